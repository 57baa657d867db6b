"""Runtime overhead: a world-1 plan through `Trainer` vs a plain PyTorch loop, side by side.

Both sides train the same model (the runtime's `Transformer`, so the same kernels) on the same
batches (the same `MarkovData`), one optimizer step per global batch of several micro-batches.
The plain loop is what one would write by hand: forward, backward, `clip_grad_norm_`,
`torch.optim.AdamW`. Steps alternate between the two so machine noise hits both alike; the
ratio of median step times is the runtime's own overhead (bar: ≤ 1.10).

    python bench/runtime_overhead.py            # prints a table and one JSON line
    python bench/runtime_overhead.py --steps 6 --hidden 128   # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moeplan.runtime.data import MarkovData
from moeplan.runtime.groups import local_groups
from moeplan.runtime.model import Transformer
from moeplan.runtime.train import Trainer
from moeplan.specs import Layout, ModelSpec, Plan, TrainingSpec, load_cluster


def make_plan(hidden: int, seq: int, gbs: int, mbs: int) -> Plan:
    model = ModelSpec(name="bench-moe", num_layers=4, hidden_size=hidden, num_attention_heads=8,
                      num_kv_heads=4, qk_norm=True, ffn_hidden_size=2 * hidden, vocab_size=4096,
                      num_experts=8, moe_top_k=2, moe_ffn_hidden_size=hidden // 2,
                      first_k_dense=1)
    training = TrainingSpec(seq_len=seq, global_batch_size=gbs, lr=1e-3, warmup_steps=1)
    return Plan(model=model, cluster=load_cluster("h100", gpus=1), training=training,
                layout=Layout.build(1, gbs, mbs=mbs))


class PlainLoop:
    """The hand-written single-process training loop the runtime is measured against."""

    def __init__(self, plan: Plan, seed: int, device: torch.device, dtype: torch.dtype):
        t = plan.training
        self.device = device
        self.model = Transformer(plan.model, seed=seed, aux_coeff=t.moe_aux_loss_coeff).to(
            device=device, dtype=dtype)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(t.adam_beta1,
                                     t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay,
                                     foreach=True)
        self.data = MarkovData(plan.model.vocab_size, t.seq_len, t.global_batch_size, seed)
        self.tokens = t.global_batch_size * t.seq_len
        self.micro = t.global_batch_size // plan.layout.mbs
        self.mbs, self.clip = plan.layout.mbs, t.clip_grad

    def step(self, step: int) -> float:
        start = time.perf_counter()
        for tokens, targets in self.data.micro_batches(step, 0, 1, self.mbs):
            terms = self.model(tokens.to(self.device), targets.to(self.device))
            terms.objective(self.tokens, self.micro).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--gbs", type=int, default=8)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    plan = make_plan(a.hidden, a.seq, a.gbs, a.mbs)
    device = torch.device(a.device)
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    runtime = Trainer(plan, local_groups(), seed=0, dtype=dtype, device=device)
    plain = PlainLoop(plan, seed=0, device=device, dtype=dtype)
    t_rt, t_plain = [], []
    for step in range(a.steps + 2):  # two warm-up steps each, then alternate
        order = (0, 1) if step % 2 == 0 else (1, 0)
        for side in order:
            if side == 0:
                m, _ = runtime.step(step)
                dt = m.step_time_s
                (t_rt if step >= 2 else []).append(dt)
            else:
                dt = plain.step(step)
                (t_plain if step >= 2 else []).append(dt)
    rt, pl = statistics.median(t_rt), statistics.median(t_plain)
    result = {"runtime_step_s": rt, "plain_step_s": pl, "ratio": rt / pl, "steps": a.steps,
              "hidden": a.hidden, "seq": a.seq, "gbs": a.gbs, "mbs": a.mbs,
              "threads": torch.get_num_threads(), "device": a.device, "dtype": a.dtype, "bar": 1.10, "ok": rt / pl <= 1.10}
    print(f"runtime (world-1 plan) {rt * 1e3:8.1f} ms/step")
    print(f"plain PyTorch loop     {pl * 1e3:8.1f} ms/step")
    print(f"ratio                  {rt / pl:8.3f}  (bar ≤ 1.10)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
