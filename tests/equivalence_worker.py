"""Train every equivalence layout of both tiny models inside one spawned gloo world.

Run as `python tests/equivalence_worker.py OUT.pt`: spawns WORLD processes once, carves each
layout's groups out of that world (`build_groups`, collective on every rank), trains STEPS steps
per layout and model, and rank 0 saves per-step losses, step times and the full reduced
gradients of the first step to OUT.pt. The single-process reference is the world-1 layout.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
STEPS = 3
MODELS = ("tiny_qwen3_moe", "tiny_deepseek_v3", "tiny_dense_tied")
DENSE = {"tiny_dense_tied"}  # trained only under layouts without experts
DATA = Path(__file__).parent / "data"
# name → (world, layout axes); the claims the tests make about each are in test_equivalence.py
LAYOUTS: dict[str, tuple[int, dict]] = {
    "reference": (1, {}),
    "tp2_sp": (2, {"tp": 2}),
    "ep2": (2, {"ep": 2}),
    "tp2_ep4_dp2": (4, {"tp": 2, "ep": 4}),
    "ep2_etp2": (4, {"ep": 2, "etp": 2}),
    "dp4_distopt": (4, {}),
    "dp2_ep2_no_distopt": (2, {"ep": 2, "distributed_optimizer": False}),
    "tp2_ep4_allgather": (4, {"tp": 2, "ep": 4, "dispatcher": "allgather"}),
    "tp2_ep2_etp2_order_pp_dp": (4, {"tp": 2, "ep": 2, "etp": 2, "order": "tp-cp-ep-pp-dp"}),
    "tp2_dp2": (4, {"tp": 2}),
    # capacity dropping is decided on each rank's own tokens: EP must not change it
    "dp2_capacity": (2, {"capacity": 1.0}),
    "dp2_ep2_capacity": (2, {"ep": 2, "capacity": 1.0}),
    # two NVLink domains of 2 GPUs: the flex dispatcher's two-hop exchange across them
    "ep4_flex_2_domains": (4, {"ep": 4, "dispatcher": "flex", "nvlink_domain": 2}),
    "ep2_etp2_flex_2_domains": (4, {"ep": 2, "etp": 2, "dispatcher": "flex", "nvlink_domain": 2}),
}


def make_plan(model: str, world: int, axes: dict):
    from moeplan.specs import Layout, Plan, TrainingSpec, load_cluster, load_model

    axes = dict(axes)
    training = TrainingSpec(seq_len=32, global_batch_size=8, lr=1e-2, warmup_steps=1,
                            moe_capacity_factor=axes.pop("capacity", None))
    cluster = load_cluster("h100", gpus=world)
    domain = axes.pop("nvlink_domain", None)
    if domain:
        cluster = cluster.model_copy(update={"nvlink_domain_gpus": domain,
                                             "gpus_per_node": domain})
    return Plan(model=load_model(DATA / f"{model}.yaml"), cluster=cluster, training=training,
                layout=Layout.build(world, 8, **axes))


def models_for(axes: dict) -> list[str]:
    """The models a layout trains: the dense one only where no expert axis is split."""
    moe_axes = axes.get("ep", 1) > 1 or axes.get("etp", 1) > 1
    return [m for m in MODELS if not (moe_axes and m in DENSE)]


def init_world(rank: int, port: int, world: int) -> None:
    """One thread per rank (2 cores here) and a gloo group over the spawned processes."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def train_layouts(rank: int, port: int, world: int, out: str,
                  layouts: Iterable[tuple[str, dict]], steps: int) -> None:
    """Train each (name, {model: plan}) for `steps` steps in one spawned world; rank 0 saves,
    per (name, model), the per-step losses and step times, the first step's full reduced
    gradients, the last grad norm and each pipeline rank's time blocked on receives."""
    from moeplan.runtime.groups import build_groups
    from moeplan.runtime.train import Trainer
    from moeplan.specs.grid import RankGrid

    init_world(rank, port, world)
    results: dict = {}
    for name, plans in layouts:
        first = next(iter(plans.values()))
        groups = build_groups(RankGrid.from_layout(first.layout),
                              domain=first.cluster.usable_domain(first.layout.world_size))
        for m, plan in plans.items():
            if groups is None:
                continue
            trainer = Trainer(plan, groups, seed=1234)
            losses, times, grads = [], [], None
            for step in range(steps):
                metrics, g = trainer.step(step, capture_grads=step == 0)
                losses.append(metrics.loss)
                times.append(metrics.step_time_s)
                grads = grads if g is None else g
            waits = None if trainer.pipeline is None else trainer.pipeline.stats.history
            results[(name, m)] = {"losses": losses, "step_time_s": times, "grads": grads,
                                  "grad_norm": metrics.grad_norm, "pipeline_wait": waits,
                                  "dispatchers": sorted({type(moe.dispatcher).__name__
                                                         for moe in trainer.model.moe_layers()})}
        dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def worker(rank: int, port: int, out: str) -> None:
    layouts = ((name, {m: make_plan(m, world, axes) for m in models_for(axes)})
               for name, (world, axes) in LAYOUTS.items())
    train_layouts(rank, port, WORLD, out, layouts, STEPS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(), sys.argv[1]), nprocs=WORLD)
