"""The published runs moeplan validates against ship inside the package, with their sources,
so `moeplan validate` and every test read the same copy in any clone or install."""

import csv
import json
from importlib import resources

import pytest

from moeplan.cli import main
from moeplan.validation import read_rows, shipped_runs


def test_shipped_data_carries_the_runs_the_hardware_and_their_sources():
    data = resources.files("moeplan.validation") / "data"
    names = {p.name for p in data.iterdir()}
    assert {"published_runs.csv", "hardware.csv", "README.md"} <= names
    rows = read_rows()
    assert len(rows) > 400 and all(r["source"] for r in rows)  # every row names its source
    with (data / "hardware.csv").open() as f:
        hw = list(csv.DictReader(f))
    assert hw and all(r["source"] for r in hw)
    assert "flops_convention" in (data / "README.md").read_text()


def test_validate_without_a_file_reads_the_shipped_published_runs(capsys):
    assert main(["validate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ids = {r["id"] for r in doc["rows"]} | {s["id"] for s in doc["skipped"]}
    assert ids == {r["id"] for r in read_rows(shipped_runs())}


def _cases(ids):
    from moeplan.validation.crossval import cases_of

    return {c.id: c for c in cases_of([r for r in read_rows() if r["id"] in ids])}


def test_a_tuned_row_without_its_virtual_pipeline_size_is_priced_at_the_fastest_valid_one():
    """Parallel Folding's strong-scaling rows say their layout is the tuned optimum and print no
    VPP: each profile prices them at the fastest size Megatron accepts (a divisor of the layers
    per stage), which at 1,024 GPUs (8 micro-batches over PP4) is an interleaved one, and never
    slower than the uninterleaved layout the row would otherwise be read as."""
    from moeplan.cost_models.estimate import estimate
    from moeplan.validation.scoring import cluster_of, predict_case, priced_layout

    case = _cases({"R0485"})["R0485"]
    assert case.layout.vpp == 1 and [a.vpp for a in case.alternatives] == [7]
    assert "tuned" in case.assumed["vpp"]
    chosen = priced_layout(case)
    assert chosen.vpp == 7
    plain = estimate(case.model, cluster_of(case), case.training, case.layout, case.choices,
                     with_interval=False).tokens_per_s_per_gpu
    row = predict_case(case)
    assert row["vpp"] == 7 and row["predicted_tokens_per_s_per_gpu"] > 1.2 * plain


def test_a_tuned_row_is_priced_at_the_fastest_virtual_pipeline_size_that_fits_in_memory():
    """The Parallel Folding paper's tuned Llama3-8x70B layout (R0453: TP 8, PP 8, EP 4 on 256
    H100, VPP unprinted) ran on 80 GB GPUs: of the sizes Megatron accepts, VPP 2 is priced
    fastest but with a peak over what the GPU holds (HBM less the reserve), a layout that could
    not have run, so the row is read at the fastest size whose priced peak is under it. The
    bound is the GPU's, not the planner's margin: Mixtral-8x22B-G8T8's tuned row (R0451) keeps
    a size priced inside the GPU yet over the margin a plan keeps."""
    from moeplan.cost_models.calibration import calibration_for
    from moeplan.cost_models.estimate import estimate
    from moeplan.validation.scoring import cluster_of, priced_layout

    def read(rid):
        case = _cases({rid})[rid]
        cluster = cluster_of(case)
        room = cluster.hbm_gb - calibration_for(cluster.calibration).reserve_gb
        priced = {lay.vpp: estimate(case.model, cluster, case.training, lay, case.choices,
                                    with_interval=False) for lay in case.layouts()}
        return priced, room, priced_layout(case).vpp

    priced, room, chosen = read("R0453")
    quickest = max(priced, key=lambda v: priced[v].tokens_per_s_per_gpu)
    assert priced[quickest].memory.peak_gb > room            # the fastest size cannot run
    assert chosen != quickest and priced[chosen].memory.peak_gb <= room
    assert priced[chosen].tokens_per_s_per_gpu == max(
        e.tokens_per_s_per_gpu for e in priced.values() if e.memory.peak_gb <= room)

    priced, room, chosen = read("R0451")
    assert not priced[chosen].fits and priced[chosen].memory.peak_gb <= room
    assert priced[chosen].tokens_per_s_per_gpu == max(
        e.tokens_per_s_per_gpu for e in priced.values())


def test_a_row_that_prints_its_virtual_pipeline_size_or_tuned_nothing_has_no_alternatives():
    """A Bridge row publishes its VPP; a Parallel Folding long-context row does not say it was
    tuned: both are priced as published."""
    cases = _cases({"R0194", "R0526"})
    assert cases["R0194"].alternatives == () and cases["R0194"].layout.vpp == 4
    assert cases["R0526"].alternatives == ()


def _external(name):
    from pathlib import Path

    return read_rows(Path(__file__).parent.parent / "bench" / "data" / name)


def test_a_rows_documented_modules_offloads_layout_and_numerics_are_priced_as_written():
    """What a run's recipe documents is read, not assumed: the selective modules in Megatron's
    words, the offloaded modules, the --pipeline-model-parallel-layout, the FP8 parameter
    gather and the bf16 Adam moments (Megatron-LM's DeepSeek-V3 GB200 recipe)."""
    from moeplan.specs import list_presets
    from moeplan.validation import case_of

    row = next(r for r in _external("megatron_lm_moe_recipes.csv") if r["id"] == "MLR02")
    case = case_of(row, list_presets())
    assert case.choices.for_rank(0) == (["mla_up_proj"], ["expert_fc1"])
    assert case.choices.stage_layout == "Et*4|(tttt|)*14tmL"
    assert case.training.fp8_param_gather and case.training.optimizer_moments_dtype == "bf16"
    assert (case.layout.dispatcher, case.layout.ep_overlap, case.layout.cuda_graphs) == (
        "flex", True, True)
    plain = case_of({**row, "recompute": "selective", "other_notes": ""}, list_presets())
    assert plain.choices.for_rank(0) == (["core_attn"], []) and plain.choices.stage_layout is None
    assert not plain.training.fp8_param_gather


def test_megatron_bridge_fp8_rows_gather_fp8_parameters_as_their_recipe_does():
    """Megatron-Bridge's performance scripts run `bf16_with_mxfp8_mixed` and
    `bf16_with_fp8_current_scaling_mixed`, both with fp8_param_gather, in every release; the
    rows were priced with bf16 gathers and bf16 weights beside their quantized copies, so a run
    that ran was priced above its GPU's memory (Qwen3-30B-A3B MXFP8 on GB300, R0007: 292 GB on
    288; Llama3-405B FP8 current scaling on H100, R0087: 85.5 GB on 80)."""
    rows = {r["id"]: r for r in read_rows()}
    cases = _cases({"R0007", "R0087", "R0200", "R0107", "R0038"})
    assert cases["R0007"].training.fp8_param_gather  # MXFP8
    assert cases["R0087"].training.fp8_param_gather  # FP8 current scaling
    assert cases["R0200"].training.fp8_param_gather  # Kimi-K2 26.02: Adam
    assert not cases["R0107"].training.fp8_param_gather  # Kimi-K2 26.04: Muon turns it off
    assert not cases["R0038"].training.fp8_param_gather  # NVFP4: FP4 gathers, not priced so
    assert rows["R0107"]["precision_preset"] == "mxfp8"
    from moeplan.validation.scoring import cluster_of, predict_case

    for c in (cases["R0007"], cases["R0087"]):
        assert predict_case(c)["predicted_memory_gb"] < cluster_of(c).hbm_gb


@pytest.mark.parametrize("cell, modules", [
    ("norm, act", ["layernorm", "moe_act"]),            # Megatron-MoE-ModelZoo's words
    ("norm, act, shared_expert", ["layernorm", "moe_act", "shared_experts"]),
    ("selective: layernorm moe", ["layernorm", "moe"]),
    ("selective activation checkpointing", ["core_attn"]),  # "activation" is not "act"
    ("full activation recomputation", ["full"]),
    ("", []),
])
def test_a_recompute_cell_naming_modules_in_its_sources_words_is_read_as_those_modules(
        cell, modules):
    from moeplan.validation.cases import published_recompute

    assert published_recompute({"recompute": cell}).for_rank(0)[0] == modules


def test_model_zoo_layouts_no_fit_saw_are_read_as_documented_and_ordered_as_measured():
    """Megatron-MoE-ModelZoo's Qwen3-235B-A22B runs (in no fit): each is read as its table and
    command document it (dispatcher, the 1F1B EP overlap, offloads, the recompute modules in
    its words), the four H100 layouts are priced in the order their step times were measured,
    and the H100 long-context runs gain TFLOPS with the sequence as measured."""
    from moeplan.specs import list_presets
    from moeplan.validation import case_of, validate_rows

    rows = _external("modelzoo_qwen3.csv")
    cases = {r["id"]: case_of(r, list_presets()) for r in rows}
    assert isinstance(cases["MZQ03"], str) and "FSDP" in cases["MZQ03"]  # not modelled
    assert isinstance(cases["MZQ13"], str)  # Qwen3-Next-80B-A3B: no preset
    recompute, offload = cases["MZQ11"].choices.for_rank(0)
    assert cases["MZQ11"].layout.ep_overlap  # A2A_OVERLAP=1
    assert sorted(recompute) == ["layernorm", "moe_act"] and offload == ["expert_fc1", "moe_act"]
    one, two, deep = cases["MZQ01"], cases["MZQ02"], cases["MZQ04"]
    assert (one.layout.dispatcher, one.layout.flex_backend, one.layout.ep_overlap) == (
        "flex", "deepep", False)
    assert two.layout.ep_overlap and deep.layout.dispatcher == "alltoall"
    assert one.choices.for_rank(0)[0] == ["layernorm", "moe_act"]
    out = {r["id"]: r for r in validate_rows(rows)["rows"]}

    def order(key):
        return sorted(("MZQ01", "MZQ02", "MZQ04", "MZQ05"), key=lambda i: -out[i][key])

    assert order("predicted_tokens_per_s_per_gpu") == order("published_tokens_per_s_per_gpu")
    tflops = [out[f"MZQ0{i}"]["predicted_tflops_per_gpu"] for i in (6, 7, 8, 9)]
    assert tflops == sorted(tflops) and tflops[-1] > 1.2 * tflops[0]


def test_megatron_lms_own_recipes_no_fit_saw_are_priced_within_20_percent():
    """Megatron-LM's MoE recipes (examples/moe_recipes) and its DeepSeek-V3 GB200 optimisation
    steps are in no fit: each is priced with the settings its recipe documents, the recipes
    within 20% MAPE, and the last optimisation step, which runs the stack every estimate
    assumes, within 10%; a router-only graph scope prices no attention graphs."""
    from moeplan.validation import validate_rows

    def priced(name):
        out = validate_rows(_external(name))
        assert not out["skipped"]
        return ({r["id"]: r["predicted_tokens_per_s_per_gpu"]
                 / r["published_tokens_per_s_per_gpu"] - 1 for r in out["rows"]},
                {r["id"]: r["assumed"] for r in out["rows"]})

    err, assumed = priced("megatron_lm_moe_recipes.csv")
    assert len(err) == 14 and sum(map(abs, err.values())) / len(err) <= 0.20
    assert assumed["MLR04"]["cuda_graphs"] is False
    err, assumed = priced("deepseek_v3_gb200_steps.csv")
    assert len(err) == 13 and abs(err["DSG12"]) <= 0.10
    assert assumed["DSG00"]["dispatcher"] == "alltoall"
    assert assumed["DSG05"]["cuda_graphs"] and not assumed["DSG04"]["cuda_graphs"]
