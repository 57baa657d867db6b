"""Gradient reduction and the (distributed) Adam optimizer over flat buffers.

Megatron's distributed optimizer (Megatron Core `distributed/param_and_grad_buffer.py`,
`optimizer/distrib_optimizer.py`): parameters of one family live as views into one flat buffer;
gradients accumulate into a flat buffer (fp32, or bf16 with `TrainingSpec.grad_reduce_dtype`:
Megatron's `--grad-reduce-in-bf16`); after backward the buffer is reduce-scattered over the
family's data-parallel group, each rank runs Adam on its shard with fp32 master weights and
moments, and the updated parameters are all-gathered back. Dense parameters reduce over dp
(×cp), expert parameters over edp, so expert gradients are averaged exactly like dense ones.

The loss each rank differentiates is already normalised by the global token count, so every
reduction is a plain sum. Parameters replicated over tp (norms, routers, MLA down-projections)
see only this rank's sequence shard or heads, so their gradients are first summed over tp; they
sit at the front of the dense buffer so that is one all-reduce. Under pipeline parallelism the
last stage may hold a copy of the embedding (tied head, MTP): both copies' gradients are summed
over the embedding group first, and the copy sits at the end of its buffer, outside the norm.

Optimizer offload (`Choices.optimizer_offload_fraction` = φ, Megatron's
`--optimizer-offload-fraction`): the first ⌊φ·n⌋ elements of each family's shard keep their fp32
master weights and Adam moments in host memory and are stepped there by the same AdamW code;
the gradient slice goes to the host and the updated weights come back. AdamW is elementwise, so
where the shard is cut cannot change any result; cutting every family's shard at the same
fraction keeps the host share equal on every data-parallel rank (they step in parallel), and
cutting by element rather than at parameter boundaries (Megatron's HybridDeviceOptimizer steps
whole parameters with per-parameter torch optimizers) makes the fraction exact for any model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..specs import TrainingSpec
from .comm import Axis, all_reduce_
from .groups import ParallelGroups
from .layers import shard_info


def lr_at(step: int, t: TrainingSpec) -> float:
    """The learning rate of `step` (from 0) under the spec's schedule (`TrainingSpec.lr_at`:
    Megatron's warm-up and constant/linear/cosine/WSD decay)."""
    return t.lr_at(step)


@dataclass
class _AdamPart:
    """fp32 master weights and Adam moments of shard elements [lo, hi), on one device."""

    lo: int
    hi: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: torch.Tensor
    offloaded: bool  # stepped by the host path


class _Joined(torch.Tensor):
    """One state read across its host and device parts (for checkpoints); `copy_` writes the
    parts back, so loading a checkpoint into it restores both."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops return plain tensors
    parts: list[torch.Tensor]

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:  # type: ignore[override]
        lo = 0
        for part in self.parts:
            part.copy_(src[lo: lo + part.numel()], non_blocking=non_blocking)
            lo += part.numel()
        return self


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    out = torch.cat([p.to(parts[-1].device) for p in parts]).as_subclass(_Joined)
    out.parts = parts
    return out


@dataclass
class _Family:
    """Parameters sharing one data-parallel group, flattened into one buffer."""

    axis: Axis
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    replicated_end: int  # [0, replicated_end): tp-replicated dense params
    numel: int
    duplicate_start: int = 0  # [duplicate_start, numel): copies counted on another stage
    shared: list[tuple[int, int]] = field(default_factory=list)  # embedding-group (offset, n)
    param_buf: torch.Tensor = field(init=False)
    grad_buf: torch.Tensor = field(init=False)
    shard: slice = field(init=False)
    decay: torch.Tensor = field(init=False)
    parts: list[_AdamPart] = field(default_factory=list)  # host part first, then device part
    grad_shard: torch.Tensor | None = None

    # each state over the whole shard, as the checkpoint reads and writes it
    @property
    def master(self) -> torch.Tensor:
        return _joined([p.master for p in self.parts])

    @property
    def exp_avg(self) -> torch.Tensor:
        return _joined([p.exp_avg for p in self.parts])

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return _joined([p.exp_avg_sq for p in self.parts])


class DistributedOptimizer:
    """AdamW with fp32 master weights, states sharded over each family's data-parallel group
    (`distributed=True`) or replicated (`distributed=False`, gradients all-reduced)."""

    def __init__(self, model: nn.Module, training: TrainingSpec, groups: ParallelGroups,
                 distributed: bool = True, offload_fraction: float = 0.0):
        self.training, self.groups, self.distributed = training, groups, distributed
        self.grad_dtype = torch.bfloat16 if training.grad_reduce_dtype == "bf16" else torch.float32
        named = list(model.named_parameters())
        dense = [(n, p) for n, p in named if not shard_info(p).expert]
        # tp-replicated first: their tp all-reduce is one contiguous slice; stage copies last
        dense.sort(key=lambda np_: (_is_duplicate(np_[1]), shard_info(np_[1]).tp_dim is not None))
        experts = [(n, p) for n, p in named if shard_info(p).expert]
        self.families = [self._flatten(dense, groups.dp_cp, tp_replicated=True)]
        if experts:
            self.families.append(self._flatten(experts, groups.edp, tp_replicated=False))
        self.step_count = 0
        self.skipped = False
        moments = torch.bfloat16 if training.optimizer_moments_dtype == "bf16" else torch.float32
        for f in self.families:
            n = f.shard.stop - f.shard.start
            cut = math.floor(offload_fraction * n)
            for lo, hi, host in ((0, cut, True), (cut, n, False)):
                if hi > lo:
                    f.parts.append(self._part(f, lo, hi, host, moments))

    # ------------------------------------------------------------------------------ buffers
    def _flatten(self, named: list[tuple[str, nn.Parameter]], axis: Axis,
                 tp_replicated: bool) -> _Family:
        offsets, n, rep_end, dup_start, shared = [], 0, 0, None, []
        for _, p in named:
            offsets.append(n)
            if _is_duplicate(p) and dup_start is None:
                dup_start = n
            if shard_info(p).embedding_group:
                shared.append((n, p.numel()))
            n += p.numel()
            if tp_replicated and shard_info(p).tp_dim is None and not _is_duplicate(p):
                rep_end = n
        size = axis.size if self.distributed else 1
        padded = -(-n // size) * size
        ref = named[0][1]
        fam = _Family(axis, [nm for nm, _ in named], [p for _, p in named], offsets, rep_end, n,
                      n if dup_start is None else dup_start, shared)
        fam.param_buf = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
        # fp32 gradient accumulation whatever the weights' dtype (Megatron's main_grad), or bf16
        # with `TrainingSpec.grad_reduce_dtype` (Megatron --grad-reduce-in-bf16: the buffer, and
        # so the accumulation over micro-batches and every reduction, is bf16)
        fam.grad_buf = torch.zeros(padded, dtype=self.grad_dtype, device=ref.device)
        decay = torch.zeros(padded, dtype=torch.bool, device=ref.device)
        for (_, p), off in zip(named, offsets, strict=True):
            view = fam.param_buf[off: off + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
            gview = fam.grad_buf[off: off + p.numel()].view_as(p)
            if p.dtype == fam.grad_buf.dtype:
                p.grad = gview  # autograd accumulates in place into the flat buffer
            else:
                p.register_post_accumulate_grad_hook(_accumulate_into(gview))
            decay[off: off + p.numel()] = p.dim() >= 2  # no decay on norms and biases
        per = padded // size
        rank = axis.rank if self.distributed else 0
        fam.shard = slice(rank * per, (rank + 1) * per)
        fam.decay = decay[fam.shard].clone()
        return fam

    @staticmethod
    def _part(f: _Family, lo: int, hi: int, host: bool, moments: torch.dtype) -> _AdamPart:
        """Master and moments of shard elements [lo, hi): on the host (pinned on CUDA), or
        beside the parameters. On a CPU-only machine the host part is still its own tensors,
        stepped by the host path."""
        dev = f.param_buf.device
        where = torch.device("cpu") if host else dev
        pin = host and dev.type == "cuda"
        master = torch.empty(hi - lo, dtype=torch.float32, device=where, pin_memory=pin)
        master.copy_(f.param_buf[f.shard][lo:hi])
        zeros = [torch.zeros(hi - lo, dtype=moments, device=where, pin_memory=pin)
                 for _ in range(2)]
        return _AdamPart(lo, hi, master, *zeros, decay=f.decay[lo:hi].to(where), offloaded=host)

    def zero_grad(self) -> None:
        for f in self.families:
            f.grad_buf.zero_()
            f.grad_shard = None

    # --------------------------------------------------------------------------------- step
    def reduce_grads(self) -> None:
        """Sum the embedding copies over the embedding group and tp partials of replicated
        params, then reduce over each family's dp group."""
        tp = self.groups.tp
        for f in self.families:
            for off, n in f.shared:
                all_reduce_(f.grad_buf[off: off + n], self.groups.embd)
            if f.replicated_end and not tp.trivial:
                all_reduce_(f.grad_buf[: f.replicated_end], tp)
            if f.axis.trivial:
                f.grad_shard = f.grad_buf[f.shard]
            elif self.distributed:
                f.grad_shard = torch.empty_like(f.grad_buf[f.shard])
                dist.reduce_scatter_tensor(f.grad_shard, f.grad_buf, group=f.axis.group)
            else:
                dist.all_reduce(f.grad_buf, group=f.axis.group)
                f.grad_shard = f.grad_buf

    def grad_norm(self) -> float:
        """Global L2 norm over every parameter of the model, each element counted once.

        Each rank adds the squares of its shard; tp-replicated elements are weighted 1/tp and
        replicated (non-distributed) buffers 1/dp, so the world sum counts every element once.
        """
        total = torch.zeros((), dtype=torch.float32, device=self.families[0].grad_buf.device)
        tp = self.groups.tp.size
        for f in self.families:
            g = f.grad_shard.float()
            g = g[: max(0, min(f.duplicate_start - f.shard.start, g.numel()))]
            rep = max(0, min(f.replicated_end - f.shard.start, g.numel()))
            part = torch.dot(g[:rep], g[:rep]) / tp + torch.dot(g[rep:], g[rep:])  # fp32, no copy
            if not self.distributed:
                part = part / f.axis.size
            total += part
        all_reduce_(total, self.groups.world)
        return float(total.sqrt())

    @torch.no_grad()
    def step(self, lr: float, skip: bool = False) -> float:
        """Clip by the global norm, AdamW on this rank's shard, all-gather the parameters.

        Returns the unclipped gradient norm. With `skip`, or when that norm is NaN/inf (the
        same on every rank: it is all-reduced), nothing is updated, not even the Adam step
        count, and `skipped` is set: one bad batch must not poison the moments.
        """
        t = self.training
        norm = self.grad_norm()
        self.skipped = skip or not math.isfinite(norm)
        if self.skipped:
            return norm
        clip = min(1.0, t.clip_grad / (norm + 1e-6)) if t.clip_grad > 0 else 1.0
        self.step_count += 1
        b1, b2 = t.adam_beta1, t.adam_beta2
        bc1, bc2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        for f in self.families:
            g = f.grad_shard.float() * clip
            host = [(p, _to_host(g[p.lo: p.hi])) for p in f.parts if p.offloaded]  # D2H first
            for p in f.parts:
                if not p.offloaded:
                    _adamw_(p, g[p.lo: p.hi], lr, bc1, bc2, t)
            if host and g.is_cuda:
                torch.cuda.current_stream(g.device).synchronize()  # the gradients have landed
            for p, gh in host:
                _adamw_(p, gh, lr, bc1, bc2, t)
            shard = f.param_buf[f.shard]
            for p in f.parts:
                shard[p.lo: p.hi].copy_(p.master, non_blocking=True)
            if self.distributed and not f.axis.trivial:
                dist.all_gather_into_tensor(f.param_buf, f.param_buf[f.shard].clone(),
                                            group=f.axis.group)
        return norm

    # ------------------------------------------------------------------------------ debug
    def reduced_grads(self) -> dict[str, torch.Tensor]:
        """Each parameter's reduced (unclipped) gradient in its local tp/ep shape.

        Collective: all-gathers distributed shards. For tests and checkpoint tooling.
        """
        out = {}
        for f in self.families:
            full = f.grad_shard
            if self.distributed and not f.axis.trivial:
                full = torch.empty_like(f.grad_buf)
                dist.all_gather_into_tensor(full, f.grad_shard.contiguous(), group=f.axis.group)
            for name, p, off in zip(f.names, f.params, f.offsets, strict=True):
                out[name] = full[off: off + p.numel()].view(p.shape).clone()
        return out


def _adamw_(p: _AdamPart, g: torch.Tensor, lr: float, bc1: float, bc2: float,
            t: TrainingSpec) -> None:
    """AdamW (Loshchilov & Hutter 2019) on one part, in place; g is its clipped gradient."""
    b1, b2 = t.adam_beta1, t.adam_beta2
    p.exp_avg.mul_(b1).add_(g.to(p.exp_avg.dtype), alpha=1 - b1)
    p.exp_avg_sq.mul_(b2).addcmul_(g.to(p.exp_avg.dtype), g.to(p.exp_avg.dtype), value=1 - b2)
    p.master.sub_(p.master * p.decay * (lr * t.weight_decay))  # decoupled decay
    denom = (p.exp_avg_sq.float() / bc2).sqrt_().add_(t.adam_eps)
    p.master.addcdiv_(p.exp_avg.float(), denom, value=-lr / bc1)


def _to_host(g: torch.Tensor) -> torch.Tensor:
    """A gradient slice copied to host memory (pinned and asynchronous on CUDA)."""
    out = torch.empty(g.shape, dtype=g.dtype, pin_memory=g.is_cuda)
    out.copy_(g, non_blocking=True)
    return out


def _is_duplicate(p: torch.Tensor) -> bool:
    return shard_info(p).duplicate


def _accumulate_into(main_grad: torch.Tensor):
    def hook(p: torch.Tensor) -> None:
        main_grad.add_(p.grad)
        p.grad = None
    return hook
