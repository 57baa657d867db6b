"""The calibration profile: every efficiency constant the cost models use, in one place.

Shipped defaults live in `calibration.json` next to this file (written by
`bench/fit_calibration.py` from every published run it can score, so its error on them is in
sample; the evidence is cross-validation, whose folds refit without the rows they predict). A
ClusterSpec's `calibration` dict (from `moeplan calibrate` or `--calibration FILE`)
overrides any key. Keys that are dicts are keyed by GPU architecture or precision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class Calibration:
    """Efficiency constants (dimensionless unless suffixed). See calibration.json for values."""

    # GEMMs: eff = gemm_eff_max[gpu or arch] · shape factor (compute.gemm_efficiency). Keyed by
    # GPU model where the fit saw it (products of one architecture sustain different clocks
    # under their power limits: GB300 at 1400 W vs B200 at 1000 W), else by architecture.
    gemm_eff_max: dict[str, float]
    gemm_half_dim: float
    # low precision: speed-up over BF16 = 1 + (peak_p/peak_bf16 − 1) · lowp_gain[precision]
    lowp_gain: dict[str, float]
    # attention core (flash/cuDNN) forward and backward fraction of the BF16 peak, per arch
    attn_fwd_eff: dict[str, float]
    attn_bwd_eff: dict[str, float]
    # memory-bound work: achieved fraction of HBM bandwidth, and a multiplier on our byte count
    hbm_eff: float
    membound_scale: float
    # links: achieved fraction of datasheet bandwidth
    nvlink_eff: float
    scaleout_eff: float
    a2a_nvlink_eff: float
    a2a_scaleout_eff: float
    # η of TP communication under TP comm overlap (Layout.tp_comm_overlap, TE userbuffers):
    # the most it hides when the GEMMs beside it are long enough; without it none is hidden
    tp_overlap_hidden: float
    # η of EP all-to-all under EP overlap (merged fwd/bwd): the most it hides when the other
    # micro-batch's compute is long enough (Megatron Core MoE report: ≈ 93 %)
    ep_overlap_hidden: float
    # fixed per-step overhead (optimizer launch, grad-norm, logging), seconds
    step_overhead_s: float
    # kernel-launch overhead of one decoder layer per forward or backward pass when its kernels
    # are launched one by one (no CUDA graphs), seconds; Layout.cuda_graphs removes the share
    # the graphs capture (cost_models.layers.graphed_share)
    layer_overhead_s: float
    # memory: allocator fragmentation fraction, fixed workspace GB, HBM reserve GB
    frag_frac: float
    workspace_gb: float
    reserve_gb: float
    # which (architecture, precision) pairs the fit saw, for the confidence label
    calibrated: list[str]
    # attention efficiency vs head dim: the D of compute.attention_head_dim_factor
    attn_head_dim_half: float = 64.0
    # share of the GPU's compute that communication kernels occupy while they overlap compute,
    # per architecture (DeepEP on H100: 24 of 132 SMs; NCCL channels similar), cost_models.overlap
    comm_sm_fraction: dict[str, float] = field(
        default_factory=lambda: {"ampere": 0.15, "hopper": 0.15, "blackwell": 0.1})
    # achieved fraction of the host's memory bandwidth for the host Adam step (optimizer offload)
    host_mem_eff: float = 0.7
    # GEMM shape curve per architecture where the fit moved it off `gemm_half_dim` (tile sizes
    # and wave quantisation differ between generations: a larger half-dim makes big GEMMs gain
    # more over small ones, as dense scaling from 22B to 1T on A100 shows)
    gemm_half_dim_arch: dict[str, float] = field(default_factory=dict)
    # seconds a pipeline rank loses at each chunk pass's stage boundary in the steady state
    # (p2p handshake and the next chunk's start), per forward or backward pass of a chunk
    pp_boundary_s: float = 0.0
    # HBM the CUDA graphs hold (their memory pool and static input/output buffers), GB per GPU;
    # no published row documents graphs, so this is a prior, not a fit (Megatron-LM's guide:
    # graphs "increase memory usage")
    cuda_graph_gb: float = 2.0
    # share of today's attention microbenchmark (attn_fwd_eff/attn_bwd_eff, cuDNN kernels
    # alone) that the attention of an older software stack realised, per architecture: the
    # kernels and Transformer Engine's context-parallel path of 2024 and before
    # (TrainingSpec.software_stack other than 'current'); fitted on the rows of those stacks
    # only, ≤ 1 (missing: 1). The current stack runs the measured kernels as measured.
    attn_realised: dict[str, float] = field(default_factory=dict)
    # host time per eager kernel launch (Python module code, PyTorch dispatcher,
    # cudaLaunchKernel), microseconds, per host CPU ("x86", "grace"; cost_models.host): the
    # floor a layer's time cannot go below; NVIDIA's Nsight Systems guide measures ≈ 20 µs for
    # one PyTorch element-wise kernel on a V100-era host; `moeplan calibrate` measures its own.
    # Missing: no host floor
    launch_us: dict[str, float] = field(default_factory=dict)
    # published/priced tokens/s of one model at one precision ("gpt-oss-120b/bf16"), where the
    # fit rows of that model and precision are off as a whole (at least
    # uncertainty.MODEL_ROWS of them, their median ratio MODEL_RATIO or more off): the measured
    # slowdown of a software path the physics does not explain, carried as unmodelled time
    # (`residual_for`). Computed after the constants are fitted (`validation.fit.fit`), from
    # the fit rows only, so a fold that leaves a model out has none for it. Replaced whole by
    # an override, never merged (`with_overrides`): a fold's profile must not inherit the
    # shipped profile's entries. Missing: none.
    model_residual: dict[str, float] = field(default_factory=dict)
    # the 80 % band of measured/predicted throughput of a cluster's own runs after
    # `moeplan calibrate --from-runs` refitted on them: {"low", "high", "runs"}, `low` the
    # share below the point and `high` above it; it replaces the published rows' band for
    # plans priced on that cluster (uncertainty.measured_bounds). Replaced whole by an
    # override, never merged. Missing: the published rows' band
    interval_runs: dict[str, float] = field(default_factory=dict)

    def residual_for(self, model: str, precision: str) -> float:
        """The measured speed of a model at a precision relative to what the cost models price
        (≤ 1; 1 where the fit rows showed no slowdown as a whole). Never above 1: a model the
        physics prices too slowly is a physics error to fix, and a residual may not price a
        run faster than the hardware work the model counts (nor break the search's bounds,
        which are priced without it)."""
        return min(1.0, self.model_residual.get(residual_key(model, precision), 1.0))

    def residual_models(self) -> set[str]:
        """The models some precision of which carries a measured residual."""
        return {k.split("/", 1)[0] for k in self.model_residual}

    def launch_s(self, host: str) -> float:
        """Host seconds per kernel launch on a host CPU kind (0: no floor priced)."""
        return self.launch_us.get(host, 0.0) * 1e-6

    def sm_fraction(self, arch: str) -> float:
        return self.comm_sm_fraction.get(arch, 0.15)

    def half_dim_for(self, arch: str) -> float:
        return self.gemm_half_dim_arch.get(arch, self.gemm_half_dim)

    def gemm_eff_max_for(self, cluster: Any) -> float:
        """Peak GEMM efficiency for a cluster: its GPU model's entry, else its architecture's."""
        return self.gemm_eff_max.get(cluster.gpu, self.gemm_eff_max[cluster.architecture])

    def with_overrides(self, overrides: dict[str, Any]) -> Calibration:
        """A copy with `overrides` applied (dict-valued keys merge entry by entry)."""
        known = {f.name for f in fields(self)}
        upd: dict[str, Any] = {}
        for k, v in overrides.items():
            if k not in known:
                continue
            cur = getattr(self, k)
            merge = isinstance(cur, dict) and isinstance(v, dict) and k not in REPLACED
            upd[k] = {**cur, **v} if merge else v
        return replace(self, **upd) if upd else self

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def residual_key(model: str, precision: str) -> str:
    """The key of Calibration.model_residual for a model preset at a precision."""
    return f"{model}/{precision}"


KEYED_BY_GPU = frozenset({"gemm_eff_max", "attn_fwd_eff", "attn_bwd_eff", "attn_realised",
                          "comm_sm_fraction", "gemm_half_dim_arch"})
"""Dict-valued keys whose entries are keyed by GPU model or architecture: pricing a cluster reads
its own entry alone (`gemm_eff_max`: its GPU's, else its architecture's)."""


def unread_entries(overrides: dict[str, Any], cluster: Any) -> list[str]:
    """The entries of `overrides` that pricing `cluster` under them never reads, as
    `key[entry]`: those of a table keyed by GPU or architecture (`KEYED_BY_GPU`) for another
    GPU or architecture, and a GEMM peak by architecture where the profile holds one for the
    cluster's GPU itself (`Calibration.gemm_eff_max_for`)."""
    cal = calibration_on(cluster, overrides)
    arch = cluster.architecture
    read = {key: {arch} for key in KEYED_BY_GPU}
    read["gemm_eff_max"] = {cluster.gpu if cluster.gpu in cal.gemm_eff_max else arch}
    return [f"{key}[{entry}]" for key, table in overrides.items()
            if key in read and isinstance(table, dict) for entry in table
            if entry not in read[key]]


REPLACED = frozenset({"model_residual", "interval_runs"})
"""Dict-valued keys an override replaces whole instead of merging entry by entry: what one fit
measured of its own rows, which another fit's entries must not leak into."""


@lru_cache(maxsize=1)
def default_calibration() -> Calibration:
    """The shipped profile (read once per process)."""
    text = (resources.files("moeplan.cost_models") / "calibration.json").read_text()
    data = json.loads(text)
    data.pop("_about", None)
    return Calibration(**data)


def _freeze(d: dict[str, Any]) -> str:
    return json.dumps(d, sort_keys=True)


@lru_cache(maxsize=64)
def _overlaid(frozen: str) -> Calibration:
    return default_calibration().with_overrides(json.loads(frozen))


def calibration_for(overrides: dict[str, Any] | None) -> Calibration:
    """The shipped profile with a cluster's overrides applied (cached per distinct overrides)."""
    if not overrides:
        return default_calibration()
    return _overlaid(_freeze(overrides))


def calibration_on(cluster: Any, overrides: dict[str, Any] | None = None) -> Calibration:
    """The profile an estimate prices `cluster` with: the cluster's overrides, then a caller's
    (a fit's trial constants) on top. Whatever reads an estimate's own constants beside it
    (the memory a run could use) takes them from here, so the two never disagree."""
    return calibration_for({**(cluster.calibration or {}), **(overrides or {})})
