"""ModelSpec: one validated description of a decoder-only dense or MoE transformer.

It holds everything the runtime needs to build exactly this model and everything the cost models
need to price it. Derived quantities (parameter counts, model FLOPs) are methods so that the
planner, the cost models and the runtime's TFLOPS counter all use one definition.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..limits import (
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_MTP_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
)
from .validated import printable_name

Activation = Literal["swiglu", "geglu", "geglu_tanh", "gelu", "squared_relu"]
GATED = ("swiglu", "geglu", "geglu_tanh")


class RopeScaling(BaseModel):
    """RoPE frequency scaling for long context, as Hugging Face's `rope_parameters` names it.

    The scaled inverse frequencies follow transformers' `modeling_rope_utils.py` (linear: Chen et
    al. 2023; dynamic NTK; yarn: Peng et al. 2023; llama3: Llama 3.1; longrope: Ding et al.
    2024). Scaling changes the angles and (yarn, longrope) a constant factor on cos/sin, never
    the FLOPs or the parameters.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: Literal["linear", "dynamic", "yarn", "llama3", "longrope"] = Field(
        description="HF rope_type.")
    factor: float | None = Field(None, gt=0, description="Context extension factor s.")
    original_max_position_embeddings: int | None = Field(
        None, gt=0, description="Pre-training context (dynamic: the HF max_position_embeddings).")
    max_position_embeddings: int | None = Field(
        None, gt=0, description="Extended context (yarn/longrope default factor = max / original).")
    beta_fast: float = Field(32.0, gt=0, description="yarn: extrapolation boundary (rotations).")
    beta_slow: float = Field(1.0, gt=0, description="yarn: interpolation boundary (rotations).")
    mscale: float | None = Field(None, description="yarn: attention-factor numerator scale.")
    mscale_all_dim: float | None = Field(
        None, description="yarn: denominator scale; with MLA also the softmax scale (mscale²).")
    attention_factor: float | None = Field(
        None, gt=0, description="Factor on cos/sin (None: derived from factor/mscale).")
    truncate: bool = Field(True, description="yarn: round the correction range to integers.")
    low_freq_factor: float | None = Field(None, gt=0, description="llama3: low-frequency bound.")
    high_freq_factor: float | None = Field(None, gt=0, description="llama3: high-frequency bound.")
    short_factor: list[float] | None = Field(None, description="longrope: per-pair factors.")
    long_factor: list[float] | None = Field(
        None, description="longrope: per-pair factors beyond the original context.")

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        need = {"linear": ("factor",), "dynamic": ("factor", "original_max_position_embeddings"),
                "yarn": ("original_max_position_embeddings",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
        for f in need[self.kind]:
            if getattr(self, f) is None:
                raise ValueError(f"rope_scaling.{f}: {self.kind} RoPE scaling needs it")
        if self.kind == "yarn" and self.factor is None and self.max_position_embeddings is None:
            raise ValueError("rope_scaling.factor: yarn needs a factor (or max_position_embeddings)")
        if self.kind == "llama3" and self.low_freq_factor == self.high_freq_factor:
            raise ValueError("rope_scaling.high_freq_factor: must differ from low_freq_factor")
        return self

    def yarn_factor(self) -> float:
        return self.factor or (self.max_position_embeddings  # type: ignore[operator]
                               / self.original_max_position_embeddings)

    def yarn_attention_factor(self) -> float:
        """yarn's constant factor on cos/sin (transformers' `attention_factor`, Megatron's
        "concentration factor"): given, or get_mscale(s, mscale) / get_mscale(s, mscale_all_dim)
        when both scales are set (DeepSeek-V3: 1), else get_mscale(s) = 0.1·ln s + 1 (gpt-oss:
        1.347 at s = 32)."""
        if self.attention_factor is not None:
            return self.attention_factor
        s = self.yarn_factor()

        def get_mscale(m: float = 1.0) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.mscale) / get_mscale(self.mscale_all_dim)
        return get_mscale()


class ModelSpec(BaseModel):
    """A decoder-only transformer, dense or Mixture-of-Experts, GQA or MLA attention."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field("custom", max_length=200,
                      description="Human-readable name (preset name or file stem).")
    num_layers: int = Field(gt=0, le=MAX_LAYERS,
                            description="Decoder layers, MTP modules not included.")
    hidden_size: int = Field(gt=0, le=MAX_HIDDEN, description="Model width h.")
    num_attention_heads: int = Field(gt=0, le=MAX_HEADS, description="Query heads a.")
    num_kv_heads: int | None = Field(
        None, gt=0, le=MAX_HEADS,
        description="KV heads g for GQA (None: equal to the query heads, MHA)."
    )
    head_dim: int | None = Field(
        None, gt=0, le=MAX_HIDDEN,
        description="Per-head dim d for GQA/MHA (None: hidden_size / heads)."
    )
    attention: Literal["gqa", "mla"] = Field("gqa", description="GQA/MHA or DeepSeek MLA.")
    q_lora_rank: int | None = Field(None, gt=0, le=MAX_HIDDEN,
                                    description="MLA query down-projection rank.")
    kv_lora_rank: int | None = Field(None, gt=0, le=MAX_HIDDEN,
                                     description="MLA KV down-projection rank.")
    qk_nope_head_dim: int | None = Field(None, gt=0, le=MAX_HIDDEN,
                                         description="MLA non-rotary q/k head dim.")
    qk_rope_head_dim: int | None = Field(None, gt=0, le=MAX_HIDDEN,
                                         description="MLA rotary q/k head dim.")
    v_head_dim: int | None = Field(None, gt=0, le=MAX_HIDDEN, description="MLA value head dim.")
    qkv_bias: bool = Field(False, description="Bias on the Q, K, V projections (Qwen2, gpt-oss); "
                           "with MLA on the q and kv down-projections (DeepSeek attention_bias).")
    attn_out_bias: bool = Field(False, description="Bias on the attention output projection.")
    qk_norm: bool = Field(False, description="RMSNorm on per-head q and k (Qwen3).")
    attention_sinks: bool = Field(False, description="Learned per-head attention sink (gpt-oss).")
    sliding_window: int | None = Field(
        None, gt=0, le=MAX_POSITIONS,
        description="Sliding-window size in tokens for the layers the pattern marks."
    )
    attention_pattern: str | None = Field(
        None, max_length=MAX_LAYERS,
        description="Per-layer attention kind tiled over the layers: 'S' sliding window, 'F' full "
        "(e.g. 'SF' alternates, starting with sliding). None: all full.",
    )

    ffn_hidden_size: int = Field(gt=0, le=MAX_FFN, description="Dense MLP intermediate size f.")
    activation: Activation = Field("swiglu", description="MLP activation.")
    mlp_bias: bool = Field(False, description="Bias on MLP and expert linears (GPT-3, gpt-oss).")
    vocab_size: int = Field(gt=0, le=MAX_VOCAB, description="Vocabulary size V.")
    tie_embeddings: bool = Field(False, description="Output layer shares the embedding weights.")
    position_embedding: Literal["rope", "learned"] = Field("rope", description="Positions.")
    max_position_embeddings: int | None = Field(
        None, gt=0, le=MAX_POSITIONS,
        description="Positions the model is built for: rows of the learned table, or a RoPE "
        "model's context length (HF max_position_embeddings; exported to Megatron)."
    )
    normalization: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="Norm kind.")
    rope_theta: float = Field(10000.0, gt=0, allow_inf_nan=False, description="RoPE base θ.")
    rope_scaling: RopeScaling | None = Field(
        None, description="RoPE frequency scaling (yarn, llama3, ...); None: plain RoPE.")
    rotary_percent: float = Field(
        1.0, gt=0, le=1, allow_inf_nan=False,
        description="Share of each GQA q/k head's dims that RoPE rotates, the leading ones (HF "
        "partial_rotary_factor, Megatron --rotary-percent; GLM-4.5: 0.5).")
    norm_eps: float = Field(1e-6, gt=0, description="Norm epsilon.")

    num_experts: int = Field(0, ge=0, le=MAX_EXPERTS,
                             description="Routed experts E per MoE layer (0: dense).")
    moe_top_k: int = Field(0, ge=0, le=MAX_EXPERTS, description="Experts each token is routed to.")
    moe_ffn_hidden_size: int | None = Field(None, gt=0, le=MAX_FFN,
                                            description="Expert intermediate size.")
    num_shared_experts: int = Field(0, ge=0, le=MAX_EXPERTS,
                                    description="Shared experts per MoE layer.")
    shared_expert_ffn_hidden_size: int | None = Field(
        None, gt=0, le=MAX_FFN,
        description="Total intermediate size of all shared experts together."
    )
    shared_expert_gate: bool = Field(False, description="Sigmoid gate on the shared expert.")
    first_k_dense: int = Field(0, ge=0, le=MAX_LAYERS,
                               description="Leading layers with a dense MLP.")
    moe_layer_freq: int = Field(1, gt=0, le=MAX_LAYERS,
                                description="Every n-th layer (after first_k_dense) is MoE.")
    moe_layer_pattern: list[int] | None = Field(
        None, description="Explicit 0/1 per layer (1 = MoE); overrides first_k_dense and freq."
    )
    router_score: Literal["softmax", "sigmoid"] = Field("softmax", description="Router scores.")
    router_bias: bool = Field(False, description="Learned bias on router logits (gpt-oss).")
    router_expert_bias: bool = Field(
        False, description="Aux-loss-free load-balancing bias on expert selection (DeepSeek-V3)."
    )
    router_num_groups: int | None = Field(None, gt=0, le=MAX_EXPERTS,
                                          description="Group-limited routing groups.")
    router_groups_per_token: int | None = Field(
        None, gt=0, le=MAX_EXPERTS,
        description="Groups a token may route into (group-limited routing)."
    )
    routed_scaling_factor: float = Field(1.0, gt=0, description="Scale on routed expert output.")
    norm_topk_prob: bool = Field(True, description="Renormalise the top-k probabilities.")
    mtp_layers: int = Field(0, ge=0, le=MAX_MTP_LAYERS,
                            description="Multi-token-prediction modules (DeepSeek-V3).")
    moe_aux_loss_coeff: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="The source model's own load-balancing loss coefficient (HF "
        "router_aux_loss_coef); a run uses it unless its training spec sets one.")

    # ------------------------------------------------------------------ validation
    @field_validator("name")
    @classmethod
    def _printable(cls, value: str) -> str:
        return printable_name(value)

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        def fail(field: str, msg: str) -> None:
            raise ValueError(f"{field}: {msg}")

        if self.attention == "mla":
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, f) is None:
                    fail(f, "MLA attention needs it; set it or use attention: gqa")
        else:
            g = self.kv_heads
            if self.num_attention_heads % g:
                fail("num_kv_heads", f"{self.num_attention_heads} query heads are not a multiple "
                     f"of {g} KV heads; pick a divisor of num_attention_heads")
            if self.head_dim is None and self.hidden_size % self.num_attention_heads:
                fail("head_dim", f"hidden_size {self.hidden_size} is not divisible by "
                     f"{self.num_attention_heads} heads; set head_dim explicitly")
        if self.num_experts:
            if not 1 <= self.moe_top_k <= self.num_experts:
                fail("moe_top_k", f"must be between 1 and num_experts ({self.num_experts})")
            if self.moe_ffn_hidden_size is None:
                fail("moe_ffn_hidden_size", "an MoE model needs the expert intermediate size")
            if self.router_num_groups is not None:
                if self.num_experts % self.router_num_groups:
                    fail("router_num_groups", f"must divide num_experts ({self.num_experts})")
                gpt = self.router_groups_per_token or self.router_num_groups
                if not 1 <= gpt <= self.router_num_groups:
                    fail("router_groups_per_token", "must be between 1 and router_num_groups")
                if gpt * (self.num_experts // self.router_num_groups) < self.moe_top_k:
                    fail("router_groups_per_token", "the allowed groups hold fewer experts "
                         "than moe_top_k; raise it")
        elif self.moe_top_k or self.num_shared_experts:
            fail("num_experts", "moe_top_k/num_shared_experts need num_experts > 0")
        if self.num_shared_experts and self.shared_expert_ffn_hidden_size is None:
            fail("shared_expert_ffn_hidden_size", "needed when num_shared_experts > 0")
        if self.first_k_dense > self.num_layers:
            fail("first_k_dense", f"exceeds num_layers ({self.num_layers})")
        if self.moe_layer_pattern is not None:
            if len(self.moe_layer_pattern) != self.num_layers:
                fail("moe_layer_pattern", f"needs one 0/1 entry per layer ({self.num_layers})")
            if any(v not in (0, 1) for v in self.moe_layer_pattern):
                fail("moe_layer_pattern", "entries must be 0 (dense) or 1 (MoE)")
        if self.attention_pattern is not None:
            if not self.attention_pattern or set(self.attention_pattern) - {"S", "F"}:
                fail("attention_pattern", "use only the letters S (sliding) and F (full)")
            if "S" in self.attention_pattern and self.sliding_window is None:
                fail("sliding_window", "the attention pattern has sliding layers; set the window")
        if self.rotary_percent != 1.0:
            if self.attention == "mla":
                fail("rotary_percent", "MLA rotates its own qk_rope_head_dim; leave it at 1")
            rotary = self.rotary_dim  # int(head_dim · share), as transformers and Megatron
            if rotary < 2 or rotary % 2:
                fail("rotary_percent", f"{self.rotary_percent} of head_dim {self.head_dim_} "
                     f"rotates {rotary} dims; RoPE rotates an even number of them, at least 2")
        if self.position_embedding == "learned" and self.max_position_embeddings is None:
            fail("max_position_embeddings", "learned positions need the table size")
        return self

    # ------------------------------------------------------------------ shapes
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_dim_(self) -> int:
        """Per-head dim for GQA (MLA has separate q/k and v dims)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each q/k head that RoPE rotates: MLA's rope dims, else the leading
        rotary_percent of the head, rounded down."""
        if self.attention == "mla":
            return self.qk_rope_head_dim or 0
        # transformers' int(head_dim * partial_rotary_factor), Megatron's int(dim * percent)
        return int(self.head_dim_ * self.rotary_percent)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    def softmax_scale_factor(self) -> float:
        """Factor on 1/√d in attention: yarn's mscale² for MLA (DeepSeek-V2/V3 `yarn_get_mscale`
        with mscale_all_dim, as transformers' DeepseekV3Attention applies it), else 1."""
        r = self.rope_scaling
        if self.attention != "mla" or r is None or r.kind != "yarn" or not r.mscale_all_dim:
            return 1.0
        s = r.yarn_factor()
        m = 1.0 if s <= 1 else 0.1 * r.mscale_all_dim * math.log(s) + 1.0
        return m * m

    def moe_layers(self) -> list[bool]:
        """Which decoder layers carry an MoE block (Megatron's --moe-layer-freq semantics)."""
        pattern = tuple(self.moe_layer_pattern) if self.moe_layer_pattern is not None else None
        return list(_moe_pattern(self.num_layers, self.is_moe, pattern, self.first_k_dense,
                                 self.moe_layer_freq))

    def sliding_layers(self) -> list[bool]:
        """Which layers use sliding-window attention (pattern tiled over the layers)."""
        return list(_sliding_pattern(self.num_layers, self.attention_pattern,
                                     self.sliding_window is not None))

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers())

    # ------------------------------------------------------------------ parameters
    def _norm_params(self, width: int) -> int:
        return width * (2 if self.normalization == "layernorm" else 1)

    def attention_params(self) -> int:
        """Parameters of one attention block (projections, biases, q/k norms, sinks), no norm."""
        h, a = self.hidden_size, self.num_attention_heads
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim  # type: ignore[operator]
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * a * qk
            else:
                q = h * a * qk
            kvr = self.kv_lora_rank
            kv = h * (kvr + self.qk_rope_head_dim) + kvr  # down-proj + kv norm
            kv += kvr * a * (self.qk_nope_head_dim + self.v_head_dim)  # up-proj
            o = a * self.v_head_dim * h  # type: ignore[operator]
            if self.qkv_bias:  # biases on the down-projections (HF q_a_proj, kv_a_proj_with_mqa)
                q += self.q_lora_rank or 0
                kv += kvr + self.qk_rope_head_dim
            return q + kv + o + (h if self.attn_out_bias else 0)
        d, g = self.head_dim_, self.kv_heads
        n = h * a * d + 2 * h * g * d + a * d * h
        if self.qkv_bias:
            n += (a + 2 * g) * d
        if self.attn_out_bias:
            n += h
        if self.qk_norm:
            n += 2 * d
        if self.attention_sinks:
            n += a
        return n

    def _mlp_params(self, ffn: int) -> int:
        h = self.hidden_size
        mats = 3 if self.gated else 2
        n = mats * h * ffn
        if self.mlp_bias:
            n += (2 * ffn if self.gated else ffn) + h
        return n

    def dense_mlp_params(self) -> int:
        return self._mlp_params(self.ffn_hidden_size)

    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return self._mlp_params(self.moe_ffn_hidden_size or 0)

    def shared_expert_params(self) -> int:
        if not self.num_shared_experts:
            return 0
        n = self._mlp_params(self.shared_expert_ffn_hidden_size or 0)
        return n + (self.hidden_size if self.shared_expert_gate else 0)

    def router_params(self) -> int:
        return self.num_experts * self.hidden_size + (self.num_experts if self.router_bias else 0)

    def layer_params(self, moe: bool, active: bool = False) -> int:
        """One decoder layer: two norms, attention, and a dense MLP or an MoE block."""
        n = 2 * self._norm_params(self.hidden_size) + self.attention_params()
        if not moe:
            return n + self.dense_mlp_params()
        experts = self.moe_top_k if active else self.num_experts
        return n + self.router_params() + experts * self.expert_params() + (
            self.shared_expert_params()
        )

    def embedding_params(self) -> int:
        n = self.vocab_size * self.hidden_size
        if self.position_embedding == "learned":
            n += (self.max_position_embeddings or 0) * self.hidden_size
        return n

    def output_params(self) -> int:
        """Final norm plus the output layer (zero extra when tied to the embedding)."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        return self._norm_params(self.hidden_size) + head

    def mtp_params(self) -> int:
        """All MTP modules: two norms, the 2h→h projection, one layer, a final norm each.

        Embedding and output head are shared with the main model (DeepSeek-V3 §2.2).
        """
        if not self.mtp_layers:
            return 0
        h = self.hidden_size
        last_moe = self.moe_layers()[-1]
        per = 3 * self._norm_params(h) + 2 * h * h + self.layer_params(last_moe)
        return self.mtp_layers * per

    def _params(self, active: bool) -> int:
        body = sum(self.layer_params(m, active) for m in self.moe_layers())
        return self.embedding_params() + body + self.output_params()

    def total_params(self) -> int:
        """All parameters, MTP modules excluded (the convention of published model sizes)."""
        return self._params(active=False)

    def bound_params(self) -> tuple[float, float]:
        """(dense, routed-expert) parameters, MTP counted as dense: what
        `cost_models.estimate.lower_bound` spreads over a layout's shards."""
        experts = self.num_moe_layers * self.num_experts * self.expert_params()
        return self.total_params() - experts + self.mtp_params(), experts

    def active_params(self) -> int:
        """Parameters a token touches: routed experts counted top-k times, MTP excluded."""
        return self._params(active=True)

    # ------------------------------------------------------------------ FLOPs
    def flops_per_token(self, seq_len: int = 4096) -> float:
        """Model FLOPs of forward + backward per token, Megatron-LM's current convention.

        Megatron-LM `training.py::num_floating_point_operations`: every GEMM counted 3× (forward,
        dgrad, wgrad) at 2 FLOPs per multiply-add; causal attention halved; logits included once
        per output head (1 + MTP); MTP layers counted as extra layers of the last layer's kind plus
        their norms and 2h→h projection; router and norms not counted; recompute not counted.
        """
        h, a, s = self.hidden_size, self.num_attention_heads, seq_len
        moe = self.moe_layers()
        n_moe, n_dense = sum(moe), self.num_layers - sum(moe)
        mtp = self.mtp_layers
        if mtp:
            n_moe += mtp * int(moe[-1])
            n_dense += mtp * int(not moe[-1])
        n_layers = self.num_layers + mtp
        glu = 1.5 if self.gated else 1.0
        mlp = 12 * h * (
            self.ffn_hidden_size * glu * n_dense
            + (self.moe_ffn_hidden_size or 0) * self.moe_top_k * glu * n_moe
            + (self.shared_expert_ffn_hidden_size or 0) * glu * n_moe
            * (1 if self.num_shared_experts else 0)
        )
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim  # type: ignore[operator]
            q_term = self.q_lora_rank * (h + a * qk + 1) if self.q_lora_rank else h * a * qk
            kvr = self.kv_lora_rank or 0
            attn = 6 * n_layers * (
                q_term
                + kvr * (h + a * (self.qk_nope_head_dim + self.v_head_dim) + 1)
                + h * self.qk_rope_head_dim
                + a * self.v_head_dim * h
                + s * a * qk / 2
                + s * a * self.v_head_dim / 2
            )
        else:
            qproj = self.head_dim_ * a
            attn = 12 * n_layers * h * qproj * (1 + self.kv_heads / a + s / h / 2)
        mtp_extra = 6 * mtp * (3 * h + 2 * h * h)
        logits = 6 * h * self.vocab_size * (mtp + 1)
        return float(mlp + attn + mtp_extra + logits)


# The layer patterns are asked for once per layer cost a search builds (thousands of times per
# search); they depend on a few fields only, so they are computed once per distinct value.
@functools.lru_cache(maxsize=256)
def _moe_pattern(num_layers: int, is_moe: bool, pattern: tuple[int, ...] | None,
                 first_k_dense: int, freq: int) -> tuple[bool, ...]:
    if not is_moe:
        return (False,) * num_layers
    if pattern is not None:
        return tuple(bool(v) for v in pattern)
    return tuple(i >= first_k_dense and i % freq == 0 for i in range(num_layers))


@functools.lru_cache(maxsize=256)
def _sliding_pattern(num_layers: int, pattern: str | None, has_window: bool
                     ) -> tuple[bool, ...]:
    if not pattern or not has_window:
        return (False,) * num_layers
    return tuple(pattern[i % len(pattern)] == "S" for i in range(num_layers))
