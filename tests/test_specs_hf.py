"""Hugging Face config.json import: same counts as the presets, clear refusal otherwise."""

from __future__ import annotations

import json
import math
import re

import pytest

from moeplan import SpecError, load_model
from moeplan.specs.hf import model_from_hf_config

from .conftest import DATA

HF = sorted(p.stem for p in (DATA / "hf").glob("*.json"))


@pytest.mark.parametrize("name", HF)
def test_hf_config_gives_identical_counts_to_preset(name):
    preset = load_model(name)
    hf = load_model(DATA / "hf" / f"{name}.json")
    assert hf.total_params() == preset.total_params()
    assert hf.active_params() == preset.active_params()
    assert hf.flops_per_token(4096) == preset.flops_per_token(4096)
    assert hf.mtp_params() == preset.mtp_params()


def test_hf_config_is_detected_whatever_the_file_name(tmp_path):
    p = tmp_path / "weird_name.json"
    p.write_text((DATA / "hf" / "mixtral-8x7b.json").read_text())
    assert load_model(p).num_experts == 8


def test_unknown_architecture_names_supported_ones():
    with pytest.raises(SpecError) as e:
        load_model(DATA / "unsupported-arch.json")
    msg = str(e.value)
    assert "FalconForCausalLM" in msg and "DeepseekV3ForCausalLM" in msg


def test_qwen_sparse_step_and_mlp_only_layers_map_to_pattern():
    cfg = {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 4, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
           "vocab_size": 100, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    m = model_from_hf_config(cfg, "test")
    # (i+1) % 2 == 0 → layers 1 and 3; layer 3 forced dense → only layer 1.
    assert m.moe_layers() == [False, True, False, False]


def test_deepseek_first_k_dense_and_nextn_layers():
    m = load_model(DATA / "hf" / "deepseek-v3.json")
    assert m.first_k_dense == 3 and m.mtp_layers == 1 and m.router_num_groups == 8


def test_missing_required_field_is_named():
    with pytest.raises(SpecError) as e:
        model_from_hf_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}, "cfg")
    assert "num_hidden_layers" in str(e.value)


# ---------------------------------------------------------------- exact import (v5 keys, ...)
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 48, "vocab_size": 64}


def _hf(arch: str, **fields):
    return model_from_hf_config({"architectures": [arch], **TINY, **fields}, "cfg")


def test_v5_qwen3_moe_keys_num_local_experts_and_rope_parameters_theta():
    m = _hf("Qwen3MoeForCausalLM", num_local_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, rope_parameters={"rope_type": "default",
                                                       "rope_theta": 1e6})
    assert m.num_experts == 8 and m.rope_theta == 1e6 and m.rope_scaling is None


def test_qwen3_moe_attention_bias_covers_the_output_projection():
    m = _hf("Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, attention_bias=True)
    assert m.qkv_bias and m.attn_out_bias


MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8,
           qk_nope_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=16, n_group=4, topk_group=2, first_k_dense_replace=1)


def test_native_v5_deepseek_routes_with_groups_and_bias_and_builds_no_mtp(caplog):
    m = _hf("DeepseekV3ForCausalLM", **MLA, num_nextn_predict_layers=1, attention_bias=True)
    assert m.router_expert_bias and m.router_num_groups == 4 and m.router_score == "sigmoid"
    assert m.mtp_layers == 0 and "num_nextn_predict_layers" in caplog.text
    assert m.qkv_bias and m.attn_out_bias  # q_a_proj, kv_a_proj_with_mqa and o_proj biases


def test_original_deepseek_config_keeps_its_mtp_module():
    m = _hf("DeepseekV3ForCausalLM", **MLA, num_nextn_predict_layers=1, topk_method="noaux_tc")
    assert m.mtp_layers == 1


def test_yarn_scaling_is_read_and_multiplies_the_mla_softmax_scale():
    m = _hf("DeepseekV3ForCausalLM", **MLA, rope_scaling={
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    assert m.rope_scaling.kind == "yarn" and m.rope_scaling.factor == 40
    assert m.softmax_scale_factor() == pytest.approx((0.1 * math.log(40) + 1) ** 2)  # 1.87


def test_rope_scaling_leaves_flops_and_parameters_unchanged():
    plain = _hf("LlamaForCausalLM")
    scaled = _hf("LlamaForCausalLM", rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 5e5})
    assert scaled.rope_scaling is not None
    assert scaled.flops_per_token(4096) == plain.flops_per_token(4096)
    assert scaled.total_params() == plain.total_params()


def test_missing_fields_take_the_architectures_hf_defaults():
    m = _hf("MixtralForCausalLM", num_local_experts=4)
    assert (m.rope_theta, m.norm_eps, m.moe_top_k) == (1e6, 1e-5, 2)
    fields = {**{k: v for k, v in TINY.items() if k != "num_key_value_heads"},
              "num_attention_heads": 32}
    q = model_from_hf_config({"architectures": ["Qwen3ForCausalLM"], **fields}, "cfg")
    assert q.head_dim == 128 and q.num_kv_heads == 32 and q.norm_eps == 1e-6


@pytest.mark.parametrize(("act", "kind"), [("silu", "swiglu"), ("gelu", "geglu"),
                                           ("gelu_pytorch_tanh", "geglu_tanh")])
def test_hidden_act_keeps_the_gated_mlp_and_its_gelu_flavour(act, kind):
    m = _hf("LlamaForCausalLM", hidden_act=act)
    assert m.activation == kind and m.gated


def test_unsupported_hidden_act_is_refused_by_name():
    with pytest.raises(SpecError, match="hidden_act 'relu'"):
        _hf("LlamaForCausalLM", hidden_act="relu")


def test_every_unused_or_unhonoured_field_is_warned(caplog):
    _hf("MixtralForCausalLM", num_local_experts=4, router_jitter_noise=0.1, shiny_new_key=3)
    assert "router_jitter_noise" in caplog.text and "shiny_new_key=3" in caplog.text


def test_known_metadata_fields_are_not_warned(caplog):
    _hf("LlamaForCausalLM", torch_dtype="bfloat16", bos_token_id=1, use_cache=True)
    assert caplog.text == ""


@pytest.mark.parametrize(("field", "value", "expect"), [
    ("architectures", 5, "'architectures' must be a list of strings"),
    ("mlp_only_layers", 7, "'mlp_only_layers' must be a list of integers"),
    ("rope_theta", "abc", "'rope_theta' must be a finite number"),
    ("rope_theta", float("inf"), "'rope_theta' must be a finite number"),
    ("num_hidden_layers", 2.5, "'num_hidden_layers' must be an integer"),
    ("rope_parameters", [1], "'rope_parameters' must be a mapping"),
])
def test_wrongly_typed_config_fields_are_refused_naming_the_field(field, value, expect):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], **TINY, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, field: value}
    with pytest.raises(SpecError, match=re.escape(expect)):
        model_from_hf_config(cfg, "cfg")


@pytest.mark.parametrize(("field", "value"), [("architectures", 5), ("mlp_only_layers", 7),
                                              ("rope_theta", "abc")])
def test_cli_refuses_wrongly_typed_hf_config_with_exit_2_and_no_traceback(cli, tmp_path, field,
                                                                         value):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], **TINY, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "model_type": "qwen3_moe",
           field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = cli("specs", "show", str(path))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and field in r.stderr


@pytest.mark.parametrize("layer_types, needle", [
    (["bogus"] * 36, "'bogus', which is not one of"),
    (["sliding_attention", "full_attention"] * 2, "lists 4 layers, the config 36"),
])
def test_gpt_oss_layer_types_outside_the_known_kinds_or_layers_are_refused(layer_types, needle,
                                                                            tmp_path):
    """An unknown kind, or a list of another length than the layers, was read as full attention
    without a word."""
    doc = json.loads((DATA / "hf" / "gpt-oss-120b.json").read_text())
    doc["layer_types"] = layer_types
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SpecError, match=re.escape(needle)):
        load_model(path)


GLM45 = {  # zai-org/GLM-4.5 config.json, as the hub writes it (v4 keys)
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
    "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "partial_rotary_factor": 0.5, "intermediate_size": 12288, "max_position_embeddings": 131072,
    "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 96,
    "n_group": 1, "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "use_qk_norm": True, "vocab_size": 151552}


def test_glm45_hub_config_reads_as_the_preset_but_for_the_mtp_depth_transformers_lacks(caplog):
    hf, preset = model_from_hf_config(GLM45, "cfg"), load_model("glm-4.5")
    assert hf.model_copy(update={"name": preset.name, "mtp_layers": 1}) == preset
    assert hf.rotary_dim == 64 and hf.qkv_bias and not hf.attn_out_bias
    assert "num_nextn_predict_layers=1" in caplog.text


@pytest.mark.parametrize(("where", "arch"), [("top", "LlamaForCausalLM"),
                                             ("rope_parameters", "Qwen3MoeForCausalLM")])
def test_partial_rotary_is_refused_where_the_architecture_rotates_the_whole_head(where, arch):
    cfg = {"architectures": [arch], **TINY, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16}
    if where == "top":
        cfg["partial_rotary_factor"] = 0.5
    else:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5}
    with pytest.raises(SpecError, match="partial_rotary_factor 0.5 is not supported"):
        model_from_hf_config(cfg, "cfg")


@pytest.mark.parametrize(("factor", "needle"), [(39 / 128, "rotates 39 dims"),
                                                (1.5, "must be in (0, 1]")])
def test_a_rotary_share_that_is_no_even_number_of_dims_is_refused(factor, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        model_from_hf_config({**GLM45, "partial_rotary_factor": factor}, "cfg")


@pytest.mark.parametrize(("where", "want"), [
    ({"rope_scaling": {"rope_type": "linear", "factor": 1.0, "partial_rotary_factor": 0.25}},
     0.25),  # a v4 rope_scaling carries it: transformers reads it there
    ({"partial_rotary_factor": None}, 1.0),  # an explicit null: transformers drops it
    ({"partial_rotary_factor": 0.3}, 0.3),  # int(128 · 0.3) = 38 dims, as transformers rounds
])
def test_glm_reads_the_rotary_share_where_transformers_does(where, want):
    spec = model_from_hf_config({**GLM45, **where}, "cfg")
    assert spec.rotary_percent == want and spec.rotary_dim == int(128 * want)


def test_a_rotary_share_inside_a_v4_rope_scaling_is_refused_for_a_whole_head_architecture():
    cfg = {"architectures": ["LlamaForCausalLM"], **TINY, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5}}
    with pytest.raises(SpecError, match="partial_rotary_factor 0.5 is not supported"):
        model_from_hf_config(cfg, "cfg")


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("first_k_dense_replace", 92, "leaves none of the 92 layers an MoE layer"),
    ("n_shared_experts", None, "n_shared_experts is null"),
    ("n_shared_experts", 0, "n_shared_experts must be ≥ 1"),
])
def test_a_glm_config_transformers_would_not_build_as_written_is_refused(field, value, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        model_from_hf_config({**GLM45, field: value}, "cfg")
