"""What this runtime version executes: every plan feature outside it is refused by name.

A plan asking for something not executed yet is never run differently (e.g. pipeline stages
silently collapsed); `features_not_executed` lists each such feature so `moeplan run` exits 2
before any worker starts. Pure function of the plan: no torch.
"""

from __future__ import annotations

from ..specs import Plan, stage_layout_for


def model_features_not_executed(model) -> list[str]:
    """Model features the runtime does not build yet."""
    out = []
    if any(model.sliding_layers()):
        out.append("sliding-window attention")
    if model.attention_sinks:
        out.append("attention sinks")
    if model.position_embedding != "rope":
        out.append("learned position embeddings")
    if model.is_moe and model.mlp_bias:
        out.append("biases on expert linears (mlp_bias with experts)")
    return out


def ep_overlap_not_executed(plan: Plan) -> list[str]:
    """EP overlap runs (overlap.py) with the alltoall and flex dispatchers, pp = 1 or
    interleaved pp·vpp (the layout's own rules refuse the rest: Megatron's VPP requirement,
    full or `moe` recompute); activation offload hooks whole layer forwards, which the merged
    schedule splits into sub-modules, so the two are not combined yet."""
    L, c = plan.layout, plan.choices
    if not L.ep_overlap:
        return []
    offload = [*c.offload, *(m for s in (c.stage_offload or []) for m in s)]
    if offload:
        return [f"activation offload ({', '.join(sorted(set(offload)))}) together with EP "
                "communication overlap (ep_overlap): drop the offload from the plan's choices "
                "(`offload`, `stage_offload`) or set `ep_overlap: false` in its layout"]
    return []


def features_not_executed(plan: Plan) -> list[str]:
    """Each plan feature this runtime does not execute yet, named for the error message."""
    L, c = plan.layout, plan.choices
    out = []
    if L.pp > 1 and plan.model.mtp_layers:
        stages = stage_layout_for(plan.model.num_layers, L.pp, L.vpp, plan.model.mtp_layers,
                                  c.stage_layout, c.stage_layers)
        if any("m" in st for st in stages[:-1]):
            out.append("MTP layers outside the last pipeline stage (put every m with the "
                       "loss L)")
    out += ep_overlap_not_executed(plan)
    # activation recompute / offload and optimizer offload run as the choices say (memory.py,
    # optimizer.py)
    # every precision recipe runs: te / torch-fp8 on a GPU, else emulated (kernels/select.py)
    out += model_features_not_executed(plan.model)
    if plan.model.vocab_size % L.tp:
        out.append(f"vocabulary padding (vocab {plan.model.vocab_size} is not divisible by "
                   f"tp={L.tp})")
    return out
