"""What one `moeplan run` trains with: its options, and the prepared run the workers read.

The launcher (launch.py) loads, validates and scales the plan once (`launch.prepare_plan`) and
writes the result with the options into the run directory (`PreparedRun.write`, OUT/run.json,
atomically); every torchrun worker reads that file (`PreparedRun.read`) and trains exactly it.
So a worker never prepares the plan itself: it cannot disagree with the checks the launcher
made (or repeat them world-size times). No torch here: the launcher imports this.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .. import limits
from ..errors import SpecError
from ..fsio import atomic_write_bytes, loads_json, read_regular, strict_dumps, write_json
from ..specs import Plan

RUN_FILE = "run.json"  # in the run directory: the prepared run, for the workers
PLAN_FILE = "plan.json"  # beside it: the plan as given (calibrate --from-runs re-predicts it)
RUN_FORMAT = 2
EVAL_ITERS = 10  # global batches per evaluation unless --eval-iters says
DIST_TIMEOUT_MINUTES = 10.0  # Megatron's --distributed-timeout-minutes default


@dataclass
class RunOptions:
    """The options of `moeplan run` (SPEC §4 and "Run outputs")."""

    steps: int | None = None  # the step to reach; None: the plan's train_iters, else 10
    data: str = "synthetic"  # 'synthetic', or Megatron indexed datasets: "PREFIX" / "W1 P1 W2 P2"
    split: str | None = None  # train,valid,test weights of --data (None: Megatron's 969,30,1)
    tokenizer_model: str | None = None  # a tokenizer.json or a directory holding one
    # validation datasets read whole (Megatron's --valid-data-path); None: --data's valid split
    valid_data: str | None = None
    eval_interval: int | None = None  # steps between evaluations on the validation split
    # global batches per evaluation (`batches_per_eval`: EVAL_ITERS unless given); given alone,
    # or with --valid-data, one evaluation at the last step (settings.apply_settings), as
    # Megatron evaluates at the end of training
    eval_iters: int | None = None
    log_interval: int = 1  # steps between progress lines (metrics.jsonl has every step)
    tensorboard_dir: str | None = None  # TensorBoard event files, written by rank 0
    # training settings under Megatron's names (settings.TRAINING_KEYS), written into the
    # plan's training section by the launcher (settings.apply_settings)
    training: dict | None = None
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
    # how long a collective waits for a peer before the run fails (Megatron's
    # --distributed-timeout-minutes, default 10); a hung rank is then noticed in minutes
    distributed_timeout_minutes: float = DIST_TIMEOUT_MINUTES
    # set by the launcher, not the user: the step `check_resume` verified (0: none) and the
    # digest of its manifest; workers load exactly that step
    resume_step: int | None = None
    resume_manifest: str | None = None
    cluster: str | None = None  # ClusterSpec of this machine, for predictions (calibrate -o)
    init_from: str | None = None  # a Hugging Face checkpoint directory (hf_io.load_hf_)

    def __post_init__(self) -> None:
        """The launch sizes a run cannot start with, refused by flag: no workers on a node,
        no nodes, a node rank outside them, a negative restart or checkpoint count."""
        from .. import limits

        if self.nproc_per_node is not None and not 1 <= self.nproc_per_node <= (
                limits.MAX_DEVICES_PER_NODE):
            raise SpecError(f"--nproc-per-node {self.nproc_per_node}: a node runs 1 to "
                            f"{limits.MAX_DEVICES_PER_NODE} workers.")
        if not 1 <= self.nnodes <= limits.MAX_GPUS:
            raise SpecError(f"--nnodes {self.nnodes}: give 1 to {limits.MAX_GPUS:,} nodes.")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise SpecError(f"--node-rank {self.node_rank}: with --nnodes {self.nnodes} the node "
                            f"ranks are 0 to {self.nnodes - 1}.")
        for flag, value in (("--max-restarts", self.max_restarts),
                            ("--ckpt-keep", self.ckpt_keep), ("--ckpt-every", self.ckpt_every)):
            if value < 0:
                raise SpecError(f"{flag} {value}: give 0 or more.")

    @property
    def batches_per_eval(self) -> int:
        """Global batches each evaluation reads: --eval-iters, else EVAL_ITERS."""
        return EVAL_ITERS if self.eval_iters is None else self.eval_iters

    @classmethod
    def from_dict(cls, data: object, source: str) -> RunOptions:
        """Options read back from a run file: a mapping of known fields only."""
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not set(data) <= known:
            extra = sorted(set(data) - known) if isinstance(data, dict) else []
            raise SpecError(f"{source}: `options` is not a mapping of run options"
                            + (f" (unknown: {', '.join(map(str, extra[:5]))})" if extra else "")
                            + "; it is written by `moeplan run`, so rerun it.")
        return cls(**data)


@dataclass(frozen=True)
class PreparedRun:
    """The plan as given (for its predictions and OUT/plan.json), the plan as it runs
    (validated, scaled down when asked) and the options, all checked by the launcher."""

    given: Plan
    running: Plan
    options: RunOptions

    def write(self, out: Path) -> Path:
        """OUT/plan.json (the plan as given) and OUT/run.json, each atomically (temporary file,
        fsync, rename). run.json refers to plan.json by name and SHA-256 instead of copying it,
        and holds the running plan only where it differs (scaled down, settings applied)."""
        digest = self.write_plan(out)
        return write_json(out / RUN_FILE, {
            "format": RUN_FORMAT, "plan": {"file": PLAN_FILE, "sha256": digest},
            "running": (None if self.running == self.given
                        else self.running.model_dump(mode="json")),
            "options": asdict(self.options)})

    def write_plan(self, out: Path) -> str:
        """OUT/plan.json, the plan as given, atomically; returns its SHA-256."""
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SpecError(f"--out {out}: cannot create it ({err.strerror or err}). Choose a "
                            "writable directory. Nothing was run.") from None
        data = strict_dumps(self.given.model_dump(mode="json")).encode()
        atomic_write_bytes(out / PLAN_FILE, data)
        return sha256(data)

    @classmethod
    def read(cls, out: Path) -> PreparedRun:
        """The run the launcher wrote into `out` (bounded, strict JSON, plans re-validated, the
        plan file the one the launcher wrote)."""
        from ..specs.loader import build, read_document

        path = out / RUN_FILE
        doc = read_document(path)
        if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
            raise SpecError(f"{path}: not a run file of this moeplan version (format "
                            f"{RUN_FORMAT}); rerun `moeplan run`.")
        ref = doc.get("plan")
        if not isinstance(ref, dict) or ref.get("file") != PLAN_FILE:
            raise SpecError(f"{path}: `plan` does not name {PLAN_FILE}; rerun `moeplan run`.")
        data = read_regular(out / PLAN_FILE, limits.MAX_FILE_BYTES)
        if sha256(data) != ref.get("sha256"):
            raise SpecError(f"{out / PLAN_FILE} changed after `moeplan run` prepared the run "
                            f"(its SHA-256 is not the one {path} names); rerun `moeplan run`.")
        given = build(Plan, loads_json(data), "plan", str(out / PLAN_FILE))
        running = given if doc.get("running") is None else build(Plan, doc["running"], "plan",
                                                                  str(path))
        return cls(given, running, RunOptions.from_dict(doc.get("options"), str(path)))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
