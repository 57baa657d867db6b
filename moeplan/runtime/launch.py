"""`moeplan run`: check the plan, then launch torchrun workers (or join an existing launch).

Everything that can be refused is refused here, in the launching process, before any worker
starts: an invalid layout, a world size that does not match the processes, a plan feature the
runtime does not execute yet (each with its fix), a run that cannot fit in the memory present
(guard.py). This module imports no torch, so those errors are instant. What passed is written
once, with the options, to OUT/run.json (`options.PreparedRun`); the workers read that file and
never prepare the plan themselves. The torchrun line comes from `moeplan.launch_lines`, the builder
`moeplan export` uses too.

Lifecycle (lifecycle.py): torchrun's agent runs in a session of its own under a parent-death
signal, so neither it nor its workers outlive this process, SIGKILLed or not. SIGINT and SIGTERM
are passed on; the workers stop at the next step boundary (checkpointing when --ckpt-dir is
given) and this process exits 130 (SIGINT) or 75 (SIGTERM, preemption) after one line, also
when the signal went to one worker only (the workers agree on it; summary.json says which). A
second signal, or workers still busy STOP_GRACE_S later, kills them at once. A single-node run
holds the --ckpt-dir lock (storage.CkptLock) for its whole life.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .. import limits
from ..errors import (
    MoeplanError,
    NotYetAvailable,
    RunFailed,
    RunRefused,
    RunStopped,
    SpecError,
)
from ..fsio import FileRefused, check_writable_dir, loads_json, read_regular
from ..launch_lines import torchrun_args
from ..specs import Plan, check_layout, load_plan
from .lifecycle import LAUNCHER_PID_ENV, STOP_EXIT_CODES, bootstrap_command, stop_exit_code
from .options import PreparedRun, RunOptions
from .settings import apply_settings, check_run_inputs, keeps_vocabulary
from .storage import (
    LOCKED_ENV,
    CkptLock,
    check_ckpt_dir,
    complete_steps,
    held_steps,
    resume_point,
    step_of,
    verify_step,
)
from .support import features_not_executed, settings_not_executed, without_speed_settings

if TYPE_CHECKING:
    from .guard import Devices

STOP_GRACE_S = 120.0  # after a stop signal: time for the step in flight and its checkpoint


class Stopped(RunStopped):
    """The run was stopped by SIGINT or SIGTERM: exit 130 or 75, with one line saying where."""

    def __init__(self, signum: int, summary: dict | None, ckpt_dir: str | None,
                 quiet: bool = False, killed: bool = True, started: bool = True):
        name = signal.Signals(signum).name
        code = stop_exit_code(signum)
        self.signum, self.summary = signum, summary
        if quiet:  # a rank other than 0 of a joined launch: rank 0 says it
            super().__init__(code, "")
            return
        if not started:  # before any worker: checking the plan, the data or the checkpoint
            super().__init__(code, f"stopped by {name} before any worker started; nothing was "
                             f"run (exit {code})")
            return
        if summary is None:  # no report: killed (a second signal, the grace ran out), or not
            newest = complete_steps(ckpt_dir) if ckpt_dir else []
            then = (f"the newest checkpoint is step {newest[-1]}; continue with --resume"
                    if newest else "no checkpoint" + ("" if ckpt_dir else " (no --ckpt-dir)"))
            how = (f"the workers were killed before they reported where (a second signal, or no "
                   f"step boundary within {STOP_GRACE_S:.0f} s)" if killed else
                   "the workers ended without reporting where (the lines above say why)")
            super().__init__(code, f"stopped by {name}; {how}; {then} (exit {code})")
            return
        at = summary.get("preempted_at") or 0
        where = f"at step {at}" if at else "before the workers reached a step boundary"
        saved = summary.get("stop_checkpoint")
        if saved:
            then = f"checkpoint {saved}; continue with --resume"
        elif ckpt_dir:
            then = "no new checkpoint (nothing trained since the last one)"
        else:
            then = "no checkpoint (no --ckpt-dir)"
        super().__init__(code, f"stopped by {name} {where}; {then} (exit {code})")


def prepare_plan(plan: Plan | str | Path, opts: RunOptions) -> tuple[Plan, Plan]:
    """(plan as given, plan as it will run): validated, refused features named, scaled down."""
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    plan = apply_settings(plan, opts)  # --lr ... --train-iters into its training section
    assert opts.steps is not None
    if opts.steps < 1:
        raise SpecError(f"--steps must be at least 1, got {opts.steps}.")
    limits.check("--steps", opts.steps, limits.MAX_STEPS, "train fewer steps")
    limits.check_seed(opts.seed)
    if opts.dtype not in (None, "fp32", "bf16"):
        raise SpecError(f"--dtype takes fp32 or bf16, got {opts.dtype!r}.")
    if opts.ckpt_every < 0 or opts.max_restarts < 0 or opts.ckpt_keep < 0:
        raise SpecError("--ckpt-every, --max-restarts and the number of checkpoints kept must "
                        "not be negative.")
    if opts.max_nonfinite_steps < 1:
        raise SpecError("the number of non-finite steps tolerated in a row must be at least 1.")
    if not 0.05 <= opts.distributed_timeout_minutes <= limits.MAX_DIST_TIMEOUT_MINUTES:
        raise SpecError(f"--distributed-timeout-minutes must be between 0.05 and "
                        f"{limits.MAX_DIST_TIMEOUT_MINUTES:,}, got "
                        f"{opts.distributed_timeout_minutes}.")
    for flag, used in (("--resume", opts.resume), ("--ckpt-every", opts.ckpt_every),
                       ("--max-restarts", opts.max_restarts)):
        if used and not opts.ckpt_dir:
            raise SpecError(f"{flag} needs --ckpt-dir DIR (where checkpoints are written and "
                            "resumed from). Nothing was run.")
    missing = features_not_executed(plan)
    if missing:
        raise NotYetAvailable("the runtime does not execute yet what this plan uses: "
                              + "; ".join(missing) + ". Nothing was run.")
    # the rest of the rules of this executor (a `megatron` plan runs here as well, per-stage
    # choices included: the runtime's own rules are the ones that apply)
    check_layout(plan.model, plan.training, plan.layout, choices=plan.choices, target="moeplan")
    running = plan
    skipped = settings_not_executed(plan)
    if skipped:  # speed settings only: the same function runs without them
        print(f"note: this runtime runs without {' and '.join(skipped)}; the step time it "
              "measures is without them.", file=sys.stderr)
        running = without_speed_settings(plan)
    if opts.scale_down:
        from .scale import scale_down_plan

        running = scale_down_plan(running, keep_vocab=keeps_vocabulary(opts))
        check_layout(running.model, running.training, running.layout, choices=running.choices,
                     target="moeplan")
    for line in check_run_inputs(running, opts):  # data, split, tokenizer, eval, logs
        print(f"data {line}", file=sys.stderr)
    if opts.init_from:
        if opts.scale_down:
            raise SpecError("--init-from loads the checkpoint's full-size weights; drop "
                            "--scale-down (or plan a smaller model). Nothing was run.")
        from .hf_io import check_hf_dir

        check_hf_dir(running.model, opts.init_from)
    return plan, running


def check_resume(running: Plan, opts: RunOptions) -> int:
    """The step a run with `--resume` starts from (0: no checkpoint yet); see `verified_resume`."""
    return verified_resume(running, opts)[0]


def verified_resume(running: Plan, opts: RunOptions) -> tuple[int, str | None]:
    """(the step a run with `--resume` starts from, 0 if none; the SHA-256 of that step's
    manifest), after verifying the newest checkpoint completely (`storage.verify`) and that it
    holds the same model and seed, and read the same data at the same positions (`_same_data`);
    without `--resume`, a --ckpt-dir holding checkpoints is refused.

    Runs in the launcher, before any worker starts: a corrupt, tampered or older-format
    checkpoint is refused by file name instead of failing (or silently diverging) inside the
    workers, which then load exactly this step. Newer `step_*` directories without a manifest
    are not checkpoints: they are named on stderr, passed over, and removed at the next save.
    """
    if not opts.resume:
        old = held_steps(opts.ckpt_dir) if opts.ckpt_dir else []
        if old:  # a fresh run would mix its checkpoints with another run's
            raise SpecError(f"--ckpt-dir {opts.ckpt_dir} already holds checkpoints (newest: "
                            f"step {old[-1]}); pass --resume to continue from it, or give "
                            "another --ckpt-dir. Nothing was run.")
        return 0, None
    path, skipped = resume_point(opts.ckpt_dir or "")
    for s in skipped:
        print(f"warning: {s} has no manifest.json, so it is not a checkpoint (never sealed, or "
              "its manifest was removed); it is passed over"
              + (f" for {path.name}" if path else "") + " and removed at the next save.",
              file=sys.stderr)
    if path is None:
        # a job script that always passes --resume starts here the first time; a mistyped
        # --ckpt-dir does too, so it is said
        print(f"--resume: no checkpoint in {opts.ckpt_dir} yet; starting at step 0.",
              file=sys.stderr, flush=True)
        return 0, None
    v = verify_step(path.parent, step_of(path.name) or 0)  # the rule list and export use
    saved = load_plan(path / "plan.json")
    if saved.model != running.model:
        raise SpecError(f"checkpoint {path} holds model {saved.model.name!r} with other "
                        f"dimensions than the plan's {running.model.name!r}; resume under a plan "
                        "of the same model (its layout may differ).")
    if v.meta["seed"] != opts.seed:
        raise SpecError(f"checkpoint {path} was trained with --seed {v.meta['seed']}; resume "
                        f"with the same seed (got {opts.seed}), or the data order would change.")
    _same_data(path, v.meta, saved, running, opts)
    _say_changed(path, v.meta, saved, running, opts)
    if v.step >= opts.steps:
        raise SpecError(f"checkpoint {path} is already at step {v.step}; --steps {opts.steps} "
                        "is the step to reach, so there is nothing to train.")
    return v.step, v.manifest_sha256


FROM_WEIGHTS = "`moeplan checkpoint export DIR --to hf -o HF`, then `--init-from HF`"


def _say_changed(path: Path, meta: dict, saved: Plan, running: Plan, opts: RunOptions) -> None:
    """One note naming each training setting (and --dtype) the resumed run changes from the
    checkpoint's: allowed (a new schedule for a continued run is common), never silent."""
    was, now = saved.training.model_dump(), running.training.model_dump()
    changed = [f"{k} {was[k]} → {now[k]}" for k in now if k in was and was[k] != now[k]]
    if opts.dtype and meta.get("dtype") not in (None, opts.dtype):
        changed.append(f"--dtype {meta['dtype']} → {opts.dtype}")
    if changed and os.environ.get("RANK", "0") == "0":  # a joined launch: rank 0 says it
        print(f"note: resuming {path.name} under other settings than it was trained with: "
              f"{'; '.join(changed)}. The weights and optimizer state carry on; the schedule "
              f"continues at step {meta.get('step')}.", file=sys.stderr, flush=True)


def _same_data(path: Path, meta: dict, saved: Plan, running: Plan, opts: RunOptions) -> None:
    """Refuse a resume that would read other samples than the run it continues: another
    --data or --split (the checkpoint's meta.json), or another global batch or sequence length
    (the data position of step s is s × global batch windows of seq + 1 tokens)."""
    from ..data.corpus import SAMPLER, data_key

    was_data, was_split = meta.get("data", "synthetic"), meta.get("split")
    key = data_key(opts.data, opts.split)  # (prefixes, weights, split), or ("synthetic", split)
    try:
        same = data_key(str(was_data), was_split) == key
    except SpecError:  # the checkpoint's data no longer parses (moved): not the same
        same = False
    if not same:
        raise SpecError(f"checkpoint {path} was trained on --data {limits.clip(str(was_data))} "
                        f"--split {was_split or 'default'}; resume with the same data and split "
                        f"(got --data {limits.clip(opts.data)} --split {opts.split or 'default'}),"
                        f" or start a new --ckpt-dir from its weights ({FROM_WEIGHTS}).")
    drawn = (0 if key[0] == "synthetic" else len(key[0]) if key[1] is None
             else sum(w > 0 for w in key[1]))
    if drawn > 1 and meta.get("sampler") != SAMPLER:
        raise SpecError(f"checkpoint {path} was trained on this blend by an earlier moeplan, "
                        "which drew its samples in another order (docs/DATA.md); resuming would "
                        "read other samples than the run it continues. Start a new --ckpt-dir "
                        f"from its weights ({FROM_WEIGHTS}).")
    st, rt = saved.training, running.training
    if (st.global_batch_size, st.seq_len) != (rt.global_batch_size, rt.seq_len):
        raise SpecError(f"checkpoint {path} was trained at a global batch of "
                        f"{st.global_batch_size} sequences of {st.seq_len} tokens, this plan "
                        f"runs {rt.global_batch_size} of {rt.seq_len}: step s reads samples from "
                        "s × global batch, so resuming would skip or repeat data. Resume under "
                        "the same batch and sequence length, or start a new --ckpt-dir from its "
                        f"weights ({FROM_WEIGHTS}).")


def _joined_environment(opts: RunOptions) -> dict[str, str] | None:
    """RANK/WORLD_SIZE/LOCAL_RANK of an enclosing torchrun or SLURM launch, else None.

    Inside a SLURM job, `moeplan run --nnodes N --rdzv-endpoint ...` (one task per node, as
    `moeplan export --format slurm` writes) is a launcher, not a rank."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= env.keys():
        return {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in env}
    launcher = opts.nnodes > 1 or opts.rdzv_endpoint is not None
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and not launcher:
        if "MASTER_ADDR" not in env:
            raise SpecError("inside a SLURM job with several tasks, set MASTER_ADDR (the first "
                            "node's address) and MASTER_PORT, or launch through torchrun.")
        return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
                "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    return None


def default_out(plan: Plan | str | Path) -> Path:
    stem = Path(plan).stem if not isinstance(plan, Plan) else plan.model.name
    return Path("runs") / stem


def guard_memory(running: Plan, opts: RunOptions, nproc: int, devices=None) -> None:
    """Refuse (exit 2, within a second or two) a run whose ranks on this node cannot fit in the
    memory present, naming what it needs, what there is, and the fixes. See guard.py."""
    from . import guard

    devices = devices or guard.detect_devices()
    if not devices.free_gb:
        return  # nothing known about this machine's memory: let it run
    dtype = guard.run_dtype(opts.dtype, devices)
    world = running.layout.world_size
    nodes = guard.node_ranks(world, opts.nnodes, opts.node_rank, nproc)
    needs = max((guard.price_ranks(running, ranks, dtype, devices.kind) for ranks in nodes),
                key=lambda ns: sum(n.total_gb for n in ns))
    why = guard.shortfall(needs, devices)
    if why is None:
        return
    fixes = []
    if not opts.scale_down:
        from .scale import scale_down_plan

        small = scale_down_plan(running, keep_vocab=keeps_vocabulary(opts))
        small_needs = guard.price_ranks(small, [n.rank for n in needs], dtype, devices.kind)
        if guard.shortfall(small_needs, devices) is None:
            fixes.append(f"`--scale-down` (the same parallel degrees on a "
                         f"{small.model.total_params() / 1e6:.1f} M-parameter model, about "
                         f"{sum(n.total_gb for n in small_needs):.1f} GB here)")
    alone = guard.one_rank_fits(needs, devices)
    if nproc > 1 and alone:
        fixes.append(f"more nodes (`--nnodes {opts.nnodes * 2} --nproc-per-node {nproc // 2}` "
                     "on each, with --rdzv-endpoint)")
    fixes.append("a smaller plan (`moeplan search` over more GPUs shards weights and "
                 "optimizer states further; recompute and a smaller --gbs cut activations)")
    why_not = "" if alone else " " + guard.why_more_nodes_cannot_help(needs, devices)
    raise SpecError(f"this run does not fit in memory: {why}, priced by the cost model at "
                    f"{dtype}. Nothing was run.{why_not} Fix: " + "; or ".join(fixes) + ".")


def run(plan: Plan | str | Path, **options: object) -> dict:
    """Train under `plan` and return the run summary (also written to OUT/summary.json).

    Launches `torchrun` with the plan's world size on this node unless told otherwise, or runs
    this process as one worker when already inside a torchrun/SLURM launch. Raises Stopped
    when SIGINT/SIGTERM stopped the run, RunFailed when workers failed.
    """
    opts = RunOptions(**options)  # type: ignore[arg-type]
    joined = _joined_environment(opts)
    if joined is not None:
        from .lifecycle import START_PPID_ENV, set_parent_death_signal

        # this process is a rank: it dies with its launcher, armed before the plan is
        # prepared and a resume verified (seconds), and gone at once if the launcher already is
        set_parent_death_signal(START_PPID_ENV)
        return _run(plan, opts, joined, [])
    with _stops_recorded() as early:
        return _run(plan, opts, None, early)


@contextlib.contextmanager
def _stops_recorded() -> Iterator[list[int]]:
    """SIGINT and SIGTERM received while the launcher prepares the run (the plan, the data's
    scan, the checkpoint's hashes: minutes for a large checkpoint), recorded rather than fatal,
    so that a preemption then exits 75 with one line, not 143 or a traceback; a second one
    stops the preparation at once, as a second one kills the workers (`_run_agent`)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def record(signum: int, _frame: object) -> None:
        got.append(signum)
        if len(got) > 1:
            raise Stopped(got[0], None, None, started=False)

    previous = {s: signal.signal(s, record) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run(plan: Plan | str | Path, opts: RunOptions, joined: dict[str, str] | None,
         early: list[int]) -> dict:
    """`run` after the launch is known: joined (this process is one rank) or ours."""
    given, running = prepare_plan(plan, opts)
    if opts.cluster:
        from .guard import check_cluster_ref

        check_cluster_ref(opts.cluster)
    world = running.layout.world_size
    out = Path(opts.out) if opts.out else default_out(plan)
    opts.out = str(out)
    check_outputs(out)
    if joined is not None:
        if int(joined["WORLD_SIZE"]) != world:
            raise SpecError(f"the plan needs {world} processes (tp·cp·dp·pp) but this launch "
                            f"has WORLD_SIZE={joined['WORLD_SIZE']}; launch {world} processes.")
        if opts.ckpt_dir:  # global rank 0's worker takes the directory's lock (worker.py)
            check_ckpt_dir(opts.ckpt_dir)
        opts.resume_step, opts.resume_manifest = verified_resume(running, opts)
        prepared = PreparedRun(given, running, opts)
        os.environ.pop(LOCKED_ENV, None)
        os.environ.update(joined)
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(opts.nproc_per_node or world))
        os.environ.setdefault("MASTER_PORT", "29500")
        from .worker import run_worker

        # global rank 0 writes OUT: it holds it for the run, as a launcher of its own would
        with _out_lock(plan, out, opts) if joined.get("RANK", "0") == "0" else \
                contextlib.nullcontext():
            if joined.get("RANK", "0") == "0":
                prepared.write_plan(out)
            signum = run_worker(prepared, out)  # in this process: the plan is prepared
        rank0 = joined.get("RANK", "0") == "0"
        summary = _read_summary(out / "summary.json") if rank0 else None
        if signum:
            raise Stopped(signum, summary, opts.ckpt_dir, quiet=not rank0)
        return summary or {}  # rank 0 reports for the run
    nproc = opts.nproc_per_node or world // max(1, opts.nnodes)
    if nproc * opts.nnodes != world:
        raise SpecError(f"the plan needs {world} processes (tp·cp·dp·pp) but --nnodes "
                        f"{opts.nnodes} × --nproc-per-node {nproc} = {nproc * opts.nnodes}; "
                        f"make their product {world}.")
    if opts.nnodes > 1 and not opts.rdzv_endpoint:
        raise SpecError("a multi-node launch needs --rdzv-endpoint HOST:PORT (the same on "
                        "every node).")
    if opts.scale_down:
        from .scale import describe_scale_down

        print(describe_scale_down(given, running, keeps_vocabulary(opts)), file=sys.stderr,
              flush=True)
    from . import guard

    devices = guard.detect_devices()
    guard_memory(running, opts, nproc, devices)
    bind, note = numa_binding(devices, nproc, shutil.which("numactl"),
                              guard.torchrun_binds_numa())
    if note:
        print(note, file=sys.stderr, flush=True)
    with contextlib.ExitStack() as held:
        env = dict(os.environ)
        env.pop(LOCKED_ENV, None)
        if opts.ckpt_dir and opts.nnodes == 1:  # the whole run is this tree: lock it here
            held.enter_context(CkptLock(opts.ckpt_dir, _describe(plan, out)))
            env[LOCKED_ENV] = "1"
        elif opts.ckpt_dir:  # several nodes: global rank 0's worker takes the lock
            check_ckpt_dir(opts.ckpt_dir)
        # this tree is the whole run: OUT is its alone (several nodes may share one OUT on a
        # shared file system, each writing its run.json there). An OUT that exists may be
        # busy: it is held before the checkpoint is verified (minutes of hashing for a large
        # one), so a second run is refused at once; one that does not is made only once the
        # checkpoint has been accepted
        lock_out = opts.nnodes == 1
        if lock_out and out.is_dir():
            held.enter_context(_out_lock(plan, out, opts))
            lock_out = False
        opts.resume_step, opts.resume_manifest = verified_resume(running, opts)
        if early:  # a stop while the run was prepared: nothing has started or been written
            raise Stopped(early[0], None, opts.ckpt_dir, started=False)
        if lock_out:
            held.enter_context(_out_lock(plan, out, opts))
        # OUT/plan.json (the plan as given, next to its summary: `calibrate --from-runs`
        # re-predicts it) and OUT/run.json, what every worker reads
        PreparedRun(given, running, opts).write(out)
        env.setdefault("OMP_NUM_THREADS", str(max(1, limits.usable_cpus() // nproc)))
        env[LAUNCHER_PID_ENV] = str(os.getpid())
        started = time.time()
        code, signum, killed = _run_agent(torchrun_command(opts, out, nproc, bind), env, early)
    summary_path = out / "summary.json"
    fresh = summary_path.is_file() and summary_path.stat().st_mtime >= started - 1
    summary = _read_summary(summary_path) if fresh else None
    if code == 2:  # the workers refused to go on (a checkpoint that cannot be written, even
        raise RunRefused()  # the stop's): rank 0 said why in one paragraph; no requeue helps
    stop = signum or _stopped_by(summary)  # this process, or any one worker, got the signal
    if stop and not (summary and not summary.get("preempted_at") and code == 0):
        raise Stopped(stop, summary, opts.ckpt_dir,  # (a run that finished anyway returns)
                      killed=killed)
    if code < 0:  # the agent itself was killed (its workers die with it): as a shell says it
        name = signal.Signals(-code).name
        raise RunFailed(128 - code, f"the torchrun agent was killed by {name}, and its workers "
                        f"with it (exit {128 - code})")
    if code:
        raise RunFailed(code)
    return summary or {}


def _out_lock(plan: Plan | str | Path, out: Path,
              opts: RunOptions) -> contextlib.AbstractContextManager:
    """The run's hold on --out (`storage.CkptLock`): a second run there would have its workers
    read this run's run.json. An OUT that is also the --ckpt-dir is held as that (one lock file
    per directory)."""
    if opts.ckpt_dir and Path(opts.ckpt_dir).resolve() == out.resolve():
        return contextlib.nullcontext()
    return CkptLock(out, _describe(plan, out), flag="--out", clash=(
        "the workers of one would read the other's run.json and train its plan, and both "
        "would append to one metrics.jsonl"), checked=False)


def _describe(plan: Plan | str | Path, out: Path) -> str:
    """The run, as the lock file names it to a second run."""
    name = plan.model.name if isinstance(plan, Plan) else str(plan)
    return f"moeplan run {limits.clip(name, 120)} --out {limits.clip(str(out), 120)}"


def _stopped_by(summary: dict | None) -> int | None:
    """The stop signal the workers agreed on (summary.json's `stopped_by`), when a worker
    rather than this launcher received it (a node-local preemption signals one process)."""
    name = (summary or {}).get("stopped_by")
    return next((int(s) for s in STOP_EXIT_CODES if s.name == name), None)


def check_outputs(out: Path) -> None:
    """Refuse, before anything starts, a run output that would be written somewhere else: the
    appended metrics.jsonl must be a regular file (not a link to a file outside --out, not a
    named pipe); the other outputs are replaced by rename, which never follows a link."""
    check_writable_dir(out, "--out")
    metrics = out / "metrics.jsonl"
    try:
        mode = metrics.lstat().st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise SpecError(f"{metrics} is {what}; the run appends to it and never writes through "
                        "a link. Remove it, or choose another --out. Nothing was run.")


def _read_summary(path: Path) -> dict | None:
    try:
        doc = loads_json(read_regular(path, limits.MAX_FILE_BYTES))
    except (FileRefused, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the agent's session and its workers (each in a session of its own)."""
    from .lifecycle import child_pids

    for pid in child_pids(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _run_agent(cmd: list[str], env: dict[str, str], pending: list[int] | None = None
               ) -> tuple[int, int | None, bool]:
    """Run torchrun's agent in a session of its own and wait for it.

    The first SIGINT or SIGTERM to this launcher is passed to the agent, which passes it to the
    workers: they stop at the next step boundary (checkpointing with --ckpt-dir) and exit. A
    second one, or STOP_GRACE_S without an exit, kills the whole tree. Whatever happens here
    (an exception included), the agent and its workers do not outlive this call.

    `pending`: stops the launcher recorded before this (`_stops_recorded`), one that came after
    its last look passed on at once.

    Returns (the agent's exit code, the stop signal received or None, whether the tree was
    killed)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    got: list[int] = []
    deadline = [float("inf")]
    killed = [False]

    def kill() -> None:
        killed[0] = True
        _kill_tree(proc)

    def on_signal(signum: int, _frame: object) -> None:
        if got:
            kill()
            return
        got.append(signum)
        deadline[0] = time.monotonic() + STOP_GRACE_S
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
        if main else {}
    if pending:
        on_signal(pending[0], None)
    try:
        while True:
            try:
                code = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline[0]:
                    kill()
    finally:
        if proc.poll() is None:
            kill()
            proc.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, (got[0] if got else None), killed[0]


def numa_binding(devices: Devices, nproc: int, numactl: str | None, torchrun_binds: bool = True,
                 cpus_near: Callable[[str], set[int]] | None = None) -> tuple[bool, str | None]:
    """Whether torchrun binds each worker to the CPUs of its GPU's NUMA node
    (`launch_lines.NUMA_BINDING`, as the runs the host launch time is priced on were bound), and
    the one line to print when a GPU run cannot be: a torch before 2.9 has no such flag
    (`torchrun_binds`, `guard.torchrun_binds_numa`). torch binds through numactl, and fails the
    launch when a GPU's node has none of the CPUs this job may use (a cgroup or Slurm CPU mask),
    so that is checked first, per local GPU (`cpus_near`: a PCI address to the CPUs allowed
    near it, `guard.numa_cpus`). A CPU run has no GPU to bind near; its ranks share the cores
    OMP_NUM_THREADS divides."""
    from .guard import numa_cpus

    if devices.kind != "cuda" or len(devices.free_gb) < nproc:
        return False, None
    unbound = "the workers run unbound to their GPUs' NUMA nodes, slower than priced wherever "
    if not torchrun_binds:
        return False, (f"this torch's torchrun has no --numa-binding (PyTorch 2.9 on): {unbound}"
                       "kernel launches bound the step; upgrade torch to bind them.")
    if numactl is None:
        return False, (f"numactl not found: {unbound}kernel launches bound the step; install "
                       "numactl to bind them.")
    near = cpus_near or numa_cpus
    buses = devices.buses[:nproc]
    cut = [i for i, bus in enumerate(buses) if not near(bus)]
    if len(buses) < nproc or cut:
        which = f"GPU {cut[0]}'s NUMA node has none of the CPUs this job may use" if cut else \
            "the GPUs' PCI addresses are not known"
        return False, (f"cannot bind the workers to their GPUs' NUMA nodes ({which}): "
                       f"{unbound}kernel launches bound the step; give the job the CPUs of "
                       "its GPUs' nodes (a whole node, as sbatch --exclusive does) to bind "
                       "them.")
    return True, None


def torchrun_command(opts: RunOptions, out: Path, nproc: int,
                     numa: bool = False) -> list[str]:
    """The torchrun line that starts `nproc` workers on this node (torchrun's own agent, run
    through `moeplan.runtime.agent`: same arguments, see agent.py); each worker trains the run
    prepared in `out` (OUT/run.json, `PreparedRun`). `numa`: bound to their GPUs' NUMA nodes
    (`numa_binding`)."""
    flags = torchrun_args(opts.nnodes, nproc, opts.rdzv_endpoint, opts.rdzv_backend,
                          opts.rdzv_id or "moeplan", opts.node_rank, opts.max_restarts, numa)
    # both started through lifecycle.BOOTSTRAP: a stop that arrives while Python imports
    # moeplan is recorded, not fatal (torchrun's --no-python runs the worker line as given)
    return [*bootstrap_command("moeplan.runtime.agent"), *flags, "--no-python",
            *bootstrap_command("moeplan.runtime.worker", str(out), unbuffered=True)]


__all__ = ["MoeplanError", "PreparedRun", "RunFailed", "RunOptions", "Stopped", "check_resume",
           "guard_memory", "numa_binding", "prepare_plan", "run", "torchrun_command",
           "verified_resume"]
