"""Token files, checkpoints and resume, and faults: nothing lost, nothing silently diverging.

In-process checks for the data and file formats; one spawned world (`checkpoint_worker.py`)
for exact and resharded resume; a few real `moeplan run` launches at world 2 for resume through
the CLI, a worker SIGKILLed mid-run and restarted by torchrun, and SIGTERM preemption.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from moeplan.errors import SpecError
from moeplan.runtime.data import TokenData, write_tokens
from moeplan.runtime.data import main as convert
from moeplan.runtime.launch import RunOptions, check_resume
from moeplan.runtime.storage import check_token_file, complete_steps, newest_checkpoint
from moeplan.specs import Choices, load_plan

from .conftest import run_cli, run_world
from .test_run_cli import write_plan

STEPS = 24  # the end-to-end runs; the tiny model takes ~0.1 s a step


def last_per_step(metrics: Path) -> dict[int, float]:
    """Readers of an appended metrics.jsonl take the last record of each step."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


# ------------------------------------------------------------------------------ box geometry
@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 1, 3, 4)])
def test_a_flat_range_cuts_into_boxes_that_cover_exactly_its_elements(shape):
    from moeplan.runtime.checkpoint import _boxes, _index

    n = int(np.prod(shape))
    for a, b in [(0, n), (1, n - 1), (n // 3, n // 3 + 1), (2, 2 * n // 3), (0, 1), (n - 1, n)]:
        marks = torch.zeros(shape, dtype=torch.int64)
        for box in _boxes(a, b, shape):
            marks[_index(box)] += 1
        want = torch.zeros(n, dtype=torch.int64)
        want[a:b] = 1
        assert torch.equal(marks.reshape(-1), want), (a, b)
        assert len(_boxes(a, b, shape)) <= 2 * len(shape) - 1


def test_a_flat_range_splits_into_its_boxes_contents_in_order():
    """Each box of a flat range is a contiguous run of it, so a rank writes (and reads back)
    its optimizer slice without building the whole shard."""
    from moeplan.runtime.checkpoint import _boxes, _index, _split

    shape = (4, 3, 5)
    full = torch.arange(60.0).view(shape)
    boxes = _boxes(7, 53, shape)
    for piece, box in zip(_split(full.reshape(-1)[7:53], boxes), boxes, strict=True):
        assert torch.equal(piece, full[_index(box)])


def test_the_complement_of_a_box_covers_the_rest_once():
    from moeplan.runtime.checkpoint import _complement, _index

    shape, box = (6, 5, 4), ((2, 1, 0), (2, 3, 4))
    marks = torch.zeros(shape, dtype=torch.int64)
    marks[_index(box)] += 1
    for b in _complement(box, shape):
        marks[_index(b)] += 1
    assert bool((marks == 1).all())


# --------------------------------------------------------------------------------------- data
def test_text_converter_writes_byte_tokens_with_a_sidecar(tmp_path):
    (tmp_path / "a.txt").write_text("héllo")
    (tmp_path / "b.txt").write_text("ok")
    convert(["text", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "-o",
             str(tmp_path / "c.bin")])
    meta = check_token_file(tmp_path / "c.bin", vocab_size=256, seq_len=4)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256
    tokens = np.fromfile(tmp_path / "c.bin", dtype=np.uint16)
    assert tokens.tolist() == [*"héllo".encode(), 0, *b"ok", 0]


def test_numpy_converter_picks_uint32_for_large_vocabularies(tmp_path):
    np.save(tmp_path / "ids.npy", np.array([[1, 70_000], [5, 6]], dtype=np.int64))
    convert(["npy", str(tmp_path / "ids.npy"), "-o", str(tmp_path / "ids.bin"),
             "--vocab-size", "100000"])
    meta = check_token_file(tmp_path / "ids.bin", vocab_size=100_000, seq_len=2)
    assert meta["dtype"] == "uint32"
    assert np.fromfile(tmp_path / "ids.bin", dtype=np.uint32).tolist() == [1, 70_000, 5, 6]


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "truncated"),
    ("vocab", "outside the model's vocabulary"),
    ("sidecar", "sidecar"),
])
def test_a_bad_token_file_is_refused_by_name(tmp_path, damage, needle):
    path = write_tokens(np.arange(100) % 50, tmp_path / "t.bin", vocab_size=50)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-2])
    elif damage == "vocab":
        write_tokens(np.array([1, 2, 3, 300] * 20), path, vocab_size=301)
        side = json.loads(path.with_suffix(".json").read_text())  # a sidecar that understates
        path.with_suffix(".json").write_text(json.dumps(side | {"vocab_size": 256}))
    else:
        path.with_suffix(".json").unlink()
    with pytest.raises(SpecError, match=needle) as e:
        check_token_file(path, vocab_size=256 if damage == "vocab" else 50, seq_len=8)
    assert "t.bin" in str(e.value)


def test_token_batches_depend_on_seed_and_step_only_not_the_dp_split(tmp_path):
    path = write_tokens(np.random.default_rng(1).integers(0, 256, 2_000), tmp_path / "t.bin")
    data = TokenData(path, 256, seq_len=16, global_batch=8, seed=3)
    for step in (0, 20):  # step 20 is past the first epoch (124 windows): a new order
        whole = data.global_batch(step)
        for dp in (2, 4):
            parts = [torch.cat([tok for tok, _ in data.micro_batches(step, r, dp, 1)])
                     for r in range(dp)]
            assert torch.equal(torch.cat(parts), whole[:, :-1])
        again = TokenData(path, 256, seq_len=16, global_batch=8, seed=3).global_batch(step)
        assert torch.equal(again, whole)  # e.g. after a restart
    assert not torch.equal(TokenData(path, 256, 16, 8, seed=4).global_batch(0), data.global_batch(0))


# ------------------------------------------------------------------------------------- non-finite
def test_a_non_finite_loss_skips_the_update_and_training_goes_on(tmp_path):
    from moeplan.runtime.parallelize import local_groups
    from moeplan.runtime.train import Trainer

    plan = load_plan(write_plan(tmp_path / "plan.json", 1))
    trainer = Trainer(plan, local_groups(), seed=0)
    trainer.step(0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    count = trainer.optimizer.step_count
    hook = trainer.model.register_forward_hook(
        lambda _m, _i, terms: replace(terms, ce_sum=terms.ce_sum * float("nan")))
    metrics, _ = trainer.step(1)
    hook.remove()
    assert metrics.skipped and trainer.optimizer.step_count == count
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n
    metrics, _ = trainer.step(2)
    assert not metrics.skipped and np.isfinite(metrics.loss)


# ------------------------------------------------------------------------ spawned-world resume
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A world-4 run saved at step 3 under tp2·ep4, resumed under it, ep2·etp2 and pp2·vpp2·tp2;
    and one saved at step 3 under pp2·vpp2·tp2, resumed under it and under tp2·ep4."""
    root = tmp_path_factory.mktemp("ckpt_world4")
    run_world("checkpoint_worker.py", root)
    return root


@pytest.mark.slow
def test_resume_under_the_same_plan_reproduces_the_straight_losses_exactly(saved):
    losses = json.loads((saved / "losses.json").read_text())
    for a, b in zip(losses["resumed_same_plan"], losses["straight"][3:], strict=True):
        assert abs(a - b) <= 1e-6
    assert len(losses["resumed_same_plan"]) == 3


@pytest.mark.slow
def test_resume_under_another_plan_reshards_to_the_straight_losses(saved):
    losses = json.loads((saved / "losses.json").read_text())
    for a, b in zip(losses["resumed_ep2_etp2"], losses["straight"][3:], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_under_the_same_plan_exactly(saved):
    losses = json.loads((saved / "losses.json").read_text())
    assert len(losses["pp2_resumed_same_plan"]) == 3
    for a, b in zip(losses["pp2_resumed_same_plan"], losses["straight_pp2"][3:], strict=True):
        assert abs(a - b) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("resumed,straight", [("pp2_resumed_tp2_ep4", "straight_pp2"),
                                              ("resumed_pp2_vpp2_tp2", "straight")])
def test_a_checkpoint_resumes_under_another_pipeline_depth_to_the_straight_losses(
        saved, resumed, straight):
    losses = json.loads((saved / "losses.json").read_text())
    assert len(losses[resumed]) == 3
    for a, b in zip(losses[resumed], losses[straight][3:], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)


@pytest.mark.slow
def test_fp8_delayed_scaling_resumes_exactly_with_its_amax_histories(saved):
    """The histories are saved per rank and restored under the same plan: the resumed FP8 run
    is the straight run; without them (the control) the first resumed step already differs."""
    losses = json.loads((saved / "losses.json").read_text())
    straight = losses["straight_fp8"][3:]
    assert losses["fp8_resumed_same_plan"] == straight
    assert losses["fp8_resumed_without_histories"][0] != straight[0]


@pytest.mark.slow
def test_every_rank_writes_its_part_and_the_step_is_sealed_with_a_manifest(saved):
    path = newest_checkpoint(saved / "ckpt")
    assert path is not None and path.name == "step_00000003"
    assert sorted(p.name for p in path.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    manifest = json.loads((path / "manifest.json").read_text())
    assert {"plan.json", "meta.json", ".metadata"} <= manifest.keys()
    assert (saved / "ckpt" / "latest").read_text().strip() == "step_00000003"
    assert not [p for p in (saved / "ckpt").iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_an_incomplete_newer_checkpoint_is_skipped_for_the_previous_complete_one(saved,
                                                                               tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", ckpt)
    half = ckpt / "step_00000005"  # e.g. copied by hand, never sealed
    shutil.copytree(ckpt / "step_00000003", half)
    (half / "manifest.json").unlink()
    (ckpt / ".step_00000006.tmp-dead").mkdir()  # a write interrupted by a crash
    assert complete_steps(ckpt) == [3]
    plan = load_plan(ckpt / "step_00000003" / "plan.json")
    assert check_resume(plan, RunOptions(steps=6, seed=5, ckpt_dir=str(ckpt), resume=True)) == 3
    assert (half / "__0_0.distcp").is_file()  # nothing on disk was touched


@pytest.mark.slow
@pytest.mark.parametrize("opts,needle", [
    ({"resume": False}, "already holds checkpoints"),  # a fresh run would mix two runs
    ({"resume": True, "seed": 6}, "same seed"),
    ({"resume": True, "steps": 3}, "nothing to train"),
])
def test_resume_refuses_what_would_silently_diverge(saved, opts, needle):
    ckpt = saved / "ckpt"
    plan = load_plan(ckpt / "step_00000003" / "plan.json")
    with pytest.raises(SpecError, match=needle):
        check_resume(plan, RunOptions(ckpt_dir=str(ckpt), **{"steps": 6, "seed": 5, **opts}))


@pytest.mark.slow
def test_a_checkpoint_of_an_older_format_is_refused_by_name(saved, tmp_path):
    """A v1 checkpoint held global tensors; this version reads only per-rank boxes."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", ckpt)
    step = ckpt / "step_00000003"
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps(meta | {"format": "moeplan-ckpt-v1"}))
    manifest = json.loads((step / "manifest.json").read_text())  # a consistent old seal
    data = (step / "meta.json").read_bytes()
    manifest["meta.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    plan = load_plan(step / "plan.json")
    with pytest.raises(SpecError, match="moeplan-ckpt-v1"):
        check_resume(plan, RunOptions(steps=6, seed=5, ckpt_dir=str(ckpt), resume=True))


@pytest.mark.slow
@pytest.mark.parametrize("damage,needle", [
    ("flip", "__1_0.distcp does not match its checksum"),
    ("truncate", "__1_0.distcp has"),
    ("code", ".metadata is not a plain checkpoint index"),  # checksums made to match
])
def test_a_corrupt_checkpoint_is_refused_naming_the_file_before_any_worker(saved, tmp_path, cli,
                                                                          damage, needle):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", ckpt)
    step = ckpt / "step_00000003"
    if damage == "code":
        (step / ".metadata").write_bytes(pickle.dumps(os.system))
        manifest = json.loads((step / "manifest.json").read_text())
        data = (step / ".metadata").read_bytes()
        manifest[".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (step / "manifest.json").write_text(json.dumps(manifest))
    else:
        bad = step / "__1_0.distcp"
        data = bytearray(bad.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        bad.write_bytes(bytes(data))
    plan = tmp_path / "plan.json"
    shutil.copy(ckpt / "step_00000003" / "plan.json", plan)
    out = tmp_path / "out"
    r = cli("run", str(plan), "--steps", "6", "--out", str(out), "--ckpt-dir", str(ckpt),
            "--resume")
    assert r.returncode == 2, r.stderr
    assert needle.replace(" ", "") in "".join(r.stderr.split())  # rich wraps long paths
    assert not out.exists()


# ------------------------------------------------------------------------- real launches (CLI)
@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict:
    """A world-2 plan (ep2, half the optimizer states on the host, so resume restores both
    parts), a token file and the uninterrupted run's losses."""
    root = tmp_path_factory.mktemp("launch")
    plan = write_plan(root / "ep2.json", 2, choices=Choices(optimizer_offload_fraction=0.5), ep=2)
    (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    convert(["text", str(root / "a.txt"), "-o", str(root / "corpus.bin")])
    data = str(root / "corpus.bin")
    r = moeplan("run", plan, "--steps", str(STEPS), "--data", data, "--out", str(root / "straight"))
    assert r.returncode == 0, r.stderr[-3000:]
    return {"root": root, "plan": plan, "data": data,
            "straight": last_per_step(root / "straight" / "metrics.jsonl")}


def moeplan(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=300)


@pytest.mark.slow
def test_three_steps_then_resume_to_six_equals_six_straight_steps_through_the_cli(launch):
    root, common = launch["root"], ["--data", launch["data"], "--ckpt-dir"]
    out, ckpt = root / "parts", str(root / "ckpt_parts")
    r = moeplan("run", launch["plan"], "--steps", "3", "--out", str(out), *common, ckpt,
                "--ckpt-every", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    r = moeplan("run", launch["plan"], "--steps", "6", "--out", str(out), *common, ckpt,
                "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    got = last_per_step(out / "metrics.jsonl")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step, loss in got.items():
        assert abs(loss - launch["straight"][step]) <= 1e-6, step
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == 3


def _worker_pids(marker: str) -> list[int]:
    """Processes running `moeplan.runtime.worker` whose command line mentions `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if cmd.split()[1:3] == ["-u", "-m"] and "moeplan.runtime.worker" in cmd and marker in cmd:
            pids.append(int(entry.name))
    return pids


def _wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run did not reach step {step}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds worker processes through /proc")
def test_a_sigkilled_worker_is_restarted_and_the_run_matches_an_uninterrupted_one(launch):
    root = launch["root"]
    out = root / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeplan", "run", launch["plan"], "--steps", str(STEPS),
         "--data", launch["data"], "--out", str(out), "--ckpt-dir", str(root / "ckpt_killed"),
         "--ckpt-every", "4", "--max-restarts", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(out / "metrics.jsonl", 6, proc)
    victim = max(_worker_pids(str(out)))
    os.kill(victim, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed at step" in " ".join(stderr.split())  # restarted workers loaded a checkpoint
    got = last_per_step(out / "metrics.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - launch["straight"][step]) <= 1e-6, step


@pytest.mark.slow
def test_sigterm_on_the_launcher_checkpoints_at_the_next_step_and_exits_75(launch):
    root = launch["root"]
    out, ckpt = root / "preempted", root / "ckpt_preempted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeplan", "run", launch["plan"], "--steps", str(STEPS),
         "--data", launch["data"], "--out", str(out), "--ckpt-dir", str(ckpt)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(out / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]  # preempted (docs/RUNTIME.md)
    at = json.loads((out / "summary.json").read_text())["preempted_at"]
    assert 3 <= at < STEPS
    assert complete_steps(ckpt) == [at]
    assert max(last_per_step(out / "metrics.jsonl")) == at


def test_the_run_stops_after_the_configured_non_finite_steps_in_a_row(tmp_path, monkeypatch,
                                                                      capsys):
    from moeplan.runtime import worker
    from moeplan.runtime.train import Trainer

    class PoisonedFromStep3(Trainer):
        def step(self, step, capture_grads=False):
            if step == 2:  # every later loss is NaN
                self.model.register_forward_hook(
                    lambda _m, _i, terms: replace(terms, ce_sum=terms.ce_sum * float("nan")))
            return super().step(step, capture_grads)

    with socket.socket() as sock:  # a free port for a one-process gloo group
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    monkeypatch.setattr(worker, "Trainer", PoisonedFromStep3)
    monkeypatch.setattr(worker.signal, "signal", lambda *_: None)  # keep pytest's SIGTERM
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                       "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        worker.run_worker(write_plan(tmp_path / "plan.json", 1),
                          RunOptions(steps=10, max_nonfinite_steps=2), out)
    assert e.value.code == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("skipped", False) for r in rows] == [False, False, True, True]
    assert "2 steps in a row" in " ".join(capsys.readouterr().err.split())
