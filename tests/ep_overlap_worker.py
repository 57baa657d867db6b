"""Train the EP-overlap layouts of both tiny MoE models in one spawned gloo world.

Run as `python tests/ep_overlap_worker.py OUT.pt`: like `equivalence_worker.py` (same plans,
seed and steps), plus, per layout, what the merged schedule's trace recorded on every rank in
the last step: each hop's direction, kind, layer and micro-batch, whether its transfer was
still running when the other micro-batch began computing, and what compute ran behind it.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from equivalence_worker import free_port, init_world, make_plan

WORLD = 4
STEPS = 2
MODELS = ("tiny_qwen3_moe", "tiny_deepseek_v3")
# name → (world, layout axes); the claims the tests make are in test_ep_overlap.py
LAYOUTS: dict[str, tuple[int, dict]] = {
    "reference": (1, {}),
    "ep2_overlap": (2, {"ep": 2, "ep_overlap": True}),
    "pp2_vpp2_ep2_overlap": (4, {"pp": 2, "vpp": 2, "ep": 2, "ep_overlap": True}),
    "ep2_etp2_overlap": (4, {"ep": 2, "etp": 2, "ep_overlap": True}),
    "ep4_flex_2_domains_overlap": (4, {"ep": 4, "dispatcher": "flex", "nvlink_domain": 2,
                                       "ep_overlap": True}),
    # selective recompute inside the sub-modules (Megatron allows all but full and `moe`)
    "ep2_overlap_selective_recompute": (2, {"ep": 2, "ep_overlap": True,
                                            "recompute": ["layernorm", "core_attn", "moe_act",
                                                          "shared_experts"]}),
    # every activation offload module inside the sub-modules of the merged schedule
    "ep2_overlap_offload": (2, {"ep": 2, "ep_overlap": True,
                                "offload": ["attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                            "mlp_norm", "expert_fc1", "moe_act"]}),
    # offload and recompute together, one set per pipeline rank, interleaved pp with overlap
    "pp2_vpp2_ep2_overlap_offload_recompute": (4, {
        "pp": 2, "vpp": 2, "ep": 2, "ep_overlap": True,
        "recompute": [["layernorm", "moe_act"], ["core_attn", "shared_experts"]],
        "offload": [["attn_norm", "qkv_linear", "expert_fc1"],
                    ["core_attn", "attn_proj", "mlp_norm", "moe_act"]]}),
}


def plan_for(model: str, world: int, axes: dict):
    from moeplan.specs import Choices

    axes = dict(axes)
    recompute, offload = axes.pop("recompute", []), axes.pop("offload", [])
    plan = make_plan(model, world, axes)
    return plan.model_copy(update={"choices": Choices(recompute=recompute, offload=offload)})


def trace_rows(trainer) -> list[dict]:
    trace = trainer.pipeline.trace if trainer.pipeline is not None else None
    if trace is None:
        return []
    return [{"side": r.side, "what": r.what, "layer": r.layer, "mb": r.mb,
             "pending": r.pending_when_overlapped, "handles": r.handles,
             "overlapped": list(r.overlapped)} for r in trace.records]


def worker(rank: int, port: int, out: str) -> None:
    from moeplan.runtime.groups import build_groups
    from moeplan.runtime.memory import measure_activations
    from moeplan.runtime.train import Trainer
    from moeplan.specs.grid import RankGrid

    init_world(rank, port, WORLD)
    results: dict = {}
    for name, (world, axes) in LAYOUTS.items():
        plans = {m: plan_for(m, world, axes) for m in MODELS}
        first = next(iter(plans.values()))
        groups = build_groups(RankGrid.from_layout(first.layout),
                              domain=first.cluster.usable_domain(first.layout.world_size))
        for m, plan in plans.items():
            row: dict = {}
            if groups is not None:
                trainer = Trainer(plan, groups, seed=1234)
                losses, grads = [], None
                with measure_activations() as meter:
                    for step in range(STEPS):
                        metrics, g = trainer.step(step, capture_grads=step == 0)
                        losses.append(metrics.loss)
                        grads = grads if g is None else g
                row = {"losses": losses, "grads": grads, "trace": trace_rows(trainer),
                       "overlap": trainer.pipeline is not None and trainer.pipeline.ep_overlap,
                       "offloaded_bytes": meter.offloaded_bytes}
            from moeplan.runtime.jsonwire import all_gather_json

            rows = all_gather_json(row.get("trace") or [], torch.device("cpu"))  # no pickle
            if rank == 0:
                results[(name, m)] = {**row, "traces": rows[:world]}
        dist.barrier()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(), sys.argv[1]), nprocs=WORLD)
