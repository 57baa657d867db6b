"""Tiny random Hugging Face checkpoints for the equivalence tests, written with save_pretrained.

Weights are re-drawn at scales where the function depends on every feature under test:
attention projections at std 0.3 (attention far from uniform, so RoPE angles and their
scaling change the loss), norms at 1 ± 0.2, biases and DeepSeek's correction bias non-zero.
Sequences (32) are longer than the original context of the scaled models (16), so yarn and
llama3 scaling move real frequencies.
"""

from __future__ import annotations

from pathlib import Path

import torch

SEQ = 32
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def configs() -> dict:
    """name → transformers config of each tiny model (v5 keys, as save_pretrained writes)."""
    import transformers as T

    return {
        "qwen3_moe": T.Qwen3MoeConfig(**COMMON, head_dim=8, moe_intermediate_size=16,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                      attention_bias=True, rope_parameters={
                                          "rope_type": "default", "rope_theta": 1e6}),
        "deepseek_v3": T.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=16, n_shared_experts=1,
            n_routed_experts=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            v_head_dim=8, qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2,
            first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
            max_position_embeddings=640, rope_parameters={
                "rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0,
                "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                "beta_fast": 32, "beta_slow": 1}),
        "mixtral_top1": T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=1),
        "mixtral_top2": T.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
        "llama31": T.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
            "rope_theta": 500000.0}),
        "qwen3": T.Qwen3Config(**COMMON, head_dim=8),
        # GLM-4.5's attention (q/k/v biases, q/k norm, RoPE on half of each head) over
        # DeepSeek-V3's MoE (sigmoid, correction bias, groups, scaling, a shared expert)
        "glm4_moe": T.Glm4MoeConfig(
            **COMMON, head_dim=8, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
            num_nextn_predict_layers=0, rope_parameters={
                "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
    }


def variant_configs() -> dict:
    """More features, checked at world 1 only (in process, cheap)."""
    import transformers as T

    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
            "original_max_position_embeddings": 16}
    return {
        # no q LoRA (q_proj path), halves RoPE layout, yarn without mscale_all_dim
        "deepseek_no_qlora": T.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=16,
            n_shared_experts=2, n_routed_experts=4, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=1, topk_group=1,
            num_experts_per_tok=2, first_k_dense_replace=0, rope_interleave=False,
            max_position_embeddings=64, rope_parameters=yarn),
        # dense layers among MoE ones, no renormalisation, tied embeddings
        "qwen3_moe_mixed": T.Qwen3MoeConfig(
            **{**COMMON, "num_hidden_layers": 3, "tie_word_embeddings": True}, head_dim=8,
            moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=False, mlp_only_layers=[1]),
        "llama_dynamic_gelu_tanh": T.LlamaConfig(
            **COMMON, hidden_act="gelu_pytorch_tanh", attention_bias=True, mlp_bias=True,
            max_position_embeddings=16,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        "qwen3_linear_gelu": T.Qwen3Config(
            **COMMON, head_dim=8, hidden_act="gelu", attention_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    }


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
             "kv_a_proj_with_mqa", "kv_b_proj")


@torch.no_grad()
def redraw_(model: torch.nn.Module, seed: int) -> None:
    """Every weight re-drawn (see module doc), from one seed."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.2 * noise)
        elif any(f".{a}." in name for a in ATTENTION):
            p.copy_(0.3 * noise)
        else:
            p.copy_(0.1 * noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def write_models(root: Path, names: list[str] | None = None,
                 variants: bool = False) -> dict[str, Path]:
    """Save each tiny model (or variant) under root/NAME; returns name → directory."""
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, cfg) in enumerate((variant_configs() if variants else configs()).items()):
        if names is not None and name not in names:
            continue
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg)
        redraw_(model, seed=100 + i)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


def hf_loss(directory: Path, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """transformers' mean cross-entropy of `targets` (b, s) after `tokens` (b, s), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(tokens).logits.float()  # (b, s, V)
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   targets.reshape(-1)))
