"""The per-layout MILP against closed forms derived by hand and a brute-force enumeration."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplan.planner.ilp import (
    InfeasibleStages,
    LayerKind,
    Option,
    StageProblem,
    evaluate,
    solve,
)

EXCL = (("moe_act", "full"), ("expert_fc1", "full"), ("moe_act", "expert_fc1"))


def problem(kinds, L, pp, vpp=1, D=0, inflight=None, budget=1e9, alpha=None, beta=1.0, **kw):
    S = pp * vpp
    return StageProblem(
        kinds=tuple(kinds), num_layers=L, dense_first=D, pp=pp, vpp=vpp,
        inflight=tuple(inflight or [float(pp - s % pp) for s in range(S)]),
        stage_time_s=kw.pop("stage_time_s", (0.0,) * S),
        stage_act_bytes=kw.pop("stage_act_bytes", (0.0,) * S),
        rank_static_bytes=kw.pop("rank_static_bytes", (0.0,) * pp),
        optimizer_bytes=kw.pop("optimizer_bytes", (0.0,) * pp),
        optimizer_offload_time_s=kw.pop("optimizer_offload_time_s", 0.0),
        budget_bytes=budget, alpha=alpha if alpha is not None else 3.0, beta=beta,
        exclusive=EXCL, **kw)


def test_unconstrained_memory_balances_layers_and_picks_nothing():
    # 4 identical layers on 2 ranks, no memory pressure: 2+2 layers, T_r = 2, step = 3·2 + 4.
    k = LayerKind("moe", 1.0, 10.0, 0.0, (Option("moe_act", "recompute", 0.3, 8.0),))
    sol = solve(problem([k], 4, 2))
    assert sol.layers == [2, 2] and sol.options == [{}, {}]
    assert sol.step_time_s == pytest.approx(3 * 2 + 4)


def test_memory_pressure_buys_the_cheapest_saving_on_the_first_rank_only():
    # Rank 0 holds 2 micro-batches: 2 layers·2·10 = 40 > 25, so it recomputes moe_act
    # (saves 2·2·8 = 32 for 0.6 s) rather than offloading (saves 12, not enough) or full.
    # Closed form: T0 = 2.6, T1 = 2, step = 3·2.6 + 4.6 = 12.4.
    k = LayerKind("moe", 1.0, 10.0, 1.0, (Option("moe_act", "recompute", 0.3, 8.0),
                                           Option("full", "recompute", 1.0, 10.0),
                                           Option("expert_fc1", "offload", 0.1, 3.0)))
    sol = solve(problem([k], 4, 2, inflight=[2, 1], budget=25))
    assert sol.step_time_s == pytest.approx(12.4)
    assert sol.options[0] == {"moe": ["moe_act"]} and sol.options[1] == {}
    assert max(sol.rank_memory_bytes) <= 25


def test_optimizer_offload_fraction_is_just_enough():
    # Static 30 bytes per layer, 1 layer per rank, budget 25: offload f·P with P = 20 → f = 0.25.
    k = LayerKind("dense", 1.0, 0.0, 30.0)
    sol = solve(problem([k], 2, 2, budget=25, optimizer_bytes=(20.0, 20.0),
                        optimizer_offload_time_s=4.0))
    assert sol.optimizer_offload_fraction == pytest.approx(0.25)
    assert sol.step_time_s == pytest.approx(3 * 1 + 2 + 4 * 0.25)


def test_dense_layers_stay_in_the_first_stage():
    dense = LayerKind("dense", 0.5, 1.0, 0.0)
    moe = LayerKind("moe", 1.0, 1.0, 0.0)
    sol = solve(problem([dense, moe], 7, 2, D=3))
    assert sol.layers[0] >= 3
    step, _ = evaluate(problem([dense, moe], 7, 2, D=3), sol.layers, sol.options)
    assert step == pytest.approx(sol.step_time_s)


def test_nothing_fits_is_reported():
    k = LayerKind("moe", 1.0, 10.0, 100.0)
    with pytest.raises(InfeasibleStages):
        solve(problem([k], 4, 2, budget=50))


def brute_force(P: StageProblem) -> float:
    """Every stage split × every option subset per rank per kind (f fixed at 0)."""
    S = P.stages
    splits = [c for c in itertools.product(range(P.num_layers + 1), repeat=S)
              if sum(c) == P.num_layers and (len(P.kinds) == 1 or c[0] >= P.dense_first)]
    per_kind = []
    for kind in P.kinds:
        names = [o.name for o in kind.options]
        subsets = [set(c) for n in range(len(names) + 1) for c in itertools.combinations(names, n)
                   if not any(a in c and b in c for a, b in P.exclusive)]
        per_kind.append(subsets)
    rank_choices = list(itertools.product(*per_kind))
    best = float("inf")
    for layers in splits:
        for combo in itertools.product(rank_choices, repeat=P.pp):
            options = [{P.kinds[k].name: sorted(sub) for k, sub in enumerate(rc)}
                       for rc in combo]
            step, mem = evaluate(P, layers, options)
            if max(mem) <= P.budget_bytes + 1e-9:
                best = min(best, step)
    return best


option_st = st.builds(
    Option,
    name=st.sampled_from(["moe_act", "full", "expert_fc1"]),
    kind=st.just("recompute"),
    time_s=st.floats(0.0, 1.0),
    saved_bytes=st.floats(0.0, 10.0),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    t=st.lists(st.floats(0.1, 2.0), min_size=2, max_size=2),
    a=st.lists(st.floats(1.0, 10.0), min_size=2, max_size=2),
    opts=st.lists(option_st, min_size=0, max_size=2, unique_by=lambda o: o.name),
    L=st.integers(2, 5),
    pp=st.integers(1, 2),
    vpp=st.integers(1, 2),
    two_kinds=st.booleans(),
    budget=st.floats(5.0, 80.0),
)
def test_milp_optimum_equals_brute_force(t, a, opts, L, pp, vpp, two_kinds, budget):
    kinds = [LayerKind("moe", t[0], a[0], 1.0, tuple(opts))]
    if two_kinds:
        kinds.insert(0, LayerKind("dense", t[1], a[1], 0.5, tuple(opts)))
    P = problem(kinds, L, pp, vpp=vpp, D=1 if two_kinds else 0, budget=budget,
                allow_offload_optimizer=False)
    ref = brute_force(P)
    if ref == float("inf"):
        with pytest.raises(InfeasibleStages):
            solve(P)
    else:
        sol = solve(P)
        assert sol.step_time_s == pytest.approx(ref, rel=1e-6, abs=1e-9)
