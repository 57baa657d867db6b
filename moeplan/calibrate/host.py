"""`moeplan calibrate`: measure this machine and describe it as a ClusterSpec.

One "device" of the spec is what one `moeplan run` rank gets: a GPU, or on a CPU host a slice of
OMP_NUM_THREADS threads when set, else cpu_count / nproc (as `moeplan run` sets them), measured
while its nproc − 1 peers compute too. Peaks are the best rates the
microbenchmarks reach; the calibration dict holds the efficiency constants of the cost models
fitted to the measured curves, for the dtype `moeplan run` computes in (fp32 on CPU, bf16 on GPU)
relative to the spec's `bf16_tflops` peak, as the cost models price every GEMM against it.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .bench import GRIDS, Grid, measure_kernels
from .collectives import measure_collectives, threads_per_rank
from .fit import GemmSample, fit_collective, fit_gemm_curve

__all__ = ["GRIDS", "Grid", "Measurements", "build_cluster", "measure", "measure_kernels"]


@dataclass
class Measurements:
    """Everything measured, with the machine it was measured on (the `--json` report)."""

    device: str
    device_name: str
    dtype: str
    nproc: int
    threads_per_device: int
    memory_gb_total: float
    gemm: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    grouped_gemm: list[dict[str, float]] = field(default_factory=list)
    attention: list[dict[str, float]] = field(default_factory=list)
    memory: list[dict[str, float]] = field(default_factory=list)
    collectives: dict[str, list[list[float]]] = field(default_factory=dict)
    layer_overhead_s: float | None = None
    step_overhead_s: float | None = None
    launch_us: float | None = None
    launch_numa_bound: bool = False  # measured bound to the GPU's NUMA node, as runs are
    seconds: dict[str, float] = field(default_factory=dict)
    load_average: list[float] = field(default_factory=list)   # 1-min load before and after


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def total_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 8.0


def gpu_architecture(device: torch.device) -> str:
    major, _ = torch.cuda.get_device_capability(device)
    return {8: "ampere", 9: "hopper"}.get(major, "blackwell" if major >= 10 else "ampere")


def measure(grid: Grid, nproc: int, dtype: str | None = None, device: torch.device | None = None,
            progress: Callable[[str], None] = lambda _: None) -> Measurements:
    """Run every microbenchmark of `grid` on this machine.

    On a CPU host with nproc ≥ 2 the kernels run in all nproc processes at once (rank 0's
    figures are kept), so that a device's peaks are what it gets while its peers compute too,
    as in `moeplan run`: cores, caches and memory bandwidth are shared.
    """
    device = device or (torch.device("cuda", 0) if torch.cuda.is_available()
                        else torch.device("cpu"))
    dtype = dtype or ("bf16" if device.type == "cuda" else "fp32")
    threads = threads_per_rank(nproc) if device.type == "cpu" else torch.get_num_threads()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    res = Measurements(device.type, name, dtype, nproc, threads, total_memory_gb(device))
    res.load_average.append(_load())
    kernels: dict[str, Any] | None = None
    if device.type == "cuda" or nproc < 2:
        kernels = measure_kernels(grid, device, dtype, threads, progress)
    t0 = time.perf_counter()
    if nproc >= 2:
        progress(f"{'kernels and ' if kernels is None else ''}collectives over {nproc} "
                 "processes")
        raw, rank0 = measure_collectives(
            nproc, list(grid.message_bytes), grid.min_s, use_cuda=device.type == "cuda",
            kernels=None if kernels is not None else (grid, dtype))
        res.collectives = {k: [list(r) for r in v] for k, v in raw.items()}
        kernels = kernels or rank0
    assert kernels is not None
    for key in ("gemm", "grouped_gemm", "attention", "memory", "layer_overhead_s",
                "step_overhead_s", "launch_us"):
        setattr(res, key, kernels.get(key))
    res.launch_numa_bound = bool(kernels.get("launch_numa_bound"))
    res.seconds.update(kernels["seconds"])
    res.seconds["processes"] = time.perf_counter() - t0   # spawn + (CPU) kernels + collectives
    res.load_average.append(_load())
    return res


def _load() -> float:
    """1-minute load average (other work sharing the machine skews every figure)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def attention_effs(samples: list[dict[str, float]], peak_tflops: float, arch: str
                   ) -> tuple[float, float]:
    """(attn_fwd_eff, attn_bwd_eff): geometric means over the timed shapes of the cost model's
    own attention time at efficiency 1 (compute.attention_time with the keys a tiled kernel
    computes, as layers.py prices core attention) over the measured time."""
    from ..cost_models.calibration import calibration_for
    from ..cost_models.compute import attended_keys, attention_time

    ideal = calibration_for({"attn_fwd_eff": {arch: 1.0}, "attn_bwd_eff": {arch: 1.0}})
    fwd, bwd = [], []
    for a in samples:
        flops = (a["batch"] * a["seq"] * attended_keys(a["seq"]) * a["heads"]
                 * 2 * (2 * a["head_dim"]))
        t_f, t_b = attention_time(flops, peak_tflops, ideal, arch, a["head_dim"])
        fwd.append(math.log(t_f / a["fwd_s"]))
        bwd.append(math.log(t_b / a["bwd_s"]))
    return math.exp(float(np.mean(fwd))), math.exp(float(np.mean(bwd)))


def _peak(samples: list[dict[str, float]]) -> float:
    return max(s["tflops"] for s in samples)


def build_cluster(m: Measurements, name: str = "local") -> dict[str, Any]:
    """A ClusterSpec document (plain dict, YAML-ready) from the measurements.

    bf16_tflops / fp32_tflops: best GEMM rate per dtype. gemm_eff_max, gemm_half_dim: the cost
    model's GEMM curve fitted to the run dtype's GEMMs against bf16_tflops. attn_*_eff: causal
    SDPA against the cost model's own attention time (`attention_effs`). hbm_tb_s: the largest copy's bandwidth; hbm_eff: elementwise ops and norms at that
    size over it. Links: α–β of each collective in comm.py's form; the ring collectives
    (all-gather, reduce-scatter, all-reduce) share one link figure (their geometric mean), which
    becomes the NVLink (and, on one host, scale-out) bandwidth with efficiency 1; all-to-all keeps
    its own efficiency against it. Overheads: `measure_overheads`. Grouped GEMM rates are
    reported, not fitted (the cost models price expert GEMMs as plain GEMMs of their shape).
    """
    arch = "cpu" if m.device == "cpu" else gpu_architecture(torch.device("cuda", 0))
    threads = f"{m.threads_per_device} thread{'s' if m.threads_per_device > 1 else ''}"
    gpu = f"{m.device_name} ({threads})" if m.device == "cpu" else m.device_name
    bf16_peak = _peak(m.gemm["bf16"])
    fp32_peak = _peak(m.gemm["fp32"])
    run = [GemmSample(**s) for s in m.gemm[m.dtype]]
    eff_max, half_dim, gemm_err = fit_gemm_curve(run, bf16_peak)
    attn_fwd, attn_bwd = attention_effs(m.attention, bf16_peak, arch)
    biggest = max(s["size_mb"] for s in m.memory)
    at = {s["op"]: s["gb_s"] for s in m.memory if s["size_mb"] == biggest}
    copy_gb_s = at["copy"]
    others = [v for k, v in at.items() if k not in ("copy", "h2d")]
    hbm_eff = float(math.exp(np.mean(np.log(np.asarray(others) / copy_gb_s)))) if others else 1.0
    mem_gb = m.memory_gb_total / (m.nproc if m.device == "cpu" else 1)
    host_gb = total_memory_gb(torch.device("cpu")) / m.nproc
    host_link_gb_s = at.get("h2d", copy_gb_s)

    links: dict[str, dict[str, float]] = {}
    for kind, rows in m.collectives.items():
        ab = fit_collective(kind, m.nproc, [r[0] for r in rows], [r[1] for r in rows])
        links[kind] = {"alpha_us": ab.alpha_us, "beta_gb_s": ab.beta_gb_s,
                       "rms_log_error": ab.rms_log_error}
    if links:
        ring = [links[k] for k in ("all_gather", "reduce_scatter", "all_reduce")]
        link_gb_s = float(math.exp(np.mean([math.log(r["beta_gb_s"]) for r in ring])))
        link_us = float(math.exp(np.mean([math.log(max(r["alpha_us"], 1e-3)) for r in ring])))
        a2a_eff = links["all_to_all"]["beta_gb_s"] / link_gb_s
        link_src = (f"gloo/NCCL ring collectives between {m.nproc} local processes, α–β fit "
                    "(geometric mean of all-gather, reduce-scatter, all-reduce)")
    else:  # one process: ranks would share memory through the host's copy bandwidth
        link_gb_s, link_us, a2a_eff = copy_gb_s, 0.0, 1.0
        link_src = "one process: no collectives measured; set to the copy bandwidth"

    constants: dict[str, Any] = {
        "gemm_eff_max": {arch: round(eff_max, 4), gpu: round(eff_max, 4)},
        "gemm_half_dim": round(half_dim, 2),
        "attn_fwd_eff": {arch: round(attn_fwd, 4)},
        "attn_bwd_eff": {arch: round(attn_bwd, 4)},
        "hbm_eff": round(hbm_eff, 4),
        "nvlink_eff": 1.0,
        "scaleout_eff": 1.0,
        "a2a_nvlink_eff": round(a2a_eff, 4),
        "a2a_scaleout_eff": round(a2a_eff, 4),
    }
    if m.device == "cpu":  # gloo runs on the cores that compute: no comm hides behind GEMMs
        constants.update(tp_overlap_hidden=0.0, ep_overlap_hidden=0.0)
    if m.layer_overhead_s is not None:
        constants["layer_overhead_s"] = float(f"{m.layer_overhead_s:.4g}")
    if m.step_overhead_s is not None:
        constants["step_overhead_s"] = float(f"{m.step_overhead_s:.4g}")
    if m.launch_us is not None:
        # one host here, whichever CPU kind it is; on a CPU the cores that launch also
        # compute, so launches add to the time (the per-layer overhead measures them) rather
        # than bound it: no floor
        us = 0.0 if m.device == "cpu" else float(f"{m.launch_us:.4g}")
        constants["launch_us"] = {"x86": us, "grace": us}
    per = f" per device ({threads})" if m.device == "cpu" else ""
    doc: dict[str, Any] = {
        "name": name,
        "gpu": gpu,
        "architecture": arch,
        "num_gpus": None,
        "bf16_tflops": float(f"{bf16_peak:.4g}"),
        "fp32_tflops": float(f"{fp32_peak:.4g}"),
        "mamf_tflops": {"bf16": float(f"{bf16_peak:.4g}")},
        "hbm_gb": float(f"{mem_gb:.4g}"),
        "hbm_tb_s": float(f"{copy_gb_s / 1e3:.4g}"),
        "nvlink_gb_s": float(f"{link_gb_s:.4g}"),
        "nvlink_domain_gpus": m.nproc,
        "gpus_per_node": m.nproc,
        "scaleout_gb_s": float(f"{link_gb_s:.4g}"),
        "scaleout_latency_us": float(f"{link_us:.4g}"),
        "nvlink_latency_us": float(f"{link_us:.4g}"),
        "host_memory_gb": float(f"{host_gb:.4g}"),
        "host_link_gb_s": float(f"{host_link_gb_s:.4g}"),
        "calibration": constants,
        "sources": {
            "bf16_tflops": f"best bf16 GEMM of the grid{per}",
            "fp32_tflops": f"best fp32 GEMM of the grid{per}",
            "mamf_tflops": f"best bf16 GEMM of the grid{per}: no GEMM is priced faster",
            "gemm_eff_max": f"{m.dtype} GEMM curve fitted against bf16_tflops "
                            f"(rms log error {gemm_err:.3f})",
            "hbm_tb_s": f"{biggest} MiB copy"
                        + (" (DRAM)" if m.device == "cpu" else ""),
            "hbm_gb": "machine memory" + (f" / {m.nproc} devices" if m.device == "cpu" else ""),
            "nvlink_gb_s": link_src,
            "scaleout_gb_s": "one host: the same local link" if m.device == "cpu" else link_src,
            "layer_overhead_s": "runtime decoder layers at negligible size, fwd+bwd / 2",
            "step_overhead_s": "AdamW step with grad-norm clipping over tiny parameters",
            "launch_us": (f"{m.launch_us:.3g} µs per eager kernel launch measured; a CPU's "
                          "cores launch and compute, so no host floor (0)"
                          if m.device == "cpu" else "eager one-element adds, host time per "
                          "launch, " + ("bound to the GPU's NUMA node as `moeplan run` binds "
                                        "its workers" if m.launch_numa_bound else
                                        "unbound (the GPU's NUMA node is not known here)"))
            if m.launch_us is not None else "not measured",
            **({"tp_overlap_hidden": "gloo collectives run on the cores that compute: TP and EP "
                "communication is all exposed"} if m.device == "cpu" else {}),
            "measured": f"moeplan calibrate, {m.dtype} compute, torch {torch.__version__}, "
                        f"{time.strftime('%Y-%m-%d')}",
        },
    }
    if links:
        doc["sources"]["collectives"] = "; ".join(
            f"{k} α {v['alpha_us']:.1f} µs β {v['beta_gb_s']:.3g} GB/s" for k, v in links.items())
    return doc
