"""Train the pipeline and context-parallel layouts of the tiny models in one spawned gloo world.

Run as `python tests/pipeline_cp_worker.py OUT.pt`: like `equivalence_worker.py`, but with the
8 processes that tp2·cp2·pp2 needs. Rank 0 saves per-step losses, the first step's full reduced
gradients and each pipeline rank's time blocked on receives.
"""

from __future__ import annotations

import sys

import torch.multiprocessing as mp
from equivalence_worker import free_port, make_plan, models_for, train_layouts

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
    layouts = ((name, {m: make_plan(m, world, axes) for m in models_for(axes)})
               for name, (world, axes) in LAYOUTS.items())
    train_layouts(rank, port, WORLD, out, layouts, STEPS)


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(), sys.argv[1]), nprocs=WORLD)
