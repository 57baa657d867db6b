"""What a plan's step and memory consist of, read from the cost model's own breakdown.

The reports draw a plan's step time split into its terms, its memory per pipeline rank against
the line `fits` is judged by, and its pipeline schedule. Each comes from the numbers the
estimate itself computed (`cost_models.estimate.estimate_breakdown`, the fit line
`cost_models.uncertainty.max_peak_gb`, the schedule orders `specs.schedule`), never from a
second model of the same thing, so a picture cannot disagree with the table beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cost_models.breakdown import Breakdown
from ..cost_models.calibration import calibration_for
from ..cost_models.estimate import estimate_breakdown
from ..cost_models.memory import GB, HOST_USABLE
from ..cost_models.uncertainty import default_profile, max_peak_gb
from ..specs import Plan
from ..specs.schedule import merged_schedule, schedule
from .svg import Block

# step-time terms, in drawing order, with one colour each across every chart and plan
STEP_PARTS = (
    ("compute", "#4e79a7"), ("optimizer step", "#b07aa1"), ("recompute", "#f28e2b"),
    ("offload (exposed copies)", "#edc948"), ("pipeline bubble", "#bab0ac"),
    ("exposed TP/CP comm", "#e15759"), ("exposed EP comm", "#76b7b2"),
    ("exposed DP/PP comm", "#59a14f"), ("exposed comm (all classes)", "#e15759"),
    ("fixed step overhead", "#9c755f"), ("unmodelled (measured for this model)", "#d37295"),
)
MEMORY_PARTS = (("weights", "#4e79a7"), ("grads", "#f28e2b"), ("optimizer", "#59a14f"),
                ("activations", "#e15759"), ("buffers", "#76b7b2"))


def breakdown(plan: Plan) -> Breakdown | None:
    """The cost model's per-rank breakdown of the plan, when it reproduces the plan's estimate
    (an estimate made with a routing imbalance, which the plan file does not record, does
    not: then the pictures fall back to the estimate's own coarser terms)."""
    est = plan.estimate
    if est is None:
        return None
    b = estimate_breakdown(plan.model, plan.cluster, plan.training, plan.layout, plan.choices,
                           priced_imbalance(plan), check=False, with_interval=False)
    same = abs(b.estimate.step_time_s - est.step_time_s) <= 1e-9 * est.step_time_s and abs(
        b.estimate.memory.peak_gb - est.memory.peak_gb) <= 1e-9 * max(est.memory.peak_gb, 1)
    return b if same else None


def step_parts(plan: Plan, b: Breakdown | None = None) -> dict[str, float]:
    """The step time as terms that add up to it (seconds; zero terms left out).

    step = compute (incl. the optimizer step) + recompute + offload + bubble + exposed comm
    + the fixed per-step overhead + a model's measured residual (cost_models.estimate); the
    breakdown splits compute from the optimizer step and the exposed communication by class:
    TP/CP inside the layers, EP, and DP (+ the pipeline's point-to-point sends, which the
    estimate sums with DP)."""
    est = plan.estimate
    assert est is not None
    t = est.time
    overhead = est.step_time_s - (t.compute_s + t.recompute_s + t.offload_s + t.pp_bubble_s
                                  + t.exposed_comm_s + est.unmodelled_s)
    parts = {"recompute": t.recompute_s, "offload (exposed copies)": t.offload_s,
             "pipeline bubble": t.pp_bubble_s}
    b = b if b is not None else breakdown(plan)
    if b is None:
        parts = {"compute": t.compute_s, **parts, "exposed comm (all classes)": t.exposed_comm_s}
    else:
        m = plan.layout.num_microbatches
        crit = max(b.ranks, key=lambda r: r.time_s)
        compute = m * sum(c.fwd_s + c.bwd_s for c in crit.chunks)
        in_layers = m * sum(c.exposed_comm_s for c in crit.chunks)
        ep = m * sum(c.ep_exposed_s for c in crit.chunks)
        parts = {"compute": compute, "optimizer step": t.compute_s - compute, **parts,
                 "exposed TP/CP comm": in_layers - ep, "exposed EP comm": ep,
                 "exposed DP/PP comm": t.exposed_comm_s - in_layers}
    parts["fixed step overhead"] = overhead
    parts["unmodelled (measured for this model)"] = est.unmodelled_s
    order = [name for name, _ in STEP_PARTS]
    return {k: max(0.0, parts[k]) for k in order if k in parts and parts[k] > 1e-12}


def fit_line_gb(plan: Plan) -> float:
    """The largest peak that fits: HBM − reserve − margin, by the one rule `fits` uses
    (`cost_models.uncertainty.max_peak_gb`)."""
    return max_peak_gb(plan.cluster, calibration_for(dict(plan.cluster.calibration or {})))


def fit_failure(plan: Plan) -> str | None:
    """Why a plan does not fit, by what it overflows (None when it fits): its most loaded GPU's
    peak above the fit line (`fit_line_gb`), or what that GPU's process offloads above its share
    of the host's memory (`cost_models.memory.HOST_USABLE`), the two things `fits` judges. Every
    "does not fit" sentence (estimate, the reports, the export's warning) is this one."""
    est = plan.estimate
    assert est is not None
    if est.fits:
        return None
    mem, line = est.memory, fit_line_gb(plan)
    if mem.peak_gb > line:
        return (f"its most loaded GPU peaks at {mem.peak_gb:.1f} GB, above the fit line of "
                f"{line:.1f} GB ({fit_rule_words(plan)})")
    room = HOST_USABLE * plan.cluster.host_memory_gb
    return (f"its most loaded GPU's process offloads {mem.host_gb:.1f} GB to the host, more "
            f"than the {room:.0f} GB it may hold there ({HOST_USABLE:.0%} of the "
            f"{plan.cluster.host_memory_gb:g} GB of host memory per GPU; its HBM peak of "
            f"{mem.peak_gb:.1f} GB is under the fit line of {line:.1f} GB)")


def fit_rule_words(plan: Plan) -> str:
    """The fit line's terms in words, with this cluster's numbers."""
    cal = calibration_for(dict(plan.cluster.calibration or {}))
    rel = default_profile().memory_rel_error
    return (f"HBM {plan.cluster.hbm_gb:g} GB − {cal.reserve_gb:g} GB reserve − a margin of "
            f"{rel:.0%} of the peak, the memory model's measured error")


def priced_imbalance(plan: Plan) -> float:
    """The routing imbalance the plan's estimate was priced at (1: balanced, none yet, or not
    recorded)."""
    return (plan.estimate.imbalance or 1.0) if plan.estimate is not None else 1.0


def rank_memory(plan: Plan, b: Breakdown | None = None) -> list[dict[str, float]]:
    """Per pipeline rank: weights, grads, optimizer, activations, buffers (GB), from the cost
    model's own per-rank accounting (the peak in the Estimate is the largest of these)."""
    b = b if b is not None else estimate_breakdown(
        plan.model, plan.cluster, plan.training, plan.layout, plan.choices, priced_imbalance(plan),
        check=False, with_interval=False)
    return [{"weights": r.static.weights / GB, "grads": r.static.grads / GB,
             "optimizer": r.static.optimizer / GB, "activations": r.activation_bytes / GB,
             "buffers": r.buffer_bytes / GB} for r in b.ranks]


@dataclass(frozen=True)
class Timeline:
    """The schedule drawn: blocks, and how many of the plan's micro-batches they cover."""

    blocks: list[Block]
    microbatches: int
    of: int
    paired: bool


def drawn_microbatches(pp: int, vpp: int, m: int) -> int:
    """Micro-batches to draw: all of them when few, else enough for the warm-up, a steady
    state and the cool-down (2·pp; pp when an interleaved schedule would need thousands of
    blocks); interleaving needs a multiple of pp."""
    want = max(2 * pp, 4)
    if vpp > 1 and 2 * pp * pp * vpp * 2 > 4000:
        want = pp
    if m <= want:
        return m
    return want - want % pp if vpp > 1 else want


def timeline(plan: Plan, b: Breakdown | None = None) -> Timeline | None:
    """Each pipeline rank's passes in the order the runtime and Megatron run them
    (`specs.schedule`: 1F1B, interleaved, or the EP-overlap merged order), timed by the cost
    model's per-chunk forward and backward times (a chunk's exposed communication and offload
    copies split between its two passes, recompute in the backward) and by when the pass it
    depends on (previous stage's forward, next stage's backward) ends. Point-to-point latency
    is not drawn. None when the order cannot be played (it always can for Megatron's)."""
    L = plan.layout
    pp, vpp = L.pp, L.vpp
    m = drawn_microbatches(pp, vpp, L.num_microbatches)
    # the pass times of the plan at the routing imbalance its estimate was priced at
    b = b if b is not None else estimate_breakdown(
        plan.model, plan.cluster, plan.training, plan.layout, plan.choices, priced_imbalance(plan),
        check=False, with_interval=False)
    fwd = [[0.0] * vpp for _ in range(pp)]
    bwd = [[0.0] * vpp for _ in range(pp)]
    for r, rc in enumerate(b.ranks):
        for v, ch in enumerate(rc.chunks):
            side = (ch.exposed_comm_s + ch.offload_s) / 2
            fwd[r][v] = ch.fwd_s + side
            bwd[r][v] = ch.bwd_s + ch.recompute_s + side
    blocks = play(pp, vpp, m, fwd, bwd, bool(L.ep_overlap))
    return None if blocks is None else Timeline(blocks, m, L.num_microbatches,
                                                bool(L.ep_overlap))


def play(pp: int, vpp: int, m: int, fwd: list[list[float]], bwd: list[list[float]],
         paired: bool) -> list[Block] | None:
    """Play each rank's order (`specs.schedule`) with pass times `fwd[rank][chunk]`,
    `bwd[rank][chunk]`: a pass starts when its rank is free and the pass it needs has ended
    (the previous virtual stage's forward of the micro-batch; the next stage's backward, or
    for the last stage its own forward). A merged EP-overlap step runs its forward and
    backward together, for the sum of their times. None if the orders deadlock."""
    steps: list[list[list[tuple[str, int, int]]]] = []
    for r in range(pp):
        if paired:
            steps.append([[a for a in (("F", *f) if f else None, ("B", *bk) if bk else None)
                           if a] for f, bk in merged_schedule(pp, vpp, r, m)])
        else:
            steps.append([[a] for a in schedule(pp, vpp, r, m)])
    last = pp * vpp - 1
    done: dict[tuple[str, int, int], float] = {}

    def needs(kind: str, r: int, v: int, mb: int) -> tuple[str, int, int] | None:
        s = v * pp + r
        if kind == "F":
            return ("F", s - 1, mb) if s > 0 else None
        return ("B", s + 1, mb) if s < last else ("F", s, mb)

    ptr, free, blocks = [0] * pp, [0.0] * pp, []
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while ptr[r] < len(steps[r]):
                step = steps[r][ptr[r]]
                deps = [d for k, v, mb in step if (d := needs(k, r, v, mb)) is not None]
                if any(d not in done for d in deps):
                    break
                start = max([free[r], *(done[d] for d in deps)])
                dur = sum((fwd if k == "F" else bwd)[r][v] for k, v, _ in step)
                for k, v, mb in step:
                    done[(k, v * pp + r, mb)] = start + dur
                    blocks.append(Block(r, start, start + dur, k, v, mb, len(step) > 1))
                free[r], ptr[r], moved = start + dur, ptr[r] + 1, True
    if any(p < len(s) for p, s in zip(ptr, steps, strict=True)):
        return None
    return blocks
