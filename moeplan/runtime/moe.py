"""The MoE layer: router → token dispatcher → grouped expert GEMMs → combine, plus shared experts.

One dispatcher interface (`TokenDispatcher`: `dispatch` returns the expert input and a
`DispatchState`, `combine` takes that state back), three implementations sharing it:
`AllToAllDispatcher` (permute → all-to-all over EP → all-gather over ETP → sort by local
expert, and the reverse), `AllGatherDispatcher` (all-gather tokens over the tp×ep group, keep
those of local experts, reduce-scatter back) and `FlexDispatcher` (across NVLink domains). With ep = etp = 1 the all-to-all dispatcher does no
communication at all: it is the reference every parallel layout is tested against. Dropless by
default; with a capacity factor, copies beyond an expert's capacity are dropped (lowest
probability first, Megatron's "probs" policy) before dispatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import KernelBackend
from .comm import (
    SINGLE,
    AllToAllV,
    Axis,
    GatherV,
    ScatterV,
    all_gather_sizes,
    all_reduce_,
    communicate,
    gather_seq,
    scatter_seq,
)
from .layers import MLP, activation, normal_weight
from .replay import recomputing


@dataclass
class Routing:
    """Router output for T local tokens: global expert ids (T, k) (E marks a dropped copy),
    probabilities (T, k) with gradient, the aux loss piece and token counts (E,) of this rank."""

    experts: torch.Tensor
    probs: torch.Tensor
    aux_loss: torch.Tensor
    counts: torch.Tensor
    may_drop: bool = False  # capacity dropping on: some ids may be E


@dataclass
class DispatchState:
    """What a dispatch leaves for its combine (one micro-batch of one MoE layer), the one
    record the three dispatchers share.

    The all-gather and all-to-all dispatchers set the permutation back to token order; the
    all-to-all one also, when it communicates (`exchanged`), the exchange's split sizes and the
    sort by local expert. The flex one keeps the rows it sent over the rail (with that hop's
    split sizes) and the in-domain dispatch's own state.
    """

    tokens: int  # T: rows the combine returns
    probs: torch.Tensor | None = None  # (T, k) routing probabilities that weight the combine
    order: torch.Tensor | None = None  # from `backend.permute`: sorted copies → tokens
    dropped: int = 0  # copies cut off after the permute (capacity drops, other ranks' experts)
    local_counts: torch.Tensor | None = None  # (E_local,) rows per local expert
    # the exchange's split sizes: all-to-all over ep (or the flex rail), then gather over etp
    send: list[int] | None = None
    recv: list[int] | None = None
    etp_sizes: list[int] | None = None
    sort: torch.Tensor | None = None  # arrival order → grouped by local expert
    # flex only: the token of each row sent over the rail, and the in-domain dispatch
    rows: torch.Tensor | None = None
    inner: DispatchState | None = None

    @property
    def exchanged(self) -> bool:
        return self.sort is not None


class TokenDispatcher(Protocol):
    """Tokens to their experts and back: `dispatch` x (T, h) → expert input (N, h) grouped by
    local expert, its counts (E_local,) and the state `combine` needs to bring the expert
    outputs (N, h) back to (T, h), weighted by the routing probabilities."""

    def dispatch(self, x: torch.Tensor, routing: Routing
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]: ...

    def combine(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor: ...


class Router(nn.Module):
    """Top-k router: softmax or sigmoid scores, optional group-limited routing, normalised top-k
    probabilities, switch aux loss (Fedus et al. 2021, eq. 4; Megatron's per-sequence-group form)
    and DeepSeek-V3's aux-loss-free expert bias (§2.1.2, a buffer updated after each step)."""

    def __init__(self, spec, std: float, gen: torch.Generator | None, aux_coeff: float,
                 capacity_factor: float | None):
        super().__init__()
        self.E, self.k = spec.num_experts, spec.moe_top_k
        self.score, self.norm_topk = spec.router_score, spec.norm_topk_prob
        self.groups, self.groups_per_token = spec.router_num_groups, spec.router_groups_per_token
        self.scale, self.aux_coeff, self.capacity_factor = (spec.routed_scaling_factor, aux_coeff,
                                                            capacity_factor)
        self.weight = normal_weight((self.E, spec.hidden_size), std, gen)
        self.bias = nn.Parameter(torch.zeros(self.E)) if spec.router_bias else None
        self.register_buffer("expert_bias", torch.zeros(self.E) if spec.router_expert_bias
                             else None)
        self.seq_axis: Axis = SINGLE  # the tp(-cp) group sharing one micro-batch's tokens

    def forward(self, x: torch.Tensor) -> Routing:
        # x (T, h) → logits (T, E) in fp32
        logits = F.linear(x.float(), self.weight.float(),
                          None if self.bias is None else self.bias.float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        select = scores.detach() if self.expert_bias is None else scores.detach() + self.expert_bias
        if self.groups and self.groups > 1:
            select = self._limit_groups(select)
        idx = select.topk(self.k, dim=-1).indices  # (T, k)
        probs = scores.gather(-1, idx)  # (T, k)
        if self.norm_topk:  # also for k = 1 (weight 1), as transformers' Mixtral router does
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        probs = probs * self.scale
        counts = torch.bincount(idx.reshape(-1), minlength=self.E)  # (E,)
        aux = self._aux_loss(scores, counts)
        if self.capacity_factor is not None:
            idx, probs = self._drop_over_capacity(idx, probs)
            counts = torch.bincount(idx.reshape(-1), minlength=self.E + 1)[: self.E]
        return Routing(idx, probs, aux, counts, self.capacity_factor is not None)

    def _limit_groups(self, select: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3 node-limited routing: keep the best `groups_per_token` expert groups."""
        T = select.shape[0]
        grouped = select.view(T, self.groups, -1)  # (T, G, E/G)
        if self.score == "sigmoid":
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_score = grouped.max(dim=-1).values  # (T, G)
        keep = group_score.topk(self.groups_per_token or self.groups, dim=-1).indices
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, -1)

    def _aux_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's piece of coeff·E/(k·T²)·Σ_e P_e·f_e over the micro-batch's T tokens.

        Token counts are summed over the ranks sharing the micro-batch (no gradient); each rank
        differentiates only its own tokens' probabilities, so the pieces add up exactly.
        """
        if self.aux_coeff == 0 or not self.training:
            return scores.new_zeros(())
        total = counts.float().clone()
        all_reduce_(total, self.seq_axis)
        T = scores.shape[0] * self.seq_axis.size
        p = scores if self.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        coeff = self.aux_coeff * self.E / (self.k * T * T)
        return (p.sum(0) * total).sum() * coeff

    def _drop_over_capacity(self, idx: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # capacity per expert = ⌈T·k/E·cf⌉ over this rank's tokens; overflow copies → id E
        T = idx.shape[0]
        cap = min(T, math.ceil(T * self.k / self.E * self.capacity_factor))
        dense = torch.full((T, self.E), -1.0, device=idx.device).scatter(
            1, idx, probs.detach().float())  # (T, E), -1 where not routed
        keep_rows = dense.topk(cap, dim=0).indices  # (cap, E)
        keep = torch.zeros_like(dense, dtype=torch.bool).scatter_(0, keep_rows, True)
        keep &= dense >= 0
        kept = keep.gather(1, idx)  # (T, k)
        return idx.masked_fill(~kept, self.E), probs * kept


class GroupedExperts(nn.Module):
    """The routed experts as stacked weights: gate/up (E, h, f), down (E, f, h).

    After `parallelize`: dim 0 holds this rank's E/ep experts, the f dims its 1/etp slice.
    """

    def __init__(self, spec, std: float, out_std: float, gen: torch.Generator | None,
                 backend: KernelBackend):
        super().__init__()
        E, h, f = spec.num_experts, spec.hidden_size, spec.moe_ffn_hidden_size
        self.kind, self.backend = spec.activation, backend
        self.w_gate = normal_weight((E, h, f), std, gen) if spec.gated else None
        self.w_up = normal_weight((E, h, f), std, gen)
        self.w_down = normal_weight((E, f, h), out_std, gen)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # x (N, h) grouped by local expert, counts (E_local,) → (N, h) (partial over etp)
        return self.backend.grouped_mm(self.act(*self.fc1(x, counts)), self.w_down, counts)

    # fc1 and act are methods of their own: the plan's `expert_fc1` / `moe_act` offload and
    # `moe_act` recompute wrap them (memory.py)
    def fc1(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, h) → up (N, f/etp) and gate (N, f/etp), or up twice without a gate."""
        up = self.backend.grouped_mm(x, self.w_up, counts)
        return up, (up if self.w_gate is None else self.backend.grouped_mm(x, self.w_gate,
                                                                           counts))

    def act(self, up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """act(gate) · up (gated), else act(up): (N, f/etp)."""
        return activation(self.kind, gate) * up if self.w_gate is not None else activation(
            self.kind, up)


class AllToAllDispatcher:
    """Megatron's MoEAlltoAllTokenDispatcher over explicit ep and etp groups.

    `tp_ep` is the etp×ep group (etp fastest), over which token counts are exchanged once.
    """

    def __init__(self, num_experts: int, backend: KernelBackend, ep: Axis = SINGLE,
                 etp: Axis = SINGLE, tp_ep: Axis = SINGLE):
        self.E, self.backend, self.ep, self.etp, self.tp_ep = num_experts, backend, ep, etp, tp_ep
        self.E_local = num_experts // ep.size
        self.first = ep.rank * self.E_local

    # dispatch = dispatch_pre → dispatch_hops → dispatch_post, combine = combine_pre →
    # combine_hops → combine_post: the EP overlap schedule (overlap.py) runs the same pieces
    # with the hops issued asynchronously between them
    def dispatch(self, x: torch.Tensor, routing: Routing
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        # x (T, h) → expert input (N, h) grouped by local expert, counts (E_local,)
        copies, state = self.dispatch_pre(x, routing)
        for op in self.dispatch_hops(state):
            copies = communicate(copies, op)
        return (*self.dispatch_post(copies, state), state)

    def combine(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        # y (N, h) expert outputs grouped by local expert → (T, h) weighted by the probabilities
        y = self.combine_pre(y, state)
        for op in self.combine_hops(state):
            y = communicate(y, op)
        return self.combine_post(y, state)

    def dispatch_pre(self, x: torch.Tensor, routing: Routing
                     ) -> tuple[torch.Tensor, DispatchState]:
        """Permute x (T, h) into copies sorted by global expert (dropped ones cut off) and
        exchange the token counts; the state holds what the other pieces need."""
        copies, order, counts = self.backend.permute(x, routing.experts, self.E + 1)
        # dropped copies sort last (id E); only then is a host sync needed to cut them off
        kept = int(counts[: self.E].sum()) if routing.may_drop else copies.shape[0]
        state = DispatchState(x.shape[0], routing.probs, order, copies.shape[0] - kept,
                              local_counts=counts[: self.E])
        copies = copies[:kept]  # (T·k − dropped, h) sorted by global expert
        if self.ep.trivial and self.etp.trivial:
            return copies, state
        # every rank's per-expert counts, arranged [ep peer j][etp peer q][expert]
        all_counts = all_gather_sizes(counts[: self.E], self.tp_ep)
        all_counts = all_counts.view(self.ep.size, self.etp.size, self.E)
        mine = all_counts[:, :, self.first: self.first + self.E_local]  # (ep, etp, E_local)
        host = mine.tolist()
        send = counts[: self.E].view(self.ep.size, self.E_local).sum(-1).tolist()
        recv = [sum(host[j][self.etp.rank]) for j in range(self.ep.size)]
        etp_sizes = [sum(sum(host[j][q]) for j in range(self.ep.size))
                     for q in range(self.etp.size)]
        # after the hops, rows arrive as [etp peer q][ep peer j][local expert l]; a stable
        # sort by local expert gives [l][q][j]
        chunk_sizes = mine.permute(1, 0, 2).reshape(-1)  # (etp·ep·E_local,) in [q][j][l] order
        chunk_expert = torch.arange(self.E_local, device=x.device).repeat(
            self.etp.size * self.ep.size)
        row_expert = torch.repeat_interleave(chunk_expert, chunk_sizes)
        sort = torch.argsort(row_expert, stable=True)
        state.send, state.recv, state.etp_sizes, state.sort = send, recv, etp_sizes, sort
        state.local_counts = mine.sum(dim=(0, 1))  # (E_local,)
        return copies, state

    def dispatch_hops(self, state: DispatchState) -> list[AllToAllV | GatherV]:
        """All-to-all over ep ([ep peer j][local expert l]), then all-gather over etp."""
        if not state.exchanged:
            return []
        assert state.recv is not None and state.send is not None and state.etp_sizes is not None
        return [op for op in (AllToAllV(self.ep, state.recv, state.send),
                              GatherV(self.etp, state.etp_sizes)) if not op.axis.trivial]

    def dispatch_post(self, y: torch.Tensor, state: DispatchState
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows in arrival order → grouped by local expert; and the counts per local expert."""
        assert state.local_counts is not None
        return (y if state.sort is None else y.index_select(0, state.sort)), state.local_counts

    def combine_pre(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        return y if state.sort is None else _unsort(y, state.sort)

    def combine_hops(self, state: DispatchState) -> list[AllToAllV | ScatterV]:
        """The adjoints of `dispatch_hops`, in reverse: reduce-scatter over etp, all-to-all back."""
        return [op.adjoint() for op in reversed(self.dispatch_hops(state))]

    def combine_post(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """y (T·k − dropped, h) back at home, sorted by global expert → (T, h) weighted."""
        return _unpermute(self.backend, y, state)


class FlexDispatcher:
    """Megatron's flex dispatcher (DeepEP / HybridEP) for an ep group spanning NVLink domains.

    A token crosses to each *remote domain* that holds one of its experts once, to the rank at
    its own position there (its rail), with the ids and probabilities of its experts in that
    domain; that rank fans it out over NVLink like the all-to-all dispatcher. The combine sums
    each domain's weighted expert outputs where they were fanned out and sends one partial sum
    back per domain. So scale-out traffic is one copy per (token, remote domain), not one per
    (token, expert): what the cost models price for `flex`. With etp > 1 each etp rank sends
    its own tokens over its own rail, and the fan-out gathers them over etp as the all-to-all
    dispatcher does (`tp_ep_domain`: the etp×ep ranks of this domain).
    """

    def __init__(self, num_experts: int, backend: KernelBackend, domain: Axis, rail: Axis,
                 etp: Axis = SINGLE, tp_ep_domain: Axis = SINGLE):
        self.E, self.rail = num_experts, rail
        self.E_dom = num_experts // rail.size  # experts of one domain: a contiguous range
        self.inner = AllToAllDispatcher(self.E_dom, backend, domain, etp,
                                        domain if etp.trivial else tp_ep_domain)

    def dispatch(self, x: torch.Tensor, routing: Routing
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        # x (T, h) → expert input (N, h) grouped by local expert, counts (E_local,)
        sent, state = self.rail_pre(x, routing)
        rail = self.rail_hop(state)
        xr, er, pr = (communicate(t, rail) if t.is_floating_point() else rail.start(t).wait()
                      for t in sent)  # integer ids: no gradient
        y, inner = self.inner.dispatch_pre(xr, self.inner_routing(er, pr, routing))
        state.inner = inner
        for op in self.inner.dispatch_hops(inner):
            y = communicate(y, op)
        y, local_counts = self.inner.dispatch_post(y, inner)
        return y, local_counts, state

    def combine(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        # y (N, h) expert outputs → (T, h): each domain's weighted partial sum, summed at home
        inner = state.inner
        assert inner is not None
        y = self.inner.combine_pre(y, inner)
        for op in self.inner.combine_hops(inner):
            y = communicate(y, op)
        partial = self.inner.combine_post(y, inner)  # (Σ recv, h)
        return self.rail_post(communicate(partial, self.rail_hop(state).adjoint()), state)

    def rail_pre(self, x: torch.Tensor, routing: Routing
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], DispatchState]:
        """One row per (token, domain holding one of its experts), grouped by domain: the
        rows of x, their expert ids within that domain and their probabilities; the row
        counts are exchanged over the rail."""
        ex, D = routing.experts, self.rail.size  # (T, k); id E marks a dropped copy
        dom = torch.where(ex < self.E, ex // self.E_dom, D)  # (T, k) domain of each copy
        idx = [(dom == d).any(1).nonzero().squeeze(1) for d in range(D)]  # tokens per domain
        send = [int(i.numel()) for i in idx]
        rows = torch.cat(idx)  # (R,) token of each row sent, grouped by destination domain
        row_dom = torch.repeat_interleave(torch.arange(D, device=x.device),
                                          torch.tensor(send, device=x.device))
        hit = dom.index_select(0, rows) == row_dom[:, None]  # (R, k) copies for that domain
        ids = torch.where(hit, ex.index_select(0, rows) - row_dom[:, None] * self.E_dom,
                          self.E_dom)  # ids within the domain; others dropped there
        probs = routing.probs.index_select(0, rows) * hit  # (R, k), gradient flows back
        counts = all_gather_sizes(torch.tensor(send, device=x.device), self.rail)  # (D, D)
        recv = counts[:, self.rail.rank].tolist()
        return (x.index_select(0, rows), ids, probs), DispatchState(
            x.shape[0], send=send, recv=recv, rows=rows)

    def rail_hop(self, state: DispatchState) -> AllToAllV:
        """The scale-out hop: each row to the rank at this rank's position in its domain."""
        assert state.recv is not None and state.send is not None
        return AllToAllV(self.rail, state.recv, state.send)

    @staticmethod
    def inner_routing(ids: torch.Tensor, probs: torch.Tensor, routing: Routing) -> Routing:
        """The rows received over the rail, routed to this domain's experts."""
        return Routing(ids, probs, routing.aux_loss, routing.counts, may_drop=True)

    def rail_post(self, back: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Partial sums back at home (R, h) → (T, h), summed per token."""
        assert state.rows is not None
        return back.new_zeros(state.tokens, back.shape[1]).index_add(0, state.rows, back)


def _unpermute(backend: KernelBackend, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
    """Expert outputs sorted by expert, the dropped copies cut off (N, h) → (T, h) weighted."""
    assert state.order is not None and state.probs is not None
    if state.dropped:
        y = torch.cat([y, y.new_zeros(state.dropped, y.shape[1])])
    return backend.unpermute(y, state.order, state.probs, state.tokens)


def _unsort(y: torch.Tensor, sort: torch.Tensor) -> torch.Tensor:
    """Inverse of `y_sorted = y.index_select(0, sort)`, differentiable."""
    inverse = torch.empty_like(sort)
    inverse[sort] = torch.arange(sort.numel(), device=sort.device)
    return y.index_select(0, inverse)


class AllGatherDispatcher:
    """Megatron's MoEAllGatherTokenDispatcher: every rank of the etp×ep group sees all its
    tokens, computes its local experts' share and the partial outputs are reduce-scattered."""

    def __init__(self, num_experts: int, backend: KernelBackend, ep: Axis = SINGLE,
                 tp_ep: Axis = SINGLE):
        self.E, self.backend, self.tp_ep = num_experts, backend, tp_ep
        self.E_local = num_experts // ep.size
        self.first = ep.rank * self.E_local

    def dispatch(self, x: torch.Tensor, routing: Routing
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchState]:
        xs = gather_seq(x, self.tp_ep)  # (T·n, h), every rank's tokens in group order
        experts = gather_seq(routing.experts, self.tp_ep) if not self.tp_ep.trivial else (
            routing.experts)
        probs = gather_seq(routing.probs, self.tp_ep)  # (T·n, k), gradient flows back
        local = experts - self.first
        mine = (local >= 0) & (local < self.E_local)
        local = local.masked_fill(~mine, self.E_local)  # other ranks' experts → drop bin
        copies, order, counts = self.backend.permute(xs, local, self.E_local + 1)
        kept = int(counts[: self.E_local].sum())
        state = DispatchState(xs.shape[0], probs, order, copies.shape[0] - kept)
        return copies[:kept], counts[: self.E_local], state

    def combine(self, y: torch.Tensor, state: DispatchState) -> torch.Tensor:
        out = _unpermute(self.backend, y, state)  # (T·n, h) partial
        return scatter_seq(out, self.tp_ep)  # (T, h)


class MoE(nn.Module):
    """Router + routed experts (through the dispatcher) + optional shared experts."""

    def __init__(self, spec, std: float, out_std: float, gen: torch.Generator | None,
                 backend: KernelBackend, aux_coeff: float, capacity_factor: float | None):
        super().__init__()
        self.router = Router(spec, std, gen, aux_coeff, capacity_factor)
        self.experts = GroupedExperts(spec, std, out_std, gen, backend)
        self.shared = (MLP(spec, spec.shared_expert_ffn_hidden_size, std, out_std, gen, backend,
                           gate=spec.shared_expert_gate) if spec.num_shared_experts else None)
        self.dispatcher: TokenDispatcher = AllToAllDispatcher(spec.num_experts, backend)
        self.register_buffer("tokens_per_expert", torch.zeros(spec.num_experts,
                                                              dtype=torch.long), persistent=False)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (s/t, b, h)
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)  # (T, h)
        routing = self.router(tokens)
        self.aux_loss = routing.aux_loss
        if not recomputing():  # a recompute in backward must not count the tokens twice
            self.tokens_per_expert += routing.counts.detach()
        expert_in, counts, state = self.dispatcher.dispatch(tokens, routing)
        expert_out = self.experts(expert_in, counts)
        y = self.dispatcher.combine(expert_out, state).view(s, b, h).to(x.dtype)
        return y if self.shared is None else y + self.shared(x)
