"""Estimate (predicted time and memory) and Plan (a self-contained, runnable decision)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .cluster import ClusterSpec
from .layout import Choices, Layout
from .model import ModelSpec
from .training import TrainingSpec


class MemoryBreakdown(BaseModel):
    """Peak memory of the most loaded GPU, GB of 10^9 bytes."""

    model_config = ConfigDict(extra="forbid")

    peak_gb: float
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    buffers_gb: float
    margin_gb: float = Field(0.0, description="Safety margin the peak must leave free: the "
                             "memory model's measured error on this peak plus the HBM the "
                             "runtime reserves (CUDA context, allocator).")
    headroom_gb: float = Field(0.0, description="HBM − peak. The plan fits when headroom ≥ "
                               "margin.")


class TimeBreakdown(BaseModel):
    """Per-step time components in seconds (exposed_comm_s is what overlap did not hide)."""

    model_config = ConfigDict(extra="forbid")

    compute_s: float
    tp_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    dp_comm_s: float = 0.0
    pp_bubble_s: float = 0.0
    recompute_s: float = 0.0
    offload_s: float = 0.0
    exposed_comm_s: float = 0.0


class Interval(BaseModel):
    """A prediction interval, calibrated out of sample (cost_models.uncertainty)."""

    model_config = ConfigDict(extra="forbid")

    level: float = Field(description="Share of real runs the interval should cover (0.8).")
    step_time_s: tuple[float, float]
    tokens_per_s_per_gpu: tuple[float, float]
    pessimistic_tokens_per_s_per_gpu: float | None = Field(
        None, description="The prediction with every unvalidated effect disappointing (the "
        "plan without EP overlap or flex, host links at half speed); the low end starts here.")
    regime: str = Field("", description="The group of held-out published runs whose errors set "
                        "the interval's width.")
    rows: int = Field(0, description="How many held-out rows that group has.")


class Assumption(BaseModel):
    """One modelled effect the estimate depends on, and whether published runs support it."""

    model_config = ConfigDict(extra="forbid")

    term: str
    validated: bool
    evidence: str


class Confidence(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: Literal["calibrated", "extrapolated"]
    reason: str


class Estimate(BaseModel):
    """What the cost models predict for one plan (SPEC §4 `moeplan estimate`)."""

    model_config = ConfigDict(extra="forbid")

    step_time_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float = Field(description="Model TFLOPS by Megatron-LM's FLOP count.")
    mfu: float = Field(description="Model FLOPs utilisation against the dense BF16 peak.")
    memory: MemoryBreakdown
    time: TimeBreakdown
    bottleneck: str
    fits: bool
    warnings: list[str] = Field(default_factory=list)
    confidence: Confidence | None = None
    interval: Interval | None = None
    assumptions: list[Assumption] = Field(default_factory=list)


class Plan(BaseModel):
    """A self-contained plan: the specs it was made for, the layout, the choices, the forecast."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    layout: Layout
    choices: Choices = Field(default_factory=Choices)
    estimate: Estimate | None = None
    explanation: list[str] = Field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.layout.world_size
