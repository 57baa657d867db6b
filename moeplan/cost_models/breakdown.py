"""The frozen objects the whole-step estimate (`estimate.estimate_breakdown`) returns besides the
SPEC Estimate: per chunk, per pipeline rank, the step outside the pipeline, and all of it.

Plain data, no pricing: a caller that only reads a breakdown (the planner's step anatomy, the
runtime's memory guard) imports these types without the estimator's internals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..specs.plan import Estimate
from .layers import LayerCost
from .memory import StaticMemory


@dataclass(frozen=True)
class ChunkCost:
    """One model chunk (virtual stage) for one micro-batch after the stage's choices."""

    layers: tuple[str, ...]
    fwd_s: float
    bwd_s: float
    recompute_s: float
    exposed_comm_s: float
    ep_exposed_s: float
    offload_s: float
    tp_s: float
    cp_s: float
    ep_s: float
    activation_bytes: float
    offload_bytes: float
    dense_params: float
    expert_params: float

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.recompute_s + self.exposed_comm_s + self.offload_s


@dataclass(frozen=True)
class RankCost:
    """One pipeline rank: its chunks, per-micro-batch time, static memory and peak."""

    rank: int
    chunks: tuple[ChunkCost, ...]
    time_s: float
    static: StaticMemory
    activation_bytes: float
    buffer_bytes: float
    host_bytes: float = 0.0  # host memory: the offloaded optimizer share, offloaded activations

    @property
    def peak_bytes(self) -> float:
        return self.static.total + self.activation_bytes + self.buffer_bytes


@dataclass(frozen=True)
class StepExtras:
    """Step time outside the pipeline schedule, for one pp rank's parameters."""

    pp_exposed_s: float
    reduce_scatter_s: float
    all_gather_s: float
    dp_exposed_s: float
    optimizer_s: float


@dataclass(frozen=True)
class Breakdown:
    """Everything `estimate` computed, for callers that want more than the Estimate.

    `extras`: the step outside the pipeline, priced on the critical (slowest) pp rank."""

    estimate: Estimate
    ranks: tuple[RankCost, ...]
    stage_layout: str
    layer_costs: Mapping[str, LayerCost]
    extras: StepExtras | None = None
