"""Communication as small autograd functions, each taking the one group it needs.

Megatron `tensor_parallel/mappings.py` style: every forward collective has its adjoint as the
backward (all-gather ↔ reduce-scatter, all-to-all ↔ the reverse all-to-all, all-reduce ↔
identity). An `Axis` of size 1 makes every function the identity, so the single-process
reference runs the very same code with no communication. Only collectives that gloo and NCCL
both implement are used (variable-size gathers are padded), so CPU tests exercise the GPU path.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

# torch ≥ 2.10 renames the tensor collectives (`*_single`); the old names work on every torch the
# runtime supports (≥ 2.4), so keep them and silence the rename notice.
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.",
                        category=FutureWarning)


@dataclass(frozen=True)
class Axis:
    """One process group as a rank sees it: the group, its size and this rank's index in it."""

    group: dist.ProcessGroup | None = None
    size: int = 1
    rank: int = 0
    ranks: tuple[int, ...] = (0,)

    @property
    def trivial(self) -> bool:
        return self.size == 1


SINGLE = Axis()


# ------------------------------------------------------------------------------ raw collectives
def all_reduce_(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    if not axis.trivial:
        dist.all_reduce(x, group=axis.group)
    return x


def all_gather_dim0(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """x (n, ...) → (size·n, ...) in rank order; no gradient (the autograd pairs wrap it)."""
    x = x.contiguous()
    out = x.new_empty((axis.size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=axis.group)
    return out


def _reduce_scatter(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    # x (size·n, ...) → (n, ...), summed over the group
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // axis.size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=axis.group)
    return out


class Pending:
    """A collective issued with `async_op=True`: `wait()` blocks on it only when its result is
    needed, then finishes it on the host (unpadding); the EP overlap schedule runs the other
    micro-batch's compute in between (overlap.py)."""

    blocked_s: ClassVar[float] = 0.0  # time this process spent blocked in wait(), in total

    def __init__(self, work: dist.Work | None, finish):
        self.work, self.finish = work, finish

    def done(self) -> bool:
        """Whether the transfer has already completed (never blocks)."""
        return self.work is None or self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            start = time.perf_counter()
            self.work.wait()
            Pending.blocked_s += time.perf_counter() - start
        return self.finish()


@dataclass(frozen=True)
class AllToAllV:
    """All-to-all over `axis` with explicit split sizes; its adjoint swaps the splits."""

    axis: Axis
    out_splits: list[int]
    in_splits: list[int]

    def start(self, x: torch.Tensor) -> Pending:
        if self.axis.trivial:
            return Pending(None, lambda: x)
        x = x.contiguous()
        out = x.new_empty((sum(self.out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x, self.out_splits, self.in_splits,
                                      group=self.axis.group, async_op=True)
        return Pending(work, lambda: out)

    def adjoint(self) -> AllToAllV:
        return AllToAllV(self.axis, self.in_splits, self.out_splits)


@dataclass(frozen=True)
class GatherV:
    """All-gather of uneven pieces (sizes[r] rows from rank r) along dim 0, padded to the
    largest piece for gloo; its adjoint is `ScatterV` of the same pieces."""

    axis: Axis
    sizes: list[int]

    def start(self, x: torch.Tensor) -> Pending:
        if self.axis.trivial:
            return Pending(None, lambda: x)
        top = max(self.sizes)
        pad = x.new_zeros((top, *x.shape[1:]))
        pad[: x.shape[0]] = x
        full = pad.new_empty((self.axis.size * top, *x.shape[1:]))
        work = dist.all_gather_into_tensor(full, pad, group=self.axis.group, async_op=True)
        return Pending(work, lambda: torch.cat(
            [full[r * top: r * top + n] for r, n in enumerate(self.sizes)], dim=0))

    def adjoint(self) -> ScatterV:
        return ScatterV(self.axis, self.sizes)


@dataclass(frozen=True)
class ScatterV:
    """Reduce-scatter of uneven pieces along dim 0: (Σ sizes, ...) → (sizes[rank], ...) summed
    over the group; its adjoint is `GatherV`."""

    axis: Axis
    sizes: list[int]

    def start(self, x: torch.Tensor) -> Pending:
        if self.axis.trivial:
            return Pending(None, lambda: x)
        top = max(self.sizes)
        pad = x.new_zeros((self.axis.size * top, *x.shape[1:]))
        offset = 0
        for r, n in enumerate(self.sizes):
            pad[r * top: r * top + n] = x[offset: offset + n]
            offset += n
        out = pad.new_empty((top, *x.shape[1:]))
        work = dist.reduce_scatter_tensor(out, pad, group=self.axis.group, async_op=True)
        return Pending(work, lambda: out[: self.sizes[self.axis.rank]])

    def adjoint(self) -> GatherV:
        return GatherV(self.axis, self.sizes)


def _all_gather_v(x: torch.Tensor, axis: Axis, sizes: list[int]) -> torch.Tensor:
    # x (sizes[rank], h) → (Σ sizes, h)
    return GatherV(axis, sizes).start(x).wait()


def _reduce_scatter_v(x: torch.Tensor, axis: Axis, sizes: list[int]) -> torch.Tensor:
    # x (Σ sizes, h) → (sizes[rank], h) summed over the group
    return ScatterV(axis, sizes).start(x).wait()


def _all_to_all(x: torch.Tensor, axis: Axis, out_splits: list[int],
                in_splits: list[int]) -> torch.Tensor:
    return AllToAllV(axis, out_splits, in_splits).start(x).wait()


# ------------------------------------------------------------------------- autograd functions
class _ReduceFwd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:  # type: ignore[override]
        return all_reduce_(x.clone(), axis)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, None


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 (the sequence under SP); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:  # type: ignore[override]
        ctx.axis = axis
        return all_gather_dim0(x, axis)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return _reduce_scatter(g, ctx.axis), None


class _ScatterSeq(torch.autograd.Function):
    """Reduce-scatter along dim 0 (partial sums → sequence shards); backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:  # type: ignore[override]
        ctx.axis = axis
        return _reduce_scatter(x, axis)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return all_gather_dim0(g, ctx.axis), None


class _GatherV(torch.autograd.Function):
    """All-gather of uneven pieces along dim 0; backward reduce-scatters the same pieces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis, sizes: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.axis, ctx.sizes = axis, sizes
        return _all_gather_v(x, axis, sizes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return _reduce_scatter_v(g, ctx.axis, ctx.sizes), None, None


class _ScatterV(torch.autograd.Function):
    """Reduce-scatter of uneven pieces along dim 0; backward all-gathers them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis, sizes: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.axis, ctx.sizes = axis, sizes
        return _reduce_scatter_v(x, axis, sizes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return _all_gather_v(g, ctx.axis, ctx.sizes), None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all with explicit split sizes; backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis, out_splits: list[int],  # type: ignore[override]
                in_splits: list[int]) -> torch.Tensor:
        ctx.axis, ctx.out_splits, ctx.in_splits = axis, out_splits, in_splits
        return _all_to_all(x, axis, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return _all_to_all(g, ctx.axis, ctx.in_splits, ctx.out_splits), None, None, None


class _Communicate(torch.autograd.Function):
    """Any `AllToAllV` / `GatherV` / `ScatterV` inside autograd; backward runs its adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, op) -> torch.Tensor:  # type: ignore[override]
        ctx.op = op
        return op.start(x).wait()

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return ctx.op.adjoint().start(g).wait(), None


def communicate(x: torch.Tensor, op: AllToAllV | GatherV | ScatterV) -> torch.Tensor:
    """Run one communication op synchronously, differentiably (identity on a trivial axis)."""
    return x if op.axis.trivial else _Communicate.apply(x, op)


def reduce_from(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sum partial results over `axis` (forward all-reduce, backward identity)."""
    return x if axis.trivial else _ReduceFwd.apply(x, axis)


def gather_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(s/t, b, h) → (s, b, h): leave sequence parallelism before a column-parallel GEMM."""
    return x if axis.trivial else _GatherSeq.apply(x, axis)


def scatter_seq(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(s, b, h) partial sums → (s/t, b, h): enter sequence parallelism after a row-parallel GEMM."""
    return x if axis.trivial else _ScatterSeq.apply(x, axis)


def gather_v(x: torch.Tensor, axis: Axis, sizes: list[int]) -> torch.Tensor:
    return x if axis.trivial else _GatherV.apply(x, axis, sizes)


def scatter_v(x: torch.Tensor, axis: Axis, sizes: list[int]) -> torch.Tensor:
    return x if axis.trivial else _ScatterV.apply(x, axis, sizes)


def all_to_all(x: torch.Tensor, axis: Axis, out_splits: list[int],
               in_splits: list[int]) -> torch.Tensor:
    return x if axis.trivial else _AllToAll.apply(x, axis, out_splits, in_splits)


def all_gather_sizes(n: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Small integer tensors (k,) from every rank → (size, k), no gradient."""
    if axis.trivial:
        return n.unsqueeze(0)
    return all_gather_dim0(n.unsqueeze(0), axis)


# --------------------------------------------------------------------- vocab-parallel cross-entropy
class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits sharded along the vocabulary (Megatron `cross_entropy.py`).

    logits (n, V/t) with this rank holding vocab rows [start, start + V/t); target (n,) global ids.
    Max, sum-exp and the target logit are all-reduced, so no rank ever holds (n, V).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, axis: Axis,  # type: ignore[override]
                start: int) -> torch.Tensor:
        logits = logits.float()
        vmax = logits.max(dim=-1).values
        if not axis.trivial:
            dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=axis.group)
        shifted = logits - vmax.unsqueeze(-1)  # (n, V/t)
        local = target - start
        inside = (local >= 0) & (local < logits.shape[-1])
        idx = local.clamp(0, logits.shape[-1] - 1)
        tgt = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside  # (n,)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        if not axis.trivial:
            both = torch.stack([tgt, sum_exp])
            dist.all_reduce(both, group=axis.group)
            tgt, sum_exp = both[0], both[1]
        ctx.save_for_backward(exp, sum_exp, idx, inside)
        return sum_exp.log() - tgt  # (n,)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        exp, sum_exp, idx, inside = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)  # softmax (n, V/t)
        grad.scatter_add_(-1, idx.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, axis: Axis,
                                 start: int) -> torch.Tensor:
    """Per-token loss (n,) from vocab-sharded logits (n, V/t)."""
    return _VocabParallelCE.apply(logits, target, axis, start)
