"""`moeplan search`: every folded layout, pruned by rules and bounds, a MILP for the best.

Branch and bound over layouts (DESIGN "planner"):
  1. enumerate candidate rows (numpy), pruning by named Megatron rules;
  2. bound every row at once: compute-only time at the best efficiency any kernel reaches, times
     the pipeline's fill factor (1 + (p−1)/(v·m)); weights + grads of a balanced stage against
     HBM (`memory_bound`: nothing can fit, whatever is recomputed or offloaded);
  3. visit rows in bound order from one heap; a row reaching the top gets the tighter bound of
     its layer costs (all layers' time spread perfectly over the pipeline), computed once per
     (tp, cp, ep, etp, mbs, dispatcher, overlap, precision) key, and goes back in; stop when the
     top bound reaches the k-th best step time found (`time_bound`);
  4. screen each visited row with its layers split evenly: the per-layout MILP then separates
     by pipeline rank and is solved exactly without a solver (`ilp.solve_fixed`), at each
     optimizer-offload fraction of a grid; a screened plan that can still enter the top k is
     re-scored by `cost_models.estimate`, so the ranking is the cost model's;
  5. for the top k, the MILP (`ilp.solve`, HiGHS) chooses layers per stage and recompute and
     offload per module per rank together; uneven first and last stages (embedding, loss, MTP)
     can beat the even split.
Layer costs do not depend on dp, pp or vpp, which is what makes one table per key enough.
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

from ..cost_models import uncertainty as U
from ..cost_models.calibration import Calibration, calibration_for
from ..cost_models.comm import placement
from ..cost_models.estimate import (
    bound_params,
    estimate,
    lower_bound,
    static_activation_budget_bytes,
)
from ..cost_models.memory import GB
from ..cost_models.uncertainty import max_peak_gb, pessimistic_layout
from ..errors import InfeasibleError, SpecError
from ..specs import Choices, ClusterSpec, Layout, ModelSpec, Plan, TrainingSpec
from ..specs.loader import cluster_presets
from ..specs.rules import TARGETS, Facts, check_target, violations
from ..specs.stage_layout import layers_layout_text, parse_stage_layout, stage_layout_for
from .enumerate import COL, DISPATCHERS, Enumeration, SearchSpace, enumerate_layouts
from .explain import explain_plans, no_valid_layout
from .ilp import (
    InfeasibleStages,
    SolverStopped,
    StageSolution,
    balanced_layers,
    evaluate,
    solve,
    solve_fixed,
)
from .problem import (
    OPTIONS,
    LayerTable,
    Menu,
    Option,
    layer_table,
    menu,
    recompute_pipeline_s,
    split_options,
    stage_problem,
)
from .sets import module_sets

OPTIMIZER_OFFLOAD_GRID = (0.0, 0.5, 1.0)
SCHEDULE_FIELDS = frozenset({"dp", "pp", "vpp", "mbs", "num_microbatches",
                             "distributed_optimizer"})
"""Layout fields that no modelled assumption reads (uncertainty.assumption_keys: the groups'
sizes and placements, the dispatcher and the stack settings), so the search looks a layout's
pessimistic variant up once for all schedules of its groups
(`test_pessimistic_variant_depends_on_no_schedule_field` keeps this true)."""
AUTO_PRECISION = {"ampere": ("bf16",), "hopper": ("bf16", "fp8-tensorwise"),
                  "blackwell": ("bf16", "mxfp8")}


def default_gbs(seq: int, tokens: int = 4 * 1024 * 1024) -> int:
    """About `tokens` per step, as a power of two sequences (so many layouts divide it)."""
    return 1 << max(0, round(math.log2(max(1.0, tokens / seq))))


@dataclass
class SearchResult:
    plans: list[Plan]
    layouts: int  # candidate layouts enumerated after the validity rules
    feasible: int  # layouts whose MILP found a plan that fits
    solved: int  # MILPs solved (HiGHS)
    seconds: float
    pruned: Counter[str] = field(default_factory=Counter)
    stopped_early: bool = False
    screened: int = 0  # rank-separable problems solved with even stages (per layout and fraction)
    objective: str = "robust"
    best_validated: Plan | None = None  # the best plan priced that rests on validated terms only

    def to_json(self) -> dict[str, Any]:
        """The `moeplan search --json` document (SPEC §4)."""
        return {
            "plans": [p.model_dump(mode="json") for p in self.plans],
            "searched": {"layouts": self.layouts, "feasible": self.feasible,
                         "seconds": round(self.seconds, 3), "milps_solved": self.solved,
                         "screened": self.screened,
                         "pruned": dict(sorted(self.pruned.items())),
                         "stopped_early": self.stopped_early},
            "objective": self.objective,
            "best_validated": (self.best_validated.model_dump(mode="json")
                               if self.best_validated is not None else None),
        }


@dataclass
class SearchCache:
    """Work that searches of the same model can share (a what-if sweep over GPU counts).

    Layer-cost tables and the module sets built from them depend on the model, the cluster's
    hardware, the sequence length, the precision and the layout key (tp, cp, ep, etp, mbs,
    dispatcher, overlap, and whether a tied output layer shares the first stage), plus where the
    tp/cp/ep/etp groups sit (inside one NVLink domain or not), but not on the GPU count or the
    batch: entries are keyed by exactly those, so a hit is the table the search would build.
    """

    tables: dict[tuple, LayerTable] = field(default_factory=dict)
    sets: dict[tuple, Any] = field(default_factory=dict)
    twins: dict[tuple, dict] = field(default_factory=dict)  # problem.layer_table's `shared`
    _sigs: dict[str, int] = field(default_factory=dict)

    def signature(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                  imbalance: float) -> int:
        """A small id for everything outside the layout key that layer costs depend on."""
        text = "\n".join((model.model_dump_json(),
                          cluster.model_copy(update={"num_gpus": None}).model_dump_json(),
                          str(training.seq_len), repr(imbalance)))
        return self._sigs.setdefault(text, len(self._sigs))


def search_space(cluster: ClusterSpec, precision: str, target: str) -> SearchSpace:
    """The axes a target can run: `megatron` is everything Megatron Core runs; `moeplan` is what
    `moeplan run` executes today (see `runtime/support.py`; a test keeps the two in step)."""
    if target not in TARGETS:
        raise SpecError(f"--target takes {' or '.join(TARGETS)}, got {target!r}.")
    check_target(target)
    if precision == "auto":
        precisions = AUTO_PRECISION.get(cluster.architecture, ("bf16",))  # e.g. a CPU host
    else:
        if not cluster.supports(precision):
            raise SpecError(f"--precision {precision}: {cluster.gpu} ({cluster.architecture}) "
                            "cannot run it; use bf16, auto, or an FP8 recipe the GPU has.")
        precisions = (precision,)
    # `moeplan run` executes neither TE userbuffers nor CUDA graphs (runtime/support.py)
    runs_stack = target == "megatron"
    return SearchSpace(precisions=precisions, tp_comm_overlap=runs_stack, cuda_graphs=runs_stack)


def _layout(row: np.ndarray) -> dict[str, Any]:
    return dict(tp=int(row[COL["tp"]]), cp=int(row[COL["cp"]]), dp=int(row[COL["dp"]]),
                pp=int(row[COL["pp"]]), vpp=int(row[COL["vpp"]]), ep=int(row[COL["ep"]]),
                etp=int(row[COL["etp"]]), mbs=int(row[COL["mbs"]]),
                num_microbatches=int(row[COL["nmb"]]),
                dispatcher=DISPATCHERS[int(row[COL["dispatcher"]])],
                ep_overlap=bool(row[COL["ep_overlap"]]),
                distributed_optimizer=bool(row[COL["dist_opt"]]))


def _unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(a, axis=0, return_inverse=True) for small non-negative integer rows, ten times
    faster: each row becomes one mixed-radix integer, and 1-D unique sorts those."""
    a = np.asarray(a, dtype=np.int64)
    if not len(a):
        return a, np.zeros(0, dtype=np.int64)
    radix = a.max(axis=0) + 1
    code = np.zeros(len(a), dtype=np.int64)
    for j in range(a.shape[1]):
        code = code * radix[j] + a[:, j]
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    return a[first], inverse.ravel()


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
    keys, inverse = _unique_rows(rows[:, cols])
    params = bound_params(model)
    per_key = np.array([lower_bound(model, cluster, training, *map(int, k), calibration=cal,
                                    params=params)[1] for k in keys])
    return t, per_key[inverse.ravel()]


def _choices(model: ModelSpec, layout: Layout, m: Menu, sol: StageSolution, dense_first: int,
             f: float, chunk_layers: list[int]) -> Choices:
    """Decode the MILP's per-rank sets and layer counts into a plan's Choices: the layers per
    virtual stage become a stage layout, unless they are the default split."""
    parts = [split_options(m.close(opts)) for opts in sol.options]
    layers = list(chunk_layers)
    layers[0] += dense_first
    text = None
    if layout.pp * layout.vpp > 1:
        text = layers_layout_text(layers, model.mtp_layers)
        if parse_stage_layout(text) == stage_layout_for(model.num_layers, layout.pp, layout.vpp,
                                                        model.mtp_layers):
            text = None
    return Choices(recompute=[p[0] for p in parts], offload=[p[1] for p in parts],
                   optimizer_offload_fraction=f, stage_layout=text)


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
    options: tuple[Option, ...] | None = None,
    cache: SearchCache | None = None,
    objective: str = "robust",
) -> SearchResult:
    """The top-k plans for a model on a cluster, best first (SPEC §4 `moeplan search`).

    `objective`: "robust" (default) ranks by the high end of the step time's 80 % interval
    (the low end of tokens/s/GPU, priced with every unvalidated effect disappointing), so a plan
    wins only if it still wins when its unproven terms fail; "expected" ranks by the point.
    Every bound the search prunes with is a bound on the point, and the interval's high end is
    never below the point, so pruning stays exact under either objective.

    Raises InfeasibleError (exit 3) with the closest candidate when nothing fits. `cache` lets
    searches of one sweep share layer tables and module sets (`SearchCache`).
    """
    if objective not in OBJECTIVES:
        raise SpecError(f"--objective takes {' or '.join(OBJECTIVES)}, got {objective!r}.")
    rank_key = _rank_key(objective)
    start = time.perf_counter()
    world = gpus or cluster.num_gpus
    if not world:
        raise SpecError("search needs a GPU count: pass --gpus N or set num_gpus in the cluster.")
    cluster = cluster.with_gpus(world)
    space = space or search_space(cluster, precision or training.precision, target)
    cal = calibration_for(cluster.calibration)
    enum = enumerate_layouts(model, cluster, training, world, space, target)
    pruned: Counter[str] = Counter(enum.pruned)
    result = SearchResult([], len(enum.rows), 0, 0, 0.0, pruned)
    if not len(enum.rows):
        raise InfeasibleError(no_valid_layout(model, cluster, training, world, space, pruned))
    t_lb, mem_lb = _bounds(model, cluster, training, enum, cal)
    usable = static_activation_budget_bytes(cluster, cal, cal.workspace_gb * GB)
    fits = mem_lb <= usable
    pruned["memory_bound"] += int((~fits).sum())
    options = OPTIONS if options is None else options
    cache = cache if cache is not None else SearchCache()
    tables, sets_cache = cache.tables, cache.sets
    sig = cache.signature(model, cluster, training, imbalance)
    best: list[tuple[float, int, Plan]] = []  # heap of the top k, worst on top
    closest: tuple[float, Layout] | None = None
    best_validated: Plan | None = None  # the best plan resting on validated terms only

    # bounds are on the point step time; a robust key is at least the point times its
    # regime's low-end factor, so the k-th key over the least such factor is a point threshold
    scale = _least_key_factor(model, cluster, space) if objective == "robust" else 1.0

    def kth() -> float:
        return -best[0][0] / scale if len(best) >= top_k else float("inf")

    def push(plan: Plan, idx: int) -> None:
        nonlocal best_validated
        entry = (-rank_key(plan), -plan.estimate.step_time_s, -idx, plan)  # type: ignore[union-attr]
        if len(best) < top_k:
            heapq.heappush(best, entry)
        elif entry > best[0]:
            heapq.heapreplace(best, entry)
        if _validated_only(plan) and (best_validated is None or (
                rank_key(plan), plan.estimate.step_time_s) < (  # type: ignore[union-attr]
                rank_key(best_validated), best_validated.estimate.step_time_s)):  # type: ignore[union-attr]
            best_validated = plan

    def table_key(layout: Layout, tr: TrainingSpec) -> tuple:
        key = (sig, layout.tp, layout.cp, layout.ep, layout.etp, layout.mbs, layout.dispatcher,
               layout.ep_overlap, layout.tp_comm_overlap, layout.cuda_graphs, tr.precision,
               model.tie_embeddings and layout.pp == 1,
               tuple(placement(layout, a, cluster) for a in ("tp", "cp", "ep", "etp")))
        if key not in tables:
            twins = key[:6] + key[8:]  # the key but the dispatcher and EP overlap
            tables[key] = layer_table(model, cluster, tr, layout, cal, imbalance,
                                      shared=cache.twins.setdefault(twins, {}))
        return key

    setups: dict[int, tuple[Layout, TrainingSpec, tuple]] = {}

    def row_setup(idx: int) -> tuple[Layout, TrainingSpec, tuple]:
        """The row's Layout, training and table key, built once per row (bounds, the twin
        check and the screen all ask for them)."""
        if idx not in setups:
            row = enum.rows[idx]
            prec = enum.precisions[int(row[COL["precision"]])]
            layout = Layout(**_layout(row),
                            tp_comm_overlap=space.tp_comm_overlap and int(row[COL["tp"]]) > 1)
            tr = training.model_copy(update={"precision": prec})
            setups[idx] = (layout, tr, table_key(layout, tr))
        return setups[idx]

    worse_of: dict[int, Layout | None] = {}
    variant_of: dict[tuple, dict[str, Any] | None] = {}

    def pessimistic(idx: int, layout: Layout, tr: TrainingSpec) -> Layout | None:
        """`pessimistic_layout` of the row, once per row (bounds and the twin both ask), its
        assumptions looked up once per class of layouts that differ only in the schedule
        (SCHEDULE_FIELDS) and share the groups' placements and the precision."""
        if idx not in worse_of:
            cls = (tr.precision, row_setup(idx)[2][-1],
                   tuple(v for f, v in layout.__dict__.items() if f not in SCHEDULE_FIELDS))
            if cls not in variant_of:
                worse = pessimistic_layout(model, cluster, tr, layout)
                variant_of[cls] = None if worse is None else {
                    f: v for f, v in worse if getattr(layout, f) != v}
            changes = variant_of[cls]
            worse_of[idx] = None if changes is None else layout.model_copy(update=changes)
        return worse_of[idx]

    def bound_tables(idx: int) -> list[LayerTable]:
        """The tables that bound a row's key: its own and, under the robust objective, those
        of its pessimistic variant (uncertainty.pessimistic_layout) when its overlap or
        dispatcher no fit row backs, since that variant prices its rank."""
        layout, tr, key = row_setup(idx)
        out = [tables[key]]
        if objective == "robust":
            worse = pessimistic(idx, layout, tr)
            if worse is not None:
                out.append(tables[table_key(worse, tr)])
        return out

    # Layer costs depend on (tp, cp, ep, etp, mbs, dispatcher, overlap, precision) only, and a
    # layout's tighter bound (every layer's time spread perfectly over the pipeline) needs them:
    # rows wait in one heap under the cheap bound and get the tighter one, with their key's
    # table, only when they reach the top, so keys the search never gets near cost nothing.
    # Rows leave the heap in the order of the tighter bound, ties by row index.
    key_cols = [COL[c] for c in ("tp", "cp", "ep", "etp", "mbs", "dispatcher", "ep_overlap",
                                 "precision")]
    cand = np.flatnonzero(fits)
    key_of = np.full(len(enum.rows), -1)
    key_of[cand] = _unique_rows(enum.rows[cand][:, key_cols])[1]
    pp, vpp, m = enum.rows[:, COL["pp"]], enum.rows[:, COL["vpp"]], enum.rows[:, COL["nmb"]]
    # micro-batch times on the critical rank per layer time (lists: read once per row)
    fill = ((m + (pp - 1) / vpp) / pp).tolist()
    work: dict[int, float] = {}
    key_list, pp_list, vpp_list, m_list = key_of.tolist(), pp.tolist(), vpp.tolist(), m.tolist()
    key_tables: dict[int, list[LayerTable]] = {}
    split_lb: dict[tuple[int, int, int, int], float] = {}
    heap = list(zip(t_lb[cand].tolist(), cand.tolist(), [False] * len(cand), strict=True))
    heapq.heapify(heap)
    lb = t_lb.tolist()
    refine: list[tuple[int, Layout, TrainingSpec, tuple]] = []
    done = 0
    solved: dict[int, tuple[str, Plan | None]] = {}
    row_index: dict[bytes, int] = {}

    def tight_bound(idx: int) -> float:
        j = key_list[idx]
        if j not in work:  # one micro-batch's time over all layers, the tighter bound's unit
            key_tables[j] = bound_tables(idx)
            work[j] = max(t.total_time_s(model.mtp_layers) for t in key_tables[j])
        b = fill[idx] * work[j]
        if b > lb[idx]:
            lb[idx] = b
        return lb[idx]

    def order_bound(idx: int) -> float:
        """The key a row re-enters the heap with. Robust: the larger of `tight_bound` and its
        key's balanced split with nothing recomputed or offloaded (`pipeline_bound`, from the
        same tables as `tight_bound` and, like it, at steady-state item times), both bounds on
        what the row can reach. The balanced
        split tracks what screening finds far better than the even spread, so the rows that
        set the k-th best are screened first and the k-th best tightens early: half the rows
        screened on DeepSeek-V3. The order decides only which plans outside the top k get
        priced (`best_validated` is the best of those when the top k has none); the point
        objective keeps its order, since its top k rarely holds a validated plan."""
        t = tight_bound(idx)
        if objective != "robust" or t >= kth():  # past the k-th best the order is moot
            return t
        j, p, v, n = key_list[idx], pp_list[idx], vpp_list[idx], m_list[idx]
        b = split_lb.get((j, p, v, n))
        if b is None:
            b = split_lb[j, p, v, n] = max(
                [tb.balanced_pipeline_s(model.mtp_layers, p, v, n, steady=True)
                 for tb in key_tables[j]])
        return t if t >= b else b

    def pipeline_bound(idx: int, layout: Layout, tr: TrainingSpec, key: tuple) -> float:
        """A bound on the step time of every plan the screening can decode for the row: its
        balanced split's pipeline with nothing recomputed or offloaded
        (`LayerTable.balanced_pipeline_s`); under the robust objective the larger of its own
        and its pessimistic variant's, which the interval prices at the same choices and split.
        Exact where the free-split screen of `_solve_layout` takes a slack, and it needs no
        stage problem: with few layers per rank the balanced split leaves the last rank (loss,
        MTP) heavy, which spreading all layers evenly (`tight_bound`) does not see."""
        args = (model.mtp_layers, layout.pp, layout.vpp, layout.num_microbatches)
        b = tables[key].balanced_pipeline_s(*args)
        if objective == "robust":
            worse = pessimistic(idx, layout, tr)
            if worse is not None:
                b = max(b, tables[table_key(worse, tr)].balanced_pipeline_s(*args))
        return b

    def solve_row(idx: int) -> tuple[str, Plan | None]:
        """Screen one row (balanced stages), push its plan, and remember the outcome."""
        nonlocal closest
        layout, tr, key = row_setup(idx)
        if tight_bound(idx) >= kth():
            pruned["time_bound"] += 1
            solved[idx] = ("bound", None)
            return solved[idx]
        if pipeline_bound(idx, layout, tr, key) >= kth():
            pruned["balanced_split_bound"] += 1
            solved[idx] = ("bound", None)
            return solved[idx]
        plan, status = _solve_layout(model, cluster, tr, layout, cal, tables[key],
                                     menu(model, tr, layout, target, options), key,
                                     sets_cache, result, balanced=True,
                                     lb_pipe=lb[idx], cutoff=kth(),
                                     with_interval=objective == "robust", target=target)
        solved[idx] = (status, plan)
        if status == "unsolved":  # the solver stopped: nothing proven either way
            pruned["milp_unsolved"] += 1
            return solved[idx]
        if status == "infeasible":
            pruned["memory_milp"] += 1
            if not best:  # only while nothing fits is the closest candidate of any use
                least = _least_memory(menu(model, tr, layout, target, options))
                peak = estimate(model, cluster, tr, layout, least, target=target).memory.peak_gb
                if closest is None or peak < closest[0]:
                    closest = (peak, layout)
            return solved[idx]
        result.feasible += status in ("plan", "screened")
        if plan is None:
            pruned["time_bound_milp" if status == "bound" else "screened_by_milp"] += 1
            return solved[idx]
        push(plan, idx)
        refine.append((idx, layout, tr, key))
        return solved[idx]

    def dominated(idx: int) -> bool:
        """Robust only: a row whose unvalidated overlap or dispatcher the interval's low end
        takes away is priced, at its low end, as its validated twin (alltoall, no EP overlap:
        the same memory and a superset of the recompute options, so every choice that fits the
        row fits the twin and the twin's best choices are at least as fast). When the twin
        cannot enter the top k, neither can the row: the twin is screened first."""
        layout, tr, _ = row_setup(idx)
        worse = pessimistic(idx, layout, tr)
        if worse is None or (worse.tp_comm_overlap, worse.cuda_graphs) != (
                layout.tp_comm_overlap, layout.cuda_graphs):
            return False
        if not row_index:
            row_index.update((r.tobytes(), i) for i, r in enumerate(enum.rows))
        twin = enum.rows[idx].copy()
        twin[COL["dispatcher"]] = DISPATCHERS.index(worse.dispatcher)
        twin[COL["ep_overlap"]] = int(worse.ep_overlap)
        j = row_index.get(twin.tobytes())
        if j is None or j == idx or not fits[j]:
            return False
        status, plan = solved[j] if j in solved else solve_row(j)
        if status in ("bound", "screened", "infeasible"):
            return True
        # a twin tied with the k-th key does not prune: the row shares the key and may win
        # the tie on its point
        return (plan is not None and len(best) >= top_k
                and rank_key(plan) > -best[0][0])

    while heap:
        bound, idx, tight = heap[0]
        if bound >= kth():
            pruned["time_bound"] += sum(1 for e in heap if e[1] not in solved)
            break
        heapq.heappop(heap)
        if idx in solved:
            continue
        done += 1
        if progress and done % 200 == 0:
            progress(done, 2 * len(cand))  # each row leaves the heap at most twice
        if not tight:
            heapq.heappush(heap, (order_bound(idx), idx, True))
            continue
        # anytime: past the limit, stop once a plan that fits is in hand (never before it, so a
        # short limit still returns the first feasible plan, and "nothing fits" stays a proof)
        if (time_limit_s is not None and best
                and time.perf_counter() - start > time_limit_s):
            result.stopped_early = True
            pruned["time_limit"] += len(heap) + 1
            break
        if objective == "robust" and dominated(idx):
            solved[idx] = ("dominated", None)
            pruned["robust_twin_bound"] += 1
            continue
        solve_row(idx)
    # screening used balanced stages; for the plans on top, the MILP also places the layers:
    # uneven first and last stages can beat the balanced split (embedding, loss, MTP)
    on_top = {-e[2] for e in best}
    for idx, layout, tr, key in refine:
        if idx not in on_top:
            continue
        k = next(i for i, e in enumerate(best) if -e[2] == idx)
        screened = best[k][3]
        plan, _ = _solve_layout(model, cluster, tr, layout, cal, tables[key],
                                menu(model, tr, layout, target, options), key,
                                sets_cache, result, lb_pipe=lb[idx],
                                fractions=(screened.choices.optimizer_offload_fraction,),
                                with_interval=objective == "robust", target=target)
        if plan is None or not plan.estimate.fits:  # type: ignore[union-attr]
            continue
        if (rank_key(plan), plan.estimate.step_time_s) < (  # type: ignore[union-attr]
                -best[k][0], -best[k][1]):
            best[k] = (-rank_key(plan), -plan.estimate.step_time_s, -idx, plan)  # type: ignore[union-attr]
            heapq.heapify(best)
    # CUDA graphs only remove launch overhead: the plans on top take them where their memory
    # leaves room for the graphs (same choices), when that makes them rank better
    best = [(-rank_key(p), -p.estimate.step_time_s, e[2], p) for e in best  # type: ignore[union-attr]
            for p in [_with_graphs(e[3], space, rank_key, objective == "robust", target)]]
    result.seconds = time.perf_counter() - start
    if not best:
        raise InfeasibleError(_infeasible_message(model, cluster, training, world, enum, mem_lb,
                                                  cal, closest))
    plans = [e[3] for e in sorted(best, key=lambda e: e[:3], reverse=True)]
    if objective == "expected":  # ranked by the point: intervals only for what is reported
        plans = [_with_interval(p) for p in plans]
        best_validated = _with_interval(best_validated) if best_validated else None
    result.objective = objective
    result.best_validated = best_validated
    result.plans = explain_plans(plans, result)
    return result


OBJECTIVES = ("robust", "expected")


def _with_graphs(plan: Plan, space: SearchSpace, rank_key: Callable[[Plan], float],
                 with_interval: bool, target: str) -> Plan:
    """The plan with CUDA graphs (Layout.cuda_graphs) when the target runs them with the
    plan's choices (`specs.rules`: no full or `moe` recompute under the graphs' scopes), the
    graphs' memory still fits beside them, and the plan then ranks better (the point breaks a
    tie: unvalidated graphs leave a robust key where it was)."""
    if not space.cuda_graphs or plan.layout.cuda_graphs or plan.estimate is None:
        return plan
    layout = plan.layout.model_copy(update={"cuda_graphs": True})
    if violations(Facts(plan.model, plan.training, layout, plan.choices, plan.cluster), target):
        return plan
    est = estimate(plan.model, plan.cluster, plan.training, layout, plan.choices,
                   with_interval=with_interval, target=target)
    if not est.fits:
        return plan
    graphed = plan.model_copy(update={"layout": layout, "estimate": est})
    if (rank_key(graphed), est.step_time_s) < (rank_key(plan), plan.estimate.step_time_s):
        return graphed
    return plan


def _validated_only(plan: Plan) -> bool:
    """Whether every modelled effect the plan rests on is backed by fit rows."""
    e = plan.estimate
    terms = e.assumptions if e is not None and e.interval is not None else [
        t.assumption for t in U.assumptions(plan.model, plan.cluster, plan.training, plan.layout,
                                          plan.choices)]
    return all(a.validated for a in terms)


def _with_interval(plan: Plan) -> Plan:
    if plan.estimate is not None and plan.estimate.interval is not None:
        return plan
    est = estimate(plan.model, plan.cluster, plan.training, plan.layout, plan.choices,
                   target=plan.target)
    return plan.model_copy(update={"estimate": est})


def _least_key_factor(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace) -> float:
    """The least ratio of a robust rank key (the interval's high end of step time) to the point
    step time over every regime a layout of this search can fall in: e^(−q_lo) of the regime
    with the smallest downside (uncertainty.tokens_interval takes the low end from the point or
    below it, never above). A cluster's own measured band (`moeplan calibrate --from-runs`)
    replaces every regime's, so it is the factor."""
    measured = U.measured_bounds(cluster)
    if measured is not None:
        return math.exp(-min(measured[0], 0.0))
    prof = U.default_profile()
    return min(math.exp(-min(prof.bounds(U.regime_names(model, cluster, prec, fab))[0], 0.0))
               for prec in space.precisions for fab in ("nvlink", "scale-out"))


def _rank_key(objective: str) -> Callable[[Plan], float]:
    """Seconds a plan is ranked by (smaller is better) under an objective."""
    def robust(plan: Plan) -> float:
        e = plan.estimate
        assert e is not None
        return e.interval.step_time_s[1] if e.interval else e.step_time_s

    def expected(plan: Plan) -> float:
        assert plan.estimate is not None
        return plan.estimate.step_time_s

    return robust if objective == "robust" else expected


SCREEN_SLACK = 1.10
"""The screening pass prices a layout by its stage problem (MILP objective plus the constant
terms) before asking `estimate`; the two differ only in the DP-exposure and optimizer terms,
which the problem takes at the balanced rank (measured on the presets: within 0.98–1.05 of the
estimate). A layout whose screened time exceeds the k-th best by more than this slack cannot
enter the top k, so the estimate is skipped (counted as `screened_by_milp`)."""


def _least_memory(m: Menu) -> Choices:
    """Choices that keep about the least memory the layout's menu allows: full recompute where
    allowed, else every selective module, every offload, in option order, each kept unless it
    completes a forbidden combination; the optimizer on the host."""
    full = Option.recompute("full")
    chosen: list[Option] = [full] if full in m.options else []
    for o in m.options:
        if o in chosen or (full in chosen and o.kind == "recompute"):
            continue
        trial = {*chosen, o}
        if not any(c.hit(trial) for c in m.forbidden):
            chosen.append(o)
    recompute, offload = split_options(chosen)
    return Choices(recompute=[recompute], offload=[offload],
                   optimizer_offload_fraction=1.0 if m.options else 0.0)


def _solve_layout(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                  layout: Layout, cal: Calibration, table: LayerTable, options: Menu,
                  key: tuple, sets_cache: dict, result: SearchResult,
                  balanced: bool = False, lb_pipe: float = 0.0, cutoff: float = math.inf,
                  fractions: tuple[float, ...] | None = None, with_interval: bool = True,
                  target: str = "megatron") -> tuple[Plan | None, str]:
    """Recompute, offload (and, unless `balanced`, layers per stage) for one layout at each
    optimizer-offload fraction, decoded into Plans and re-scored by the cost model.

    Returns the fastest plan that fits and beats `cutoff` (or None) with a status: "plan";
    "screened" (fits, but cannot beat the cutoff); "bound" (the lower bound already cannot);
    "infeasible" (proven: no choice fits at any fraction); "unsolved" (the solver stopped
    without a solution at some fraction and none fits at the others: nothing proven).

    `balanced` is the screening pass: layers split evenly, so the problem separates by rank and
    is solved exactly without a solver (`ilp.solve_fixed`). Otherwise the MILP places layers and
    chooses modules together. A fraction is skipped when the pipeline's lower bound plus its
    optimizer time cannot beat the best so far; larger fractions are tried only when the plan
    without optimizer offload needed recompute or offload (memory pressure).
    """
    grid = fractions or ((0.0,) if not options.options else OPTIMIZER_OFFLOAD_GRID)
    best: Plan | None = None
    base_const: float | None = None
    fits = skipped = stopped = False
    for f in grid:
        built = stage_problem(model, cluster, training, layout, cal, table, options, f)
        if base_const is None:
            base_const = built.constant_s
        extra = built.constant_s - base_const  # optimizer time the fraction adds
        limit = min(cutoff, best.estimate.step_time_s if best else math.inf)  # type: ignore[union-attr]
        if lb_pipe + base_const + extra >= limit:
            skipped = True
            continue
        P = built.problem
        if balanced and limit < math.inf and f == grid[0]:
            # the balanced split with nothing recomputed or offloaded is the least any choice
            # reaches at any fraction (choices only add time, fractions only add optimizer
            # time): past the screen's slack, no fraction can be estimated, so none is solved
            free, _ = evaluate(P, balanced_layers(P), [()] * P.pp)
            if free + base_const > SCREEN_SLACK * limit:
                return None, "bound"
        skey = (key, P.options, P.forbidden, P.items[P.layer_item].name,
                tuple(i.name for i in P.items))
        if skey not in sets_cache:
            sets_cache[skey] = module_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)
        try:
            if balanced:
                result.screened += 1
                sol = solve_fixed(P, sets_cache[skey], balanced_layers(P))
            else:
                result.solved += 1
                sol = solve(P, sets_cache[skey])
        except InfeasibleStages:
            continue
        except SolverStopped:
            stopped = True
            continue
        fits = True
        pressure = any(sol.options)
        # the estimate is the dearest step of a screen: skipped past the screen's slack, and
        # where the plan's bare and recomputed time alone (exact, no slack) misses the limit
        if not (balanced and sol.objective_s + built.constant_s > SCREEN_SLACK * limit) and (
                limit == math.inf or recompute_pipeline_s(
                    table, P, sol.layers, sol.options, layout.num_microbatches) < limit):
            choices = _choices(model, layout, options, sol, built.leading_layers, f,
                               P.chunk_layers(sol.layers))
            est = estimate(model, cluster, training, layout, choices, with_interval=False,
                           target=target)
            if est.fits and est.step_time_s < limit:
                best = Plan(model=model, cluster=cluster, training=training, layout=layout,
                            choices=choices, estimate=est, target=target)
        if f == 0.0 and not pressure:
            break  # no memory pressure: offloading the optimizer only adds time
    if best is not None:
        # fractions compete on the point, so only the winner needs its interval (the
        # pessimistic variant's estimate doubles the price of one)
        return (_with_interval(best) if with_interval else best), "plan"
    if fits:
        return None, "screened"
    return None, "bound" if skipped else "unsolved" if stopped else "infeasible"


def _infeasible_message(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                        world: int, enum: Enumeration, mem_lb: np.ndarray, cal: Calibration,
                        closest: tuple[float, Layout] | None) -> str:
    """What came closest and what would make it fit."""
    budget_gb = max_peak_gb(cluster, cal)
    if closest is not None:  # fits on weights, not with the activations it must keep
        need_gb, lay = closest
        where = (f"{Plan(model=model, cluster=cluster, training=training, layout=lay).summary()}"
                 f" peaks at {need_gb:.0f} GB per GPU with the least memory this target allows")
    else:
        i = int(np.argmin(mem_lb))
        lay = Layout(**_layout(enum.rows[i]))
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
    if training.precision == "bf16" and cluster.fp8_tflops:
        hints.append("an FP8 recipe (--precision auto) to shrink activations")
    if larger:
        hints.append(f"a larger-memory GPU ({', '.join(larger)})")
    return (f"nothing fits {model.name} on {world} × {cluster.gpu} (a plan fits when its peak "
            f"leaves the memory margin free: at most {budget_gb:.0f} GB of {cluster.hbm_gb:g} GB "
            f"each). Closest: {where}. To fit: " + "; or ".join(hints) + ".")
