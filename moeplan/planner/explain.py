"""Why a plan wins: short sentences for the table and the Plan JSON's `explanation`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..specs import Estimate, Plan

if TYPE_CHECKING:
    from .search import SearchResult

TIME_PARTS = {
    "compute_s": "compute", "pp_bubble_s": "pipeline bubble", "recompute_s": "recompute",
    "offload_s": "offload", "exposed_comm_s": "exposed communication",
}


def describe(plan: Plan) -> str:
    L, c = plan.layout, plan.choices
    parts = [f"tp{L.tp}", f"cp{L.cp}", f"dp{L.dp}", f"pp{L.pp}"]
    if L.vpp > 1:
        parts.append(f"vpp{L.vpp}")
    if plan.model.is_moe:
        parts += [f"ep{L.ep}", f"etp{L.etp}", f"edp{L.edp}", L.dispatcher]
    parts.append(f"mbs{L.mbs}")
    if L.ep_overlap:
        parts.append("ep-overlap")
    if not L.distributed_optimizer:
        parts.append("no-dist-opt")
    text = " ".join(parts) + f" {plan.training.precision}"
    rec = c.stage_recompute or ([c.recompute] if c.recompute else [])
    off = c.stage_offload or ([c.offload] if c.offload else [])
    if any(rec):
        text += " recompute=" + "|".join(",".join(r) or "-" for r in rec)
    if any(off):
        text += " offload=" + "|".join(",".join(o) or "-" for o in off)
    if c.optimizer_offload_fraction:
        text += f" optimizer-offload={c.optimizer_offload_fraction:g}"
    return text


def _why(best: Plan, other: Plan) -> str:
    a, b = best.estimate, other.estimate
    assert a is not None and b is not None
    gain = b.step_time_s / a.step_time_s - 1
    diffs = {name: getattr(b.time, k) - getattr(a.time, k) for k, name in TIME_PARTS.items()}
    name, delta = max(diffs.items(), key=lambda kv: kv[1])
    reason = (f"its {name} is {delta:.3g} s shorter per step" if delta > 0
              else "its components add up shorter")
    return (f"{gain:.1%} faster than the runner-up ({describe(other)}): {reason}; peak "
            f"{a.memory.peak_gb:.1f} GB vs {b.memory.peak_gb:.1f} GB")


def interval_sentence(e: Estimate) -> str:
    """The 80 % interval and the unvalidated effects an estimate leans on, in words."""
    if e.interval is None:
        return "no interval"
    lo, hi = e.interval.tokens_per_s_per_gpu
    weak = [a.term for a in e.assumptions if not a.validated]
    return (f"80% interval {lo:,.0f}–{hi:,.0f} tokens/s/GPU (from {e.interval.rows} held-out "
            f"published runs, {e.interval.regime}); memory headroom "
            f"{e.memory.headroom_gb:.1f} GB against a {e.memory.margin_gb:.1f} GB margin; "
            + ("not backed by any published run: " + "; ".join(weak) if weak
               else "every modelled effect is backed by published runs"))


def robust_sentences(best: Plan, result: SearchResult) -> list[str]:
    """What the winner wins by, and the best plan that rests on validated terms only."""
    e = best.estimate
    assert e is not None
    weak = [a.term for a in e.assumptions if not a.validated]
    out = [f"ranked by {'the low end of the interval' if result.objective == 'robust' else 'the point estimate'}"
           f" (--objective {result.objective})"
           + (f"; it wins by effects no published run backs: {'; '.join(weak)}" if weak else "")]
    v = result.best_validated
    if weak and v is not None and v.estimate is not None and v.estimate.interval is not None:
        lo = v.estimate.interval.tokens_per_s_per_gpu[0]
        out.append(f"best plan using validated effects only: {describe(v)}, "
                   f"{v.estimate.tokens_per_s_per_gpu:,.0f} tokens/s/GPU (low end {lo:,.0f}), "
                   f"headroom {v.estimate.memory.headroom_gb:.1f} GB against a "
                   f"{v.estimate.memory.margin_gb:.1f} GB margin")
    elif weak:
        out.append("no plan the search priced rests on validated effects only")
    return out


def explain_plans(plans: list[Plan], result: SearchResult) -> list[Plan]:
    """Attach explanations: what each plan is, its bottleneck, why the best beats the next,
    and which rules and bounds removed the other candidates."""
    pruned = ", ".join(f"{k} {v}" for k, v in result.pruned.most_common())
    out = []
    for i, p in enumerate(plans):
        e = p.estimate
        assert e is not None
        lines = [f"#{i + 1}: {describe(p)}",
                 f"step {e.step_time_s:.3g} s, {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
                 f"MFU {e.mfu:.1%}, peak {e.memory.peak_gb:.1f} GB; bottleneck: {e.bottleneck}"]
        lines.append(interval_sentence(e))
        if i + 1 < len(plans):
            lines.append(_why(p, plans[i + 1]))
        if i == 0:
            lines += robust_sentences(p, result)
            lines.append(f"searched {result.layouts} valid layouts: {result.screened} "
                         f"screened with even stages, {result.solved} MILPs for the best; "
                         f"pruned: {pruned or 'none'}")
        out.append(p.model_copy(update={"explanation": lines}))
    return out
