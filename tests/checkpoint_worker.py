"""Save and resume checkpoints inside one spawned gloo world (for test_checkpoint.py).

Run as `python tests/checkpoint_worker.py DIR`: spawns WORLD processes and, on a token file in
DIR, trains the tiny MoE model STEPS steps under tp2·ep4 (checkpointing after step SAVE_AT),
then resumes that checkpoint three times, under the same plan, under ep2·etp2 and under
pp2·vpp2·tp2, to STEPS. It then does the same from pp2·vpp2·tp2: a straight run checkpointing
after step SAVE_AT, resumed under the same plan and under tp2·ep4. Last, tp2·ep4 in fp8-delayed
(the emulated backend's amax histories): straight, resumed, and resumed with the histories
dropped as a control. Rank 0 writes the per-step losses of every run to DIR/losses.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp
from equivalence_worker import free_port, init_world

WORLD, STEPS, SAVE_AT = 4, 6, 3
DATA = Path(__file__).parent / "data"
PLANS = {"tp2_ep4": {"tp": 2, "ep": 4}, "ep2_etp2": {"ep": 2, "etp": 2},
         "pp2_vpp2_tp2": {"pp": 2, "vpp": 2, "tp": 2}}


def make_plan(axes: dict, precision: str = "bf16"):
    from moeplan.specs import Layout, Plan, TrainingSpec, load_cluster, load_model

    training = TrainingSpec(seq_len=32, global_batch_size=8, lr=1e-2, warmup_steps=1,
                            precision=precision)
    return Plan(model=load_model(DATA / "tiny_qwen3_moe.yaml"),
                cluster=load_cluster("h100", gpus=WORLD), training=training,
                layout=Layout.build(WORLD, 8, **axes))


def worker(rank: int, port: int, root: str) -> None:
    from moeplan.runtime import checkpoint
    from moeplan.runtime.groups import build_groups
    from moeplan.runtime.storage import newest_checkpoint
    from moeplan.runtime.train import Trainer
    from moeplan.specs.grid import RankGrid

    init_world(rank, port, WORLD)
    data, ckpt = str(Path(root) / "tokens.bin"), Path(root) / "ckpt"
    plans = {k: make_plan(a) for k, a in PLANS.items()}
    plans["fp8_delayed"] = make_plan(PLANS["tp2_ep4"], "fp8-delayed")
    groups = {k: build_groups(RankGrid.from_layout(p.layout)) for k, p in plans.items()}

    def trainer(name: str) -> Trainer:
        return Trainer(plans[name], groups[name], seed=5, data=data)

    def straight(name: str, into: Path) -> list[float]:
        t, out = trainer(name), []
        for step in range(STEPS):
            out.append(t.step(step)[0].loss)
            if step + 1 == SAVE_AT:
                checkpoint.save(t, into, SAVE_AT)
        return out

    def resumed(name: str, into: Path, forget_fp8: bool = False) -> list[float]:
        t = trainer(name)
        start = checkpoint.load(t, newest_checkpoint(into))
        if forget_fp8:  # the control: what a resume without the amax histories gives
            t.kernels.backend._sites.clear()
        return [t.step(step)[0].loss for step in range(start, STEPS)]

    pp_ckpt = Path(root) / "ckpt_pp2"
    losses = {"straight": straight("tp2_ep4", ckpt),
              "resumed_same_plan": resumed("tp2_ep4", ckpt),
              "resumed_ep2_etp2": resumed("ep2_etp2", ckpt),
              "resumed_pp2_vpp2_tp2": resumed("pp2_vpp2_tp2", ckpt),
              "straight_pp2": straight("pp2_vpp2_tp2", pp_ckpt),
              "pp2_resumed_same_plan": resumed("pp2_vpp2_tp2", pp_ckpt),
              "pp2_resumed_tp2_ep4": resumed("tp2_ep4", pp_ckpt)}
    fp8_ckpt = Path(root) / "ckpt_fp8"
    losses |= {"straight_fp8": straight("fp8_delayed", fp8_ckpt),
               "fp8_resumed_same_plan": resumed("fp8_delayed", fp8_ckpt),
               "fp8_resumed_without_histories": resumed("fp8_delayed", fp8_ckpt, True)}
    if rank == 0:
        (Path(root) / "losses.json").write_text(json.dumps(losses))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from moeplan.runtime.data import write_tokens

    rng = np.random.default_rng(0)
    write_tokens(rng.integers(0, 256, 20_000), Path(sys.argv[1]) / "tokens.bin", vocab_size=256)
    mp.spawn(worker, args=(free_port(), sys.argv[1]), nprocs=WORLD)
