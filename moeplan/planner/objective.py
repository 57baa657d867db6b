"""How a search ranks plans: the objective's key, bound and tie rule, one class each.

`Expected` ranks by the point estimate of the step time. `Robust` (the default) ranks by the
high end of its 80 % interval: the low end of tokens/s/GPU, priced with every unvalidated
effect disappointing (`uncertainty.pessimistic_layout`), so a plan wins only if it still wins
when its unproven terms fail. The branch and bound (`planner.branch`) asks its objective for
everything that differs between the two and never tests which one it has.

Every bound the search prunes with is a bound on the point's physics, and the interval's high
end is never below the point, so pruning stays exact under either objective. The point is the
physics slowed by a model's measured residual (`residual_slowdown`), which every factor below
carries: the robust k-th key
over the least ratio of key to point any regime of the search can have
(`least_key_factor`) is a point threshold, and over a row's own ratio (`Robust.row_factor`)
a tighter one for that row. One bound is robust's alone (`Robust.offload_bound`): a row that
must offload activations to fit is priced, at its interval's low end, on a slowed host link;
so its recompute and offload are also chosen on that link, beside the cluster's, and the
better key kept (`Robust.choice_host`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..cost_models import uncertainty as U
from ..cost_models.calibration import calibration_for
from ..specs import ClusterSpec, ModelSpec, Plan
from .enumerate import SearchSpace
from .problem import LayerTable
from .screen import with_interval_estimate

if TYPE_CHECKING:
    from .branch import BranchAndBound

OBJECTIVES = ("robust", "expected")


class Objective:
    """The point objective's answers; `Robust` overrides where the interval changes them."""

    name = "expected"
    prices_intervals = False  # whether screened plans need their interval to be ranked

    def key(self, plan: Plan) -> float:
        """Seconds a plan is ranked by (smaller is better)."""
        assert plan.estimate is not None
        return plan.estimate.step_time_s

    def key_factor(self, model: ModelSpec, cluster: ClusterSpec, space: SearchSpace) -> float:
        """The least key over the physics' step time of any plan of the search."""
        return min(residual_slowdown(model, cluster, p) for p in space.precisions)

    def row_factor(self, bb: BranchAndBound, idx: int) -> float:
        """The least key over point step time of the row's plans: the search's least."""
        return bb.scale

    def tables(self, bb: BranchAndBound, idx: int) -> list[LayerTable]:
        """The layer tables that bound a row's key."""
        return [bb.tables[bb.setup(idx)[2]]]

    def order_bound(self, bb: BranchAndBound, idx: int, tight: float) -> float:
        """The key a row re-enters the heap with, given its tight bound."""
        return tight

    def split_bound(self, bb: BranchAndBound, idx: int) -> float:
        """A bound on every plan the search can decode for the row, at any stage split: its
        levelled split's pipeline with nothing recomputed or offloaded
        (`LayerTable.balanced_pipeline_s`)."""
        layout, _, key = bb.setup(idx)
        return bb.tables[key].balanced_pipeline_s(bb.pb.model.mtp_layers, layout.pp,
                                                  layout.vpp, layout.num_microbatches)

    def offload_bound(self, bb: BranchAndBound, idx: int) -> float:
        """A bound on the key of every plan the screen can decode for the row, over the row's
        key factor (0: none beyond the split's)."""
        return 0.0

    def dominated(self, bb: BranchAndBound, idx: int) -> bool:
        """Whether the row provably ranks no better than a row already judged."""
        return False

    def choice_host(self, bb: BranchAndBound, idx: int) -> float | None:
        """The host link (seconds per byte) the row's recompute and offload are chosen on
        (`screen.solve_layout`); None: the cluster's own, which the point prices."""
        return None

    def finish(self, plans: list[Plan], imbalance: float = 1.0) -> list[Plan]:
        """The plans as reported: ranked by the point, intervals only for what is shown."""
        return [with_interval_estimate(p, imbalance) for p in plans]


class Expected(Objective):
    """Rank by the point estimate."""


class Robust(Objective):
    """Rank by the high end of the step time's 80 % interval."""

    name = "robust"
    prices_intervals = True

    def key(self, plan: Plan) -> float:
        e = plan.estimate
        assert e is not None
        return e.interval.step_time_s[1] if e.interval else e.step_time_s

    def key_factor(self, model: ModelSpec, cluster: ClusterSpec, space: SearchSpace) -> float:
        return least_key_factor(model, cluster, space)

    def row_factor(self, bb: BranchAndBound, idx: int) -> float:
        """The row's own least key-to-point ratio (`uncertainty.key_factor`: its regime's band
        widened by its own distance from the fit evidence, doublings included, which the
        search's least leaves out), once per layer-table key (which holds every field the
        band reads). Shaved by 1e-9, so that rounding between this product and the interval's
        quotient never prunes a row whose key ties the k-th; never below the search's least."""
        layout, tr, key = bb.setup(idx)
        if key not in bb.factors:
            f = (U.key_factor(bb.pb.model, bb.pb.cluster, tr, layout)
                 * residual_slowdown(bb.pb.model, bb.pb.cluster, tr.precision))
            bb.factors[key] = max(bb.scale, f * (1 - 1e-9))
        return bb.factors[key]

    def order_factor(self, bb: BranchAndBound, idx: int) -> float:
        """`row_factor` where the row's groups sit in the fabric of the narrower band
        (`uncertainty.least_key_factor_of`), once per row key: what a row's heap order reads,
        before its layout is built."""
        j = bb.key_of[idx]
        if j not in bb.order_factors:
            layout, tr, _ = bb.setup(idx)
            f = (U.least_key_factor_of(bb.pb.model, bb.pb.cluster, tr, layout)
                 * residual_slowdown(bb.pb.model, bb.pb.cluster, tr.precision))
            bb.order_factors[j] = max(bb.scale, f * (1 - 1e-9))
        return bb.order_factors[j]

    def tables(self, bb: BranchAndBound, idx: int) -> list[LayerTable]:
        """Its own table and, when no fit row backs its overlap or dispatcher, its pessimistic
        variant's, since that variant prices its key."""
        out = super().tables(bb, idx)
        worse = bb.worse_table(idx)
        return out if worse is None else [*out, worse]

    def order_bound(self, bb: BranchAndBound, idx: int, tight: float) -> float:
        """The larger of the tight bound and its key's levelled split with nothing recomputed
        or offloaded (from the same tables, at steady-state item times): both bound what the
        row can reach. The levelled split tracks what screening finds far better than the even
        spread, so the rows that set the k-th best are screened first and the k-th best
        tightens early. The order decides only which plans outside the top k get priced
        (`best_validated` is the best of those when the top k has none).

        Both are taken up by the row's key factor over the search's least (`order_factor`),
        so the heap holds bounds on keys over the least factor and stops where no row's key
        can reach the k-th key, not only where no row's point can."""
        r = self.order_factor(bb, idx) / bb.scale
        if tight * r >= bb.kth():  # past the k-th best the order is moot
            return tight * r
        return max(tight, bb.steady_split_bound(idx)) * r

    def split_bound(self, bb: BranchAndBound, idx: int) -> float:
        """The larger of its own and its pessimistic variant's levelled split, which the
        interval prices at the same choices and split."""
        b = super().split_bound(bb, idx)
        worse = bb.worse_table(idx)
        if worse is None:
            return b
        layout = bb.setup(idx)[0]
        return max(b, worse.balanced_pipeline_s(bb.pb.model.mtp_layers, layout.pp, layout.vpp,
                                                layout.num_microbatches))

    def offload_bound(self, bb: BranchAndBound, idx: int) -> float:
        """The row's least pipeline with its host link slowed (`slow_host_pipeline`), when no
        fit row backs activation offload: a plan that offloads activations is then priced, at
        its interval's low end, on the slow link (its key is at least that pipeline times the
        row's key factor), and a plan that offloads none has no copies, so the slow link
        leaves its pipeline as its point prices it. Only for a row whose layout effects are
        validated (no pessimistic variant): a variant prices the low end on another layout.
        Under memory pressure the point hides the copies the slow link exposes, so rows whose
        point wins on offload drop out without a screen."""
        if U.validated("activation_offload") or bb.pessimistic(idx) is not None:
            return 0.0
        return bb.slow_host_pipeline(idx)

    def choice_host(self, bb: BranchAndBound, idx: int) -> float | None:
        """The slowed host link of `offload_bound`, under the same condition: the key of a
        plan that offloads activations prices its copies there, so its choices are made
        there. Chosen on the cluster's link, a memory-tight row offloads what the fast link
        hides and its key then pays the slow copies (DeepSeek-V3 on 1,024 H100 at TP 4, EP 64,
        MBS 2: the point-best plan's key was 2.3x its point), where recomputing instead keeps
        its key near its point."""
        if U.validated("activation_offload") or bb.pessimistic(idx) is not None:
            return None
        return bb.slow_s_per_byte()

    def dominated(self, bb: BranchAndBound, idx: int) -> bool:
        """A row whose unvalidated overlap or dispatcher the interval's low end takes away is
        priced, at its low end, as its validated twin (alltoall, no EP overlap: the same memory
        and a superset of the recompute options, so every choice that fits the row fits the
        twin and the twin's best choices are at least as fast). When the twin cannot enter the
        top k, neither can the row: the twin is screened first."""
        j = bb.validated_twin(idx)
        if j is None:
            return False
        status, plan = bb.solved[j] if j in bb.solved else bb.solve_row(j)
        if status in ("bound", "screened", "infeasible"):
            return True
        # a twin tied with the k-th key does not prune: the row shares the key and may win
        # the tie on its point
        return plan is not None and bb.full() and self.key(plan) > bb.kth_key()

    def finish(self, plans: list[Plan], imbalance: float = 1.0) -> list[Plan]:
        return plans


def objective_for(name: str) -> Objective:
    from ..errors import SpecError

    if name not in OBJECTIVES:
        raise SpecError(f"--objective takes {' or '.join(OBJECTIVES)}, got {name!r}.")
    return Robust() if name == "robust" else Expected()


def least_key_factor(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace) -> float:
    """The least ratio of a robust rank key (the interval's high end of step time) to the point
    step time over every regime a layout of this search can fall in: e^(−q_lo) of the regime
    with the smallest downside, widened by the distance from the fit evidence that every
    layout of the search shares (`uncertainty.least_low_end`: the model, the GPU and
    precision; uncertainty.tokens_interval takes the low end from the point or below it, never
    above). A cluster's own measured band (`moeplan calibrate --from-runs`) replaces every
    regime's, and is not widened, so it is the factor."""
    measured = U.measured_bounds(cluster)
    if measured is not None:
        return math.exp(-min(measured[0], 0.0)) * min(
            residual_slowdown(model, cluster, prec) for prec in space.precisions)
    return min(math.exp(-min(U.least_low_end(model, cluster, prec, fab), 0.0))
               * residual_slowdown(model, cluster, prec)
               for prec in space.precisions for fab in ("nvlink", "scale-out"))


def residual_slowdown(model: ModelSpec, cluster: ClusterSpec, precision: str) -> float:
    """How much longer than its physics `estimate` prices every plan of the model at the
    precision (1 / Calibration.residual_for, ≥ 1): the search's bounds price the physics
    alone, so the factors that turn them into key thresholds carry it."""
    return 1.0 / calibration_for(cluster.calibration).residual_for(model.name, precision)


def validated_only(plan: Plan) -> bool:
    """Whether every modelled effect the plan rests on is backed by fit rows."""
    e = plan.estimate
    terms = e.assumptions if e is not None and e.interval is not None else [
        t.assumption for t in U.assumptions(plan.model, plan.cluster, plan.training, plan.layout,
                                          plan.choices)]
    return all(a.validated for a in terms)
