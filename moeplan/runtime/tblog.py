"""`--tensorboard-dir`: TensorBoard event files, written by rank 0.

Writer: tensorboardX's `EventsWriter`. It writes the event-file format TensorBoard reads
(TFRecord framing of `Event` protobufs) with only numpy and protobuf as dependencies, so
`moeplan[run]` gains no TensorBoard server, gRPC or web stack; `torch.utils.tensorboard`
would need the whole `tensorboard` package installed just to write. It writes in the calling
thread, so a full or failing disk raises where the run can answer it (`RunLog` warns once and
trains on without TensorBoard; metrics.jsonl keeps every step), where the asynchronous
`FileWriter` fails in a thread of its own and again at exit. Each scalar is one
`Summary.Value(tag, simple_value)`, the record `torch.utils.tensorboard` (Megatron-LM's
writer) writes for `add_scalar`; tensorboardX's own `add_scalar` would rewrite a tag's spaces
as underscores, and Megatron's tags have spaces. Tested by reading the files back with
TensorBoard's own `EventAccumulator`, beside the same scalars written by
`torch.utils.tensorboard` (`tests/test_tblog.py`).

Tags are Megatron-LM's, spelled as its `training_log` and `evaluate_and_print_results` write
them, so a dashboard made for Megatron runs shows moeplan's: `lm loss`, `learning-rate`,
`grad-norm`, `iteration-time` (s), `throughput` (model TFLOP/s per GPU), `load_balancing_loss`,
`batch-size`, `lm loss validation`, `lm loss validation ppl`; the loss, learning-rate,
grad-norm, batch-size and validation tags also `… vs samples` (x = samples consumed, step ×
global batch), as Megatron writes them. `load_balancing_loss` is Megatron's quantity too: the
switch loss per MoE layer without its coefficient (1.0 for a balanced router), where
metrics.jsonl's `aux_loss` is the term the objective adds (coefficient × the sum over layers).
moeplan's own: `tokens-per-second`, `mfu` (when the peak of this machine is known: a GPU preset
or `--cluster`), `mem-peak-gigabytes` (peak allocated on GPU, peak RSS on CPU; Megatron's
`--log-memory-to-tensorboard` writes bytes as `mem-max-allocated-bytes`, GPU only) and
`moe/load-imbalance` (busiest expert's tokens / mean, worst MoE layer; 1.0 is even).
"""

from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path

from ..errors import SpecError

STEP_TAGS = {"lm loss": "loss", "learning-rate": "lr", "grad-norm": "grad_norm",
             "iteration-time": "step_time_s", "throughput": "tflops_per_gpu",
             "tokens-per-second": "tokens_per_s", "mfu": "mfu",
             "mem-peak-gigabytes": "peak_mem_gb",
             "load_balancing_loss": "load_balancing_loss",
             "moe/load-imbalance": "load_imbalance"}  # tag → metrics.jsonl key
VS_SAMPLES = ("lm loss", "learning-rate", "grad-norm")  # Megatron's `… vs samples` twins
VALIDATION = "lm loss validation"


def require_writer() -> None:
    """Exit 2 before any worker starts when tensorboardX is missing (checked without importing
    it, so the launcher stays torch-free)."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise SpecError("--tensorboard-dir writes TensorBoard event files with tensorboardX, "
                        "which is not installed: pip install 'moeplan[run]' (or pip install "
                        "tensorboardX). Nothing was run.")


class TensorBoard:
    """Scalars of each step and each evaluation into DIR (appended across resumes: TensorBoard
    shows the last value written for a step). `batch_size`: the global batch in samples, for
    Megatron's `batch-size` and `… vs samples` tags."""

    def __init__(self, logdir: str | Path, batch_size: int):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        try:
            Path(logdir).mkdir(parents=True, exist_ok=True)
            self.writer = EventsWriter(str(Path(logdir) / "events"))
        except OSError as e:
            raise SpecError(f"--tensorboard-dir {logdir}: cannot write there "
                            f"({e.strerror or e}). Choose a writable directory.") from None
        self.event, self.summary, self.batch_size = Event, Summary, batch_size

    def scalar(self, tag: str, value: float, x: int) -> None:
        """One point of `tag` at x, the tag kept as given (spaces included)."""
        value_ = self.summary.Value(tag=tag, simple_value=float(value))
        self.writer.write_event(self.event(wall_time=time.time(), step=x,
                                           summary=self.summary(value=[value_])))

    def step(self, step: int, record: dict) -> None:
        """One training step's record (the metrics.jsonl keys, plus `mfu` when known)."""
        samples = step * self.batch_size
        for tag, key in STEP_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.scalar(tag, value, step)
                if tag in VS_SAMPLES:
                    self.scalar(f"{tag} vs samples", value, samples)
        self.scalar("batch-size", self.batch_size, step)
        self.scalar("batch-size vs samples", self.batch_size, samples)

    def evaluation(self, step: int, loss: float) -> None:
        samples = step * self.batch_size
        self.scalar(VALIDATION, loss, step)
        self.scalar(f"{VALIDATION} vs samples", loss, samples)
        if math.isfinite(loss) and loss < 700:  # exp overflows beyond ~709
            self.scalar(f"{VALIDATION} ppl", math.exp(loss), step)
            self.scalar(f"{VALIDATION} ppl vs samples", math.exp(loss), samples)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
