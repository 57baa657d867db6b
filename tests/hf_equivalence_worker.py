"""Start every tiny HF checkpoint with `--init-from` under each layout, in one spawned world.

Run as `python tests/hf_equivalence_worker.py MODELS_DIR OUT.json`: spawns WORLD processes
once, carves each layout's groups out of that world, builds a Trainer per (layout, model) from
MODELS_DIR/NAME (each rank reading only its own slices) and rank 0 writes the step-1 losses
as JSON. The claims are in test_hf_equivalence.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from equivalence_worker import free_port, init_world  # noqa: E402
from hf_tiny import SEQ  # noqa: E402

WORLD = 4
GBS = 8
DENSE = {"llama31", "qwen3"}
LAYOUTS: dict[str, tuple[int, dict]] = {
    "world1": (1, {}),
    "tp2_ep2": (4, {"tp": 2, "ep": 2}),
    "pp2_dp2_ep2": (4, {"pp": 2, "ep": 2}),
    "cp2": (2, {"cp": 2}),
}


def make_plan(directory: Path, world: int, axes: dict):
    from moeplan.runtime.hf_io import hf_model_spec
    from moeplan.specs import Layout, Plan, TrainingSpec, load_cluster

    training = TrainingSpec(seq_len=SEQ, global_batch_size=GBS, lr=1e-2, warmup_steps=1,
                            moe_aux_loss_coeff=0.0)
    return Plan(model=hf_model_spec(directory), cluster=load_cluster("h100", gpus=world),
                training=training, layout=Layout.build(world, GBS, **axes))


def worker(rank: int, port: int, root: str, out: str) -> None:
    from moeplan.runtime.groups import build_groups
    from moeplan.runtime.train import Trainer
    from moeplan.specs.grid import RankGrid

    init_world(rank, port, WORLD)
    names = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
    results: dict = {}
    for layout, (world, axes) in LAYOUTS.items():
        moe_axes = axes.get("ep", 1) > 1
        plans = {n: make_plan(Path(root) / n, world, axes) for n in names
                 if not (moe_axes and n in DENSE)}
        first = next(iter(plans.values()))
        groups = build_groups(RankGrid.from_layout(first.layout),
                              domain=first.cluster.usable_domain(world))
        for name, plan in plans.items():
            if groups is None:
                continue
            trainer = Trainer(plan, groups, seed=0, init_from=str(Path(root) / name))
            losses = [trainer.step(step)[0].loss for step in range(2)]
            results.setdefault(layout, {})[name] = losses
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(), sys.argv[1], sys.argv[2]), nprocs=WORLD)
