"""ClusterSpec: per-GPU peaks plus the topology that decides which links a group's ranks use."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .. import limits
from ..limits import MAX_BANDWIDTH_GB_S, MAX_LATENCY_US, MAX_MEMORY_GB, MAX_TFLOPS, MIN_RATE
from .validated import printable_name

PRECISION_PEAK_FIELD = {
    "bf16": "bf16_tflops",
    "fp8-delayed": "fp8_tflops",
    "fp8-tensorwise": "fp8_tflops",
    "fp8-blockwise": "fp8_tflops",
    "mxfp8": "fp8_tflops",
    "nvfp4": "fp4_tflops",
}

BLACKWELL_ONLY = frozenset({"mxfp8", "nvfp4"})
# efficiency tables keyed by architecture that a CPU host's spec must fill itself
CPU_CALIBRATION_KEYS = ("gemm_eff_max", "attn_fwd_eff", "attn_bwd_eff")


def _constant(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and v >= 0)


def _runs_band(band: dict[str, Any]) -> bool:
    """Whether a calibration's `interval_runs` is a refit's band (`refit.measured_interval`):
    exactly low, high and runs, the low share below 1 (throughput stays positive), runs whole."""
    if set(band) != {"low", "high", "runs"}:
        return False
    runs = band["runs"]
    return band["low"] < 1 and float(runs).is_integer() and runs >= 1


class ClusterSpec(BaseModel):
    """A homogeneous GPU cluster: datasheet peaks per GPU, links, and where GPUs sit.

    Peaks are datasheet (dense, no sparsity) figures; the fraction of them that real kernels reach
    lives in the calibration profile, never here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field("custom", max_length=200, description="Preset name or file stem.")
    gpu: str = Field(max_length=200, description="GPU model, e.g. 'H100-SXM'.")
    architecture: Literal["ampere", "hopper", "blackwell", "cpu"] = Field(
        description="GPU generation; decides which low-precision recipes exist (MXFP8 and NVFP4 "
        "need Blackwell, FP8 needs Hopper or newer). 'cpu': a CPU host measured by `moeplan "
        "calibrate`, one device per `moeplan run` process; no datasheet, so its calibration "
        "must carry its own GEMM and attention efficiencies."
    )
    num_gpus: int | None = Field(
        None, gt=0, le=limits.MAX_GPUS,
        description="GPUs in the cluster (None: given on the command line by --gpus)."
    )
    bf16_tflops: float = Field(ge=MIN_RATE, le=MAX_TFLOPS,
                               description="Dense BF16 tensor-core peak per GPU.")
    fp8_tflops: float | None = Field(None, ge=MIN_RATE, le=MAX_TFLOPS,
                                     description="Dense FP8 peak (None: no FP8).")
    fp4_tflops: float | None = Field(None, ge=MIN_RATE, le=MAX_TFLOPS,
                                     description="Dense FP4 peak (None: no FP4).")
    fp32_tflops: float | None = Field(
        None, ge=MIN_RATE, le=MAX_TFLOPS, description="Dense FP32 GEMM peak (measured by `moeplan calibrate`; the cost "
        "models price GEMMs against bf16_tflops, so it is for reference).")
    hbm_gb: float = Field(ge=MIN_RATE, le=MAX_MEMORY_GB,
                          description="Usable HBM per GPU, GB (10^9 bytes).")
    hbm_tb_s: float = Field(ge=MIN_RATE, le=MAX_BANDWIDTH_GB_S / 1000,
                            description="HBM bandwidth per GPU, TB/s.")
    nvlink_gb_s: float = Field(ge=MIN_RATE, le=MAX_BANDWIDTH_GB_S,
                               description="NVLink bandwidth per GPU per direction, GB/s.")
    nvlink_domain_gpus: int = Field(gt=0, le=limits.MAX_GPUS,
                                    description="GPUs sharing one NVLink/NVSwitch domain.")
    gpus_per_node: int = Field(gt=0, le=limits.MAX_GPUS,
                               description="GPUs per server (tray for NVL72).")
    scaleout_gb_s: float = Field(ge=MIN_RATE, le=MAX_BANDWIDTH_GB_S,
                                 description="Scale-out network bandwidth per GPU, GB/s.")
    scaleout_latency_us: float = Field(5.0, ge=0, le=MAX_LATENCY_US,
                                       description="Scale-out α per message, µs.")
    nvlink_latency_us: float = Field(2.0, ge=0, le=MAX_LATENCY_US,
                                     description="NVLink α per message, µs.")
    host_memory_gb: float = Field(ge=MIN_RATE, le=MAX_MEMORY_GB,
                                  description="Host (CPU) memory per GPU, GB.")
    host_link_gb_s: float = Field(
        ge=MIN_RATE, le=MAX_BANDWIDTH_GB_S, description="GPU↔host bandwidth per direction, GB/s (PCIe or NVLink-C2C)."
    )
    host_memory_bw_gb_s: float = Field(
        50.0, ge=MIN_RATE, le=MAX_BANDWIDTH_GB_S, description="Host memory bandwidth per GPU, GB/s (the node's DRAM "
        "bandwidth over its GPUs): the host Adam step of optimizer offload is bound by it. The "
        "default is a conservative two-socket DDR5 server shared by 8 GPUs. `moeplan calibrate` "
        "on a CPU host writes its measured copy bandwidth; on a GPU host it keeps the preset's "
        "figure, or this default.")
    mamf_tflops: dict[Literal["bf16", "fp8"], float] = Field(
        default_factory=dict,
        description="Measured maximum achievable matmul TFLOPS per GEMM input format (the best "
        "a brute-force search over GEMM shapes reaches on this GPU, e.g. the ml-engineering "
        "MAMF table): no GEMM of the cost models runs faster. A missing format has no ceiling "
        "but the datasheet peak.")
    sfu_exp_scale: float = Field(
        1.0, ge=1.0, le=8.0,
        description="Exponential throughput of the special function units (MUFU.EX2, the "
        "softmax's exp) relative to its architecture's base part: Blackwell Ultra (B300, GB300) "
        "runs it twice as fast as B200/GB200. The softmax share of an attention kernel runs at "
        "this rate (cost_models.compute.sfu_saving).")
    calibration: dict[str, Any] = Field(
        default_factory=dict,
        description="Efficiency constants overriding the shipped calibration profile "
        "(written by `moeplan calibrate`).",
    )
    sources: dict[str, str] = Field(default_factory=dict, description="Where each figure is from.")

    @field_validator("name", "gpu")
    @classmethod
    def _printable(cls, value: str) -> str:
        return printable_name(value)

    @field_validator("calibration")
    @classmethod
    def _calibration_shape(cls, cal: dict[str, Any]) -> dict[str, Any]:
        """Each constant must have the shape of the shipped one (number, table of numbers, or
        list of names) and be finite and non-negative: the cost models divide by them."""
        from ..cost_models.calibration import default_calibration

        shipped = default_calibration().to_dict()
        unknown = sorted(set(cal) - set(shipped))
        if unknown:  # the cost models would ignore it without a word
            import difflib

            near = difflib.get_close_matches(unknown[0], list(shipped), n=1)
            raise ValueError(f"`{limits.clip(str(unknown[0]))}` is not a calibration constant"
                             + (f" (did you mean `{near[0]}`?)" if near else "")
                             + f"; the constants are {', '.join(sorted(shipped))}. Rewrite the "
                             "file with `moeplan calibrate`")
        for key, value in cal.items():
            ref = shipped.get(key)
            if isinstance(ref, list):
                ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
                want = "a list of names"
            elif isinstance(ref, dict) or (ref is None and isinstance(value, dict)):
                ok = isinstance(value, dict) and all(_constant(v) for v in value.values())
                want = "a mapping of names to finite non-negative numbers"
            else:
                ok = _constant(value)
                want = "a finite non-negative number"
            if not ok:
                raise ValueError(f"`{key}` must be {want}, got "
                                 f"{limits.excerpt(value)}; rewrite it with `moeplan calibrate`")
        band = cal.get("interval_runs")
        if band and not _runs_band(band):
            raise ValueError("`interval_runs` must be the band `moeplan calibrate --from-runs` "
                             "writes: `low` below 1 and `high` (shares of the point), `runs` a "
                             f"whole number of at least 1, got {limits.excerpt(band)}; refit "
                             "it with `moeplan calibrate --from-runs`")
        return cal

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        if self.nvlink_domain_gpus < self.gpus_per_node:
            raise ValueError(
                f"nvlink_domain_gpus: {self.nvlink_domain_gpus} is smaller than gpus_per_node "
                f"({self.gpus_per_node}); a node's GPUs always share its NVLink domain"
            )
        if self.nvlink_domain_gpus % self.gpus_per_node:
            raise ValueError(
                "nvlink_domain_gpus: must be a multiple of gpus_per_node "
                f"({self.gpus_per_node}); an NVLink domain is made of whole nodes"
            )
        from ..cost_models.calibration import calibration_for

        cal = calibration_for(self.calibration)
        kept = cal.reserve_gb + cal.workspace_gb
        if self.hbm_gb <= kept:
            own = [k for k in ("reserve_gb", "workspace_gb") if k in self.calibration]
            device = "a device's memory" if self.architecture == "cpu" else "the GPU's memory"
            raise ValueError(
                f"hbm_gb: {self.hbm_gb:g} GB leaves nothing for a plan once the "
                f"{cal.reserve_gb:g} GB reserve and the {cal.workspace_gb:g} GB workspace "
                f"every plan keeps free are set aside"
                + (f" (this file's calibration sets {' and '.join(own)})" if own else "")
                + f"; give {device} in GB (10^9 bytes), more than {kept:g}"
            )
        if self.architecture == "cpu":
            missing = [k for k in CPU_CALIBRATION_KEYS
                       if not isinstance(self.calibration.get(k), dict)
                       or "cpu" not in self.calibration[k]]
            if missing:
                raise ValueError(
                    f"calibration: a CPU host needs its own {', '.join(missing)} "
                    "(entries keyed 'cpu'), as the shipped profile has none; write the spec "
                    "with `moeplan calibrate -o FILE`"
                )
        return self

    @property
    def device_kind(self) -> str:
        """The torch device type this spec describes: 'cpu' for a host `moeplan calibrate`
        measured, 'cuda' for any GPU. A step measured on the other kind says nothing of the
        figures priced on this spec (a CPU step against an H100's interval, or refitting the
        H100's constants to it)."""
        return "cpu" if self.architecture == "cpu" else "cuda"

    def usable_domain(self, world: int) -> int:
        """GPUs of one NVLink domain a job of `world` GPUs actually uses.

        A job that fits in one domain uses it whole. A larger job fills its domains in equal
        segments of whole nodes, as schedulers allocate NVL72 racks (256 GPUs run as 4 racks ×
        64, leaving trays spare), so the segment is the largest multiple of gpus_per_node that
        divides the job and fits the domain. The cost models price links and the runtime groups
        ranks by the same segments.
        """
        dom, node = self.nvlink_domain_gpus, self.gpus_per_node
        if world <= dom:
            return world
        for d in range(dom - dom % node, node - 1, -node):
            if world % d == 0:
                return d
        return node

    def peak_tflops(self, precision: str) -> float | None:
        """Dense peak for a precision recipe's GEMMs, or None when the GPU lacks that format."""
        if precision in BLACKWELL_ONLY and self.architecture != "blackwell":
            return None
        return getattr(self, PRECISION_PEAK_FIELD[precision])

    def mamf(self, precision: str) -> float | None:
        """The measured GEMM ceiling for a precision recipe's GEMMs (FP8 and MXFP8 both run
        8-bit tensor-core GEMMs), or None when no measurement bounds them."""
        fmt = "bf16" if precision == "bf16" else "fp8" if PRECISION_PEAK_FIELD.get(
            precision) == "fp8_tflops" else None
        return self.mamf_tflops.get(fmt) if fmt else None  # type: ignore[arg-type]

    @field_validator("mamf_tflops")
    @classmethod
    def _mamf_finite(cls, v: dict[str, float]) -> dict[str, float]:
        for fmt, tflops in v.items():
            if not (math.isfinite(tflops) and MIN_RATE <= tflops <= MAX_TFLOPS):
                raise ValueError(f"mamf_tflops.{fmt} must be a finite TFLOPS figure from "
                                 f"{MIN_RATE:g} to {MAX_TFLOPS:g}")
        return v

    def supports(self, precision: str) -> bool:
        return self.peak_tflops(precision) is not None

    def with_gpus(self, n: int) -> ClusterSpec:
        return self.model_copy(update={"num_gpus": n})
