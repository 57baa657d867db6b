"""What one device measures: the calibration grids, and the kernel and overhead
microbenchmarks run on it.

Its own module because two callers run it: `host.measure` in this process, and each
`collectives` worker at once when a CPU host is measured with its peers busy (as in
`moeplan run`), so neither of those modules has to import the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from . import micro


@dataclass(frozen=True)
class Grid:
    """What one calibration measures, and for how long each point runs."""

    gemm_shapes: tuple[tuple[int, int, int], ...]
    grouped: tuple[tuple[int, int, int, int], ...]        # (experts, tokens/expert, k, n)
    attention: tuple[tuple[int, int, int, int], ...]      # (batch, heads, seq, head_dim)
    memory_mb: tuple[int, ...]
    message_bytes: tuple[int, ...]
    min_s: float


def _gemm_grid(dims: tuple[int, ...], k: int, extra: tuple[tuple[int, int, int], ...]
               ) -> tuple[tuple[int, int, int], ...]:
    return tuple((m, k, n) for m in dims for n in (dims[1], dims[-1])) + extra


QUICK = Grid(
    gemm_shapes=_gemm_grid((16, 64, 256, 1024), 512, ((128, 128, 128), (1024, 1024, 1024))),
    grouped=((8, 32, 256, 256), (8, 128, 256, 256)),
    attention=((1, 4, 128, 32), (1, 4, 512, 64)),
    memory_mb=(128,),
    message_bytes=(4 << 10, 64 << 10, 1 << 20, 8 << 20),
    min_s=0.06,
)
FULL = Grid(
    gemm_shapes=_gemm_grid((8, 32, 128, 512, 2048), 1024,
                           ((128, 128, 128), (256, 2048, 256), (2048, 2048, 2048),
                            (4096, 4096, 4096))),
    grouped=((8, 32, 512, 512), (8, 128, 512, 512), (32, 64, 512, 512), (8, 512, 512, 512)),
    attention=((1, 8, 256, 64), (1, 8, 1024, 64), (1, 8, 2048, 128)),
    memory_mb=(32, 256, 1024),
    message_bytes=(4 << 10, 32 << 10, 256 << 10, 2 << 20, 16 << 20, 64 << 20),
    min_s=0.3,
)
# The smallest grid that still fits every constant: for tests.
TINY = Grid(
    gemm_shapes=((16, 128, 64), (64, 128, 256), (256, 128, 256), (256, 256, 256)),
    grouped=((4, 16, 64, 64),),
    attention=((1, 2, 64, 16),),
    memory_mb=(16,),
    message_bytes=(4 << 10, 256 << 10),
    min_s=0.01,
)
GRIDS = {"quick": QUICK, "full": FULL, "tiny": TINY}


def _micro_spec() -> Any:
    """A one-dense-layer, one-MoE-layer model so small that its layers' time is all overhead."""
    from ..specs import ModelSpec

    return ModelSpec(name="calibrate-overhead", num_layers=2, hidden_size=16,
                     num_attention_heads=2, num_kv_heads=2, head_dim=8, ffn_hidden_size=32,
                     vocab_size=64, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=8,
                     first_k_dense=1)


def measure_overheads(device: torch.device, dtype: str, min_s: float) -> tuple[float, float]:
    """(per-layer, per-step) fixed seconds: forward+backward of the runtime's own decoder layers
    at a size where compute is negligible, halved (the cost model adds the per-layer overhead to
    the forward and to the backward); and an AdamW step with grad-norm clipping over a layer's
    worth of tiny parameters plus a scalar reduction (the optimizer/grad-norm/logging floor)."""
    from ..runtime.model import Transformer

    model = Transformer(_micro_spec()).to(device=device, dtype=micro.DTYPES[dtype])
    x = torch.randn(4, 1, 16, device=device, dtype=micro.DTYPES[dtype])   # (s, b, h)
    rope = model.rope(4, x)
    per_layer = []
    for block in model.layers:
        def fwd_bwd(block=block) -> None:
            y = block(x, rope)
            y = y[0] if isinstance(y, tuple) else y
            y.float().sum().backward()
        per_layer.append(micro.time_op(fwd_bwd, device, min_s) / 2)
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        float(torch.stack([p.detach().float().sum() for p in params[:1]]).sum())
    return float(np.mean(per_layer)), micro.time_op(step, device, min_s)


def measure_kernels(grid: Grid, device: torch.device, dtype: str, threads: int,
                    progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """GEMMs (both dtypes), grouped GEMMs, attention, memory bandwidth and overheads on one
    device with `threads` threads: the Measurements fields of the same names."""
    res: dict[str, Any] = {"gemm": {}, "seconds": {}}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        for dt in ("fp32", "bf16"):
            progress(f"GEMM {dt}: {len(grid.gemm_shapes)} shapes")
            res["gemm"][dt] = [asdict(s) for s in micro.gemm_samples(grid.gemm_shapes, dt,
                                                                     device, grid.min_s)]
        res["seconds"]["gemm"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        progress("grouped GEMM")
        res["grouped_gemm"] = [asdict(s) for s in micro.grouped_gemm_samples(
            grid.grouped, dtype, device, grid.min_s)]
        progress("attention")
        res["attention"] = [asdict(s) for s in micro.attention_samples(grid.attention, dtype,
                                                                         device, grid.min_s)]
        progress("memory bandwidth")
        res["memory"] = [asdict(s) for s in micro.memory_samples(grid.memory_mb, device,
                                                                 grid.min_s)]
        progress("per-layer and per-step overheads")
        res["layer_overhead_s"], res["step_overhead_s"] = measure_overheads(device, dtype,
                                                                          grid.min_s)
        with micro.near_gpu(device) as bound:
            res["launch_us"] = micro.launch_us(device)
        res["launch_numa_bound"] = bound
        res["seconds"]["kernels"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    return res
