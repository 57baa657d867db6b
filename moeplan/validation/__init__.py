"""Validation against published runs: reading them, the settings their sources document,
scoring, cross-validation and the calibration fit.

  rows       the CSV and its cells; the shipped copy (`data/published_runs.csv`, sources in
             `data/README.md`)
  rules      settings a row's source documents but does not print
  recipes    Megatron-Bridge workload recipes, matched on every printed size
  cases      a row → the specs, layout and choices it ran (or why it cannot be predicted)
  scoring    predictions against the published figures: per row, MAPE, intervals, ranking
  fit        the calibration fit (coordinate descent on fit rows)
  crossval   leave-one-model-out and leave-one-release-out cross-validation
"""

from .cases import (
    RunCase,
    case_of,
    config_key,
    family_of,
    model_preset_of,
    split_of,
)
from .rows import read_rows, release_of, shipped_runs
from .scoring import (
    anatomy_parts,
    ape,
    coverage,
    flops_per_token_in,
    inside,
    layout_pairs,
    mape,
    median_width,
    predict_case,
    release_group,
    skip_groups,
    validate_rows,
)

__all__ = [
    "RunCase", "anatomy_parts", "ape", "case_of", "config_key", "coverage", "family_of",
    "flops_per_token_in", "inside", "layout_pairs", "mape", "median_width", "model_preset_of",
    "predict_case", "read_rows", "release_group", "release_of", "shipped_runs", "skip_groups",
    "split_of", "validate_rows",
]
