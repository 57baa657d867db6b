"""What this runtime version executes: every plan feature outside it is refused by name.

A plan asking for something not executed yet is never run differently (e.g. pipeline stages
silently collapsed); `features_not_executed` lists each such feature, each with the exact way
around it (a flag, a stage layout, another command), so `moeplan run` exits 2 before any worker
starts with something the user can type. Pure function of the plan: no torch.
"""

from __future__ import annotations

from ..specs import Plan, format_stage_layout, stage_layout_for

MODEL_FIX = ("no flag avoids it: `moeplan export PLAN --format megatron` runs this model on "
             "Megatron-LM")


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


def search_line(plan: Plan) -> str:
    """The `moeplan search` command that re-plans this model, cluster and batch for the
    runtime (`--target moeplan`: only what `moeplan run` executes)."""
    t = plan.training
    return (f"moeplan search --model {plan.model.name} --cluster {plan.cluster.name} --gpus "
            f"{plan.layout.world_size} --seq {t.seq_len} --gbs {t.global_batch_size} "
            f"--precision {t.precision} --target moeplan -o plan.json")


def mtp_on_last_stage(stages: list[list[str]]) -> str:
    """The same stage layout with every MTP layer moved to the last stage, before the loss."""
    moved = [[k for k in st if k != "m"] for st in stages]
    mtp = sum(st.count("m") for st in stages)
    last = moved[-1]
    at = last.index("L") if "L" in last else len(last)
    moved[-1] = last[:at] + ["m"] * mtp + last[at:]
    return format_stage_layout(moved)


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
                "(`offload`, `stage_offload`), set `ep_overlap: false` in its layout, or "
                f"re-plan: `{search_line(plan)}`"]
    return []


def features_not_executed(plan: Plan) -> list[str]:
    """Each plan feature this runtime does not execute yet, named with its fix."""
    L, c = plan.layout, plan.choices
    out = []
    if L.pp > 1 and plan.model.mtp_layers:
        stages = stage_layout_for(plan.model.num_layers, L.pp, L.vpp, plan.model.mtp_layers,
                                  c.stage_layout, c.stage_layers)
        if any("m" in st for st in stages[:-1]):
            out.append("MTP layers outside the last pipeline stage (put every m with the "
                       "loss L: `moeplan estimate ... --stage-layout "
                       f"'{mtp_on_last_stage(stages)}' -o plan.json`)")
    out += ep_overlap_not_executed(plan)
    if plan.training.fp8_param_gather:
        out.append("FP8 parameter all-gather (set `fp8_param_gather: false` in the plan's "
                   "training: this runtime keeps bf16 weights and quantises them per GEMM; or "
                   "run it with Megatron: `moeplan export PLAN --format megatron` writes "
                   "--fp8-param-gather)")
    # activation recompute / offload and optimizer offload run as the choices say (memory.py,
    # optimizer.py)
    # every precision recipe runs: te / torch-fp8 on a GPU, else emulated (kernels/select.py)
    out += [f"{f} ({MODEL_FIX})" for f in model_features_not_executed(plan.model)]
    if plan.model.vocab_size % L.tp:
        fits = [t for t in (1, 2, 4, 8) if plan.model.vocab_size % t == 0 and t < L.tp]
        out.append(f"vocabulary padding (vocab {plan.model.vocab_size} is not divisible by "
                   f"tp={L.tp}; re-plan with `moeplan estimate ... --tp {max(fits)}`, or pad "
                   f"vocab_size in the model spec to a multiple of {L.tp})")
    return out


SPEED_SETTINGS = {"tp_comm_overlap": "TP communication overlap (tp_comm_overlap)",
                  "cuda_graphs": "CUDA graphs (cuda_graphs)"}
"""Megatron stack settings this runtime runs without: they change the step time, never the
function computed (TE userbuffers, CUDA graphs)."""


def settings_not_executed(plan: Plan) -> list[str]:
    """The SPEED_SETTINGS the plan names: the run goes ahead without them and says that its
    measured time is without them."""
    return [name for field, name in SPEED_SETTINGS.items() if getattr(plan.layout, field)]


def without_speed_settings(plan: Plan) -> Plan:
    """The plan as this runtime executes it: every SPEED_SETTINGS field off."""
    off = {field: False for field in SPEED_SETTINGS}
    return plan.model_copy(update={"layout": plan.layout.model_copy(update=off)})
