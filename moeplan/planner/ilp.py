"""The per-layout MILP: recompute and offload per module per pipeline rank and layers per virtual
stage, minimising step time under each rank's memory budget.

Formulation (written like Alpa's auto-sharding ILP: names follow the math, constraint groups are
labelled as below, building / solving / decoding are separate functions):

  Sets      s ∈ S virtual stages on pp ranks r(s) = s mod p;  i ∈ I items (dense layer, MoE
            layer, embedding, loss, MTP layer);  o ∈ O module options (recompute `core_attn` …
            `full`, offload `offload:attn_norm` …);  c ∈ C module sets (subsets of O).
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
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pulp

MS = 1e3  # the MILP's time unit is the millisecond


@dataclass(frozen=True)
class Group:
    """Activation bytes of one item that the same options free or move."""

    bytes: float
    recompute_by: frozenset[str] = frozenset()
    offload_by: str | None = None


@dataclass(frozen=True)
class Item:
    """One layer kind (or the embedding/loss/MTP) for one micro-batch on one GPU."""

    name: str
    time_s: float  # t_i
    fwd_s: float  # forward compute that hides the device-to-host copies
    bwd_s: float  # backward compute that hides the host-to-device copies
    static_bytes: float  # w_i
    groups: tuple[Group, ...] = ()
    recompute_s: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class StageProblem:
    """Everything the MILP needs for one layout; built from the cost models by the planner."""

    items: tuple[Item, ...]
    layer_item: int  # ℓ: the repeated kind whose count per stage is decided
    free_layers: int  # L − D: layers of kind ℓ to place
    fixed: tuple[tuple[tuple[int, int], ...], ...]  # per stage: (item, count) fixed there
    pp: int
    vpp: int
    inflight: tuple[float, ...]  # ψ_s
    host_s_per_byte: float
    budget_bytes: tuple[float, ...]  # B_r
    alpha: float
    beta: float
    options: tuple[str, ...]  # O
    exclusive: tuple[tuple[str, str], ...] = ()
    fixed_layers: tuple[int, ...] | None = None  # X_r given (a user's stage layout)

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, s: int) -> int:
        return s % self.pp

    def mean_inflight(self, r: int) -> float:
        """ψ̄_r: mean in-flight micro-batches over rank r's chunks."""
        return sum(self.inflight[r::self.pp]) / self.vpp

    def chunk_layers(self, X: Sequence[int]) -> list[int]:
        """x_s from X_r: even split, the remainder to the chunks holding fewest micro-batches."""
        x = [0] * self.stages
        for r in range(self.pp):
            q, extra = divmod(int(X[r]), self.vpp)
            chunks = sorted(range(self.vpp), key=lambda v: (self.inflight[v * self.pp + r], -v))
            for rank_in_order, v in enumerate(chunks):
                x[v * self.pp + r] = q + (1 if rank_in_order < extra else 0)
        return x


class SetNames(Sequence[tuple[str, ...]]):
    """The option names of each set, decoded from its bit mask only when asked: a search builds
    thousands of sets per layout key and names the few it picks."""

    def __init__(self, options: tuple[str, ...], masks: np.ndarray):
        self.options, self.masks = options, masks

    def __len__(self) -> int:
        return len(self.masks)

    def __getitem__(self, c):  # type: ignore[override]
        if isinstance(c, slice):
            return [self[i] for i in range(*c.indices(len(self)))]
        m = int(self.masks[c])
        return tuple(o for j, o in enumerate(self.options) if m >> j & 1)


@dataclass(frozen=True)
class ModuleSets:
    """The non-dominated module sets C with Δt_ic and k_ic."""

    sets: Sequence[tuple[str, ...]]
    add_time: np.ndarray  # (C, I)
    kept: np.ndarray  # (C, I)
    fronts: dict = field(default_factory=dict, compare=False, repr=False)  # memo of rank fronts


@dataclass
class StageSolution:
    objective_s: float
    layers: list[int]  # X_r, layers of kind ℓ per pp rank
    options: list[list[str]]  # per pp rank
    rank_memory_bytes: list[float] = field(default_factory=list)


class InfeasibleStages(Exception):
    """No choice of module sets and stage layers fits the budget for this layout."""


def item_cost(item: Item, chosen: set[str], h: float) -> tuple[float, float]:
    """(Δt, kept bytes) of one item under one module set: the reference for `module_sets`."""
    rec = sum(t for o, t in item.recompute_s if o in chosen)
    kept = off = 0.0
    for g in item.groups:
        if g.recompute_by & chosen:
            continue
        if g.offload_by in chosen:
            off += g.bytes
        else:
            kept += g.bytes
    copy = h * off
    return rec + max(0.0, copy - item.fwd_s) + max(0.0, copy - item.bwd_s), kept


def module_sets(items: Sequence[Item], options: Sequence[str],
                exclusive: Sequence[tuple[str, str]], h: float) -> ModuleSets:
    """Every allowed subset of the options, costed per item with numpy; subsets that cost exactly
    the same as a smaller one are dropped (the per-rank fronts are taken in `rank_sets`).

    Options no item reacts to (`mla_up_proj` without MLA, `shared_experts` without shared
    experts) are left out before the subsets are formed: each halves the work and could only
    add sets that cost the same as a smaller one."""
    used = {o for it in items for o, t in it.recompute_s if t}
    used |= {o for it in items for g in it.groups for o in (*g.recompute_by, g.offload_by)}
    options = [o for o in options if o in used]
    n_opt = len(options)
    bit = {o: 1 << j for j, o in enumerate(options)}
    masks = np.arange(1 << n_opt, dtype=np.int64)
    ok = np.ones(masks.shape, dtype=bool)
    for a, b in exclusive:
        if a in bit and b in bit:
            ok &= (masks & (bit[a] | bit[b])) != (bit[a] | bit[b])
    masks = masks[ok]
    add = np.zeros((len(masks), len(items)))
    kept = np.zeros((len(masks), len(items)))
    for i, item in enumerate(items):
        off = np.zeros(len(masks))
        for o, t in item.recompute_s:
            if o in bit and t:
                add[:, i] += t * ((masks & bit[o]) != 0)
        for g in item.groups:
            rb = sum(bit[o] for o in g.recompute_by if o in bit)
            freed = (masks & rb) != 0
            moved = ~freed & ((masks & bit[g.offload_by]) != 0) if g.offload_by in bit else (
                np.zeros(len(masks), dtype=bool))
            off += g.bytes * moved
            kept[:, i] += g.bytes * (~freed & ~moved)
        copy = h * off
        add[:, i] += np.maximum(0.0, copy - item.fwd_s) + np.maximum(0.0, copy - item.bwd_s)
    vec = np.round(np.hstack([add, kept]), 12) + 0.0  # + 0.0: no −0.0 bytes
    # identical cost vectors: keep the smallest set (fewest modules, then lowest mask); a dict
    # over the rows' bytes, since sorting 10⁴ float rows (np.unique) costs ten times more
    order = np.lexsort((masks, np.bitwise_count(masks)))
    rows = np.ascontiguousarray(vec[order]).view(np.dtype((np.void, vec.shape[1] * 8))).ravel()
    seen: dict[bytes, int] = {}
    for pos, row in enumerate(rows.tolist()):
        seen.setdefault(row, pos)
    keep = order[np.sort(np.fromiter(seen.values(), dtype=np.int64))]
    return ModuleSets(SetNames(tuple(options), masks[keep]), add[keep], kept[keep])


def pareto(v: np.ndarray) -> np.ndarray:
    """Indices of the rows no other row dominates (≤ everywhere, < somewhere); of equal rows the
    first is kept.

    Rows are swept in lexicographic order: a row can only be dominated by one before it, so each
    is checked against the front found so far — O(N·F) instead of O(N²).
    """
    order = np.lexsort(v.T[::-1])
    front: list[int] = []
    fv = np.empty((len(v), v.shape[1]))
    n = 0
    for k in order:
        row = v[k]
        if n and ((fv[:n] <= row).all(axis=1)).any():  # dominated, or equal to a kept row
            continue
        front.append(int(k))
        fv[n] = row
        n += 1
    return np.array(sorted(front), dtype=np.int64)


def fixed_on_rank(P: StageProblem, C: ModuleSets, r: int, cs: np.ndarray | slice = slice(None)
                  ) -> tuple[np.ndarray, np.ndarray, float, float]:
    """What the items fixed on rank r add, per module set in `cs`: Σ n·Δt_ic and Σ n·ψ_s·k_ic,
    and their constant time and static bytes Σ n·t_i and Σ n·w_i (the (time) and (memory)
    rows of the formulation, without the repeated layer)."""
    ft = np.zeros(len(C.add_time[cs]))
    fk = np.zeros(len(ft))
    t0 = m0 = 0.0
    for s in range(r, P.stages, P.pp):
        for i, n in P.fixed[s]:
            ft += n * C.add_time[cs, i]
            fk += n * P.inflight[s] * C.kept[cs, i]
            t0 += n * P.items[i].time_s
            m0 += n * P.items[i].static_bytes
    return ft, fk, t0, m0


def rank_sets(P: StageProblem, C: ModuleSets, r: int, layers: float | None = None) -> list[int]:
    """Indices of the module sets worth considering on rank r.

    A rank's time and memory depend on a set only through four numbers: Δt and k of the
    repeated layer, and Σ n·Δt and Σ n·ψ·k over the items fixed on the rank. A set dominated in
    these four is never strictly better for any layer count, so that front is exact. With
    `layers` given, the front is taken on the rank's two totals at that layer count instead
    (smaller; exact only at that count).
    """
    ell = P.layer_item
    ft, fk, _, _ = fixed_on_rank(P, C, r)
    if layers is None:
        v = np.stack([C.add_time[:, ell], C.kept[:, ell], ft, fk], axis=1)
    else:
        psi = P.mean_inflight(r)
        v = np.stack([C.add_time[:, ell] * layers + ft, C.kept[:, ell] * psi * layers + fk], axis=1)
    return [int(k) for k in pareto(np.round(v, 12))]


def build(P: StageProblem, C: ModuleSets, cand: list[list[int]],
          layers: Sequence[int] | None = None) -> tuple[pulp.LpProblem, dict]:
    """The MILP of the module docstring over the candidate sets of each rank; `layers` fixes
    X_r. Returned with its variables for decoding."""
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
    return lp, {"X": X, "z": z, "cand": cand}


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


def solver() -> pulp.LpSolver:
    """HiGHS in-process when highspy is installed (no subprocess per solve), else CBC."""
    highs = pulp.HiGHS(msg=False)
    return highs if highs.available() else pulp.PULP_CBC_CMD(msg=False)


EXACT_LIMIT = 400  # candidate sets over all ranks up to which one exact MILP is solved
COARSE_SETS = 8  # sets per rank in the first of the two MILPs for larger problems


def _solve(P: StageProblem, C: ModuleSets, cand: list[list[int]],
           layers: Sequence[int] | None) -> StageSolution:
    lp, v = build(P, C, cand, layers)
    with _quiet_solver():
        lp.solve(solver())
    if pulp.LpStatus[lp.status] != "Optimal":
        raise InfeasibleStages(pulp.LpStatus[lp.status])
    X = [round(float(pulp.value(x))) if not isinstance(x, int) else x for x in v["X"]]
    options = []
    for r in range(P.pp):
        c = max(v["cand"][r], key=lambda c: pulp.value(v["z"][r, c]) or 0.0)
        options.append(list(C.sets[c]))
    obj, mem = evaluate(P, X, options)
    return StageSolution(obj, X, options, mem)


def solve_fixed(P: StageProblem, C: ModuleSets, layers: Sequence[int]) -> StageSolution:
    """The MILP with the layer split X_r given, solved exactly without a solver.

    With X fixed, rank r's time T_r and memory depend only on its own z_r·, so the MILP separates
    by rank, and the objective α·max_r T_r + β·Σ_r T_r grows with every T_r: each rank's fastest
    set that fits its budget is optimal for all ranks at once (ties to the smaller set, the one
    with fewer modules). That is one vectorised pass over every set C per rank — the screening pass
    of the search runs it for every surviving layout, where a solver call would cost a thousand
    times more. `tests/test_planner_ilp.py` checks it equals the MILP and brute force.
    """
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


def balanced_layers(P: StageProblem) -> list[int]:
    """X_r as even as possible, the remainder to the ranks holding the fewest micro-batches."""
    q, extra = divmod(P.free_layers, P.pp)
    ranks = sorted(range(P.pp), key=lambda r: (P.mean_inflight(r), -r))
    X = [q] * P.pp
    for r in ranks[:extra]:
        X[r] += 1
    return X


def exact_fronts(P: StageProblem, C: ModuleSets) -> list[list[int]]:
    """`rank_sets` of every rank, memoised on the module sets: the front depends only on which
    items are fixed on the rank and the ratios of their in-flight counts (a common factor ψ
    scales one coordinate and leaves dominance unchanged), so ranks and layouts share fronts."""
    memo = C.fronts
    out = []
    for r in range(P.pp):
        fixed = [(i, n, P.inflight[s]) for s in range(r, P.stages, P.pp) for i, n in P.fixed[s]]
        psi0 = fixed[0][2] if fixed and fixed[0][2] else 1.0
        sig = (P.layer_item, tuple((i, n, round(ps / psi0, 9)) for i, n, ps in fixed))
        if sig not in memo:
            memo[sig] = rank_sets(P, C, r)
        out.append(memo[sig])
    return out


def useful_sets(P: StageProblem, C: ModuleSets, cand: list[list[int]]) -> list[list[int]]:
    """Per rank, the candidate sets that are the rank's fastest fitting set at some layer count.

    Exact: take any optimum (X*, z*) and give each rank r the fastest set that fits at X*_r; its
    T_r does not grow and it still fits, and the objective grows with every T_r, so the result
    is optimal too and uses only these sets. At most L − D + 1 sets per rank survive, usually a
    handful (one when memory never binds), where the fronts hold hundreds: the MILP keeps the
    whole choice of layers and sets but solves in milliseconds.
    """
    ell = P.layer_item
    lay = P.items[ell]
    X = np.arange(P.free_layers + 1, dtype=float)[:, None]  # (U+1, 1) layer counts
    out = []
    for r in range(P.pp):
        cs = np.array(sorted(cand[r]), dtype=np.int64)  # ascending: ties go to the smaller set
        ft, fk, t0, m0 = fixed_on_rank(P, C, r, cs)
        t = np.round(X * (lay.time_s + C.add_time[cs, ell]) + ft + t0, 12)  # (U+1, |cs|)
        m = X * (lay.static_bytes + P.mean_inflight(r) * C.kept[cs, ell]) + fk + m0
        ok = m <= P.budget_bytes[r] * (1 + 1e-9)
        fastest = np.argmin(np.where(ok, t, np.inf), axis=1)[ok.any(axis=1)]
        out.append(sorted(set(cs[fastest].tolist())))
    return out


def solve(problem: StageProblem, sets: ModuleSets | None = None,
          layers: Sequence[int] | None = None) -> StageSolution:
    """Build, solve and decode; raises InfeasibleStages when nothing fits.

    `layers` (X_r per rank) fixes the stage split and leaves only the module sets, which
    separate by rank (`solve_fixed`). Otherwise, when the exact fronts hold at most EXACT_LIMIT
    sets in all, one MILP decides layers and sets together; larger ones (DeepSeek-V3's first and
    last ranks hold hundreds of non-dominated sets) are solved in two steps: the MILP over layers
    and sets on a thinned front of each rank's sets at the balanced layer count, then every set
    with those layers fixed.
    """
    P = problem
    if min(P.budget_bytes) <= 0:
        raise InfeasibleStages("buffers alone exceed the memory budget")
    C = sets or module_sets(P.items, P.options, P.exclusive, P.host_s_per_byte)
    fixed = layers if layers is not None else P.fixed_layers
    if fixed is not None:
        return solve_fixed(P, C, fixed)
    exact = useful_sets(P, C, exact_fronts(P, C))
    if not all(exact):
        raise InfeasibleStages("a rank fits no module set at any layer count")
    if sum(map(len, exact)) <= EXACT_LIMIT:
        return _solve(P, C, exact, None)
    even = P.free_layers / P.pp
    coarse = []
    for r in range(P.pp):
        front = rank_sets(P, C, r, even)
        if len(front) > COARSE_SETS:  # thin evenly along the front (it is sorted by time)
            front = [front[i] for i in sorted(set(np.linspace(0, len(front) - 1, COARSE_SETS)
                                                  .round().astype(int)))]
        coarse.append(front)
    first = _solve(P, C, coarse, None)
    return solve_fixed(P, C, first.layers)


def evaluate(problem: StageProblem, layers: Sequence[int], options: Sequence[Sequence[str]]
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
