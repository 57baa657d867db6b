"""Context parallelism: causal attention over a sequence split across the cp group.

Load balancing (Megatron Core's `get_batch_on_this_cp_rank`): the sequence is cut into 2·cp
chunks of n tokens and cp rank r holds chunks r and 2cp−1−r, one early and one late, so every
rank does the same causal work. Every token-wise module (norms, linears, MoE, loss) just sees a
shorter sequence; only attention needs the other ranks' keys and values.

Ring attention (Liu et al. 2023; Megatron's `AttnFuncWithCPAndKVP2P`): the local K/V block
travels around the cp ring in cp − 1 shifts, and each block's partial attention is merged into
the running output with its log-sum-exp (the online softmax). With the two-chunk layout the
causal mask is needed only for the rank's own block: a block from an earlier rank j < r is fully
visible to every local query but only its first chunk is in the past, and a block from a later
rank j > r is fully visible only to the local late chunk. The shift is an autograd function
whose backward is the reverse shift, so dK/dV travel back around the ring and autograd derives
the whole backward pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import Axis


def cp_positions(seq: int, cp: Axis, device: torch.device | None = None) -> torch.Tensor:
    """Global positions (2n,) of this cp rank's tokens: chunk r, then chunk 2cp−1−r."""
    n = seq // (2 * cp.size)
    r = cp.rank
    early = torch.arange(r * n, (r + 1) * n, device=device)
    late = torch.arange((2 * cp.size - 1 - r) * n, (2 * cp.size - r) * n, device=device)
    return torch.cat([early, late])


def _shift(x: torch.Tensor, axis: Axis, step: int) -> torch.Tensor:
    """Send x to the rank `step` places ahead in the ring and receive from the one behind."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dst = axis.ranks[(axis.rank + step) % axis.size]
    src = axis.ranks[(axis.rank - step) % axis.size]
    # one batch: on NCCL the send and receive are grouped, so neither waits behind the other
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, dst, axis.group),
                                   dist.P2POp(dist.irecv, out, src, axis.group)])
    for req in reqs:
        req.wait()
    return out


class _RingShift(torch.autograd.Function):
    """Pass a block to the next cp rank; the gradient goes back to the previous one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: Axis) -> torch.Tensor:  # type: ignore[override]
        ctx.axis = axis
        return _shift(x, axis, 1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return _shift(g, ctx.axis, -1), None


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # q (b, a, sq, d), k (b, a, sk, d), v (b, a, sk, dv) → out (b, a, sq, dv), lse (b, a, sq)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (b, a, sq, sk)
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: combine two partial attentions over disjoint key sets."""
    new = torch.logaddexp(lse, lse_b)  # (b, a, sq)
    merged = out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1)
    return merged, new


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   cp: Axis) -> torch.Tensor:
    """Causal attention of the local (two-chunk) queries over the whole cp-split sequence.

    q (s, b, a, d), k (s, b, g, d), v (s, b, g, dv) with s = 2n local tokens → (s, b, a·dv).
    """
    s, b, a = q.shape[0], q.shape[1], q.shape[2]
    n, dk = s // 2, k.shape[-1]
    rep = a // k.shape[2]  # GQA: query head i reads kv head i // rep (as SDPA's enable_gqa)
    qh = q.permute(1, 2, 0, 3)  # (b, a, s, d)

    def heads(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # kv (s, b, g, d + dv) → k, v (b, a, s, ·)
        kv = kv.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        return kv[..., :dk], kv[..., dk:]

    kv = torch.cat([k, v], dim=-1)  # (s, b, g, d + dv): one message per ring step
    out, lse = _block(qh, *heads(kv), scale, causal=True)  # own block: plain causal
    for i in range(1, cp.size):
        kv = _RingShift.apply(kv, cp)
        j = (cp.rank - i) % cp.size  # whose block arrived
        kb, vb = heads(kv)
        if j < cp.rank:  # earlier rank: its early chunk precedes both local chunks
            out, lse = _merge(out, lse, *_block(qh, kb[:, :, :n], vb[:, :, :n], scale, False))
        else:  # later rank: both its chunks precede only the local late chunk
            o2, l2 = _merge(out[:, :, n:], lse[:, :, n:],
                            *_block(qh[:, :, n:], kb, vb, scale, False))
            out = torch.cat([out[:, :, :n], o2], dim=2)
            lse = torch.cat([lse[:, :, :n], l2], dim=2)
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # (s, b, a·dv)
