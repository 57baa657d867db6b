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

from ..kernels import choose_backend
from ..specs import Plan
from .comm import all_reduce_
from .data import make_data
from .groups import ParallelGroups
from .jsonwire import all_gather_json
from .layers import materialize_
from .model import Transformer
from .optimizer import DistributedOptimizer, lr_at
from .parallelize import gather_full, parallelize
from .pipeline import PipelineSchedule, plan_stages, rank_chunks, split_stage
from .settings import validation_source

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
    # Megatron's `load_balancing_loss`: the switch loss per MoE layer without its coefficient
    # (router.py logs aux_loss / aux_loss_coeff, moe_logging.py averages it over the MoE
    # layers and micro-batches; 1.0 is a balanced router); None without an aux loss
    load_balancing_loss: float | None = None
    skipped: bool = False  # non-finite loss or gradient: no update was applied
    # expert-load balance of the step: the busiest expert's tokens over the mean, in the most
    # imbalanced MoE layer (1.0: even); None without MoE layers
    load_imbalance: float | None = None

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
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                 data: str = "synthetic", init_from: str | None = None,
                 split: str | None = None, valid_data: str | None = None):
        """`data`: 'synthetic' or a blend of Megatron indexed datasets (`split` cuts them into
        train/valid/test); `init_from`: a Hugging Face checkpoint directory whose weights
        replace the seeded draw (each rank reads only its shards, `hf_io.load_hf_`)."""
        self.plan, self.groups, self.seed = plan, groups, seed
        self.device = device or torch.device("cpu")
        t, layout = plan.training, plan.layout
        # the GEMM backend for the plan's precision recipe on this device (kernels/select.py)
        self.kernels = choose_backend(t.precision, self.device)
        # large weights stay on the meta device until this rank's stages and shards are known,
        # then only those are drawn (layers.materialize_): no rank builds the full model
        model = Transformer(plan.model, seed=seed, backend=self.kernels.backend,
                            aux_coeff=t.moe_aux_loss_coeff,
                            capacity_factor=t.moe_capacity_factor,
                            mtp_loss_weight=t.mtp_loss_weight, materialize=False)
        self.moe_layer_numbers = model.all_moe_layer_numbers()  # whole model, every stage
        chunks = rank_chunks(plan_stages(plan), layout.pp, groups.pp.rank)
        if layout.pp > 1:  # keep this rank's pipeline stages, then parallelize them
            model = split_stage(model, chunks, layout.pp)
        model = parallelize(model, groups, layout, plan.choices)
        if init_from:
            from .hf_io import load_hf_

            model = load_hf_(model, init_from, plan.model)
        else:
            model = materialize_(model, seed)
        self.model = model.to(device=self.device, dtype=dtype)
        for moe in self.model.moe_layers():  # router state stays fp32 (selection, counts)
            if moe.router.expert_bias is not None:
                moe.router.expert_bias = moe.router.expert_bias.float()
        self.optimizer = DistributedOptimizer(
            self.model, t, groups, distributed=layout.distributed_optimizer,
            offload_fraction=plan.choices.optimizer_offload_fraction)
        self.data_args = (data, plan.model.vocab_size, t.seq_len, t.global_batch_size, seed,
                          split)
        self.data = make_data(*self.data_args, which="train")
        blend, valid_split = validation_source(data, split, valid_data)
        self.valid_args = (blend, *self.data_args[1:5], valid_split)
        self.valid = None  # the validation split, opened at the first evaluation
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.microbatches_global = t.global_batch_size // layout.mbs
        self.flops_per_step = plan.model.flops_per_token(t.seq_len) * self.tokens_per_step
        self.routing_totals = torch.zeros(len(self.moe_layer_numbers), plan.model.num_experts,
                                          dtype=torch.long)
        # EP overlap runs the merged schedule, also with pp = 1 (a one-stage pipeline)
        self.pipeline = None if layout.pp == 1 and not layout.ep_overlap else PipelineSchedule(
            self.model, chunks, groups.pp, groups.pp_links,
            (t.seq_len // (layout.cp * layout.tp), layout.mbs, plan.model.hidden_size),
            dtype, self.device, ep_overlap=layout.ep_overlap)

    def step(self, step: int, capture_grads: bool = False) -> tuple[StepMetrics, dict | None]:
        """Train one global batch (step counts from 0). With `capture_grads`, also return every
        parameter's full reduced gradient (collective; for equivalence tests)."""
        g, layout = self.groups, self.plan.layout
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad()
        ce_total = torch.zeros((), dtype=torch.float64, device=self.device)  # no per-micro-batch
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)  # host sync
        batches = [(tokens.to(self.device), targets.to(self.device)) for tokens, targets
                   in self.data.micro_batches(step, g.dp.rank, g.dp.size, layout.mbs)]
        if self.pipeline is not None:  # every rank of the stage's tp/cp/ep groups runs it too
            ce_total, aux_total = self.pipeline.run(batches, self.tokens_per_step,
                                                    self.microbatches_global)
        else:
            for tokens, targets in batches:
                terms = self.model(tokens, targets)
                terms.objective(self.tokens_per_step, self.microbatches_global).backward()
                ce_total += terms.ce_sum.detach()
                aux_total += terms.aux.detach().double() / self.microbatches_global
        self.optimizer.reduce_grads()
        grads = None
        if capture_grads:
            grads = self._over_stages(gather_full(self.model, g, self.optimizer.reduced_grads()))
        lr = lr_at(step, self.plan.training)
        # global-batch mean loss, identical on every rank: CE sums are equal across tp
        sums = torch.stack([ce_total / g.tp.size, aux_total])
        all_reduce_(sums, g.world)
        # a NaN/inf loss or gradient skips the update (the same decision on every rank)
        norm = self.optimizer.step(lr, skip=not bool(torch.isfinite(sums).all()))
        skipped = self.optimizer.skipped
        imbalance = None
        if skipped:
            for moe in self.model.moe_layers():
                moe.tokens_per_expert.zero_()
        else:
            imbalance = self._update_routing()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - start
        m = StepMetrics(
            step=step + 1, loss=float(sums[0]) / self.tokens_per_step, grad_norm=norm, lr=lr,
            step_time_s=dt, tokens_per_s=self.tokens_per_step / dt,
            tflops_per_gpu=self.flops_per_step / dt / g.world.size / 1e12,
            peak_mem_gb=peak_memory_gb(self.device), aux_loss=float(sums[1]),
            load_balancing_loss=self._load_balancing(float(sums[1])), skipped=skipped,
            load_imbalance=imbalance,
        )
        return m, grads

    def _load_balancing(self, aux: float) -> float | None:
        """The step's aux objective (coeff · Σ over MoE layers, micro-batch mean) as Megatron
        logs it: per MoE layer, without the coefficient (MTP depths count, as there)."""
        coeff, layers = self.plan.training.moe_aux_loss_coeff, len(self.moe_layer_numbers)
        return aux / (coeff * layers) if coeff > 0 and layers else None

    @torch.no_grad()
    def evaluate(self, iters: int) -> float:
        """Mean token cross-entropy of `iters` global batches of the validation split
        (collective; the same value on every rank). The batches are the split's first `iters`
        (batch i: samples i·gbs …), the same at every evaluation, so successive values compare;
        MTP and aux losses are left out, as Megatron's `lm loss` is."""
        g, layout = self.groups, self.plan.layout
        if self.valid is None:
            self.valid = make_data(*self.valid_args, which="valid")
        ce = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(iters):
            batches = [(tokens.to(self.device), targets.to(self.device)) for tokens, targets
                       in self.valid.micro_batches(i, g.dp.rank, g.dp.size, layout.mbs)]
            if self.pipeline is not None:
                ce += self.pipeline.forward_only(batches)
            else:
                for tokens, targets in batches:
                    ce += self.model(tokens, targets).ce_sum.double()
        for moe in self.model.moe_layers():  # evaluation routes no training tokens
            moe.tokens_per_expert.zero_()
        total = (ce / g.tp.size).reshape(1)  # CE sums are equal across tp
        all_reduce_(total, g.world)
        return float(total) / (iters * self.tokens_per_step)

    @torch.no_grad()
    def _update_routing(self) -> float | None:
        """Sum this step's tokens per expert over the ranks routing distinct tokens, update the
        aux-loss-free expert bias (b_e += γ·sign(mean − load_e)) and the run's totals; return
        the step's load imbalance (max over MoE layers of the busiest expert's load / mean)."""
        if not self.moe_layer_numbers:
            return None
        moes = self.model.moe_layers()
        rows = [self.moe_layer_numbers.index(n) for n in self.model.moe_layer_numbers()]
        counts = torch.zeros(len(self.moe_layer_numbers), self.plan.model.num_experts,
                             dtype=torch.float64, device=self.device)  # (L_all, E)
        for j, m in zip(rows, moes, strict=True):
            counts[j] = m.tokens_per_expert.to(torch.float64)
        # tp·cp·dp ranks route distinct tokens; pp stages hold distinct layers
        all_reduce_(counts, self.groups.world)
        for m, c in zip(moes, counts[rows], strict=True):
            if m.router.expert_bias is not None:
                m.router.expert_bias += EXPERT_BIAS_RATE * torch.sign(c.mean() - c).float().to(
                    m.router.expert_bias.device)
            m.tokens_per_expert.zero_()
        self.routing_totals += counts.round().long().cpu()
        mean = counts.mean(dim=1).clamp_min(1e-12)  # (L_all,)
        return float((counts.max(dim=1).values / mean).max())

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size (collective), e.g. to compare with the reference."""
        return self._over_stages(gather_full(
            self.model, self.groups, {n: p.detach() for n, p in self.model.named_parameters()}))

    def _over_stages(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Merge every pipeline stage's full tensors (collective over pp; a stage's copy of the
        embedding equals the first stage's)."""
        pp = self.groups.pp
        if pp.trivial:
            return tensors
        # names, shapes and dtypes as JSON, then each stage's tensors broadcast from it:
        # all_gather_object would unpickle what the other ranks send
        device = self.device
        metas = all_gather_json({k: [list(v.shape), str(v.dtype).removeprefix("torch.")]
                                 for k, v in tensors.items()}, device, group=pp.group)
        me = dist.get_rank(pp.group)
        parts: list[dict[str, torch.Tensor]] = []
        for r, meta in enumerate(metas):
            part = {}
            for k, (shape, dtype) in meta.items():
                buf = (tensors[k].detach().to(device).contiguous() if r == me else
                       torch.empty(shape, dtype=getattr(torch, dtype), device=device))
                dist.broadcast(buf, src=dist.get_global_rank(pp.group, r), group=pp.group)
                part[k] = buf.cpu()
            parts.append(part)
        return {k: v for part in reversed(parts) for k, v in part.items()}


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
