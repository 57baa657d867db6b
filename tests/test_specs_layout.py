"""Megatron Core's validity rules, each reported by name."""

from __future__ import annotations

import pytest

from moeplan import LayoutError, load_cluster, load_model
from moeplan.specs import Choices, Layout, TrainingSpec, layout_violations

DSV3 = load_model("deepseek-v3")
QWEN = load_model("qwen3-235b-a22b")
LLAMA = load_model("llama3-8b")
TRAIN = TrainingSpec(seq_len=4096, global_batch_size=1024)


def rules(model, layout, world=None, choices=None, cluster=None, training=TRAIN):
    return {r for r, _ in layout_violations(model, training, layout, world, choices, cluster)}


def test_published_deepseek_layout_is_valid():
    lay = Layout.build(256, 1024, tp=1, pp=4, vpp=4, ep=64)
    assert lay.dp == 64 and lay.edp == 1 and lay.num_microbatches == 16
    assert rules(DSV3, lay) == set()


def test_folding_allows_ep_larger_than_dp():
    lay = Layout.build(64, 1024, tp=4, pp=2, ep=32)
    assert lay.dp == 8 and lay.ep > lay.dp and lay.edp == 1
    assert rules(QWEN, lay) == set()


@pytest.mark.parametrize("axes,world,rule", [
    (dict(tp=1, pp=1, ep=3), 24, "experts_divisible_by_ep"),
    (dict(tp=8, pp=1, ep=1), 64, "kv_heads_divisible_by_tp"),
    (dict(tp=1, pp=1, ep=128, etp=2), 64, "expert_world_size"),
    (dict(tp=1, pp=1, vpp=2), 64, "vpp_needs_pp"),
])
def test_each_broken_rule_is_named(axes, world, rule):
    lay = Layout.build(world, 1024 * 3, **axes)
    assert rule in rules(QWEN, lay)


def test_heads_not_divisible_by_tp():
    lay = Layout(tp=3, dp=1)
    assert "heads_divisible_by_tp" in rules(LLAMA, lay, training=TrainingSpec(
        seq_len=4095, global_batch_size=3))


def test_world_size_mismatch_is_reported():
    lay = Layout(tp=2, dp=2)
    assert "world_size" in rules(LLAMA, lay, world=8)


def test_build_refuses_non_dividing_sizes():
    with pytest.raises(LayoutError) as e:
        Layout.build(10, 64, tp=4)
    assert "world_size" in str(e.value)
    with pytest.raises(LayoutError) as e:
        Layout.build(8, 10, tp=1, mbs=4)
    assert "gbs_divisible" in str(e.value)


def test_ep_overlap_rules_follow_megatron():
    lay = Layout.build(256, 1024, pp=4, ep=64, ep_overlap=True)
    assert "ep_overlap_needs_vpp" in rules(DSV3, lay)
    lay = Layout.build(256, 1024, pp=4, vpp=4, ep=64, ep_overlap=True)
    assert rules(DSV3, lay) == set()
    assert "ep_overlap_recompute" in rules(DSV3, lay, choices=Choices(recompute=["moe"]))


def test_dense_model_refuses_expert_parallelism():
    lay = Layout.build(8, 64, ep=2)
    assert "ep_needs_experts" in rules(LLAMA, lay)


def test_a_dense_model_refuses_moe_module_choices_and_a_dispatcher_it_would_drop():
    """llama3-8b kept `recompute=moe_act offload=expert_fc1` and exported them as Megatron
    flags, and took `dispatcher flex` to drop it: each is named by a rule; an MoE model takes
    them all, and the dense model's own modules stay allowed."""
    from moeplan.planner.problem import OPTIONS, Option, menu

    lay = Layout.build(8, 1024, tp=8)
    moe = Choices(recompute=["moe_act", "shared_experts"], offload=["expert_fc1", "moe_act"])
    assert "moe_modules_need_moe" in rules(LLAMA, lay, choices=moe)
    for name in ("moe_act", "moe", "shared_experts"):
        assert "moe_modules_need_moe" in rules(LLAMA, lay, choices=Choices(recompute=[name]))
    assert rules(LLAMA, lay, choices=Choices(recompute=["mlp", "core_attn"],
                                             offload=["qkv_linear", "mlp_norm"])) == set()
    assert rules(QWEN, Layout.build(8, 1024, ep=8), choices=moe) == set()
    assert "dispatcher_needs_experts" in rules(LLAMA, lay.model_copy(
        update={"dispatcher": "flex"}))
    assert rules(QWEN, Layout.build(8, 1024, ep=8, dispatcher="allgather")) == set()
    offered = menu(LLAMA, TRAIN, lay, "megatron", OPTIONS).options
    assert Option.recompute("mlp") in offered
    assert not {Option.recompute("moe_act"), Option.offload("expert_fc1")} & set(offered)


def test_precision_must_exist_on_the_gpu():
    lay = Layout.build(8, 64)
    h100 = load_cluster("h100")
    train = TrainingSpec(global_batch_size=64, precision="mxfp8")
    assert "precision_supported" in rules(LLAMA, lay, cluster=h100, training=train)
    train = TrainingSpec(global_batch_size=64, precision="fp8-blockwise")
    assert rules(LLAMA, lay, cluster=h100, training=train) == set()
    assert "precision_supported" in rules(LLAMA, lay, cluster=load_cluster("a100-80g"),
                                          training=train)


def test_full_recompute_is_exclusive():
    with pytest.raises(ValueError):
        Choices(recompute=["full", "mlp"])


def test_plan_json_round_trips_with_derived_fields(tmp_path):
    from moeplan import load_plan
    from moeplan.specs import Plan

    lay = Layout.build(256, 1024, pp=4, vpp=4, ep=64)
    plan = Plan(model=DSV3, cluster=load_cluster("h100", gpus=256), training=TRAIN, layout=lay)
    p = tmp_path / "plan.json"
    p.write_text(plan.model_dump_json())
    assert load_plan(p) == plan
    assert '"edp":1' in plan.model_dump_json()


def test_contradicting_derived_field_is_refused():
    with pytest.raises(ValueError, match="edp"):
        Layout.model_validate({"tp": 1, "dp": 4, "ep": 2, "edp": 4})


def test_a_derived_field_beside_a_mistyped_axis_is_refused_naming_the_axis():
    """A hand-edited plan with `world_size` kept and `tp` broken fails field validation on `tp`
    (no TypeError from comparing the derived field first)."""
    from pydantic import ValidationError

    for bad in ({"tp": None, "world_size": 8}, {"pp": "two", "edp": 1}, {"dp": [2], "edp": 2}):
        with pytest.raises(ValidationError) as e:
            Layout.model_validate(bad)
        assert next(iter(set(bad) - {"world_size", "edp"})) in str(e.value)


@pytest.mark.parametrize("tp", [0, -1, 2.5])
def test_a_plan_axis_that_is_no_positive_whole_number_is_refused_by_name_not_blamed_on_edp(tp):
    """A hand-edited plan keeps `world_size` and `edp`; `tp: 0` is the error, not the derived
    fields its product no longer matches."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        Layout.model_validate({"tp": tp, "dp": 4, "ep": 2, "world_size": 4, "edp": 2,
                               "sequence_parallel": False})
    assert [err["loc"] for err in e.value.errors()] == [("tp",)], e.value
    assert "implied" not in str(e.value) and "imply" not in str(e.value)


def test_a_derived_field_is_compared_with_the_axes_as_read_not_as_written():
    """`tp: "2"` reads as 2: a `world_size` kept from before the edit no longer matches."""
    with pytest.raises(ValueError, match="world_size: given 4 but the axes imply 8"):
        Layout.model_validate({"tp": "2", "dp": 4, "world_size": 4})
