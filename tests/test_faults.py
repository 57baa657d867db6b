"""Faults tell the truth: a signal to one worker, SIGKILL during a save and during an export, a
full disk during a save, and two runs on one checkpoint directory.

After each fault the three commands that read a checkpoint directory agree (`_agree`): the
step `checkpoint list` marks as the newest is the one `checkpoint export` writes and `run
--resume` continues from, or all three refuse it by name; and every step that was sealed before
the fault is still listed as usable. Real `moeplan run` launches (world 2, gloo on CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeplan.runtime.storage import CkptLock, complete_steps, verify

from .conftest import run_cli
from .test_run_cli import write_plan

LINUX = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds workers through /proc")
pytestmark = [pytest.mark.slow, LINUX]
SEED = "11"


def moeplan(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=timeout)


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, str]:
    """The faulted runs' plan (world 2, ep2) and the plan the agreement check resumes under
    (world 1: the same model and training, resharded)."""
    root = tmp_path_factory.mktemp("fault_plans")
    return {"ep2": write_plan(root / "ep2.json", 2, ep=2), "w1": write_plan(root / "w1.json", 1)}


def _start(plan: str, out: Path, ckpt: Path, *extra: str, steps: int = 100_000,
           preexec=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moeplan", "run", plan, "--steps", str(steps), "--seed", SEED,
         "--out", str(out), "--ckpt-dir", str(ckpt), "--ckpt-keep", "0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)


def _steps_done(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def _wait(cond, proc: subprocess.Popen | None = None, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()[1][-3000:]}")
        time.sleep(0.02)
    raise AssertionError("timed out")


def _worker_pid(out: Path, rank: int) -> int:
    """The worker process of global rank `rank` of the run writing into `out`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"moeplan.runtime.worker" in cmd and str(out).encode() in cmd \
                and f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no worker of rank {rank} for {out}")


def _usable(ckpt: Path) -> set[int]:
    out = set()
    for s in complete_steps(ckpt):
        with contextlib.suppress(Exception):
            verify(ckpt / f"step_{s:08d}")
            out.add(s)
    return out


def _agree(ckpt: Path, plans: dict[str, str], work: Path, sealed: set[int],
           hf: Path | None = None) -> int | None:
    """`checkpoint list`, `checkpoint export` and `run --resume` agree on the step they take,
    and no step in `sealed` is lost; return that step (None: no checkpoint at all)."""
    r = moeplan("checkpoint", "list", str(ckpt), "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    rows = json.loads(r.stdout)["checkpoints"]
    usable = {row["step"] for row in rows if row["usable"]}
    assert sealed <= usable, (sealed, rows)  # no sealed step is lost
    newest = next((row for row in rows if row["newest"]), None)
    hf = hf or work / "hf"
    r = moeplan("checkpoint", "export", str(ckpt), "--to", "hf", "-o", str(hf), "--json")
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    if newest is not None and newest["usable"]:
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)["step"] == newest["step"]
        assert not list(hf.parent.glob(f".{hf.name}.tmp-*"))  # a killed export's leftovers
    else:
        assert r.returncode == 2 and not hf.exists(), r.stderr[-2000:]
    step = newest["step"] if newest is not None else 0
    out = work / "resumed"
    r = moeplan("run", plans["w1"], "--resume", "--steps", str(step + 1), "--seed", SEED,
                "--out", str(out), "--ckpt-dir", str(ckpt), "--ckpt-keep", "0")
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if newest is None or newest["usable"]:
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads((out / "summary.json").read_text())["resumed_from"] == step
    else:
        assert r.returncode == 2 and f"step_{step:08d}" in _flat(r.stderr), r.stderr[-2000:]
    return newest["step"] if newest is not None else None


# ------------------------------------------------------------------------ a signal to one worker
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_signal_to_one_worker_stops_the_run_with_its_exit_code_and_one_line(
        plans, tmp_path, sig, code):
    """A node-local preemption signals one torchrun worker (rank 1), not the launcher: the run
    stopped at a step boundary and checkpointed, then exited 0 with a normal summary. It exits
    75 (SIGTERM) or 130 (SIGINT) with its one "stopped by …; continue with --resume" line."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    proc = _start(plans["ep2"], out, ckpt, "--json")
    _wait(lambda: _steps_done(out) >= 3, proc)
    os.kill(_worker_pid(out, 1), sig)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == code, stderr[-3000:]
    assert json.loads(stdout)["stopped_by"] == sig.name  # --json: one document, the stop's
    lines = [line for line in stderr.splitlines() if line.strip()]
    stops = [line for line in lines if line.startswith("stopped by")]
    summary = json.loads((out / "summary.json").read_text())
    at = summary["preempted_at"]
    assert stops == [lines[-1]], stderr[-3000:]  # one line, the last
    assert stops[0] == (f"stopped by {sig.name} at step {at}; checkpoint "
                        f"{summary['stop_checkpoint']}; continue with --resume (exit {code})")
    assert summary["stopped_by"] == sig.name and complete_steps(ckpt) == [at]
    assert _agree(ckpt, plans, tmp_path, {at}) == at


def test_a_stop_before_the_workers_start_stops_them_at_their_first_step(plans, tmp_path):
    """A SIGTERM that reaches the agent before torchrun has started the workers is kept in its
    environment (`lifecycle.STOP_ENV`), which the workers inherit: they train one step,
    checkpoint it and stop, and the run exits 75, where the stop used to be lost and the run
    trained on until the launcher's grace period killed it."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    env = {**os.environ, "MOEPLAN_STOP_SIGNAL": str(int(signal.SIGTERM))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeplan", "run", plans["ep2"], "--steps", "1000", "--seed", SEED,
         "--out", str(out), "--ckpt-dir", str(ckpt)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 75, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["preempted_at"] == 1
    assert complete_steps(ckpt) == [1]


def test_a_stop_while_python_starts_a_process_is_recorded_not_fatal(tmp_path):
    """The agent and the workers start through `lifecycle.BOOTSTRAP`: a SIGTERM that arrives
    before the module's own handlers exist (while Python imports it) is recorded for them
    instead of killing the process (exit 143) or raising KeyboardInterrupt (SIGINT)."""
    from moeplan.runtime.lifecycle import bootstrap_command

    (tmp_path / "slow_start.py").write_text(
        "import os, signal\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"   # a stop during the module's import
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "from moeplan.runtime.lifecycle import pending_stop\n"
        "print(pending_stop())\n")
    done = subprocess.run(bootstrap_command("slow_start"), capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(int(signal.SIGTERM))  # the larger of 15 and 2


# ------------------------------------------------------------------------ SIGKILL during a save
def test_sigkill_during_a_save_loses_no_sealed_step(plans, tmp_path):
    """Rank 0 (the process that seals a step: manifest, rename, `latest`, prune) is SIGKILLed
    while a step is being written. The steps sealed before stay usable, the half-written one
    is no checkpoint, and list, export and --resume agree."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    proc = _start(plans["ep2"], out, ckpt, "--ckpt-every", "1")
    _wait(lambda: len(complete_steps(ckpt)) >= 2, proc)
    victim = _worker_pid(out, 0)
    deadline, caught = time.monotonic() + 120, False
    while time.monotonic() < deadline and not caught:  # wait for a save in flight
        caught = any(".tmp-" in e.name for e in os.scandir(ckpt))
    sealed = _usable(ckpt)  # sealed before the kill (a step sealed meanwhile is extra)
    os.kill(victim, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=180)
    assert caught, "no save was seen in flight"
    assert proc.returncode != 0 and "Traceback" not in stderr, stderr[-3000:]
    assert "worker rank 0 was killed by SIGKILL" in _flat(stderr)
    newest = _agree(ckpt, plans, tmp_path, sealed)
    assert newest is not None and newest >= max(sealed)


# ---------------------------------------------------------------------- SIGKILL during an export
def test_sigkill_during_an_export_leaves_nothing_the_next_export_trips_on(plans, tmp_path):
    """A killed export leaves no OUT directory (it is renamed into place whole) and its
    temporary directory is removed by the next export to that place."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    r = moeplan("run", plans["ep2"], "--steps", "4", "--seed", SEED, "--out", str(out),
                "--ckpt-dir", str(ckpt), "--ckpt-every", "2", "--ckpt-keep", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    sealed = _usable(ckpt)
    assert sealed == {2, 4}
    hf = tmp_path / "hf"
    for _attempt in range(5):  # until the kill lands while the export is writing
        proc = subprocess.Popen([sys.executable, "-m", "moeplan", "checkpoint", "export",
                                 str(ckpt), "--to", "hf", "-o", str(hf)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        caught = False
        while proc.poll() is None and not caught:
            caught = any(e.name.startswith(".hf.tmp-") for e in os.scandir(tmp_path))
        if caught:
            proc.kill()
        proc.wait()
        if caught and not hf.exists():
            break
        if hf.exists():  # finished first: try again
            subprocess.run(["rm", "-rf", str(hf)], check=True)
    else:
        pytest.fail("no export was killed while writing")
    assert [p.name for p in tmp_path.glob(".hf.tmp-*")]  # what a killed export leaves
    assert _agree(ckpt, plans, tmp_path, sealed, hf=hf) == 4  # the next export removes it


# -------------------------------------------------------------------- a full disk during a save
def _tmpfs(where: Path, size: str) -> bool:
    """Mount a tmpfs of `size` on `where` (root only); False when this machine will not."""
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True)
    return r.returncode == 0


def _limit_file_size(limit: int):
    """The fallback where no tmpfs can be mounted: a per-process file-size limit (RLIMIT_FSIZE,
    inherited by the agent and the workers) that makes the save's writes fail with EFBIG, the
    same real save path as ENOSPC (Python ignores SIGXFSZ, so the write returns the error)."""
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_a_full_disk_during_a_save_exits_2_in_one_paragraph_and_keeps_the_sealed_steps(
        plans, tmp_path):
    """A full disk at a checkpoint save gave a raw ENOSPC traceback in a worker. Now every
    rank agrees the save failed, the half-written step is removed, rank 0 says it in one
    paragraph, and the run exits 2; the steps sealed before stay. Here on a real tmpfs of
    8 MiB (two 3.1 MB steps fit, the third does not); without root, the same save path fails
    through a file-size limit instead (EFBIG, "File too large")."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    ckpt.mkdir()
    mounted = _tmpfs(ckpt, "8m")
    try:
        preexec = None if mounted else _limit_file_size(1 << 20)  # a rank file is ~1.5 MB
        proc = _start(plans["ep2"], out, ckpt, "--ckpt-every", "3", steps=12, preexec=preexec)
        _, stderr = proc.communicate(timeout=300)
        said = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, stderr[-3000:]
        assert "Traceback" not in stderr and not any("worker rank" in s for s in said)
        error = [s for s in said if s.startswith("error:")]
        assert len(error) == 1 and said[-1] == error[0], stderr[-3000:]  # one paragraph, last
        reason = "No space left on device" if mounted else "File too large"
        sealed = _usable(ckpt)
        assert sealed == ({3, 6} if mounted else set())
        assert f"cannot save the checkpoint of step {9 if mounted else 3}" in error[0]
        assert reason in error[0]
        assert ("sealed checkpoints (steps 3, 6) are unchanged" in error[0]
                and "--resume" in error[0]) if mounted else "no checkpoint was sealed" in error[0]
        assert not [p for p in ckpt.iterdir() if ".tmp-" in p.name]  # the half-written step
        if mounted:  # free space, then the three commands agree on step 6
            subprocess.run(["mount", "-o", "remount,size=64m", str(ckpt)], check=True)
        assert _agree(ckpt, plans, tmp_path, sealed) == (6 if mounted else None)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(ckpt)], check=False)


# ------------------------------------------------------------ two runs on one checkpoint directory
def test_a_second_run_on_a_busy_ckpt_dir_exits_2_naming_the_first_which_goes_on(plans,
                                                                                 tmp_path):
    """Two runs on one --ckpt-dir: the second's pruning deleted the first's temporary step
    (a worker traceback, a directory holding the other run's steps). The first run holds a
    lock for its life; a second one, fresh or --resume, exits 2 naming it, and starts
    nothing; the first goes on undisturbed."""
    out, ckpt = tmp_path / "first", tmp_path / "ckpt"
    first = _start(plans["ep2"], out, ckpt, "--ckpt-every", "2")
    _wait(lambda: len(complete_steps(ckpt)) >= 1, first)
    for extra in ([], ["--resume"]):
        second = tmp_path / f"second{len(extra)}"
        r = moeplan("run", plans["ep2"], "--steps", "50", "--seed", SEED, "--out", str(second),
                    "--ckpt-dir", str(ckpt), *extra)
        said = _flat(r.stderr)
        assert r.returncode == 2 and "Traceback" not in r.stderr, said
        assert "is in use by another run" in said and f"pid {first.pid}" in said
        assert str(out) in said and not second.exists()
    _wait(lambda: len(complete_steps(ckpt)) >= 3, first)
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=180)
    assert first.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr
    sealed = _usable(ckpt)
    at = json.loads((out / "summary.json").read_text())["preempted_at"]
    assert max(sealed) == at and len(sealed) >= 3
    assert _agree(ckpt, plans, tmp_path, sealed) == at


# ------------------------------------------------------------- two runs on one output directory
def test_a_second_run_on_a_busy_out_exits_2_and_the_first_trains_its_own_plan(plans, tmp_path):
    """Two runs on one --out: the first's workers read the second's run.json and trained its
    plan and options, then exited 0 with its summary. The first now holds OUT for its life."""
    out = tmp_path / "out"
    first = _start(plans["ep2"], out, tmp_path / "ckpt1", steps=30)
    _wait(lambda: _steps_done(out) >= 1, first)
    r = moeplan("run", plans["w1"], "--steps", "6", "--seed", "2", "--out", str(out),
                "--ckpt-dir", str(tmp_path / "ckpt2"))
    said = _flat(r.stderr)
    assert r.returncode == 2 and "Traceback" not in r.stderr, said
    assert f"--out {out} is in use by another run" in said and f"pid {first.pid}" in said
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["seed"] == int(SEED)
    assert summary["world_size"] == 2 and _steps_done(out) == 30


def test_a_busy_out_is_refused_before_the_checkpoint_is_verified(plans, tmp_path):
    """A second run on a busy --out verified (hashed) its --resume checkpoint first, minutes
    for a large one, and only then was refused: the --out it names is held first."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    step = ckpt / "step_00000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")  # claims to be a checkpoint: verify refuses it
    with CkptLock(out, "moeplan run held-by-this-test", flag="--out", clash="", checked=False):
        r = moeplan("run", plans["w1"], "--steps", "2", "--seed", SEED, "--out", str(out),
                    "--ckpt-dir", str(ckpt), "--resume")
    said = _flat(r.stderr)
    assert r.returncode == 2 and "Traceback" not in r.stderr, said
    assert f"--out {out} is in use by another run" in said and "held-by-this-test" in said
    assert "manifest" not in said


# --------------------------------------------------------------------------- restarts, hung ranks
def test_a_restart_after_a_lost_worker_is_said_and_counted(plans, tmp_path):
    """torchrun restarted the workers without a word: the only trace was rank 0's lost peer,
    and the summary said nothing of it. The line names the worker that failed and how."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    run = _start(plans["ep2"], out, ckpt, "--ckpt-every", "1", "--max-restarts", "1", steps=8)
    _wait(lambda: len(complete_steps(ckpt)) >= 2, run)
    os.kill(_worker_pid(out, 1), signal.SIGKILL)
    _, stderr = run.communicate(timeout=300)
    said = _flat(stderr)
    assert run.returncode == 0 and "Traceback" not in stderr, said[-3000:]
    assert ("worker rank 1 was killed by SIGKILL (the out-of-memory killer sends SIGKILL); "
            "restarting the workers from the newest checkpoint: restart 1 of 1") in said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["resumed_from"] >= 2
    assert any("restarted 1 time" in n for n in summary["notes"])


def test_a_hung_rank_fails_the_run_within_the_distributed_timeout(plans, tmp_path):
    """A stopped rank held every other rank in a collective for torch's default of 30
    minutes; --distributed-timeout-minutes (Megatron's flag) bounds the wait."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    run = _start(plans["ep2"], out, ckpt, "--distributed-timeout-minutes", "0.1")
    _wait(lambda: _steps_done(out) >= 2, run)
    hung = _worker_pid(out, 1)
    os.kill(hung, signal.SIGSTOP)
    start = time.monotonic()
    try:
        _, stderr = run.communicate(timeout=150)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGKILL)
    assert run.returncode not in (0, 2, 75, 130) and "Traceback" not in stderr, stderr[-3000:]
    assert "waited past --distributed-timeout-minutes for a peer" in _flat(stderr)
    assert time.monotonic() - start < 120
    with pytest.raises(AssertionError):
        _worker_pid(out, 0)  # nothing of the run is left
