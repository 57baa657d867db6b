"""Derived quantities of ModelSpec against published sizes and a hand FLOP count."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from moeplan import load_model
from moeplan.specs import ModelSpec

# (preset, published total B, published active B or None, rel. tolerance total, rel. tol. active)
PUBLISHED = [
    ("deepseek-v3", 671, 37, 0.015, 0.04),
    ("qwen3-235b-a22b", 235, 22, 0.015, 0.04),
    ("qwen3-30b-a3b", 30.5, 3.3, 0.015, 0.04),
    ("qwen2-57b-a14b", 57.4, 14.2, 0.015, 0.04),
    ("mixtral-8x7b", 46.7, 12.9, 0.015, 0.04),
    ("mixtral-8x22b", 141, 39, 0.015, 0.04),
    ("llama3-8b", 8.03, None, 0.015, 0),
    ("llama3-70b", 70.6, None, 0.015, 0),
    ("llama3-405b", 405, None, 0.015, 0),
    ("gpt3-175b", 175, None, 0.015, 0),
    ("gpt-oss-120b", 116.8, None, 0.015, 0),
    ("kimi-k2", 1040, 32.6, 0.015, 0.04),
    ("llama2-7b", 6.74, None, 0.015, 0),
    ("llama2-13b", 13.0, None, 0.015, 0),
    ("llama2-70b", 69.0, None, 0.015, 0),
    ("gpt3-5b", 5.0, None, 0.02, 0),
    ("gpt3-20b", 20.0, None, 0.02, 0),
    ("nemotron4-15b", 15.6, None, 0.015, 0),       # 12.5B non-embedding + 3.2B embedding
    ("nemotron4-340b", 341, None, 0.015, 0),
    ("glm-4.5", 355, None, 0.015, 0),
    ("glm-4.5-air", 106, None, 0.015, 0),
]


@pytest.mark.parametrize("name,total,active,tol_t,tol_a", PUBLISHED)
def test_param_counts_match_published_sizes(name, total, active, tol_t, tol_a):
    m = load_model(name)
    assert m.total_params() / 1e9 == pytest.approx(total, rel=tol_t)
    if active is not None:
        assert m.active_params() / 1e9 == pytest.approx(active, rel=tol_a)
    else:
        assert m.active_params() <= m.total_params()


def test_dense_models_have_active_equal_total():
    m = load_model("llama3-70b")
    assert m.active_params() == m.total_params()


def test_gpt_oss_active_without_unembedding_matches_model_card():
    # The gpt-oss model card counts 5.1B active parameters excluding the unembedding.
    m = load_model("gpt-oss-120b")
    assert (m.active_params() - m.vocab_size * m.hidden_size) / 1e9 == pytest.approx(5.13, rel=0.02)


@pytest.mark.parametrize("name,active", [("glm-4.5", 32), ("glm-4.5-air", 12)])
def test_glm_active_without_embedding_and_output_matches_the_model_card(name, active):
    # GLM-4.5's card counts active parameters without the embedding and the output layer
    m = load_model(name)
    shown = m.active_params() - 2 * m.vocab_size * m.hidden_size
    assert shown / 1e9 == pytest.approx(active, rel=0.02)


def test_mtp_modules_are_excluded_from_counts_but_exist():
    m = load_model("deepseek-v3")
    no_mtp = m.model_copy(update={"mtp_layers": 0})
    assert m.total_params() == no_mtp.total_params()
    assert m.mtp_params() / 1e9 == pytest.approx(11.7, rel=0.1)  # 685B − 671B published ≈ 14B


def _hand_flops_gqa(L, h, a, g, d, f, V, s, glu, experts_routed=0, fe=0):
    """Megatron's count written out per GEMM (fwd+bwd = 3×fwd, 2 FLOPs/MAC, causal half)."""
    per_tok_fwd = 0.0
    per_tok_fwd += 2 * h * a * d  # Q
    per_tok_fwd += 2 * 2 * h * g * d  # K, V
    per_tok_fwd += 2 * a * d * h  # O
    per_tok_fwd += 2 * s * a * d / 2  # QK^T, causal half
    per_tok_fwd += 2 * s * a * d / 2  # AV, causal half
    mats = 3 if glu else 2
    if experts_routed:
        per_tok_fwd += 2 * mats * h * fe * experts_routed
    else:
        per_tok_fwd += 2 * mats * h * f
    total = L * per_tok_fwd + 2 * h * V  # logits
    return 3 * total


def test_flops_per_token_llama3_8b_matches_hand_count():
    m = load_model("llama3-8b")
    hand = _hand_flops_gqa(32, 4096, 32, 8, 128, 14336, 128256, 4096, True)
    assert m.flops_per_token(4096) == pytest.approx(hand, rel=1e-12)


def test_flops_per_token_mixtral_matches_hand_count():
    m = load_model("mixtral-8x7b")
    hand = _hand_flops_gqa(32, 4096, 32, 8, 128, 14336, 32000, 2048, True, 2, 14336)
    assert m.flops_per_token(2048) == pytest.approx(hand, rel=1e-12)


@pytest.mark.parametrize("name,gflops", [
    ("qwen3-30b-a3b", 23), ("qwen3-235b-a22b", 148), ("deepseek-v3", 260)])
def test_flops_per_token_matches_reference_checks(name, gflops):
    # REFERENCE.md: Qwen3-30B-A3B ≈ 23, Qwen3-235B ≈ 148, DeepSeek-V3 ≈ 260 with one MTP layer.
    assert load_model(name).flops_per_token(4096) / 1e9 == pytest.approx(gflops, rel=0.01)


def test_deepseek_v3_flops_without_mtp():
    m = load_model("deepseek-v3").model_copy(update={"mtp_layers": 0})
    assert m.flops_per_token(4096) / 1e9 == pytest.approx(249, rel=0.01)


def test_flops_grow_with_sequence_through_attention_only():
    m = load_model("llama3-8b")
    a, d, L = 32, 128, 32
    delta = m.flops_per_token(8192) - m.flops_per_token(4096)
    assert delta == pytest.approx(3 * L * 2 * 2 * 4096 * a * d / 2)


def test_moe_layer_pattern_first_k_dense_and_freq():
    m = load_model("deepseek-v3")
    layers = m.moe_layers()
    assert layers[:3] == [False] * 3 and all(layers[3:])
    assert m.num_moe_layers == 58


def test_sliding_pattern_alternates_for_gpt_oss():
    m = load_model("gpt-oss-120b")
    assert m.sliding_layers()[:4] == [True, False, True, False]


BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
            vocab_size=100)


@pytest.mark.parametrize("bad,field", [
    ({"hidden_size": -5}, "hidden_size"),
    ({"num_kv_heads": 3}, "num_kv_heads"),
    ({"num_experts": 4, "moe_top_k": 5, "moe_ffn_hidden_size": 32}, "moe_top_k"),
    ({"num_experts": 4, "moe_top_k": 2}, "moe_ffn_hidden_size"),
    ({"attention": "mla"}, "kv_lora_rank"),
    ({"first_k_dense": 9}, "first_k_dense"),
    ({"activation": "tanh"}, "activation"),
    ({"attention_pattern": "SX", "sliding_window": 4}, "attention_pattern"),
])
def test_impossible_values_are_rejected_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as e:
        ModelSpec(**{**BASE, **bad})
    assert field in str(e.value)


def test_fine_grained_mixtral_keeps_the_weights_and_activates_one_wide_experts_worth():
    """Mixtral-8x22B-G8T8 splits each expert's FFN 8 ways: the same total parameters (router
    aside), and top-8 of the thin experts run one original expert's width where Mixtral's top-2
    runs two."""
    wide, thin = load_model("mixtral-8x22b"), load_model("mixtral-8x22b-g8t8")
    assert thin.total_params() == pytest.approx(wide.total_params(), rel=1e-3)
    one_expert = 3 * wide.hidden_size * wide.moe_ffn_hidden_size * wide.num_layers
    assert wide.active_params() - thin.active_params() == pytest.approx(one_expert, rel=2e-3)


def test_upcycled_llama3_8x70b_is_llama3_70b_with_eight_copies_of_its_ffn():
    """Llama3-8x70B (the MoE Parallel Folding paper's upcycled model) keeps Llama-3 70B's
    attention, embeddings and norms and replaces each FFN by eight copies of it (plus a router):
    seven more FFNs in total, one more active under top-2."""
    dense, moe = load_model("llama3-70b"), load_model("llama3-8x70b")
    ffn = 3 * dense.hidden_size * dense.ffn_hidden_size * dense.num_layers
    router = dense.hidden_size * moe.num_experts * moe.num_layers
    assert moe.total_params() == pytest.approx(dense.total_params() + 7 * ffn + router, rel=1e-6)
    assert moe.active_params() == pytest.approx(dense.active_params() + ffn + router, rel=1e-6)
