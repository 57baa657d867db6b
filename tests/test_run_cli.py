"""`moeplan run` end to end: real torchrun launches, the output files, and the refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from moeplan.specs import (
    Choices,
    ClusterSpec,
    Estimate,
    Interval,
    Layout,
    MemoryBreakdown,
    Plan,
    TimeBreakdown,
    TrainingSpec,
    load_cluster,
    load_model,
)

from .conftest import DATA, run_cli_without_torch

SPEC_KEYS = {"step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tflops_per_gpu",
             "peak_mem_gb"}


ESTIMATE = Estimate(step_time_s=0.5, tokens_per_s_per_gpu=128.0, tflops_per_gpu=1.0, mfu=0.1,
                    memory=MemoryBreakdown(peak_gb=1.0, weights_gb=0.1, grads_gb=0.1,
                                           optimizer_gb=0.2, activations_gb=0.5, buffers_gb=0.1),
                    time=TimeBreakdown(compute_s=0.4), bottleneck="compute", fits=True)


def write_plan(path, world: int, model: str = "tiny_qwen3_moe", estimate: Estimate | None = None,
               choices: Choices | None = None, **axes) -> str:
    training = TrainingSpec(seq_len=32, global_batch_size=4, lr=1e-2, warmup_steps=1)
    plan = Plan(model=load_model(DATA / f"{model}.yaml"), cluster=load_cluster("h100", gpus=world),
                training=training, layout=Layout.build(world, 4, **axes), estimate=estimate,
                choices=choices or Choices())
    path.write_text(plan.model_dump_json())
    return str(path)


@pytest.mark.slow
def test_run_writes_spec_outputs_and_appends_metrics(cli, tmp_path):
    out = tmp_path / "run"
    plan = write_plan(tmp_path / "tp2ep2.json", 2, estimate=ESTIMATE, tp=2, ep=2)
    r = cli("run", plan, "--steps", "5", "--out", str(out), "--seed", "7", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert all(row.keys() >= SPEC_KEYS for row in rows)
    assert all(isinstance(row["peak_mem_gb"], float) and row["peak_mem_gb"] > 0 for row in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # the synthetic stream is learnable at once
    spec = load_model(DATA / "tiny_qwen3_moe.yaml")
    routing = json.loads((out / "routing.json").read_text())
    moe_layers = [i for i, m in enumerate(spec.moe_layers()) if m]
    assert [layer["layer"] for layer in routing["layers"]] == moe_layers
    for layer in routing["layers"]:
        assert len(layer["tokens_per_expert"]) == spec.num_experts
        assert sum(layer["tokens_per_expert"]) == 5 * 4 * 32 * spec.moe_top_k
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["measured"]["step_time_s"] > 0
    assert summary["predicted"]["step_time_s"] == 0.5  # measured next to the plan's forecast
    assert summary["numa_bound"] is None  # a CPU run: no GPU to be bound near
    assert "step time" in r.stderr and "loss" in r.stderr  # progress and the summary table

    # a second run into the same directory appends; the world-1 plan gives the same losses
    single = write_plan(tmp_path / "single.json", 1)
    r2 = cli("run", single, "--steps", "2", "--out", str(out), "--seed", "7", timeout=300)
    assert r2.returncode == 0, r2.stderr[-3000:]
    rows2 = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows2) == 7
    for a, b in zip(rows2[5:], rows[:2], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def _summary_of(plan: Plan, step_s: float) -> dict:
    """The summary rank 0 writes for three CPU steps of `step_s` seconds under `plan`."""
    import torch

    from moeplan.runtime.launch import RunOptions
    from moeplan.runtime.train import StepMetrics
    from moeplan.runtime.worker import _summary

    history = [StepMetrics(step=i, loss=5.0, grad_norm=1.0, lr=1e-3, step_time_s=step_s,
                           tokens_per_s=1.0, tflops_per_gpu=1.0, peak_mem_gb=0.3)
               for i in (1, 2, 3)]
    return _summary(plan, plan, history, [0.3, 0.3], torch.device("cpu"), torch.float32,
                    RunOptions(steps=3))


def test_a_run_measured_on_cpu_is_not_judged_against_a_gpu_interval():
    """A CPU step inside (or outside) an H100 plan's interval says nothing of the plan: no
    verdict, and a note saying why; a plan priced on the CPU it ran on is judged."""
    from .test_calibrate import CPU_CLUSTER

    est = ESTIMATE.model_copy(update={"interval": Interval(
        level=0.8, step_time_s=(0.4, 0.6), tokens_per_s_per_gpu=(100.0, 160.0))})
    h100 = Plan(model=load_model(DATA / "tiny_qwen3_moe.yaml"),
                cluster=load_cluster("h100", gpus=2), estimate=est,
                training=TrainingSpec(seq_len=32, global_batch_size=4),
                layout=Layout.build(2, 4, ep=2))
    on_gpu = _summary_of(h100, 0.5)
    assert on_gpu["inside_interval"] is None
    assert on_gpu["predicted"]["step_time_interval_s"] == [0.4, 0.6]  # the plan's, kept
    assert any("not judged" in n and "H100-SXM" in n for n in on_gpu["notes"])
    host = ClusterSpec.model_validate(CPU_CLUSTER).with_gpus(2)
    on_cpu = _summary_of(h100.model_copy(update={"cluster": host}), 0.5)
    assert on_cpu["inside_interval"] is True
    assert not any("not judged" in n for n in on_cpu["notes"])
    assert on_cpu["predicted_cluster"]["gpu"] == "test-cpu"  # what the refit re-prices on


def test_the_launcher_trains_a_plan_without_importing_torch_itself(tmp_path):
    """Only the workers run torch: the launcher checks the plan, spawns torchrun and reads the
    results, so its own process never pays torch's import."""
    out = tmp_path / "run"
    r = run_cli_without_torch("run", write_plan(tmp_path / "w1.json", 1), "--steps", "2",
                              "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_run_trains_an_interleaved_pipeline_with_mtp_on_the_last_stage(cli, tmp_path):
    """pp2·vpp2: loss reported by every rank's all-reduce, routing of every stage's layers."""
    out = tmp_path / "pp"
    plan = write_plan(tmp_path / "pp2vpp2.json", 2, model="tiny_deepseek_v3", pp=2, vpp=2)
    r = cli("run", plan, "--steps", "3", "--out", str(out), "--seed", "7", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[-1]["loss"] < rows[0]["loss"]
    spec = load_model(DATA / "tiny_deepseek_v3.yaml")
    routing = json.loads((out / "routing.json").read_text())
    moe_layers = [i for i, m in enumerate(spec.moe_layers()) if m] + [spec.num_layers]  # + MTP
    assert [layer["layer"] for layer in routing["layers"]] == moe_layers
    for layer in routing["layers"]:
        assert sum(layer["tokens_per_expert"]) == 3 * 4 * 32 * spec.moe_top_k


@pytest.mark.slow
def test_run_joins_an_enclosing_torchrun_launch(tmp_path):
    """Started by torchrun (as a Slurm/torchrun job script would), each process becomes a rank."""
    out = tmp_path / "joined"
    plan = write_plan(tmp_path / "ep2.json", 2, ep=2)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", "-m", "moeplan", "run", plan, "--steps", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2  # written once, by rank 0
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_scale_down_runs_a_real_preset_plan_with_its_parallel_degrees(cli, tmp_path):
    """A Qwen3-235B-A22B plan (tp2, ep2 on 2 ranks) runs locally once shrunk."""
    plan = Plan(model=load_model("qwen3-235b-a22b"), cluster=load_cluster("h100", gpus=2),
                training=TrainingSpec(seq_len=4096, global_batch_size=64),
                layout=Layout.build(2, 64, tp=2, ep=2))
    path = tmp_path / "q235.json"
    path.write_text(plan.model_dump_json())
    out = tmp_path / "scaled"
    r = cli("run", str(path), "--scale-down", "--steps", "2", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scaled_down"] and summary["world_size"] == 2
    assert "tp2" in summary["layout"] and "ep2" in summary["layout"]


@pytest.mark.parametrize("case,axes,extra,needle", [
    ("mtp_stage", {"model": "tiny_deepseek_v3", "pp": 2, "vpp": 2,
                   "choices": Choices(stage_layout="Et|t|tm|L")}, [], "--stage-layout 'Et|t|t|mL'"),
    ("world", {"ep": 2}, ["--nproc-per-node", "3"], "needs 2 processes"),
    ("data", {}, ["--data", "tokens.bin"], "neither tokens.bin nor tokens.idx exists"),
    ("text", {}, ["--data", "corpus.txt"], "this is not a tokenized dataset. `moeplan run` "
     "trains on Megatron's indexed format, a PREFIX.bin + PREFIX.idx pair given by its PREFIX; "
     "make one with `moeplan data prepare corpus.txt --tokenizer-model TOKENIZER -o corpus`"),
    ("resume", {}, ["--resume"], "--resume needs --ckpt-dir"),
    ("nproc0", {}, ["--nproc-per-node", "0"], "--nproc-per-node 0: a node runs 1 to"),
    ("noderank", {}, ["--node-rank", "5"], "--node-rank 5: with --nnodes 1 the node ranks"),
])
def test_run_refuses_before_any_worker_starts(cli, tmp_path, case, axes, extra, needle):
    world = 2 if axes else 1
    plan = write_plan(tmp_path / f"{case}.json", world, **axes)
    out = tmp_path / "out"
    start = time.perf_counter()
    r = cli("run", plan, "--steps", "2", "--out", str(out), *extra)
    assert r.returncode == 2, r.stderr
    assert needle in " ".join(r.stderr.split()) and "Traceback" not in r.stderr
    assert not out.exists()  # nothing ran, nothing was written
    assert time.perf_counter() - start < 20


def test_run_rejects_an_invalid_layout(cli, tmp_path):
    path = tmp_path / "bad.json"
    write_plan(path, 2, ep=2)
    doc = json.loads(path.read_text())
    doc["layout"]["ep"] = 3  # 8 experts are not divisible by 3, nor is the world
    for derived in ("edp", "world_size", "sequence_parallel"):
        doc["layout"].pop(derived, None)
    path.write_text(json.dumps(doc))
    r = cli("run", str(path), "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not divisible by ep=3" in " ".join(r.stderr.split())


def test_a_worker_trains_the_run_the_launcher_prepared_from_the_run_directory_alone(
        tmp_path, monkeypatch):
    """The worker gets only the run directory: the launcher's prepared (scaled-down) plan and
    options come from OUT/run.json, and the plan file it was prepared from is gone."""
    import socket

    from moeplan.runtime import worker
    from moeplan.runtime.launch import PreparedRun, RunOptions, prepare_plan

    opts = RunOptions(steps=2, seed=3, scale_down=True)
    given, running = prepare_plan(write_plan(tmp_path / "plan.json", 1), opts)
    out = tmp_path / "run"
    PreparedRun(given, running, opts).write(out)
    (tmp_path / "plan.json").unlink()
    with socket.socket() as sock:  # a free port for a one-process gloo group
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    monkeypatch.setattr(worker.signal, "signal", lambda *_: None)  # keep pytest's SIGTERM
    monkeypatch.setattr(worker, "set_parent_death_signal", lambda *_: True)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                       "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    worker.main([str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["seed"], summary["scaled_down"]) == (2, 3, True)
    assert summary["model"] == running.model.name != given.model.name
    assert summary["layout"] == running.summary()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_run_prepares_a_plan_with_one_set_per_stage_under_its_own_rules(tmp_path):
    """`moeplan run` is the `moeplan` executor whatever target a plan names: per-stage
    recompute and offload (which the Megatron export refuses) are prepared, not refused."""
    from moeplan.runtime.launch import RunOptions, prepare_plan

    path = write_plan(tmp_path / "staged.json", 2, pp=2, choices=Choices(
        recompute=[["core_attn"], []], offload=[["expert_fc1"], ["attn_norm"]]))
    given, running = prepare_plan(path, RunOptions(steps=1))
    assert running.choices.offload == [["expert_fc1"], ["attn_norm"]]
