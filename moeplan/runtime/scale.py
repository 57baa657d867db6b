"""`--scale-down`: a small model and batch of the same shape family, runnable on one machine.

The small model is a function of the full model alone, not of the layout, so a scaled-down
checkpoint resumes under any other plan of the same model: ep2 and tp2·pp2 train the very same
small network on the very same batches. Every size a parallel degree splits is kept a multiple
of gcd(full size, 840): 840 = lcm(1, …, 8), so every degree up to 8 that divides the full
model's size (and a valid plan's degrees do) divides the small one too:

- heads and KV heads (tp), FFN sizes (tp, etp), experts (ep, router groups), the vocabulary
  (tp) of the synthetic stream;
- depth min(layers, 4) (one decoder layer per stage for pp·vpp ≤ 4), sequence 128, global
  batch 4 sequences (pp ≤ 4 and dp·mbs ≤ 4 keep their micro-batch rules).

A layout beyond those (a degree above 8, pp·vpp > 4, dp·mbs·pp > 4, tp·cp beyond what 128
tokens split) grows only the size it needs, to the least common multiple; `describe_scale_down`
then names what grew, since a checkpoint of that size resumes only under layouts that fit it.
With `--data` (or a tokenizer) the vocabulary is the full model's: the dataset's ids index it.
"""

from __future__ import annotations

import math

from ..specs import Layout, ModelSpec, Plan, TrainingSpec

SMALL = 840  # lcm(1..8): sizes keep every degree ≤ 8 that divides the full size
BASE_LAYERS, BASE_SEQ, BASE_GBS = 4, 128, 4
HIDDEN = 256


def _lcm(*xs: int) -> int:
    out = 1
    for x in xs:
        out = out * x // math.gcd(out, x)
    return out


def _fit(target: int, full: int, degree: int = 1) -> int:
    """The smallest multiple of gcd(full, 840) at least `target`, grown to a multiple of
    `degree` when the layout needs one (degrees ≤ 8 dividing `full` never do)."""
    step = math.gcd(max(full, 1), SMALL)
    n = -(-target // step) * step
    return n if n % degree == 0 else _lcm(n, degree)


def _head_dim(target: int, rotary_percent: float) -> int:
    """The even head dim nearest `target` from below whose rotary share rounds down to an even
    number of dims (GLM's half-head RoPE needs a multiple of 4), else the next above."""
    def fits(d: int) -> bool:
        r = int(d * rotary_percent)  # as ModelSpec.rotary_dim rounds
        return r >= 2 and r % 2 == 0

    down = next((d for d in range(target // 2 * 2, 1, -2) if fits(d)), None)
    return down or next(d for d in range(target // 2 * 2 + 2, 1 << 20, 2) if fits(d))


def scale_down_model(spec: ModelSpec, layout: Layout | None = None,
                     keep_vocab: bool = False) -> ModelSpec:
    """The plan's model shrunk to a few layers of width 256; `layout` only grows a size its
    degrees cannot split (see the module docstring); `keep_vocab` keeps the vocabulary."""
    tp, ep, etp = (layout.tp, layout.ep, layout.etp) if layout else (1, 1, 1)
    stages = layout.pp * layout.vpp if layout else 1
    upd: dict = {"name": f"{spec.name}-scaled-down"}
    dense_first = min(spec.first_k_dense, 1)
    upd["num_layers"] = max(min(spec.num_layers, BASE_LAYERS), stages)
    upd["first_k_dense"] = dense_first
    if spec.moe_layer_pattern is not None:
        upd["moe_layer_pattern"] = None
        upd["first_k_dense"] = dense_first if spec.is_moe else 0
    upd["moe_layer_freq"] = 1
    upd["mtp_layers"] = min(spec.mtp_layers, 1)
    if spec.attention == "gqa":
        grouped = spec.kv_heads < spec.num_attention_heads
        kv = _fit(1, spec.kv_heads, tp)
        heads = kv * min(2, spec.num_attention_heads // spec.kv_heads) if grouped else kv
        upd.update(num_attention_heads=heads, num_kv_heads=kv,
                   head_dim=_head_dim(max(8, HIDDEN // heads), spec.rotary_percent),
                   hidden_size=HIDDEN)
    else:
        upd.update(num_attention_heads=_fit(1, spec.num_attention_heads, tp),
                   hidden_size=HIDDEN, q_lora_rank=64 if spec.q_lora_rank else None,
                   kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    upd["ffn_hidden_size"] = _fit(256, spec.ffn_hidden_size, tp)
    if not keep_vocab:
        upd["vocab_size"] = _fit(1024, spec.vocab_size, tp)
    if spec.sliding_window:
        upd["sliding_window"] = min(spec.sliding_window, 64)
    if spec.is_moe:
        groups = spec.router_num_groups
        E = _lcm(math.gcd(spec.num_experts, SMALL), groups or 1, ep)
        while E < 8:
            E *= 2
        upd["num_experts"] = E
        upd["moe_top_k"] = min(spec.moe_top_k, E // 2 or 1)
        upd["moe_ffn_hidden_size"] = _fit(64, spec.moe_ffn_hidden_size or 64, etp)
        if groups:
            gpt = spec.router_groups_per_token or groups
            upd["router_groups_per_token"] = max(gpt, -(-upd["moe_top_k"] // (E // groups)))
        if spec.num_shared_experts:
            full = spec.shared_expert_ffn_hidden_size or spec.moe_ffn_hidden_size or 64
            upd["shared_expert_ffn_hidden_size"] = _fit(64 * spec.num_shared_experts, full, tp)
    return ModelSpec.model_validate({**spec.model_dump(), **upd})


def _seq_for(layout: Layout) -> int:
    """BASE_SEQ, or the least multiple of it that sequence parallelism and load-balanced CP
    split (seq % 2·cp, (seq / cp) % tp)."""
    seq = BASE_SEQ
    while (layout.cp > 1 and seq % (2 * layout.cp)) or (seq // layout.cp) % layout.tp:
        seq += BASE_SEQ
    return seq


def scale_down_training(training: TrainingSpec, layout: Layout) -> tuple[TrainingSpec, Layout]:
    """Sequence 128 and a global batch of 4 sequences (grown only where the layout's rules need
    it: dp·mbs must divide the batch and, under pipeline parallelism, pp the micro-batch count,
    so the schedule still pipelines). The schedule and optimizer settings are kept."""
    per = layout.dp * layout.mbs * (layout.pp if layout.pp > 1 else 1)
    gbs = _lcm(BASE_GBS, per)
    layout = layout.model_copy(update={"num_microbatches": gbs // (layout.dp * layout.mbs)})
    training = TrainingSpec.model_validate({**training.model_dump(), "seq_len": _seq_for(layout),
                                            "global_batch_size": gbs})
    return training, layout


def scale_down_plan(plan: Plan, keep_vocab: bool = False) -> Plan:
    """The whole plan scaled down: model, sequence and batch shrunk, every degree kept; the
    full model's stage layout cannot fit the shrunk one, so stages are rebalanced."""
    training, layout = scale_down_training(plan.training, plan.layout)
    choices = plan.choices.model_copy(update={"stage_layout": None})
    model = scale_down_model(plan.model, plan.layout, keep_vocab)
    return plan.model_copy(update={"model": model, "training": training, "layout": layout,
                                   "choices": choices, "estimate": None})


def grown_for_layout(plan: Plan, keep_vocab: bool = False) -> list[str]:
    """What the plan's layout made larger than the layout-free scaled-down sizes ("num_layers
    4 → 8", ...): a checkpoint of those sizes resumes only under layouts that split them."""
    base = scale_down_model(plan.model, None, keep_vocab).model_dump()
    here = scale_down_model(plan.model, plan.layout, keep_vocab).model_dump()
    out = [f"{k} {base[k]} → {here[k]}" for k in here if k != "name" and here[k] != base[k]]
    training, layout = scale_down_training(plan.training, plan.layout)
    if training.seq_len != BASE_SEQ:
        out.append(f"seq {BASE_SEQ} → {training.seq_len}")
    if training.global_batch_size != BASE_GBS:
        out.append(f"global batch {BASE_GBS} → {training.global_batch_size}")
    return out


def _count(n: float) -> str:
    for div, unit in ((1e9, " B"), (1e6, " M"), (1e3, " k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def describe_scale_down(given: Plan, running: Plan, keep_vocab: bool = False) -> str:
    """One line: what --scale-down made of the plan (parameters, sequence, batch, and why the
    vocabulary was kept or what this layout made larger)."""
    a, b = given.model, running.model
    line = (f"--scale-down: {a.name} {_count(a.total_params())} → {_count(b.total_params())} "
            f"parameters ({b.num_layers} layers, hidden {b.hidden_size}"
            + (f", {b.num_experts} experts" if b.is_moe else "")
            + f"), seq {given.training.seq_len} → {running.training.seq_len}, global batch "
            f"{given.training.global_batch_size} → {running.training.global_batch_size}; "
            "parallel degrees kept")
    if keep_vocab:
        emb = b.vocab_size * b.hidden_size * (1 if b.tie_embeddings else 2)
        line += (f"; vocabulary {b.vocab_size:,} kept for the data's token ids "
                 f"({_count(emb)} embedding and output parameters)")
    grown = grown_for_layout(given, keep_vocab)
    if grown:
        line += ("; grown for this layout (" + ", ".join(grown) + "), so its checkpoints "
                 "resume only under layouts that split these sizes")
    else:
        line += "; the same small model under every layout of this model, so its checkpoints "
        line += "resume under any of them"
    return line
