"""`moeplan calibrate`: measure this machine and describe it as a ClusterSpec.

One "device" of the spec is what one `moeplan run` rank gets: a GPU, or on a CPU host a slice of
OMP_NUM_THREADS threads when set, else cpu_count / nproc (as `moeplan run` sets them), measured
while its nproc − 1 peers compute too. The calibration dict holds the efficiency constants of
the cost models fitted to the measured curves, for the dtype `moeplan run` computes in (fp32 on
CPU, bf16 on GPU), each relative to the figure of the spec the cost models multiply it by
(`bf16_tflops`, `hbm_tb_s`, `nvlink_gb_s`). A GPU a cluster preset describes is written as that
preset with the measured constants, relative to its datasheet figures, so that they price what
was measured whether the file is the cluster (`--cluster FILE`) or overlaid on the preset
(`--calibration FILE`, which takes the constants alone; as the cluster the file also carries
the measured link latency, host link and GEMM ceiling). Any other device is written with the
best rates it reached as its peaks.
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

from ..terminal import plural
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
    architecture: str = "cpu"  # ClusterSpec.architecture of the device measured
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


PRESET_OF_DEVICE: dict[str, str] = {
    "NVIDIA A100-SXM4-80GB": "a100-80g",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H200": "h200",
    "NVIDIA H800": "h800",
    "NVIDIA B200": "b200",
    "NVIDIA B300 SXM6 AC": "b300",
    "NVIDIA GB200": "gb200-nvl72",
    "NVIDIA GB300": "gb300-nvl72",
}
"""The cluster preset of each GPU by the name CUDA reports for it (`torch.cuda.get_device_name`).
Exact names only: a PCIe or NVL part of the same chip ("NVIDIA H100 PCIe", "NVIDIA H200 NVL")
runs at other clocks and power, which no preset describes."""


def device_preset(device_name: str) -> str | None:
    """The cluster preset of a CUDA device name (`PRESET_OF_DEVICE`), or None."""
    return PRESET_OF_DEVICE.get(device_name.strip())


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
    res = Measurements(device.type, name, dtype, nproc, threads, total_memory_gb(device),
                       architecture="cpu" if device.type == "cpu" else gpu_architecture(device))
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


def attention_effs(samples: list[dict[str, float]], peak_tflops: float, arch: str,
                   exp_scale: float = 1.0) -> tuple[float, float]:
    """(attn_fwd_eff, attn_bwd_eff): geometric means over the timed shapes of the cost model's
    own attention time at efficiency 1 over the measured time. The time is priced as layers.py
    prices core attention (the keys a tiled kernel computes, its head dim, its keys per call,
    the GPU's exponential rate), so that pricing a timed shape with the fitted constants gives
    back its measured time: an efficiency fitted without the length factor would be divided by
    it a second time when a sequence is priced."""
    from ..cost_models.calibration import calibration_for
    from ..cost_models.compute import attended_keys, attention_time

    ideal = calibration_for({"attn_fwd_eff": {arch: 1.0}, "attn_bwd_eff": {arch: 1.0}})
    fwd, bwd = [], []
    for a in samples:
        flops = (a["batch"] * a["seq"] * attended_keys(a["seq"]) * a["heads"]
                 * 2 * (2 * a["head_dim"]))
        f0, b0 = attention_time(flops, peak_tflops, ideal, arch, a["head_dim"], a["seq"])
        f1, _ = attention_time(flops, peak_tflops, ideal, arch, a["head_dim"], a["seq"],
                               exp_scale=exp_scale)
        # forward: the softmax's saving scales with its time, so eff = ideal / measured; the
        # backward saves the forward's seconds (compute.sfu_saving), which the fitted forward
        # efficiency fixes: measured = b0/eff_b − (f0 − f1)/eff_f
        eff_f = f1 / a["fwd_s"]
        fwd.append(math.log(eff_f))
        bwd.append(math.log(b0 / (a["bwd_s"] + (f0 - f1) / eff_f)))
    return math.exp(float(np.mean(fwd))), math.exp(float(np.mean(bwd)))


def grouped_vs_priced(samples: list[dict[str, float]], peak_tflops: float,
                      constants: dict[str, Any], arch: str, ceiling: float | None
                      ) -> list[float]:
    """Measured over priced rate of each grouped expert GEMM, priced as layers.py prices the
    experts of a layer (`experts` GEMMs of the tokens each one receives, the GEMM curve at that
    M) with the fitted `constants`: how far the grouped kernel the runtime runs departs from
    the plain GEMM of its per-expert shape. Reported, not fitted."""
    from ..cost_models.calibration import calibration_for
    from ..cost_models.compute import gemm_time

    cal = calibration_for(constants)
    out = []
    for g in samples:
        e, t, k, n = int(g["experts"]), g["tokens"], g["k"], g["n"]
        priced = gemm_time(t, k, n, peak_tflops, cal, constants["gemm_eff_max"][arch],
                           count=e, half_dim=cal.half_dim_for(arch), ceiling_tflops=ceiling)
        measured = 2.0 * e * t * k * n / (g["tflops"] * 1e12)
        out.append(priced / measured)   # measured rate over priced rate
    return out


def _span(values: list[float], fmt: str) -> str:
    """"lo–hi" of some figures, or the one figure they all round to."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def _peak(samples: list[dict[str, float]]) -> float:
    return max(s["tflops"] for s in samples)


def build_cluster(m: Measurements, name: str = "local") -> dict[str, Any]:
    """A ClusterSpec document (plain dict, YAML-ready) from the measurements.

    Each efficiency is fitted against the figure of the spec it multiplies: gemm_eff_max and
    its shape curve (gemm_half_dim, and gemm_half_dim_arch for the architecture, whose shipped
    entry would otherwise pair the fitted peak with another curve) to the run dtype's GEMMs
    against bf16_tflops; attn_*_eff: causal SDPA against the cost model's own attention time
    (`attention_effs`); hbm_eff: elementwise ops and norms of the largest size against
    hbm_tb_s. Links: α–β of each collective in comm.py's form; the ring collectives
    (all-gather, reduce-scatter, all-reduce) share one link figure (their geometric mean):
    nvlink_eff is it over nvlink_gb_s, and all-to-all keeps its own efficiency against
    nvlink_gb_s. Overheads: `measure_overheads`. Grouped GEMM rates are reported, not fitted
    (the cost models price expert GEMMs as plain GEMMs of their shape).

    On a GPU a preset describes (`device_preset`) the figures are the preset's datasheet ones,
    the document is the preset with these constants, and what one host cannot measure (the
    scale-out network) keeps the shipped constants. Elsewhere the figures are the measured ones
    (best GEMM rate, largest copy, ring link, each at efficiency 1, the link standing for the
    scale-out network too on one host).
    """
    from ..specs.loader import load_cluster

    arch = m.architecture
    threads = plural(m.threads_per_device, "thread")
    preset_name = device_preset(m.device_name) if m.device == "cuda" else None
    preset = load_cluster(preset_name) if preset_name else None
    bf16_best = _peak(m.gemm["bf16"])
    fp32_best = _peak(m.gemm["fp32"])
    peak = preset.bf16_tflops if preset else bf16_best
    run = [GemmSample(**s) for s in m.gemm[m.dtype]]
    eff_max, half_dim, gemm_err = fit_gemm_curve(run, peak)
    attn_fwd, attn_bwd = attention_effs(m.attention, peak, arch,
                                        preset.sfu_exp_scale if preset else 1.0)
    biggest = max(s["size_mb"] for s in m.memory)
    at = {s["op"]: s["gb_s"] for s in m.memory if s["size_mb"] == biggest}
    copy_gb_s = at["copy"]
    mem_gb_s = preset.hbm_tb_s * 1e3 if preset else copy_gb_s
    ops = [v for k, v in at.items() if k not in ("copy", "h2d")] or [copy_gb_s]
    hbm_eff = float(math.exp(np.mean(np.log(np.asarray(ops) / mem_gb_s))))
    host_link_gb_s = at.get("h2d", copy_gb_s)

    links: dict[str, dict[str, float]] = {}
    for kind, rows in m.collectives.items():
        ab = fit_collective(kind, m.nproc, [r[0] for r in rows], [r[1] for r in rows])
        links[kind] = {"alpha_us": ab.alpha_us, "beta_gb_s": ab.beta_gb_s,
                       "rms_log_error": ab.rms_log_error}
    constants: dict[str, Any] = {
        "gemm_eff_max": {arch: round(eff_max, 4)},
        "gemm_half_dim": round(half_dim, 2),
        "gemm_half_dim_arch": {arch: round(half_dim, 2)},
        "attn_fwd_eff": {arch: round(attn_fwd, 4)},
        "attn_bwd_eff": {arch: round(attn_bwd, 4)},
        "hbm_eff": round(hbm_eff, 4),
    }
    link_gb_s = link_us = None
    if links:
        ring = [links[k] for k in ("all_gather", "reduce_scatter", "all_reduce")]
        link_gb_s = float(math.exp(np.mean([math.log(r["beta_gb_s"]) for r in ring])))
        link_us = float(math.exp(np.mean([math.log(max(r["alpha_us"], 1e-3)) for r in ring])))
        link_src = (f"{'NCCL' if m.device == 'cuda' else 'gloo'} ring collectives between "
                    f"{m.nproc} local processes, α–β fit (geometric mean of all-gather, "
                    "reduce-scatter, all-reduce)")
        ref = preset.nvlink_gb_s if preset else link_gb_s
        a2a_eff = round(links["all_to_all"]["beta_gb_s"] / ref, 4)
        constants.update(nvlink_eff=round(link_gb_s / ref, 4), a2a_nvlink_eff=a2a_eff)
        if not preset:
            constants.update(scaleout_eff=1.0, a2a_scaleout_eff=a2a_eff)
    elif not preset:  # one process: ranks would share memory through the host's copy bandwidth
        link_gb_s, link_us = copy_gb_s, 0.0
        link_src = "one process: no collectives measured; set to the copy bandwidth"
        constants.update(nvlink_eff=1.0, scaleout_eff=1.0, a2a_nvlink_eff=1.0,
                         a2a_scaleout_eff=1.0)
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
    sources: dict[str, str] = {
        "gemm_eff_max": f"{m.dtype} GEMM curve fitted against bf16_tflops "
                        f"(rms log error {gemm_err:.3f})",
        "hbm_eff": f"elementwise ops and norms of {biggest} MiB against hbm_tb_s",
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
        "measured": f"moeplan calibrate on {m.device_name}, {m.dtype} compute, torch "
                    f"{torch.__version__}, {time.strftime('%Y-%m-%d')}",
    }
    # the GEMM ceiling the file carries: the larger of the published one and the grid's best
    ceiling = float(f"{bf16_best:.4g}")
    if preset:
        ceiling = max(preset.mamf_tflops.get("bf16", 0.0), ceiling)
    if m.grouped_gemm:
        ratios = grouped_vs_priced(m.grouped_gemm, peak, constants, arch, ceiling)
        tokens = [g["tokens"] for g in m.grouped_gemm]
        sources["grouped_gemm"] = (
            f"the runtime's grouped expert GEMM at {_span(ratios, '.2f')}× the rate priced for "
            f"its per-expert shape ({_span(tokens, 'g')} tokens per expert, "
            f"{plural(len(ratios), 'shape')}); reported, not fitted")
    if links:
        sources["collectives"] = "; ".join(f"{k} α {v['alpha_us']:.1f} µs β "
                                           f"{v['beta_gb_s']:.3g} GB/s"
                                           for k, v in links.items())
        sources["nvlink_eff"] = link_src
    if preset:
        doc = preset.model_dump(mode="json")
        mamf = {**preset.mamf_tflops, "bf16": ceiling}
        constants["gemm_eff_max"][preset.gpu] = constants["gemm_eff_max"][arch]
        doc.update(name=name, num_gpus=None, fp32_tflops=float(f"{fp32_best:.4g}"),
                   mamf_tflops=mamf, host_link_gb_s=float(f"{host_link_gb_s:.4g}"),
                   calibration=constants)
        if link_us is not None:
            doc["nvlink_latency_us"] = float(f"{link_us:.4g}")
        doc["sources"] = {
            **preset.sources,
            **sources,
            "preset": f"{m.device_name} is the `{preset_name}` preset's GPU: its datasheet "
                      "figures, the constants measured against them; what one host cannot "
                      "measure (the scale-out network) keeps the shipped constants",
            "mamf_tflops": f"the larger of the published figure and the grid's best bf16 GEMM "
                           f"({bf16_best:.4g})",
            "fp32_tflops": "best fp32 GEMM of the grid",
            "host_link_gb_s": "pinned host-to-device copy of the largest size",
        }
        return doc
    gpu = f"{m.device_name} ({threads})" if m.device == "cpu" else m.device_name
    constants["gemm_eff_max"][gpu] = constants["gemm_eff_max"][arch]
    mem_gb = m.memory_gb_total / (m.nproc if m.device == "cpu" else 1)
    host_gb = total_memory_gb(torch.device("cpu")) / m.nproc
    assert link_gb_s is not None and link_us is not None
    return {
        "name": name,
        "gpu": gpu,
        "architecture": arch,
        "num_gpus": None,
        "bf16_tflops": float(f"{bf16_best:.4g}"),
        "fp32_tflops": float(f"{fp32_best:.4g}"),
        "mamf_tflops": {"bf16": ceiling},
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
        **({"host_memory_bw_gb_s": float(f"{copy_gb_s:.4g}")} if m.device == "cpu" else {}),
        "calibration": constants,
        "sources": {
            "bf16_tflops": f"best bf16 GEMM of the grid{per}",
            "fp32_tflops": f"best fp32 GEMM of the grid{per}",
            "mamf_tflops": f"best bf16 GEMM of the grid{per}: no GEMM is priced faster",
            "hbm_tb_s": f"{biggest} MiB copy" + (" (DRAM)" if m.device == "cpu" else ""),
            "hbm_gb": "machine memory"
                      + (f" / {plural(m.nproc, 'device')}" if m.device == "cpu" else ""),
            **({"host_memory_bw_gb_s": f"{biggest} MiB copy (DRAM), as hbm_tb_s"}
               if m.device == "cpu" else {}),
            "nvlink_gb_s": link_src,
            "scaleout_gb_s": "one host: the same local link" if m.device == "cpu" else link_src,
            **sources,
        },
    }
