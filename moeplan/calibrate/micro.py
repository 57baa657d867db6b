"""Microbenchmarks of this machine's compute and memory: GEMMs, grouped GEMMs, attention, copies.

Each timing runs the op once to warm up, then repeats it in a few batches for at least
`min_s` seconds and keeps the fastest batch's mean: the steady rate the device sustains, not its
first-call or noisy-neighbour cost. Shapes in comments are tensor dims.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels.torch_backend import TorchBackend
from ..runtime.guard import numa_cpus, pci_address
from .fit import GemmSample

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def near_gpu(device: torch.device) -> Iterator[bool]:
    """This process bound, while inside, to the CPUs of its GPU's NUMA node, as `moeplan run`
    binds each worker (torchrun --numa-binding node): the host time per launch it measures is
    the one a run's ranks pay. Yields whether it is bound (a CPU device, or a GPU whose node is
    unknown, is measured as it runs)."""
    cpus: set[int] = set()
    if device.type == "cuda" and hasattr(os, "sched_setaffinity"):
        bus = pci_address(torch.cuda.get_device_properties(device))
        if bus is not None:
            cpus = numa_cpus(bus)
    if not cpus:
        yield False
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield True
    finally:
        os.sched_setaffinity(0, before)


def launch_us(device: torch.device, n: int = 2000) -> float:
    """Host microseconds per eager kernel launch: `n` one-element in-place adds issued back to
    back, timed on the host before the device is waited for (on a GPU the kernels queue, so the
    loop measures the Python, PyTorch-dispatcher and cudaLaunchKernel cost of each; on a CPU
    each op also runs, and its compute on one element is negligible). The host floor's
    `launch_us` (cost_models.host)."""
    x = torch.zeros(1, device=device)
    for _ in range(50):  # warm the dispatcher and the kernel cache
        x.add_(1.0)
    device_sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    host = time.perf_counter() - t0
    device_sync(device)
    return host / n * 1e6


def time_op(fn: Callable[[], object], device: torch.device, min_s: float = 0.05,
            batches: int = 3) -> float:
    """Seconds per call of `fn`: fastest of `batches` batches, each ≥ min_s/batches long."""
    fn()
    device_sync(device)
    t0 = time.perf_counter()
    fn()
    device_sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, int(min_s / batches / once))
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        device_sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def gemm_samples(shapes: Sequence[tuple[int, int, int]], dtype: str, device: torch.device,
                 min_s: float) -> list[GemmSample]:
    """Achieved TFLOPS of (m×k)·(k×n) GEMMs, 2·m·k·n FLOPs each (compute.gemm_flops)."""
    out = []
    dt = DTYPES[dtype]
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dt, device=device)   # (m, k)
        b = torch.randn(k, n, dtype=dt, device=device)   # (k, n)
        s = time_op(lambda a=a, b=b: a @ b, device, min_s)
        out.append(GemmSample(m, k, n, 2.0 * m * k * n / s / 1e12))
    return out


@dataclass(frozen=True)
class GroupedSample:
    """A grouped expert GEMM: `experts` GEMMs of (tokens×k)·(k×n), as the runtime runs them."""

    experts: int
    tokens: int
    k: int
    n: int
    tflops: float


def grouped_gemm_samples(cases: Sequence[tuple[int, int, int, int]], dtype: str,
                         device: torch.device, min_s: float) -> list[GroupedSample]:
    """Achieved TFLOPS of the runtime's grouped GEMM (kernels/torch_backend.py: torch._grouped_mm
    where supported, else a per-expert loop) for (experts, tokens per expert, k, n) cases."""
    backend = TorchBackend()
    out = []
    dt = DTYPES[dtype]
    for e, t, k, n in cases:
        x = torch.randn(e * t, k, dtype=dt, device=device)      # (E·T, k) grouped by expert
        w = torch.randn(e, k, n, dtype=dt, device=device)       # (E, k, n)
        counts = torch.full((e,), t, dtype=torch.int64, device=device)
        s = time_op(lambda x=x, w=w, c=counts: backend.grouped_mm(x, w, c), device, min_s)
        out.append(GroupedSample(e, t, k, n, 2.0 * e * t * k * n / s / 1e12))
    return out


@dataclass(frozen=True)
class AttentionSample:
    """Causal SDPA over (batch, heads, seq, head_dim): forward and backward seconds."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    fwd_s: float
    bwd_s: float

    @property
    def flops_fwd(self) -> float:
        """Megatron's core-attention count: 2·s²·h·(d_qk + d_v), halved by the causal mask."""
        return self.batch * 2.0 * self.seq * self.seq * self.heads * 2 * self.head_dim / 2.0


def attention_samples(cases: Sequence[tuple[int, int, int, int]], dtype: str,
                      device: torch.device, min_s: float) -> list[AttentionSample]:
    out = []
    dt = DTYPES[dtype]
    for b, h, s, d in cases:
        q, k, v = (torch.randn(b, h, s, d, dtype=dt, device=device, requires_grad=True)
                   for _ in range(3))                        # (B, H, S, D)
        g = torch.randn(b, h, s, d, dtype=dt, device=device)

        def fwd(q=q, k=k, v=v) -> torch.Tensor:
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def bwd(q=q, k=k, v=v, g=g, y=y) -> None:
            torch.autograd.grad(y, (q, k, v), g, retain_graph=True)

        out.append(AttentionSample(b, h, s, d, time_op(fwd, device, min_s),
                                   time_op(bwd, device, min_s)))
    return out


@dataclass(frozen=True)
class MemorySample:
    """Bytes moved per second by one memory-bound op (reads + writes)."""

    op: str
    size_mb: int
    nbytes: int
    gb_s: float


def memory_samples(sizes_mb: Sequence[int], device: torch.device, min_s: float
                   ) -> list[MemorySample]:
    """Copy (read + write), elementwise add (2 reads + 1 write) and an RMSNorm-like op
    (read, reduce, scale, write: the norm/activation traffic the cost model prices) in fp32."""
    out = []
    for mb in sizes_mb:
        n = mb * 2**20 // 4
        x = torch.randn(n, device=device)
        y = torch.empty_like(x)
        z = torch.randn(n, device=device)
        rows, out_rows = x.view(-1, 1024), y.view(-1, 1024)        # (N/1024, 1024)
        norms = torch.empty(rows.shape[0], 1, device=device)

        def rmsnorm(r: torch.Tensor = rows, o: torch.Tensor = out_rows,
                    nrm: torch.Tensor = norms) -> None:
            torch.linalg.vector_norm(r, dim=-1, keepdim=True, out=nrm)
            torch.mul(r, nrm.reciprocal_(), out=o)

        ops: dict[str, tuple[Callable[[], object], int]] = {
            "copy": (lambda x=x, y=y: y.copy_(x), 2 * 4 * n),
            "add": (lambda x=x, y=y, z=z: torch.add(x, z, out=y), 3 * 4 * n),
            "rmsnorm": (rmsnorm, 3 * 4 * n),       # read twice (norm, scale), write once
        }
        if device.type == "cuda":  # host link: pinned host memory → device
            host = torch.empty(n, pin_memory=True)
            ops["h2d"] = (lambda h=host, y=y: y.copy_(h, non_blocking=True), 4 * n)
        for name, (fn, nbytes) in ops.items():
            s = time_op(fn, device, min_s)
            out.append(MemorySample(name, mb, nbytes, nbytes / s / 1e9))
    return out
