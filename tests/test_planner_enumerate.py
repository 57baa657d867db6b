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
