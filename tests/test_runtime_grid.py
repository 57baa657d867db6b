"""RankGrid reproduces Megatron Core's process groups: golden tables and the rank formula.

Pure functions, no processes (Megatron's own `test_parallel_state` style)."""

from __future__ import annotations

import itertools

import pytest

from moeplan import groups
from moeplan.errors import SpecError
from moeplan.specs.grid import RankGrid


def test_megatron_docstring_example_tp2_pp4_on_16_ranks():
    # megatron/core/parallel_state.py, initialize_model_parallel docstring
    g = RankGrid(tp=2, dp=2, pp=4)
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                              [14, 15]]
    assert g.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                              [13, 15]]


def test_folding_ep_larger_than_dp_on_8_ranks():
    g = RankGrid(tp=2, dp=4, ep=4)
    assert g.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.groups("etp") == [[r] for r in range(8)]
    assert g.groups("tp_ep") == g.groups("ep")


def test_etp2_ep2_with_tp1_on_8_ranks():
    g = RankGrid(dp=8, ep=2, etp=2)
    assert g.groups("etp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.groups("tp_ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _formula_groups(sizes: dict[str, int], order: list[str], axes: set[str]) -> list[list[int]]:
    """Groups from REFERENCE.md's rank formula: rank = Σ index_i·Π_{j<i} size_j in `order`."""
    by_key: dict[tuple, list[int]] = {}
    for idx in itertools.product(*(range(sizes[a]) for a in order)):
        rank, stride = 0, 1
        for a, i in zip(order, idx, strict=True):
            rank += i * stride
            stride *= sizes[a]
        key = tuple(i for a, i in zip(order, idx, strict=True) if a not in axes)
        by_key.setdefault(key, []).append(rank)
    return sorted(sorted(g) for g in by_key.values())


LAYOUTS = [
    # (tp, cp, dp, pp, ep, etp)
    (1, 1, 1, 1, 1, 1), (2, 1, 4, 1, 4, 1), (2, 1, 4, 1, 8, 1), (1, 1, 8, 1, 2, 2),
    (2, 2, 2, 2, 4, 1), (4, 1, 4, 2, 8, 2), (8, 1, 8, 4, 64, 1), (2, 1, 8, 4, 8, 2),
    (1, 2, 4, 2, 8, 1), (4, 2, 2, 2, 2, 4), (2, 1, 2, 3, 4, 1), (1, 1, 6, 2, 3, 2),
]


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"])
@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp", LAYOUTS)
def test_groups_match_the_megatron_rank_formula(tp, cp, dp, pp, ep, etp, order):
    g = RankGrid(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, order=order)
    edp = g.world // (etp * ep * pp)
    attn = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    expert = {"tp": etp, "ep": ep, "dp": edp, "pp": pp}
    attn_order = [a for a in order.split("-") if a != "ep"]
    expert_order = [a for a in order.split("-") if a != "cp"]
    cases = {"tp": {"tp"}, "cp": {"cp"}, "dp": {"dp"}, "pp": {"pp"}, "tp_cp": {"tp", "cp"},
             "dp_cp": {"dp", "cp"}}
    for axis, members in cases.items():
        assert g.groups(axis) == _formula_groups(attn, attn_order, members), axis
    for axis, members in {"ep": {"ep"}, "etp": {"tp"}, "edp": {"dp"},
                          "tp_ep": {"tp", "ep"}}.items():
        assert g.groups(axis) == _formula_groups(expert, expert_order, members), axis
    # every axis partitions the world
    for axis in ("tp", "cp", "dp", "pp", "ep", "etp", "edp", "tp_ep"):
        flat = sorted(r for grp in g.groups(axis) for r in grp)
        assert flat == list(range(g.world))


def test_groups_api_rejects_sizes_that_do_not_divide():
    with pytest.raises(SpecError, match="etp·ep·pp"):
        groups(gpus=8, ep=3)
    assert groups(gpus=4, tp=2, ep=2)["edp"] == [[0, 2], [1, 3]]


def test_moeplan_groups_json(cli):
    import json

    r = cli("groups", "--gpus", "8", "--tp", "2", "--ep", "4", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"tp", "cp", "dp", "pp", "tp_cp", "ep", "etp", "edp"}
    assert doc["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    bad = cli("groups", "--gpus", "6", "--tp", "4")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_an_ep_group_splits_by_nvlink_domain_into_domains_and_rails():
    from moeplan.runtime.groups import ep_domains

    assert ep_domains([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert ep_domains([8, 9, 10, 11, 12, 13, 14, 15], 4) == (
        [[8, 9, 10, 11], [12, 13, 14, 15]], [[8, 12], [9, 13], [10, 14], [11, 15]])
    # one domain, or a placement whose domains are not runs of one size: no split
    assert ep_domains([0, 1, 2, 3], 8) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert ep_domains([0, 2, 1, 3], 2)[0] == [[0, 2, 1, 3]]
    assert ep_domains([0, 1, 2], 2)[0] == [[0, 1, 2]]
