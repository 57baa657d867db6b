"""`moeplan run`: check the plan, then launch torchrun workers (or join an existing launch).

Everything that can be refused is refused here, in the launching process, before any worker
starts: an invalid layout, a world size that does not match the processes, a plan feature the
runtime does not execute yet. This module imports no torch, so those errors are instant.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import MoeplanError, NotYetAvailable, SpecError
from ..specs import Plan, check_layout, load_plan
from .storage import CKPT_FORMAT, check_token_file, complete_steps, newest_checkpoint
from .support import features_not_executed


@dataclass
class RunOptions:
    """The options of `moeplan run` (SPEC §4 and "Run outputs")."""

    steps: int = 10
    data: str = "synthetic"
    seed: int = 0
    dtype: str | None = None  # fp32 | bf16; None: bf16 on GPU, fp32 on CPU
    out: str | None = None
    scale_down: bool = False
    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str = "c10d"
    rdzv_id: str | None = None
    ckpt_dir: str | None = None
    ckpt_every: int = 0
    resume: bool = False
    max_restarts: int = 0
    ckpt_keep: int = 3  # sealed checkpoints kept (0: all)
    max_nonfinite_steps: int = 3  # NaN/inf steps in a row skipped before the run stops
    init_from: str | None = None  # a Hugging Face checkpoint directory (hf_io.load_hf_)


class RunFailed(Exception):
    """Workers exited with an error (their output says why)."""

    def __init__(self, code: int):
        super().__init__(f"training workers exited with code {code}")
        self.exit_code = code


def prepare_plan(plan: Plan | str | Path, opts: RunOptions) -> tuple[Plan, Plan]:
    """(plan as given, plan as it will run): validated, refused features named, scaled down."""
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    if opts.steps < 1:
        raise SpecError(f"--steps must be at least 1, got {opts.steps}.")
    if opts.dtype not in (None, "fp32", "bf16"):
        raise SpecError(f"--dtype takes fp32 or bf16, got {opts.dtype!r}.")
    if opts.ckpt_every < 0 or opts.max_restarts < 0 or opts.ckpt_keep < 0:
        raise SpecError("--ckpt-every, --max-restarts and the number of checkpoints kept must "
                        "not be negative.")
    if opts.max_nonfinite_steps < 1:
        raise SpecError("the number of non-finite steps tolerated in a row must be at least 1.")
    for flag, used in (("--resume", opts.resume), ("--ckpt-every", opts.ckpt_every),
                       ("--max-restarts", opts.max_restarts)):
        if used and not opts.ckpt_dir:
            raise SpecError(f"{flag} needs --ckpt-dir DIR (where checkpoints are written and "
                            "resumed from). Nothing was run.")
    check_layout(plan.model, plan.training, plan.layout, choices=plan.choices)
    missing = features_not_executed(plan)
    if missing:
        raise NotYetAvailable("this plan uses " + "; ".join(missing) + ", which the runtime "
                              "does not execute yet. Nothing was run; pick a plan without it.")
    running = plan
    if opts.scale_down:
        from .scale import scale_down_model, scale_down_training

        training, layout = scale_down_training(plan.training, plan.layout)
        # the full model's stage layout cannot fit the shrunk one: stages are rebalanced
        choices = plan.choices.model_copy(update={"stage_layout": None, "stage_layers": None})
        running = plan.model_copy(update={"model": scale_down_model(plan.model, plan.layout),
                                          "training": training, "layout": layout,
                                          "choices": choices})
        check_layout(running.model, running.training, running.layout, choices=running.choices)
    if opts.data != "synthetic":
        check_token_file(opts.data, running.model.vocab_size, running.training.seq_len)
    if opts.init_from:
        if opts.scale_down:
            raise SpecError("--init-from loads the checkpoint's full-size weights; drop "
                            "--scale-down (or plan a smaller model). Nothing was run.")
        from .hf_io import check_hf_dir

        check_hf_dir(running.model, opts.init_from)
    return plan, running


def check_resume(running: Plan, opts: RunOptions) -> int:
    """The step a run with `--resume` starts from (0: no checkpoint yet), after verifying the
    newest complete checkpoint's checksums and that it holds the same model and seed; without
    `--resume`, a --ckpt-dir holding checkpoints is refused.

    Runs in the launcher, before any worker starts: a corrupt checkpoint is refused by file
    name instead of failing (or silently diverging) inside the workers.
    """
    if not opts.resume:
        old = complete_steps(opts.ckpt_dir) if opts.ckpt_dir else []
        if old:  # a fresh run would mix its checkpoints with another run's
            raise SpecError(f"--ckpt-dir {opts.ckpt_dir} already holds checkpoints (newest: "
                            f"step {old[-1]}); pass --resume to continue from it, or give "
                            "another --ckpt-dir. Nothing was run.")
        return 0
    path = newest_checkpoint(opts.ckpt_dir or "")
    if path is None:
        return 0
    saved = load_plan(path / "plan.json")
    if saved.model != running.model:
        raise SpecError(f"checkpoint {path} holds model {saved.model.name!r} with other "
                        f"dimensions than the plan's {running.model.name!r}; resume under a plan "
                        "of the same model (its layout may differ).")
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != CKPT_FORMAT:
        raise SpecError(f"checkpoint {path} has format {meta.get('format')!r}; this version "
                        f"reads {CKPT_FORMAT!r}. Resume with the moeplan version that wrote it, "
                        "or start a fresh run in another --ckpt-dir. Nothing was run.")
    step = int(meta["step"])
    if meta.get("seed", opts.seed) != opts.seed:
        raise SpecError(f"checkpoint {path} was trained with --seed {meta['seed']}; resume with "
                        f"the same seed (got {opts.seed}), or the data order would change.")
    if step >= opts.steps:
        raise SpecError(f"checkpoint {path} is already at step {step}; --steps {opts.steps} is "
                        "the step to reach, so there is nothing to train.")
    return step


def _joined_environment() -> dict[str, str] | None:
    """RANK/WORLD_SIZE/LOCAL_RANK of an enclosing torchrun or SLURM launch, else None."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= env.keys():
        return {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in env}
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        if "MASTER_ADDR" not in env:
            raise SpecError("inside a SLURM job with several tasks, set MASTER_ADDR (the first "
                            "node's address) and MASTER_PORT, or launch through torchrun.")
        return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
                "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    return None


def default_out(plan: Plan | str | Path) -> Path:
    stem = Path(plan).stem if not isinstance(plan, Plan) else plan.model.name
    return Path("runs") / stem


def run(plan: Plan | str | Path, **options: object) -> dict:
    """Train under `plan` and return the run summary (also written to OUT/summary.json).

    Launches `torchrun` with the plan's world size on this node unless told otherwise, or runs
    this process as one worker when already inside a torchrun/SLURM launch.
    """
    opts = RunOptions(**options)  # type: ignore[arg-type]
    given, running = prepare_plan(plan, opts)
    check_resume(running, opts)
    world = running.layout.world_size
    out = Path(opts.out) if opts.out else default_out(plan)
    joined = _joined_environment()
    if joined is not None:
        if int(joined["WORLD_SIZE"]) != world:
            raise SpecError(f"the plan needs {world} processes (tp·cp·dp·pp) but this launch "
                            f"has WORLD_SIZE={joined['WORLD_SIZE']}; launch {world} processes.")
        if joined.get("RANK", "0") == "0":
            _save_plan(given, out)
        os.environ.update(joined)
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(opts.nproc_per_node or world))
        os.environ.setdefault("MASTER_PORT", "29500")
        from .worker import run_worker

        run_worker(plan, opts, out)
        if joined.get("RANK", "0") != "0":
            return {}  # rank 0 reports for the run
    else:
        nproc = opts.nproc_per_node or world // max(1, opts.nnodes)
        if nproc * opts.nnodes != world:
            raise SpecError(f"the plan needs {world} processes (tp·cp·dp·pp) but --nnodes "
                            f"{opts.nnodes} × --nproc-per-node {nproc} = {nproc * opts.nnodes}; "
                            f"make their product {world}.")
        if opts.nnodes > 1 and not opts.rdzv_endpoint:
            raise SpecError("a multi-node launch needs --rdzv-endpoint HOST:PORT (the same on "
                            "every node).")
        _save_plan(given, out)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        started = time.time()
        code, preempted = _run_forwarding_sigterm(torchrun_command(plan, opts, out, nproc), env)
        summary_path = out / "summary.json"
        if preempted and summary_path.is_file() and summary_path.stat().st_mtime >= started:
            summary = json.loads(summary_path.read_text())
            if summary.get("preempted_at"):  # workers checkpointed at a step boundary
                return summary
        if code:
            raise RunFailed(code)
    summary_path = out / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.is_file() else {}


def _save_plan(plan: Plan, out: Path) -> None:
    """OUT/plan.json: the plan next to its summary, so `moeplan calibrate --from-runs` can
    re-predict it (written once every check passed, right before workers start)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(plan.model_dump_json(indent=2))


def _run_forwarding_sigterm(cmd: list[str], env: dict[str, str]) -> tuple[int, bool]:
    """Run torchrun; a SIGTERM to this launcher (preemption) is passed on to it, and torchrun
    passes it to the workers, which checkpoint at the next step boundary and exit.

    Returns (exit code, whether SIGTERM was received)."""
    proc = subprocess.Popen(cmd, env=env)
    got: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        got.append(signum)
        proc.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        code = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code, bool(got)


def torchrun_command(plan: Plan | str | Path, opts: RunOptions, out: Path,
                     nproc: int) -> list[str]:
    """The torchrun line that starts `nproc` workers on this node."""
    if isinstance(plan, Plan):
        out.mkdir(parents=True, exist_ok=True)
        path = out / "plan.json"
        path.write_text(plan.model_dump_json(indent=2))
        plan = path
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--nnodes={opts.nnodes}"]
    if opts.nnodes == 1 and not opts.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += [f"--rdzv-backend={opts.rdzv_backend}", f"--rdzv-endpoint={opts.rdzv_endpoint}",
                f"--rdzv-id={opts.rdzv_id or 'moeplan'}"]
        if opts.node_rank is not None:
            cmd.append(f"--node-rank={opts.node_rank}")
    if opts.max_restarts:  # restarted workers resume from the newest checkpoint
        cmd.append(f"--max-restarts={opts.max_restarts}")
    worker_opts = {k: v for k, v in asdict(opts).items() if k in (
        "steps", "data", "seed", "dtype", "scale_down", "ckpt_dir", "ckpt_every", "resume",
        "ckpt_keep", "max_nonfinite_steps", "init_from")}
    return [*cmd, "-m", "moeplan.runtime.worker", str(plan), "--out", str(out),
            "--options", json.dumps(worker_opts)]


__all__ = ["MoeplanError", "RunFailed", "RunOptions", "check_resume", "prepare_plan", "run",
           "torchrun_command"]
