"""Layout enumeration agrees with the spec's Megatron rules: nothing invalid survives, nothing
valid is lost except by the planner's named placement rule."""

from __future__ import annotations

import itertools

from moeplan import load_cluster, load_model
from moeplan.planner.branch import layout_of_row as _layout
from moeplan.planner.enumerate import COL, SearchSpace, divisors, enumerate_layouts
from moeplan.specs import Layout, TrainingSpec, layout_violations

MODEL = load_model("qwen3-30b-a3b")
CLUSTER = load_cluster("h100", gpus=32)
TRAIN = TrainingSpec(seq_len=4096, global_batch_size=64)
SPACE = SearchSpace(precisions=("bf16",), max_mbs=2, max_vpp=2)


def test_every_enumerated_layout_is_valid():
    enum = enumerate_layouts(MODEL, CLUSTER, TRAIN, 32, SPACE)
    assert len(enum.rows) > 100
    for row in enum.rows:
        lay = Layout(**_layout(row))
        assert layout_violations(MODEL, TRAIN, lay, 32, None, CLUSTER) == [], lay


def test_no_valid_layout_is_lost_except_by_named_placement_rule():
    enum = enumerate_layouts(MODEL, CLUSTER, TRAIN, 32, SPACE)
    got = {tuple(int(r[COL[c]]) for c in ("tp", "cp", "pp", "ep", "etp")) for r in enum.rows}
    for tp, cp, pp, ep, etp in itertools.product(*[divisors(32)] * 5):
        if 32 % (tp * cp * pp) or TRAIN.global_batch_size % (32 // (tp * cp * pp)):
            continue
        lay = Layout.build(32, TRAIN.global_batch_size, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp)
        if layout_violations(MODEL, TRAIN, lay, 32, None, CLUSTER):
            continue
        if tp * cp > CLUSTER.nvlink_domain_gpus or etp > CLUSTER.nvlink_domain_gpus:
            assert (tp, cp, pp, ep, etp) not in got
            continue
        assert (tp, cp, pp, ep, etp) in got, (tp, cp, pp, ep, etp)
    assert enum.pruned["tp_cp_within_nvlink"] > 0


def test_flex_is_enumerated_only_where_the_ep_group_leaves_the_nvlink_domain():
    """Inside one domain the flex dispatcher is the all-to-all exchange: the same plan twice."""
    from moeplan.planner.enumerate import DISPATCHERS

    enum = enumerate_layouts(MODEL, CLUSTER, TRAIN, 32, SPACE)
    flex = enum.rows[enum.rows[:, COL["dispatcher"]] == DISPATCHERS.index("flex")]
    assert len(flex) > 0 and enum.pruned["flex_inside_nvlink"] > 0
    domain = CLUSTER.usable_domain(32)
    assert all(domain % int(r[COL["ep"]] * r[COL["etp"]]) for r in flex)


def test_no_two_rows_differ_only_in_a_setting_without_effect_at_their_sizes():
    """Without expert parallelism no dispatcher moves a token, and over one data-parallel rank
    (expert data-parallel too) the distributed optimizer shards nothing: the rows differing only
    there are one job, which filled the top k with copies ranked by a tie of equal numbers
    (llama3-8b on 7 GPUs: `dist-opt` and `no-dist-opt`, "3,287 vs 3,287"). One row stands for
    each, the stack's default; where the setting matters both stay."""
    from moeplan.planner.enumerate import DISPATCHERS

    enum = enumerate_layouts(MODEL, CLUSTER, TRAIN, 32, SPACE)
    rows = enum.rows
    ep1 = rows[rows[:, COL["ep"]] == 1]
    assert len(ep1) and set(ep1[:, COL["dispatcher"]]) == {DISPATCHERS.index("alltoall")}
    assert {DISPATCHERS.index("allgather"), DISPATCHERS.index("flex")} <= set(
        rows[rows[:, COL["ep"]] > 1][:, COL["dispatcher"]])
    one = (rows[:, COL["dp"]] * rows[:, COL["cp"]] == 1) & (rows[:, COL["edp"]] == 1)
    assert one.any() and rows[one][:, COL["dist_opt"]].all()
    assert set(rows[~one][:, COL["dist_opt"]]) == {0, 1}
    assert enum.pruned["dispatcher_without_ep"] > 0 and enum.pruned["dist_opt_without_dp"] > 0
    dense = load_model("llama3-8b")
    tr = TrainingSpec(seq_len=4096, global_batch_size=3)
    rows = enumerate_layouts(dense, load_cluster("h100", gpus=7), tr, 7, SPACE).rows
    assert [(_layout(r)["pp"], _layout(r)["distributed_optimizer"]) for r in rows] == [(7, True)]
    # a stack without the distributed optimizer keeps the replicated one it has
    old = SearchSpace(precisions=("bf16",), max_mbs=2, max_vpp=2, allow_dist_opt=False)
    rows = enumerate_layouts(dense, load_cluster("h100", gpus=7), tr, 7, old).rows
    assert [_layout(r)["distributed_optimizer"] for r in rows] == [False]
