"""`moeplan search`: every folded layout, pruned by rules and bounds, one MILP per survivor.

Branch and bound over layouts (DESIGN "planner"):
  1. enumerate candidate rows (numpy), pruning by named Megatron rules;
  2. bound every row at once: compute-only time at the best efficiency any kernel reaches, times
     the pipeline's fill factor (1 + (p−1)/(v·m)); weights + grads of a balanced stage against
     HBM (`memory_bound`: nothing can fit, whatever is recomputed or offloaded);
  3. visit rows in bound order; stop when the bound reaches the k-th best step time found;
  4. per row, a tighter bound from the layer costs (all layers' time spread perfectly over the
     pipeline); only rows it cannot rule out get the MILP (recompute/offload per module per
     rank, layers per stage, optimizer offload over a grid), and every MILP result is re-scored
     by `cost_models.estimate` so the ranking is the cost model's, not the MILP's algebra.
Layer costs depend on (tp, cp, ep, etp, mbs, dispatcher, overlap, precision) but not on dp, pp
or vpp, so they are computed once per such key.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cost_models.calibration import Calibration, calibration_for
from ..cost_models.estimate import estimate, lower_bound
from ..cost_models.memory import GB
from ..errors import InfeasibleError, SpecError
from ..specs import (
    OFFLOAD_MODULES,
    RECOMPUTE_MODULES,
    Choices,
    ClusterSpec,
    Layout,
    ModelSpec,
    Plan,
    TrainingSpec,
)
from .enumerate import COL, DISPATCHERS, Enumeration, SearchSpace, enumerate_layouts
from .explain import explain_plans
from .ilp import InfeasibleStages, StageSolution, balanced_layers, module_sets, solve
from .problem import OFFLOAD_PREFIX, LayerTable, layer_table, stage_problem

OPTIMIZER_OFFLOAD_GRID = (0.0, 0.5, 1.0)
AUTO_PRECISION = {"ampere": ("bf16",), "hopper": ("bf16", "fp8-tensorwise"),
                  "blackwell": ("bf16", "mxfp8")}
TARGETS = ("megatron", "moeplan")


def default_gbs(seq: int, tokens: int = 4 * 1024 * 1024) -> int:
    """About `tokens` per step, as a power of two sequences (so many layouts divide it)."""
    return 1 << max(0, round(math.log2(max(1.0, tokens / seq))))


@dataclass
class SearchResult:
    plans: list[Plan]
    layouts: int  # candidate layouts enumerated after the validity rules
    feasible: int  # layouts whose MILP found a plan that fits
    solved: int  # MILPs solved
    seconds: float
    pruned: Counter[str] = field(default_factory=Counter)
    stopped_early: bool = False

    def to_json(self) -> dict[str, Any]:
        """The `moeplan search --json` document (SPEC §4)."""
        return {
            "plans": [p.model_dump(mode="json") for p in self.plans],
            "searched": {"layouts": self.layouts, "feasible": self.feasible,
                         "seconds": round(self.seconds, 3), "milps_solved": self.solved,
                         "pruned": dict(sorted(self.pruned.items())),
                         "stopped_early": self.stopped_early},
        }


def search_space(cluster: ClusterSpec, precision: str, target: str) -> SearchSpace:
    """The axes a target can run: `megatron` is everything Megatron Core runs; `moeplan` is what
    `moeplan run` executes today (see `runtime/support.py`; a test keeps the two in step)."""
    if target not in TARGETS:
        raise SpecError(f"--target takes {' or '.join(TARGETS)}, got {target!r}.")
    if precision == "auto":
        precisions = AUTO_PRECISION[cluster.architecture]
    else:
        if not cluster.supports(precision):
            raise SpecError(f"--precision {precision}: {cluster.gpu} ({cluster.architecture}) "
                            "cannot run it; use bf16, auto, or an FP8 recipe the GPU has.")
        precisions = (precision,)
    if target == "moeplan":
        return SearchSpace(precisions=("bf16",), dispatchers=("alltoall", "allgather"),
                           allow_ep_overlap=False)
    return SearchSpace(precisions=precisions)


def _options(target: str) -> tuple[str, ...]:
    if target == "moeplan":
        return ()
    return tuple(RECOMPUTE_MODULES) + tuple(OFFLOAD_PREFIX + o for o in OFFLOAD_MODULES)


def _layout(row: np.ndarray) -> dict[str, Any]:
    return dict(tp=int(row[COL["tp"]]), cp=int(row[COL["cp"]]), dp=int(row[COL["dp"]]),
                pp=int(row[COL["pp"]]), vpp=int(row[COL["vpp"]]), ep=int(row[COL["ep"]]),
                etp=int(row[COL["etp"]]), mbs=int(row[COL["mbs"]]),
                num_microbatches=int(row[COL["nmb"]]),
                dispatcher=DISPATCHERS[int(row[COL["dispatcher"]])],
                ep_overlap=bool(row[COL["ep_overlap"]]),
                distributed_optimizer=bool(row[COL["dist_opt"]]))


def _bounds(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, enum: Enumeration,
            cal: Calibration) -> tuple[np.ndarray, np.ndarray]:
    """(time lower bound, static-memory lower bound in bytes) of every row, vectorised."""
    rows = enum.rows
    t0 = np.empty(len(enum.precisions))
    world = int(rows[0, COL["tp"]] * rows[0, COL["cp"]] * rows[0, COL["dp"]] * rows[0, COL["pp"]])
    for i, p in enumerate(enum.precisions):
        tr = training.model_copy(update={"precision": p})
        t0[i] = lower_bound(model, cluster, tr, 1, 1, world, 1, 1, 1, cal)[0]
    pp, vpp, m = rows[:, COL["pp"]], rows[:, COL["vpp"]], rows[:, COL["nmb"]]
    t = t0[rows[:, COL["precision"]]] * (1 + (pp - 1) / (vpp * m))
    cols = [COL["tp"], COL["cp"], COL["dp"], COL["pp"], COL["ep"], COL["etp"]]
    keys, inverse = np.unique(rows[:, cols], axis=0, return_inverse=True)
    per_key = np.array([lower_bound(model, cluster, training, *map(int, k), calibration=cal)[1]
                        for k in keys])
    return t, per_key[inverse.ravel()]


def _choices(sol: StageSolution, dense_first: int, pp: int, vpp: int, f: float,
             chunk_layers: list[int]) -> Choices:
    """Decode the MILP's per-rank sets and layer counts into a plan's Choices."""
    rec = [[o for o in opts if not o.startswith(OFFLOAD_PREFIX)] for opts in sol.options]
    off = [[o[len(OFFLOAD_PREFIX):] for o in opts if o.startswith(OFFLOAD_PREFIX)]
           for opts in sol.options]
    layers = list(chunk_layers)
    layers[0] += dense_first
    uniform = all(r == rec[0] for r in rec) and all(o == off[0] for o in off)
    return Choices(
        recompute=rec[0] if uniform else [],
        offload=off[0] if uniform else [],
        stage_recompute=None if uniform else rec,
        stage_offload=None if uniform else off,
        optimizer_offload_fraction=f,
        stage_layers=layers if pp * vpp > 1 else None,
    )


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    gpus: int | None = None,
    *,
    top_k: int = 5,
    precision: str | None = None,
    target: str = "megatron",
    time_limit_s: float | None = None,
    imbalance: float = 1.0,
    progress: Callable[[int, int], None] | None = None,
    space: SearchSpace | None = None,
    options: tuple[str, ...] | None = None,
) -> SearchResult:
    """The top-k plans for a model on a cluster, best first (SPEC §4 `moeplan search`).

    Raises InfeasibleError (exit 3) with the closest candidate when nothing fits.
    """
    start = time.perf_counter()
    world = gpus or cluster.num_gpus
    if not world:
        raise SpecError("search needs a GPU count: pass --gpus N or set num_gpus in the cluster.")
    cluster = cluster.with_gpus(world)
    space = space or search_space(cluster, precision or training.precision, target)
    cal = calibration_for(cluster.calibration)
    enum = enumerate_layouts(model, cluster, training, world, space)
    pruned: Counter[str] = Counter(enum.pruned)
    result = SearchResult([], len(enum.rows), 0, 0, 0.0, pruned)
    if not len(enum.rows):
        raise InfeasibleError(f"no valid layout of {model.name} on {world} GPUs: "
                              + ", ".join(f"{k} ×{v}" for k, v in pruned.most_common(4)))
    t_lb, mem_lb = _bounds(model, cluster, training, enum, cal)
    usable = (cluster.hbm_gb - cal.reserve_gb - cal.workspace_gb) * GB / (1 + cal.frag_frac)
    fits = mem_lb <= usable
    pruned["memory_bound"] += int((~fits).sum())
    options = _options(target) if options is None else options
    tables: dict[tuple, LayerTable] = {}
    sets_cache: dict[tuple, Any] = {}
    best: list[tuple[float, int, Plan]] = []  # heap of the top k, worst on top
    closest: tuple[float, Any] | None = None
    # tighter bound, still vectorised: every layer's time spread perfectly over the pipeline,
    # from layer costs computed once per (tp, cp, ep, etp, mbs, dispatcher, overlap, precision)
    key_cols = [COL[c] for c in ("tp", "cp", "ep", "etp", "mbs", "dispatcher", "ep_overlap",
                                 "precision")]
    cand = np.flatnonzero(fits)
    keys, first, inverse = np.unique(enum.rows[cand][:, key_cols], axis=0, return_index=True,
                                     return_inverse=True)
    work = np.empty(len(keys))
    for j in range(len(keys)):
        row = enum.rows[cand[first[j]]]
        prec = enum.precisions[int(row[COL["precision"]])]
        tr = training.model_copy(update={"precision": prec})
        layout = Layout(**_layout(row))
        tk = (layout.tp, layout.cp, layout.ep, layout.etp, layout.mbs, layout.dispatcher,
              layout.ep_overlap, prec)
        tables[tk] = layer_table(model, cluster, tr, layout, cal, imbalance)
        work[j] = tables[tk].total_time_s(cal.layer_overhead_s, model.mtp_layers)
    r = enum.rows[cand]
    pp, vpp, m = r[:, COL["pp"]], r[:, COL["vpp"]], r[:, COL["nmb"]]
    lb1 = np.maximum(t_lb[cand], (m + (pp - 1) / vpp) / pp * work[inverse.ravel()])
    t_lb = np.full(len(t_lb), np.inf)
    t_lb[cand] = lb1
    order = cand[np.lexsort((cand, lb1))]

    def kth() -> float:
        return -best[0][0] if len(best) >= top_k else float("inf")

    def push(plan: Plan, idx: int) -> None:
        entry = (-plan.estimate.step_time_s, -idx, plan)  # type: ignore[union-attr]
        if len(best) < top_k:
            heapq.heappush(best, entry)
        elif entry > best[0]:
            heapq.heapreplace(best, entry)

    no_choice = Choices()
    offload_all = [o[len(OFFLOAD_PREFIX):] for o in options if o.startswith(OFFLOAD_PREFIX)]
    selective = [o for o in options if not o.startswith(OFFLOAD_PREFIX)
                 and o not in ("full", "moe") and (o != "mla_up_proj" or model.attention == "mla")]
    max_saving = {  # the least memory any choice reaches, by whether EP overlap is on
        False: Choices(recompute=["full"] if "full" in options else [], offload=offload_all,
                       optimizer_offload_fraction=1.0 if options else 0.0),
        True: Choices(recompute=selective, offload=offload_all,
                      optimizer_offload_fraction=1.0 if options else 0.0)}
    refine: list[tuple[int, Layout, TrainingSpec, tuple]] = []
    for n, idx in enumerate(order):
        if progress and n % 500 == 0:
            progress(n, len(order))
        if t_lb[idx] >= kth():
            pruned["time_bound"] += len(order) - n
            break
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            result.stopped_early = True
            pruned["time_limit"] += len(order) - n
            break
        row = enum.rows[idx]
        prec = enum.precisions[int(row[COL["precision"]])]
        tr = training.model_copy(update={"precision": prec})
        layout = Layout(**_layout(row))
        key = (layout.tp, layout.cp, layout.ep, layout.etp, layout.mbs, layout.dispatcher,
               layout.ep_overlap, prec)
        if key not in tables:
            tables[key] = layer_table(model, cluster, tr, layout, cal, imbalance)
        table = tables[key]
        # the balanced layout without recompute or offload: an upper bound when it fits
        e0 = estimate(model, cluster, tr, layout, no_choice)
        if e0.fits:
            result.feasible += 1
            push(Plan(model=model, cluster=cluster, training=tr, layout=layout,
                      choices=no_choice, estimate=e0), int(idx))
            refine.append((int(idx), layout, tr, key))
            continue
        if options and not estimate(model, cluster, tr, layout,
                                    max_saving[layout.ep_overlap]).fits:
            pruned["memory_bound"] += 1
            if closest is None or e0.memory.peak_gb < closest[0]:
                closest = (e0.memory.peak_gb, layout)
            continue
        plan = _solve_layout(model, cluster, tr, layout, cal, table, options, key, sets_cache,
                             result, target, balanced=True, lb_pipe=float(t_lb[idx]))
        if plan is None or not plan.estimate.fits:  # type: ignore[union-attr]
            pruned["memory_milp"] += 1
            if closest is None or e0.memory.peak_gb < closest[0]:
                closest = (e0.memory.peak_gb, layout)
            continue
        result.feasible += 1
        push(plan, int(idx))
        refine.append((int(idx), layout, tr, key))
    # screening used balanced stages; for the plans on top, the MILP also places the layers:
    # uneven first and last stages can beat the balanced split (embedding, loss, MTP)
    on_top = {-e[1] for e in best}
    for idx, layout, tr, key in refine:
        if idx not in on_top or layout.pp == 1:
            continue
        plan = _solve_layout(model, cluster, tr, layout, cal, tables[key], options, key,
                             sets_cache, result, target, lb_pipe=float(t_lb[idx]))
        if plan is None or not plan.estimate.fits:  # type: ignore[union-attr]
            continue
        k = next(i for i, e in enumerate(best) if -e[1] == idx)
        if plan.estimate.step_time_s < -best[k][0]:  # type: ignore[union-attr]
            best[k] = (-plan.estimate.step_time_s, -idx, plan)  # type: ignore[union-attr]
            heapq.heapify(best)
    result.seconds = time.perf_counter() - start
    if not best:
        raise InfeasibleError(_infeasible_message(model, cluster, training, world, enum, mem_lb,
                                                  cal, closest))
    plans = [p for _, _, p in sorted(best, key=lambda e: (e[0], e[1]), reverse=True)]
    result.plans = explain_plans(plans, result)
    return result


def _solve_layout(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                  layout: Layout, cal: Calibration, table: LayerTable, options: tuple[str, ...],
                  key: tuple, sets_cache: dict, result: SearchResult,
                  target: str, balanced: bool = False, lb_pipe: float = 0.0) -> Plan | None:
    """The MILP for one layout at each optimizer-offload fraction of the grid, decoded into
    Plans and re-scored by the cost model; the fastest that fits, or None.

    A fraction is skipped when even the pipeline's lower bound plus that fraction's optimizer
    time cannot beat the best plan found at a smaller one; larger fractions are tried only when
    the plan without optimizer offload needed recompute or offload (memory pressure).
    """
    grid = (0.0,) if target == "moeplan" or not options else OPTIMIZER_OFFLOAD_GRID
    best: Plan | None = None
    base_const: float | None = None
    for f in grid:
        built = stage_problem(model, cluster, training, layout, cal, table, options, f)
        if base_const is None:
            base_const = built.constant_s
        extra = built.constant_s - base_const  # optimizer time the fraction adds
        if best is not None and lb_pipe + base_const + extra >= best.estimate.step_time_s:  # type: ignore[union-attr]
            continue
        P = built.problem
        skey = (key, P.items[P.layer_item].name, tuple(i.name for i in P.items))
        if skey not in sets_cache:
            sets_cache[skey] = module_sets(P.items, P.options, P.exclusive, P.host_s_per_byte)
        result.solved += 1
        try:
            sol = solve(P, sets_cache[skey], balanced_layers(P) if balanced else None)
        except InfeasibleStages:
            continue
        choices = _choices(sol, built.leading_layers, layout.pp, layout.vpp, f,
                           P.chunk_layers(sol.layers))
        est = estimate(model, cluster, training, layout, choices)
        if est.fits and (best is None or est.step_time_s < best.estimate.step_time_s):  # type: ignore[union-attr]
            best = Plan(model=model, cluster=cluster, training=training, layout=layout,
                        choices=choices, estimate=est)
        if f == 0.0 and not any(sol.options):
            break  # no memory pressure: offloading the optimizer only adds time
    return best


def _infeasible_message(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                        world: int, enum: Enumeration, mem_lb: np.ndarray, cal: Calibration,
                        closest: tuple[float, Layout] | None) -> str:
    """What came closest and what would make it fit."""
    budget_gb = cluster.hbm_gb - cal.reserve_gb
    if closest is not None:  # fits on weights, not with the activations it must keep
        need_gb, lay = closest
        where = (f"tp={lay.tp} cp={lay.cp} pp={lay.pp} ep={lay.ep} etp={lay.etp} mbs={lay.mbs} "
                 f"peaks at {need_gb:.0f} GB per GPU with the least memory this target allows")
    else:
        i = int(np.argmin(mem_lb))
        ax = _layout(enum.rows[i])
        need_gb = (mem_lb[i] * (1 + cal.frag_frac)) / GB + cal.workspace_gb
        where = (f"tp={ax['tp']} pp={ax['pp']} ep={ax['ep']} etp={ax['etp']} needs at least "
                 f"{need_gb:.0f} GB per GPU for weights and gradients alone, with every "
                 "activation recomputed or offloaded and the optimizer on the host")
    ratio = need_gb / budget_gb
    gpus_needed = world * 2
    while gpus_needed < world * ratio * 1.15:
        gpus_needed *= 2
    bigger = [("h200", 141), ("b200", 180), ("b300", 288), ("gb300-nvl72", 288)]
    larger = [name for name, gb in bigger if gb > cluster.hbm_gb * max(1.0, ratio)]
    hints = [f"about {gpus_needed} GPUs of this kind"]
    if training.precision == "bf16" and cluster.fp8_tflops:
        hints.append("an FP8 recipe (--precision auto) to shrink activations")
    if larger:
        hints.append(f"a larger-memory GPU ({', '.join(larger)})")
    return (f"nothing fits {model.name} on {world} × {cluster.gpu} ({budget_gb:.0f} GB usable "
            f"each). Closest: {where}. To fit: " + "; or ".join(hints) + ".")
