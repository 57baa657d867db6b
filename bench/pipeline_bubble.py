"""Pipeline bubble on CPU: measured idle time of the runtime's schedules vs the cost model.

Spawns a pp-rank gloo world (one thread per rank) that trains a small dense model under 1F1B
(vpp 1) and interleaved 1F1B (vpp 2) for several micro-batch counts. Each rank records the time it
spends blocked on pipeline receives; its busy time per micro-batch gives the per-rank stage
times the cost model takes, so the prediction uses the same stages as the measurement:

  measured bubble  = idle share of the slowest-finishing rank's schedule time, (T − busy)/busy
  predicted bubble = `pipeline_time(rank_times, m, vpp)` bubble / (m · max rank time), and the
                     equal-stage closed form `bubble_fraction(pp, m, vpp)` = (p − 1)/(v·m)

    python bench/pipeline_bubble.py            # prints a table and one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeplan.cost_models.pipeline import bubble_fraction, pipeline_time
from moeplan.specs import Layout, ModelSpec, Plan, TrainingSpec, load_cluster


def make_plan(pp: int, vpp: int, m: int, hidden: int, seq: int) -> Plan:
    model = ModelSpec(name="bench-dense", num_layers=4 * vpp, hidden_size=hidden,
                      num_attention_heads=8, num_kv_heads=4, ffn_hidden_size=4 * hidden,
                      vocab_size=1024)
    training = TrainingSpec(seq_len=seq, global_batch_size=m, lr=1e-3, warmup_steps=1)
    return Plan(model=model, cluster=load_cluster("h100", gpus=pp), training=training,
                layout=Layout.build(pp, m, pp=pp, vpp=vpp))


def worker(rank: int, port: int, pp: int, cases: list, steps: int, hidden: int, seq: int,
           queue) -> None:
    from moeplan.runtime.groups import build_groups
    from moeplan.runtime.train import Trainer
    from moeplan.specs.grid import RankGrid

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=pp)
    for vpp, m in cases:
        plan = make_plan(pp, vpp, m, hidden, seq)
        trainer = Trainer(plan, build_groups(RankGrid.from_layout(plan.layout)), seed=0)
        for step in range(steps):
            trainer.step(step)
        hist = trainer.pipeline.stats.history[1:]  # the first step warms up
        wait = statistics.median(w for w, _ in hist)
        total = statistics.median(t for _, t in hist)
        stats = torch.tensor([[wait, total]], dtype=torch.float64)
        every = [torch.zeros_like(stats) for _ in range(pp)]
        dist.all_gather(every, stats)
        if rank == 0:
            queue.put((vpp, m, torch.cat(every).tolist()))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    a = p.parse_args()
    cases = [(1, 2), (1, 4), (1, 8), (2, 4), (2, 8)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(port, a.pp, cases, a.steps, a.hidden, a.seq, queue), nprocs=a.pp)
    rows = []
    print(f"{'schedule':<14}{'m':>4}{'step ms':>10}{'measured':>10}{'predicted':>11}"
          f"{'(p-1)/(vm)':>12}")
    for _ in cases:
        vpp, m, per_rank = queue.get()
        total = max(t for _, t in per_rank)
        busy = [t - w for w, t in per_rank]  # per rank: all its micro-batches, all chunks
        measured = (total - max(busy)) / max(busy)
        _, bubble = pipeline_time([b / m for b in busy], m, vpp)
        predicted = bubble / max(busy)
        ideal = bubble_fraction(a.pp, m, vpp)
        name = "1F1B" if vpp == 1 else f"interleaved v{vpp}"
        print(f"{name:<14}{m:>4}{total * 1e3:>10.1f}{measured:>10.3f}{predicted:>11.3f}"
              f"{ideal:>12.3f}")
        rows.append({"pp": a.pp, "vpp": vpp, "m": m, "step_s": total, "measured": measured,
                     "predicted": predicted, "closed_form": ideal})
    print(json.dumps({"pipeline_bubble": rows}))


if __name__ == "__main__":
    main()
