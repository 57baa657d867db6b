"""Hugging Face `config.json` → ModelSpec that computes what transformers computes.

Each reader follows the architecture's `modeling_*.py` and `configuration_*.py` in transformers
(v4 and v5 key names): which layers are MoE, where biases and norms are, how the router
normalises, RoPE θ and scaling (`rope_scaling` in v4, `rope_parameters` in v5), and the
configuration class's own default for every field a config.json leaves out (Mixtral θ 1e6 and
ε 1e-5, Qwen3 head_dim 128, ...). So a preset and its config.json give identical counts, and a
checkpoint loaded with `--init-from` gives transformers' loss.

Nothing is dropped silently: every config field the reader does not use, and every value it
cannot honour, is logged as one warning (logger `moeplan.hf`, printed to stderr).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from typing import Any

from ..errors import SpecError
from .model import ModelSpec
from .validated import build

log = logging.getLogger("moeplan.hf")

# Fields that describe the file, tokenizer or inference, never the function trained.
METADATA = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "_name_or_path", "name_or_path", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
    "initializer_range", "output_router_logits", "output_attentions", "output_hidden_states",
    "return_dict", "tokenizer_class", "auto_map", "pretraining_tp", "max_position_embeddings",
    "ep_size", "is_decoder", "use_return_dict", "_attn_implementation",
    "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "task_specific_params",
})
HIDDEN_ACT = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu",
              "gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh"}
# Fields where transformers reads an explicit null as "none" (not as the class default).
NULLABLE = frozenset({"q_lora_rank", "head_dim", "num_key_value_heads", "sliding_window",
                      "n_group", "topk_group"})
_REQUIRED = object()
_SHOWN = 60  # characters of a bad value quoted in a message


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= _SHOWN else s[:_SHOWN] + "…"


class Config:
    """A config.json with typed reads: each read records the key (for the unused-field
    warning) and refuses a value of the wrong type with a SpecError naming the field."""

    def __init__(self, data: dict[str, Any], source: str, arch: str):
        self.data, self.source, self.arch = data, source, arch
        self.used: set[str] = set(METADATA)
        self.notes: list[str] = []

    def has(self, key: str) -> bool:
        self.used.add(key)
        return self.data.get(key) is not None

    def get(self, key: str, kind: type | str, default: Any = _REQUIRED) -> Any:
        """The value of `key` as `kind` (int, float, bool, str, dict, "ints", "floats"); a
        missing or null value gives `default` (HF's class default), or is refused if none;
        a null NULLABLE field gives None."""
        self.used.add(key)
        v = self.data.get(key)
        if v is None and key in NULLABLE and key in self.data:
            return None  # an explicit null is meaningful here (e.g. no q LoRA)
        if v is None:
            if default is _REQUIRED:
                raise SpecError(f"{self.source}: the {self.arch} config lacks the field {key!r}, "
                                "which moeplan needs; add it from the model's published "
                                "config.json.")
            return default
        return check_type(v, kind, key, f"{self.source}: {self.arch} config")

    def note(self, text: str) -> None:
        self.notes.append(text)


def check_type(v: Any, kind: type | str, key: str, where: str) -> Any:
    """`v` checked to be `kind`; a SpecError naming `key`, the value and the expected type."""
    ok: bool
    if kind is bool:
        ok = isinstance(v, bool)
    elif kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    elif kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        v = float(v) if ok else v
    elif kind == "ints":
        ok = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                         for x in v)
    elif kind == "floats":
        ok = isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                         and math.isfinite(x) for x in v)
    elif kind == "strs":
        ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
    else:
        ok = isinstance(v, kind)  # type: ignore[arg-type]
    if not ok:
        name = {"ints": "a list of integers", "floats": "a list of finite numbers",
                "strs": "a list of strings", int: "an integer", float: "a finite number",
                bool: "true or false", str: "a string", dict: "a mapping"}[kind]
        raise SpecError(f"{where}: field {key!r} must be {name}, got {_show(v)}. Fix it in "
                        "config.json (the model's published config has the right value).")
    return v


# ------------------------------------------------------------------------------------ RoPE
def _rope(c: Config, default_theta: float, rotary: float | None = None) -> dict[str, Any]:
    """θ and scaling from v5 `rope_parameters` or v4 `rope_theta` + `rope_scaling`, and the
    share of each head RoPE rotates (`partial_rotary_factor`, in rope_parameters or, as the
    hub's v4 configs write it, at the top level), which only an architecture whose attention
    slices q and k before rotating takes: `rotary` is its default share (None: it has none)."""
    params = c.get("rope_parameters", dict, {})
    if "rope_theta" in params:
        theta = check_type(params["rope_theta"], float, "rope_parameters.rope_theta",
                           c.source)
        c.used.add("rope_theta")
    else:
        theta = c.get("rope_theta", float, default_theta)
    scaling = dict(params)
    if c.has("rope_scaling"):
        scaling = {**c.get("rope_scaling", dict), **{k: v for k, v in params.items()
                                                      if k == "rope_theta"}}
    factor = _rotary_share(c, scaling, rotary)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    check_type(kind, str, "rope_parameters.rope_type", c.source)
    out: dict[str, Any] = {"rope_theta": theta}
    if factor != 1.0:
        out["rotary_percent"] = factor
    if kind == "default":
        extra = set(scaling) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
        if extra:
            c.note(f"rope_parameters fields {sorted(extra)} are unused with rope_type default")
        return out
    if kind not in ("linear", "dynamic", "yarn", "llama3", "longrope"):
        raise SpecError(f"{c.source}: RoPE scaling rope_type {_show(kind)} is not supported; "
                        "moeplan runs linear, dynamic, yarn, llama3 and longrope. Remove "
                        "rope_scaling / rope_parameters or pick one of these.")
    known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
             "truncate", "low_freq_factor", "high_freq_factor", "short_factor", "long_factor",
             "partial_rotary_factor"}
    if set(scaling) - known:
        c.note(f"rope_parameters fields {sorted(set(scaling) - known)} are not used")
    max_pos = c.get("max_position_embeddings", int, None)
    rs: dict[str, Any] = {"kind": kind, "max_position_embeddings": max_pos}
    for key, typ in (("factor", float), ("original_max_position_embeddings", int),
                     ("beta_fast", float), ("beta_slow", float), ("mscale", float),
                     ("mscale_all_dim", float), ("attention_factor", float), ("truncate", bool),
                     ("low_freq_factor", float), ("high_freq_factor", float),
                     ("short_factor", "floats"), ("long_factor", "floats")):
        if scaling.get(key) is not None:
            rs[key] = check_type(scaling[key], typ, f"rope_parameters.{key}", c.source)
    if kind == "dynamic":  # transformers scales against the config's max_position_embeddings
        rs["original_max_position_embeddings"] = max_pos
    if kind == "yarn" and "original_max_position_embeddings" not in rs:
        rs["original_max_position_embeddings"] = max_pos
    out["rope_scaling"] = rs
    return out


def _rotary_share(c: Config, scaling: dict[str, Any], rotary: float | None) -> float:
    """`partial_rotary_factor` where transformers reads it: in the RoPE parameters (v5
    `rope_parameters`, or a v4 `rope_scaling` merged into them), else at the top level, else the
    architecture's default `rotary` (None: its attention rotates the whole head, so any other
    share is refused). An explicit top-level null is dropped by transformers: the whole head."""
    c.used.add("partial_rotary_factor")
    if "partial_rotary_factor" in scaling:
        factor = scaling["partial_rotary_factor"]
    elif "partial_rotary_factor" in c.data:
        factor = c.data["partial_rotary_factor"]
        factor = 1.0 if factor is None else factor
    else:
        factor = rotary or 1.0
    check_type(factor, float, "partial_rotary_factor", c.source)
    if factor != 1.0 and rotary is None:
        raise SpecError(f"{c.source}: partial_rotary_factor {_show(factor)} is not supported "
                        f"for {c.arch}, whose attention rotates the whole head; only "
                        "Glm4MoeForCausalLM rotates part of it.")
    if not 0 < factor <= 1:
        raise SpecError(f"{c.source}: partial_rotary_factor must be in (0, 1], got "
                        f"{_show(factor)}. Fix it in config.json.")
    return float(factor)


# ------------------------------------------------------------------------------ readers
def _common(c: Config, theta: float = 10000.0, eps: float = 1e-6,
            kv_heads: int | None = None, head_dim: int | None = None,
            rotary: float | None = None) -> dict[str, Any]:
    """Fields every supported architecture shares, with this architecture's HF defaults."""
    act = c.get("hidden_act", str, "silu")
    if act not in HIDDEN_ACT:
        raise SpecError(f"{c.source}: hidden_act {_show(act)} is not supported; moeplan runs "
                        f"{', '.join(HIDDEN_ACT)} (gated MLPs, as transformers builds them).")
    if c.get("attention_dropout", float, 0.0):
        c.note("attention_dropout > 0 is not applied (moeplan trains without dropout)")
    return {
        "num_layers": c.get("num_hidden_layers", int),
        "hidden_size": c.get("hidden_size", int),
        "num_attention_heads": c.get("num_attention_heads", int),
        "num_kv_heads": c.get("num_key_value_heads", int, kv_heads),
        "head_dim": c.get("head_dim", int, head_dim),
        "ffn_hidden_size": c.get("intermediate_size", int),
        "vocab_size": c.get("vocab_size", int),
        "max_position_embeddings": c.get("max_position_embeddings", int, None),
        "tie_embeddings": c.get("tie_word_embeddings", bool, False),
        "norm_eps": c.get("rms_norm_eps", float, eps),
        "activation": HIDDEN_ACT[act],
        **_rope(c, theta, rotary),
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


def _aux(c: Config, key: str = "router_aux_loss_coef") -> dict[str, Any]:
    coeff = c.get(key, float, None)
    return {} if coeff is None else {"moe_aux_loss_coeff": coeff}


def _deepseek(c: Config, v3: bool) -> dict[str, Any]:
    """DeepseekV2/V3: MLA, routed + shared experts, layer i is MoE when i ≥ first_k_dense_replace
    and i % moe_layer_freq == 0 (modeling_deepseek_v3.py).

    transformers' DeepseekV3 router always scores with a sigmoid, adds the correction bias and
    limits groups (n_group, topk_group); `topk_method` / `scoring_func` are DeepSeek's own
    remote-code keys, present only in its original config.json. transformers builds no MTP
    module, so `num_nextn_predict_layers` (which v5 writes by default) counts only in the
    original config (then the checkpoint carries the MTP weights as model.layers.{N}).
    """
    d = _common(c, kv_heads=None)
    d.pop("num_kv_heads")
    c.get("num_key_value_heads", int, None)
    d.pop("head_dim")
    c.used.update({"qk_head_dim", "rope_interleave"})  # derived / a weight layout (hf_io)
    n_layers = d["num_layers"]
    first = c.get("first_k_dense_replace", int, 3 if v3 else 0)
    freq = c.get("moe_layer_freq", int, 1)
    if freq < 1:
        raise SpecError(f"{c.source}: moe_layer_freq must be ≥ 1, got {freq}.")
    moe = [i >= first and i % freq == 0 for i in range(n_layers)]
    n_shared = c.get("n_shared_experts", int, 1 if v3 else 0)
    original = c.has("topk_method")
    method = c.get("topk_method", str, "noaux_tc" if v3 else "greedy")
    score = c.get("scoring_func", str, "sigmoid" if v3 else "softmax")
    if v3 and (method != "noaux_tc" or score != "sigmoid"):
        c.note(f"topk_method {method!r} / scoring_func {score!r} are ignored: transformers' "
               "DeepseekV3 always routes by sigmoid scores with the correction bias and groups")
        method, score = "noaux_tc", "sigmoid"
    n_group = c.get("n_group", int, 8 if v3 else None)
    topk_group = c.get("topk_group", int, 4 if v3 else None)
    grouped = (method in ("group_limited_greedy", "noaux_tc") and (n_group or 1) > 1)
    mtp = c.get("num_nextn_predict_layers", int, 0) if v3 else 0
    if v3 and mtp and not original:
        c.note(f"num_nextn_predict_layers={mtp} builds no MTP module (transformers builds "
               "none); set mtp_layers in a ModelSpec to train MTP")
        mtp = 0
    c.used.add("num_mtp_layers")
    d.update(
        attention="mla",
        q_lora_rank=c.get("q_lora_rank", int, 1536 if v3 else None),
        kv_lora_rank=c.get("kv_lora_rank", int),
        qk_nope_head_dim=c.get("qk_nope_head_dim", int),
        qk_rope_head_dim=c.get("qk_rope_head_dim", int),
        v_head_dim=c.get("v_head_dim", int),
        num_experts=c.get("n_routed_experts", int),
        moe_top_k=c.get("num_experts_per_tok", int),
        moe_ffn_hidden_size=c.get("moe_intermediate_size", int),
        num_shared_experts=n_shared,
        shared_expert_ffn_hidden_size=n_shared * c.get("moe_intermediate_size", int)
        if n_shared else None,
        router_score=score,
        router_expert_bias=method == "noaux_tc",
        router_num_groups=n_group if grouped else None,
        router_groups_per_token=topk_group if grouped else None,
        routed_scaling_factor=c.get("routed_scaling_factor", float, 2.5 if v3 else 1.0),
        norm_topk_prob=c.get("norm_topk_prob", bool, v3),
        mtp_layers=mtp,
        qkv_bias=c.get("attention_bias", bool, False),
        attn_out_bias=c.get("attention_bias", bool, False),
        **_aux(c, "aux_loss_alpha"),
        **_pattern_fields(moe, n_layers),
    )
    c.used.add("seq_aux")
    return d


def _sliding(c: Config, d: dict[str, Any], flag: str | None) -> None:
    """Sliding-window attention where HF applies it (the runtime refuses it by name)."""
    window = c.get("sliding_window", int, None)
    on = c.get(flag, bool, False) if flag else window is not None
    if on and window is not None:
        d.update(sliding_window=window, attention_pattern="S")


def _qwen_moe(c: Config, qwen3: bool) -> dict[str, Any]:
    """Qwen2Moe/Qwen3Moe: layer i is MoE when i ∉ mlp_only_layers and (i+1) % decoder_sparse_step
    == 0 (modeling_qwen3_moe.py); Qwen2Moe adds a sigmoid-gated shared expert and QKV bias.
    v5 writes the expert count as num_local_experts."""
    d = _common(c, kv_heads=4 if qwen3 else 16, head_dim=None)
    n_layers = d["num_layers"]
    step = c.get("decoder_sparse_step", int, 1)
    if step < 1:
        raise SpecError(f"{c.source}: decoder_sparse_step must be ≥ 1, got {step}.")
    dense_only = set(c.get("mlp_only_layers", "ints", []))
    moe = [i not in dense_only and (i + 1) % step == 0 for i in range(n_layers)]
    experts = (c.get("num_local_experts", int) if c.has("num_local_experts")
               else c.get("num_experts", int, 128 if qwen3 else 60))
    c.used.add("num_experts")
    d.update(
        num_experts=experts,
        moe_top_k=c.get("num_experts_per_tok", int, 8 if qwen3 else 4),
        moe_ffn_hidden_size=c.get("moe_intermediate_size", int, 768 if qwen3 else 1408),
        norm_topk_prob=c.get("norm_topk_prob", bool, False),
        **_aux(c),
        **_pattern_fields(moe, n_layers),
    )
    c.used.add("max_window_layers")
    _sliding(c, d, "use_sliding_window")
    if qwen3:
        bias = c.get("attention_bias", bool, False)
        d.update(qk_norm=True, qkv_bias=bias, attn_out_bias=bias)
    else:
        d["qkv_bias"] = True
        shared = c.get("shared_expert_intermediate_size", int, 0)
        if shared:
            d.update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared,
                     shared_expert_gate=True)
    return d


def _mixtral(c: Config) -> dict[str, Any]:
    """Mixtral: softmax top-k renormalised (also for k = 1), HF defaults θ 1e6, ε 1e-5."""
    d = _common(c, theta=1e6, eps=1e-5, kv_heads=8)
    if c.get("router_jitter_noise", float, 0.0):
        c.note("router_jitter_noise > 0 is not applied (moeplan routes without noise)")
    d.update(num_experts=c.get("num_local_experts", int, 8),
             moe_top_k=c.get("num_experts_per_tok", int, 2),
             moe_ffn_hidden_size=d["ffn_hidden_size"], norm_topk_prob=True, **_aux(c))
    _sliding(c, d, None)
    return d


def _llama(c: Config) -> dict[str, Any]:
    d = _common(c)
    bias = c.get("attention_bias", bool, False)
    d.update(qkv_bias=bias, attn_out_bias=bias, mlp_bias=c.get("mlp_bias", bool, False))
    return d


def _qwen2(c: Config) -> dict[str, Any]:
    d = _common(c, kv_heads=32)
    d["qkv_bias"] = True
    c.used.add("max_window_layers")
    _sliding(c, d, "use_sliding_window")
    return d


def _qwen3(c: Config) -> dict[str, Any]:
    d = _common(c, kv_heads=32, head_dim=128)
    bias = c.get("attention_bias", bool, False)
    d.update(qk_norm=True, qkv_bias=bias, attn_out_bias=bias)
    c.used.add("max_window_layers")
    kinds = c.get("layer_types", "strs", [])
    if c.get("use_sliding_window", bool, False) and "sliding_attention" in kinds:
        _layer_pattern(c, d, kinds)
    c.used.add("sliding_window")
    return d


LAYER_TYPES = {"sliding_attention": "S", "full_attention": "F"}
"""The attention kinds a config's `layer_types` may name (transformers' values)."""


def _layer_pattern(c: Config, d: dict[str, Any], kinds: list[str]) -> None:
    """Sliding and full attention by layer, as the shortest period that tiles `layer_types`;
    a kind outside LAYER_TYPES, or a list of another length than the layers, is refused (it
    was read as full attention without a word)."""
    unknown = sorted({t for t in kinds if t not in LAYER_TYPES})
    if unknown:
        raise SpecError(f"{c.source}: layer_types holds {_show(unknown[0])}, which is not one of "
                        f"{', '.join(LAYER_TYPES)}; fix it in the config.")
    layers = d.get("num_layers")
    if kinds and layers is not None and len(kinds) != layers:
        raise SpecError(f"{c.source}: layer_types lists {len(kinds)} layers, the config "
                        f"{layers} (num_hidden_layers); give one entry per layer.")
    pattern = "".join(LAYER_TYPES[t] for t in kinds)
    for n in range(1, len(pattern) + 1):  # shortest period that tiles the list
        if all(pattern[i] == pattern[i % n] for i in range(len(pattern))):
            pattern = pattern[:n]
            break
    if pattern:
        d.update(sliding_window=c.get("sliding_window", int, None), attention_pattern=pattern)


def _gpt_oss(c: Config) -> dict[str, Any]:
    """gpt-oss: alternating sliding/full attention from `layer_types`, sinks, biases everywhere."""
    d = _common(c, theta=150000.0, eps=1e-5, kv_heads=8, head_dim=64)
    _layer_pattern(c, d, c.get("layer_types", "strs", []))
    bias = c.get("attention_bias", bool, True)
    d.update(qkv_bias=bias, attn_out_bias=bias, attention_sinks=True, mlp_bias=True,
             num_experts=c.get("num_local_experts", int),
             moe_top_k=c.get("num_experts_per_tok", int, 4),
             moe_ffn_hidden_size=d["ffn_hidden_size"], router_bias=True, norm_topk_prob=True,
             **_aux(c))
    c.used.update({"swiglu_limit", "sliding_window"})
    return d


def _glm4_moe(c: Config) -> dict[str, Any]:
    """Glm4Moe (GLM-4.5, GLM-4.5-Air): GQA with biases on q, k and v only (`attention_bias`),
    optional per-head q/k norm (`use_qk_norm`), RoPE on the leading `partial_rotary_factor` of
    each head (0.5); layer i is MoE when i ≥ first_k_dense_replace, and its MoE is DeepSeek-V3's:
    sigmoid scores with the correction bias, group-limited top-k, renormalised, scaled by
    routed_scaling_factor, plus n_shared_experts shared experts of moe_intermediate_size each
    (modeling_glm4_moe.py). transformers builds no MTP module and its config writes
    num_nextn_predict_layers = 1 by default, weights or not, so the count builds none here;
    `--init-from` reads a plan's MTP depth from the weights (`hf_io.check_hf_dir`)."""
    d = _common(c, eps=1e-5, kv_heads=8, rotary=0.5)
    n_layers = d["num_layers"]
    first = c.get("first_k_dense_replace", int, 1)
    if first >= n_layers:
        raise SpecError(f"{c.source}: first_k_dense_replace {first} leaves none of the "
                        f"{n_layers} layers an MoE layer; a Glm4Moe model has at least one. "
                        "Fix it in config.json.")
    moe = [i >= first for i in range(n_layers)]
    if "n_shared_experts" in c.data and c.data["n_shared_experts"] is None:
        raise SpecError(f"{c.source}: n_shared_experts is null; Glm4MoeForCausalLM needs a "
                        "count (transformers refuses null too). Fix it in config.json.")
    n_shared = c.get("n_shared_experts", int, 1)
    if n_shared < 1:
        raise SpecError(f"{c.source}: n_shared_experts must be ≥ 1 for Glm4MoeForCausalLM "
                        f"(it builds a shared expert of n_shared_experts × "
                        f"moe_intermediate_size), got {n_shared}.")
    expert_f = c.get("moe_intermediate_size", int, 1408)
    n_group, topk_group = c.get("n_group", int, 1), c.get("topk_group", int, 1)
    mtp = c.get("num_nextn_predict_layers", int, 0)
    if mtp:
        c.note(f"num_nextn_predict_layers={mtp} counts no MTP module here (transformers builds "
               "none); a plan whose model has the depth (mtp_layers, as the glm-4.5 presets) "
               "reads its weights from a checkpoint that holds them as model.layers.{L+k}")
    bias = c.get("attention_bias", bool, False)
    d.update(
        qkv_bias=bias, attn_out_bias=False, qk_norm=c.get("use_qk_norm", bool, False),
        num_experts=c.get("n_routed_experts", int, 128),
        moe_top_k=c.get("num_experts_per_tok", int, 8),
        moe_ffn_hidden_size=expert_f,
        num_shared_experts=n_shared, shared_expert_ffn_hidden_size=n_shared * expert_f,
        router_score="sigmoid", router_expert_bias=True,
        router_num_groups=n_group if n_group > 1 else None,
        router_groups_per_token=topk_group if n_group > 1 else None,
        routed_scaling_factor=c.get("routed_scaling_factor", float, 1.0),
        norm_topk_prob=c.get("norm_topk_prob", bool, True),
        **_pattern_fields(moe, n_layers),
    )
    return d


Reader = Callable[[Config], dict[str, Any]]
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
    "Glm4MoeForCausalLM": _glm4_moe,
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
    "glm4_moe": "Glm4MoeForCausalLM",
}
ARCHITECTURES = {v: k for k, v in MODEL_TYPES.items()}


def architecture(config: dict[str, Any], source: str) -> str:
    """The supported architecture a config names (its `architectures` list, else model_type)."""
    archs = config.get("architectures")
    if archs is not None:
        check_type(archs, "strs", "architectures", f"{source}: Hugging Face config")
    model_type = config.get("model_type")
    if model_type is not None:
        check_type(model_type, str, "model_type", f"{source}: Hugging Face config")
    arch = next((a for a in archs or [] if a in READERS), None)
    if arch is None:
        arch = MODEL_TYPES.get(str(model_type))
    if arch is None:
        got = ", ".join(_show(a) for a in archs or []) or f"model_type {_show(model_type)}"
        raise SpecError(f"{source}: Hugging Face architecture {got} is not supported. Supported: "
                        f"{', '.join(READERS)}. Write a ModelSpec YAML for other models "
                        "(see `moeplan specs show deepseek-v3 --json` for the fields).")
    return arch


def model_from_hf_config(config: dict[str, Any], source: str, name: str = "hf") -> ModelSpec:
    """Map a Hugging Face config onto a ModelSpec; unknown architectures and malformed fields
    are refused (SpecError, exit 2); fields not used are logged as one warning."""
    if not isinstance(config, dict):
        raise SpecError(f"{source}: a Hugging Face config must be a JSON object.")
    arch = architecture(config, source)
    c = Config(config, source, arch)
    fields = READERS[arch](c)
    unused = sorted(k for k in config if k not in c.used)
    if unused:
        shown = ", ".join(f"{k}={_show(config[k])}" for k in unused[:12])
        more = f" and {len(unused) - 12} more" if len(unused) > 12 else ""
        c.note(f"fields not used: {shown}{more}")
    for text in c.notes:
        log.warning("warning: %s (%s): %s", source, arch, text)
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
