"""Pruning of the MILP's candidate module sets: which subsets of the options are worth a variable.

The MILP (`planner.ilp`) gives each pipeline rank one module set c ∈ C. Every allowed subset of
the options is a set, thousands for a DeepSeek-V3 layout, but few are ever worth picking; each
step below drops only sets that can never be strictly better, so the optimum survives:
  `module_sets`   every allowed subset, costed per item (Δt_ic, k_ic); sets costing exactly the
                  same as a smaller one dropped;
  `rank_sets`     per rank, the sets not dominated in the four numbers the rank's time and
                  memory depend on (`exact_fronts` memoises them across ranks and layouts);
  `useful_sets`   per rank, the sets that are the fastest fitting one at some layer count;
  `coarse_sets`   a thinned front at the balanced layer count, for the first of the two MILPs of
                  large problems (a heuristic: it proves nothing on its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from .problem import Combo, Item, Option, StageProblem, as_combo

COARSE_SETS = 8  # sets per rank in the first of the two MILPs for larger problems


class SetNames(Sequence[tuple[Option, ...]]):
    """The options of each set, decoded from its bit mask only when asked: a search builds
    thousands of sets per layout key and names the few it picks."""

    def __init__(self, options: tuple[Option, ...], masks: np.ndarray):
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

    sets: Sequence[tuple[Option, ...]]
    add_time: np.ndarray  # (C, I)
    kept: np.ndarray  # (C, I)
    # memo of rank fronts (`exact_fronts`) and of the fixed items' terms (`ilp._rank_costs`)
    fronts: dict = field(default_factory=dict, compare=False, repr=False)


def item_cost(item: Item, chosen: set[Option], h: float) -> tuple[float, float]:
    """(Δt, kept bytes) of one item under one module set: the reference for `module_sets`.
    The offload copies hide behind the item's own forward and backward only, as the estimate
    prices them (`cost_models.estimate.StageTerms.offload_s`)."""
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


def module_sets(items: Sequence[Item], options: Sequence[Option],
                forbidden: Sequence[Combo | tuple[Option, Option]], h: float) -> ModuleSets:
    """Every allowed subset of the options, costed per item with numpy; subsets that cost exactly
    the same as a smaller one are dropped (the per-rank fronts are taken in `rank_sets`).

    Options no item reacts to (`mla_up_proj` without MLA, `shared_experts` without shared
    experts) are left out before the subsets are formed: each halves the work and could only
    add sets that cost the same as a smaller one. Subsets that act alike on every item (the
    same recompute options with a time, the same tensors freed and moved) cost the same to the
    bit, so only the smallest of each such class is costed (`_acting_sets`, shared by every
    layout whose items have the same shape): a fifth of the subsets for DeepSeek-V3."""
    shape = tuple((tuple(o for o, t in it.recompute_s if t),
                   tuple((g.recompute_by, g.offload_by) for g in it.groups)) for it in items)
    options, masks = _acting_sets(tuple(options), tuple(as_combo(c) for c in forbidden), shape)
    bit = {o: 1 << j for j, o in enumerate(options)}
    add = np.zeros((len(masks), len(items)))
    kept = np.zeros((len(masks), len(items)))
    for i, item in enumerate(items):
        off = np.zeros(len(masks))
        for o, t in item.recompute_s:
            if o in bit and t:
                add[:, i] += t * ((masks & bit[o]) != 0)
        for g in item.groups:
            freed, moved = _freed_moved(masks, g.recompute_by, g.offload_by, bit)
            off += g.bytes * moved
            kept[:, i] += g.bytes * (~freed & ~moved)
        copy = h * off
        add[:, i] += np.maximum(0.0, copy - item.fwd_s) + np.maximum(0.0, copy - item.bwd_s)
    # identical cost vectors: keep the smallest set (masks come in that order: fewest modules,
    # then lowest mask); a dict over the rows' bytes, since sorting float rows costs more
    vec = np.round(np.hstack([add, kept]), 12) + 0.0  # + 0.0: no −0.0 bytes
    keep = _first_of_each(vec)
    return ModuleSets(SetNames(options, masks[keep]), add[keep], kept[keep])


def _freed_moved(masks: np.ndarray, recompute_by: frozenset[Option], offload_by: Option | None,
                 bit: dict[Option, int]) -> tuple[np.ndarray, np.ndarray]:
    """Per set: whether it frees a tensor group (recomputes a module that re-creates it) and,
    if not, whether it moves the group to host (offloads it)."""
    rb = sum(bit[o] for o in recompute_by if o in bit)
    freed = (masks & rb) != 0
    moved = ~freed & ((masks & bit[offload_by]) != 0) if offload_by in bit else (
        np.zeros(len(masks), dtype=bool))
    return freed, moved


def _first_of_each(rows: np.ndarray) -> np.ndarray:
    """Indices of the first occurrence of each distinct row, ascending.

    Rows are grouped by one number each, a weighted sum of their columns taken column by
    column (so equal rows get equal numbers, bit for bit), and the grouping is kept only when
    every row equals the first of its group; otherwise (two rows sharing a number by chance)
    a dict over the rows' bytes decides."""
    rows = np.ascontiguousarray(rows)
    if len(rows) and rows.shape[1]:
        key = np.zeros(len(rows))
        for j in range(rows.shape[1]):
            key += rows[:, j] * _FIRST_WEIGHTS[j % len(_FIRST_WEIGHTS)]
        _, first, inv = np.unique(key, return_index=True, return_inverse=True)
        bits = rows.view(np.int64) if rows.dtype == np.float64 else rows  # bytes, as the dict
        if np.array_equal(bits, bits[first[inv.ravel()]]):
            return np.sort(first)
    view = rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize)))
    seen: dict[bytes, int] = {}
    for pos, row in enumerate(view.ravel().tolist()):
        seen.setdefault(row, pos)
    return np.sort(np.fromiter(seen.values(), dtype=np.int64))


_FIRST_WEIGHTS = np.random.default_rng(0).uniform(1.0, 2.0, 61)
"""Fixed weights of `_first_of_each`'s grouping number (any distinct values do)."""


@lru_cache(maxsize=256)
def _acting_sets(options: tuple[Option, ...], forbidden: tuple[Combo, ...],
                 shape: tuple[tuple[tuple[Option, ...],
                                    tuple[tuple[frozenset[Option], Option | None], ...]], ...]
                 ) -> tuple[tuple[Option, ...], np.ndarray]:
    """(the options some item reacts to, the smallest allowed subset of each class that acts
    alike on every item), subsets in order of fewest modules then lowest mask.

    `shape` is, per item, the recompute options with a nonzero time and each tensor group's
    (recompute options, offload option): everything but the numbers. Two subsets that recompute
    the same timed modules and free and move the same groups of every item get the same sums
    term by term, so their costs are equal to the bit and the smaller one stands for both. The
    shape repeats across the layouts of a search (only byte counts and times change), so the
    classes are formed once per shape."""
    used = {o for rec, groups in shape for o in rec}
    used |= {o for _, groups in shape for rb, ob in groups for o in (*rb, ob)}
    options = tuple(o for o in options if o in used)
    bit = {o: 1 << j for j, o in enumerate(options)}
    masks = np.arange(1 << len(options), dtype=np.int64)
    ok = np.ones(masks.shape, dtype=bool)
    for c in forbidden:
        if not all(o in bit for o in c.present):
            continue  # an option no item reacts to is never in a set: the combo cannot occur
        if not all(o in bit for o in c.absent):
            continue  # adding an option no item reacts to costs nothing (`Menu.close` adds it)
        need = sum(bit[o] for o in c.present)
        lack = sum(bit[o] for o in c.absent)
        ok &= ~(((masks & need) == need) & ((masks & lack) == 0))
    masks = masks[ok]
    masks = masks[np.lexsort((masks, np.bitwise_count(masks)))]
    cols = []
    for rec, groups in shape:
        cols.append(masks & sum(bit[o] for o in rec if o in bit))
        code = np.zeros(len(masks), dtype=np.int64)
        for k, (rb, ob) in enumerate(groups):
            if k and k % 31 == 0:  # two bits per group, 62 per column
                cols.append(code)
                code = np.zeros(len(masks), dtype=np.int64)
            freed, moved = _freed_moved(masks, rb, ob, bit)
            code |= (freed.astype(np.int64) | moved.astype(np.int64) << 1) << (2 * (k % 31))
        cols.append(code)
    sig = np.stack(cols, axis=1) if cols else np.zeros((len(masks), 1), dtype=np.int64)
    reps = masks[_first_of_each(sig)]
    reps.flags.writeable = False
    return options, reps


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


def coarse_sets(P: StageProblem, C: ModuleSets) -> list[list[int]]:
    """Per rank, at most COARSE_SETS sets of its front at the balanced layer count, evenly
    spaced over the front in set order: the first MILP of a large problem, which only places
    the layers."""
    even = P.free_layers / P.pp
    coarse = []
    for r in range(P.pp):
        front = rank_sets(P, C, r, even)
        if len(front) > COARSE_SETS:
            front = [front[i] for i in sorted(set(np.linspace(0, len(front) - 1, COARSE_SETS)
                                                  .round().astype(int)))]
        coarse.append(front)
    return coarse
