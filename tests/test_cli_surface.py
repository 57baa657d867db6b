"""The CLI's surface a new user meets: complete Megatron exports (schedule, context length,
placeholders), model names from Hugging Face configs, `--version`, help on every option."""

from __future__ import annotations

import json
import subprocess

import click
import pytest
import typer

import moeplan
from moeplan import Layout, Plan, TrainingSpec, load_cluster, load_model
from moeplan.cli import app
from moeplan.planner.export import export, to_megatron_args

from .conftest import DATA, run_cli


def _flags(argv: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    key = ""
    for tok in argv:
        if tok.startswith("--"):
            key = tok
            out[key] = []
        else:
            out[key].append(tok)
    return out


def qwen_plan(**training: object) -> Plan:
    return Plan(model=load_model("qwen3-30b-a3b"), cluster=load_cluster("h100", 8),
                training=TrainingSpec(seq_len=4096, global_batch_size=64, **training),
                layout=Layout.build(8, 64, ep=8))


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(qwen_plan(lr_warmup_iters=20, lr_decay_iters=1000).model_dump_json())
    return path


def test_train_iters_5000_writes_a_schedule_inside_5000_iterations(cli, plan_file):
    r = cli("export", str(plan_file), "--train-iters", "5000", "--json")
    assert r.returncode == 0, r.stderr
    f = _flags(json.loads(r.stdout)["args"])
    assert f["--train-iters"] == ["5000"]
    warm, decay = int(f["--lr-warmup-iters"][0]), int(f["--lr-decay-iters"][0])
    assert warm == 100  # the spec's 20 of 1,000 steps, as the same 2 % of 5,000
    assert 0 < warm < decay <= 5000


def test_train_tokens_become_iterations_at_the_plans_batch():
    doc = export(qwen_plan(), train_tokens=1e9)
    assert doc["schedule"]["train_iters"] == -(-10**9 // (4096 * 64))  # ceil: 3,815
    with pytest.raises(moeplan.SpecError, match="not both"):
        export(qwen_plan(), train_iters=10, train_tokens=1e9)
    with pytest.raises(moeplan.SpecError, match="positive"):
        export(qwen_plan(), train_tokens=float("nan"))
    with pytest.raises(moeplan.SpecError, match="--format megatron"):
        export(qwen_plan(), "slurm", train_iters=10)


def test_megatron_export_uses_the_models_context_length_and_marks_what_to_supply(cli,
                                                                                 plan_file):
    f = _flags(to_megatron_args(qwen_plan())[0])
    assert f["--max-position-embeddings"] == ["40960"]  # the config's, not --seq-length 4096
    assert f["--data-path"] == ["${DATA_PATH:?}"] and f["--save"] == f["--load"]
    text = cli("export", str(plan_file)).stdout
    head = [line for line in text.split("\n") if line.startswith("#")]
    for var in ("DATA_PATH", "TOKENIZER_MODEL", "CHECKPOINT_DIR"):
        assert any(var in line for line in head)
    # the launch is valid shell: an unset placeholder stops it with the variable's name
    # before torchrun starts (the first placeholder of the command line is the data's)
    r = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "DATA_PATH: parameter null or not set" in r.stderr


def test_hf_config_takes_the_models_name(tmp_path):
    cfg = json.loads((DATA / "hf" / "qwen3-30b-a3b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert load_model(str(path)).name == "qwen3_moe-30.5b"  # architecture and size
    path.write_text(json.dumps({**cfg, "_name_or_path": "Qwen/Qwen3-30B-A3B"}))
    assert load_model(str(path)).name == "Qwen3-30B-A3B"
    path.write_text(json.dumps({**cfg, "_name_or_path": "x;$(touch y)\n#"}))
    assert load_model(str(path)).name == "x-touch-y"  # safe in titles and job names


def test_version_and_help_on_every_option():
    assert run_cli("--version").stdout.strip() == f"moeplan {moeplan.__version__}"
    missing = []

    def walk(cmd: click.Command, path: str) -> None:
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden and not p.help:
                missing.append(f"{path} {p.opts[0]}")
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "moeplan")
    assert not missing, missing


def test_whatif_help_shows_the_tokens_default_as_written_not_as_fourteen_digits():
    r = run_cli("whatif", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "15000000000000" not in text and "15e12" in text


def test_run_json_is_one_document_on_stdout(cli, tmp_path):
    plan = tmp_path / "small.json"
    r = cli("estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "2",
            "--gbs", "8", "--ep", "2", "-o", str(plan))
    assert r.returncode == 0, r.stderr
    r = cli("run", str(plan), "--steps", "2", "--scale-down", "--out", str(tmp_path / "run"),
            "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)  # the workers' step lines went to stderr
    assert doc["measured"]["step_time_s"] > 0 and "step    2/2" in r.stderr


# ------------------------------------------------------------------------------ --report
def test_report_path_is_refused_before_the_search(cli, tmp_path):
    r = cli("search", "--model", "deepseek-v3", "--cluster", "h100", "--gpus", "1024",
            "--report", str(tmp_path / "plan.txt"), timeout=30)
    assert r.returncode == 2 and ".html" in r.stderr and "Traceback" not in r.stderr
