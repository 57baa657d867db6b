"""moeplan: plan, predict and run Mixture-of-Experts training.

The public Python API; the `moeplan` command is a thin layer over these functions, so notebooks
and scripts behave exactly like the CLI. Importing moeplan never imports torch.
"""

from .errors import InfeasibleError, LayoutError, MoeplanError, NotYetAvailable, SpecError
from .specs import (
    Choices,
    ClusterSpec,
    Estimate,
    Layout,
    ModelSpec,
    Plan,
    TrainingSpec,
    list_presets,
    load_cluster,
    load_model,
    load_plan,
    load_training,
)

__version__ = "0.1.0"

__all__ = [
    "Choices", "ClusterSpec", "Estimate", "InfeasibleError", "Layout", "LayoutError",
    "ModelSpec", "MoeplanError", "NotYetAvailable", "Plan", "SpecError", "TrainingSpec",
    "list_presets", "load_cluster", "load_model", "load_plan", "load_training",
]
