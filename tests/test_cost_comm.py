"""Rank placement (Megatron Core's order) and α–β collective times, by hand."""

import random

import pytest

from moeplan.cost_models.calibration import default_calibration
from moeplan.cost_models.comm import (
    GroupPlacement,
    all_reduce_time,
    all_to_all_time,
    group_ranks,
    p2p_time,
    placement,
    ring_time,
)
from moeplan.specs import Layout, load_cluster
from moeplan.specs.grid import RankGrid, span


def test_groups_match_megatron_docstring_example():
    # Megatron's initialize_model_parallel docstring: 16 GPUs, tp 2, pp 4 → dp 2
    L = Layout(tp=2, pp=4, dp=2)
    assert group_ranks(L, "tp")[:3] == [[0, 1], [2, 3], [4, 5]]
    assert group_ranks(L, "dp")[:3] == [[0, 2], [1, 3], [4, 6]]
    assert group_ranks(L, "pp")[0] == [0, 4, 8, 12]


def test_expert_grid_folds_over_the_same_ranks():
    L = Layout(tp=2, dp=8, pp=2, ep=4, etp=1)  # 32 GPUs, edp = 32 / (1·4·2) = 4
    assert group_ranks(L, "ep")[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group_ranks(L, "edp")[0] == [0, 4, 8, 12]
    etp = group_ranks(L, "etp")
    assert (len(etp), len(etp[0])) == (32, 1)
    assert sorted(r for g in group_ranks(L, "ep") for r in g) == list(range(32))


def test_placement_inside_and_across_nvlink():
    h100 = load_cluster("h100")
    L = Layout(dp=16, ep=8)
    assert placement(L, "ep", h100).inside_nvlink
    wide = placement(Layout(dp=16, ep=16), "ep", h100)
    assert wide == GroupPlacement(16, 8, 2)


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
def test_placement_from_group_parts_equals_the_span_of_every_listed_group(order):
    # placement reads only the first group and where each group starts (grid.group_parts);
    # it must be the worst span over every group Megatron's rank generator lists
    for cname, world in (("h100", 64), ("h100", 256), ("gb200-nvl72", 144), ("gb200-nvl72", 256)):
        cluster = load_cluster(cname)
        domain = cluster.usable_domain(world)
        for tp, cp, pp, ep, etp in ((1, 1, 1, 8, 1), (2, 2, 4, 4, 2), (4, 1, 2, 16, 1),
                                    (8, 1, 4, 2, 4), (1, 4, 2, 32, 2), (2, 1, 8, 8, 1)):
            dp = world // (tp * cp * pp)
            if dp < 1 or world % (tp * cp * pp) or world % (etp * ep * pp):
                continue
            L = Layout(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, order=order)
            for axis in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"):
                groups = group_ranks(L, axis)
                spans = [len({r // domain for r in g}) for g in groups]
                n = len(groups[0])
                want = GroupPlacement(n, max(1, n // max(spans)), max(spans)) if n > 1 else (
                    GroupPlacement(1, 1, 1))
                assert placement(L, axis, cluster) == want, (cname, world, L, axis)


def test_nvl72_jobs_fill_racks_in_equal_segments():
    gb = load_cluster("gb200-nvl72")
    assert gb.usable_domain(64) == 64
    assert gb.usable_domain(256) == 64
    assert gb.usable_domain(144) == 72


def test_ring_time_by_hand():
    c, cal = load_cluster("h100"), default_calibration()
    p = GroupPlacement(8, 8, 1)
    want = 7 * c.nvlink_latency_us * 1e-6 + 7 / 8 * 8e9 / (c.nvlink_gb_s * cal.nvlink_eff * 1e9)
    assert ring_time(8e9, p, c, cal) == pytest.approx(want)
    assert all_reduce_time(8e9, p, c, cal) == pytest.approx(2 * want)
    assert ring_time(8e9, GroupPlacement(1, 1, 1), c, cal) == 0.0


def test_all_to_all_by_hand_and_slower_across_nodes():
    c, cal = load_cluster("h100"), default_calibration()
    S = 470e6  # 4096 tokens · top-8 · 7168 · 2 bytes (DeepSeek-V3, one rank)
    inside = all_to_all_time(S, GroupPlacement(8, 8, 1), c, cal)
    assert inside == pytest.approx(7 / 8 * S / (c.nvlink_gb_s * cal.a2a_nvlink_eff * 1e9)
                                   + c.nvlink_latency_us * 1e-6 * 4)
    across = all_to_all_time(S, GroupPlacement(64, 8, 8), c, cal)
    remote = 56 / 64 * S / (c.scaleout_gb_s * cal.a2a_scaleout_eff * 1e9)
    assert across == pytest.approx(remote + c.scaleout_latency_us * 1e-6 * 7)
    assert across > 3 * inside


def test_p2p_by_hand():
    c, cal = load_cluster("h100"), default_calibration()
    assert p2p_time(1e9, True, c, cal) == pytest.approx(
        5e-6 + 1e9 / (c.scaleout_gb_s * cal.scaleout_eff * 1e9))
    assert p2p_time(0, True, c, cal) == 0.0


def test_a_ring_across_nodes_with_k_ranks_per_node_crosses_them_through_k_nics():
    """NCCL runs a multi-node reduce-scatter as several rings, each crossing every node boundary
    once through a different GPU's NIC: eight ranks per node move their data over eight NICs
    (8× one rank per node's bandwidth, latency aside), and never faster than the NVLink hops
    the other seven shares take."""
    c, cal = load_cluster("h100", gpus=64), default_calibration()
    S = 8e9
    one = ring_time(S, GroupPlacement(8, 1, 8), c, cal)          # one rank in each of 8 nodes
    eight = ring_time(S, GroupPlacement(64, 8, 8), c, cal)        # eight ranks in each
    alpha1, alpha8 = 7 * c.scaleout_latency_us * 1e-6, 63 * c.scaleout_latency_us * 1e-6
    so = c.scaleout_gb_s * cal.scaleout_eff * 1e9
    assert one - alpha1 == pytest.approx(7 / 8 * S / so)
    nvlink_bound = 63 / 64 * S * 7 / 8 / (c.nvlink_gb_s * cal.nvlink_eff * 1e9)
    assert eight - alpha8 == pytest.approx(max(63 / 64 * S / 8 / so, nvlink_bound))
    assert eight < one / 4


@pytest.mark.parametrize("experts, k, ep, groups, per_token", [
    (256, 8, 32, None, None), (256, 8, 32, 8, 4), (128, 8, 16, None, None), (64, 6, 64, None, None),
    (8, 2, 8, None, None), (256, 8, 4, 8, 4), (256, 8, 2, 8, 4), (256, 8, 16, 8, 4),
    (128, 8, 4, None, None)])
def test_ranks_a_token_reaches_match_sampling_its_experts(experts, k, ep, groups, per_token):
    """DeepEP and HybridEP send a token once per destination rank, and once per remote node:
    the expected count of ranks (or nodes, `ep` their number) holding at least one of k distinct
    experts, drawn among those its group limit allows; a rank or node may hold several whole
    groups (DeepSeek-V3 at EP 32 over four nodes: two per node)."""
    import random

    from moeplan.cost_models.comm import ranks_hit

    rng = random.Random(0)
    per_rank, trials, total = experts // ep, 20000, 0
    for _ in range(trials):
        if groups:
            size = experts // groups
            chosen = rng.sample(range(groups), per_token)
            pool = [g * size + i for g in chosen for i in range(size)]
        else:
            pool = list(range(experts))
        total += len({e // per_rank for e in rng.sample(pool, k)})
    assert ranks_hit(experts, k, ep, groups, per_token) == pytest.approx(total / trials, rel=0.02)
    assert ranks_hit(experts, k, 1) == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_placement_equals_the_span_of_every_listed_group_at_any_domain_size(seed):
    # the span reads group starts modulo the domain (grid.group_parts_modulo), never the starts
    # themselves; rack-sized and odd domains included, every axis the cost models ask about
    rng = random.Random(seed)
    checked = 0
    while checked < 60:
        tp, cp, pp = rng.choice((1, 2, 4, 8)), rng.choice((1, 2, 3)), rng.choice((1, 2, 4, 6))
        dp, ep, etp = rng.choice((1, 2, 3, 4, 8, 12)), rng.choice((1, 2, 4, 6, 8)), rng.choice((1, 2))
        order = rng.choice(("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"))
        world = tp * cp * pp * dp
        if world % (etp * ep * pp):
            continue
        sizes = (tp, cp, dp, pp, ep, etp, order)
        grid = RankGrid(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, order=order)
        for axis in ("tp", "cp", "dp", "pp", "ep", "etp", "edp", "tp_cp", "dp_cp", "tp_ep"):
            groups = grid.groups(axis)
            for domain in (1, 4, 7, 8, 9, 36, 72):
                spans = [len({r // domain for r in g}) for g in groups]
                n = len(groups[0])
                want = (n, max(1, n // max(spans)), max(spans)) if n > 1 else (1, 1, 1)
                assert span(sizes, axis, domain) == want, (sizes, axis, domain)
        checked += 1


def test_placement_at_131072_ranks_equals_the_span_of_every_listed_group():
    sizes = (4, 2, 1024, 16, 64, 1, "tp-cp-ep-dp-pp")
    grid = RankGrid(tp=4, cp=2, dp=1024, pp=16, ep=64, etp=1)
    for axis in ("dp", "ep", "edp", "pp"):
        groups = grid.groups(axis)
        spans = [len({r // 8 for r in g}) for g in groups]
        n = len(groups[0])
        assert span(sizes, axis, 8) == (n, max(1, n // max(spans)), max(spans)), axis
