"""One torchrun worker: init the process group, build groups, model and optimizer, train,
write metrics.jsonl / summary.json / routing.json (rank 0).

gloo on CPU, NCCL on GPU (one device per local rank); the code path is otherwise identical.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import SpecError
from ..specs import Plan
from . import checkpoint
from .grid import RankGrid
from .launch import RunOptions, prepare_plan
from .parallelize import build_groups
from .storage import newest_checkpoint
from .train import StepMetrics, Trainer

SPEC_KEYS = ("step", "loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tflops_per_gpu",
             "peak_mem_gb")


def _device() -> torch.device:
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        return dev
    if "OMP_NUM_THREADS" not in os.environ:  # the launcher sets it: cores / local workers
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return torch.device("cpu")


def run_worker(plan: Plan | str | Path, opts: RunOptions, out: Path) -> None:
    """Train `opts.steps` steps as this process's rank (environment set by torchrun)."""
    given, running = prepare_plan(plan, opts)
    device = _device()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[
        opts.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if not dist.is_initialized():
        _init_process_group(device)
    rank0 = dist.get_rank() == 0
    groups = build_groups(RankGrid.from_layout(running.layout),
                          domain=running.cluster.usable_domain(running.layout.world_size))
    assert groups is not None
    trainer = Trainer(running, groups, seed=opts.seed, dtype=dtype, device=device,
                      data=opts.data, init_from=opts.init_from)
    start = _resume(trainer, opts)
    stop = _StopOnSigterm(device)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        from rich.console import Console

        console = Console(stderr=True, highlight=False)
        console.print(f"[b]moeplan run[/] {running.model.name}: world {dist.get_world_size()} "
                      f"({_layout_str(running)}), {device.type}/{dist.get_backend()}, "
                      f"{str(dtype).removeprefix('torch.')}, {opts.steps} steps → {out}"
                      + (f", resumed at step {start}" if start else ""))
        console.print(f"kernels: {trainer.kernels.reason}")
        console.print(objective_line(running))
    history: list[StepMetrics] = []
    bad, preempted_at = 0, 0
    for step in range(start, opts.steps):
        metrics, _ = trainer.step(step)
        history.append(metrics)
        bad = bad + 1 if metrics.skipped else 0
        if rank0:
            with open(out / "metrics.jsonl", "a") as f:  # appended, never truncated
                f.write(json.dumps({**{k: getattr(metrics, k) for k in SPEC_KEYS},
                                    "aux_loss": metrics.aux_loss}
                                   | ({"skipped": True} if metrics.skipped else {})) + "\n")
            console.print(
                f"step {metrics.step:>4}/{opts.steps}  loss {metrics.loss:.4f}  "
                f"{metrics.tokens_per_s:,.0f} tok/s  {metrics.tflops_per_gpu:.3g} TFLOPS/GPU  "
                f"{metrics.peak_mem_gb:.3g} GB  {metrics.step_time_s * 1e3:.1f} ms"
                + ("  [skipped: non-finite loss or gradient]" if metrics.skipped else ""))
        if bad >= opts.max_nonfinite_steps:
            if rank0:
                console.print(f"[bold red]error:[/] {bad} steps in a row (to step "
                              f"{metrics.step}) had a non-finite loss or gradient; stopping. "
                              "Resume from the last checkpoint with a lower lr or other data.")
            dist.destroy_process_group()
            raise SystemExit(1)
        preempt = stop.agreed()
        done = metrics.step
        if opts.ckpt_dir and (preempt or done == opts.steps
                              or (opts.ckpt_every and done % opts.ckpt_every == 0)):
            path = checkpoint.save(trainer, opts.ckpt_dir, done, keep=opts.ckpt_keep,
                                   extra={"data": opts.data, "preempted": preempt})
            if rank0:
                console.print(f"checkpoint {path}")
        if preempt:
            preempted_at = done
            if rank0:
                console.print(f"SIGTERM: stopped at step {done}"
                              + (" after checkpointing" if opts.ckpt_dir else ""))
            break
    if not history:  # resumed (after a restart) at the last step: nothing left to train
        dist.barrier()
        dist.destroy_process_group()
        return
    peak = torch.tensor([max(m.peak_mem_gb for m in history)], dtype=torch.float64,
                        device=device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)  # every rank's peak, in rank order
    if rank0:
        routing = {"layers": [
            {"layer": i, "tokens_per_expert": trainer.routing_totals[j].tolist()}
            for j, i in enumerate(trainer.moe_layer_numbers)  # MTP depth k: layer L + k
        ], "steps": opts.steps}
        (out / "routing.json").write_text(json.dumps(routing, indent=1))
        summary = _summary(given, running, history, [float(p) for p in peaks], device, dtype,
                           opts)
        summary.update(resumed_from=start, preempted_at=preempted_at,
                       precision=running.training.precision,
                       kernel_backend=trainer.kernels.backend.name)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def _init_process_group(device: torch.device) -> None:
    """NCCL on GPU, gloo on CPU, from torchrun's environment.

    After a torchrun restart the workers reconnect to the agent's store, which still holds the
    previous attempt's keys (process-group addresses under the same names); a prefix per
    attempt keeps the new groups from reading them and connecting to dead peers.
    """
    backend, kw = ("nccl", {"device_id": device}) if device.type == "cuda" else ("gloo", {})
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(minutes=10))
        dist.init_process_group(backend, store=dist.PrefixStore(f"moeplan/attempt_{restart}",
                                                                base),
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), **kw)
    else:
        dist.init_process_group(backend, **kw)


def _resume(trainer: Trainer, opts: RunOptions) -> int:
    """Load the newest complete checkpoint when resuming or restarted by torchrun; return the
    step to continue from (0 when there is none yet).

    The launcher verified the checkpoint of `--resume`; after a restart, rank 0 verifies the
    newest one (written by this run) and every rank loads the same directory.
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not opts.ckpt_dir or not (opts.resume or restarted):
        return 0
    found: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            path = newest_checkpoint(opts.ckpt_dir, check=restarted)
            found = [str(path) if path else None]
        except SpecError as e:
            found = [f"error: {e}"]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return 0
    if found[0].startswith("error: "):
        raise SpecError(found[0].removeprefix("error: "))
    return checkpoint.load(trainer, found[0])


class _StopOnSigterm:
    """SIGTERM (preemption; torchrun passes the launcher's on) sets a flag; at each step
    boundary the ranks agree (max over the world) so they all checkpoint the same step."""

    def __init__(self, device: torch.device):
        self.flag = torch.zeros(1, device=device)
        self.seen = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, _signum: int, _frame: object) -> None:
        self.seen = True

    def agreed(self) -> bool:
        self.flag.fill_(float(self.seen))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)
        return bool(self.flag.item())


def _layout_str(plan: Plan) -> str:
    L = plan.layout
    vpp = f" vpp{L.vpp}" if L.vpp > 1 else ""
    return (f"tp{L.tp} cp{L.cp} dp{L.dp} pp{L.pp}{vpp} ep{L.ep} etp{L.etp} edp{L.edp}, mbs {L.mbs}, "
            f"{L.dispatcher}, {'distributed' if L.distributed_optimizer else 'replicated'} "
            "optimizer")


def _summary(given: Plan, running: Plan, history: list[StepMetrics], peaks_gb: list[float],
             device: torch.device, dtype: torch.dtype, opts: RunOptions) -> dict:
    """Measured figures (median step after the first) next to the plan's predictions, and
    their ratios measured/predicted (peak memory: the busiest rank; on CPU it is the process's
    peak RSS, so the ratio says little there)."""
    steady = history[1:] or history
    step_s = statistics.median(m.step_time_s for m in steady)
    tokens = running.training.global_batch_size * running.training.seq_len
    world = running.layout.world_size
    est = given.estimate
    predicted = None if est is None else {
        "step_time_s": est.step_time_s, "tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
        "tflops_per_gpu": est.tflops_per_gpu, "peak_mem_gb": est.memory.peak_gb,
    }
    notes = [objective_line(running)]
    if opts.init_from:
        notes.append(f"initialised from the Hugging Face checkpoint {opts.init_from}")
    if opts.scale_down:
        notes.append("scaled down: measured figures are for the smaller model and batch, "
                     "predicted ones for the full plan")
    if predicted is not None:
        gpus = given.cluster.num_gpus or given.layout.world_size
        notes.append(f"predicted figures are for {gpus} × {given.cluster.gpu}; measured on "
                     f"{device.type}")
    return {
        "model": running.model.name, "world_size": world, "layout": _layout_str(running),
        "steps": opts.steps, "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "seed": opts.seed, "scaled_down": opts.scale_down,
        "measured": {
            "step_time_s": step_s, "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_gpu": tokens / step_s / world,
            "tflops_per_gpu": running.model.flops_per_token(running.training.seq_len) * tokens
            / step_s / world / 1e12,
            "peak_mem_gb": max(peaks_gb), "peak_mem_gb_per_rank": peaks_gb,
            "first_loss": history[0].loss, "final_loss": history[-1].loss,
        },
        "predicted": predicted,
        "ratio": None if predicted is None else {
            "step_time_s": _ratio(step_s, predicted["step_time_s"]),
            "peak_mem_gb": _ratio(max(peaks_gb), predicted["peak_mem_gb"]),
        },
        "notes": notes,
    }


def objective_line(plan: Plan) -> str:
    from .hf_io import describe_objective

    return describe_objective(plan.model, plan.training.moe_aux_loss_coeff)


def _ratio(measured: float, predicted: float) -> float | None:
    return measured / predicted if predicted > 0 else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="moeplan torchrun worker (started by `moeplan run`)")
    p.add_argument("plan")
    p.add_argument("--out", required=True)
    p.add_argument("--options", default="{}", help="RunOptions fields as JSON")
    a = p.parse_args(argv)
    run_worker(a.plan, RunOptions(**json.loads(a.options)), Path(a.out))


if __name__ == "__main__":
    main()
