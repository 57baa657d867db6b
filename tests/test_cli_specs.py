"""The CLI surface of `moeplan specs` and the error contract (exit 2, one paragraph, no traceback)."""

from __future__ import annotations

import json

import pytest

from moeplan.specs import list_presets

from .conftest import DATA

MODEL_PRESETS = ["deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b", "qwen2-57b-a14b",
                 "mixtral-8x7b", "mixtral-8x22b", "llama3-8b", "llama3-70b", "llama3-405b",
                 "gpt3-175b", "gpt-oss-120b", "llama2-7b", "llama2-13b", "llama2-70b",
                 "gpt3-5b", "gpt3-20b", "nemotron4-15b", "nemotron4-340b"]
CLUSTER_PRESETS = ["a100-80g", "h100", "h200", "h800", "b200", "b300", "gb200-nvl72",
                   "gb300-nvl72"]


def test_specs_list_json_lists_every_preset(cli):
    r = cli("specs", "list", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(MODEL_PRESETS) <= set(doc["models"])
    assert set(CLUSTER_PRESETS) <= set(doc["clusters"])


def test_specs_show_deepseek_derived_counts(cli):
    r = cli("specs", "show", "deepseek-v3", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kind"] == "model" and doc["name"] == "deepseek-v3"
    assert isinstance(doc["derived"]["total_params"], int)
    assert abs(doc["derived"]["total_params"] / 671e9 - 1) <= 0.015
    assert abs(doc["derived"]["active_params"] / 37e9 - 1) <= 0.04


def test_specs_show_cluster_and_hf_config(cli):
    from moeplan.cli import main

    assert main(["specs", "show", "gb200-nvl72", "--json"]) == 0
    assert main(["specs", "show", str(DATA / "hf" / "qwen3-30b-a3b.json"), "--json"]) == 0


def test_what_specs_show_json_writes_reads_back_as_the_spec_it_shows(tmp_path, capsys):
    from moeplan.cli import main

    shown = {}
    for ref in ("h100", "mixtral-8x7b", str(DATA / "hf" / "qwen3-30b-a3b.json")):
        assert main(["specs", "show", ref, "--json"]) == 0
        text = capsys.readouterr().out
        path = tmp_path / f"{json.loads(text)['name']}.json"
        path.write_text(text)
        shown[ref] = path
        assert main(["specs", "validate", str(path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["kind"] == json.loads(text)["kind"]
        assert main(["specs", "show", str(path), "--json"]) == 0
        assert capsys.readouterr().out == text  # the same document, shown again

    def step(model: str, cluster: str) -> float:
        assert main(["estimate", "--model", model, "--cluster", cluster, "--gpus", "8",
                     "--gbs", "64", "--ep", "8", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["step_time_s"]

    assert step(str(shown["mixtral-8x7b"]), str(shown["h100"])) == step("mixtral-8x7b", "h100")
    # a cluster's document given as the model: refused, saying where it goes
    assert main(["estimate", "--model", str(shown["h100"]), "--cluster", "h100", "--gpus", "8",
                 "--gbs", "64"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{shown['h100']} holds a cluster spec" in err and "(--cluster FILE)" in err
    assert "Traceback" not in err


def test_a_spec_kind_is_told_by_a_field_only_that_kind_has(tmp_path):
    from moeplan.cli import main
    from moeplan.specs.loader import document_kind, ref_kind

    assert document_kind({"model": {}, "cluster": {}, "layout": {}}) == "plan"
    assert document_kind({"name": "x", "bf16_tflops": 1.0}) == "cluster"
    assert document_kind({"global_batch_size": 8}) == "training"
    assert document_kind({"model_type": "qwen3_moe"}) == document_kind([1]) == "model"
    assert ref_kind("h100") == "cluster" and ref_kind("deepseek-v3") == "model"
    assert ref_kind(DATA / "hf" / "qwen3-30b-a3b.json") == "model"
    plan = tmp_path / "p.json"
    assert main(["search", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "8",
                 "--gbs", "64", "--top", "1", "-o", str(plan)]) == 0
    assert ref_kind(plan) == "plan"
    assert ref_kind("no-such-name") == "model"  # the model loader then names the presets


def test_cluster_presets_are_every_cluster_preset_by_memory():
    from moeplan.specs.loader import cluster_presets

    clusters = cluster_presets()
    assert {c.name for c in clusters} == set(list_presets()["clusters"]) >= set(CLUSTER_PRESETS)
    assert [c.hbm_gb for c in clusters] == sorted(c.hbm_gb for c in clusters)


def test_every_cluster_preset_keeps_its_sources():
    from moeplan import load_cluster

    for name in list_presets()["clusters"]:
        c = load_cluster(name)
        assert c.sources, name
        assert c.name == name


def test_measured_matmul_ceilings_sit_below_the_datasheet_and_name_their_source():
    """A GPU preset's MAMF figures are measurements below its datasheet peaks, with their
    source; a hostile ceiling is refused with the field named."""
    import pytest
    from pydantic import ValidationError

    from moeplan import load_cluster

    measured = 0
    for name in list_presets()["clusters"]:
        c = load_cluster(name)
        if not c.mamf_tflops:
            continue
        measured += 1
        assert "mamf_tflops" in c.sources, name
        assert c.mamf_tflops["bf16"] < c.bf16_tflops, name
        if "fp8" in c.mamf_tflops:
            assert c.mamf_tflops["bf16"] < c.mamf_tflops["fp8"] < c.fp8_tflops, name
        assert c.mamf("mxfp8") == c.mamf_tflops.get("fp8") and c.mamf("nvfp4") is None
    assert measured >= 6
    base = load_cluster("h100").model_dump()
    for bad in ({"bf16": -1.0}, {"bf16": float("inf")}, {"fp4": 100.0}):
        with pytest.raises(ValidationError, match="mamf_tflops"):
            type(load_cluster("h100")).model_validate({**base, "mamf_tflops": bad})


def _assert_clean_error(r, *words):
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_unknown_preset_exits_2(cli):
    _assert_clean_error(cli("specs", "show", "nope-7b"), "nope-7b", "Presets")


@pytest.mark.parametrize("args,noun", [(("specs", "show", ""), "model"),
                                       (("specs", "validate", " "), "path"),
                                       (("search", "--model", "", "--cluster", "h100", "--gpus",
                                         "8"), "model"),
                                       (("search", "--model", "llama3-8b", "--cluster", "",
                                         "--gpus", "8"), "cluster")])
def test_an_empty_name_is_called_empty_with_the_presets_not_a_directory(cli, args, noun):
    r = cli(*args)
    _assert_clean_error(r, f"the {noun} name is empty" if noun != "path" else "path is empty")
    assert "directory" not in r.stderr
    if noun != "path":
        assert ("llama3-8b" if noun == "model" else "h100") in r.stderr  # the presets


def test_bad_yaml_exits_2(cli, tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("num_layers: [1,\n")
    _assert_clean_error(cli("specs", "validate", str(p)), "not valid YAML")


@pytest.mark.parametrize("text,problem,where", [
    ("name: x\nfoo: @bar\n", "found character '@' that cannot start any token",
     "line 2 column 6"),
    ("name: x\nnum_layers: 2\n  hidden: [1, 2\n", "mapping values are not allowed here",
     "line 3 column 9"),
])
def test_a_yaml_syntax_error_names_the_problem_and_its_line_and_column(cli, tmp_path, text,
                                                                       problem, where):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    _assert_clean_error(cli("specs", "validate", str(p)), "not valid YAML", problem, where)


@pytest.mark.parametrize("field,value,word", [
    ("hidden_size", -5, "hidden_size"),
    ("num_layers", 2.5, "num_layers"),
    ("num_kv_heads", 3, "num_kv_heads"),
    ("hidden_sise", 64, "hidden_sise"),
])
def test_invalid_model_file_names_the_field(cli, tmp_path, field, value, word):
    import yaml

    spec = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                vocab_size=100)
    spec[field] = value
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(spec))
    _assert_clean_error(cli("specs", "validate", str(p)), word)


def test_unknown_flag_value_exits_2(cli):
    r = cli("specs", "show", "deepseek-v3", "--seq", "abc")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_unsupported_hf_architecture_exits_2(cli):
    _assert_clean_error(cli("specs", "show", str(DATA / "unsupported-arch.json")),
                        "not supported")


def test_debug_flag_shows_traceback(cli):
    r = cli("--debug", "specs", "show", "nope-7b")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_specs_validate_accepts_a_good_file(cli):
    r = cli("specs", "validate", str(DATA / "hf" / "mixtral-8x7b.json"), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["valid"] is True


def test_cli_starts_fast_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys, moeplan.cli; "
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_layout_errors_name_every_broken_rule(cli):
    r = cli("estimate", "--model", "qwen3-235b-a22b", "--cluster", "h100", "--gpus", "64",
            "--seq", "4096", "--gbs", "64", "--ep", "3")
    _assert_clean_error(r, "[experts_divisible_by_ep]", "[expert_world_size]")
