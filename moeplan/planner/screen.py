"""One layout of a search: its recompute/offload program solved, decoded into a Plan, priced.

`solve_layout` is the per-layout step of the branch and bound (`planner.branch`): the stage
problem (`problem.stage_problem`) at each optimizer-offload fraction, solved exactly without a
solver when the layers are split evenly or levelled (the screen, `ilp.solve_screen`) or by the
MILP that also places the layers (`ilp.solve`), decoded (`decode_choices`) and re-scored by the cost
model, so the ranking is the cost model's. It returns what it found and what it counted;
nothing here keeps state between layouts except the module-set cache the caller passes in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ..cost_models.calibration import Calibration
from ..cost_models.estimate import estimate, estimate_breakdown
from ..cost_models.layers import LayerCost
from ..specs import Choices, ClusterSpec, Layout, ModelSpec, Plan, TrainingSpec
from ..specs.plan import Estimate
from ..specs.rules import Facts, violations
from ..specs.stage_layout import layers_layout_text, parse_stage_layout, stage_layout_for
from .ilp import (
    InfeasibleStages,
    SolverStopped,
    StageSolution,
    evaluate,
    screen_layers,
    solve,
    solve_screen,
)
from .problem import (
    Built,
    LayerTable,
    Menu,
    Option,
    StageProblem,
    recompute_pipeline_s,
    split_options,
    stage_problem,
)
from .sets import module_sets

OPTIMIZER_OFFLOAD_GRID = (0.0, 0.5, 1.0)
SCREEN_SLACK = 1.10
"""The screening pass prices a layout by its stage problem (MILP objective plus the constant
terms) before asking `estimate`; the two differ only in the DP-exposure and optimizer terms,
which the problem takes at the balanced rank (measured on the presets: within 0.98–1.05 of the
estimate). A layout whose screened time exceeds the k-th best by more than this slack cannot
enter the top k, so the estimate is skipped (counted as `screened_by_milp`)."""


@dataclass(frozen=True)
class Problem:
    """What one search prices layouts of: the specs, the target and its calibration."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    cal: Calibration
    target: str = "megatron"
    imbalance: float = 1.0  # tokens on the busiest EP rank over the mean (`search --imbalance`)


@dataclass(frozen=True)
class Solved:
    """A layout's outcome. `status`: "plan" (the fastest plan that fits and beats the cutoff);
    "screened" (fits, but cannot beat the cutoff); "bound" (the lower bound already cannot);
    "infeasible" (proven: no choice fits at any fraction); "unsolved" (the solver stopped
    without a solution at some fraction and none fits at the others: nothing proven).
    `screened`/`solved`: the rank-separable problems and MILPs this took."""

    plan: Plan | None
    status: str
    screened: int = 0
    solved: int = 0


def physics_s(est: Estimate) -> float:
    """An estimate's step time less its model's measured residual (`Estimate.unmodelled_s`):
    what the stage problem and the search's bounds price, and so what a cutoff is in."""
    return est.step_time_s - est.unmodelled_s


def solve_layout(pb: Problem, training: TrainingSpec, layout: Layout, table: LayerTable,
                 menu: Menu, key: tuple, sets_cache: dict, *, balanced: bool = False,
                 lb_pipe: float = 0.0, cutoff: float = math.inf,
                 fractions: tuple[float, ...] | None = None,
                 with_interval: bool = True, host_s_per_byte: float | None = None) -> Solved:
    """Recompute, offload (and, unless `balanced`, layers per stage) for one layout at each
    optimizer-offload fraction, decoded into Plans and re-scored by the cost model.

    `balanced` is the screening pass: layers split evenly and levelled (`ilp.screen_layers`),
    each split solved exactly without a solver (`ilp.solve_fixed`). Otherwise the MILP places layers and chooses modules
    together. A fraction is skipped when the pipeline's lower bound plus its optimizer time
    cannot beat the cutoff (and, ranked by the point, the best so far); larger fractions are
    tried only when the plan without optimizer offload needed recompute or offload (memory
    pressure). `with_interval`: each plan is priced with its interval and the layout's plans
    compete on its high end of step time, the search's robust key (`_rank`).

    `host_s_per_byte`: choose recompute and offload as if the host link were this slow (the
    robust objective's low end, `uncertainty.slow_host`, when no fit row backs activation
    offload), then price the plan as usual. A plan ranked by its interval's high end pays its
    offload copies at the slow link there, so the choices that win on the point (offload the
    copies the fast link hides) can lose twice over on the key to recomputing instead.
    """
    grid = fractions or (OPTIMIZER_OFFLOAD_GRID if menu.options and menu.optimizer_offload
                         else (0.0,))
    # on a slowed host the choices differ: both sets compete at each fraction
    hosts: tuple[float | None, ...] = (None,) if host_s_per_byte is None else (
        None, host_s_per_byte)
    best: Plan | None = None
    base_const: float | None = None
    fits = skipped = stopped = False
    screened = solved = 0
    for f in grid:
        built = stage_problem(pb.model, pb.cluster, training, layout, pb.cal, table, menu, f)
        base_const = built.constant_s if base_const is None else base_const
        limit = cutoff if with_interval else min(
            cutoff, physics_s(best.estimate) if best and best.estimate else math.inf)
        if lb_pipe + built.constant_s >= limit:  # the fraction's optimizer time alone loses
            skipped = True
            continue
        pressure = True
        for host in hosts:
            P = built.problem if host is None else replace(built.problem, host_s_per_byte=host)
            if balanced and limit < math.inf and f == grid[0] and host is None:
                # the levelled split with nothing recomputed or offloaded is the least any
                # choice reaches at any fraction (choices only add time, fractions only add
                # optimizer time): past the screen's slack, no fraction can be estimated, so
                # none is solved
                free = min(evaluate(P, X, [()] * P.pp)[0] for X in screen_layers(P))
                if free + base_const > SCREEN_SLACK * limit:
                    return Solved(None, "bound", screened, solved)
            screened, solved = screened + balanced, solved + (not balanced)
            try:
                sol = _solve(P, key, sets_cache, balanced)
            except InfeasibleStages:
                break  # the same memory on either link: neither fits at this fraction
            except SolverStopped:
                stopped = True
                continue
            fits = True
            if host is None and not any(sol.options):
                pressure = False  # nothing to offload: the slow link changes nothing
            plan = _priced(pb, training, layout, table, menu, built, P, sol, f, limit, balanced)
            if plan is not None and with_interval:
                plan = with_interval_estimate(plan, pb.imbalance, (table.costs, table.keys))
            if plan is not None and (best is None or _rank(plan) < _rank(best)):
                best = plan
            if not pressure:
                break
        if f == 0.0 and not pressure:
            break  # no memory pressure: offloading the optimizer only adds time
    if best is not None:
        return Solved(best, "plan", screened, solved)
    status = "screened" if fits else "bound" if skipped else "unsolved" if stopped else (
        "infeasible")
    return Solved(None, status, screened, solved)


def _solve(P: StageProblem, key: tuple, sets_cache: dict, balanced: bool) -> StageSolution:
    """The stage problem solved exactly at the screen's splits (`ilp.solve_screen`) or by the
    MILP that also places the layers, its module sets built once per table key and link."""
    skey = (key, P.options, P.forbidden, P.host_s_per_byte, tuple(i.name for i in P.items))
    if skey not in sets_cache:
        sets_cache[skey] = module_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)
    if balanced:
        return solve_screen(P, sets_cache[skey])
    return solve(P, sets_cache[skey])


def _priced(pb: Problem, training: TrainingSpec, layout: Layout, table: LayerTable,
            menu: Menu, built: Built, P: StageProblem, sol: StageSolution, f: float,
            limit: float, balanced: bool) -> Plan | None:
    """The solution decoded and priced by `estimate`, when it fits and beats the limit. The
    estimate is the dearest step of a screen: skipped past the screen's slack, and where the
    plan's bare and recomputed time alone (exact, no slack) misses the limit."""
    if balanced and sol.objective_s + built.constant_s > SCREEN_SLACK * limit:
        return None
    if limit < math.inf and recompute_pipeline_s(table, P, sol.layers, sol.options,
                                                 layout.num_microbatches) >= limit:
        return None
    choices = decode_choices(pb.model, layout, menu, sol, built.leading_layers, f,
                             P.chunk_layers(sol.layers))
    # on the layout's own layer table (its imbalance included) and unchecked: the enumeration
    # checked the layout and the menu holds only what the target's rules allow
    # (`problem.menu`); `search` checks the plans it returns
    est = estimate_breakdown(pb.model, pb.cluster, training, layout, choices, pb.imbalance,
                             with_interval=False, target=pb.target, check=False,
                             table=(table.costs, table.keys)).estimate
    if not est.fits or physics_s(est) >= limit:
        return None
    return Plan(model=pb.model, cluster=pb.cluster, training=training, layout=layout,
                choices=choices, estimate=est, target=pb.target)


def _rank(plan: Plan) -> tuple[float, float]:
    """What the plans of one layout compete on: the key (the interval's high end of step
    time, a fraction's optimizer offload and the link the choices were made on can move it
    on their own) when the plan is priced with its interval, else the point; the point breaks
    a tie."""
    e = plan.estimate
    assert e is not None
    return (e.interval.step_time_s[1] if e.interval else e.step_time_s), e.step_time_s


def decode_choices(model: ModelSpec, layout: Layout, menu: Menu, sol: StageSolution,
                   dense_first: int, f: float, chunk_layers: list[int]) -> Choices:
    """The MILP's per-rank sets and layer counts as a plan's Choices: the layers per virtual
    stage become a stage layout, unless they are the default split."""
    parts = [split_options(menu.close(opts)) for opts in sol.options]
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


def least_memory(menu: Menu) -> Choices:
    """Choices that keep about the least memory the layout's menu allows: full recompute where
    allowed, else every selective module, every offload, in option order, each kept unless it
    completes a forbidden combination; the optimizer on the host."""
    full = Option.recompute("full")
    chosen: list[Option] = [full] if full in menu.options else []
    for o in menu.options:
        if o in chosen or (full in chosen and o.kind == "recompute"):
            continue
        if not any(c.hit({*chosen, o}) for c in menu.forbidden):
            chosen.append(o)
    recompute, offload = split_options(chosen)
    return Choices(recompute=[recompute], offload=[offload],
                   optimizer_offload_fraction=1.0 if menu.options and menu.optimizer_offload
                   else 0.0)


def with_interval_estimate(plan: Plan, imbalance: float = 1.0,
                           table: tuple[Mapping[str, LayerCost], Sequence[str]] | None = None
                           ) -> Plan:
    """The plan with its estimate's interval and assumptions priced (once), at the search's
    routing imbalance; `table`: its layout's layer table, when the caller holds it."""
    if plan.estimate is not None and plan.estimate.interval is not None:
        return plan
    est = estimate(plan.model, plan.cluster, plan.training, plan.layout, plan.choices,
                   imbalance, target=plan.target, point=plan.estimate, table=table)
    return plan.model_copy(update={"estimate": est})


def with_graphs(plan: Plan, rank_key, with_interval: bool,  # noqa: ANN001
                imbalance: float = 1.0) -> Plan:
    """The plan with CUDA graphs (Layout.cuda_graphs) when its target runs them with the
    plan's choices (`specs.rules`: no full or `moe` recompute under the graphs' scopes), the
    graphs' memory still fits beside them, and the plan then ranks better by `rank_key` (the
    point breaks a tie: unvalidated graphs leave a robust key where it was)."""
    if plan.layout.cuda_graphs or plan.estimate is None:
        return plan
    layout = plan.layout.model_copy(update={"cuda_graphs": True})
    if violations(Facts(plan.model, plan.training, layout, plan.choices, plan.cluster),
                  plan.target):
        return plan
    est = estimate(plan.model, plan.cluster, plan.training, layout, plan.choices, imbalance,
                   with_interval=with_interval, target=plan.target)
    if not est.fits:
        return plan
    graphed = plan.model_copy(update={"layout": layout, "estimate": est})
    if (rank_key(graphed), est.step_time_s) < (rank_key(plan), plan.estimate.step_time_s):
        return graphed
    return plan
