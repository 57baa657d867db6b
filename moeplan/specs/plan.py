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

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    peak_gb: float
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    buffers_gb: float


class TimeBreakdown(BaseModel):
    """Per-step time components in seconds (exposed_comm_s is what overlap did not hide)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    compute_s: float
    tp_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    dp_comm_s: float = 0.0
    pp_bubble_s: float = 0.0
    recompute_s: float = 0.0
    offload_s: float = 0.0
    exposed_comm_s: float = 0.0


class Confidence(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    label: Literal["calibrated", "extrapolated"]
    reason: str


class Estimate(BaseModel):
    """What the cost models predict for one plan (SPEC §4 `moeplan estimate`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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


class Plan(BaseModel):
    """A self-contained plan: the specs it was made for, the layout, the choices, the forecast."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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
