"""The module names a plan recomputes or offloads, Megatron's own (`--recompute-modules`,
`--offload-modules`): one list the layout's choices and the executors' rules both read."""

from __future__ import annotations

from typing import Literal

RecomputeModule = Literal[
    "core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "full"
]
OffloadModule = Literal[
    "attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"
]
RECOMPUTE_MODULES: tuple[str, ...] = RecomputeModule.__args__  # type: ignore[attr-defined]
OFFLOAD_MODULES: tuple[str, ...] = OffloadModule.__args__  # type: ignore[attr-defined]
