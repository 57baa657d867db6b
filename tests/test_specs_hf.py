"""Hugging Face config.json import: same counts as the presets, clear refusal otherwise."""

from __future__ import annotations

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
