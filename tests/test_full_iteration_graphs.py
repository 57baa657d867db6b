"""A full-iteration CUDA graph is a plan choice: `Layout.cuda_graph_scope` "full_iteration"
removes the host floor the per-layer graphs leave, exports Megatron's whole-step capture with
the static MoE buffers it needs, is refused where Megatron refuses it, and is what the
published runs of Megatron-Bridge's 26.06 MXFP8 MoE recipes are priced with."""

import argparse
import json

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


# ------------------------------------------------------------- the fused grouped MLP
def _fused(on: bool, precision: str = "mxfp8", **axes) -> tuple:
    training = TrainingSpec(seq_len=4096, global_batch_size=512, precision=precision)
    lay = _layout("full_iteration", fused_grouped_mlp=on, **axes)
    return moe_layer(make_context(QWEN, GB200, training, lay, default_calibration())), lay


def test_the_fused_grouped_mlp_removes_the_activation_and_fc2_quantize_traffic():
    """Per routed copy the unfused experts move (6 + c)·f + c·h bytes outside their GEMMs (the
    activation reads 2f and writes f in bf16; each GEMM operand is quantized, c bytes per
    element: the bf16 read and MXFP8's row- and column-wise copies with their scales,
    2 + 2·(1 + 1/32)); the fused kernel keeps the fc1 operand's quantize (c·h) and writes the
    activated output once, row- and column-wise (2·(1 + 1/32)·f): Qwen3-30B-A3B (h 2048, f 768)
    moves 38% less, and the layer's forward and backward are shorter by that traffic's time."""
    from moeplan.cost_models.layers import _expert_act, _ffn, _mem

    unfused, lay = _fused(False)
    fused, _ = _fused(True)
    h, f, routed = QWEN.hidden_size, QWEN.moe_ffn_hidden_size, 1e6
    off = make_context(QWEN, GB200, TR, lay, default_calibration())
    on = make_context(QWEN, GB200, TR, lay.model_copy(update={"fused_grouped_mlp": True}),
                      default_calibration())
    act = _ffn(off, routed, f, 1)[1]
    copies = 2 * (1 + 1 / 32)
    c = 2 + copies
    assert act == pytest.approx(_mem(off, (c * h + (6 + c) * f) * routed))
    assert _expert_act(off, routed, f, act) == (act, pytest.approx(_mem(off, c * f * routed)))
    assert _expert_act(on, routed, f, act) == (
        pytest.approx(_mem(on, (c * h + copies * f) * routed)), 0.0)
    assert 1 - (c * h + copies * f) / (c * h + (6 + c) * f) == pytest.approx(0.38, abs=0.005)
    saved_f = unfused.fwd_s - fused.fwd_s
    assert saved_f > 0 and unfused.bwd_s - fused.bwd_s == pytest.approx(2 * saved_f)
    assert unfused.recompute_fwd_s["moe_act"] > fused.recompute_fwd_s["moe_act"]


def test_the_fused_grouped_mlp_prices_nothing_where_it_has_nothing_to_fuse():
    """BF16 experts quantize nothing: the flag leaves their cost as it was."""
    assert _fused(True, "bf16")[0] == _fused(False, "bf16")[0]


def test_the_fused_grouped_mlp_launches_each_expert_gemm_once_for_all_local_experts():
    from moeplan.cost_models.host import layer_launches

    lay = _layout("layer", ep=4)  # 32 local experts
    unfused = layer_launches(QWEN, lay, "mxfp8", "moe")
    fused = layer_launches(QWEN, lay, "mxfp8", "moe", fused_mlp=True)
    # blocks: dispatch, fc1 quantize, fc1, activation, fc2 quantize, fc2, combine
    assert unfused.after_sync[1:6] == (32, 32, 1, 32, 32)
    assert fused.after_sync[1:6] == (1, 1, 0, 0, 1)
    assert fused.bwd < unfused.bwd - 4 * 31
    assert layer_launches(QWEN, lay, "bf16", "moe", fused_mlp=True) == layer_launches(
        QWEN, lay, "bf16", "moe")


def test_megatron_refuses_the_fused_grouped_mlp_where_its_kernel_cannot_run():
    """Hopper, a BF16 recipe, or expert tensor parallelism: each named in the refusal."""
    plan = Plan(model=QWEN, cluster=load_cluster("h100", gpus=8),
                training=TrainingSpec(seq_len=4096, global_batch_size=512),
                layout=_layout(fused_grouped_mlp=True, etp=2), choices=Choices())
    v = dict(layout_violations(plan.model, plan.training, plan.layout, 8, plan.choices,
                               plan.cluster))
    why = v["fused_grouped_mlp_support"]
    assert "H100" in why and "bf16" in why and "etp is 2" in why
    assert "fused_grouped_mlp false" in why
    ok = Plan(model=QWEN, cluster=GB200, training=TR,
              layout=_layout("full_iteration", fused_grouped_mlp=True), choices=Choices())
    assert "fused_grouped_mlp_support" not in dict(layout_violations(
        ok.model, ok.training, ok.layout, 8, ok.choices, ok.cluster))


def test_the_export_writes_the_fused_grouped_mlp_only_for_a_transformer_engine_that_has_it(
        monkeypatch):
    """The export is written for Transformer Engine 2.12 and Megatron Core needs 2.14 for the
    fused kernel: refused by name; for 2.14 the launch carries the op fuser flag and the
    variable Transformer Engine reads."""
    from moeplan.planner import export as export_mod
    from moeplan.specs import rules

    plan = Plan(model=QWEN, cluster=GB200, training=TR,
                layout=_layout("full_iteration", fused_grouped_mlp=True), choices=Choices())
    with pytest.raises(LayoutError, match="fused_grouped_mlp_te_version"):
        to_megatron_args(plan)
    monkeypatch.setattr(export_mod, "TE_VERSION", "2.14")
    argv, _ = to_megatron_args(plan)
    assert "--use-transformer-engine-op-fuser" in argv
    assert export_mod.megatron_env(plan)["NVTE_CUTEDSL_FUSED_GROUPED_MLP"] == "1"
    assert [q.name for q in rules.requirements(rules.Facts(
        QWEN, TR, _layout("full_iteration"), None, GB200), "env")
            ].count("NVTE_CUTEDSL_FUSED_GROUPED_MLP") == 0


def test_moeplan_run_goes_ahead_without_the_fused_grouped_mlp_and_says_so():
    plan = Plan(model=QWEN, cluster=GB200, training=TR,
                layout=_layout("full_iteration", fused_grouped_mlp=True), choices=Choices())
    assert any("fused grouped MLP" in s for s in settings_not_executed(plan))
    assert not without_speed_settings(plan).layout.fused_grouped_mlp


def test_the_26_06_full_iteration_recipes_run_the_fused_grouped_mlp_and_earlier_ones_do_not():
    """Megatron-Bridge v0.5.0 (26.06) turns `cutedsl_fused_grouped_mlp` on exactly where its
    MXFP8 MoE recipes capture the whole iteration; 26.04 ran neither, and DeepSeek-V3 on
    B300 at 26.06 keeps per-layer graphs and the unfused experts."""
    from moeplan.specs import list_presets
    from moeplan.validation.rules import documented_settings

    presets = list_presets()
    rows = {r["id"]: r for r in read_rows()}
    fused = {i: case_of(rows[i], presets).layout.fused_grouped_mlp
             for i in ("R0008", "R0049", "R0043", "R0100")}
    assert fused == {"R0008": True, "R0049": True, "R0043": False, "R0100": False}
    assert documented_settings({"other_notes": "fused grouped MLP "
                                "(NVTE_CUTEDSL_FUSED_GROUPED_MLP=1)", "source_detail": ""}
                               )["fused_grouped_mlp"] is True


def test_estimate_prices_the_fused_grouped_mlp_on_request_and_refuses_it_on_hopper(capsys):
    from moeplan.cli import main

    base = ["estimate", "--model", "qwen3-30b-a3b", "--gpus", "8", "--gbs", "512", "--mbs", "4",
            "--ep", "8", "--json"]
    blackwell = base + ["--cluster", "gb200-nvl72", "--precision", "mxfp8", "--dispatcher",
                        "flex", "--cuda-graph-scope", "full_iteration"]
    speeds = []
    for extra in ([], ["--fused-grouped-mlp"]):
        assert main(blackwell + extra) == 0
        speeds.append(json.loads(capsys.readouterr().out)["tokens_per_s_per_gpu"])
    assert speeds[1] > speeds[0]
    assert main(base + ["--cluster", "h100", "--fused-grouped-mlp"]) == 2
    err = capsys.readouterr().err
    assert "fused_grouped_mlp_support" in err and "Traceback" not in err


def test_the_fused_grouped_mlp_gains_more_on_gpt_oss_than_on_deepseek_v3_as_nvidia_measured():
    """NVIDIA's technical blog "Boosting MoE Training Throughput with Advanced Fusion Kernels"
    (2026-06-15) measured the fused grouped MLP at +93% end to end on gpt-oss and +8% on
    DeepSeek-V3. Priced on the GB200 MXFP8 layouts NVIDIA publishes for them (the fused MLP and
    the whole-step graph against the unfused experts under per-layer graphs), both gain and
    gpt-oss, whose small layers carry biased, clamped experts, gains more
    (`bench/megatron_recipes.py` prints the sizes, docs/ACCURACY.md compares them)."""
    from pathlib import Path

    from moeplan.specs import list_presets
    from moeplan.validation.scoring import cluster_of, priced_layout

    steps = Path(__file__).parent.parent / "bench" / "data" / "deepseek_v3_gb200_steps.csv"
    rows = {"gpt-oss": next(r for r in read_rows() if r["id"] == "R0006"),
            "deepseek": next(r for r in read_rows(steps) if r["id"] == "DSG12")}
    gain = {}
    for name, row in rows.items():
        case = case_of(row, list_presets())

        def tokens(fused: bool, scope: str, case=case) -> float:
            lay = priced_layout(case).model_copy(update={
                "fused_grouped_mlp": fused, "cuda_graphs": True, "cuda_graph_scope": scope})
            return estimate(case.model, cluster_of(case), case.training, lay, case.choices,
                            with_interval=False).tokens_per_s_per_gpu

        gain[name] = tokens(True, "full_iteration") / tokens(False, "layer")
    assert 1.0 < gain["deepseek"] < gain["gpt-oss"]
