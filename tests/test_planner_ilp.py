"""The per-layout MILP against closed forms derived by hand and a brute-force enumeration."""

from __future__ import annotations

import itertools

import pulp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplan.planner.ilp import (
    InfeasibleStages,
    Outcome,
    SolverStopped,
    build,
    decode,
    evaluate,
    outcome,
    solve,
    solve_fixed,
    solve_milp,
    solve_over,
)
from moeplan.planner.problem import Group, Item, Option, StageProblem, as_combo
from moeplan.planner.sets import exact_fronts, item_cost, module_sets, pareto, useful_sets

FS = frozenset
MOE_ACT, FULL, CORE_ATTN = (Option.recompute(m) for m in ("moe_act", "full", "core_attn"))
OFF_FC1 = Option.offload("expert_fc1")


def problem(items, L, pp, vpp=1, inflight=None, budget=1e12, m=4, fixed=None,
            options=(MOE_ACT, FULL, OFF_FC1), host=0.0):
    S = pp * vpp
    return StageProblem(
        items=tuple(items), layer_item=0, free_layers=L,
        fixed=tuple(tuple(f) for f in (fixed or [()] * S)), pp=pp, vpp=vpp,
        inflight=tuple(inflight or [float(pp - s % pp) for s in range(S)]),
        host_s_per_byte=host, budget_bytes=(budget,) * pp, alpha=m - 1 / vpp, beta=1 / vpp,
        options=tuple(options), forbidden=((FULL, MOE_ACT),))


MOE = Item("moe", time_s=1.0, fwd_s=0.3, bwd_s=0.6, static_bytes=1.0,
           groups=(Group(2.0, FS(), None),  # the layer input stays even under full
                   Group(8.0, FS({MOE_ACT, FULL}), OFF_FC1)),
           recompute_s=((MOE_ACT, 0.3), (FULL, 1.0)))


def test_unconstrained_memory_balances_layers_and_picks_nothing():
    # 4 identical layers on 2 ranks, m = 4: 2+2 layers, T_r = 2, step = (4−1)·2 + 4 = 10.
    sol = solve(problem([MOE], 4, 2, options=(MOE_ACT, FULL)))
    assert sol.layers == [2, 2] and sol.options == [[], []]
    assert sol.objective_s == pytest.approx(10.0)


def test_memory_pressure_buys_the_cheapest_saving_on_the_first_rank_only():
    # Rank 0 holds 2 micro-batches: 2 layers·(1 + 2·10) = 42 > 30. Recomputing moe_act frees
    # 2·2·8 = 32 for 0.6 s; full frees the same for 2 s. Closed form: T0 = 2.6, T1 = 2,
    # step = 3·2.6 + 4.6 = 12.4. A 1+3 split needs 3·(1+10) = 33 > 30 on rank 1, so rank 1
    # would recompute: 3·1.3 = 3.9 → worse.
    sol = solve(problem([MOE], 4, 2, inflight=[2, 1], budget=30, options=(MOE_ACT, FULL)))
    assert sol.objective_s == pytest.approx(12.4)
    assert sol.options == [[MOE_ACT], []]
    assert max(sol.rank_memory_bytes) <= 30


def test_offload_hidden_behind_compute_costs_nothing():
    # Copy 8 bytes at 0.01 s/byte = 0.08 s per layer, hidden by fwd 0.3 and bwd 0.6.
    sol = solve(problem([MOE], 4, 2, inflight=[2, 1], budget=30, host=0.01,
                        options=(MOE_ACT, OFF_FC1)))
    assert sol.options[0] == [OFF_FC1]
    assert sol.objective_s == pytest.approx(10.0)


def test_exposed_offload_copy_is_charged():
    # 0.5 s/byte: 4 s per layer copy, minus 0.3 and 0.6 hidden → 7.1 s exposed; recompute wins.
    sol = solve(problem([MOE], 4, 2, inflight=[2, 1], budget=30, host=0.5,
                        options=(MOE_ACT, OFF_FC1)))
    assert sol.options[0] == [MOE_ACT]


def test_fixed_items_count_on_their_rank():
    emb = Item("E", 0.5, 0.1, 0.1, 5.0, (Group(1.0),))
    P = problem([MOE, emb], 4, 2, fixed=[((1, 1),), ()], options=(MOE_ACT,))
    sol = solve(P)
    step, _ = evaluate(P, sol.layers, sol.options)
    assert step == pytest.approx(sol.objective_s)
    assert sol.layers == [2, 2]  # T0 = 2.5, T1 = 2: moving a layer would make T1 = 3


def test_nothing_fits_is_reported():
    with pytest.raises(InfeasibleStages):
        solve(problem([MOE], 4, 2, budget=3))


def test_the_milp_proves_infeasibility_when_each_rank_fits_some_layers_but_not_all():
    # Least memory per layer (full recompute keeps the 2-byte input): 1 + ψ·2, so 5 on rank 0
    # (ψ = 2) and 3 on rank 1. A budget of 6 holds 1 + 2 = 3 of the 4 layers: every rank fits a
    # set at some count (the pruning passes), only the MILP can prove the total infeasible.
    P = problem([MOE], 4, 2, inflight=[2, 1], budget=6)
    C = module_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)
    cand = useful_sets(P, C, exact_fronts(P, C))
    assert all(cand)
    assert solve_milp(build(P, C, cand)) is Outcome.INFEASIBLE
    with pytest.raises(InfeasibleStages):
        solve(P)


def test_a_time_limit_before_any_solution_is_not_reported_as_infeasible():
    # A problem that fits, stopped by a zero time limit before HiGHS has an incumbent: that
    # proves nothing, so it must not read as infeasible (the CLI's exit 3).
    P = problem([MOE] * 2, 6, 3, inflight=[3, 2, 1], budget=60, host=0.05,
                options=(MOE_ACT, FULL, CORE_ATTN, OFF_FC1))
    assert solve(P).proven_optimal
    with pytest.raises(SolverStopped) as stopped:
        solve(P, time_limit_s=0.0)
    assert not isinstance(stopped.value, InfeasibleStages)


def test_an_incumbent_at_a_time_limit_is_decoded_but_not_claimed_optimal():
    # pulp reports a HiGHS time limit with an incumbent as status "Optimal" with solution
    # status "Solution Found"; decoding must keep the plan and drop the claim.
    P = problem([MOE], 4, 2, inflight=[2, 1], budget=30, options=(MOE_ACT, FULL))
    C = module_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)
    milp = build(P, C, exact_fronts(P, C))
    assert solve_milp(milp) is Outcome.OPTIMAL
    milp.lp.assignStatus(pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible)
    sol = decode(P, C, milp, outcome(milp.lp.status, milp.lp.sol_status))
    assert not sol.proven_optimal
    assert sol.objective_s == pytest.approx(12.4) and sol.options == [[MOE_ACT], []]


@pytest.mark.parametrize(("status", "sol_status", "expected"), [
    (pulp.LpStatusOptimal, pulp.LpSolutionOptimal, Outcome.OPTIMAL),
    (pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible, Outcome.INCUMBENT),
    (pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible, Outcome.INFEASIBLE),
    (pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound, Outcome.STOPPED),
    # pulp's default solution status for "Not Solved" is "No Solution Exists": still no proof
    (pulp.LpStatusNotSolved, pulp.LpStatusToSolution[pulp.LpStatusNotSolved], Outcome.STOPPED),
    (pulp.LpStatusUndefined, pulp.LpSolutionInfeasible, Outcome.STOPPED),
    (pulp.LpStatusUnbounded, pulp.LpSolutionUnbounded, Outcome.STOPPED),
])
def test_solver_statuses_map_to_what_they_prove(status, sol_status, expected):
    assert outcome(status, sol_status) is expected


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limit=st.sampled_from([0.0, 1e-4, 1e-3, 3e-3, 1e-2]))
def test_any_time_limit_gives_a_fitting_plan_or_a_stop_never_infeasibility(limit):
    P = problem([MOE] * 2, 6, 3, inflight=[3, 2, 1], budget=60, host=0.05,
                options=(MOE_ACT, FULL, CORE_ATTN, OFF_FC1))
    best = solve(P).objective_s
    try:
        sol = solve(P, time_limit_s=limit)
    except SolverStopped:
        return
    assert max(sol.rank_memory_bytes) <= 60 * (1 + 1e-9)
    assert sol.objective_s >= best - 1e-9
    if sol.proven_optimal:
        assert sol.objective_s == pytest.approx(best, rel=1e-9)


def test_pareto_keeps_exactly_the_non_dominated_rows():
    import numpy as np

    v = np.array([[1, 5], [2, 2], [3, 3], [5, 1], [2, 2], [1, 6]], dtype=float)
    assert pareto(v).tolist() == [0, 1, 3]


def test_module_sets_cost_each_subset_like_the_reference():
    opts = (MOE_ACT, FULL, OFF_FC1)
    C = module_sets([MOE], opts, ((FULL, MOE_ACT),), 0.2)
    for k, chosen in enumerate(C.sets):
        dt, kept = item_cost(MOE, set(chosen), 0.2)
        assert C.add_time[k, 0] == pytest.approx(dt) and C.kept[k, 0] == pytest.approx(kept)


def brute_force(P: StageProblem) -> float:
    """Every layer split over ranks × every option subset per rank (one subset shared by every
    rank where the problem says so, `P.uniform`)."""
    splits = [c for c in itertools.product(range(P.free_layers + 1), repeat=P.pp)
              if sum(c) == P.free_layers]
    subsets = [list(c) for n in range(len(P.options) + 1)
               for c in itertools.combinations(P.options, n)
               if not any(f.hit(set(c)) for f in P.forbidden)]
    combos = ([[c] * P.pp for c in subsets] if P.uniform
              else list(itertools.product(subsets, repeat=P.pp)))
    best = float("inf")
    for layers in splits:
        for combo in combos:
            step, mem = evaluate(P, layers, combo)
            if all(mm <= bb + 1e-9 for mm, bb in zip(mem, P.budget_bytes, strict=True)):
                best = min(best, step)
    return best


group_st = st.builds(
    Group, bytes=st.floats(0.5, 10.0),
    recompute_by=st.sets(st.sampled_from([MOE_ACT, FULL, CORE_ATTN]), max_size=2).map(FS),
    offload_by=st.sampled_from([None, OFF_FC1]))
item_st = st.builds(
    Item, name=st.just("k"), time_s=st.floats(0.1, 2.0), fwd_s=st.floats(0.0, 0.5),
    bwd_s=st.floats(0.0, 1.0), static_bytes=st.floats(0.0, 3.0),
    groups=st.lists(group_st, max_size=3).map(tuple),
    recompute_s=st.tuples(st.tuples(st.just(MOE_ACT), st.floats(0, 1)),
                          st.tuples(st.just(FULL), st.floats(0, 2)),
                          st.tuples(st.just(CORE_ATTN), st.floats(0, 0.5))))


def masks_has(mask, bit, o):
    return o in bit and bool(mask & bit[o])


def every_subset_sets(items, options, exclusive, h):
    """`module_sets` as it was before subsets were grouped by how they act: every allowed
    subset costed with numpy, the smallest of each equal cost vector kept."""
    import numpy as np

    used = {o for it in items for o, t in it.recompute_s if t}
    used |= {o for it in items for g in it.groups for o in (*g.recompute_by, g.offload_by)}
    options = [o for o in options if o in used]
    bit = {o: 1 << j for j, o in enumerate(options)}
    masks = np.arange(1 << len(options), dtype=np.int64)
    ok = np.ones(masks.shape, dtype=bool)
    for f in map(as_combo, exclusive):
        names = [[o for o in options if masks_has(m, bit, o)] for m in masks.tolist()]
        ok &= np.array([not f.hit(set(n)) for n in names], dtype=bool)
    masks = masks[ok]
    add, kept = np.zeros((len(masks), len(items))), np.zeros((len(masks), len(items)))
    for i, item in enumerate(items):
        off = np.zeros(len(masks))
        for o, t in item.recompute_s:
            if o in bit and t:
                add[:, i] += t * ((masks & bit[o]) != 0)
        for g in item.groups:
            freed = (masks & sum(bit[o] for o in g.recompute_by if o in bit)) != 0
            moved = ~freed & ((masks & bit[g.offload_by]) != 0) if g.offload_by in bit else (
                np.zeros(len(masks), dtype=bool))
            off += g.bytes * moved
            kept[:, i] += g.bytes * (~freed & ~moved)
        add[:, i] += np.maximum(0.0, h * off - item.fwd_s) + np.maximum(0.0, h * off - item.bwd_s)
    vec = np.round(np.hstack([add, kept]), 12) + 0.0
    order = np.lexsort((masks, np.bitwise_count(masks)))
    seen: dict = {}
    for pos, row in enumerate(map(bytes, vec[order])):
        seen.setdefault(row, pos)
    keep = order[np.sort(np.fromiter(seen.values(), dtype=np.int64))]
    return masks[keep], add[keep], kept[keep]


def assert_sets_equal_every_subset_sets(items, options, exclusive, h):
    import numpy as np

    C = module_sets(items, options, exclusive, h)
    masks, add, kept = every_subset_sets(items, options, exclusive, h)
    assert np.array_equal(np.asarray(C.sets.masks), masks)
    assert np.array_equal(C.add_time, add) and np.array_equal(C.kept, kept)


# coarse values, so that different subsets often cost the same
coarse = st.sampled_from([0.0, 0.5, 1.0, 2.0])
coarse_item = st.builds(
    Item, name=st.just("k"), time_s=st.just(1.0), fwd_s=coarse, bwd_s=coarse,
    static_bytes=st.just(1.0),
    groups=st.lists(st.builds(
        Group, bytes=st.sampled_from([1.0, 2.0]),
        recompute_by=st.sets(st.sampled_from([MOE_ACT, FULL, CORE_ATTN]), max_size=2).map(FS),
        offload_by=st.sampled_from([None, OFF_FC1, Option.offload("moe_act")])),
        max_size=4).map(tuple),
    recompute_s=st.tuples(st.tuples(st.just(MOE_ACT), coarse), st.tuples(st.just(FULL), coarse),
                          st.tuples(st.just(CORE_ATTN), coarse)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(st.one_of(item_st, coarse_item), min_size=1, max_size=3),
       host=st.sampled_from([0.0, 0.5, 1.0]))
def test_module_sets_keep_the_smallest_subset_of_each_cost_like_costing_every_subset(items,
                                                                                    host):
    # module_sets costs one subset per class of subsets that act alike on every item; the
    # sets, their order and their costs must be those of costing every subset
    options = (MOE_ACT, FULL, CORE_ATTN, OFF_FC1, Option.offload("moe_act"))
    assert_sets_equal_every_subset_sets(items, options, ((FULL, MOE_ACT), (FULL, CORE_ATTN)),
                                        host)


def test_module_sets_of_a_deepseek_v3_layout_equal_costing_every_subset():
    from moeplan import load_cluster, load_model
    from moeplan.cost_models.calibration import calibration_for
    from moeplan.planner.problem import OPTIONS, layer_table, stage_problem
    from moeplan.specs import Layout, TrainingSpec

    model, cluster = load_model("deepseek-v3"), load_cluster("h100", gpus=1024)
    tr = TrainingSpec(seq_len=4096, global_batch_size=8192)
    cal = calibration_for(None)
    for ovl in (False, True):  # EP overlap forbids full and moe recompute
        layout = Layout(tp=2, pp=16, vpp=2, dp=32, ep=32, num_microbatches=256, ep_overlap=ovl)
        P = stage_problem(model, cluster, tr, layout, cal,
                          layer_table(model, cluster, tr, layout, cal), OPTIONS).problem
        assert_sets_equal_every_subset_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(item_st, min_size=2, max_size=2), L=st.integers(2, 6),
       pp=st.integers(1, 3), vpp=st.integers(1, 2), with_fixed=st.booleans(),
       budget=st.floats(5.0, 120.0), host=st.sampled_from([0.0, 0.05, 0.5]))
def test_milp_optimum_equals_brute_force(items, L, pp, vpp, with_fixed, budget, host):
    S = pp * vpp
    fixed = [[] for _ in range(S)]
    if with_fixed:
        fixed[0].append((1, 1))
    P = problem(items, L, pp, vpp=vpp, budget=budget, host=host, fixed=fixed,
                options=(MOE_ACT, FULL, CORE_ATTN, OFF_FC1))
    ref = brute_force(P)
    if ref == float("inf"):
        with pytest.raises(InfeasibleStages):
            solve(P)
    else:
        sol = solve(P)
        assert sol.objective_s == pytest.approx(ref, rel=1e-6, abs=1e-9)


def brute_force_sets(P: StageProblem, layers: list[int]) -> float:
    """Every option subset per rank with the layer split given."""
    subsets = [list(c) for n in range(len(P.options) + 1)
               for c in itertools.combinations(P.options, n)
               if not any(f.hit(set(c)) for f in P.forbidden)]
    best = float("inf")
    for combo in itertools.product(subsets, repeat=P.pp):
        step, mem = evaluate(P, layers, combo)
        if all(mm <= bb + 1e-9 for mm, bb in zip(mem, P.budget_bytes, strict=True)):
            best = min(best, step)
    return best


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(item_st, min_size=2, max_size=2), split=st.lists(st.integers(0, 4),
       min_size=1, max_size=3), vpp=st.integers(1, 2), with_fixed=st.booleans(),
       budget=st.floats(5.0, 120.0), host=st.sampled_from([0.0, 0.05, 0.5]))
def test_rank_separable_solution_with_layers_fixed_equals_the_milp_and_brute_force(
        items, split, vpp, with_fixed, budget, host):
    # With the layers per rank given, the MILP separates by rank: each rank's fastest fitting
    # set is optimal. The screening pass of the search relies on it.
    pp = len(split)
    fixed = [[] for _ in range(pp * vpp)]
    if with_fixed:
        fixed[0].append((1, 1))
    P = problem(items, sum(split), pp, vpp=vpp, budget=budget, host=host, fixed=fixed,
                options=(MOE_ACT, FULL, CORE_ATTN, OFF_FC1))
    C = module_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)
    ref = brute_force_sets(P, split)
    if ref == float("inf"):
        with pytest.raises(InfeasibleStages):
            solve_fixed(P, C, split)
        with pytest.raises(InfeasibleStages):
            solve_over(P, C, exact_fronts(P, C), split)
        return
    fast = solve_fixed(P, C, split)
    milp = solve_over(P, C, exact_fronts(P, C), split)
    assert fast.objective_s == pytest.approx(ref, rel=1e-6, abs=1e-9)
    assert milp.objective_s == pytest.approx(ref, rel=1e-6, abs=1e-9)
    assert fast.layers == split


REQUIRES = as_combo(((OFF_FC1,), (MOE_ACT,)))  # offload expert_fc1 only with moe_act recomputed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(item_st, min_size=2, max_size=2), L=st.integers(2, 6),
       pp=st.integers(1, 3), vpp=st.integers(1, 2), with_fixed=st.booleans(),
       budget=st.floats(5.0, 120.0), host=st.sampled_from([0.0, 0.05, 0.5]),
       requires=st.booleans())
def test_one_set_for_every_rank_equals_brute_force(items, L, pp, vpp, with_fixed, budget, host,
                                                   requires):
    # Megatron's one recompute/offload setting for every stage: the level-filling solve over
    # the set front must equal brute force over every split and every shared subset, with a
    # "needs" combination (present without absent) among the forbidden ones.
    import dataclasses

    S = pp * vpp
    fixed = [[] for _ in range(S)]
    if with_fixed:
        fixed[0].append((1, 1))
    P = problem(items, L, pp, vpp=vpp, budget=budget, host=host, fixed=fixed,
                options=(MOE_ACT, FULL, CORE_ATTN, OFF_FC1))
    P = dataclasses.replace(P, uniform=True,
                            forbidden=P.forbidden + ((REQUIRES,) if requires else ()))
    ref = brute_force(P)
    if ref == float("inf"):
        with pytest.raises(InfeasibleStages):
            solve(P)
        return
    sol = solve(P)
    assert sol.objective_s == pytest.approx(ref, rel=1e-6, abs=1e-9)
    assert all(o == sol.options[0] for o in sol.options)
    C = module_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)
    fixed_sol = solve_fixed(P, C, sol.layers)
    assert fixed_sol.objective_s == pytest.approx(sol.objective_s, rel=1e-9, abs=1e-12)
    assert all(o == fixed_sol.options[0] for o in fixed_sol.options)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(item_st, min_size=2, max_size=2), L=st.integers(2, 6),
       pp=st.integers(1, 3), budget=st.floats(5.0, 120.0), host=st.sampled_from([0.0, 0.5]))
def test_a_needs_combination_constrains_the_milp_like_brute_force(items, L, pp, budget, host):
    import dataclasses

    P = problem(items, L, pp, budget=budget, host=host,
                options=(MOE_ACT, FULL, CORE_ATTN, OFF_FC1))
    P = dataclasses.replace(P, forbidden=P.forbidden + (REQUIRES,))
    ref = brute_force(P)
    if ref == float("inf"):
        with pytest.raises(InfeasibleStages):
            solve(P)
        return
    assert solve(P).objective_s == pytest.approx(ref, rel=1e-6, abs=1e-9)


def test_the_milp_returns_the_best_not_one_within_highs_default_gap():
    """A case the property above found: HiGHS's default relative gap (1e-4) returned a split
    with full recompute on one layer, 5.0002 s, as optimal where brute force finds 5.0 s."""
    import dataclasses

    rec = {m: Option(kind="recompute", module=m) for m in ("moe_act", "full", "core_attn")}
    kept = Group(bytes=1.0, recompute_by=frozenset(), offload_by=None)
    by_full = Group(bytes=1.0, recompute_by=frozenset({rec["full"]}), offload_by=None)
    costly = Item(name="k", time_s=1.0, fwd_s=0.0, bwd_s=0.0, static_bytes=0.0,
                  groups=(kept, by_full), recompute_s=((rec["moe_act"], 0.0),
                                                       (rec["full"], 5e-05),
                                                       (rec["core_attn"], 0.0)))
    free = Item(name="k", time_s=1.0, fwd_s=0.0, bwd_s=0.0, static_bytes=0.0, groups=(),
                recompute_s=tuple((o, 0.0) for o in rec.values()))
    P = problem([costly, free], 2, 3, budget=5.0, host=0.0,
                options=(MOE_ACT, FULL, CORE_ATTN, OFF_FC1))
    P = dataclasses.replace(P, forbidden=P.forbidden + (REQUIRES,))
    assert brute_force(P) == 5.0
    assert solve(P).objective_s == pytest.approx(5.0, rel=1e-6, abs=1e-9)


def full_front_sweep(P: StageProblem, C):
    """The sweep `_solve_uniform` replaced, as the reference for its early stop: every set of
    the whole front filled (`_fill_all`, `_fill_flat`), the least (objective, set) wins."""
    import numpy as np

    from moeplan.planner.ilp import _caps, _fill_all, _fill_flat, _fixed_terms

    ell = P.layer_item
    lay = P.items[ell]
    ft, fk, t0, m0 = _fixed_terms(P, C)
    front = pareto(np.round(np.stack([C.add_time[:, ell], C.kept[:, ell], *ft, *fk], axis=1),
                            12))
    best = None
    for c in front.tolist():
        slope = lay.time_s + C.add_time[c, ell]
        base = ft[:, c] + t0
        cap = np.array([_caps(np.array([P.budget_bytes[r] * (1 + 1e-9) - fk[r, c] - m0[r]]),
                              np.array([lay.static_bytes + P.mean_inflight(r) * C.kept[c, ell]]),
                              P.free_layers)[0] for r in range(P.pp)])
        if (cap < 0).any() or cap.sum() < P.free_layers:
            continue
        X = (_fill_all(np.array([slope]), base[None], cap[None], P.free_layers)[0]
             if slope > 0 else _fill_flat(base, cap, P.free_layers))
        if X is None:
            continue
        T = base + slope * np.array(X)
        obj = round(float(P.alpha * T.max() + P.beta * T.sum()), 12)
        if best is None or (obj, c) < best[:2]:
            best = (obj, c, list(X))
    return best


# layers whose time may be nothing (a set's slope ≤ 0 sorts first) and recompute options
# that cost nothing, so that sets tie
tie_item_st = st.builds(
    Item, name=st.just("k"), time_s=st.sampled_from([0.0, 0.5, 1.0]),
    fwd_s=st.sampled_from([0.0, 0.25]), bwd_s=st.sampled_from([0.0, 0.5]),
    static_bytes=st.sampled_from([0.0, 1.0]), groups=st.lists(group_st, max_size=3).map(tuple),
    recompute_s=st.tuples(st.tuples(st.just(MOE_ACT), st.sampled_from([0.0, 0.25])),
                          st.tuples(st.just(FULL), st.sampled_from([0.0, 1.0])),
                          st.tuples(st.just(CORE_ATTN), st.sampled_from([0.0, 0.25]))))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=st.lists(tie_item_st, min_size=2, max_size=2), L=st.integers(1, 8),
       pp=st.integers(1, 4), vpp=st.integers(1, 2), with_fixed=st.booleans(),
       budget=st.floats(2.0, 120.0), host=st.sampled_from([0.0, 0.05, 0.5]))
def test_one_set_for_every_rank_stops_early_yet_picks_what_the_whole_front_sweep_picked(
        items, L, pp, vpp, with_fixed, budget, host):
    """Filling sets in the order of their lower bound and stopping once it passes the best
    changes nothing: the same set and the same layers as filling every set of the front, ties
    included (to the smaller set)."""
    import dataclasses

    fixed = [[] for _ in range(pp * vpp)]
    if with_fixed:
        fixed[0].append((1, 1))
    P = dataclasses.replace(problem(items, L, pp, vpp=vpp, budget=budget, host=host,
                                    fixed=fixed, options=(MOE_ACT, FULL, CORE_ATTN, OFF_FC1)),
                            uniform=True)
    C = module_sets(P.items, P.options, P.forbidden, P.host_s_per_byte)
    ref = full_front_sweep(P, C)
    if ref is None:
        with pytest.raises(InfeasibleStages):
            solve(P, C)
        return
    sol = solve(P, C)
    assert sol.layers == ref[2] and sol.options[0] == list(C.sets[ref[1]])


def test_level_filling_takes_no_sets():
    import numpy as np

    from moeplan.planner.ilp import _fill_all

    assert _fill_all(np.zeros(0), np.zeros((0, 3)), np.zeros((0, 3), dtype=np.int64), 5) == []
