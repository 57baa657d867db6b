"""Validated descriptions of what to train (ModelSpec), where (ClusterSpec), how (TrainingSpec),
and the decisions a plan fixes (Layout, Choices), with the Plan and Estimate that carry them."""

from .cluster import ClusterSpec
from .layout import (
    Choices,
    Layout,
    check_layout,
    layout_violations,
)
from .loader import list_presets, load_cluster, load_model, load_plan, load_training
from .model import ModelSpec
from .modules import OFFLOAD_MODULES, RECOMPUTE_MODULES
from .plan import (
    Assumption,
    Confidence,
    Estimate,
    Interval,
    MemoryBreakdown,
    Plan,
    TimeBreakdown,
)
from .stage_layout import (
    balanced_stage_layout,
    format_stage_layout,
    parse_stage_layout,
    stage_layout_for,
)
from .training import PRECISIONS, TrainingSpec

__all__ = [
    "OFFLOAD_MODULES", "PRECISIONS", "RECOMPUTE_MODULES", "Assumption", "Choices", "ClusterSpec",
    "Confidence", "Interval",
    "Estimate", "Layout", "MemoryBreakdown", "ModelSpec", "Plan", "TimeBreakdown", "TrainingSpec",
    "balanced_stage_layout", "check_layout", "format_stage_layout", "layout_violations",
    "list_presets", "load_cluster", "load_model", "load_plan", "load_training",
    "parse_stage_layout", "stage_layout_for",
]
