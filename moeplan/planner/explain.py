"""Why a plan wins: short sentences for the table and the Plan JSON's `explanation`."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from .. import limits
from ..cost_models.calibration import Calibration
from ..cost_models.memory import GB
from ..cost_models.uncertainty import max_peak_gb
from ..specs import ClusterSpec, Estimate, Layout, ModelSpec, Plan, TrainingSpec
from ..specs.loader import cluster_presets
from ..specs.training import priced_on
from ..terminal import figure, plural, share

if TYPE_CHECKING:
    from .enumerate import Enumeration, SearchSpace
    from .search import SearchResult

TIME_PARTS = {
    "compute_s": "compute", "pp_bubble_s": "pipeline bubble", "recompute_s": "recompute",
    "offload_s": "offload", "exposed_comm_s": "exposed communication",
}


def describe(plan: Plan) -> str:
    """The plan in the shared vocabulary (`Plan.summary`), so a sentence names a choice with
    the same word as the table above it and the README."""
    return plan.summary()


def _why(best: Plan, other: Plan) -> str:
    """Why `best` beats `other`: the step-time difference and the components that make it up,
    gains and losses both, so the parts add up to the difference the user sees."""
    a, b = best.estimate, other.estimate
    assert a is not None and b is not None
    gain = b.step_time_s / a.step_time_s - 1
    step_delta = b.step_time_s - a.step_time_s
    diffs = [(name, getattr(b.time, k) - getattr(a.time, k)) for k, name in TIME_PARTS.items()]
    # a model's measured residual scales with the step, so it is part of any gap between plans
    diffs.append(("unmodelled time", b.unmodelled_s - a.unmodelled_s))
    moved = sorted((d for d in diffs if abs(d[1]) >= 5e-4 * b.step_time_s),
                   key=lambda d: -abs(d[1]))[:3]
    rest = step_delta - sum(d for _, d in moved)  # the terms not named, so the parts add up
    if moved and abs(rest) >= 5e-4 * b.step_time_s:
        moved.append(("the other terms", rest))
    parts = [f"{name} {abs(d):.3g} s {'shorter' if d > 0 else 'longer'}" for name, d in moved]
    reason = ("per step: " + ", ".join(parts)) if parts else "its components add up shorter"
    choices = _distinct(best, other)
    head = (f"{gain:.1%} ({step_delta:.3g} s per step) faster than the runner-up" if gain >= 0
            else f"ranked above the runner-up by its interval's low end, though "
                 f"{-gain:.1%} ({-step_delta:.3g} s per step) slower at the point estimate")
    return (f"{head} ({describe(other)}){choices}: {reason}; peak "
            f"{a.memory.peak_gb:.1f} GB vs {b.memory.peak_gb:.1f} GB")


def _distinct(best: Plan, other: Plan) -> str:
    """The layout and choice tokens in which the two plans differ, as ` (differs in: …)`."""
    mine = best.layout_summary().split() + best.choice_tokens()
    theirs = set(other.layout_summary().split() + other.choice_tokens())
    diff = [t for t in mine if t not in theirs]
    return f", this plan has {' '.join(diff)}" if diff else ""


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


def searched_sentence(result: SearchResult, plan: Plan, most: int = 6) -> str:
    """How much was searched and what removed the rest, each reason in words with its count
    (the codes stay in `--json`'s `searched.pruned`): the valid layouts the bounds set aside,
    then the candidate splits the rules refused (another unit: they never were layouts)."""
    from .branch import BOUNDS
    from .enumerate import SAME_JOB

    def words(items: list[tuple[str, int]], n: int) -> str:
        said = "; ".join(f"{v:,} {rule_words(k, plan.model, plan.training, plan.cluster)}"
                         for k, v in items[:n])
        rest = items[n:]
        return said + (f"; {sum(v for _, v in rest):,} for {len(rest)} more reason"
                       f"{'s' if len(rest) > 1 else ''} (--json: searched.pruned)"
                       if rest else "")

    cut = [(k, v) for k, v in result.pruned.most_common() if v > 0]
    bounds = [(k, v) for k, v in cut if k in BOUNDS]
    same = [(k, v) for k, v in cut if k in SAME_JOB]
    rules = [(k, v) for k, v in cut if k not in BOUNDS and k not in SAME_JOB]
    out = (f"searched {plural(result.layouts, 'valid layout')}: {result.screened:,} screened "
           f"at even and levelled stages, {result.solved} MILPs for the best; set aside: "
           f"{words(bounds, most) or 'none'}")
    if rules:
        out += (f". Before that, the rules refused {sum(v for _, v in rules):,} candidate "
                f"splits: {words(rules, max(1, most - len(bounds[:most])))}")
    if same:  # not refusals: copies of a kept job, a setting that changes nothing at its sizes
        out += (f"; {plural(sum(v for _, v in same), 'row')} repeating a kept job were not "
                f"enumerated: {words(same, len(same))}")
    return out


def explain_plans(plans: list[Plan], result: SearchResult) -> list[Plan]:
    """Attach explanations: what each plan is, its bottleneck, why the best beats the next,
    and which rules and bounds removed the other candidates."""
    out = []
    for i, p in enumerate(plans):
        e = p.estimate
        assert e is not None
        lines = [f"#{i + 1}: {describe(p)}",
                 f"step {e.step_time_s:.3g} s, {figure(e.tokens_per_s_per_gpu)} tokens/s/GPU, "
                 f"MFU {share(e.mfu)}, peak {e.memory.peak_gb:.1f} GB; bottleneck: {e.bottleneck}"]
        lines.append(interval_sentence(e))
        if i + 1 < len(plans):
            lines.append(_why(p, plans[i + 1]))
        if i == 0:
            lines += robust_sentences(p, result)
            lines += [searched_sentence(result, p), stack_sentence(p)]
        out.append(p.model_copy(update={"explanation": lines}))
    return out


def terminal_notes(result: SearchResult) -> list[str]:
    """The sentences under the search table: why #1 beats #2 (one line, the ranking key's two
    values), the winner's interval, what it rests on, and what was searched. The longer
    term-by-term comparison stays in the plans' `explanation`."""
    best = result.plans[0]
    assert best.estimate is not None
    line = ranking_line(result.plans, result.objective)
    return ([line] if line else []) + [interval_sentence(best.estimate),
                                       *robust_sentences(best, result),
                                       searched_sentence(result, best, 4), stack_sentence(best)]


def stack_sentence(plan: Plan) -> str:
    """The software stack the plans were priced on and kept to, in words (`--stack`)."""
    stack = plan.training.software_stack
    return priced_on(stack) + ("; --stack names an older one" if stack == "current" else "")


# ------------------------------------------------------------------- the ranking, in one line
def ranking_line(plans: list[Plan], objective: str) -> str | None:
    """Why #1 ranks above #2, in one sentence that names the ranking key and its two values,
    and, when #2 looks better on a figure the table shows, why that does not count."""
    if len(plans) < 2:
        return None
    a, b = plans[0].estimate, plans[1].estimate
    assert a is not None and b is not None
    if objective == "expected" or a.interval is None or b.interval is None:
        ka, kb = a.tokens_per_s_per_gpu, b.tokens_per_s_per_gpu
        head = (f"#1 ranks above #2 by the point estimate of tokens/s/GPU (the ranking key, "
                f"--objective expected): {_pair(ka, kb)}")
        if ka == kb:
            return head + _tie_break(a, b, "step")
        return head + f" ({ka / kb - 1:+.1%})."
    ka, kb = a.interval.tokens_per_s_per_gpu[0], b.interval.tokens_per_s_per_gpu[0]
    head = (f"#1 ranks above #2 by the low end of the 80% interval of tokens/s/GPU (the "
            f"ranking key, --objective robust): {_pair(ka, kb)}")
    if ka == kb:
        return head + _tie_break(a, b, "expected step")
    if b.tokens_per_s_per_gpu <= a.tokens_per_s_per_gpu:
        return head + f", and {_pair(a.tokens_per_s_per_gpu, b.tokens_per_s_per_gpu)} at " \
                      "the point estimate."
    gap = b.tokens_per_s_per_gpu / a.tokens_per_s_per_gpu - 1
    pa, pb = a.interval.pessimistic_tokens_per_s_per_gpu, b.interval.pessimistic_tokens_per_s_per_gpu
    why = (f"; with its unvalidated effects failing #2 makes {pb:,.0f} against #1's {pa:,.0f}"
           if pa is not None and pb is not None and pb < pa else
           "; its interval reaches lower")
    return (head + f". #2 is {gap:.1%} faster at the point estimate "
            f"({_pair(b.tokens_per_s_per_gpu, a.tokens_per_s_per_gpu)})" + why + ".")


def _pair(x: float, y: float) -> str:
    """Two figures that read apart: whole numbers, or one decimal where those are equal; one
    figure for both where they are the same number (a tie reads as one)."""
    if x == y:
        return f"both {x:,.0f}"
    a, b = f"{x:,.0f}", f"{y:,.0f}"
    if a == b:
        a, b = f"{x:,.1f}", f"{y:,.1f}"
    return f"{a} vs {b}"


def _tie_break(a: Estimate, b: Estimate, step: str) -> str:
    """The end of a sentence on a tie of the ranking key: the two step times that broke it,
    in as many digits as make them read apart, or, where they are equal too, that nothing
    did (two plans priced alike are listed in the search's order)."""
    x, y = a.step_time_s, b.step_time_s
    if x == y:
        return (f"; a tie on the {step} too ({x:.3g} s): the two price the same, and #1 is "
                "listed first in the search's order.")
    digits = next(d for d in range(3, 18) if f"{x:.{d}g}" != f"{y:.{d}g}")
    return f"; a tie, broken by the shorter {step} ({x:.{digits}g} s vs {y:.{digits}g} s)."


# ------------------------------------------------------------------ rules, in words
def rule_words(rule: str, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec
               ) -> str:
    """A validity or pruning rule (`enumerate.py`, `search.py` counters) as a sentence with
    this problem's numbers; the rule's code stays in the JSON (`searched.pruned`)."""
    words = {
        "gbs_divisible": f"the global batch ({training.global_batch_size:,} sequences) must "
                         "divide evenly by data-parallel size × micro-batch size",
        "too_many_stages": f"pipeline stages cannot outnumber the {model.num_layers} layers",
        "heads_divisible_by_tp": f"tensor parallel must divide the {model.num_attention_heads} "
                                 "attention heads" + (
                                     f" and the {model.kv_heads} KV heads"
                                     if model.kv_heads != model.num_attention_heads else ""),
        "ffn_divisible_by_tp": f"tensor parallel must divide the FFN size "
                               f"({model.ffn_hidden_size:,})",
        "seq_divisible_by_2cp": f"context parallel needs the sequence length "
                                f"({training.seq_len:,}) divisible by 2·cp",
        "seq_divisible_by_tp": "sequence parallel needs the sequence length per context "
                               "rank divisible by tp",
        "tp_cp_within_nvlink": f"tp·cp must stay inside one NVLink domain "
                               f"({cluster.nvlink_domain_gpus} GPUs)",
        "interleaved_microbatches": "the interleaved schedule needs the micro-batches per "
                                    "replica to be a multiple of pp",
        "expert_world_size": f"expert parallel (a divisor of the {model.num_experts} experts) × "
                             "expert tensor parallel × pp must divide the GPU count",
        "flex_inside_nvlink": "the flex dispatcher inside one NVLink domain is the all-to-all",
        "ep_overlap_needs_ep": "EP overlap needs expert parallel > 1",
        "ep_overlap_needs_vpp": "EP overlap with pp > 1 needs virtual pipeline stages",
        "ep_overlap_dispatcher": "EP overlap does not work with the allgather dispatcher",
        "target_max_tp": "the target executor caps tensor parallel",
        "target_max_cp": "the target executor caps context parallel",
        "target_max_pp": "the target executor caps pipeline parallel",
        "memory_bound": "cannot fit in memory even with every activation recomputed or "
                        "offloaded and the optimizer on the host",
        "memory_milp": "no recompute/offload choice fits in memory",
        "time_bound": "provably slower than the plans kept",
        "time_bound_milp": "provably slower than the plans kept (after its MILP)",
        "balanced_split_bound": "provably slower even with the best stage split",
        "robust_twin_bound": "a twin with validated effects only ranks at least as well",
        "robust_offload_bound": "slower, at the balanced and the levelled stage splits, once "
                                "its unvalidated offload is priced on a slow host",
        "screened_by_milp": "slower than the plans kept at the balanced and the levelled "
                            "stage splits",
        "milp_unsolved": "its MILP found no solution in time",
        "time_limit": "not reached before --time-limit",
    }
    if rule in words:
        return words[rule]
    from .enumerate import SAME_JOB

    if rule in SAME_JOB:
        return SAME_JOB[rule]
    from ..specs.rules import BY_NAME, STACK_FEATURES, STACK_RULES, stack_lacks

    stack = training.software_stack
    lacks = [STACK_FEATURES[k] for k in STACK_RULES.get(rule, ()) if stack_lacks(stack, k)]
    if lacks:  # the oldest feature of the rule the plans' software stack predates
        return (f"{lacks[0].words}, which the {stack} software stack predates (added in "
                f"{lacks[0].release})")
    # an executor rule: what the table says it checks

    return BY_NAME[rule].what if rule in BY_NAME else rule.replace("_", " ")


NEAREST_SCAN_S = 1.5  # seconds spent looking for nearby GPU counts and batches that work


def _has_layouts(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, world: int,
                 space: SearchSpace, target: str) -> bool:
    from .enumerate import enumerate_layouts

    return len(enumerate_layouts(model, cluster.with_gpus(world), training, world, space,
                                 target).rows) > 0


def nearest_working(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, world: int,
                    space: SearchSpace, budget_s: float = NEAREST_SCAN_S,
                    target: str = "megatron") -> tuple[int | None, int | None, int | None]:
    """(fewer GPUs, more GPUs, another global batch at `world` GPUs): the nearest values that
    have a valid layout for the target executor, found by enumerating each count (the rules
    are checked, not guessed), within `budget_s`; None where none was found in range or in
    time."""
    deadline = time.monotonic() + budget_s
    below = above = gbs = None
    for k in range(1, world):
        if time.monotonic() > deadline or (below and above):
            break
        if below is None and world - k >= max(1, world // 2) and _has_layouts(
                model, cluster, training, world - k, space, target):
            below = world - k
        if above is None and world + k <= min(limits.MAX_GPUS, 2 * world) and _has_layouts(
                model, cluster, training, world + k, space, target):
            above = world + k
    g0 = training.global_batch_size
    for k in range(1, g0):
        if time.monotonic() > deadline or gbs is not None:
            break
        for g in (g0 - k, g0 + k):
            if gbs is None and 0 < g <= limits.MAX_GLOBAL_BATCH and _has_layouts(
                    model, cluster, training.model_copy(update={"global_batch_size": g}),
                    world, space, target):
                gbs = g
    return below, above, gbs


def no_valid_layout(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, world: int,
                    space: SearchSpace, pruned: Counter[str], target: str = "megatron") -> str:
    """Exit 3's paragraph when no layout of `world` GPUs passes the rules: the rules that
    removed the candidates, in words, and the nearest GPU counts (and batch) that work."""
    rules = "; ".join(f"{rule_words(r, model, training, cluster)} "
                      f"({plural(n, 'candidate split')})" for r, n in pruned.most_common(4))
    below, above, gbs = nearest_working(model, cluster, training, world, space, target=target)
    counts = [f"{n:,}" for n in (below, above) if n is not None]
    near = (f"GPU counts near {world:,} that have valid layouts: {' and '.join(counts)} "
            f"(--gpus {counts[0].replace(',', '')})" if counts
            else f"no GPU count between {max(1, world // 2):,} and {2 * world:,} checked in "
                 "time has a valid layout")
    batch = (f"; or keep {world:,} GPUs with --gbs {gbs}" if gbs is not None else "")
    return (f"no valid layout of {model.name} on {world:,} GPUs: every way to split "
            f"{world:,} GPUs breaks a rule. {rules[0].upper() + rules[1:]}. {near}{batch}.")


def grad_reduce_saving_gb(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                          lay: Layout, cal: Calibration) -> float:
    """GB per GPU that reducing gradients in bf16 frees at layout `lay`: the main gradients a
    rank holds go from 4 bytes per parameter to 2 (`estimate.grad_reduce_bytes`), with the
    allocator's fragmentation on top, as `nothing_fits` counts memory; 0 when they already are
    bf16."""
    from ..cost_models.estimate import lower_bound

    if training.grad_reduce_dtype == "bf16":
        return 0.0
    bf16 = training.model_copy(update={"grad_reduce_dtype": "bf16"})
    axes = (lay.tp, lay.cp, lay.dp, lay.pp, lay.ep, lay.etp)
    held = [lower_bound(model, cluster, t, *axes, calibration=cal)[1] for t in (training, bf16)]
    return (held[0] - held[1]) * (1 + cal.frag_frac) / GB


def nothing_fits(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                        world: int, enum: Enumeration, mem_lb: np.ndarray, cal: Calibration,
                        closest: tuple[float, Layout] | None, grad_reduce_flag: bool = True
                        ) -> str:
    """What came closest and what would make it fit. `grad_reduce_flag`: whether the caller
    takes --grad-reduce (whatif does not), so that bf16 gradients are suggested only where the
    user can ask for them."""
    from .branch import layout_of_row

    budget_gb = max_peak_gb(cluster, cal)
    if closest is not None:  # fits on weights, not with the activations it must keep
        need_gb, lay = closest
        where = (f"{Plan(model=model, cluster=cluster, training=training, layout=lay).summary()}"
                 f" peaks at {need_gb:.0f} GB per GPU with the least memory this target allows")
    else:
        i = int(np.argmin(mem_lb))
        lay = Layout(**layout_of_row(enum.rows[i]), flex_backend=enum.flex_backend)
        need_gb = (mem_lb[i] * (1 + cal.frag_frac)) / GB + cal.workspace_gb
        where = (f"{Plan(model=model, cluster=cluster, training=training, layout=lay).summary()}"
                 f" needs at least {need_gb:.0f} GB per GPU for weights and gradients alone, "
                 "with every activation recomputed or offloaded and the optimizer on the host")
    ratio = need_gb / budget_gb
    gpus_needed = world * 2
    while gpus_needed < world * ratio * 1.15:
        gpus_needed *= 2
    larger = [c.name for c in cluster_presets() if c.hbm_gb > cluster.hbm_gb * max(1.0, ratio)]
    hints = [f"about {gpus_needed} GPUs of this kind"]
    if training.precision == "bf16" and cluster.fp8_tflops and closest is not None:
        # only where activations are what does not fit: weights and gradients stay bf16/fp32
        hints.append("an FP8 recipe (--precision auto) to shrink activations")
    saved_gb = grad_reduce_saving_gb(model, cluster, training, lay, cal) if grad_reduce_flag \
        else 0.0
    shown = f"{saved_gb:.0f}" if saved_gb >= 10 else f"{saved_gb:.1f}"
    also = ""
    if saved_gb > 0 and need_gb - saved_gb <= budget_gb:  # enough on its own: an alternative
        hints.append(f"gradients reduced in bf16 (--grad-reduce bf16), about {shown} GB less "
                     "per GPU at the closest layout")
    elif saved_gb > 0:
        also = (f" Gradients reduced in bf16 (--grad-reduce bf16) would free about {shown} GB "
                "per GPU at the closest layout, not enough on its own.")
    if larger:
        hints.append(f"a larger-memory GPU ({', '.join(larger)})")
    return (f"nothing fits {model.name} on {world} × {cluster.gpu} (a plan fits when its peak "
            f"leaves the memory margin free: at most {budget_gb:.0f} GB of {cluster.hbm_gb:g} GB "
            f"each). Closest: {where}. To fit: " + "; or ".join(hints) + "." + also)
