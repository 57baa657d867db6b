"""TrainingSpec: sequence, batch, precision recipe and optimizer settings."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..limits import MAX_GLOBAL_BATCH, MAX_SEQ_LEN

Precision = Literal["bf16", "fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4"]
SoftwareStack = Literal["current", "mcore-2024", "megatron-2023", "megatron-2022",
                        "megatron-2021"]
PRECISIONS: tuple[str, ...] = Precision.__args__  # type: ignore[attr-defined]


class TrainingSpec(BaseModel):
    """What one optimizer step trains on and how: the planner keeps it fixed, layouts vary."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    seq_len: int = Field(4096, gt=0, le=MAX_SEQ_LEN, description="Tokens per sequence s.")
    global_batch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH,
                                   description="Sequences per optimizer step (gbs).")
    precision: Precision = Field("bf16", description="GEMM precision recipe.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    min_lr: float = Field(3e-5, ge=0, description="Final learning rate of the cosine decay.")
    warmup_steps: int = Field(2, ge=0, description="Linear warm-up steps.")
    decay_steps: int = Field(1000, gt=0, description="Cosine decay length in steps.")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="Adam β1.")
    adam_beta2: float = Field(0.95, gt=0, lt=1, description="Adam β2.")
    adam_eps: float = Field(1e-8, gt=0, description="Adam ε.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip (0: off).")
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
        "(--moe-permute-fusion), sink attention (gpt-oss) in cuDNN's fused kernel. 'mcore-2024': "
        "without those: the router and the token permutation run as separate PyTorch kernels, "
        "and sink attention falls back to unfused attention, which computes and keeps every "
        "query-key score (TE before cuDNN 9.13.1, TE issue 2318). 'megatron-2023': also without "
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
        None, gt=0, description="Expert capacity as a multiple of the even share T·k/E; copies "
        "over capacity are dropped (Megatron --moe-expert-capacity-factor). None: dropless."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainingSpec:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr: {self.min_lr} is above lr ({self.lr}); lower it")
        if self.fp8_param_gather and not self.precision.startswith(("fp8", "mxfp8")):
            raise ValueError(f"fp8_param_gather: needs an FP8 precision recipe, not "
                             f"{self.precision}; set fp8_param_gather false or pick fp8-*/mxfp8")
        return self

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
