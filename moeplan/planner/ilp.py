"""The per-layout MILP: recompute and offload per module per pipeline rank and layers per virtual
stage, minimising step time under each rank's memory budget.

Formulation (written like Alpa's auto-sharding ILP: names follow the math, constraint groups are
labelled as below, building / solving / decoding are separate functions):

  Sets      s ∈ S virtual stages on pp ranks r(s) = s mod p;  i ∈ I items (dense layer, MoE
            layer, embedding, loss, MTP layer);  o ∈ O module options (recompute `core_attn` …
            `full`, offload `attn_norm` …: `problem.Option`);  c ∈ C module sets (subsets of O,
            pruned in `planner.sets`).
  Data      t_i      time of one item per micro-batch (fwd + bwd + exposed communication)
            w_i      static bytes of one item on its rank (weights, grads, optimizer)
            Δt_ic    seconds module set c adds to item i per micro-batch: recompute forwards plus
                     the offload copies that the item's forward (D2H) and backward (H2D) cannot hide
            k_ic     activation bytes item i keeps per in-flight micro-batch under set c: a tensor
                     goes when any option freeing it is in c (`full` frees all but the layer
                     input), else moves to host when its offload option is in c
            ψ_s      in-flight micro-batches of stage s at the rank's peak (the schedule's warm-up)
            n_is     fixed item counts (the D dense layers in stage 0; embedding; loss and MTP in
                     the last stage);  B_r memory budget of rank r
  Variables X_r ∈ ℤ≥0 layers of the repeated kind ℓ on pp rank r, split over its v model chunks
            as evenly as possible, the remainder going to the chunks holding the fewest micro-batches
            (so Ψ_r ≤ ψ̄_r X_r, ψ̄_r the mean of ψ_s over the rank's chunks);  z_rc ∈ {0,1} rank r
            runs set c;  X_rc ≥ 0 the disaggregation of X_r;  T_r rank time; M ≥ T_r.
  Objective min  α·M + β·Σ_r T_r        (pipeline: m·max + (Σ − max)/v, so α = m − 1/v, β = 1/v)
  (layers)  Σ_r X_r = L − D
  (choice)  Σ_c z_rc = 1
  (disagg)  Σ_c X_rc = X_r,  X_rc ≤ U z_rc
  (time)    T_r = t_ℓ X_r + Σ_c Δt_ℓc X_rc + Σ_{i,s∈r} n_is (t_i + Σ_c Δt_ic z_rc)
  (memory)  w_ℓ X_r + ψ̄_r Σ_c k_ℓc X_rc + Σ_{i,s∈r} n_is (w_i + ψ_s Σ_c k_ic z_rc) ≤ B_r

Layers are decided per pp rank, not per virtual stage: the pipeline model prices a rank by the
sum of its chunks, so moving layers between one rank's chunks only games the in-flight count
while unbalancing the interleaved schedule, which the model does not see.

The disaggregation (Balas) is the convex hull of "one set per rank", so the LP relaxation is tight
and HiGHS solves a DeepSeek-V3 layout in milliseconds. C holds only the module sets not dominated
item by item (no other set is at least as fast and as small for every item): a dominated set is
never strictly better for any layer counts, so dropping it loses no optimum. The MILP still picks
the modules: b_ro = Σ_{c∋o} z_rc is the decision on module o at rank r.

The optimizer-offload fraction f multiplies the stage layout (bilinear), so it is an outer
parameter: the planner solves this MILP for each f on a grid (see `planner.search`).

`build` → `solve_milp` → `decode`. The solver's status is reported as what it proves
(`outcome`): infeasible raises InfeasibleStages (the only proof that nothing fits); a time limit
with an incumbent decodes it, marked `proven_optimal=False`; a stop with no solution raises
SolverStopped, which no caller may present as infeasibility.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pulp

from .problem import Option, StageProblem, balanced_split, level_split
from .sets import (
    ModuleSets,
    coarse_sets,
    exact_fronts,
    fixed_on_rank,
    item_cost,
    module_sets,
    pareto,
    useful_sets,
)

MS = 1e3  # the MILP's time unit is the millisecond
EXACT_LIMIT = 400  # candidate sets over all ranks up to which one exact MILP is solved


@dataclass
class StageSolution:
    objective_s: float
    layers: list[int]  # X_r, layers of kind ℓ per pp rank
    options: list[list[Option]]  # per pp rank
    rank_memory_bytes: list[float] = field(default_factory=list)
    # False when the solver stopped at a time limit with an incumbent, or when a large problem
    # was solved in two steps (layers on a thinned set front first): a good plan, not a proof
    proven_optimal: bool = True


class InfeasibleStages(Exception):
    """Proven: no choice of module sets and stage layers fits the budget for this layout."""


class SolverStopped(Exception):
    """The solver stopped (a time limit before its first solution, numerical trouble) with
    neither a solution nor a proof that none exists. Never infeasibility: nothing is proven."""


class Outcome(enum.Enum):
    """What a solver run established, read from pulp's (status, solution status)."""

    OPTIMAL = "optimal"  # a solution, proven optimal
    INCUMBENT = "incumbent"  # a solution, not proven optimal (a time limit)
    INFEASIBLE = "infeasible"  # proven: no solution exists
    STOPPED = "stopped"  # neither a solution nor a proof


def outcome(status: int, sol_status: int) -> Outcome:
    """Map pulp's statuses to what they establish.

    pulp reports a HiGHS or CBC time limit as status "Optimal" with the solution status
    "Solution Found" when an incumbent exists, and as "Not Solved" when none does; only the
    status "Infeasible" is a proof (HiGHS's "unbounded or infeasible" is one too here: T_r ≥ 0,
    α, β ≥ 0 bound the objective below, so the MILP is never unbounded).
    """
    if status == pulp.LpStatusInfeasible:
        return Outcome.INFEASIBLE
    if status == pulp.LpStatusOptimal and sol_status == pulp.LpSolutionOptimal:
        return Outcome.OPTIMAL
    if status == pulp.LpStatusOptimal and sol_status == pulp.LpSolutionIntegerFeasible:
        return Outcome.INCUMBENT
    return Outcome.STOPPED


@dataclass(frozen=True)
class Milp:
    """The built MILP with the variables decoding reads: X_r (ints when the layers are given)
    and z_rc over each rank's candidate sets."""

    lp: pulp.LpProblem
    X: list
    z: dict[tuple[int, int], pulp.LpVariable]
    cand: list[list[int]]


def build(P: StageProblem, C: ModuleSets, cand: list[list[int]],
          layers: Sequence[int] | None = None) -> Milp:
    """The MILP of the module docstring over the candidate sets of each rank; `layers` fixes
    X_r."""
    R = P.pp
    lp = pulp.LpProblem("stage_choices", pulp.LpMinimize)
    U = P.free_layers
    if layers is not None:
        X: list = list(layers)
    else:
        X = [lp.add_variable(f"X_{r}", 0, U, cat="Integer") for r in range(R)]
        lp += pulp.lpSum(X) == U, "layers_total"
    ell = P.layer_item
    lay = P.items[ell]
    z = {(r, c): lp.add_variable(f"z_{r}_{c}", cat="Binary") for r in range(R) for c in cand[r]}
    T = [lp.add_variable(f"T_{r}", 0) for r in range(R)]
    M = lp.add_variable("M", 0)
    Aff = pulp.LpAffineExpression
    for r in range(R):
        cs = np.array(cand[r], dtype=np.int64)
        zr = [z[r, int(c)] for c in cs]
        lp += Aff([(v, 1.0) for v in zr]) == 1, f"choice_{r}"
        # per-set coefficients of this rank's fixed items, and their constant parts
        zt, zm, t0, m0 = fixed_on_rank(P, C, r, cs)
        psi = P.mean_inflight(r)
        dt_l, k_l = C.add_time[cs, ell], psi * C.kept[cs, ell]
        time_terms: list[tuple[pulp.LpVariable, float]] = []
        mem_terms: list[tuple[pulp.LpVariable, float]] = []
        if isinstance(X[r], int):  # layers fixed: X_rc = X_r·z_rc is already linear
            zt = zt + X[r] * dt_l
            zm = zm + X[r] * k_l
            t0 += lay.time_s * X[r]
            m0 += lay.static_bytes * X[r]
        else:
            Xc = [lp.add_variable(f"Xc_{r}_{c}", 0, U) for c in cs]
            lp += Aff([(v, 1.0) for v in Xc] + [(X[r], -1.0)]) == 0, f"disagg_{r}"
            for c, xv, zv in zip(cs, Xc, zr, strict=True):
                lp += Aff([(xv, 1.0), (zv, -float(U))]) <= 0, f"disagg_le_{r}_{c}"
            time_terms += [(X[r], lay.time_s)] + list(zip(Xc, dt_l.tolist(), strict=True))
            mem_terms += [(X[r], lay.static_bytes)] + list(zip(Xc, k_l.tolist(), strict=True))
        time_terms += list(zip(zr, zt.tolist(), strict=True))
        mem_terms += list(zip(zr, zm.tolist(), strict=True))
        # scaled (time in ms, memory as a fraction of the budget): raw seconds and bytes span
        # twelve decades, which slows HiGHS down and trips its feasibility tolerances
        inv_b = 1.0 / P.budget_bytes[r]
        lp += (Aff([(v, MS * a) for v, a in time_terms] + [(T[r], -1.0)], constant=MS * t0)
               == 0), f"time_rank_{r}"
        lp += T[r] <= M, f"time_max_{r}"
        lp += Aff([(v, a * inv_b) for v, a in mem_terms], constant=m0 * inv_b) <= 1.0, (
            f"memory_rank_{r}")
    lp += P.alpha * M + P.beta * pulp.lpSum(T), "step_time_ms"
    return Milp(lp, X, z, cand)


@contextlib.contextmanager
def _quiet_solver() -> Iterator[None]:
    """HiGHS prints a banner on stdout even with `msg=False`; `--json` promises stdout holds
    only the document, and the banner tells a user nothing, so stdout goes to /dev/null for
    the solve (its outcome is read from the status, never from the log)."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


MIP_GAP = 1e-7
"""Relative optimality gap the MILP is solved to. HiGHS stops at 1e-4 by default, which
returned a plan 4e-5 slower than the best (5.0002 s against 5.0, brute force) as "optimal":
the planner's best is the best to well below any difference a plan's price can tell."""


def solver(time_limit_s: float | None = None) -> pulp.LpSolver:
    """HiGHS in-process when highspy is installed (no subprocess per solve), else CBC; both
    to `MIP_GAP`."""
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=MIP_GAP)
    return highs if highs.available() else pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s,
                                                              gapRel=MIP_GAP)


def solve_milp(milp: Milp, time_limit_s: float | None = None) -> Outcome:
    """Run the solver on a built MILP; what it established, never decoded here."""
    with _quiet_solver():
        milp.lp.solve(solver(time_limit_s))
    return outcome(milp.lp.status, milp.lp.sol_status)


def decode(P: StageProblem, C: ModuleSets, milp: Milp, result: Outcome) -> StageSolution:
    """X_r and each rank's chosen set from a solved MILP, costed by `evaluate`.

    Raises InfeasibleStages only on a proof, SolverStopped when there is no solution to read."""
    if result is Outcome.INFEASIBLE:
        raise InfeasibleStages("no module sets and layer split fit (proven by the solver)")
    if result is Outcome.STOPPED:
        raise SolverStopped(f"the solver stopped without a solution "
                            f"({pulp.LpStatus[milp.lp.status]})")
    X = [round(float(pulp.value(x))) if not isinstance(x, int) else x for x in milp.X]
    options = []
    for r in range(P.pp):
        c = max(milp.cand[r], key=lambda c: pulp.value(milp.z[r, c]) or 0.0)
        options.append(list(C.sets[c]))
    obj, mem = evaluate(P, X, options)
    return StageSolution(obj, X, options, mem, proven_optimal=result is Outcome.OPTIMAL)


def solve_over(P: StageProblem, C: ModuleSets, cand: list[list[int]],
               layers: Sequence[int] | None = None, time_limit_s: float | None = None
               ) -> StageSolution:
    """Build, solve and decode the MILP over the given candidate sets of each rank."""
    milp = build(P, C, cand, layers)
    return decode(P, C, milp, solve_milp(milp, time_limit_s))


def solve_fixed(P: StageProblem, C: ModuleSets, layers: Sequence[int]) -> StageSolution:
    """The MILP with the layer split X_r given, solved exactly without a solver.

    With X fixed, rank r's time T_r and memory depend only on its own z_r·, so the MILP separates
    by rank, and the objective α·max_r T_r + β·Σ_r T_r grows with every T_r: each rank's fastest
    set that fits its budget is optimal for all ranks at once (ties to the smaller set, the one
    with fewer modules). That is one vectorised pass over every set C per rank — the screening pass
    of the search runs it for every surviving layout, where a solver call would cost a thousand
    times more. `tests/test_planner_ilp.py` checks it equals the MILP and brute force.

    With `P.uniform` (one set for every rank) the ranks no longer separate: every set is priced
    on every rank at once and the fitting set of least objective wins (`_fixed_uniform`).
    """
    if P.uniform:
        return _fixed_uniform(P, C, layers)
    ell = P.layer_item
    lay = P.items[ell]
    choice: list[int] = []
    for r in range(P.pp):
        x = int(layers[r])
        ft, fk, t0, m0 = fixed_on_rank(P, C, r)
        t = x * (lay.time_s + C.add_time[:, ell]) + ft + t0
        m = x * (lay.static_bytes + P.mean_inflight(r) * C.kept[:, ell]) + fk + m0
        ok = np.flatnonzero(m <= P.budget_bytes[r] * (1 + 1e-9))
        if not len(ok):
            raise InfeasibleStages(f"rank {r} does not fit with any module set")
        # fastest, then smallest memory, then the earliest (smallest) set: deterministic
        choice.append(int(ok[np.argmin(np.round(t[ok], 12))]))  # ties: the smaller set
    options = [list(C.sets[c]) for c in choice]
    X = [int(x) for x in layers]
    obj, mem = evaluate(P, X, options)
    return StageSolution(obj, X, options, mem)


def _fixed_terms(P: StageProblem, C: ModuleSets
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`fixed_on_rank` of every rank at once: (ft, fk) per rank and set (R, C), (t0, m0) per
    rank. The items fixed on a rank add n·Δt_ic and n·ψ_s·k_ic in item order, the order
    `fixed_on_rank` adds them in, so the sums are the same to the bit. The sets' terms depend
    only on where the fixed items sit (rank, count, the stage's in-flight micro-batches), not
    on the item times or bytes an optimizer-offload fraction changes: memoised per set family
    and placement."""
    R = P.pp
    t0, m0 = np.zeros(R), np.zeros(R)
    for s in range(P.stages):
        for i, n in P.fixed[s]:
            t0[s % R] += n * P.items[i].time_s
            m0[s % R] += n * P.items[i].static_bytes
    placed = tuple((s % R, i, n, P.inflight[s]) for s in range(P.stages) for i, n in P.fixed[s])
    memo = ("fixed", R, placed)
    if memo not in C.fronts:
        nt: dict[int, np.ndarray] = {}  # item -> count per rank
        nk: dict[int, np.ndarray] = {}  # item -> count × in-flight per rank
        for r, i, n, psi in placed:
            nt.setdefault(i, np.zeros(R))[r] += n
            nk.setdefault(i, np.zeros(R))[r] += n * psi
        ft, fk = np.zeros((R, len(C.sets))), np.zeros((R, len(C.sets)))
        for i in sorted(nt):
            ft += nt[i][:, None] * C.add_time[:, i][None, :]
            fk += nk[i][:, None] * C.kept[:, i][None, :]
        C.fronts[memo] = (ft, fk)
    ft, fk = C.fronts[memo]
    return ft, fk, t0, m0


def _rank_costs(P: StageProblem, C: ModuleSets, layers: Sequence[int]
                ) -> tuple[np.ndarray, np.ndarray]:
    """(T, fits): every set's time on every rank (R, C) at the given layers, and whether it
    fits there."""
    ell = P.layer_item
    lay = P.items[ell]
    ft, fk, t0, m0 = _fixed_terms(P, C)
    x = np.array([int(v) for v in layers], dtype=float)[:, None]
    psi = np.array([P.mean_inflight(r) for r in range(P.pp)])[:, None]
    T = x * (lay.time_s + C.add_time[:, ell])[None, :] + ft + t0[:, None]
    m = x * (lay.static_bytes + psi * C.kept[:, ell][None, :]) + fk + m0[:, None]
    ok = m <= np.array(P.budget_bytes, dtype=float)[:, None] * (1 + 1e-9)
    return T, ok


def _fixed_uniform(P: StageProblem, C: ModuleSets, layers: Sequence[int]) -> StageSolution:
    """`solve_fixed` when one set serves every rank: the set that fits every rank with the
    least α·max_r T_r + β·Σ_r T_r (ties to the smaller set)."""
    T, ok = _rank_costs(P, C, layers)
    fits = np.flatnonzero(ok.all(axis=0))
    if not len(fits):
        raise InfeasibleStages("no one module set fits every rank")
    obj = P.alpha * T[:, fits].max(axis=0) + P.beta * T[:, fits].sum(axis=0)
    c = int(fits[np.argmin(np.round(obj, 12))])
    X = [int(x) for x in layers]
    options = [list(C.sets[c])] * P.pp
    o, mem = evaluate(P, X, options)
    return StageSolution(o, X, options, mem)


def _solve_uniform(P: StageProblem, C: ModuleSets) -> StageSolution:
    """Layers and one set for every rank together, exactly and without a solver.

    With the set c fixed, Σ_r T_r = (t_ℓ + Δt_ℓc)·(L − D) + const does not depend on the split,
    so the objective α·max + β·Σ is least where max_r T_r is: every rank's time grows by the
    same t_ℓ + Δt_ℓc per layer, and level filling under each rank's memory cap
    (`_fill_all`) finds that split. The least objective over the sets not dominated on the
    numbers the ranks' times and memories read wins (ties to the smaller set).

    A set's objective is at least α·max(mean_r T_r, max_r base_r) + β·Σ_r T_r (its Σ is exact
    at any split, and no rank's time falls below its base), so the sets are filled in the
    order of that bound, a block at a time, until the next bound is above the best objective
    found: the sets left cannot reach it (DeepSeek-V3's top plans at PP 16 hold some 2,500
    sets, of which a few blocks are filled). A set that dominates another has no larger bound
    and no larger objective, so the sets tied at the least objective hold every set that
    dominates one of them, and the front's winner is the smallest set of their own front."""
    ell = P.layer_item
    lay = P.items[ell]
    ft, fk, t0, m0 = _fixed_terms(P, C)
    # every set at once: its slope, each rank's base time and layer cap (C, R)
    slope = lay.time_s + C.add_time[:, ell]
    base = (ft + t0[:, None]).T
    cap = np.stack([_caps(P.budget_bytes[r] * (1 + 1e-9) - fk[r] - m0[r],
                          lay.static_bytes + P.mean_inflight(r) * C.kept[:, ell],
                          P.free_layers) for r in range(P.pp)], axis=1)
    ok = (cap >= 0).all(axis=1) & (cap.sum(axis=1) >= P.free_layers)  # else: no split fits
    total = base.sum(axis=1) + slope * P.free_layers
    lb = np.where(slope > 0, P.alpha * np.maximum(total / P.pp, base.max(axis=1))
                  + P.beta * total, -np.inf)
    todo = np.flatnonzero(ok)
    todo = todo[np.lexsort((todo, lb[todo]))]
    least = math.inf
    found: dict[int, tuple[float, list[int]]] = {}
    for a in range(0, len(todo), UNIFORM_BLOCK):
        block = todo[a:a + UNIFORM_BLOCK]
        # the margin covers the objectives' rounding to 12 digits at any size
        if lb[block[0]] - max(1e-9 * abs(lb[block[0]]), 1e-11) > least:
            break  # every set left is bounded above the best: none can reach it
        rising = block[slope[block] > 0]
        filled = dict(zip(rising.tolist(), _fill_all(slope[rising], base[rising], cap[rising],
                                                     P.free_layers), strict=True))
        for c in block.tolist():
            X = filled[c] if c in filled else _fill_flat(base[c], cap[c], P.free_layers)
            if X is None:
                continue
            T = base[c] + slope[c] * np.array(X)
            found[c] = (round(float(P.alpha * T.max() + P.beta * T.sum()), 12), X)
            least = min(least, found[c][0])
    if not found:
        raise InfeasibleStages("no one module set fits every rank at any layer split")
    tied = np.array(sorted(c for c, (o, _) in found.items() if o == least), dtype=np.int64)
    cols = [C.add_time[tied, ell], C.kept[tied, ell], *ft[:, tied], *fk[:, tied]]
    c = int(tied[pareto(np.round(np.stack(cols, axis=1), 12))].min())
    X = found[c][1]
    options = [list(C.sets[c])] * P.pp
    o, mem = evaluate(P, X, options)
    return StageSolution(o, X, options, mem)


UNIFORM_BLOCK = 16
"""Sets `_solve_uniform` fills between looks at its bound."""


def _caps(room: np.ndarray, per_layer: np.ndarray, most: int) -> np.ndarray:
    """Layers a rank holds in `room` bytes at `per_layer` bytes each, at most `most`, per set;
    −1 where its fixed items alone overflow."""
    with np.errstate(over="ignore", invalid="ignore"):  # the entries `most` or −1 replace
        held = np.floor_divide(room, np.where(per_layer > 0, per_layer, 1.0))  # Python's //
        out = np.where((per_layer <= 0) | (room >= per_layer * most), most,
                       np.minimum(held, most)).astype(np.int64)
    return np.where(room < 0, -1, out)


def _fill_all(slope: np.ndarray, base: np.ndarray, cap: np.ndarray, total: int
              ) -> list[list[int] | None]:
    """Per set (slope > 0, caps summing to `total` or more), integer layers X_r ≤ cap_r summing
    to `total` that minimise max_r (slope·X_r + base_r); None where none is found.

    The ranks share the slope, so the optimum is a water level: the least level t with
    Σ_r min(cap_r, ⌊(t − base_r)/slope⌋⁺) ≥ total. Every optimal max is one of the levels
    base_r + slope·k, and the count only grows with the level, so each set's sorted levels are
    searched by bisection, every set at once; layers past `total` come off ranks standing at
    the level (which leaves the max and Σ_r T_r where they are)."""
    F = len(slope)
    if not F:
        return []
    levels = np.sort((base[:, :, None] + slope[:, None, None] * np.arange(total + 1))
                     .reshape(F, -1), axis=1)
    rows = np.arange(F)

    def counts(at: np.ndarray) -> np.ndarray:
        lv = levels[rows, at]
        return np.clip(np.floor((lv[:, None] - base) / slope[:, None] + 1e-9).astype(np.int64),
                       0, cap)

    lo, hi = np.zeros(F, dtype=np.int64), np.full(F, levels.shape[1] - 1)
    held = counts(hi).sum(axis=1) >= total  # else no level holds `total`
    while (lo < hi).any():
        mid = (lo + hi) // 2
        holds = counts(mid).sum(axis=1) >= total
        lo, hi = np.where(holds, lo, mid + 1), np.where(holds, mid, hi)
    lo = np.where(held, lo, 0)
    at, lv = counts(lo), levels[rows, lo]
    out: list[list[int] | None] = []
    for i in range(F):
        X, level = at[i].copy(), lv[i]
        excess = int(X.sum()) - total
        for r in range(len(X) - 1, -1, -1):
            if excess <= 0:
                break
            if X[r] > 0 and abs(base[i, r] + slope[i] * X[r] - level) <= 1e-9 * max(1.0, level):
                X[r] -= 1
                excess -= 1
        out.append(X.tolist() if excess == 0 else None)
    return out


def _fill_flat(base: np.ndarray, cap: np.ndarray, total: int) -> list[int]:
    """`_fill_all` of a set whose layers add no time (slope ≤ 0): the ranks of least base
    first, each up to its cap."""
    X = np.zeros(len(base), dtype=np.int64)
    for r in np.argsort(base, kind="stable"):
        X[r] = min(int(cap[r]), total - int(X.sum()))
    return X.tolist()


def balanced_layers(P: StageProblem) -> list[int]:
    """X_r as even as possible, the remainder to the ranks holding the fewest micro-batches."""
    return balanced_split(P.free_layers, P.pp, P.vpp, P.inflight)


def level_layers(P: StageProblem) -> list[int]:
    """X_r of the least bare pipeline (`problem.level_split`): fewer layers on the ranks whose
    fixed items (embedding, leading dense layers, loss, MTP) take time, ties to the ranks
    holding the fewest micro-batches."""
    fixed = [sum(P.items[i].time_s * n for s in range(r, P.stages, P.pp) for i, n in P.fixed[s])
             for r in range(P.pp)]
    return level_split(P.free_layers, fixed, P.items[P.layer_item].time_s,
                       [P.mean_inflight(r) for r in range(P.pp)])


def screen_layers(P: StageProblem) -> list[list[int]]:
    """The stage splits the screen solves exactly (`solve_fixed`): the balanced one (the most
    even memory) and, where it differs, the levelled one (the least bare time)."""
    even, level = balanced_layers(P), level_layers(P)
    return [even] if level == even else [even, level]


def solve_screen(P: StageProblem, C: ModuleSets) -> StageSolution:
    """The best of `solve_fixed` over the screen's splits (`screen_layers`); InfeasibleStages
    when none fits. The levelled split goes first: its bare objective is the least of any
    split, so once its solution is at or below the even split's bare objective (always,
    where nothing needs recomputing or offloading), the even split cannot win and is not
    solved."""
    best: StageSolution | None = None
    for X in reversed(screen_layers(P)):
        if best is not None and evaluate(P, X, [()] * P.pp)[0] >= best.objective_s:
            continue
        try:
            sol = solve_fixed(P, C, X)
        except InfeasibleStages:
            continue
        if best is None or sol.objective_s < best.objective_s:
            best = sol
    if best is None:
        raise InfeasibleStages("no module set fits at the balanced or the levelled split")
    return best


def solve(problem: StageProblem, sets: ModuleSets | None = None,
          layers: Sequence[int] | None = None, time_limit_s: float | None = None
          ) -> StageSolution:
    """Prune the module sets, then build, solve and decode; raises InfeasibleStages when nothing
    provably fits, SolverStopped when the solver stopped (`time_limit_s` per MILP) with neither
    a solution nor a proof.

    `layers` (X_r per rank) fixes the stage split and leaves only the module sets, which
    separate by rank (`solve_fixed`). Otherwise, when the exact fronts hold at most EXACT_LIMIT
    sets in all, one MILP decides layers and sets together; larger ones (DeepSeek-V3's first and
    last ranks hold hundreds of non-dominated sets) are solved in two steps: the MILP over layers
    and sets on a thinned front of each rank's sets at the balanced layer count
    (`sets.coarse_sets`), then every set with those layers fixed. The thinned sets prove
    nothing: when they fit no layer split, one MILP over all useful sets decides.
    """
    P = problem
    if min(P.budget_bytes) <= 0:
        raise InfeasibleStages("buffers alone exceed the memory budget")
    C = sets or module_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)
    fixed = layers if layers is not None else P.fixed_layers
    if fixed is not None:
        return solve_fixed(P, C, fixed)
    if P.uniform:
        return _solve_uniform(P, C)
    exact = useful_sets(P, C, exact_fronts(P, C))
    if not all(exact):
        raise InfeasibleStages("a rank fits no module set at any layer count")
    if sum(map(len, exact)) <= EXACT_LIMIT:
        return solve_over(P, C, exact, None, time_limit_s)
    try:
        first = solve_over(P, C, coarse_sets(P, C), None, time_limit_s)
    except InfeasibleStages:
        return solve_over(P, C, exact, None, time_limit_s)
    return dataclasses.replace(solve_fixed(P, C, first.layers), proven_optimal=False)


def evaluate(problem: StageProblem, layers: Sequence[int], options: Sequence[Sequence[Option]]
             ) -> tuple[float, list[float]]:
    """Objective and per-rank memory of given choices (layers X_r per rank), costed item by item
    with `item_cost` — independent of the MILP's algebra, for the brute-force reference."""
    P = problem
    T = [0.0] * P.pp
    mem = [0.0] * P.pp
    lay = P.items[P.layer_item]
    for r in range(P.pp):
        chosen = set(options[r])
        dt, kept = item_cost(lay, chosen, P.host_s_per_byte)
        T[r] += (lay.time_s + dt) * layers[r]
        mem[r] += (lay.static_bytes + P.mean_inflight(r) * kept) * layers[r]
        for s in range(r, P.stages, P.pp):
            for i, n in P.fixed[s]:
                item = P.items[i]
                dt, kept = item_cost(item, chosen, P.host_s_per_byte)
                T[r] += (item.time_s + dt) * n
                mem[r] += (item.static_bytes + P.inflight[s] * kept) * n
    return P.alpha * max(T) + P.beta * sum(T), mem
