"""Train the pipeline and context-parallel layouts of the tiny models in one spawned gloo world.

Run as `python tests/pipeline_cp_worker.py OUT.pt`: like `equivalence_worker.py`, but with the
8 processes that tp2·cp2·pp2 needs. Rank 0 saves per-step losses, the first step's full reduced
gradients and each pipeline rank's time blocked on receives.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from equivalence_worker import DENSE, MODELS, free_port, make_plan

WORLD = 8
STEPS = 3
# name → (world, layout axes); the claims the tests make about each are in
# test_pipeline_cp_equivalence.py. gbs 8, mbs 1: pp2 runs 8 micro-batches (4 with dp2).
LAYOUTS: dict[str, tuple[int, dict]] = {
    "reference": (1, {}),
    "pp2": (2, {"pp": 2}),
    "pp2_vpp2_tp2": (4, {"pp": 2, "vpp": 2, "tp": 2}),
    "cp2": (2, {"cp": 2}),
    "cp4_dp2": (8, {"cp": 4}),
    "tp2_cp2_pp2_ep4": (8, {"tp": 2, "cp": 2, "pp": 2, "ep": 4}),
}


def worker(rank: int, port: int, out: str) -> None:
    from moeplan.runtime.grid import RankGrid
    from moeplan.runtime.parallelize import build_groups
    from moeplan.runtime.train import Trainer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results: dict = {}
    for name, (world, axes) in LAYOUTS.items():
        moe_axes = axes.get("ep", 1) > 1 or axes.get("etp", 1) > 1
        models = [m for m in MODELS if not (moe_axes and m in DENSE)]
        plans = {m: make_plan(m, world, axes) for m in models}
        groups = build_groups(RankGrid.from_layout(plans[models[0]].layout))
        for m in models:
            if groups is None:
                continue
            trainer = Trainer(plans[m], groups, seed=1234)
            losses, grads = [], None
            for step in range(STEPS):
                metrics, g = trainer.step(step, capture_grads=step == 0)
                losses.append(metrics.loss)
                grads = grads if g is None else g
            waits = None if trainer.pipeline is None else trainer.pipeline.stats.history
            results[(name, m)] = {"losses": losses, "grads": grads, "pipeline_wait": waits}
        dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(), sys.argv[1]), nprocs=WORLD)
