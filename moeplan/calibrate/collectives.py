"""Collective timings between processes this module launches itself (gloo on CPU, NCCL on GPU).

`measure_collectives` spawns `nproc` workers with torch.multiprocessing; they rendezvous through a
file store in a temporary directory, time each collective over a few message sizes (the slowest
rank's time counts, as it sets the step), and rank 0 writes the timings to a JSON file that the
parent reads back.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..fsio import atomic_write_text

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def _ops(kind: str, nbytes: int, rank: int, n: int, device: torch.device):
    """A closure running one collective on `nbytes` (the size comm.py passes for it)."""
    elems = max(n, nbytes // 4 // n * n)                          # fp32, divisible by n
    x = torch.ones(elems, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x)
    if kind == "all_gather":                                      # gathered size = nbytes
        part = x[: elems // n].clone()
        return lambda: dist.all_gather_into_tensor(x, part)
    if kind == "reduce_scatter":
        part = x[: elems // n].clone()
        return lambda: dist.reduce_scatter_tensor(part, x)
    if kind == "all_to_all":                                      # each rank holds nbytes
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x)
    if kind == "p2p":                                             # ranks 0 → 1, one message
        def send_recv() -> None:
            if rank == 0:
                dist.send(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
        return send_recv
    raise ValueError(kind)


def threads_per_rank(nproc: int) -> int:
    """CPU threads of one of `nproc` ranks, as `moeplan run` sets them: OMP_NUM_THREADS when
    given, else cpu_count // nproc (at least 1)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else max(
        1, (os.cpu_count() or 1) // nproc)


def _time_collective(fn, device: torch.device, min_s: float, batches: int = 2) -> float:
    """Seconds per call, the same repetition count on every rank (a collective's calls must
    match across ranks): fastest batch on this rank, then the slowest rank's."""
    import time

    fn()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    once = torch.tensor([time.perf_counter() - t0], device=device)
    dist.all_reduce(once, op=dist.ReduceOp.MAX)
    reps = max(1, int(min_s / batches / max(once.item(), 1e-7)))
    best = float("inf")
    for _ in range(batches):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    s = torch.tensor([best], device=device)
    dist.all_reduce(s, op=dist.ReduceOp.MAX)
    return float(s.item())


def _worker(rank: int, n: int, store_dir: str, sizes: list[int], min_s: float, use_cuda: bool,
            threads: int, kernels: tuple[Any, str] | None) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            init_method=f"file://{store_dir}/store", rank=rank, world_size=n,
                            timeout=timedelta(seconds=120))
    measured: dict[str, Any] = {}
    if kernels is not None:  # every rank at once, as `moeplan run` ranks share the host
        from .bench import measure_kernels

        dist.barrier()
        measured = measure_kernels(kernels[0], device, kernels[1], threads)
    out: dict[str, list[list[float]]] = {}
    for kind in KINDS:
        rows = []
        for nbytes in sizes:
            fn = _ops(kind, nbytes, rank, n, device)
            rows.append([float(max(n, nbytes // 4 // n * n) * 4),
                         _time_collective(fn, device, min_s)])
        out[kind] = rows
    if rank == 0:
        atomic_write_text(Path(store_dir, "timings.json"),
                          json.dumps({"collectives": out, "kernels": measured}))
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(nproc: int, sizes: list[int], min_s: float = 0.05,
                        use_cuda: bool = False, kernels: tuple[Any, str] | None = None
                        ) -> tuple[dict[str, list[tuple[float, float]]], dict[str, Any] | None]:
    """({collective: [(bytes, seconds), ...]}, rank 0's kernel measurements or None) over
    `nproc` local processes; `kernels` = (Grid, dtype) runs bench.measure_kernels in every rank
    at once first."""
    threads = threads_per_rank(nproc)
    with tempfile.TemporaryDirectory(prefix="moeplan-calibrate-") as tmp:
        mp.start_processes(_worker, args=(nproc, tmp, sizes, min_s, use_cuda, threads, kernels),
                           nprocs=nproc, join=True, start_method="spawn")
        raw = json.loads(Path(tmp, "timings.json").read_text())
    coll = {k: [(float(b), float(t)) for b, t in rows] for k, rows in raw["collectives"].items()}
    return coll, raw["kernels"] or None
