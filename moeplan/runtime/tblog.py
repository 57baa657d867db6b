"""`--tensorboard-dir`: TensorBoard event files, written by rank 0.

Writer: tensorboardX's `SummaryWriter`. It writes the event-file format TensorBoard reads
(TFRecord framing of `Event` protobufs) with only numpy and protobuf as dependencies, so
`moeplan[run]` gains no TensorBoard server, gRPC or web stack; `torch.utils.tensorboard`
would need the whole `tensorboard` package installed just to write. Tested by reading the files
back with TensorBoard's own `EventAccumulator` (`tests/test_train_data.py`).

Tags are Megatron-LM's (`training.py`'s `training_log`) with its spaces and underscores
written as hyphens (tensorboardX turns spaces into underscores; one spelling avoids two):
`lm-loss`, `learning-rate`, `grad-norm`, `iteration-time` (s), `throughput` (model TFLOP/s per
GPU), `load-balancing-loss`, `lm-loss-validation`, `lm-loss-validation-ppl`; plus
`tokens-per-second`, `mfu` (when the peak of this machine is known: a GPU preset or
`--cluster`), `mem-peak-gigabytes` (peak allocated on GPU, peak RSS on CPU) and
`moe/load-imbalance` (busiest expert's tokens / mean, worst MoE layer; 1.0 is even).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from ..errors import SpecError

STEP_TAGS = {"lm-loss": "loss", "learning-rate": "lr", "grad-norm": "grad_norm",
             "iteration-time": "step_time_s", "throughput": "tflops_per_gpu",
             "tokens-per-second": "tokens_per_s", "mfu": "mfu",
             "mem-peak-gigabytes": "peak_mem_gb", "load-balancing-loss": "aux_loss",
             "moe/load-imbalance": "load_imbalance"}  # tag → metrics.jsonl key


def require_writer() -> None:
    """Exit 2 before any worker starts when tensorboardX is missing (checked without importing
    it, so the launcher stays torch-free)."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise SpecError("--tensorboard-dir writes TensorBoard event files with tensorboardX, "
                        "which is not installed: pip install 'moeplan[run]' (or pip install "
                        "tensorboardX). Nothing was run.")


class TensorBoard:
    """Scalars of each step and each evaluation into DIR (appended across resumes: TensorBoard
    shows the last value written for a step)."""

    def __init__(self, logdir: str | Path):
        from tensorboardX import SummaryWriter

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(logdir))

    def step(self, step: int, record: dict) -> None:
        """One training step's record (the metrics.jsonl keys, plus `mfu` when known)."""
        for tag, key in STEP_TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tag, float(value), step)

    def evaluation(self, step: int, loss: float) -> None:
        self.writer.add_scalar("lm-loss-validation", loss, step)
        if math.isfinite(loss) and loss < 700:  # exp overflows beyond ~709
            self.writer.add_scalar("lm-loss-validation-ppl", math.exp(loss), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
