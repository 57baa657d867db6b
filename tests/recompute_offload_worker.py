"""Train multi-rank layouts with and without recompute / offload choices in one gloo world.

Run as `python tests/recompute_offload_worker.py OUT.pt` (from tests/): like
`equivalence_worker.py`, 4 processes; each layout is trained once without memory choices and
once with them, and rank 0 saves per-step losses and the first step's full reduced gradients.
"""

from __future__ import annotations

import sys

import torch.multiprocessing as mp
from equivalence_worker import free_port, make_plan, train_layouts

WORLD = 4
STEPS = 2
MODELS = ("tiny_qwen3_moe", "tiny_deepseek_v3")
# name → (world, layout axes, choices); the claims are in test_recompute_offload.py
LAYOUTS: dict[str, tuple[int, dict, dict]] = {
    "tp2_ep2": (4, {"tp": 2, "ep": 2}, {}),
    "tp2_ep2_memory": (4, {"tp": 2, "ep": 2}, {
        "recompute": ["core_attn", "moe_act", "layernorm"],
        "offload": ["qkv_linear", "attn_proj", "expert_fc1"],
        "optimizer_offload_fraction": 0.5}),
    "cp2_dp2_ep2_recompute_moe": (4, {"cp": 2, "ep": 2}, {"recompute": ["moe", "core_attn"]}),
    "cp2_dp2_ep2": (4, {"cp": 2, "ep": 2}, {}),
    # not a memory choice but a numerics one (TrainingSpec.grad_reduce_dtype): gradients
    # accumulated and reduced over dp·cp and edp in bf16
    "cp2_dp2_ep2_bf16_grads": (4, {"cp": 2, "ep": 2}, {}),
    "pp2_dp2": (4, {"pp": 2}, {}),
    "pp2_dp2_stages": (4, {"pp": 2}, {
        "stage_recompute": [["full"], ["moe", "shared_experts", "layernorm"]],
        "stage_offload": [[], ["attn_norm", "core_attn", "moe_act"]],
        "optimizer_offload_fraction": 1.0}),
}


def worker(rank: int, port: int, out: str) -> None:
    from moeplan.specs import Choices

    def plan(m: str, name: str, world: int, axes: dict, choices: dict):
        p = make_plan(m, world, axes)
        training = p.training.model_copy(
            update={"grad_reduce_dtype": "bf16" if name.endswith("bf16_grads") else "fp32"})
        return p.model_copy(update={"choices": Choices(**choices), "training": training})

    layouts = ((name, {m: plan(m, name, world, axes, choices) for m in MODELS})
               for name, (world, axes, choices) in LAYOUTS.items())
    train_layouts(rank, port, WORLD, out, layouts, STEPS)


if __name__ == "__main__":
    mp.spawn(worker, args=(free_port(), sys.argv[1]), nprocs=WORLD)
