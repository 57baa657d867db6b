"""The training step under a plan: micro-batches → backward → reduce → clip → AdamW → metrics.

`Trainer` is what the torchrun worker, the equivalence tests and the overhead benchmark all
drive, so the code measured and tested is the code that runs. Loss normalisation: each rank
differentiates Σ(token losses of its sequences)/N_global + Σ(aux pieces)/M_global, so every
gradient reduction is a plain sum and any layout computes the single-process gradient.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..specs import Plan
from .comm import all_reduce_
from .data import MarkovData
from .model import Transformer
from .optimizer import DistributedOptimizer, lr_at
from .parallelize import ParallelGroups, gather_full, parallelize

# DeepSeek-V3's aux-loss-free bias update speed γ (§2.1.2; Megatron moe_router_bias_update_rate)
EXPERT_BIAS_RATE = 1e-3


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    peak_mem_gb: float
    aux_loss: float = 0.0

    def record(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or this process's peak RSS on CPU; GB of 10^9 bytes."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


class Trainer:
    """One rank's model, optimizer and data for `plan` (already scaled down if asked)."""

    def __init__(self, plan: Plan, groups: ParallelGroups, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None):
        self.plan, self.groups, self.seed = plan, groups, seed
        self.device = device or torch.device("cpu")
        t, layout = plan.training, plan.layout
        model = Transformer(plan.model, seed=seed, aux_coeff=t.moe_aux_loss_coeff,
                            capacity_factor=t.moe_capacity_factor,
                            mtp_loss_weight=t.mtp_loss_weight)
        self.model = parallelize(model, groups, layout).to(device=self.device, dtype=dtype)
        for moe in self.model.moe_layers():  # router state stays fp32 (selection, counts)
            if moe.router.expert_bias is not None:
                moe.router.expert_bias = moe.router.expert_bias.float()
        self.optimizer = DistributedOptimizer(self.model, t, groups,
                                              distributed=layout.distributed_optimizer)
        self.data = MarkovData(plan.model.vocab_size, t.seq_len, t.global_batch_size, seed)
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.microbatches_global = t.global_batch_size // layout.mbs
        self.flops_per_step = plan.model.flops_per_token(t.seq_len) * self.tokens_per_step
        n_moe = len(self.model.moe_layers())
        self.moe_layer_numbers = self.model.moe_layer_numbers()
        self.routing_totals = torch.zeros(n_moe, plan.model.num_experts, dtype=torch.long)

    def step(self, step: int, capture_grads: bool = False) -> tuple[StepMetrics, dict | None]:
        """Train one global batch (step counts from 0). With `capture_grads`, also return every
        parameter's full reduced gradient (collective; for equivalence tests)."""
        g, layout = self.groups, self.plan.layout
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad()
        ce_total = torch.zeros((), dtype=torch.float64, device=self.device)  # no per-micro-batch
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)  # host sync
        for tokens, targets in self.data.micro_batches(step, g.dp.rank, g.dp.size, layout.mbs):
            tokens, targets = tokens.to(self.device), targets.to(self.device)
            terms = self.model(tokens, targets)
            terms.objective(self.tokens_per_step, self.microbatches_global).backward()
            ce_total += terms.ce_sum.detach()
            aux_total += terms.aux.detach().double() / self.microbatches_global
        self.optimizer.reduce_grads()
        grads = None
        if capture_grads:
            grads = gather_full(self.model, g, self.optimizer.reduced_grads())
        lr = lr_at(step, self.plan.training)
        norm = self.optimizer.step(lr)
        self._update_routing()
        # global-batch mean loss, identical on every rank: CE sums are equal across tp
        sums = torch.stack([ce_total / g.tp.size, aux_total])
        all_reduce_(sums, g.world)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - start
        m = StepMetrics(
            step=step + 1, loss=float(sums[0]) / self.tokens_per_step, grad_norm=norm, lr=lr,
            step_time_s=dt, tokens_per_s=self.tokens_per_step / dt,
            tflops_per_gpu=self.flops_per_step / dt / g.world.size / 1e12,
            peak_mem_gb=peak_memory_gb(self.device), aux_loss=float(sums[1]),
        )
        return m, grads

    @torch.no_grad()
    def _update_routing(self) -> None:
        """Sum this step's tokens per expert over the ranks routing distinct tokens, update the
        aux-loss-free expert bias (b_e += γ·sign(mean − load_e)) and the run's totals."""
        moes = self.model.moe_layers()
        if not moes:
            return
        counts = torch.stack([m.tokens_per_expert for m in moes]).to(torch.float64)  # (L, E)
        all_reduce_(counts, self.groups.tp_cp_dp)
        for m, c in zip(moes, counts, strict=True):
            if m.router.expert_bias is not None:
                m.router.expert_bias += EXPERT_BIAS_RATE * torch.sign(c.mean() - c).float().to(
                    m.router.expert_bias.device)
            m.tokens_per_expert.zero_()
        self.routing_totals += counts.round().long().cpu()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size (collective), e.g. to compare with the reference."""
        return gather_full(self.model, self.groups,
                           {n: p.detach() for n, p in self.model.named_parameters()})


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
