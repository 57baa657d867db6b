"""How much of the EP all-to-all time the merged 1F1B schedule hides, on CPU/gloo.

Spawns an ep-rank gloo world (one compute thread per rank; gloo's transfers run on its own
threads) that trains one MoE model twice in the same run, alternating step by step so both see
the same machine load: the plain schedule and the EP-overlap one (`overlap.py`). It then replays
every collective the overlapped step issued (dispatch and combine hops, forward and backward,
same sizes, same order) synchronously with no compute: the all-to-all time alone.

  saved   = (plain step − overlapped step) / all-to-all alone
  blocked = time each schedule spent blocked waiting on the EP hops (`comm.Pending.blocked_s`)

A blocking all-to-all also waits for the slowest peer to arrive, so the plain schedule's
blocked time is the transfer plus the ranks' skew; the overlap can hide both. The saved share
also pays the overlap's own bookkeeping (autograd cut at every sub-module).

    python bench/ep_overlap.py [--ep 2] [--hidden 512] [--seq 512] [--steps 6]

Prints a table and one JSON line. Medians over the steps after the first (warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeplan.runtime.comm import Pending
from moeplan.specs import Layout, ModelSpec, Plan, TrainingSpec, load_cluster


def make_plan(ep: int, overlap: bool, hidden: int, seq: int, microbatches: int,
              top_k: int) -> Plan:
    """A Qwen3-MoE-shaped model with fine-grained experts (16, small FFNs): few layers, and
    top-k copies of every token crossing the all-to-all."""
    model = ModelSpec(name="bench-moe", num_layers=4, hidden_size=hidden,
                      num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=2 * hidden,
                      vocab_size=1024, num_experts=16, moe_top_k=top_k,
                      moe_ffn_hidden_size=max(16, hidden // 8), first_k_dense=0)
    gbs = ep * microbatches
    training = TrainingSpec(seq_len=seq, global_batch_size=gbs, lr=1e-3, warmup_steps=1)
    return Plan(model=model, cluster=load_cluster("h100", gpus=ep), training=training,
                layout=Layout.build(ep, gbs, ep=ep, ep_overlap=overlap))


def replay_s(records) -> float:
    """Every recorded collective again, synchronously and back to back (no compute)."""
    dist.barrier()
    start = time.perf_counter()
    for rec in records:
        for op, shape, dtype in rec.issued:
            op.start(torch.zeros(shape, dtype=dtype)).wait()
    return time.perf_counter() - start


def worker(rank: int, port: int, args, queue) -> None:
    from moeplan.runtime.groups import build_groups
    from moeplan.runtime.train import Trainer
    from moeplan.specs.grid import RankGrid

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ep)
    trainers = {}
    for overlap in (False, True):
        plan = make_plan(args.ep, overlap, args.hidden, args.seq, args.microbatches,
                         args.top_k)
        trainers[overlap] = Trainer(plan, build_groups(RankGrid.from_layout(plan.layout)), seed=0)
    times: dict[bool, list[float]] = {False: [], True: []}
    blocked: dict[bool, list[float]] = {False: [], True: []}
    alone, hidden_hops = [], []
    for step in range(args.steps):
        for overlap in (False, True):
            dist.barrier()
            before = Pending.blocked_s
            metrics, _ = trainers[overlap].step(step)
            times[overlap].append(metrics.step_time_s)
            blocked[overlap].append(Pending.blocked_s - before)
        trace = trainers[True].pipeline.trace
        hidden_hops.append(trace.hidden_fraction())
        alone.append(replay_s(trace.records))
    med = [statistics.median(v[1:]) for v in (times[False], times[True], alone,
                                               blocked[False], blocked[True], hidden_hops)]
    row = torch.tensor([med], dtype=torch.float64)
    every = [torch.zeros_like(row) for _ in range(args.ep)]
    dist.all_gather(every, row)
    if rank == 0:
        queue.put(torch.cat(every).tolist())
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=4, help="per rank and step")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(free_port(), args, queue), nprocs=args.ep)
    rows = queue.get()
    # the step ends together on every rank; the slowest rank's figures are the step's
    plain, ovl, alone, blocked_plain, blocked_ovl, hops = (max(r[i] for r in rows)
                                                           for i in range(6))
    print(f"ep{args.ep}, hidden {args.hidden}, seq {args.seq}, top-{args.top_k} of 16 experts, "
          f"{args.microbatches} micro-batches per rank, gloo, {args.steps} steps (median after "
          "the first)")
    print("| schedule | step s | blocked on EP hops s |")
    print("|---|---|---|")
    print(f"| plain 1F1B | {plain:.3f} | {blocked_plain:.3f} |")
    print(f"| EP overlap | {ovl:.3f} | {blocked_ovl:.3f} |")
    print(f"| all-to-all alone (same hops, no compute) | {alone:.3f} | |")
    print(f"step time saved {plain - ovl:+.3f} s = {(plain - ovl) / alone:.0%} of the all-to-all "
          f"time alone; blocked time cut by {1 - blocked_ovl / blocked_plain:.0%}; "
          f"{hops:.0%} of hops had the other micro-batch's compute behind them")
    print(json.dumps({"ep": args.ep, "hidden": args.hidden, "seq": args.seq, "top_k": args.top_k,
                      "microbatches": args.microbatches, "step_s_plain": plain,
                      "step_s_overlap": ovl, "all_to_all_s_alone": alone,
                      "blocked_s_plain": blocked_plain, "blocked_s_overlap": blocked_ovl,
                      "saved_share_of_all_to_all": (plain - ovl) / alone,
                      "blocked_cut": 1 - blocked_ovl / blocked_plain,
                      "hops_with_compute_behind": hops}))


if __name__ == "__main__":
    main()
