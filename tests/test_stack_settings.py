"""Stack features are plan choices: TP comm overlap and CUDA graphs are layout fields with their
own cost, their own Megatron flags and their own search rule, never global constants."""

import argparse
import functools
from pathlib import Path

import pytest

from moeplan import Choices, Layout, Plan, TrainingSpec, load_cluster, load_model
from moeplan.cost_models.calibration import default_calibration
from moeplan.cost_models.estimate import estimate, fixed_buffer_bytes
from moeplan.cost_models.layers import dense_layer, make_context, moe_layer
from moeplan.errors import LayoutError
from moeplan.planner.export import to_megatron_args
from moeplan.planner.search import search
from moeplan.runtime.support import features_not_executed, settings_not_executed
from moeplan.specs import check_layout
from moeplan.validation import case_of, read_rows

GB = 1e9
LLAMA = load_model("llama3-70b")
H100 = load_cluster("h100", gpus=64)
TR = TrainingSpec(seq_len=4096, global_batch_size=256)


@functools.cache
def published_cases():
    """(row, RunCase) of every predictable row of the shared published runs, read once."""
    from moeplan.specs import list_presets

    presets = list_presets()
    rows = read_rows()  # the shipped published runs
    return [(r, c) for r in rows for c in [case_of(r, presets)] if not isinstance(c, str)]


def _ctx(**axes):
    layout = Layout.build(64, 256, **axes)
    return make_context(LLAMA, H100, TR, layout, default_calibration())


def test_without_tp_comm_overlap_all_tp_communication_is_exposed():
    lc = dense_layer(_ctx(tp=8, pp=2))
    assert lc.tp_s > 0
    assert lc.exposed_fwd_s + lc.exposed_bwd_s == pytest.approx(lc.tp_s)


def test_tp_comm_overlap_hides_at_most_its_share_and_costs_sms():
    cal = default_calibration()
    off = dense_layer(_ctx(tp=8, pp=2))
    on = dense_layer(_ctx(tp=8, pp=2, tp_comm_overlap=True))
    exposed = on.exposed_fwd_s + on.exposed_bwd_s
    assert exposed < off.exposed_fwd_s + off.exposed_bwd_s
    # never below the share η leaves exposed, plus the SM share of what it hides
    floor = (1 - cal.tp_overlap_hidden) * on.tp_s
    assert exposed >= floor - 1e-12
    assert on.fwd_s == off.fwd_s and on.tensors == off.tensors  # same compute and memory


def test_tp_comm_overlap_needs_tp():
    with pytest.raises(LayoutError, match="tp_comm_overlap_needs_tp"):
        check_layout(LLAMA, TR, Layout.build(64, 256, pp=4, tp_comm_overlap=True))


def test_cuda_graphs_hold_their_memory_pool():
    cal = default_calibration()
    layout = Layout.build(64, 256, tp=8, pp=2)
    graphed = layout.model_copy(update={"cuda_graphs": True})
    extra = fixed_buffer_bytes(LLAMA, TR, graphed, cal) - fixed_buffer_bytes(LLAMA, TR, layout,
                                                                             cal)
    assert extra == pytest.approx(cal.cuda_graph_gb * GB)


def test_graphs_and_overlap_make_a_step_faster_and_are_named_as_unvalidated_or_validated():
    small = load_model("llama3-8b")  # host-bound at tp 8, 1,024 tokens: the graphs matter
    tr = TrainingSpec(seq_len=1024, global_batch_size=256)
    base = Layout.build(64, 256, tp=8, pp=2)
    t0 = estimate(small, H100, tr, base)
    t1 = estimate(small, H100, tr, base.model_copy(update={"tp_comm_overlap": True,
                                                           "cuda_graphs": True}))
    assert t1.step_time_s < t0.step_time_s
    terms = {a.term: a for a in t1.assumptions}
    graphs = next(a for k, a in terms.items() if "CUDA graphs" in k)
    assert not graphs.validated  # no published row documents graphs
    # the low end is priced without the unvalidated graphs
    assert t1.interval.pessimistic_tokens_per_s_per_gpu < t1.tokens_per_s_per_gpu


def _flags(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--tp-comm-overlap", action="store_true")
    p.add_argument("--cuda-graph-impl")
    p.add_argument("--cuda-graph-modules", nargs="+")
    ns, _ = p.parse_known_args(argv)
    return ns


@pytest.mark.parametrize(("model", "axes", "scope"), [
    ("llama3-70b", {"tp": 8, "pp": 2}, ["attn", "mlp"]),
    ("mixtral-8x7b", {"tp": 2, "ep": 8}, ["attn", "moe_router", "moe_preprocess"])])
def test_export_writes_the_megatron_flags_of_each_setting(model, axes, scope):
    m = load_model(model)
    on = Layout.build(64, 256, **axes, tp_comm_overlap=True, cuda_graphs=True)
    plan = Plan(model=m, cluster=H100, training=TR, layout=on, choices=Choices())
    ns = _flags(to_megatron_args(plan)[0])
    assert ns.tp_comm_overlap and ns.cuda_graph_impl == "transformer_engine"
    assert ns.cuda_graph_modules == scope
    off = plan.model_copy(update={"layout": Layout.build(64, 256, **axes)})
    ns = _flags(to_megatron_args(off)[0])
    assert not ns.tp_comm_overlap and ns.cuda_graph_impl is None


def test_search_turns_tp_overlap_on_for_megatron_and_off_for_the_runtime():
    m = load_model("mixtral-8x7b")
    tr = TrainingSpec(seq_len=4096, global_batch_size=512)
    mega = search(m, H100, tr, 64, top_k=3, objective="expected")
    assert all(p.layout.tp_comm_overlap == (p.layout.tp > 1) for p in mega.plans)
    own = search(m, H100, tr, 64, top_k=3, objective="expected", target="moeplan")
    assert not any(p.layout.tp_comm_overlap or p.layout.cuda_graphs for p in own.plans)


def test_runtime_runs_the_same_function_without_the_speed_settings_and_says_so():
    plan = Plan(model=LLAMA, cluster=H100, training=TR, choices=Choices(),
                layout=Layout.build(64, 256, tp=8, pp=2, tp_comm_overlap=True,
                                    cuda_graphs=True))
    assert features_not_executed(plan) == []
    assert len(settings_not_executed(plan)) == 2


def test_validation_prices_nemo_recipes_with_tp_overlap_and_papers_without():
    seen = {"nemo": 0, "paper": 0, "kept off": 0}
    off = {"R0265", "R0106", "R0291", "R0038", "R0209"}  # Qwen3-235B H100, DeepSeek-V3, NVFP4
    for r, c in published_cases():
        if c.layout.tp == 1:
            continue
        if r["source"].startswith("NVIDIA Megatron-Bridge"):
            if r["id"] in off:
                assert not c.layout.tp_comm_overlap, r["id"]
                seen["kept off"] += 1
            elif r["precision_preset"] != "nvfp4" and r["model_preset"] not in (
                    "deepseek-v3", "kimi-k2", "qwen3-235b-a22b"):
                assert c.layout.tp_comm_overlap, r["id"]
                seen["nemo"] += 1
        elif r["source"].startswith("Narayanan"):
            assert not c.layout.tp_comm_overlap, r["id"]
            seen["paper"] += 1
    assert seen["nemo"] > 10 and seen["paper"] > 5 and seen["kept off"] == len(off)


def test_bridge_recipes_that_keep_tp_overlap_off_are_priced_without_it():
    """Megatron-Bridge's DeepSeek-V3 and Kimi-K2 base recipes, its Qwen3-235B-A22B H100
    performance config and every NVFP4 Llama config set `tp_comm_overlap=False` at TP > 1;
    the GB200 Qwen3-235B configs and the FP8 Llama ones keep it on."""
    from moeplan.validation.rules import stack_settings

    bridge = {"source": "NVIDIA Megatron-Bridge performance summary", "gpu": "H100-SXM"}
    assert stack_settings(bridge, 2, "qwen3-235b-a22b", "fp8-tensorwise") == {}
    assert stack_settings(bridge, 2, "deepseek-v3", "fp8-blockwise") == {}
    assert stack_settings(bridge, 8, "kimi-k2", "bf16") == {}
    assert stack_settings(bridge, 4, "llama3-405b", "nvfp4") == {}
    assert stack_settings(bridge, 4, "llama3-405b", "fp8-tensorwise") == {"tp_comm_overlap": True}
    gb200 = {**bridge, "gpu": "GB200"}
    assert stack_settings(gb200, 2, "qwen3-235b-a22b", "mxfp8") == {"tp_comm_overlap": True}
    assert stack_settings(bridge, 1, "llama3-405b", "fp8-tensorwise") == {}


def test_a_low_precision_recipe_gathers_its_quantized_operand_across_tp():
    """Transformer Engine quantizes a column-parallel GEMM's input before the sequence-parallel
    all-gather, so an FP8 or NVFP4 recipe moves fewer TP bytes than bf16 (the reduce-scatters
    and the backward stay bf16): one of the block's four collectives shrinks."""
    from moeplan.cost_models.layers import QUANTIZED_BYTES

    layout = Layout.build(64, 256, tp=8, pp=2)
    cal = default_calibration()
    tp = {p: dense_layer(make_context(LLAMA, H100, TR.model_copy(update={"precision": p}),
                                      layout, cal)).tp_s
          for p in ("bf16", "fp8-tensorwise", "nvfp4")}
    assert tp["nvfp4"] < tp["fp8-tensorwise"] < tp["bf16"]
    # each block's four rings: three bf16, one at the quantized width (latency aside)
    assert tp["fp8-tensorwise"] / tp["bf16"] == pytest.approx(
        (3 * 2 + QUANTIZED_BYTES["fp8-tensorwise"]) / 8, rel=0.02)


# ------------------------------------------------------------- bf16 gradient reduction
def _extras(training: TrainingSpec, layout: Layout):
    from moeplan.cost_models.estimate import step_extras

    return step_extras(LLAMA, H100, training, layout, default_calibration(),
                       dense_params=4e9, expert_params=0.0, fwd_window_s=1.0, bwd_window_s=2.0)


def test_bf16_gradient_reduction_moves_half_the_bytes_and_keeps_half_the_gradient_memory():
    lay = Layout.build(64, 256, tp=8, pp=2)
    bf16 = TR.model_copy(update={"grad_reduce_dtype": "bf16"})
    fp32_x, bf16_x = _extras(TR, lay), _extras(bf16, lay)
    assert bf16_x.reduce_scatter_s == pytest.approx(fp32_x.reduce_scatter_s / 2, rel=0.02)
    assert bf16_x.all_gather_s == fp32_x.all_gather_s  # bf16 parameters either way
    a = estimate(LLAMA, H100, TR, lay, with_interval=False)
    b = estimate(LLAMA, H100, bf16, lay, with_interval=False)
    assert b.memory.grads_gb == pytest.approx(a.memory.grads_gb / 2)
    assert b.memory.weights_gb == a.memory.weights_gb
    assert b.time.dp_comm_s < a.time.dp_comm_s and b.step_time_s <= a.step_time_s


def test_bf16_gradient_reduction_exports_its_megatron_flag():
    plan = Plan(model=LLAMA, cluster=H100, choices=Choices(), layout=Layout.build(64, 256, tp=8),
                training=TR.model_copy(update={"grad_reduce_dtype": "bf16"}))
    assert "--grad-reduce-in-bf16" in to_megatron_args(plan)[0]
    assert "--grad-reduce-in-bf16" not in to_megatron_args(
        plan.model_copy(update={"training": TR}))[0]


def test_validation_reduces_gradients_in_bf16_for_nvidia_recipes_and_fp32_for_papers():
    seen = {"recipe": 0, "paper": 0}
    for r, c in published_cases():
        if r["source"].startswith(("NVIDIA Megatron-Bridge", "NVIDIA NeMo 2.0")):
            assert c.training.grad_reduce_dtype == "bf16", r["id"]
            assert c.assumed.get("grad_reduce_dtype") == "bf16", r["id"]
            seen["recipe"] += 1
        elif r["source"].startswith(("Narayanan", "MoE Parallel Folding", "Korthikanti")):
            assert c.training.grad_reduce_dtype == "fp32", r["id"]
            seen["paper"] += 1
    assert seen["recipe"] > 50 and seen["paper"] > 10


# ------------------------------------------------------------ FP8 parameter all-gather
def test_fp8_parameter_gather_halves_the_gemm_weights_gather_and_keeps_embeddings_bf16():
    from moeplan.cost_models.estimate import step_extras

    lay = Layout.build(64, 256, tp=8, pp=2)
    fp8 = TR.model_copy(update={"precision": "fp8-tensorwise"})
    gather = fp8.model_copy(update={"fp8_param_gather": True})
    args = dict(dense_params=4e9, expert_params=0.0, fwd_window_s=1.0, bwd_window_s=2.0)
    cal = default_calibration()
    plain = step_extras(LLAMA, H100, fp8, lay, cal, **args)
    half = step_extras(LLAMA, H100, gather, lay, cal, **args)
    assert half.all_gather_s == pytest.approx(plain.all_gather_s / 2, rel=0.02)
    assert half.reduce_scatter_s == plain.reduce_scatter_s  # gradients are not FP8
    # the embedding and output layer keep bf16 weights: all-embedding gathers as before
    emb = step_extras(LLAMA, H100, gather, lay, cal, **args, embedding_params=4e9)
    assert emb.all_gather_s == pytest.approx(plain.all_gather_s)
    plan = Plan(model=LLAMA, cluster=H100, training=gather, layout=lay, choices=Choices())
    assert "--fp8-param-gather" in to_megatron_args(plan)[0]
    assert any("fp8_param_gather" in f for f in features_not_executed(plan))


def test_fp8_parameter_gather_needs_an_fp8_recipe():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="fp8_param_gather: needs an FP8 precision"):
        TrainingSpec(seq_len=4096, global_batch_size=256, fp8_param_gather=True)


def test_validation_gathers_fp8_parameters_only_where_a_recipe_documents_it():
    """NeMo 2.0's FP8 rows, and Megatron-Bridge's FP8 current-scaling and MXFP8 rows (its
    `get_precision_config`), except Kimi-K2 from 26.04 (Muon turns the gather off); no other
    row, NVFP4 and blockwise FP8 included."""
    from moeplan.validation.rows import release_of

    on = off = 0
    for r, c in published_cases():
        bridge = (r["source"].startswith("NVIDIA Megatron-Bridge")
                  and c.training.precision in ("fp8-tensorwise", "mxfp8")
                  and not (r["model_preset"] == "kimi-k2" and release_of(r) >= (26, 4)))
        documented = bridge or (r["source"].startswith("NVIDIA NeMo 2.0 performance summary")
                                and r["precision"].strip() == "FP8")
        assert c.training.fp8_param_gather == documented, r["id"]
        on, off = on + documented, off + (not documented and c.training.precision != "bf16")
    assert on >= 100 and off > 20


# ------------------------------------------------------------- Megatron-Bridge recipes
def _bridge(**over: str) -> dict[str, str]:
    """A Megatron-Bridge row of DeepSeek-V3 on 256 B200 at the sizes of the 26.04 B200 MXFP8
    recipe (PP8 VPP2 EP32, MBS 1, GBS 4096)."""
    row = {"id": "B1", "source": "NVIDIA Megatron-Bridge performance summary",
           "source_detail": "docs; release 26.04.01 NeMo container; DGX-B200", "gpu": "B200",
           "num_gpus": "256", "seq_len": "4096", "global_batch_seqs": "4096", "micro_batch": "1",
           "tp": "1", "pp": "8", "vpp": "2", "ep": "32", "tokens_per_s_per_gpu": "3000",
           "model_preset": "deepseek-v3", "cluster_preset": "b200",
           "precision_preset": "mxfp8", "flops_convention": "causal_halved"}
    return {**row, **over}


def test_a_bridge_row_with_a_recipes_sizes_is_priced_with_that_recipes_settings():
    from moeplan.specs import list_presets

    presets = list_presets()
    case = case_of(_bridge(), presets)
    assert case.assumed["recipe"] == "DEEPSEEK_V3_PRETRAIN_CONFIG_B200_FP8_MX_V2"
    assert case.layout.dispatcher == "flex" and case.layout.ep_overlap
    assert case.layout.cuda_graphs
    assert case.choices.recompute == [["mla_up_proj", "mlp"]]
    # one size off, another source, another precision: no recipe, moeplan's defaults
    for row in (_bridge(global_batch_seqs="2048"), _bridge(vpp="4"),
                _bridge(source="NVIDIA NeMo 2.0 performance summary"),
                _bridge(precision_preset="nvfp4")):
        other = case_of(row, presets)
        assert "recipe" not in other.assumed, row
        assert other.layout.dispatcher == "alltoall" and not other.layout.ep_overlap, row
        assert not other.layout.cuda_graphs and other.choices.recompute == [], row


def test_a_recipe_that_kept_its_sizes_prices_only_the_releases_that_ran_it():
    """DeepSeek-V3 on GB200 ran PP4 VPP4 EP64 before and after the 26.06 MXFP8 recipe change;
    only the 26.06 rows are priced with that recipe's EP overlap."""
    from moeplan.specs import list_presets

    presets = list_presets()
    over = dict(gpu="GB200", cluster_preset="gb200-nvl72", pp="4", vpp="4", ep="64")
    early = case_of(_bridge(**over), presets)
    late = case_of(_bridge(**over, source_detail="docs; release 26.06 NeMo container"), presets)
    assert "recipe" not in early.assumed and not early.layout.ep_overlap
    assert late.assumed["recipe"] == "DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_FP8_MX_V2"
    assert late.layout.ep_overlap and late.choices.recompute == [["mla_up_proj"]]


def test_a_bridge_deepseek_row_runs_the_recipes_pipeline_layout_not_moeplans_count_split():
    """Megatron-Bridge's DeepSeek-V3 recipe sets the pipeline layout (E and four decoder layers
    first, one decoder layer with the MTP and the loss last at PP·VP = 16), and every release
    from 25.11 ran it whether or not the row matches a table recipe; moeplan's own split by
    count would put two decoder layers beside the MTP and the loss, a heavier pacing stage."""
    from moeplan.specs import list_presets, parse_stage_layout, stage_layout_for

    presets = list_presets()
    case = case_of(_bridge(), presets)
    assert case.choices.stage_layout == "Et*4|(t*4|)*14,tmL"
    assert case.assumed["stage_layout"] == case.choices.stage_layout
    stages = parse_stage_layout(case.choices.stage_layout, 8, 61, 1)
    assert stages[0] == ["E"] + ["t"] * 4 and stages[-1] == ["t", "m", "L"]
    assert stages != stage_layout_for(61, 8, 2, 1)
    base = case.choices.model_copy(update={"stage_layout": None})
    priced = estimate(case.model, case.cluster, case.training, case.layout, case.choices)
    counted = estimate(case.model, case.cluster, case.training, case.layout, base)
    assert priced.step_time_s < counted.step_time_s  # the count split's last stage paces it
    # a run without MTP keeps the loss alone beside the last decoder layer
    without = case_of(_bridge(other_notes="variant=w/o MTP"), presets)
    assert without.choices.stage_layout == "Et*4|(t*4|)*14,tL"
    # GB300's PP 2 × VPP 8 took the layout from 26.02 on; 25.09's run script, another source and
    # a (PP, VPP) the recipe leaves to Megatron's default get moeplan's split
    gb300 = dict(gpu="GB300", cluster_preset="gb300-nvl72", pp="2", vpp="8")
    assert case_of(_bridge(**gb300), presets).choices.stage_layout == "Et*4|(t*4|)*14,tmL"
    for row in (_bridge(**gb300, source_detail="docs; release 25.11 NeMo container"),
                _bridge(source_detail="docs; release 25.09 NeMo container"),
                _bridge(source="NVIDIA NeMo 2.0 performance summary"),
                _bridge(pp="2", vpp="4")):
        other = case_of(row, presets)
        assert other.choices.stage_layout is None and "stage_layout" not in other.assumed, row


def test_every_deepseek_recipe_layout_is_one_megatron_takes():
    """Each entry of the map, with and without MTP, is a valid layout of DeepSeek-V3's 61 layers
    over PP·VP stages (the `stage_layout_valid` rule a plan obeys)."""
    from moeplan.specs import parse_stage_layout
    from moeplan.validation.recipes import PIPELINE_LAYOUTS

    for (pp, vpp), text in PIPELINE_LAYOUTS.items():
        for mtp in (0, 1):
            stages = parse_stage_layout(text.replace("{m}", "m" * mtp), pp, 61, mtp)
            assert len(stages) == pp * vpp, (pp, vpp)
            assert sum(s.count("t") for s in stages) == 61 and stages[-1][-1] == "L"


def test_every_recipe_is_a_layout_megatron_would_run_with_its_settings():
    """The table is checked the way a row is: each recipe builds as a layout with its settings
    and recompute, on its model and GPU, without a rule violation (so no recipe silently falls
    back to the defaults), and its recompute modules exist in moeplan."""
    from moeplan.specs import layout_violations
    from moeplan.specs.layout import RecomputeModule
    from moeplan.validation.recipes import RECIPE_FILES, RECIPES

    cluster_of = {"GB300": "gb300-nvl72", "GB200": "gb200-nvl72", "B300": "b300",
                  "B200": "b200", "H100-SXM": "h100"}
    allowed = set(RecomputeModule.__args__)
    assert len({r.name for r in RECIPES}) == len(RECIPES)
    for r in RECIPES:
        assert r.model in RECIPE_FILES and set(r.recompute) <= allowed, r.name
        model, cluster = load_model(r.model), load_cluster(cluster_of[r.gpu], r.gpus)
        for precision in r.precisions:
            training = TrainingSpec(seq_len=4096, global_batch_size=r.gbs, precision=precision)
            lay = Layout.build(r.gpus, r.gbs, tp=r.tp, pp=r.pp, vpp=r.vpp, cp=r.cp, ep=r.ep,
                               mbs=r.mbs, **r.settings)
            v = layout_violations(model, training, lay, r.gpus,
                                  Choices(recompute=list(r.recompute)), cluster)
            assert not v, (r.name, precision, v)


def test_each_ep_transfer_hides_only_behind_its_partner_block():
    """Merged 1F1B overlaps forward dispatch with the MLP backward, backward dispatch with the
    MLP forward, and the two combines with the attention passes: the exposed EP time is at
    least what the attention passes leave uncovered of the combines, even where the layer as a
    whole has compute to spare."""
    from moeplan.cost_models.layers import attention_block
    from moeplan.cost_models.overlap import exposed_time

    m = load_model("qwen3-235b-a22b")
    c = load_cluster("h100", gpus=256)
    t = TrainingSpec(seq_len=4096, global_batch_size=2048)
    lay = Layout.build(256, 2048, tp=2, pp=8, vpp=4, ep=32, ep_overlap=True)
    ctx = make_context(m, c, t, lay, default_calibration())
    lc, at = moe_layer(ctx), attention_block(ctx, False)
    ep_exposed = lc.exposed_fwd_s + lc.exposed_bwd_s - lc.tp_s  # TP exposed at most tp_s
    combines = exposed_time(lc.ep_s / 4, at.fwd) + exposed_time(lc.ep_s / 4, at.bwd)
    assert combines > 0 and ep_exposed >= combines
    pooled = exposed_time(lc.ep_s, lc.fwd_s + lc.bwd_s, ctx.cal.ep_overlap_hidden)
    assert lc.exposed_fwd_s + lc.exposed_bwd_s >= pooled


def test_a_26_06_row_whose_sizes_contradict_its_recipe_is_not_given_the_recipes_overlap():
    """Kimi-K2's 26.06 MXFP8 recipe runs MBS 1 with EP overlap; a 26.06 row printed at MBS 2
    ran another revision, so neither that recipe nor the 26.06 rule prices it."""
    from moeplan.specs import list_presets

    presets = list_presets()
    over = dict(model_preset="kimi-k2", gpu="GB300", cluster_preset="gb300-nvl72", pp="4",
                vpp="4", ep="64", source_detail="docs; release 26.06 NeMo container")
    ran = case_of(_bridge(**over), presets)
    assert ran.assumed["recipe"] == "KIMI_K2_PRETRAIN_CONFIG_GB300_FP8_MX"
    assert ran.layout.ep_overlap and ran.layout.cuda_graphs
    other = case_of(_bridge(**over, micro_batch="2"), presets)
    assert "recipe" not in other.assumed
    assert not other.layout.ep_overlap and other.layout.dispatcher == "alltoall"


STACKS = ("current", "mcore-2024", "megatron-2023", "megatron-2022", "megatron-2021")


def _est(model, cluster, layout, stack, seq=4096, gbs=256):
    """The layout as the stack runs it: without the distributed optimizer before it existed."""
    from moeplan.specs.rules import stack_lacks

    tr = TrainingSpec(seq_len=seq, global_batch_size=gbs, software_stack=stack)
    layout = layout.model_copy(update={"distributed_optimizer": layout.distributed_optimizer
                                       and not stack_lacks(stack, "distributed_optimizer")})
    return estimate(model, cluster, tr, layout, with_interval=False)


def test_each_older_stack_is_no_faster_than_the_newer_one():
    """The stacks are generations: each lacks what the next adds, so a step never gets faster
    going back in time, and the features bite where they apply (MoE layers from Megatron
    Core, the `mcore-2024` stack on)."""
    cases = [(load_model("gpt-oss-120b"), load_cluster("gb200-nvl72", 64),
              Layout.build(64, 256, ep=64, mbs=1)),
             (load_model("qwen3-30b-a3b"), load_cluster("h100", 16), Layout.build(16, 256, ep=16)),
             (LLAMA, H100, Layout.build(64, 256, tp=8, pp=2))]
    for model, cluster, layout in cases:
        stacks = STACKS if not model.is_moe else STACKS[:2]
        t = [_est(model, cluster, layout, s).step_time_s for s in stacks]
        assert t == sorted(t), (model.name, t)
    moe = [_est(*cases[1], s).step_time_s for s in ("current", "mcore-2024")]
    dense = [_est(*cases[2], s).step_time_s for s in ("megatron-2023", "megatron-2022")]
    assert moe[1] > moe[0] and dense[1] > dense[0]


def test_sink_attention_runs_unfused_before_cudnn_9_13_1():
    """gpt-oss's learnable sinks: TE's fused cuDNN kernel takes them from cuDNN 9.13.1, else
    TE runs UnfusedDotProductAttention, which keeps every query-key score for backward."""
    oss, c = load_model("gpt-oss-120b"), load_cluster("gb200-nvl72", 64)
    lay = Layout.build(64, 256, ep=64, mbs=1)

    def kept(stack):
        tr = TrainingSpec(seq_len=4096, global_batch_size=256, software_stack=stack)
        return dense_layer(make_context(oss, c, tr, lay, default_calibration())
                           ).activation_bytes()

    scores = oss.num_attention_heads * 4096 * 4096 * 2  # bf16 probabilities, one sequence
    assert kept("mcore-2024") - kept("current") == pytest.approx(scores)


def test_stacks_before_2024_wait_for_the_whole_backward_to_reduce_gradients():
    from moeplan.cost_models.estimate import step_extras

    lay = Layout.build(64, 256, tp=8)  # dp 8
    cal = default_calibration()

    def extras(stack):
        tr = TrainingSpec(seq_len=4096, global_batch_size=256, software_stack=stack)
        return step_extras(LLAMA, H100, tr, lay, cal, dense_params=1e9, expert_params=0.0,
                           fwd_window_s=1.0, bwd_window_s=2.0)

    old, new = extras("megatron-2023"), extras("mcore-2024")
    assert old.dp_exposed_s == pytest.approx(old.reduce_scatter_s + old.all_gather_s)
    assert new.dp_exposed_s < old.dp_exposed_s


@pytest.mark.parametrize(("stack", "fusions", "overlap"), [
    ("current", True, True), ("mcore-2024", False, True), ("megatron-2023", False, False)])
def test_the_export_runs_the_stack_the_plan_was_priced_on(stack, fusions, overlap):
    """Megatron turns on neither the MoE router and permutation fusions nor the data-parallel
    overlap by default; a plan priced with them exports them, one priced without them does not,
    so the exported job is the one priced."""
    from moeplan.planner.export import to_megatron_args

    tr = TrainingSpec(seq_len=4096, global_batch_size=256, software_stack=stack)
    moe = stack in ("current", "mcore-2024")  # MoE layers came with Megatron Core
    plan = Plan(model=load_model("mixtral-8x7b" if moe else "llama3-8b"), cluster=H100,
                training=tr, choices=Choices(),
                layout=Layout.build(64, 256, tp=2, ep=8 if moe else 1))  # dp 32, dist-opt
    argv, warn = to_megatron_args(plan)
    # a plan priced on an older stack says whose flags the launch carries
    assert any(f"priced on the {stack} software stack" in w for w in warn) == (
        stack != "current")
    assert ("--moe-router-fusion" in argv) == fusions == ("--moe-permute-fusion" in argv)
    assert ("--overlap-grad-reduce" in argv) == overlap == ("--overlap-param-gather" in argv)
    assert plan.training.fused_moe_kernels == fusions
    assert plan.training.dp_comm_overlap == overlap
    one_replica = plan.model_copy(update={"layout": Layout.build(16, 256, tp=2, pp=8,
                                                                  ep=2 if moe else 1)})
    assert one_replica.layout.dp == 1 and (one_replica.layout.edp == 1 or not moe)
    assert "--overlap-grad-reduce" not in to_megatron_args(one_replica)[0]


def test_published_rows_are_priced_on_the_stack_their_source_ran():
    stack = {c.row["source"].split(" (")[0].split(" et al")[0]: c.training.software_stack
             for _, c in published_cases()}
    assert stack["Narayanan"] == "megatron-2021"
    assert stack["MegaScale"] == "megatron-2023"
    assert stack["NVIDIA Megatron-Bridge performance summary"] == "current"


def test_the_stack_is_a_command_line_setting(capsys):
    from moeplan.cli import main
    from moeplan.specs.training import STACKS, SoftwareStack

    assert tuple(STACKS) == SoftwareStack.__args__  # one line of words per stack, newest first
    args = ["estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "16", "--gbs",
            "64", "--ep", "16"]
    assert main([*args, "--stack", "MCORE-2024"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"software stack mcore-2024: {STACKS['mcore-2024']}" in out  # stated, in words
    for command in (args, ["search", *args[1:9]], ["whatif", *args[1:7], "--tokens", "1e9"]):
        assert main([*command, "--stack", "megatron-2019"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "--stack 'megatron-2019' is not a software stack" in err, err
        assert "Did you mean megatron-2021" in err and "Traceback" not in err


def test_every_estimate_names_its_stack_among_its_assumptions():
    """The stack an estimate assumes is one of its named assumptions, validated by the fit
    rows that ran it: today's stack by Megatron-Bridge's, Megatron-LM 2022's by none (its
    Table 5 runs are scored apart, bench/korthikanti_table5.py)."""
    lay = Layout.build(64, 256, tp=8, distributed_optimizer=False)  # one every stack runs

    def stack_term(stack):
        tr = TrainingSpec(seq_len=4096, global_batch_size=256, software_stack=stack)
        terms = [a for a in estimate(LLAMA, H100, tr, lay).assumptions
                 if a.term.startswith("software stack ")]
        assert len(terms) == 1
        return terms[0]

    now, old = stack_term("current"), stack_term("megatron-2022")
    assert now.validated and "fit rows" in now.evidence and "Megatron Core" in now.term
    assert not old.validated and "megatron-2022" in old.evidence


def test_a_csv_of_ones_own_runs_names_their_stack_in_a_software_stack_column():
    """A `software_stack` cell prices the row on that stack, over what its source implies; a
    stack the row's layout could not have run, or a name moeplan does not know, skips the row
    with the reason."""
    from moeplan.validation import validate_rows

    recipes = Path(__file__).resolve().parents[1] / "bench/data/megatron_lm_moe_recipes.csv"
    row = next(r for r in read_rows(str(recipes)) if r["id"] == "MLR11")  # Qwen3-30B, H100
    priced = {}
    for stack in ("", "current", "MCORE-2024"):
        res = validate_rows([{**row, "software_stack": stack}])
        priced[stack] = res["rows"][0]["predicted_tokens_per_s_per_gpu"]
    assert priced[""] == priced["current"] > priced["MCORE-2024"]  # unfused router, permute
    for stack, why in (("megatron-2023", "stack_model"), ("2019", "not a software stack")):
        res = validate_rows([{**row, "software_stack": stack}])
        assert not res["rows"] and why in res["skipped"][0]["why"]


def test_a_search_on_an_older_stack_plans_only_what_that_stacks_megatron_ran():
    """mcore-2024 (Megatron Core 0.12) had the flex dispatcher only with DeepEP and no EP
    overlap: its search prunes EP overlap by that rule, names DeepEP in every flex plan, and
    says which stack it priced; the current stack's search may use both."""
    from moeplan.planner.search import search_space

    model, cluster = load_model("qwen3-30b-a3b"), load_cluster("h100", gpus=32)
    old = TrainingSpec(seq_len=4096, global_batch_size=256, software_stack="mcore-2024")
    res = search(model, cluster, old, 32, top_k=5, time_limit_s=60)
    assert res.pruned["stack_ep_overlap"] > 0
    for p in res.plans:
        assert p.training.software_stack == "mcore-2024" and not p.layout.ep_overlap
        assert p.layout.dispatcher != "flex" or p.layout.flex_backend == "deepep"
        assert check_layout(p.model, p.training, p.layout, 32, p.choices, p.cluster) is None
    assert any("priced on the mcore-2024 software stack" in x for x in res.plans[0].explanation)
    now = search_space(cluster, "bf16", "megatron")
    assert now.flex_backend == "hybridep" and now.allow_ep_overlap
    assert search_space(cluster, "bf16", "megatron", "mcore-2024").flex_backend == "deepep"
    dense = search_space(cluster, "auto", "megatron", "megatron-2022")
    assert dense.precisions == ("bf16",) and not dense.tp_comm_overlap and not dense.cuda_graphs
    assert not dense.allow_dist_opt and search_space(cluster, "auto", "megatron",
                                                     "megatron-2023").allow_dist_opt
    assert search_space(cluster, "auto", "moeplan", "megatron-2022").allow_dist_opt
    assert search_space(load_cluster("gb200-nvl72", gpus=32), "auto", "megatron",
                        "mcore-2024").precisions == ("bf16", "mxfp8")


def test_a_whatif_prices_every_point_on_the_stack_it_was_given():
    from moeplan import whatif

    res = whatif("llama3-8b", "h100", [16], tokens=1e9, stack="megatron-2023", workers=1)
    assert res.to_json()["software_stack"] == "megatron-2023"
    plans = [p.plan for p in res.points if p.plan]
    assert plans and all(p.training.software_stack == "megatron-2023" and p.layout.cp == 1
                         and not p.layout.tp_comm_overlap and not p.layout.cuda_graphs
                         for p in plans)


@pytest.mark.parametrize("notes, settings", [
    ("DeepEP dispatcher; EP A2A overlap; CUDA graphs",
     {"dispatcher": "flex", "flex_backend": "deepep", "ep_overlap": True, "cuda_graphs": True}),
    ("w/o EP overlap, alltoall dispatcher", {"dispatcher": "alltoall", "ep_overlap": False}),
    ("no CUDA graphs; HybridEP", {"dispatcher": "flex", "flex_backend": "hybridep",
                                  "cuda_graphs": False}),
    ("CUDA graphs disabled", {"cuda_graphs": False}),
    ("DP/TP/PP/CP overlap enabled", {"tp_comm_overlap": True}),
    ("1F1B A2A overlap (--overlap-moe-expert-parallel-comm)", {"ep_overlap": True}),
    ("DeepEP dispatcher; +1f1b overlap", {"dispatcher": "flex", "flex_backend": "deepep",
                                          "ep_overlap": True}),  # Megatron-MoE-ModelZoo
    ("A2A dispatcher; intra-node EP strategy", {"dispatcher": "alltoall"}),
    ("dispatcher: A2A", {"dispatcher": "alltoall"}),
    ("Dispatcher=DeepEP; A2A_OVERLAP=0", {"dispatcher": "flex", "flex_backend": "deepep",
                                          "ep_overlap": False}),
    ("A2A_OVERLAP=1", {"ep_overlap": True}),
    ("interleaved 1F1B with 6 virtual stages", {}),  # a pipeline schedule, not EP overlap
    ("MoE benchmarks force-balance tokens across experts, dropless", {}),
    ("pipeline step overlap with the optimizer", {}),  # "ep" inside a word is not EP
])
def test_a_rows_own_text_documents_its_dispatcher_overlaps_and_graphs(notes, settings):
    from moeplan.validation.rules import documented_settings

    assert documented_settings({"other_notes": notes}) == settings


def test_a_row_that_documents_deepep_and_graphs_is_cased_with_them():
    from moeplan.specs import list_presets

    presets = list_presets()
    row = next(r for r in read_rows() if r["id"] == "R0601")  # Mixtral, MoE README, H100
    plain = case_of({**row, "other_notes": "dropless"}, presets)
    told = case_of({**row, "other_notes": "dropless; DeepEP dispatcher; CUDA graphs"}, presets)
    assert (plain.layout.dispatcher, plain.layout.cuda_graphs) == ("alltoall", False)
    assert (told.layout.dispatcher, told.layout.cuda_graphs) == ("flex", True)
    assert told.assumed["dispatcher"] == "flex"  # recorded with the case's assumptions


def test_bridge_token_drop_rows_are_cased_padded_to_capacity_with_their_matrix_graphs():
    """Megatron-Bridge's 25.09 token-drop runs (`apply_moe_token_drop`: capacity factor 1,
    inputs padded, alltoall) are priced so, with CUDA graphs where its performance matrix ran
    them; the same sizes without the variant note stay dropless."""
    from moeplan.specs import list_presets

    presets = list_presets()
    rows = {r["id"]: r for r in read_rows()}
    b200, h100 = case_of(rows["R0284"], presets), case_of(rows["R0292"], presets)  # qwen3-30b
    for case in (b200, h100):
        t = case.training
        assert t.moe_capacity_factor == 1.0 and t.static_moe_shapes
        assert case.layout.dispatcher == "alltoall"
    assert b200.layout.cuda_graphs and not h100.layout.cuda_graphs
    plain = case_of({**rows["R0284"], "other_notes": "dropless"}, presets)
    assert plain.training.moe_capacity_factor is None and not plain.training.static_moe_shapes


def test_padding_to_capacity_is_refused_by_the_runtime_and_named():
    t = TrainingSpec(seq_len=4096, global_batch_size=64, moe_capacity_factor=1.0,
                     moe_pad_expert_input_to_capacity=True)
    plan = Plan(model=load_model("qwen3-30b-a3b"), cluster=load_cluster("h100", gpus=16),
                training=t, layout=Layout.build(16, 64, ep=8))
    refused = features_not_executed(plan)
    assert len(refused) == 1 and "moe_pad_expert_input_to_capacity: false" in refused[0]
    with pytest.raises(ValueError, match="moe_capacity_factor"):
        TrainingSpec(global_batch_size=64, moe_pad_expert_input_to_capacity=True)


def test_a_capacity_caps_the_busiest_rank_and_padding_computes_the_whole_capacity():
    """Dropping cuts the busiest expert at its capacity (faster than the imbalance it would
    carry); padding makes every expert compute its whole capacity, however routing spread."""
    model, cluster = load_model("qwen3-30b-a3b"), load_cluster("b200", gpus=8)
    lay = Layout.build(8, 512, ep=8, mbs=8)  # device-bound: the routed work shows

    def speed(cf, pad, imbalance):
        t = TrainingSpec(seq_len=4096, global_batch_size=512, precision="mxfp8",
                         moe_capacity_factor=cf, moe_pad_expert_input_to_capacity=pad)
        return estimate(model, cluster, t, lay, Choices(), imbalance=imbalance,
                        with_interval=False).tokens_per_s_per_gpu

    assert speed(1.1, False, 1.3) > speed(None, False, 1.3)
    assert speed(1.1, False, 1.0) == speed(None, False, 1.0)
    assert speed(1.1, True, 1.0) == speed(1.1, True, 1.3) < speed(None, False, 1.0)
    assert speed(1.5, True, 1.0) < speed(1.1, True, 1.0)


def test_a_search_on_a_stack_before_the_distributed_optimizer_replicates_the_optimizer():
    """Megatron-LM took --use-distributed-optimizer in June 2022: plans on the 2021 and 2022
    stacks replicate the optimizer, without layouts the rules would only refuse; the same
    layout built from options on those stacks is the same, and a plan file that asks for it
    is refused naming the plan's field."""
    from moeplan.api import plan_from_options
    from moeplan.planner.export import export

    tr = TrainingSpec(seq_len=4096, global_batch_size=256, software_stack="megatron-2021")
    res = search(LLAMA, H100, tr, 64, top_k=3, time_limit_s=60)
    assert res.plans and not any(p.layout.distributed_optimizer for p in res.plans)
    assert "stack_distributed_optimizer" not in res.pruned
    plan = plan_from_options("llama3-8b", "h100", 16, 4096, 256, axes={"tp": 2},
                             software_stack="megatron-2022")
    assert not plan.layout.distributed_optimizer
    assert plan_from_options("llama3-8b", "h100", 16, 4096, 256, axes={"tp": 2},
                             software_stack="megatron-2023").layout.distributed_optimizer
    sharded = plan.model_copy(update={"layout": plan.layout.model_copy(
        update={"distributed_optimizer": True})})
    with pytest.raises(LayoutError, match="a plan file's layout: distributed_optimizer false"):
        export(sharded)


CPU_HOST = {  # what `moeplan calibrate` writes on a CPU machine of two processes
    "name": "host", "gpu": "test-cpu", "architecture": "cpu", "bf16_tflops": 0.5,
    "fp32_tflops": 0.16, "hbm_gb": 12, "hbm_tb_s": 0.02, "nvlink_gb_s": 0.8,
    "nvlink_domain_gpus": 2, "gpus_per_node": 2, "scaleout_gb_s": 0.8,
    "nvlink_latency_us": 250.0, "scaleout_latency_us": 250.0, "host_memory_gb": 12,
    "host_link_gb_s": 17.0,
    "calibration": {"gemm_eff_max": {"cpu": 0.37}, "gemm_half_dim": 18.0,
                    "attn_fwd_eff": {"cpu": 1.2}, "attn_bwd_eff": {"cpu": 1.2},
                    "tp_overlap_hidden": 0.0, "ep_overlap_hidden": 0.0,
                    "layer_overhead_s": 5e-4, "step_overhead_s": 1e-3},
}


def test_a_cpu_host_is_searched_without_cuda_graphs_or_tp_comm_overlap():
    """A CPU has no CUDA kernel to capture and no userbuffers: its search never turns the two
    CUDA settings on (where it ranked only `cuda-graphs` plans, priced with the launches the
    graphs remove and their memory), and a layout asking for them is refused by rule."""
    from moeplan.planner.search import search_space
    from moeplan.specs import ClusterSpec

    from .conftest import DATA

    host = ClusterSpec.model_validate(CPU_HOST)
    space = search_space(host, "bf16", "megatron")
    assert not space.cuda_graphs and not space.tp_comm_overlap
    model = load_model(DATA / "tiny_qwen3_moe.yaml")
    tr = TrainingSpec(seq_len=128, global_batch_size=8)
    res = search(model, host, tr, 2, top_k=20)
    assert res.plans and not any(p.layout.cuda_graphs or p.layout.tp_comm_overlap
                                 for p in res.plans)
    graphed = Layout.build(2, 8, tp=2, cuda_graphs=True, tp_comm_overlap=True)
    for target in ("megatron", "moeplan"):
        with pytest.raises(LayoutError) as e:
            check_layout(model, tr, graphed, 2, Choices(), host.with_gpus(2), target)
        assert {n for n, _ in e.value.violations} >= {"cuda_graphs_need_cuda",
                                                      "tp_comm_overlap_needs_cuda"}
    check_layout(model, tr, graphed, 2, Choices(), load_cluster("h100", gpus=2))


@pytest.mark.parametrize("flags, named", [(("--cuda-graphs",), "--cuda-graphs"),
                                          (("--tp", "2", "--tp-comm-overlap"),
                                           "--tp-comm-overlap")])
def test_a_cuda_setting_asked_of_a_cpu_host_exits_2_naming_its_flag(tmp_path, flags, named):
    import yaml

    from .conftest import DATA, run_cli

    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(CPU_HOST))
    proc = run_cli("estimate", "--model", str(DATA / "tiny_qwen3_moe.yaml"), "--cluster",
                   str(path), "--gpus", "2", "--seq", "128", "--gbs", "8", *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    said = " ".join(proc.stderr.split())
    assert named in said and "CPU host" in said and len(proc.stderr.strip().splitlines()) == 1
