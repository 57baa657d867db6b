"""`--tensorboard-dir`: TensorBoard event files, written by rank 0.

Writer: tensorboardX's `FileWriter`. It writes the event-file format TensorBoard reads
(TFRecord framing of `Event` protobufs) with only numpy and protobuf as dependencies, so
`moeplan[run]` gains no TensorBoard server, gRPC or web stack; `torch.utils.tensorboard`
would need the whole `tensorboard` package installed just to write. Each scalar is one
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
global batch), as Megatron writes them. moeplan's own: `tokens-per-second`, `mfu` (when the
peak of this machine is known: a GPU preset or `--cluster`), `mem-peak-gigabytes` (peak
allocated on GPU, peak RSS on CPU; Megatron's `--log-memory-to-tensorboard` writes bytes as
`mem-max-allocated-bytes`, GPU only) and `moe/load-imbalance` (busiest expert's tokens /
mean, worst MoE layer; 1.0 is even).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from ..errors import SpecError

STEP_TAGS = {"lm loss": "loss", "learning-rate": "lr", "grad-norm": "grad_norm",
             "iteration-time": "step_time_s", "throughput": "tflops_per_gpu",
             "tokens-per-second": "tokens_per_s", "mfu": "mfu",
             "mem-peak-gigabytes": "peak_mem_gb", "load_balancing_loss": "aux_loss",
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
        from tensorboardX import FileWriter
        from tensorboardX.proto.summary_pb2 import Summary

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.writer, self.summary, self.batch_size = FileWriter(str(logdir)), Summary, batch_size

    def scalar(self, tag: str, value: float, x: int) -> None:
        """One point of `tag` at x, the tag kept as given (spaces included)."""
        self.writer.add_summary(
            self.summary(value=[self.summary.Value(tag=tag, simple_value=float(value))]), x)

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
