"""`--scale-down`: a small model and batch of the same shape family, runnable on one machine.

Widths, depth, expert count, vocabulary, sequence and micro-batch count shrink while every
parallel degree of the plan still divides what it splits (heads and KV heads by tp, experts by
ep, expert FFN by etp, vocabulary by tp, sequence by tp and 2·cp, at least one decoder layer
per pipeline stage), so the scaled-down run exercises exactly the plan's process groups and
communication.
"""

from __future__ import annotations

import math

from ..specs import Layout, ModelSpec, Plan, TrainingSpec


def _lcm(*xs: int) -> int:
    out = 1
    for x in xs:
        out = out * x // math.gcd(out, x)
    return out


def scale_down_model(spec: ModelSpec, layout: Layout) -> ModelSpec:
    """The plan's model shrunk to a few layers of width ~256, divisibility kept."""
    tp = layout.tp
    upd: dict = {"name": f"{spec.name}-scaled-down"}
    dense_first = min(spec.first_k_dense, 1)
    layers = min(spec.num_layers, dense_first + 2 if spec.is_moe else 2)
    layers = max(layers, layout.pp * layout.vpp)  # at least one decoder layer per stage
    upd["num_layers"] = layers
    upd["first_k_dense"] = dense_first
    if spec.moe_layer_pattern is not None:
        upd["moe_layer_pattern"] = None
        upd["first_k_dense"] = dense_first if spec.is_moe else 0
    upd["moe_layer_freq"] = 1
    upd["mtp_layers"] = min(spec.mtp_layers, 1)
    heads = tp * max(1, 4 // tp)
    upd["num_attention_heads"] = heads
    if spec.attention == "gqa":
        grouped = spec.kv_heads < spec.num_attention_heads
        upd["num_kv_heads"] = tp if grouped and tp < heads else heads
        upd["head_dim"] = 32
        upd["hidden_size"] = 256
    else:
        upd.update(hidden_size=256, q_lora_rank=64 if spec.q_lora_rank else None,
                   kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    upd["ffn_hidden_size"] = 128 * _lcm(tp, 4) // 4 * 4
    upd["vocab_size"] = 1024 * tp
    if spec.sliding_window:
        upd["sliding_window"] = min(spec.sliding_window, 64)
    if spec.is_moe:
        groups = spec.router_num_groups
        E = _lcm(layout.ep, groups or 1)
        while E < 8:
            E *= 2
        upd["num_experts"] = E
        upd["moe_top_k"] = min(spec.moe_top_k, E // 2 or 1)
        upd["moe_ffn_hidden_size"] = 64 * layout.etp
        if groups:
            gpt = spec.router_groups_per_token or groups
            upd["router_groups_per_token"] = max(gpt, -(-upd["moe_top_k"] // (E // groups)))
        if spec.num_shared_experts:
            upd["shared_expert_ffn_hidden_size"] = 64 * tp * spec.num_shared_experts
    return ModelSpec.model_validate({**spec.model_dump(), **upd})


def scale_down_training(training: TrainingSpec, layout: Layout) -> tuple[TrainingSpec, Layout]:
    """Sequence 128·tp·cp (divisible as SP and load-balanced CP need), one micro-batch per DP
    rank, or pp of them under pipeline parallelism so the schedule still pipelines."""
    seq = 128 * layout.tp * layout.cp
    m = layout.pp if layout.pp > 1 else 1
    layout = layout.model_copy(update={"num_microbatches": m})
    training = TrainingSpec.model_validate({**training.model_dump(), "seq_len": seq,
                                            "global_batch_size": layout.dp * layout.mbs * m})
    return training, layout


def scale_down_plan(plan: Plan) -> Plan:
    """The whole plan scaled down: model, sequence and batch shrunk, every degree kept; the
    full model's stage layout cannot fit the shrunk one, so stages are rebalanced."""
    training, layout = scale_down_training(plan.training, plan.layout)
    choices = plan.choices.model_copy(update={"stage_layout": None})
    return plan.model_copy(update={"model": scale_down_model(plan.model, plan.layout),
                                   "training": training, "layout": layout, "choices": choices,
                                   "estimate": None})


def _count(n: float) -> str:
    for div, unit in ((1e9, " B"), (1e6, " M"), (1e3, " k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def describe_scale_down(given: Plan, running: Plan) -> str:
    """One line: what --scale-down made of the plan (parameters, sequence, batch)."""
    a, b = given.model, running.model
    return (f"--scale-down: {a.name} {_count(a.total_params())} → {_count(b.total_params())} "
            f"parameters ({b.num_layers} layers, hidden {b.hidden_size}"
            + (f", {b.num_experts} experts" if b.is_moe else "")
            + f"), seq {given.training.seq_len} → {running.training.seq_len}, global batch "
            f"{given.training.global_batch_size} → {running.training.global_batch_size}; "
            f"parallel degrees kept")
