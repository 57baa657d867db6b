"""The search's branch and bound over layouts, as one state and its steps.

  1. enumerate candidate rows (numpy), pruning by the target's rules (`planner.enumerate`);
  2. bound every row at once (`row_bounds`): compute-only time at the best efficiency any
     kernel reaches, times the pipeline's fill factor (1 + (p−1)/(v·m)); weights + grads of a
     balanced stage against HBM (`memory_bound`: nothing can fit, whatever is recomputed or
     offloaded);
  3. visit rows in bound order from one heap; a row reaching the top gets the tighter bound of
     its layer costs (all layers' time spread perfectly over the pipeline), computed once per
     (tp, cp, ep, etp, mbs, dispatcher, overlap, precision) key, and goes back in under the
     objective's order (`Objective.order_bound`); stop when the top bound reaches the k-th
     best key found (`time_bound`);
  4. screen each visited row at two stage splits, the even one and the levelled one (fewer
     layers beside the embedding, loss and MTP: `problem.level_split`), each exact without a
     solver (`screen.solve_layout`), at each optimizer-offload fraction; a screened plan that
     can still enter the top k is re-scored by `cost_models.estimate`, so the ranking is the
     cost model's;
  5. for the top k, the MILP chooses layers per stage and recompute and offload per module
     together (`refine`), which can still beat both screened splits (by at most a few
     percent on the presets); then CUDA graphs where their memory leaves room
     (`screen.with_graphs`).
The bounds of steps 2 and 3 hold at any stage split (the levelled split has the least bare
pipeline of all), so a row they set aside is slower than the plans kept whatever its MILP
would place; a row the screen sets aside is slower at the two splits it tried.
Layer costs do not depend on dp, pp or vpp, which is what makes one table per key enough.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ..cost_models.comm import placement
from ..cost_models.estimate import estimate, lower_bound
from ..cost_models.uncertainty import assumption_keys, pessimistic_layout, slow_host
from ..specs import Choices, Layout, Plan, TrainingSpec
from .enumerate import COL, DISPATCHERS, Enumeration, SearchSpace
from .ilp import InfeasibleStages, solve_screen
from .objective import Objective, validated_only
from .problem import LayerTable, Option, layer_table, menu, stage_problem
from .screen import OPTIMIZER_OFFLOAD_GRID, Problem, least_memory, solve_layout, with_graphs
from .sets import module_sets

NO_CHOICES = Choices()
"""A layout's pessimistic variant is bounded before any choice (`pessimistic_layout`)."""
FIRST, TIGHT, ORDERED = 0, 1, 2
"""How far a row in the search's heap has been bounded (`BranchAndBound.run`)."""
BOUNDS = frozenset({"time_bound", "balanced_split_bound", "robust_offload_bound",
                    "robust_twin_bound", "time_bound_milp", "screened_by_milp", "memory_milp",
                    "milp_unsolved", "time_limit", "memory_bound"})
"""The `pruned` counts of valid layouts the search set aside (here, and `memory_bound` in
search.py); every other count is of candidate splits a rule refused before any was a layout."""
KEY_COLUMNS = ("tp", "cp", "ep", "etp", "mbs", "dispatcher", "ep_overlap", "precision")
"""The row columns a layer-cost table depends on (with the groups' placements)."""


def layout_of_row(row: np.ndarray) -> dict[str, Any]:
    """A candidate row's Layout fields."""
    return dict(tp=int(row[COL["tp"]]), cp=int(row[COL["cp"]]), dp=int(row[COL["dp"]]),
                pp=int(row[COL["pp"]]), vpp=int(row[COL["vpp"]]), ep=int(row[COL["ep"]]),
                etp=int(row[COL["etp"]]), mbs=int(row[COL["mbs"]]),
                num_microbatches=int(row[COL["nmb"]]),
                dispatcher=DISPATCHERS[int(row[COL["dispatcher"]])],
                ep_overlap=bool(row[COL["ep_overlap"]]),
                distributed_optimizer=bool(row[COL["dist_opt"]]))


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def row_bounds(pb: Problem, enum: Enumeration) -> tuple[np.ndarray, np.ndarray]:
    """(time lower bound, static-memory lower bound in bytes) of every row, vectorised."""
    rows, model, cluster = enum.rows, pb.model, pb.cluster
    t0 = np.empty(len(enum.precisions))
    world = int(rows[0, COL["tp"]] * rows[0, COL["cp"]] * rows[0, COL["dp"]] * rows[0, COL["pp"]])
    for i, p in enumerate(enum.precisions):
        tr = pb.training.model_copy(update={"precision": p})
        t0[i] = lower_bound(model, cluster, tr, 1, 1, world, 1, 1, 1, pb.cal)[0]
    pp, vpp, m = rows[:, COL["pp"]], rows[:, COL["vpp"]], rows[:, COL["nmb"]]
    t = t0[rows[:, COL["precision"]]] * (1 + (pp - 1) / (vpp * m))
    cols = [COL["tp"], COL["cp"], COL["dp"], COL["pp"], COL["ep"], COL["etp"]]
    keys, inverse = unique_rows(rows[:, cols])
    params = model.bound_params()
    per_key = np.array([lower_bound(model, cluster, pb.training, *map(int, k),
                                    calibration=pb.cal, params=params)[1] for k in keys])
    return t, per_key[inverse.ravel()]


class BranchAndBound:
    """One search's state: the candidate rows and their bounds, the heap, the layer tables,
    the plans kept, and what was counted. `run` visits rows until no bound can beat the k-th
    best; the objective (`planner.objective`) decides keys, bounds and dominance."""

    def __init__(self, pb: Problem, enum: Enumeration, space: SearchSpace,
                 objective: Objective, options: tuple[Option, ...], tables: dict,
                 sets: dict, twins: dict, sig: int, top_k: int, imbalance: float,
                 fits: np.ndarray, t_lb: np.ndarray) -> None:
        self.pb, self.enum, self.space, self.objective = pb, enum, space, objective
        self.options, self.tables, self.sets, self.twins = options, tables, sets, twins
        self.sig, self.top_k, self.imbalance, self.fits = sig, top_k, imbalance, fits
        self.pruned: Counter[str] = Counter()
        self.screened = self.solved_milps = self.feasible = 0
        self.best: list[tuple[float, float, int, Plan]] = []  # the top k, worst on top
        self.best_validated: Plan | None = None  # the best plan on validated terms only
        self.closest: tuple[float, Layout] | None = None  # least peak while nothing fits
        self.solved: dict[int, tuple[str, Plan | None]] = {}
        self.refine_rows: list[int] = []
        self._setups: dict[int, tuple[Layout, TrainingSpec, tuple]] = {}
        self._trainings: dict[str, TrainingSpec] = {}
        self._worse: dict[int, Layout | None] = {}
        self._variants: dict[tuple, dict[str, Any] | None] = {}
        self._key_changes: dict[tuple, dict[str, Any] | None] = {}
        self._worse_keys: dict[tuple, tuple | None] = {}
        self.factors: dict[tuple, float] = {}  # `Objective.row_factor` per layer-table key
        self.order_factors: dict[int, float] = {}  # `Robust.order_factor` per row key
        self._slow_s_per_byte: float | None = None  # `slow_host_pipeline`'s host link
        self._slow_pipes: dict[tuple, float] = {}  # `slow_host_pipeline` per relaxed row
        self.scale = objective.key_factor(pb.model, pb.cluster, space)
        rows = enum.rows
        self.cand = np.flatnonzero(fits)
        key_of = np.full(len(rows), -1)
        key_of[self.cand] = unique_rows(rows[self.cand][:, [COL[c] for c in KEY_COLUMNS]])[1]
        pp, vpp, m = rows[:, COL["pp"]], rows[:, COL["vpp"]], rows[:, COL["nmb"]]
        # micro-batch times on the critical rank per layer time (lists: read once per row)
        self.fill = ((m + (pp - 1) / vpp) / pp).tolist()
        self.key_of, self.pp = key_of.tolist(), pp.tolist()
        self.vpp, self.nmb = vpp.tolist(), m.tolist()
        self.lb = t_lb.tolist()
        self._work: dict[int, float] = {}
        self._key_tables: dict[int, list[LayerTable]] = {}
        self._split_lb: dict[tuple[int, int, int, int], float] = {}

    # ------------------------------------------------------------------ the plans kept
    def full(self) -> bool:
        return len(self.best) >= self.top_k

    def kth_key(self) -> float:
        """The k-th best key kept (the worst of the top k)."""
        return -self.best[0][0]

    def kth(self) -> float:
        """The point threshold a row's bound must beat: the k-th key over the least
        key-to-point factor (inf until k plans are kept)."""
        return self.kth_key() / self.scale if self.full() else math.inf

    def kth_of(self, idx: int) -> float:
        """The point threshold the row's bound must beat: the k-th key over the row's own
        least key-to-point factor (`Objective.row_factor`; inf until k plans are kept)."""
        return self.kth_key() / self.objective.row_factor(self, idx) if self.full() else (
            math.inf)

    def push(self, plan: Plan, idx: int) -> None:
        assert plan.estimate is not None
        key = self.objective.key(plan)
        entry = (-key, -plan.estimate.step_time_s, -idx, plan)
        if not self.full():
            heapq.heappush(self.best, entry)
        elif entry > self.best[0]:
            heapq.heapreplace(self.best, entry)
        bv = self.best_validated
        if validated_only(plan) and (bv is None or (key, plan.estimate.step_time_s) < (
                self.objective.key(bv), bv.estimate.step_time_s)):  # type: ignore[union-attr]
            self.best_validated = plan

    # ------------------------------------------------------------------ rows and tables
    def table_key(self, layout: Layout, tr: TrainingSpec) -> tuple:
        """The layer table of a layout, built on first use (`SearchCache` keys)."""
        model, cluster = self.pb.model, self.pb.cluster
        key = (self.sig, layout.tp, layout.cp, layout.ep, layout.etp, layout.mbs,
               layout.dispatcher, layout.ep_overlap, layout.tp_comm_overlap, layout.cuda_graphs,
               tr.precision, model.tie_embeddings and layout.pp == 1,
               tuple(placement(layout, a, cluster) for a in ("tp", "cp", "ep", "etp")))
        if key not in self.tables:
            # the key but the expert axes: what the EP_BLIND costs read
            blind = key[:3] + key[5:6] + key[8:12] + key[12][:2]
            self.tables[key] = layer_table(model, cluster, tr, layout, self.pb.cal,
                                           self.imbalance,
                                           shared=self.twins.setdefault(blind, {}))
        return key

    def setup(self, idx: int) -> tuple[Layout, TrainingSpec, tuple]:
        """The row's Layout, training and table key, built once per row."""
        if idx not in self._setups:
            row = self.enum.rows[idx]
            prec = self.enum.precisions[int(row[COL["precision"]])]
            layout = Layout(**layout_of_row(row), tp_comm_overlap=self.space.tp_comm_overlap
                            and int(row[COL["tp"]]) > 1, flex_backend=self.space.flex_backend)
            if prec not in self._trainings:  # one training per precision, shared by rows
                self._trainings[prec] = self.pb.training.model_copy(update={"precision": prec})
            tr = self._trainings[prec]
            self._setups[idx] = (layout, tr, self.table_key(layout, tr))
        return self._setups[idx]

    def pessimistic(self, idx: int) -> Layout | None:
        """`pessimistic_layout` of the row, looked up once per precision and set of evidence
        keys the layout relies on (`uncertainty.assumption_keys`): which effects are
        unvalidated, and so what the variant takes away, is a function of those keys alone
        (`test_pessimistic_variant_is_a_function_of_the_evidence_keys` keeps this true)."""
        if idx not in self._worse:
            layout, _, key = self.setup(idx)
            changes = self._changes(idx)
            self._worse[idx] = None if changes is None else layout.model_copy(update=changes)
        return self._worse[idx]

    def _changes(self, idx: int) -> dict[str, Any] | None:
        """The fields the row's pessimistic variant changes, once per layer-table key (which
        holds every field `assumption_keys` reads) and per set of evidence keys."""
        layout, tr, key = self.setup(idx)
        if key not in self._key_changes:
            cls = (tr.precision, tuple(assumption_keys(self.pb.model, self.pb.cluster, tr,
                                                       layout, NO_CHOICES)))
            if cls not in self._variants:
                worse = pessimistic_layout(self.pb.model, self.pb.cluster, tr, layout)
                self._variants[cls] = None if worse is None else {
                    f: v for f, v in worse if getattr(layout, f) != v}
            self._key_changes[key] = self._variants[cls]
        return self._key_changes[key]

    def worse_table(self, idx: int) -> LayerTable | None:
        """The layer table of the row's pessimistic variant, looked up once per table key."""
        key = self.setup(idx)[2]
        if key not in self._worse_keys:
            worse = self.pessimistic(idx)
            self._worse_keys[key] = (None if worse is None
                                     else self.table_key(worse, self.setup(idx)[1]))
        wk = self._worse_keys[key]
        return None if wk is None else self.tables[wk]

    def validated_twin(self, idx: int) -> int | None:
        """The row that differs only in the dispatcher and EP overlap its pessimistic variant
        takes away, when it exists, fits, and keeps the stack settings."""
        layout = self.setup(idx)[0]
        worse = self.pessimistic(idx)
        if worse is None or (worse.tp_comm_overlap, worse.cuda_graphs) != (
                layout.tp_comm_overlap, layout.cuda_graphs):
            return None
        rows = self.enum.rows
        twin = rows[idx].copy()
        twin[COL["dispatcher"]] = DISPATCHERS.index(worse.dispatcher)
        twin[COL["ep_overlap"]] = int(worse.ep_overlap)
        # the enumeration binds the dispatcher, the overlap, the distributed optimizer and the
        # precision innermost (`enumerate._Walk.experts`), so a row's twin sits within one
        # block of those around it; a twin not found there only forgoes a prune
        w = len(DISPATCHERS) * 2 * 2 * len(self.enum.precisions)
        lo = max(0, idx - w)
        hit = np.flatnonzero((rows[lo:idx + w + 1] == twin).all(axis=1))
        j = lo + int(hit[0]) if len(hit) else None
        return None if j is None or j == idx or not self.fits[j] else j

    # ------------------------------------------------------------------ bounds
    def tight_bound(self, idx: int) -> float:
        """All layers' time (one micro-batch) spread perfectly over the pipeline."""
        j = self.key_of[idx]
        if j not in self._work:  # one micro-batch's time over all layers, the bound's unit
            self._key_tables[j] = self.objective.tables(self, idx)
            self._work[j] = max(t.total_time_s(self.pb.model.mtp_layers)
                                for t in self._key_tables[j])
        b = self.fill[idx] * self._work[j]
        if b > self.lb[idx]:
            self.lb[idx] = b
        return self.lb[idx]

    def steady_split_bound(self, idx: int) -> float:
        """The key's levelled split with nothing recomputed or offloaded, at steady-state item
        times, once per (key, pp, vpp, m)."""
        j, p, v, n = self.key_of[idx], self.pp[idx], self.vpp[idx], self.nmb[idx]
        b = self._split_lb.get((j, p, v, n))
        if b is None:
            b = self._split_lb[j, p, v, n] = max(
                tb.balanced_pipeline_s(self.pb.model.mtp_layers, p, v, n, steady=True)
                for tb in self._key_tables[j])
        return b

    def slow_host_pipeline(self, idx: int) -> float:
        """The least pipeline time of any choice the screen can decode for the row, at any
        optimizer-offload fraction, with its host link as slow as the interval's low end
        prices unvalidated offload (`uncertainty.slow_host`): the screen's splits' stage
        problem at the largest fraction (the most memory room: fractions change no item time
        and only take optimizer bytes off the GPU), solved exactly (`ilp.solve_fixed`, whose
        objective is the pipeline `estimate` prices). A row that must offload to fit then pays
        for the copies the slow link exposes, where its point hides them. 0 for interleaved
        layer kinds (priced as one average layer) or when nothing can be chosen; inf when
        nothing fits at any fraction.

        A row without the distributed optimizer takes its twin's with it, once for both: the
        same layer table and items with optimizer states no larger, so every stage choice
        that fits the row fits the twin, whose pipeline is then a lower bound for the row's."""
        row = self.enum.rows[idx].copy()
        row[COL["dist_opt"]] = 1
        relaxed = tuple(row.tolist())
        if relaxed not in self._slow_pipes:
            self._slow_pipes[relaxed] = self._slow_host_pipeline(idx)
        return self._slow_pipes[relaxed]

    def _slow_host_pipeline(self, idx: int) -> float:
        """`slow_host_pipeline` of the row with the distributed optimizer on."""
        layout, tr, key = self.setup(idx)
        if not layout.distributed_optimizer:
            layout = layout.model_copy(update={"distributed_optimizer": True})
        table = self.tables[key]
        if table.placement() is None:
            return 0.0
        m = menu(self.pb.model, tr, layout, self.pb.target, self.options)
        if not m.options:
            return 0.0
        built = stage_problem(self.pb.model, self.pb.cluster, tr, layout, self.pb.cal, table, m,
                              OPTIMIZER_OFFLOAD_GRID[-1] if m.optimizer_offload else 0.0)
        P = replace(built.problem, host_s_per_byte=self.slow_s_per_byte())
        skey = (key, P.options, P.forbidden, P.host_s_per_byte, tuple(i.name for i in P.items))
        if skey not in self.sets:
            self.sets[skey] = module_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)
        try:
            return solve_screen(P, self.sets[skey]).objective_s
        except InfeasibleStages:
            return math.inf

    def slow_s_per_byte(self) -> float:
        """Seconds per byte of the host link the interval's low end prices unvalidated
        offload on (`uncertainty.slow_host`)."""
        if self._slow_s_per_byte is None:
            self._slow_s_per_byte = 1.0 / (slow_host(self.pb.cluster).host_link_gb_s * 1e9)
        return self._slow_s_per_byte

    # ------------------------------------------------------------------ one row
    def solve_row(self, idx: int) -> tuple[str, Plan | None]:
        """Screen one row (the balanced and the levelled split), keep its plan, and remember
        the outcome."""
        kth = self.kth_of(idx)
        if self.tight_bound(idx) >= kth:
            return self._outcome(idx, "time_bound", ("bound", None))
        if self.objective.split_bound(self, idx) >= kth:
            return self._outcome(idx, "balanced_split_bound", ("bound", None))
        if kth < math.inf and self.objective.offload_bound(self, idx) >= kth:
            return self._outcome(idx, "robust_offload_bound", ("bound", None))
        layout, tr, key = self.setup(idx)
        m = menu(self.pb.model, tr, layout, self.pb.target, self.options)
        got = solve_layout(self.pb, tr, layout, self.tables[key], m, key, self.sets,
                           balanced=True, lb_pipe=self.lb[idx], cutoff=kth,
                           with_interval=self.objective.prices_intervals,
                           host_s_per_byte=self.objective.choice_host(self, idx))
        self.screened += got.screened
        self.solved[idx] = (got.status, got.plan)
        if got.status == "unsolved":  # the solver stopped: nothing proven either way
            self.pruned["milp_unsolved"] += 1
        elif got.status == "infeasible":
            self.pruned["memory_milp"] += 1
            self._note_closest(layout, tr, m)
        else:
            self.feasible += got.status in ("plan", "screened")
            if got.plan is None:
                self.pruned["time_bound_milp" if got.status == "bound"
                            else "screened_by_milp"] += 1
            else:
                self.push(got.plan, idx)
                self.refine_rows.append(idx)
        return self.solved[idx]

    def _outcome(self, idx: int, rule: str, outcome: tuple[str, Plan | None]
                 ) -> tuple[str, Plan | None]:
        self.pruned[rule] += 1
        self.solved[idx] = outcome
        return outcome

    def _note_closest(self, layout: Layout, tr: TrainingSpec, m: Any) -> None:
        """Only while nothing fits is the closest candidate of any use."""
        if self.best:
            return
        peak = estimate(self.pb.model, self.pb.cluster, tr, layout, least_memory(m),
                        self.imbalance, target=self.pb.target).memory.peak_gb
        if self.closest is None or peak < self.closest[0]:
            self.closest = (peak, layout)

    # ------------------------------------------------------------------ the loop
    def run(self, start: float, time_limit_s: float | None,
            progress: Callable[[int, int], None] | None) -> bool:
        """Visit rows in bound order until none can beat the k-th best; returns whether it
        stopped at the time limit (anytime: only once a plan that fits is in hand, so a short
        limit still returns the first feasible plan, and "nothing fits" stays a proof)."""
        # a row's key only grows as it is looked at more closely: its first bound, the tight
        # bound of its layer table, then the objective's order; each is computed only when
        # the row reaches the top with the one before (lazily, so the visiting order is the
        # order of the final keys, and a row past the k-th best never pays for the next)
        heap = list(zip([self.lb[i] for i in self.cand.tolist()], self.cand.tolist(),
                        [FIRST] * len(self.cand), strict=True))
        heapq.heapify(heap)
        done = 0
        while heap:
            bound, idx, stage = heap[0]
            if bound >= self.kth():
                self.pruned["time_bound"] += sum(1 for e in heap if e[1] not in self.solved)
                return False
            heapq.heappop(heap)
            if idx in self.solved:
                continue
            if stage == FIRST:
                done += 1
                if progress and done % 200 == 0:
                    progress(done, len(self.cand))
                heapq.heappush(heap, (self.tight_bound(idx), idx, TIGHT))
                continue
            if stage == TIGHT:
                order = self.objective.order_bound(self, idx, bound)
                if order > bound:
                    heapq.heappush(heap, (order, idx, ORDERED))
                    continue
            if time_limit_s is not None and self.best and (
                    time.perf_counter() - start > time_limit_s):
                self.pruned["time_limit"] += len(heap) + 1
                return True
            if self.objective.dominated(self, idx):
                self._outcome(idx, "robust_twin_bound", ("dominated", None))
                continue
            self.solve_row(idx)
        return False

    def refine(self) -> None:
        """For the plans on top, the MILP also places the layers, with recompute and offload
        per rank: it can beat both splits the screen tried."""
        on_top = {-e[2] for e in self.best}
        for idx in self.refine_rows:
            if idx not in on_top:
                continue
            k = next(i for i, e in enumerate(self.best) if -e[2] == idx)
            screened = self.best[k][3]
            layout, tr, key = self.setup(idx)
            got = solve_layout(self.pb, tr, layout, self.tables[key],
                               menu(self.pb.model, tr, layout, self.pb.target, self.options),
                               key, self.sets, lb_pipe=self.lb[idx],
                               fractions=(screened.choices.optimizer_offload_fraction,),
                               with_interval=self.objective.prices_intervals,
                               host_s_per_byte=self.objective.choice_host(self, idx))
            self.solved_milps += got.solved
            plan = got.plan
            if plan is None or plan.estimate is None or not plan.estimate.fits:
                continue
            entry = (-self.objective.key(plan), -plan.estimate.step_time_s, -idx, plan)
            if entry[:2] > self.best[k][:2]:
                self.best[k] = entry
                heapq.heapify(self.best)

    def ranked(self) -> list[Plan]:
        """The plans kept, best first, each with CUDA graphs where they help."""
        key = self.objective.key
        graphed = [(-key(p), -p.estimate.step_time_s, e[2], p)  # type: ignore[union-attr]
                   for e in self.best
                   for p in [with_graphs(e[3], key, self.objective.prices_intervals,
                                         self.imbalance)
                             if self.space.cuda_graphs else e[3]]]
        return [e[3] for e in sorted(graphed, key=lambda e: e[:3], reverse=True)]
