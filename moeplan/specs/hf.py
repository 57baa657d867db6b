"""Hugging Face `config.json` → ModelSpec, for the architectures moeplan models faithfully.

Each reader follows the layer rules of the architecture's `modeling_*.py` in transformers (which
layers are MoE, where biases and norms are), so that a preset and its config.json give identical
parameter counts.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..errors import SpecError
from .loader import build
from .model import ModelSpec

Reader = Callable[[dict[str, Any]], dict[str, Any]]


def _common(c: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_kv_heads": c.get("num_key_value_heads"),
        "head_dim": c.get("head_dim"),
        "ffn_hidden_size": c["intermediate_size"],
        "vocab_size": c["vocab_size"],
        "max_position_embeddings": c.get("max_position_embeddings"),
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "rope_theta": float(c.get("rope_theta", 10000.0)),
        "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "activation": "swiglu" if c.get("hidden_act", "silu") in ("silu", "swiglu") else "gelu",
    }


def _pattern_fields(moe: list[bool], num_layers: int) -> dict[str, Any]:
    """Express an MoE layer pattern as first_k_dense + freq when that is exact, else a list."""
    if not any(moe):
        return {"moe_layer_pattern": [0] * num_layers}
    first = moe.index(True)
    for freq in range(1, num_layers + 1):
        if [i >= first and i % freq == 0 for i in range(num_layers)] == moe:
            return {"first_k_dense": first, "moe_layer_freq": freq}
    return {"moe_layer_pattern": [int(m) for m in moe]}


def _deepseek(c: dict[str, Any], v3: bool) -> dict[str, Any]:
    """DeepseekV2/V3: MLA, routed + shared experts, layer i is MoE when i ≥ first_k_dense_replace
    and i % moe_layer_freq == 0 (modeling_deepseek_v3.py)."""
    d = _common(c)
    d.pop("num_kv_heads")
    d.pop("head_dim")
    n_layers = c["num_hidden_layers"]
    first, freq = c.get("first_k_dense_replace", 0), c.get("moe_layer_freq", 1)
    moe = [i >= first and i % freq == 0 for i in range(n_layers)]
    n_shared = c.get("n_shared_experts") or 0
    method = c.get("topk_method", "greedy")
    grouped = method in ("group_limited_greedy", "noaux_tc") and (c.get("n_group") or 1) > 1
    d.update(
        attention="mla",
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        num_experts=c["n_routed_experts"],
        moe_top_k=c["num_experts_per_tok"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        num_shared_experts=n_shared,
        shared_expert_ffn_hidden_size=n_shared * c["moe_intermediate_size"] if n_shared else None,
        router_score=c.get("scoring_func", "sigmoid" if v3 else "softmax"),
        router_expert_bias=method == "noaux_tc",
        router_num_groups=c.get("n_group") if grouped else None,
        router_groups_per_token=c.get("topk_group") if grouped else None,
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(c.get("norm_topk_prob", v3)),
        mtp_layers=c.get("num_nextn_predict_layers", 0) if v3 else 0,
        **_pattern_fields(moe, n_layers),
    )
    return d


def _qwen_moe(c: dict[str, Any], qwen3: bool) -> dict[str, Any]:
    """Qwen2Moe/Qwen3Moe: layer i is MoE when i ∉ mlp_only_layers and (i+1) % decoder_sparse_step
    == 0 (modeling_qwen3_moe.py); Qwen2Moe adds a sigmoid-gated shared expert and QKV bias."""
    d = _common(c)
    n_layers = c["num_hidden_layers"]
    step, dense_only = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    moe = [i not in dense_only and (i + 1) % step == 0 for i in range(n_layers)]
    d.update(
        num_experts=c["num_experts"],
        moe_top_k=c["num_experts_per_tok"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        **_pattern_fields(moe, n_layers),
    )
    if qwen3:
        d["qk_norm"] = True
        d["qkv_bias"] = bool(c.get("attention_bias", False))
    else:
        d["qkv_bias"] = True
        shared = c.get("shared_expert_intermediate_size") or 0
        if shared:
            d.update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared,
                     shared_expert_gate=True)
    return d


def _mixtral(c: dict[str, Any]) -> dict[str, Any]:
    d = _common(c)
    d.update(num_experts=c["num_local_experts"], moe_top_k=c["num_experts_per_tok"],
             moe_ffn_hidden_size=c["intermediate_size"], norm_topk_prob=True)
    return d


def _llama(c: dict[str, Any]) -> dict[str, Any]:
    d = _common(c)
    bias = bool(c.get("attention_bias", False))
    d.update(qkv_bias=bias, attn_out_bias=bias, mlp_bias=bool(c.get("mlp_bias", False)))
    return d


def _qwen2(c: dict[str, Any]) -> dict[str, Any]:
    d = _common(c)
    d["qkv_bias"] = True
    return d


def _qwen3(c: dict[str, Any]) -> dict[str, Any]:
    d = _common(c)
    d.update(qk_norm=True, qkv_bias=bool(c.get("attention_bias", False)),
             attn_out_bias=bool(c.get("attention_bias", False)))
    return d


def _gpt_oss(c: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: alternating sliding/full attention from `layer_types`, sinks, biases everywhere."""
    d = _common(c)
    kinds = ["S" if t == "sliding_attention" else "F" for t in c.get("layer_types", [])]
    pattern = "".join(kinds) or None
    if pattern:  # shortest period that tiles the list
        for n in range(1, len(pattern) + 1):
            if all(pattern[i] == pattern[i % n] for i in range(len(pattern))):
                pattern = pattern[:n]
                break
    bias = bool(c.get("attention_bias", True))
    d.update(qkv_bias=bias, attn_out_bias=bias, attention_sinks=True, mlp_bias=True,
             sliding_window=c.get("sliding_window"), attention_pattern=pattern,
             num_experts=c["num_local_experts"], moe_top_k=c.get("num_experts_per_tok", 4),
             moe_ffn_hidden_size=c["intermediate_size"], router_bias=True, norm_topk_prob=True)
    return d


READERS: dict[str, Reader] = {
    "DeepseekV3ForCausalLM": lambda c: _deepseek(c, v3=True),
    "DeepseekV2ForCausalLM": lambda c: _deepseek(c, v3=False),
    "Qwen3MoeForCausalLM": lambda c: _qwen_moe(c, qwen3=True),
    "Qwen2MoeForCausalLM": lambda c: _qwen_moe(c, qwen3=False),
    "MixtralForCausalLM": _mixtral,
    "LlamaForCausalLM": _llama,
    "Qwen3ForCausalLM": _qwen3,
    "Qwen2ForCausalLM": _qwen2,
    "GptOssForCausalLM": _gpt_oss,
}
MODEL_TYPES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def model_from_hf_config(config: dict[str, Any], source: str, name: str = "hf") -> ModelSpec:
    """Map a Hugging Face config onto a ModelSpec; unknown architectures are refused (exit 2)."""
    archs = list(config.get("architectures") or [])
    arch = next((a for a in archs if a in READERS), None)
    if arch is None:
        arch = MODEL_TYPES.get(str(config.get("model_type")))
    if arch is None:
        got = ", ".join(archs) or f"model_type '{config.get('model_type')}'"
        raise SpecError(f"{source}: Hugging Face architecture {got} is not supported. Supported: "
                        f"{', '.join(READERS)}. Write a ModelSpec YAML for other models "
                        "(see `moeplan specs show deepseek-v3 --json` for the fields).")
    try:
        fields = READERS[arch](config)
    except KeyError as err:
        raise SpecError(f"{source}: the {arch} config lacks the field {err.args[0]!r}, which "
                        "moeplan needs; add it from the model's published config.json.") from None
    fields = {k: v for k, v in fields.items() if v is not None}
    spec = build(ModelSpec, {"name": _hf_name(config, name) or "hf", **fields}, "model spec",
                 source)
    if _hf_name(config, name) is None:  # no name anywhere: say what it is, e.g. qwen3_moe-30.5b
        kind = str(config.get("model_type") or arch.removesuffix("ForCausalLM"))
        spec = spec.model_copy(update={"name": _safe(f"{kind}-{spec.total_params() / 1e9:.3g}b")})
    return spec


def _safe(text: str) -> str:
    """A name fit for titles, job names and file names: letters, digits, `._-`, ≤ 64."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:64]


def _hf_name(config: dict[str, Any], stem: str) -> str | None:
    """The model's own name: `_name_or_path`'s last part (`Qwen/Qwen3-30B-A3B` →
    `Qwen3-30B-A3B`), else the file's stem unless it is the generic `config`."""
    ref = config.get("_name_or_path")
    if isinstance(ref, str) and _safe(ref.rstrip("/").rsplit("/", 1)[-1]):
        return _safe(ref.rstrip("/").rsplit("/", 1)[-1])
    return _safe(stem) if stem and stem not in ("config", "hf") and _safe(stem) else None
