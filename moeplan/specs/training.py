"""TrainingSpec: sequence, batch, precision recipe, optimizer and learning-rate schedule.

The schedule's fields carry Megatron-LM's names (`lr_warmup_iters` is `--lr-warmup-iters`, ...)
and its meaning (`megatron.core.optimizer_param_scheduler.OptimizerParamScheduler.get_lr`), so
`moeplan run --lr-decay-style WSD ...`, the plan's `training` section and the Megatron export
say the same thing in the same words. Plans written before the rename (`warmup_steps`,
`decay_steps`, `grad_clip`) still load: those names are accepted as aliases.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from ..limits import MAX_CAPACITY_FACTOR, MAX_GLOBAL_BATCH, MAX_LR, MAX_SEQ_LEN, MAX_TRAIN_ITERS

Precision = Literal["bf16", "fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4"]
SoftwareStack = Literal["current", "mcore-2024", "megatron-2023", "megatron-2022",
                        "megatron-2021"]
PRECISIONS: tuple[str, ...] = Precision.__args__  # type: ignore[attr-defined]
STACKS: dict[str, str] = {
    "current": "Megatron Core ≥ 0.14, Transformer Engine ≥ 2.8, cuDNN ≥ 9.13.1: fused MoE "
               "router and permutation, sink attention in cuDNN, today's attention kernels",
    "mcore-2024": "Megatron Core 0.5–0.12, 2024 to mid-2025: router and permutation "
                  "unfused, older attention kernels; no EP overlap, HybridEP or NVFP4",
    "megatron-2023": "Megatron-LM 23.x, before Megatron Core 0.4: dense models, no "
                     "data-parallel overlap, context parallelism or TP comm overlap",
    "megatron-2022": "Megatron-LM of May 2022: also attention as batched GEMMs, dropout, BF16 "
                     "only, the optimizer replicated over data parallelism",
    "megatron-2021": "Megatron-LM 2021: also no sequence parallelism",
}
"""Each software stack in one line (`TrainingSpec.software_stack` says it in full), newest
first: what `--stack` offers and what an estimate says it assumes. What each stack can run
is the rules table's (`specs.rules.STACK_FEATURES`)."""


def priced_on(stack: str) -> str:
    """The sentence every estimate, search and what-if states its stack in."""
    return f"priced on the {stack} software stack ({STACKS[stack]})"
DecayStyle = Literal["constant", "linear", "cosine", "WSD"]
WsdDecayStyle = Literal["linear", "cosine", "exponential", "minus_sqrt"]
DEFAULT_DECAY_ITERS = 1000  # decay length when neither lr_decay_iters nor train_iters is set


class TrainingSpec(BaseModel):
    """What one optimizer step trains on and how: the planner keeps it fixed, layouts vary."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    seq_len: int = Field(4096, gt=0, le=MAX_SEQ_LEN, description="Tokens per sequence s.")
    global_batch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH,
                                   description="Sequences per optimizer step (gbs).")
    precision: Precision = Field("bf16", description="GEMM precision recipe.")
    lr: float = Field(3e-4, gt=0, le=MAX_LR, description="Peak learning rate (Megatron --lr).")
    min_lr: float = Field(3e-5, ge=0, le=MAX_LR, description="Learning rate at the end of the "
                          "decay (Megatron --min-lr).")
    lr_warmup_iters: int = Field(
        2, ge=0, le=MAX_TRAIN_ITERS, validation_alias=AliasChoices("lr_warmup_iters",
                                                                   "warmup_steps"),
        description="Linear warm-up iterations (Megatron --lr-warmup-iters).")
    lr_decay_style: DecayStyle = Field(
        "cosine", description="Decay after warm-up (Megatron --lr-decay-style): constant, "
        "linear, cosine, or WSD (warm-up, stable, then decay over the last "
        "lr_wsd_decay_iters).")
    lr_decay_iters: int | None = Field(
        None, gt=0, le=MAX_TRAIN_ITERS, validation_alias=AliasChoices("lr_decay_iters",
                                                                      "decay_steps"),
        description="Iteration at which the decay reaches min_lr, counted from 0 with the "
        "warm-up (Megatron --lr-decay-iters); None: train_iters, else 1000.")
    lr_wsd_decay_style: WsdDecayStyle = Field(
        "exponential", description="Shape of WSD's final decay (Megatron "
        "--lr-wsd-decay-style).")
    lr_wsd_decay_iters: int | None = Field(
        None, gt=0, le=MAX_TRAIN_ITERS, description="WSD: iterations of the final decay, "
        "ending at lr_decay_iters (Megatron --lr-wsd-decay-iters); required with WSD.")
    train_iters: int | None = Field(
        None, gt=0, le=MAX_TRAIN_ITERS, description="Iterations the whole run trains (Megatron "
        "--train-iters; `moeplan run --train-tokens T` sets it to ⌈T / tokens per step⌉); "
        "the default decay length and the step `moeplan run` reaches without --steps.")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="Adam β1.")
    adam_beta2: float = Field(0.95, gt=0, lt=1, description="Adam β2.")
    adam_eps: float = Field(1e-8, gt=0, description="Adam ε.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay (Megatron "
                                "--weight-decay).")
    clip_grad: float = Field(1.0, ge=0, validation_alias=AliasChoices("clip_grad", "grad_clip"),
                             description="Global gradient-norm clip, 0: off (Megatron "
                             "--clip-grad).")
    optimizer_moments_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Adam moment storage (bf16 saves 4 bytes/param, Megatron option)."
    )
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Data-parallel gradient reduction dtype: bf16 halves the reduce-"
        "scatter/all-reduce bytes at some precision cost (Megatron --grad-reduce-in-bf16; "
        "NVIDIA's NeMo and Megatron-Bridge performance recipes set it)."
    )
    fp8_param_gather: bool = Field(
        False, description="Keep the GEMM weights in FP8 and all-gather them in FP8 over data "
        "parallelism (Megatron --fp8-param-gather): half the parameter all-gather bytes of "
        "those weights; needs an FP8 precision recipe."
    )
    software_stack: SoftwareStack = Field(
        "current", description="The software stack the estimate assumes, by the Megatron "
        "generation that runs it; each older one lacks what the newer adds. 'current': Megatron "
        "Core ≥ 0.14 with Transformer Engine ≥ 2.8 and cuDNN ≥ 9.13.1, as NVIDIA's 2025–26 "
        "recipes run: fused MoE router (--moe-router-fusion) and permutation "
        "(--moe-permute-fusion), sink attention (gpt-oss) in cuDNN's fused kernel, and "
        "attention at the rate today's cuDNN kernels are measured at. 'mcore-2024': Megatron "
        "Core before 0.13 (2024 to mid-2025, NeMo 24.x–25.04): the router and the token "
        "permutation run as separate PyTorch kernels, sink attention falls back to unfused "
        "attention, which computes and keeps every query-key score (TE before cuDNN 9.13.1, "
        "TE issue 2318), and attention runs at the share of today's kernel rate that the "
        "published runs of that stack realised (Calibration.attn_realised). 'megatron-2023': also without "
        "overlapping the data-parallel gradient reduce-scatter and parameter all-gather with "
        "compute (Megatron-LM before --overlap-grad-reduce/--overlap-param-gather, as "
        "MegaScale's baseline ran). 'megatron-2022': also attention as batched GEMMs around a "
        "fused softmax, keeping every score, and the GPT recipes' dropout (Korthikanti et al. "
        "2022). 'megatron-2021': also no sequence parallelism: each tensor-parallel rank runs "
        "the layer norms, dropouts and residual adds over the whole sequence (Narayanan et al. "
        "2021)."
    )
    moe_aux_loss_coeff: float = Field(1e-3, ge=0, description="Load-balancing aux-loss weight.")
    mtp_loss_weight: float = Field(0.1, ge=0, description="Weight of the MTP loss.")
    moe_capacity_factor: float | None = Field(
        None, gt=0, le=MAX_CAPACITY_FACTOR, description="Expert capacity as a multiple of the even share T·k/E; copies "
        "over capacity are dropped (Megatron --moe-expert-capacity-factor). None: dropless."
    )
    moe_pad_expert_input_to_capacity: bool = Field(
        False, description="Pad each expert's input to its capacity (Megatron "
        "--moe-pad-expert-input-to-capacity; Megatron-Bridge's token-drop recipes set it with a "
        "capacity factor of 1): every shape is static, so the MoE layer needs no host sync and "
        "CUDA graphs capture all of it; needs moe_capacity_factor and the alltoall dispatcher."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainingSpec:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr: {self.min_lr} is above lr ({self.lr}); lower it")
        decay = self.decay_iters
        if self.lr_warmup_iters >= decay:
            raise ValueError(f"lr_warmup_iters: {self.lr_warmup_iters} warm-up iterations do not "
                             f"end before the decay does (lr_decay_iters {decay}); lower it or "
                             "raise lr_decay_iters / train_iters")
        if self.lr_decay_style == "WSD":
            if self.lr_wsd_decay_iters is None:
                raise ValueError("lr_wsd_decay_iters: the WSD schedule needs the length of its "
                                 "final decay; set lr_wsd_decay_iters (e.g. 10% of the run)")
            if self.lr_wsd_decay_iters > decay - self.lr_warmup_iters:
                raise ValueError(f"lr_wsd_decay_iters: {self.lr_wsd_decay_iters} is longer than "
                                 f"the {decay - self.lr_warmup_iters} iterations between warm-up "
                                 f"and lr_decay_iters ({decay}); shorten it")
        if self.moe_pad_expert_input_to_capacity and self.moe_capacity_factor is None:
            raise ValueError("moe_pad_expert_input_to_capacity: padding to capacity needs a "
                             "capacity; set moe_capacity_factor (e.g. 1.0) or turn padding off")
        if self.fp8_param_gather and not self.precision.startswith(("fp8", "mxfp8")):
            raise ValueError(f"fp8_param_gather: needs an FP8 precision recipe, not "
                             f"{self.precision}; set fp8_param_gather false or pick fp8-*/mxfp8")
        return self

    @property
    def static_moe_shapes(self) -> bool:
        """Token dropping padded to capacity: the MoE layer's shapes are fixed, so Megatron
        neither waits for the routing histogram on the host nor keeps the layer out of CUDA
        graphs ("moe cuda graph is only supported with drop-padding MoE")."""
        return self.moe_capacity_factor is not None and self.moe_pad_expert_input_to_capacity

    @property
    def fused_moe_kernels(self) -> bool:
        """Fused MoE router and permutation (software_stack 'current')."""
        return self.software_stack == "current"

    @property
    def fused_attention(self) -> bool:
        """Flash-style fused attention (cuDNN or FlashAttention through Transformer Engine);
        the 2021–22 stacks ran QKᵀ and PV as batched GEMMs around a fused softmax kernel."""
        return self.software_stack not in ("megatron-2022", "megatron-2021")

    @property
    def dropout(self) -> bool:
        """Hidden and attention dropout (0.1), as the 2021–22 GPT recipes trained."""
        return not self.fused_attention

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism (Korthikanti et al. 2022) on tensor-parallel ranks."""
        return self.software_stack != "megatron-2021"

    @property
    def current_attention_kernels(self) -> bool:
        """Attention at today's measured cuDNN rate (software_stack 'current'); older stacks at
        the share their published runs realised (`Calibration.attn_realised`)."""
        return self.software_stack == "current"

    @property
    def fused_sink_attention(self) -> bool:
        """Sink attention in cuDNN's fused kernel (software_stack 'current')."""
        return self.software_stack == "current"

    @property
    def dp_comm_overlap(self) -> bool:
        """Data-parallel gradient reduction and parameter gathers overlapped with compute."""
        return self.software_stack not in ("megatron-2023", "megatron-2022", "megatron-2021")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size

    @property
    def decay_iters(self) -> int:
        """The iteration the decay ends at: lr_decay_iters, else train_iters (Megatron's
        default), else DEFAULT_DECAY_ITERS."""
        return self.lr_decay_iters or self.train_iters or DEFAULT_DECAY_ITERS

    def lr_at(self, step: int) -> float:
        """Learning rate of step `step` (counted from 0).

        Megatron's `OptimizerParamScheduler.get_lr` at iteration count step + 1: Megatron
        steps its scheduler after the optimizer, so its first iteration trains at init_lr (0)
        and its k-th at get_lr(k − 1); moeplan starts one iteration along (lr/warm-up at step
        0) and is otherwise the same function, tested against megatron-core's.
        """
        n, warm, decay = step + 1, self.lr_warmup_iters, self.decay_iters
        if warm > 0 and n <= warm:
            return self.lr * n / warm
        if self.lr_decay_style == "constant":
            return self.lr
        if n > decay:
            return self.min_lr
        ratio = (n - warm) / (decay - warm)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable at lr, then the last lr_wsd_decay_iters decay
            wsd = self.lr_wsd_decay_iters or 1
            start = decay - wsd
            if n <= start:
                coeff = 1.0
            else:
                r = (n - start) / wsd
                coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": 2.0 * 0.5 ** r - 1.0,
                         "minus_sqrt": 1.0 - math.sqrt(r)}[self.lr_wsd_decay_style]
        return self.min_lr + coeff * (self.lr - self.min_lr)
