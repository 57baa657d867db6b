"""What this runtime version executes: every plan feature outside it is refused by name.

The rules themselves live in the one table of what each executor accepts
(`moeplan.specs.rules`, target `moeplan`); this module words the runtime's refusal from it. A
plan asking for something not executed yet is never run differently (e.g. pipeline stages
silently collapsed): `features_not_executed` lists each broken rule with the exact way around it
(a flag, a stage layout, another command), so `moeplan run` exits 2 before any worker starts
with something the user can type. Pure function of the plan: no torch.
"""

from __future__ import annotations

from ..specs import Plan
from ..specs.rules import BY_NAME, MOEPLAN, Facts, model_features_not_executed, violations

__all__ = ["SPEED_SETTINGS", "features_not_executed", "model_features_not_executed",
           "settings_not_executed", "without_speed_settings"]


def features_not_executed(plan: Plan) -> list[str]:
    """Each rule of the runtime's own (the table's rules of the `moeplan` target alone) the
    plan breaks, worded with its fix; the rules both executors share are a layout's validity
    (`check_layout`)."""
    facts = Facts(plan.model, plan.training, plan.layout, plan.choices, plan.cluster)
    return [why for name, why in violations(facts, "moeplan")
            if BY_NAME[name].targets == MOEPLAN]


SPEED_SETTINGS = {"tp_comm_overlap": "TP communication overlap (tp_comm_overlap)",
                  "cuda_graphs": "CUDA graphs (cuda_graphs)",
                  "fused_grouped_mlp": "the fused grouped MLP kernel (fused_grouped_mlp)"}
"""Megatron stack settings this runtime runs without: they change the step time, never the
function computed (TE userbuffers, CUDA graphs, the CuTe-DSL grouped MLP)."""


def settings_not_executed(plan: Plan) -> list[str]:
    """The SPEED_SETTINGS the plan names: the run goes ahead without them and says that its
    measured time is without them."""
    return [name for field, name in SPEED_SETTINGS.items() if getattr(plan.layout, field)]


def without_speed_settings(plan: Plan) -> Plan:
    """The plan as this runtime executes it: every SPEED_SETTINGS field off."""
    off = {field: False for field in SPEED_SETTINGS}
    return plan.model_copy(update={"layout": plan.layout.model_copy(update=off)})
