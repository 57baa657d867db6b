"""`moeplan estimate` and `moeplan validate`: JSON shape (SPEC §4), exit codes, plan output."""

import csv
import json
import re
import resource
import subprocess
import sys

import pytest

from moeplan.cli import main
from moeplan.validation import flops_per_token_in, predict_case, split_of, validate_rows

EST_ARGS = ["estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "16",
            "--seq", "4096", "--gbs", "64", "--ep", "8", "--pp", "2", "--json"]


def run_cli(args, capsys):
    code = main(args)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_estimate_json_shape(capsys):
    code, out, _ = run_cli(EST_ARGS, capsys)
    assert code == 0
    doc = json.loads(out)
    assert {"step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "memory", "time",
            "bottleneck", "fits", "warnings"} <= doc.keys()
    assert set(doc["memory"]) == {"peak_gb", "weights_gb", "grads_gb", "optimizer_gb",
                                  "activations_gb", "buffers_gb", "margin_gb", "headroom_gb",
                                  "host_gb"}
    iv = doc["interval"]
    assert iv["level"] == 0.8
    assert iv["tokens_per_s_per_gpu"][0] < doc["tokens_per_s_per_gpu"] < iv[
        "tokens_per_s_per_gpu"][1]
    assert iv["step_time_s"][0] < doc["step_time_s"] < iv["step_time_s"][1]
    assert doc["assumptions"] and all(set(a) == {"term", "validated", "evidence"}
                                      for a in doc["assumptions"])
    assert set(doc["time"]) == {"compute_s", "tp_comm_s", "cp_comm_s", "ep_comm_s", "dp_comm_s",
                                "pp_bubble_s", "recompute_s", "offload_s", "exposed_comm_s"}
    assert doc["step_time_s"] > 0 and isinstance(doc["fits"], bool)


def test_estimate_writes_plan_and_reads_it_back(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    code, out, _ = run_cli([*EST_ARGS, "--recompute", "moe_act", "-o", str(plan)], capsys)
    assert code == 0
    written = json.loads(plan.read_text())
    assert written["choices"]["recompute"] == [["moe_act"]]  # one set for every rank
    assert written["layout"]["ep"] == 8 and written["estimate"]["fits"] in (True, False)
    code, out2, _ = run_cli(["estimate", str(plan), "--json"], capsys)
    assert code == 0
    assert json.loads(out2)["step_time_s"] == json.loads(out)["step_time_s"]


def test_a_searched_plan_keeps_its_explanation_until_the_estimate_changes(tmp_path, capsys):
    """The search's "why this plan" (vpp, overlap, the runner-up margin) describes the estimate
    it was written with; an edited plan file re-estimated must not carry it into a report."""
    searched, same, edited = (tmp_path / n for n in ("s.json", "same.json", "edited.json"))
    code, _, _ = run_cli(["search", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus",
                          "16", "--gbs", "64", "--top", "2", "-o", str(searched)], capsys)
    assert code == 0 and json.loads(searched.read_text())["explanation"]
    code, _, err = run_cli(["estimate", str(searched), "-o", str(same)], capsys)
    assert code == 0 and "dropped" not in err
    assert json.loads(same.read_text())["explanation"] == json.loads(
        searched.read_text())["explanation"]
    doc = json.loads(searched.read_text())
    doc["layout"]["mbs"], doc["layout"]["num_microbatches"] = (
        doc["layout"]["mbs"] * 2, doc["layout"]["num_microbatches"] // 2)
    searched.write_text(json.dumps(doc))
    code, _, err = run_cli(["estimate", str(searched), "-o", str(edited)], capsys)
    assert code == 0 and "search explanation was dropped" in err
    assert json.loads(edited.read_text())["explanation"] == []


def test_a_searched_plan_without_its_estimate_says_so_not_that_the_estimate_differs(tmp_path,
                                                                                   capsys):
    searched = tmp_path / "s.json"
    code, _, _ = run_cli(["search", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus",
                          "16", "--gbs", "64", "--top", "2", "-o", str(searched)], capsys)
    doc = json.loads(searched.read_text())
    assert code == 0 and doc.pop("estimate") and doc["explanation"]
    searched.write_text(json.dumps(doc))
    code, _, err = run_cli(["estimate", str(searched)], capsys)
    assert code == 0 and "records no estimate" in err and "differs" not in err


def test_search_json_that_nothing_fits_is_one_document_on_stdout(capsys):
    """Exit 3 is a proof, and a script reading --json gets it as JSON, the paragraph on stderr
    as ever; weights that alone overflow get no FP8 hint (FP8 shrinks activations only)."""
    code, out, err = run_cli(["search", "--model", "deepseek-v3", "--cluster", "h100",
                              "--gpus", "8", "--json"], capsys)
    assert code == 3
    doc = json.loads(out)
    assert doc["plans"] == [] and doc["infeasible"] is True
    assert "weights and gradients alone" in doc["message"] and "infeasible:" in err
    assert "FP8" not in doc["message"]


def test_validate_says_why_a_row_has_no_published_figure_and_counts_the_scored_rows(capsys):
    code, out, _ = run_cli(["validate"], capsys)
    assert code == 0
    assert "- published: the row gives no tokens/s/GPU and no TFLOPS" in " ".join(out.split())
    assert re.search(r"All rows scored: MAPE tokens/s/GPU [\d.]+% over the [\d,]+ with a",
                     " ".join(out.split()))


def test_a_plan_priced_at_an_imbalance_is_estimated_again_at_it(tmp_path, capsys):
    """`search --imbalance 1.5 -o` then `estimate PLAN.json` gave the balanced step time, and
    the plan listed "balanced routing" as what it assumed."""
    plan = tmp_path / "p.json"
    code, _, _ = run_cli([*EST_ARGS, "--imbalance", "1.5", "-o", str(plan)], capsys)
    assert code == 0
    priced = json.loads(plan.read_text())["estimate"]
    assert priced["imbalance"] == 1.5
    terms = [a["term"] for a in priced["assumptions"]]
    assert "balanced routing" not in terms and any("imbalance 1.5×" in t for t in terms)
    code, out, _ = run_cli(["estimate", str(plan), "--json"], capsys)
    assert code == 0 and json.loads(out)["step_time_s"] == priced["step_time_s"]
    code, out, _ = run_cli(["estimate", str(plan), "--imbalance", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["step_time_s"] < priced["step_time_s"]
    # a plan file written before the field: priced balanced, and said so
    doc = json.loads(plan.read_text())
    del doc["estimate"]["imbalance"]
    plan.write_text(json.dumps(doc))
    code, _, err = run_cli(["estimate", str(plan)], capsys)
    assert code == 0 and "does not record the routing it was priced at" in err


def test_a_tiny_models_rates_show_their_digits_not_zero(capsys, tmp_path):
    """A test-sized model's 0.00128 TFLOPS printed as `0 (MFU 0.0%)`, the search table's as 0
    beside an MFU that was not: small rates keep three significant digits."""
    from .conftest import DATA

    args = ["--model", str(DATA / "tiny_qwen3_moe.yaml"), "--cluster", "h100", "--gpus", "2",
            "--seq", "64", "--gbs", "4"]
    assert main(["estimate", *args, "--ep", "2", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert main(["estimate", *args, "--ep", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("TFLOPS"))
    assert f"{est['tflops_per_gpu']:.3g} (MFU {est['mfu'] * 100:.2g}% of" in line
    assert main(["search", *args, "--report", str(tmp_path / "r.md")]) == 0
    table = capsys.readouterr().out
    assert re.search(r" 0\.\d+ +\d", table) and " 0 " not in table
    # the report's table of plans says what the terminal says
    rows = [x for x in (tmp_path / "r.md").read_text().splitlines() if x.startswith("| #")]
    assert rows and not [x for x in rows if "| 0 |" in x or "| 0.0% |" in x], rows


def test_not_fitting_layout_exits_zero(capsys):
    code, out, _ = run_cli(["estimate", "--model", "deepseek-v3", "--cluster", "h100", "--gpus",
                            "64", "--seq", "4096", "--gbs", "64", "--ep", "64", "--json"], capsys)
    assert code == 0 and json.loads(out)["fits"] is False


def test_invalid_layout_exits_two(capsys):
    code, out, err = run_cli([*EST_ARGS[:-1], "--ep", "3", "--json"], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "not divisible by ep=3" in err


def test_invalid_inputs_exit_two(capsys):
    assert run_cli(["estimate", "--model", "qwen3-30b-a3b", "--json"], capsys)[0] == 2
    assert run_cli([*EST_ARGS, "--recompute", "everything"], capsys)[0] == 2
    assert run_cli([*EST_ARGS, "--stage-layout", "Ett|L"], capsys)[0] == 2
    assert run_cli([*EST_ARGS, "--imbalance", "0.5"], capsys)[0] == 2
    code, _, err = run_cli([*EST_ARGS, "--dispatcher", "foo"], capsys)
    assert code == 2 and "dispatcher" in err and "Traceback" not in err
    assert run_cli(["validate", "no-such.csv"], capsys)[0] == 2


DENSE_ARGS = ["estimate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8", "--seq",
              "4096", "--gbs", "8", "--tp", "8"]


@pytest.mark.parametrize(("flags", "said"), [
    (["--recompute", "moe_act", "--offload", "expert_fc1"], "--recompute and --offload"),
    (["--dispatcher", "flex"], "drop --dispatcher"),
    (["--flex-backend", "deepep"], "is a dense model, with no experts for a token dispatcher "
     "to send tokens to; drop --flex-backend")])
def test_an_option_the_layout_would_ignore_exits_two_naming_its_flag(flags, said, capsys,
                                                                      tmp_path):
    """MoE-only options on a dense model, and a flex backend without the flex dispatcher, were
    kept (and exported) or dropped without a word."""
    out = tmp_path / "dense.json"
    code, _, err = run_cli([*DENSE_ARGS, *flags, "-o", str(out)], capsys)
    assert code == 2 and "Traceback" not in err and not out.exists()
    assert said in " ".join(err.split()) and len(err.strip().splitlines()) == 1
    code, _, err = run_cli([*EST_ARGS[:-1], "--flex-backend", "deepep", "--json"], capsys)
    assert code == 2 and "--flex-backend deepep" in err and "add --dispatcher flex" in err
    code, _, _ = run_cli([*EST_ARGS[:-1], "--dispatcher", "flex", "--flex-backend", "deepep",
                          "--json"], capsys)
    assert code == 0


def test_explicit_stage_layout_is_used(capsys):
    # qwen3-30b-a3b has 48 layers; pp 2, all but one layer on the second stage is slower
    code, even, _ = run_cli(EST_ARGS, capsys)
    lopsided = "Et|" + "t" * 47 + "L"
    code2, skew, _ = run_cli([*EST_ARGS, "--stage-layout", lopsided], capsys)
    assert code == code2 == 0
    assert json.loads(skew)["step_time_s"] > json.loads(even)["step_time_s"]


def test_cli_start_up_and_estimate_under_two_seconds():
    # CPU seconds of the child (start-up, imports, estimate, JSON), so that other work on a
    # busy test machine does not count against it
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, "-m", "moeplan.cli", *EST_ARGS], capture_output=True,
                       text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0, r.stderr
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 2.0
    json.loads(r.stdout)


COLS = ["id", "gpu", "num_gpus", "precision", "seq_len", "global_batch_seqs", "micro_batch",
        "tp", "pp", "vpp", "cp", "ep", "etp", "dp", "other_notes", "tflops_per_gpu", "mfu",
        "tokens_per_s_per_gpu", "memory_gb", "model_preset", "cluster_preset",
        "precision_preset", "flops_convention"]


def write_runs(path):
    rows = [
        {"id": "A1", "gpu": "H100-SXM", "num_gpus": "8", "seq_len": "8192",
         "global_batch_seqs": "128", "micro_batch": "1", "tp": "1", "pp": "1",
         "other_notes": "FSDP=0 (>0: Megatron-FSDP sharding size; 0: DDP)",
         "tokens_per_s_per_gpu": "12000", "model_preset": "llama3-8b", "cluster_preset": "h100",
         "precision_preset": "fp8-tensorwise", "flops_convention": "causal_halved"},
        {"id": "A2", "gpu": "H100-SXM", "num_gpus": "8", "seq_len": "8192",
         "global_batch_seqs": "128", "micro_batch": "1", "tp": "1", "pp": "1",
         "other_notes": "FSDP=8 (>0: Megatron-FSDP sharding size; 0: DDP)",
         "tokens_per_s_per_gpu": "12000", "model_preset": "llama3-8b", "cluster_preset": "h100",
         "precision_preset": "bf16", "flops_convention": "causal_halved"},
        {"id": "A3", "model_preset": "", "cluster_preset": "h100", "num_gpus": "8"},
        {"id": "A4", "gpu": "H100-SXM", "num_gpus": "16", "seq_len": "4096",
         "global_batch_seqs": "64", "micro_batch": "1", "tp": "1", "pp": "2", "ep": "8",
         "mfu": "0.3", "model_preset": "qwen3-30b-a3b", "cluster_preset": "h100",
         "precision_preset": "bf16", "flops_convention": "full"},
    ]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLS)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def test_validate_json_shape_and_skips(tmp_path, capsys):
    runs = tmp_path / "runs.csv"
    write_runs(runs)
    code, out, _ = run_cli(["validate", str(runs), "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert {"rows", "mape_tokens_per_s", "skipped"} <= doc.keys()
    assert [r["id"] for r in doc["rows"]] == ["A1", "A4"]
    skipped = {s["id"]: s["why"] for s in doc["skipped"]}
    assert "FSDP" in skipped["A2"] and "model preset" in skipped["A3"]
    row = doc["rows"][0]
    assert {"id", "predicted_tokens_per_s_per_gpu", "published_tokens_per_s_per_gpu",
            "predicted_tflops_per_gpu", "published_tflops_per_gpu", "predicted_memory_gb",
            "published_memory_gb"} <= row.keys()
    # A4 publishes only MFU in the `full` convention: tokens/s derived by that convention
    a4 = doc["rows"][1]
    assert a4["published_tflops_per_gpu"] == 0.3 * 989
    assert a4["tokens_derived_from_tflops"] is True


def test_flop_conventions_ordered():
    from moeplan.specs import load_model

    m = load_model("llama3-70b")
    ours = flops_per_token_in(m, 8192, "causal_halved")
    full = flops_per_token_in(m, 8192, "full")
    assert ours == m.flops_per_token(8192) < full < flops_per_token_in(m, 8192,
                                                                       "full_with_recompute")
    # the causal s² term of llama3-70b: 6·L·a·d·s per token is what `full` adds back
    assert full - ours == 6 * 80 * 64 * 128 * 8192
    assert flops_per_token_in(m, 8192, "unknown") is None


def test_split_is_by_configuration_not_by_row():
    a = {"id": "X1", "model_preset": "llama3-8b", "cluster_preset": "h100", "tp": "1"}
    b = {**a, "id": "X2", "tokens_per_s_per_gpu": "1"}  # re-publication of the same config
    assert split_of(a) == split_of(b)
    assert validate_rows([])["rows"] == []


def _bridge_row(release: str, **over: str) -> dict[str, str]:
    row = {"id": "B1", "source": "NVIDIA Megatron-Bridge performance summary",
           "source_detail": f"docs; release {release} NeMo container; DGX-GB200", "gpu": "GB200",
           "num_gpus": "8", "seq_len": "4096", "global_batch_seqs": "512", "micro_batch": "4",
           "tp": "1", "pp": "1", "ep": "8", "tokens_per_s_per_gpu": "30000",
           "model_preset": "qwen3-30b-a3b", "cluster_preset": "gb200-nvl72",
           "precision_preset": "mxfp8", "flops_convention": "causal_halved"}
    return {**row, **over}


def test_bridge_mxfp8_moe_rows_from_26_06_are_priced_with_their_recipe_ep_overlap():
    """The 26.06 MXFP8 MoE recipes overlap EP communication and capture CUDA graphs (over the
    whole iteration where the recipe does); earlier
    releases, BF16, dense models and layouts Megatron would refuse the overlap for keep
    moeplan's defaults."""
    from moeplan.specs import list_presets
    from moeplan.validation import case_of, release_of

    presets = list_presets()
    late = case_of(_bridge_row("26.06"), presets)
    assert release_of(late.row) == (26, 6)
    assert late.layout.ep_overlap and late.layout.dispatcher == "flex"
    for row in (_bridge_row("26.04.01"),
                _bridge_row("26.08", precision_preset="bf16", micro_batch="2"),  # no recipe's
                _bridge_row("26.08", model_preset="llama3-8b", ep=""),
                _bridge_row("26.08", source="NVIDIA NeMo 2.0 performance summary"),
                _bridge_row("26.08", num_gpus="16", pp="2")):      # pp 2 without vpp
        case = case_of(row, presets)
        assert not case.layout.ep_overlap and case.layout.dispatcher == "alltoall", row
    # the overlap hides EP time, so the same row predicts faster with it
    early = case_of(_bridge_row("26.04.01"), presets)
    seen, plain = predict_case(late), predict_case(early)
    assert seen["predicted_tokens_per_s_per_gpu"] > plain["predicted_tokens_per_s_per_gpu"]
    # the same recipes' gradient reduction, and MXFP8's parameter gather (`get_precision_config`)
    bf16_grads = {"grad_reduce_dtype": "bf16", "fp8_param_gather": True}
    # Qwen3-30B-A3B on GB200: the recipe captures the whole iteration and runs the fused
    # grouped MLP (validation.rules)
    assert seen["assumed"] == {"ep_overlap": True, "dispatcher": "flex", "cuda_graphs": True,
                               "cuda_graph_scope": "full_iteration", "fused_grouped_mlp": True,
                               **bf16_grads}
    assert plain["assumed"] == bf16_grads


def test_shipped_fit_reads_every_scored_row_and_only_those(tmp_path):
    """The shipped calibration is fitted on every row that publishes a throughput (the honest
    figures come from cross-validation refits, which leave rows out); rows with nothing to
    score are not fitted."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "fit_calibration.py"
    spec = importlib.util.spec_from_file_location("fit_calibration", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    runs = tmp_path / "runs.csv"
    write_runs(runs)
    base = [r for r in csv.DictReader(runs.open()) if r["id"] in ("A1", "A4")]
    rows = [{**r, "id": f"{r['id']}-{g}", "global_batch_seqs": str(g)}
            for r in base for g in (64, 128, 256)]
    silent = {**rows[0], "id": "no-figure", "tokens_per_s_per_gpu": "", "tflops_per_gpu": "",
              "mfu": ""}
    cases = mod.fit_cases(rows + [silent])
    assert {c.id for c in cases} == {r["id"] for r in rows}


def test_rows_naming_a_preset_architecture_are_scored_with_it():
    """The shared CSV leaves `model_preset` empty where no preset existed; a row whose `model`
    names one (NeMo's spelling) is predicted with it and split by it, and an unnamed one is
    still skipped."""
    from moeplan.specs import list_presets
    from moeplan.validation import case_of, config_key

    row = {"id": "N1", "source": "NVIDIA NeMo performance summary (NeMo 24.07)",
           "model": "LLAMA2-7B", "gpu": "H100-SXM", "num_gpus": "8", "seq_len": "4096",
           "global_batch_seqs": "128", "micro_batch": "1", "tp": "1", "pp": "1",
           "tokens_per_s_per_gpu": "16934", "model_preset": "", "cluster_preset": "h100",
           "precision_preset": "fp8-tensorwise", "flops_convention": "full"}
    case = case_of(row, list_presets())
    assert case.model.name == "llama2-7b" and case.family == "llama2"
    assert config_key(row).startswith("llama2-7b|")
    assert case_of({**row, "model": "Nemotron-22B"}, list_presets()) == "no model preset"


def test_grad_reduce_flag_prices_bf16_reduction_and_refuses_other_dtypes(capsys):
    base = ["estimate", "--model", "llama3-70b", "--cluster", "h100", "--gpus", "64",
            "--gbs", "256", "--tp", "8", "--json"]
    code, out, _ = run_cli(base, capsys)
    fp32 = json.loads(out)
    code2, out2, _ = run_cli(base + ["--grad-reduce", "bf16"], capsys)
    bf16 = json.loads(out2)
    assert code == code2 == 0
    assert bf16["memory"]["grads_gb"] == pytest.approx(fp32["memory"]["grads_gb"] / 2)
    assert bf16["time"]["dp_comm_s"] < fp32["time"]["dp_comm_s"]
    code, _, err = run_cli(base + ["--grad-reduce", "fp16"], capsys)
    assert code == 2 and "`--grad-reduce`" in err and "Traceback" not in err


# ------------------------------------------------------- which rows are evidence
def _shipped(rid: str) -> dict[str, str]:
    from moeplan.validation import read_rows

    return dict(next(r for r in read_rows(None) if r["id"] == rid))


def test_validate_calls_a_row_fit_only_when_the_shipped_calibration_was_fitted_on_that_run(
        tmp_path, capsys):
    """The shipped calibration saw every shipped run, so its error on them is in sample: a
    copy of one (under any id) is a fit row; the same layout published with another figure is
    a run no fit saw, and only such rows make the held-out summary."""
    seen = {**_shipped("R0001"), "id": "COPY"}
    new = {**_shipped("R0001"), "id": "NEW",
           "tokens_per_s_per_gpu": str(round(float(seen["tokens_per_s_per_gpu"]) * 0.8))}
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, list(seen))
        w.writeheader()
        w.writerows([seen, new])
    code, out, _ = run_cli(["validate", str(path), "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    split = {r["id"]: r["split"] for r in doc["rows"]}
    assert split == {"COPY": "fit", "NEW": "held-out"}
    row = next(r for r in doc["rows"] if r["id"] == "NEW")
    err = abs(row["predicted_tokens_per_s_per_gpu"] / row["published_tokens_per_s_per_gpu"] - 1)
    un = doc["unseen"]
    assert un["rows"] == un["tokens_rows"] == 1 and un["tflops_only_rows"] == 0
    assert un["mape_tokens_per_s"] == pytest.approx(err)
    assert doc["mape_tokens_per_s_held_out"] == pytest.approx(err)
    # the fit rows' evidence is the cross-validation, quoted from the shipped profile
    lomo = doc["cross_validated"]["leave_one_model_out"]
    assert 0 < lomo["mape"] < 0.15 and lomo["rows"] >= 200


def _pred(rid, pub, pred, model="m", family="hopper", derived=False, split="held-out"):
    return {"id": rid, "split": split, "model": model, "gpu_family": family,
            "precision": "bf16", "published_tokens_per_s_per_gpu": pub,
            "predicted_tokens_per_s_per_gpu": pred, "tokens_derived_from_tflops": derived,
            "predicted_interval_tokens_per_s_per_gpu": [0.8 * pred, 1.2 * pred]}


def test_the_held_out_summary_flags_a_model_gpu_family_off_as_a_whole_and_parts_tflops_rows():
    """A group of two or more rows of one model on one GPU family whose mean error passes
    ±30% is off as a whole, however good the MAPE over the rest; one row alone is no group.
    Rows that publish only TFLOPS are scored apart from rows that publish tokens/s."""
    from moeplan.validation.scoring import unseen_summary

    rows = [_pred("a", 100, 140, "x"), _pred("b", 100, 135, "x"),     # x on Hopper: +37.5%
            _pred("c", 100, 140, "x", "blackwell-hgx"),               # alone: no group
            _pred("d", 100, 110, "y"), _pred("e", 100, 90, "y"),     # y: mean 0
            _pred("f", 100, 95, "y", derived=True),
            _pred("g", 100, 500, "z", split="fit"), _pred("h", 100, 500, "z", split="fit")]
    empty = {"by_split": {"held-out": {"pairs": 0, "ordered": 0, "ordered_within_step_bar": 0}}}
    un = unseen_summary(rows, empty)
    assert [(g["model"], g["gpu_family"]) for g in un["families_off"]] == [("x", "hopper")]
    assert {(g["model"], g["gpu_family"]) for g in un["family_groups"]} == {
        ("x", "hopper"), ("y", "hopper")}                           # the fit rows' z is not
    assert un["rows"] == 6 and un["tokens_rows"] == 5 and un["tflops_only_rows"] == 1
    assert un["mape_tokens_per_s"] == pytest.approx((0.4 + 0.35 + 0.4 + 0.1 + 0.1) / 5)
    assert un["mape_tflops_only"] == pytest.approx(0.05)
    assert un["coverage"] == pytest.approx(3 / 6)  # ±20% bands miss the three +35-40% rows


def test_a_layout_pair_counts_as_told_apart_only_when_its_ratio_is_priced_within_20_percent():
    """Ordering two layouts right is half of it: the planner must price the gap the hardware
    measured. A pair measured 1.65x apart and priced 1.24x is ordered but not told apart."""
    from moeplan.validation.scoring import layout_pairs

    base = {"model_preset": "m", "cluster_preset": "h100", "num_gpus": "64",
            "precision_preset": "bf16", "seq_len": "4096", "source": "S"}
    raw = {k: {**base, "id": k, "tp": tp} for k, tp in (("a", "1"), ("b", "2"), ("c", "4"))}
    rows = [_pred("a", 100, 100), _pred("b", 165, 124), _pred("c", 130, 125)]
    for r in rows:
        r["model"] = "m"
    out = layout_pairs(rows, raw)
    # b over a priced 1.24x against 1.65x measured: ordered, not told apart; c over a 1.25x
    # against 1.30x: both; b over c 0.99x against 1.27x: misordered
    assert (out["pairs"], out["ordered"], out["ordered_within_step_bar"]) == (3, 2, 1)
    assert out["by_split"]["held-out"] == {"pairs": 3, "ordered": 2,
                                           "ordered_within_step_bar": 1}


def test_throughput_must_move_with_sequence_length_the_way_it_was_measured():
    """Long context: as the sequence (and the GPUs, and CP) grows, measured TFLOPS/GPU rose
    where a model that gets attention wrong has them fall. A step counts when its predicted
    change has the measured sign, and is near when its ratio is within 20% too; rows at one
    length count as their mean, and another release or model is another series."""
    from moeplan.validation.scoring import sequence_steps

    def row(rid, seq, gpus, pub, pred, source="S"):
        r = _pred(rid, 1000.0, 1000.0)
        r.update(model="m", published_tflops_per_gpu=pub, predicted_tflops_per_gpu=pred)
        return r, {"id": rid, "seq_len": str(seq), "num_gpus": str(gpus),
                   "cluster_preset": "h100", "source": source, "source_detail": ""}

    pts = [row("a", 16384, 8, 400, 400), row("b", 32768, 16, 450, 380),   # rose, priced down
           row("c", 65536, 32, 500, 470), row("d", 65536, 32, 520, 490),  # mean 510 vs 480
           row("e", 131072, 64, 530, 505),
           row("x", 4096, 8, 300, 300, "T"), row("y", 8192, 8, 330, 340, "T")]
    rows, raw = [r for r, _ in pts], {w["id"]: w for _, w in pts}
    out = sequence_steps(rows, raw)
    # S: 16K→32K against (1.125 measured, 0.95 priced); 32K→64K 1.133 vs 1.263 (near);
    # 64K→128K 1.039 vs 1.052 (near); T: 4K→8K 1.10 vs 1.133 (near)
    assert (out["steps"], out["moves_as_measured"], out["within_step_bar"]) == (4, 3, 3)
    assert out["against"][0]["seq"] == [16384, 32768]
