"""One torchrun worker: init the process group, build groups, model and optimizer, train,
write metrics.jsonl / summary.json / routing.json (rank 0).

gloo on CPU, NCCL on GPU (one device per local rank); the code path is otherwise identical.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from ..specs import Plan
from .grid import RankGrid
from .launch import RunOptions, prepare_plan
from .parallelize import build_groups
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
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    rank0 = dist.get_rank() == 0
    groups = build_groups(RankGrid.from_layout(running.layout))
    assert groups is not None
    trainer = Trainer(running, groups, seed=opts.seed, dtype=dtype, device=device)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        from rich.console import Console

        console = Console(stderr=True, highlight=False)
        console.print(f"[b]moeplan run[/] {running.model.name}: world {dist.get_world_size()} "
                      f"({_layout_str(running)}), {device.type}/{dist.get_backend()}, "
                      f"{str(dtype).removeprefix('torch.')}, {opts.steps} steps → {out}")
    history: list[StepMetrics] = []
    for step in range(opts.steps):
        metrics, _ = trainer.step(step)
        history.append(metrics)
        if rank0:
            with open(out / "metrics.jsonl", "a") as f:  # appended, never truncated
                f.write(json.dumps({**{k: getattr(metrics, k) for k in SPEC_KEYS},
                                    "aux_loss": metrics.aux_loss}) + "\n")
            console.print(
                f"step {metrics.step:>4}/{opts.steps}  loss {metrics.loss:.4f}  "
                f"{metrics.tokens_per_s:,.0f} tok/s  {metrics.tflops_per_gpu:.3g} TFLOPS/GPU  "
                f"{metrics.peak_mem_gb:.3g} GB  {metrics.step_time_s * 1e3:.1f} ms")
    peak = torch.tensor([max(m.peak_mem_gb for m in history)], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank0:
        routing = {"layers": [
            {"layer": i, "tokens_per_expert": trainer.routing_totals[j].tolist()}
            for j, i in enumerate(trainer.moe_layer_numbers)  # MTP depth k: layer L + k
        ], "steps": opts.steps}
        (out / "routing.json").write_text(json.dumps(routing, indent=1))
        summary = _summary(given, running, history, float(peak), device, dtype, opts)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def _layout_str(plan: Plan) -> str:
    L = plan.layout
    return (f"tp{L.tp} cp{L.cp} dp{L.dp} pp{L.pp} ep{L.ep} etp{L.etp} edp{L.edp}, mbs {L.mbs}, "
            f"{L.dispatcher}, {'distributed' if L.distributed_optimizer else 'replicated'} "
            "optimizer")


def _summary(given: Plan, running: Plan, history: list[StepMetrics], peak_gb: float,
             device: torch.device, dtype: torch.dtype, opts: RunOptions) -> dict:
    """Measured figures (median step after the first) next to the plan's predictions."""
    steady = history[1:] or history
    step_s = statistics.median(m.step_time_s for m in steady)
    tokens = running.training.global_batch_size * running.training.seq_len
    world = running.layout.world_size
    est = given.estimate
    predicted = None if est is None else {
        "step_time_s": est.step_time_s, "tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
        "tflops_per_gpu": est.tflops_per_gpu, "peak_mem_gb": est.memory.peak_gb,
    }
    notes = []
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
            "peak_mem_gb": peak_gb, "first_loss": history[0].loss, "final_loss": history[-1].loss,
        },
        "predicted": predicted,
        "notes": notes,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="moeplan torchrun worker (started by `moeplan run`)")
    p.add_argument("plan")
    p.add_argument("--out", required=True)
    p.add_argument("--options", default="{}", help="RunOptions fields as JSON")
    a = p.parse_args(argv)
    run_worker(a.plan, RunOptions(**json.loads(a.options)), Path(a.out))


if __name__ == "__main__":
    main()
