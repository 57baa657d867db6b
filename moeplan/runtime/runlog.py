"""What rank 0 writes while training: metrics.jsonl, the progress lines, TensorBoard.

- `OUT/metrics.jsonl`: one record per step, always (SPEC "Run outputs"), appended, never
  truncated; a step that was evaluated also carries `eval_loss` and `eval_ppl`.
- stderr: one line every `--log-interval` steps (and at the last step), one per evaluation.
- `--tensorboard-dir`: the same figures as TensorBoard scalars (tblog.py).

MFU is model TFLOPS per GPU over the dense BF16 peak of the machine's ClusterSpec (the GPU's
preset, or `--cluster`), as the estimate's `mfu`; on a CPU without `--cluster` there is no peak
and no MFU.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

from rich.markup import escape

from ..fsio import append_text, finite_or_null, strict_dumps
from ..specs import Plan
from .options import RunOptions

SPEC_KEYS = ("step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tflops_per_gpu",
             "peak_mem_gb")


def eval_due(step: int, opts: RunOptions) -> bool:
    """Evaluate after `step` (counted from 1): every --eval-interval steps and at the last."""
    return bool(opts.eval_interval) and (step % opts.eval_interval == 0 or step == opts.steps)


def peak_tflops(running: Plan, device_kind: str, gpu_name: str | None,
                cluster: str | None) -> float | None:
    """The machine's dense BF16 peak per device (None: unknown, e.g. a CPU without --cluster)."""
    from .guard import machine_cluster

    try:
        spec = machine_cluster(running, device_kind, gpu_name, cluster)
    except Exception:  # a --cluster that fails here was already refused by the launcher
        return None
    return None if spec is None else spec.bf16_tflops


class RunLog:
    """Rank 0's outputs for each step (see the module docstring)."""

    def __init__(self, out: Path, opts: RunOptions, console, peak: float | None,
                 batch_size: int):
        self.out, self.opts, self.console, self.peak = out, opts, console, peak
        self.evaluations: list[dict] = []
        self.tb, self.tb_error = None, None
        if opts.tensorboard_dir:
            from .tblog import TensorBoard

            self.tb = TensorBoard(opts.tensorboard_dir, batch_size)

    def step(self, metrics, eval_loss: float | None) -> None:
        """Record one step (and its evaluation, when there was one)."""
        record = {**{k: getattr(metrics, k) for k in SPEC_KEYS}, "aux_loss": metrics.aux_loss}
        if metrics.load_imbalance is not None:
            record["load_imbalance"] = metrics.load_imbalance
        if metrics.load_balancing_loss is not None:
            record["load_balancing_loss"] = metrics.load_balancing_loss
        if self.peak:
            record["mfu"] = metrics.tflops_per_gpu / self.peak
        if metrics.skipped:
            record["skipped"] = True
        if eval_loss is not None:
            ppl = math.exp(eval_loss) if eval_loss < 700 else math.inf
            record.update(eval_loss=eval_loss, eval_ppl=ppl)
            self.evaluations.append(finite_or_null({"step": metrics.step, "loss": eval_loss,
                                                    "ppl": ppl}))
        # appended, never truncated, never through a link
        append_text(self.out / "metrics.jsonl",
                    strict_dumps(finite_or_null(record), indent=None) + "\n")
        if self.tb is not None:
            try:
                self.tb.step(metrics.step, record)
                if eval_loss is not None:
                    self.tb.evaluation(metrics.step, eval_loss)
                self.tb.flush()
            except OSError as e:  # a full log disk stops the dashboard, not the training
                self._tb_failed(metrics.step, e)
        steps = self.opts.steps or metrics.step
        if metrics.step % self.opts.log_interval == 0 or metrics.step == steps \
                or metrics.skipped:
            self.console.print(
                f"step {metrics.step:>4}/{steps}  loss {metrics.loss:.4f}  "
                f"lr {metrics.lr:.3g}  {metrics.tokens_per_s:,.0f} tok/s  "
                f"{metrics.tflops_per_gpu:.3g} TFLOPS/GPU"
                + (f" (MFU {record['mfu']:.1%})" if "mfu" in record else "")
                + f"  {metrics.peak_mem_gb:.3g} GB  {metrics.step_time_s * 1e3:.1f} ms"
                + ("  (skipped: non-finite loss or gradient, no update)" if metrics.skipped
                   else ""), markup=False)
        if eval_loss is not None:
            self.console.print(f"validation at step {metrics.step}: loss {eval_loss:.4f}, "
                               f"perplexity {record['eval_ppl']:.4g} "
                               f"({self.opts.batches_per_eval} batches)")

    def _tb_failed(self, step: int, e: OSError) -> None:
        self.tb_error = (f"TensorBoard writes into --tensorboard-dir {self.opts.tensorboard_dir} "
                         f"failed at step {step} ({e.strerror or e}); the event files end "
                         "before it, and metrics.jsonl holds every step")
        self.console.print(f"[bold yellow]warning:[/] {escape(self.tb_error)}. "
                           "Training goes on.")
        with contextlib.suppress(OSError):
            self.tb.close()
        self.tb = None

    def close(self) -> None:
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as e:
                self._tb_failed(self.opts.steps or 0, e)
