"""A full-iteration CUDA graph is a plan choice: `Layout.cuda_graph_scope` "full_iteration"
removes the host floor the per-layer graphs leave, exports Megatron's whole-step capture with
the static MoE buffers it needs, is refused where Megatron refuses it, and is what the
published runs of Megatron-Bridge's 26.06 MXFP8 MoE recipes are priced with."""

import argparse

import pytest

from moeplan import Choices, Layout, Plan, TrainingSpec, load_cluster, load_model
from moeplan.cost_models.calibration import default_calibration
from moeplan.cost_models.estimate import estimate
from moeplan.cost_models.layers import PAGED_STASH_BUFFER, make_context, moe_layer
from moeplan.errors import LayoutError
from moeplan.planner.export import RANK_CAPACITY_FACTOR, to_megatron_args
from moeplan.runtime.support import settings_not_executed, without_speed_settings
from moeplan.specs import check_layout, layout_violations
from moeplan.validation import case_of, read_rows

QWEN = load_model("qwen3-30b-a3b")
GB200 = load_cluster("gb200-nvl72", gpus=8)
TR = TrainingSpec(seq_len=4096, global_batch_size=512, precision="mxfp8")


def _layout(scope: str = "layer", **axes) -> Layout:
    base = {"ep": 8, "mbs": 4, "dispatcher": "flex", "ep_overlap": True, "cuda_graphs": True}
    return Layout.build(8, 512, **{**base, **axes}, cuda_graph_scope=scope)


def _flags(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--cuda-graph-impl")
    p.add_argument("--cuda-graph-modules", nargs="+")
    p.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_true")
    p.add_argument("--moe-expert-rank-capacity-factor", type=float)
    p.add_argument("--moe-paged-stash", action="store_true")
    p.add_argument("--moe-use-grouped-tensor", action="store_true")
    ns, _ = p.parse_known_args(argv)
    return ns


def test_the_scope_is_read_only_with_graphs_on():
    assert _layout("full_iteration").full_iteration_graphs
    assert not _layout("full_iteration", cuda_graphs=False).full_iteration_graphs
    assert not _layout("layer").full_iteration_graphs
    assert _layout("layer").key() != _layout("full_iteration").key()  # caches tell them apart


def test_a_full_iteration_graph_leaves_no_host_floor_where_per_layer_graphs_leave_one():
    """Qwen3-30B-A3B on 8 GB200 at MBS 4: the per-layer graphs leave the MoE part's launches
    above its device time (a host-bound forward); the whole-step graph launches none."""
    cal = default_calibration()
    layer = moe_layer(make_context(QWEN, GB200, TR, _layout("layer"), cal))
    full = moe_layer(make_context(QWEN, GB200, TR, _layout("full_iteration"), cal))
    assert full.fwd_s < layer.fwd_s and full.bwd_s <= layer.bwd_s
    assert full.launch_s == 0.0
    t_layer = estimate(QWEN, GB200, TR, _layout("layer"), with_interval=False)
    t_full = estimate(QWEN, GB200, TR, _layout("full_iteration"), with_interval=False)
    assert t_full.tokens_per_s_per_gpu > 1.05 * t_layer.tokens_per_s_per_gpu


def test_the_paged_stash_holds_the_experts_activations_at_its_buffer_factor():
    cal = default_calibration()
    layer = moe_layer(make_context(QWEN, GB200, TR, _layout("layer"), cal))
    full = moe_layer(make_context(QWEN, GB200, TR, _layout("full_iteration"), cal))
    size = {t.name: t.bytes for t in layer.tensors}
    for t in full.tensors:
        want = PAGED_STASH_BUFFER if t.name.startswith("expert_") else 1.0
        assert t.bytes == pytest.approx(want * size[t.name]), t.name


def test_export_writes_the_whole_step_capture_and_its_static_moe_buffers():
    plan = Plan(model=QWEN, cluster=GB200, training=TR, layout=_layout("full_iteration"),
                choices=Choices())
    argv, warnings = to_megatron_args(plan)[:2]
    ns = _flags(argv)
    assert ns.cuda_graph_impl == "full_iteration" and ns.cuda_graph_modules is None
    assert ns.no_check_for_nan_in_loss_and_grad  # validate_args demands it
    assert ns.moe_expert_rank_capacity_factor == RANK_CAPACITY_FACTOR
    assert ns.moe_paged_stash and ns.moe_use_grouped_tensor
    assert any("drops the tokens" in w for w in warnings)
    dense = Plan(model=load_model("llama3-8b"), cluster=GB200,
                 training=TrainingSpec(seq_len=4096, global_batch_size=64),
                 layout=Layout.build(8, 64, cuda_graphs=True, cuda_graph_scope="full_iteration"),
                 choices=Choices())
    ns = _flags(to_megatron_args(dense)[0])
    assert ns.cuda_graph_impl == "full_iteration" and ns.moe_expert_rank_capacity_factor is None


def test_a_dropless_moe_needs_hybridep_for_a_full_iteration_graph():
    bad = _layout("full_iteration", dispatcher="alltoall", ep_overlap=False)
    with pytest.raises(LayoutError, match="full_iteration_graphs_moe_buffers"):
        check_layout(QWEN, TR, bad)
    padded = TR.model_copy(update={"moe_capacity_factor": 1.0,
                                   "moe_pad_expert_input_to_capacity": True})
    check_layout(QWEN, padded, bad)  # padded to capacity, the shapes are static already
    check_layout(QWEN, TR, _layout("full_iteration"))


def test_full_iteration_graphs_allow_full_recompute_and_refuse_offload():
    lay = _layout("full_iteration", ep_overlap=False)
    v = layout_violations(QWEN, TR, lay, 8, Choices(recompute=["full"]), GB200)
    assert not [r for r, _ in v if r == "cuda_graphs_recompute"]
    v = layout_violations(QWEN, TR, _layout("layer", ep_overlap=False), 8,
                          Choices(recompute=["full"]), GB200)
    assert [r for r, _ in v if r == "cuda_graphs_recompute"]
    v = layout_violations(QWEN, TR, lay, 8, Choices(offload=["expert_fc1"]), GB200)
    assert [r for r, _ in v if r == "full_iteration_graphs_offload"]


def test_the_runtime_runs_without_the_graphs_of_either_scope():
    plan = Plan(model=QWEN, cluster=GB200, training=TR, layout=_layout("full_iteration"),
                choices=Choices())
    assert "CUDA graphs (cuda_graphs)" in settings_not_executed(plan)
    assert not without_speed_settings(plan).layout.full_iteration_graphs


def test_bridge_mxfp8_moe_rows_of_2606_are_priced_with_the_scope_their_recipe_ran():
    """Megatron-Bridge's June 2026 recipes capture the whole iteration for Qwen3 and
    DeepSeek-V3 on GB200/GB300 and Qwen3-30B-A3B on B300; DeepSeek-V3 on B300 keeps
    per-layer graphs; the 26.04 rows of the same recipes ran before the change."""
    from moeplan.specs import list_presets

    presets = list_presets()
    rows = {r["id"]: r for r in read_rows()}
    scope = {i: case_of(rows[i], presets).layout for i in ("R0008", "R0049", "R0043", "R0100")}
    assert scope["R0008"].full_iteration_graphs    # Qwen3-30B-A3B, GB200, 26.08
    assert scope["R0049"].full_iteration_graphs    # Qwen3-30B-A3B, B300, 26.06
    assert not scope["R0043"].full_iteration_graphs  # DeepSeek-V3, B300, 26.06
    assert not scope["R0100"].full_iteration_graphs  # Qwen3-30B-A3B, B200, 26.04


def test_a_row_that_documents_full_iteration_graphs_is_priced_with_them():
    from moeplan.validation.rules import documented_settings

    row = {"other_notes": "HybridEP dispatcher; EP overlap; full-iteration CUDA graphs with "
                          "paged stash", "source_detail": ""}
    got = documented_settings(row)
    assert got["cuda_graphs"] is True and got["cuda_graph_scope"] == "full_iteration"
    assert "cuda_graph_scope" not in documented_settings(
        {"other_notes": "CUDA graphs (attn moe_router)", "source_detail": ""})
