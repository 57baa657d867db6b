"""`moeplan run` as a process tree: no worker outlives the launcher, Ctrl-C stops cleanly in one
line, the memory guard refuses what cannot fit, refusals name their fix, two nodes train as one."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from moeplan.errors import SpecError
from moeplan.planner.export import to_slurm
from moeplan.runtime.guard import (
    Devices,
    detect_devices,
    mem_available_gb,
    node_ranks,
    price_ranks,
    shortfall,
    torchrun_binds_numa,
)
from moeplan.runtime.launch import RunOptions, guard_memory, numa_binding, torchrun_command
from moeplan.runtime.lifecycle import INTERRUPTED_EXIT
from moeplan.runtime.support import features_not_executed
from moeplan.specs import (
    Choices,
    Layout,
    Plan,
    TrainingSpec,
    load_cluster,
    load_model,
    load_plan,
)

from .test_checkpoint import _wait_for_step
from .test_run_cli import write_plan

LINUX = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes through /proc")


def _processes_mentioning(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line contains `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmd and "moeplan" in cmd and state != "Z":
            pids.append(int(entry.name))
    return pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------- lifecycle
@pytest.mark.slow
@LINUX
def test_sigkill_on_the_launcher_leaves_no_worker_within_15_s(tmp_path):
    out = tmp_path / "killed-launcher"
    plan = write_plan(tmp_path / "ep2.json", 2, ep=2)
    proc = subprocess.Popen([sys.executable, "-m", "moeplan", "run", plan, "--steps", "100000",
                             "--out", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for_step(out / "metrics.jsonl", 2, proc, timeout=180)
        assert len(_processes_mentioning(str(out))) == 4  # launcher, agent, two workers
    finally:
        proc.kill()  # SIGKILL: no handler runs in the launcher
        proc.wait()
    deadline = time.monotonic() + 15
    while _processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_mentioning(str(out)) == []


def _run_in_terminal(argv: list[str], columns: int, until: Path, steps: int
                     ) -> tuple[int, str]:
    """Run argv on a pseudo-terminal of `columns` columns as its foreground job, type Ctrl-C
    once `until` has `steps` lines, and return (exit code, everything it printed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))

    def controlling_tty() -> None:  # a new session whose controlling terminal is the pty
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, preexec_fn=controlling_tty,
                            env={**os.environ, "COLUMNS": str(columns)})
    os.close(slave)
    chunks: list[bytes] = []
    sent = False
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal closed: every writer exited
                break
            if not data:
                break
            chunks.append(data)
        if not sent and until.is_file() and len(until.read_text().splitlines()) >= steps:
            os.write(master, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the foreground job
            sent = True
    code = proc.wait(timeout=60)
    os.close(master)
    assert sent, "the run did not reach the step to interrupt at"
    return code, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
@LINUX
def test_ctrl_c_stops_at_a_step_boundary_with_one_line_a_checkpoint_and_exit_130(tmp_path):
    out, ckpt = tmp_path / "interrupted", tmp_path / "ckpt"
    plan = write_plan(tmp_path / "ep2.json", 2, ep=2)
    code, text = _run_in_terminal(
        [sys.executable, "-m", "moeplan", "run", plan, "--steps", "100000", "--out", str(out),
         "--ckpt-dir", str(ckpt)], columns=100, until=out / "metrics.jsonl", steps=3)
    assert code == INTERRUPTED_EXIT == 130, text[-3000:]
    assert "Traceback" not in text and "torch.distributed" not in text
    lines = [line for line in text.replace("\r", "").split("\n") if line.strip()]
    stop = [line for line in lines if "SIGINT" in line]
    assert len(stop) == 1, text[-3000:]  # one line, not wrapped (soft wrap in the terminal)
    summary = json.loads((out / "summary.json").read_text())
    at = summary["preempted_at"]
    assert summary["stopped_by"] == "SIGINT" and at >= 3
    assert f"at step {at}" in stop[0] and summary["stop_checkpoint"] in stop[0]
    assert lines[-1] == stop[0]  # nothing after it
    assert _processes_mentioning(str(out)) == []


# ------------------------------------------------------------------------------ memory guard
def test_a_full_size_llama3_8b_plan_on_this_cpu_is_refused_within_30_s(cli, tmp_path):
    if (mem_available_gb() or 0) > 200:
        pytest.skip("this machine has the ~210 GB a full fp32 Llama-3-8B step needs")
    plan = tmp_path / "p.json"
    r = cli("estimate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "1", "--seq",
            "4096", "--gbs", "1", "-o", str(plan))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    start = time.perf_counter()
    r = cli("run", str(plan), "--steps", "1", "--out", str(out), timeout=60)
    took = time.perf_counter() - start
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and took < 30, (took, r.stderr)
    assert "Traceback" not in r.stderr and "--scale-down" in said
    assert "does not fit in memory" in said and "MemAvailable" in said
    assert not out.exists()  # nothing started, nothing written


def _qwen_plan(world: int, **axes) -> Plan:
    return Plan(model=load_model("qwen3-30b-a3b"), cluster=load_cluster("h100", gpus=world),
                training=TrainingSpec(seq_len=4096, global_batch_size=64),
                layout=Layout.build(world, 64, **axes))


def test_the_guard_compares_each_rank_with_its_own_gpu_and_names_the_short_one():
    plan = _qwen_plan(2, ep=2)
    needs = price_ranks(plan, [0, 1], "bf16", "cuda")
    need = needs[0].total_gb
    roomy = Devices("cuda", (need + 1, need + 1), ("NVIDIA H100", "NVIDIA H100"))
    assert shortfall(needs, roomy) is None
    tight = Devices("cuda", (need + 1, need - 1), ("NVIDIA H100", "NVIDIA H100"))
    why = shortfall(needs, tight)
    assert why is not None and "rank 1" in why and "GPU 1" in why
    assert "only 1 GPUs are visible" in shortfall(needs, Devices("cuda", (1e9,), ("x",)))


def test_the_guard_prices_fp32_and_host_copies_above_the_gpu_bf16_figure():
    """On CPU the optimizer states 'offloaded to the host' are in the same RAM, and fp32
    doubles weights and activations: the CPU price is above the GPU one, by exactly those."""
    plan = _qwen_plan(2, ep=2).model_copy(update={"choices": Choices(
        optimizer_offload_fraction=0.5)})
    gpu = price_ranks(plan, [0], "bf16", "cuda")[0]
    cpu = price_ranks(plan, [0], "fp32", "cpu")[0]
    full = price_ranks(plan.model_copy(update={"choices": Choices()}), [0], "bf16", "cuda")[0]
    assert cpu.static_gb > full.static_gb > gpu.static_gb  # host share and fp32 weights kept
    assert cpu.activations_gb == pytest.approx(2 * gpu.activations_gb)


def test_gpus_are_read_from_nvidia_smi_as_cuda_visible_devices_leaves_them(tmp_path,
                                                                          monkeypatch):
    """A stand-in nvidia-smi (same query, same CSV) on PATH: GPU 1 is the only visible one, so
    a 2-rank node is refused, and the one rank of a world-1 plan is priced against its 70 GB."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=index,uuid,name,memory.free,pci.bus_id ]"
                   " || exit 9\n"
                   "echo '0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81000, 00000000:1B:00.0'\n"
                   "echo '1, GPU-bbbb, NVIDIA H100 80GB HBM3, 66758, 00000000:43:00.0'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    devices = detect_devices()
    assert devices.kind == "cuda" and devices.names == ("NVIDIA H100 80GB HBM3",)
    assert devices.buses == ("0000:43:00.0",)  # as sysfs names it, for the NUMA binding
    assert devices.free_gb == pytest.approx((66758 * 2**20 / 1e9,))
    with pytest.raises(SpecError, match="only 1 GPUs are visible"):
        guard_memory(_qwen_plan(2, ep=2), RunOptions(), nproc=2, devices=devices)
    big = Plan(model=load_model("llama3-70b"), cluster=load_cluster("h100", gpus=1),
               training=TrainingSpec(seq_len=4096, global_batch_size=1),
               layout=Layout.build(1, 1))
    with pytest.raises(SpecError) as e:
        guard_memory(big, RunOptions(), nproc=1, devices=devices)
    said = str(e.value)
    assert "GPU 0 (NVIDIA H100 80GB HBM3) has 70.0 GB free" in said and "bf16" in said
    assert "--scale-down" in said and "more nodes" not in said  # one rank: no node to add


def test_the_guard_offers_more_nodes_only_when_one_rank_alone_fits():
    """Two ranks of a 373.8 GB-per-rank run on a 23 GB host were told to try `--nnodes 2
    --nproc-per-node 1`, which cannot work: each node would still hold a whole rank. The guard
    says why more nodes cannot help and offers what can (--scale-down)."""
    big = Plan(model=load_model("llama3-70b"), cluster=load_cluster("h100", gpus=2),
               training=TrainingSpec(seq_len=4096, global_batch_size=2),
               layout=Layout.build(2, 2, tp=2))
    host = Devices("cpu", (23.0,))
    (rank,) = price_ranks(big, [0], "fp32", "cpu")
    assert rank.total_gb > 23.0
    with pytest.raises(SpecError) as e:
        guard_memory(big, RunOptions(), nproc=2, devices=host)
    said = str(e.value)
    assert "--nnodes" not in said and "--scale-down" in said
    assert f"one rank alone (rank 0) needs about {rank.total_gb:.1f} GB" in said
    assert "More nodes cannot help" in said
    small = _qwen_plan(2, ep=2)  # each rank fits alone, both together do not: more nodes help
    need = price_ranks(small, [0, 1], "fp32", "cpu")
    tight = Devices("cpu", (max(n.total_gb for n in need) + 0.5,))
    with pytest.raises(SpecError) as e:
        guard_memory(small, RunOptions(scale_down=True), nproc=2, devices=tight)
    assert "--nnodes 2 --nproc-per-node 1" in str(e.value)
    assert "cannot help" not in str(e.value)


def test_gpu_workers_are_bound_to_their_gpus_numa_nodes_as_the_priced_runs_were(tmp_path):
    """On GPUs `moeplan run` starts torchrun with `--numa-binding node` (torch binds each worker
    through numactl), as NVIDIA's performance launches bind the ranks the host launch time is
    fitted on; without numactl it says in one line that the run is not the one priced; a CPU
    run has no GPU to bind near."""
    buses = tuple(f"0000:{b:02x}:00.0" for b in range(8))
    gpus = Devices("cuda", (80.0,) * 8, buses=buses)
    near = {bus: ({0, 1} if i < 4 else {2, 3}) for i, bus in enumerate(buses)}.get
    assert numa_binding(gpus, 8, "/usr/bin/numactl", cpus_near=near) == (True, None)
    bound, note = numa_binding(gpus, 8, None, cpus_near=near)
    assert not bound and "numactl not found" in note and "install numactl" in note
    bound, note = numa_binding(gpus, 8, "/usr/bin/numactl", False, near)  # torch before 2.9
    assert not bound and "has no --numa-binding" in note
    parser = pytest.importorskip("torch.distributed.run").get_args_parser()
    takes = "numa_binding" in vars(parser.parse_args(["train.py"]))
    assert torchrun_binds_numa() is takes  # read from its source, as its parser says
    # a job whose CPU mask leaves GPU 5's node no CPU: torch would fail the launch, so unbound
    masked = {**{b: near(b) for b in buses}, buses[5]: set()}.get
    bound, note = numa_binding(gpus, 8, "/usr/bin/numactl", cpus_near=masked)
    assert not bound and "GPU 5's NUMA node has none of the CPUs this job may use" in note
    assert numa_binding(Devices("cpu", (23.0,)), 2, "/usr/bin/numactl") == (False, None)
    assert numa_binding(Devices("cuda", (80.0,) * 2, buses=buses[:2]), 4,
                        "/usr/bin/numactl", cpus_near=near)[0] is False
    argv = torchrun_command(RunOptions(), tmp_path, 8, numa=True)
    agent = argv.index("moeplan.runtime.agent")
    ns = pytest.importorskip("torch.distributed.run").parse_args(argv[agent + 1:])
    assert str(getattr(ns.numa_binding, "value", ns.numa_binding)) == "node"
    unbound = torchrun_command(RunOptions(), tmp_path, 8)
    assert "--numa-binding" not in unbound


def test_every_node_is_priced_when_the_rendezvous_decides_the_node_rank():
    assert node_ranks(8, 2, 1, 4) == [[4, 5, 6, 7]]
    assert node_ranks(8, 2, None, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.slow
def test_scale_down_prints_its_size_and_predicts_the_shrunken_run_here(cli, tmp_path):
    estimate = {"step_time_s": 9.0, "tokens_per_s_per_gpu": 7.0, "tflops_per_gpu": 400.0,
                "mfu": 0.4, "memory": {"peak_gb": 70.0, "weights_gb": 1, "grads_gb": 1,
                                       "optimizer_gb": 1, "activations_gb": 1,
                                       "buffers_gb": 1},
                "time": {"compute_s": 8.0}, "bottleneck": "compute", "fits": True}
    doc = json.loads(_qwen_plan(2, ep=2).model_dump_json())
    doc["estimate"] = estimate
    path = tmp_path / "q30.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "small"
    r = cli("run", str(path), "--scale-down", "--steps", "2", "--out", str(out),
            "--cluster", "h100", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    said = " ".join(r.stderr.split())
    assert "--scale-down: qwen3-30b-a3b 30.5 B →" in said and "parameters" in said
    summary = json.loads((out / "summary.json").read_text())
    predicted = summary["predicted"]
    assert predicted["step_time_s"] != 9.0 and predicted["step_time_s"] < 0.1  # not the plan's
    assert 0 < predicted["peak_mem_gb"] < 2  # the small model's ranks, not 70 GB
    assert any("on this machine" in n for n in summary["notes"])
    assert any("2 × H100-SXM (h100)" in n for n in summary["notes"])


# -------------------------------------------------------------------------------- refusals
def test_each_refusal_names_a_fix_that_removes_it():
    mtp = Plan(model=load_model("deepseek-v3"), cluster=load_cluster("h100", gpus=48),
               training=TrainingSpec(seq_len=4096, global_batch_size=48),
               layout=Layout.build(48, 48, tp=2, pp=3, ep=8),
               choices=Choices(stage_layout="Et*31|t*30m|L"))
    (refusal,) = features_not_executed(mtp)
    fixed = refusal.split("--stage-layout '")[1].split("'")[0]
    assert features_not_executed(mtp.model_copy(update={
        "choices": Choices(stage_layout=fixed)})) == []
    plan = _qwen_plan(8, ep=8)
    gather = plan.model_copy(update={"training": plan.training.model_copy(update={
        "precision": "fp8-tensorwise", "fp8_param_gather": True})})
    (refusal,) = features_not_executed(gather)
    assert "`fp8_param_gather: false`" in refusal and "--format megatron" in refusal
    assert features_not_executed(gather.model_copy(update={"training": gather.training
                                                   .model_copy(update={
                                                       "fp8_param_gather": False})})) == []


@pytest.mark.slow
def test_a_refused_plan_exits_2_with_the_fix_before_any_worker_starts(cli, tmp_path):
    path = tmp_path / "gather.json"
    write_plan(path, 2, ep=2)
    doc = json.loads(path.read_text())
    doc["training"].update(precision="fp8-tensorwise", fp8_param_gather=True)
    path.write_text(json.dumps(doc))
    r = cli("run", str(path), "--steps", "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "`fp8_param_gather: false`" in " ".join(r.stderr.split())


# ------------------------------------------------------------------------------ multi-node
def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _slurm_launch_line(plan: str) -> str:
    """The command `moeplan export --format slurm` has srun run once per node."""
    script = to_slurm(load_plan(plan), nnodes=2, plan_path=plan)
    srun = script[script.index("srun "):].replace("\\\n", " ").split(" || code=$?")[0]
    return srun.split("--ntasks-per-node=1 ", 1)[1].replace("moeplan run", f"{sys.executable} "
                                                           "-m moeplan run", 1).strip()


@pytest.mark.slow
def test_two_localhost_nodes_of_two_ranks_match_the_single_process_losses(cli, tmp_path):
    """tp2·ep2·dp2 over two `moeplan run` launchers, each started as the exported Slurm script
    starts it on its node (SLURM_* set, rendezvous on the first node: here 127.0.0.1). The dp
    and edp groups cross the node boundary; fp32 losses equal one process's."""
    steps = "3"
    single = tmp_path / "single"
    r = cli("run", write_plan(tmp_path / "w1.json", 1), "--steps", steps, "--seed", "7",
            "--out", str(single), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = write_plan(tmp_path / "w4.json", 4, tp=2, ep=2)
    out = tmp_path / "two-nodes"
    line = f"{_slurm_launch_line(plan)} --seed 7 --out {out}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "DATA": "synthetic", "STEPS": steps, "CKPT_DIR": str(tmp_path / "ckpt"),
           "MASTER_PORT": str(_free_port()), "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2",
           "SLURM_JOB_NODELIST": "localhost"}
    nodes = [subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**env, "SLURM_PROCID": str(k), "SLURM_NODEID": str(k)})
             for k in (0, 1)]
    results = [node.communicate(timeout=400) for node in nodes]
    for node, (_, err) in zip(nodes, results, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert json.loads((out / "summary.json").read_text())["world_size"] == 4
    got, want = _losses(out), _losses(single)
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=0)


def test_a_stop_without_a_summary_says_the_workers_were_killed_and_names_the_newest_step(
        tmp_path):
    """After a second signal (or the grace period) the workers report nothing: the line says
    so and names the newest sealed step, instead of "before the workers reached a step
    boundary; nothing trained since the last one", which a run of thousands of steps read."""
    from moeplan.runtime.launch import Stopped

    line = str(Stopped(signal.SIGTERM, None, str(tmp_path / "none")))
    assert "killed before they reported" in line and "no checkpoint" in line
    assert "nothing trained" not in line and line.endswith("(exit 75)")


def test_the_parent_a_rank_checks_is_its_own_never_one_it_inherited(monkeypatch, capsys):
    """A rank of someone else's torchrun exits at once when the parent it started under is
    gone (`lifecycle.START_PPID_ENV`); a record inherited from an ancestor moeplan would name
    another parent and kill a healthy rank, so every process records its own."""
    from moeplan.cli import main

    monkeypatch.setenv("MOEPLAN_START_PPID", "1")
    monkeypatch.setenv("MOEPLAN_START_PID", "1")  # an ancestor's record
    assert main(["--version"]) == 0
    capsys.readouterr()
    assert os.environ["MOEPLAN_START_PPID"] == str(os.getppid())
    assert os.environ["MOEPLAN_START_PID"] == str(os.getpid())


def _launcher_with_agent_stood_in(monkeypatch, tmp_path, agent):
    """launch.run on a world-1 plan for real up to the torchrun agent, which `agent` stands
    in for (what the launcher decides from the agent's exit is under test)."""
    from moeplan.runtime import launch
    from tests.test_run_cli import write_plan

    monkeypatch.setattr(launch, "_run_agent", agent)
    plan = write_plan(tmp_path / "w1.json", 1)
    return lambda: launch.run(plan, steps=2, out=str(tmp_path / "out"))


def test_a_stop_while_the_launcher_prepares_exits_75_having_started_nothing(monkeypatch,
                                                                              tmp_path):
    """A SIGTERM before the launcher's handlers existed (while it hashed a large checkpoint,
    say) killed it with 143, or a SIGINT with a traceback; a preemption must exit 75."""
    from moeplan.errors import exit_code
    from moeplan.runtime import launch

    def never(*_a):
        raise AssertionError("the agent started after a stop")

    verified = launch.verified_resume

    def stopped_while_verifying(running, opts):
        os.kill(os.getpid(), signal.SIGTERM)
        return verified(running, opts)

    monkeypatch.setattr(launch, "verified_resume", stopped_while_verifying)
    run = _launcher_with_agent_stood_in(monkeypatch, tmp_path, never)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(launch.Stopped) as e:
        run()
    assert exit_code(e.value) == 75 and "before any worker started; nothing was run" in str(
        e.value)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler it found is back
    assert not (tmp_path / "out" / "run.json").exists()  # nothing written for workers


def test_a_stop_checkpoint_that_cannot_be_written_exits_2_not_75(monkeypatch, tmp_path):
    """The workers refused (exit 2: rank 0 said the stop's checkpoint could not be written)
    after a SIGTERM: the launcher said they were killed before reporting and exited 75,
    which tells a scheduler to requeue onto the same full disk."""
    from moeplan.errors import RunRefused, exit_code

    run = _launcher_with_agent_stood_in(monkeypatch, tmp_path,
                                        lambda *_a: (2, signal.SIGTERM, False))
    with pytest.raises(RunRefused) as e:
        run()
    assert exit_code(e.value) == 2


def test_a_stop_whose_workers_ended_unkilled_does_not_say_they_were_killed(monkeypatch,
                                                                           tmp_path):
    from moeplan.runtime.launch import Stopped

    run = _launcher_with_agent_stood_in(monkeypatch, tmp_path,
                                        lambda *_a: (1, signal.SIGTERM, False))
    with pytest.raises(Stopped) as e:
        run()
    assert "killed" not in str(e.value) and "without reporting" in str(e.value)


def test_a_resume_names_each_setting_it_changes(tmp_path, capsys):
    from moeplan.runtime.launch import _say_changed
    from moeplan.specs import load_plan
    from tests.test_run_cli import write_plan

    saved = load_plan(write_plan(tmp_path / "p.json", 1))
    running = saved.model_copy(update={"training": saved.training.model_copy(
        update={"lr": 5e-5, "clip_grad": 0.0})})
    _say_changed(tmp_path / "step_00000002", {"step": 2, "dtype": "fp32"}, saved, running,
                 RunOptions(dtype="bf16"))
    said = " ".join(capsys.readouterr().err.split())
    assert f"lr {saved.training.lr} → 5e-05" in said and "clip_grad 1.0 → 0.0" in said
    assert "--dtype fp32 → bf16" in said and "continues at step 2" in said
    _say_changed(tmp_path / "step_00000002", {"step": 2}, saved, saved, RunOptions())
    assert not capsys.readouterr().err


def test_a_skipped_step_is_marked_on_the_progress_line(tmp_path):
    """Rich read "[skipped: ...]" as a markup tag and printed nothing of it."""
    from rich.console import Console

    from moeplan.runtime.runlog import RunLog
    from moeplan.runtime.train import StepMetrics

    console = Console(record=True, width=200)
    log = RunLog(tmp_path, RunOptions(steps=1), console, None, 8)
    metrics = StepMetrics(step=1, loss=float("nan"), grad_norm=float("nan"), lr=1e-3,
                          step_time_s=1.0, tokens_per_s=1.0, tflops_per_gpu=1.0,
                          peak_mem_gb=1.0, skipped=True)
    log.step(metrics, None)
    assert "skipped: non-finite loss or gradient" in console.export_text()


def test_a_blend_checkpoint_of_an_earlier_sampler_is_refused_a_single_dataset_one_is_not(
        tmp_path):
    """Blends are drawn in another order than before (`corpus.SAMPLER`): resuming a blend's
    checkpoint saved by an earlier moeplan would read other samples. One dataset, or a blend
    with one positive weight, is drawn as before."""
    from moeplan.runtime.launch import _same_data
    from moeplan.specs import load_plan
    from tests.test_run_cli import write_plan

    plan = load_plan(write_plan(tmp_path / "p.json", 1))
    old = {"data": "0.5 a 0.5 b", "split": None, "step": 3}  # no `sampler`: an earlier moeplan
    with pytest.raises(SpecError, match="drew its samples in another order"):
        _same_data(tmp_path / "step_3", old, plan, plan, RunOptions(data="0.5 a 0.5 b"))
    for data in ("a", "1 a 0 b"):
        _same_data(tmp_path / "step_3", {**old, "data": data}, plan, plan, RunOptions(data=data))
