"""Apply a plan's parallelism to a full-size model, one axis at a time (torchtitan style).

Pipeline splitting happens first, outside (`pipeline.split_stage` keeps this rank's stages);
then dense TP/SP → EP/ETP (+ dispatcher) → CP → DP (gradient reduction and the distributed
optimizer, in `optimizer.py`). Each `apply_*` receives only the groups it needs; the model
blocks read those groups at forward time and never look anything up globally. Activation
recompute and offload come between CP and DP (`apply_memory`, in `memory.py`), with the
module sets the plan gives this rank's pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..specs import Choices, Layout
from .comm import SINGLE, Axis, all_gather_dim0
from ..specs.grid import RankGrid
from .layers import (
    MLP,
    Attention,
    Linear,
    MLAttention,
    ShardInfo,
    set_shard_info,
    shard_,
    shard_info,
)
from .memory import apply_memory
from .model import Transformer
from .moe import AllGatherDispatcher, AllToAllDispatcher, FlexDispatcher, GroupedExperts

# Axes the runtime builds groups for: the printed ones plus those the optimizer and loss need.
RUNTIME_AXES = ("tp", "cp", "dp", "pp", "tp_cp", "dp_cp", "tp_cp_dp", "ep", "etp", "edp",
                "tp_ep")


@dataclass(frozen=True)
class ParallelGroups:
    """The frozen bundle of this rank's groups for one layout (built once, passed down)."""

    tp: Axis = SINGLE
    cp: Axis = SINGLE
    dp: Axis = SINGLE
    pp: Axis = SINGLE
    tp_cp: Axis = SINGLE
    dp_cp: Axis = SINGLE
    tp_cp_dp: Axis = SINGLE
    ep: Axis = SINGLE
    etp: Axis = SINGLE
    edp: Axis = SINGLE
    tp_ep: Axis = SINGLE
    # the ep group split by NVLink domain, for the flex dispatcher (`ep_domains`): this rank's
    # ep peers inside its domain, and its "rail" (the peers at its position in other domains)
    ep_domain: Axis = SINGLE
    ep_rail: Axis = SINGLE
    tp_ep_domain: Axis = SINGLE  # the etp×ep group's ranks in this rank's domain (etp > 1)
    world: Axis = SINGLE
    embd: Axis = SINGLE  # first and last pp rank of this pipeline (Megatron's embedding group)
    # one 2-rank group per pipeline edge and direction: (kind, sender's pp index, group), kind 0
    # for activations (i → i+1), 1 for gradients (i → i−1)
    pp_links: tuple[tuple[int, int, dist.ProcessGroup], ...] = ()


def ep_domains(ep_ranks: list[int], domain: int) -> tuple[list[list[int]], list[list[int]]]:
    """An ep group's ranks split by NVLink domain of `domain` GPUs: (one list per domain, one
    rail per position in a domain). The flex dispatcher needs each domain to hold a run of
    consecutive ep ranks of one size, so that a domain owns a contiguous range of experts; any
    other placement gives one domain (the flex dispatcher then runs as the all-to-all one)."""
    doms: dict[int, list[int]] = {}
    for r in ep_ranks:
        doms.setdefault(r // domain, []).append(r)
    parts = list(doms.values())
    size = len(parts[0])
    if len(parts) == 1 or any(len(p) != size for p in parts) or \
            [r for p in parts for r in p] != list(ep_ranks):
        return [list(ep_ranks)], [[r] for r in ep_ranks]
    return parts, [list(rail) for rail in zip(*parts, strict=True)]


def build_groups(grid: RankGrid, offset: int = 0, domain: int | None = None
                 ) -> ParallelGroups | None:
    """Create the torch.distributed groups of `grid` placed on global ranks offset..offset+world.

    Collective over the default process group: every process calls it with the same arguments
    (even those outside the grid, which get None), so several layouts can be carved out of one
    spawned world. Size-1 groups are not created. With `domain` (GPUs per NVLink domain the job
    uses, `ClusterSpec.usable_domain`), the ep groups are also split by domain for the flex
    dispatcher.
    """
    me = dist.get_rank()
    found: dict[str, Axis] = {}
    split: dict[str, list[list[int]]] = {"ep_domain": [], "ep_rail": [], "tp_ep_domain": []}
    if domain is not None and grid.ep > 1:
        for ep_ranks in grid.groups("ep"):
            doms, rails = ep_domains([r + offset for r in ep_ranks], domain)
            split["ep_domain"] += [[r - offset for r in d] for d in doms]
            split["ep_rail"] += [[r - offset for r in rail] for rail in rails]
        if grid.etp > 1:  # the counts exchange of the fan-out inside a domain spans etp too
            for ranks in grid.groups("tp_ep"):
                by_dom: dict[int, list[int]] = {}
                for r in ranks:
                    by_dom.setdefault((r + offset) // domain, []).append(r)
                split["tp_ep_domain"] += list(by_dom.values())
    for axis in (*RUNTIME_AXES, *split, "world"):
        groups = ([list(range(grid.world))] if axis == "world" else split[axis]
                  if axis in split else grid.groups(axis))
        for ranks in groups:
            ranks = [r + offset for r in ranks]
            if len(ranks) == 1:
                if me in ranks:
                    found[axis] = Axis(None, 1, 0, tuple(ranks))
                continue
            pg = dist.new_group(ranks)
            if me in ranks:
                found[axis] = Axis(pg, len(ranks), ranks.index(me), tuple(ranks))
    links = []
    if grid.pp > 1:
        for pp_ranks in grid.groups("pp"):
            ranks = [pp_ranks[0] + offset, pp_ranks[-1] + offset]
            pg = dist.new_group(ranks)
            if me in ranks:
                found["embd"] = Axis(pg, 2, ranks.index(me), tuple(ranks))
            # each link carries one kind of message one way, in one order on both ends, so
            # a send never queues behind a receive on the same communicator (NCCL)
            for kind, step in ((0, 1), (1, -1)):
                for i, src in enumerate(pp_ranks):
                    dst = pp_ranks[(i + step) % grid.pp]
                    pg = dist.new_group(sorted({src + offset, dst + offset}))
                    if me - offset in (src, dst):
                        links.append((kind, i, pg))
    if not offset <= me < offset + grid.world:
        return None
    return ParallelGroups(**found, pp_links=tuple(links))


def local_groups() -> ParallelGroups:
    """The bundle of a single-process run: every axis trivial."""
    return ParallelGroups()


# ---------------------------------------------------------------------------------- apply_*
def _column(lin: Linear, tp: Axis) -> None:
    for p in (lin.weight, lin.bias):
        if p is not None:
            shard_(p, 0, tp)
            set_shard_info(p, ShardInfo(tp_dim=0))


def _row(lin: Linear, tp: Axis) -> None:
    shard_(lin.weight, 1, tp)
    set_shard_info(lin.weight, ShardInfo(tp_dim=1))


def apply_tp(model: Transformer, tp: Axis) -> None:
    """Megatron TP with sequence parallelism: heads and FFN columns split over tp, vocab-parallel
    embedding and output. Everything else stays replicated (its gradients are summed over tp)."""
    if tp.trivial:
        return
    emb = model.embedding  # None on pipeline stages without embedding or loss head
    for p in (None if emb is None else emb.weight, model.output):
        if p is not None:
            shard_(p, 0, tp)
            set_shard_info(p, ShardInfo(tp_dim=0))
    if emb is not None:
        emb.tp, emb.start = tp, tp.rank * emb.weight.shape[0]
    model.tp = tp
    for m in model.modules():
        if isinstance(m, Attention):
            for lin in (m.q_proj, m.k_proj, m.v_proj):
                _column(lin, tp)
            _row(m.o_proj, tp)
        elif isinstance(m, MLAttention):
            for lin in (m.q_up if m.q_rank else m.q_proj, m.kv_up):
                _column(lin, tp)
            _row(m.o_proj, tp)
        elif isinstance(m, MLP):
            for lin in (m.gate_proj, m.up_proj):
                if lin is not None:
                    _column(lin, tp)
            _row(m.down_proj, tp)
        else:
            continue
        m.tp = tp


def apply_ep(model: Transformer, ep: Axis, etp: Axis, tp_ep: Axis, seq: Axis,
             dispatcher: str, ep_domain: Axis = SINGLE, ep_rail: Axis = SINGLE,
             tp_ep_domain: Axis = SINGLE) -> None:
    """Experts split over ep (dim 0) and their FFN over etp; the dispatcher gets ep/etp/tp_ep
    (the flex one also the ep group's split by NVLink domain); the router's aux loss counts
    tokens over `seq` (the tp-cp group sharing a micro-batch)."""
    for moe in model.moe_layers():
        ex: GroupedExperts = moe.experts
        for name in ("w_gate", "w_up", "w_down"):
            p = getattr(ex, name)
            if p is None:
                continue
            etp_dim = 1 if name == "w_down" else 2
            shard_(p, 0, ep)
            shard_(p, etp_dim, etp)
            set_shard_info(p, ShardInfo(expert=True, etp_dim=etp_dim))
        E = moe.router.E
        if dispatcher == "allgather":
            moe.dispatcher = AllGatherDispatcher(E, ex.backend, ep, tp_ep)
        elif dispatcher == "flex" and not ep_rail.trivial:
            moe.dispatcher = FlexDispatcher(E, ex.backend, ep_domain, ep_rail, etp, tp_ep_domain)
        else:  # alltoall, or flex inside one NVLink domain (the same exchange)
            moe.dispatcher = AllToAllDispatcher(E, ex.backend, ep, etp, tp_ep)
        moe.router.seq_axis = seq


def apply_cp(model: Transformer, cp: Axis) -> None:
    """Context parallelism: the model takes this rank's load-balanced sequence chunks and RoPE
    positions, attention runs the K/V ring over cp. Nothing is sharded: weights see partial
    gradients, summed over dp·cp by the dense family; MoE layers see the cp-sharded tokens as a
    flat batch (their aux loss already counts tokens over tp·cp)."""
    if cp.trivial:
        return
    model.cp = cp
    for m in model.modules():
        if isinstance(m, (Attention, MLAttention)):
            m.cp = cp


def parallelize(model: Transformer, groups: ParallelGroups, layout: Layout,
                choices: Choices | None = None) -> Transformer:
    """Shard `model` (already split to this rank's pipeline stages) in place for this rank of
    `layout`, then recompute / offload what `choices` name for its pipeline rank (stage sets
    are indexed by pp rank, shared by its virtual stages); the DP step is the optimizer's."""
    apply_tp(model, groups.tp)
    apply_ep(model, groups.ep, groups.etp, groups.tp_ep, groups.tp_cp, layout.dispatcher,
             groups.ep_domain, groups.ep_rail, groups.tp_ep_domain)
    apply_cp(model, groups.cp)
    if choices is not None:
        stage = groups.pp.rank
        apply_memory(model, choices.recompute_for_stage(stage), choices.offload_for_stage(stage))
    return model


# ----------------------------------------------------------------------- gathering shards back
def _gather_dim(t: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    if axis.trivial:
        return t
    return all_gather_dim0(t.movedim(dim, 0), axis).movedim(0, dim)  # rank order along `dim`


def gather_full(model: nn.Module, groups: ParallelGroups,
                tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full-size copies of per-parameter tensors (weights or gradients) from their shards.

    Collective over the layout's ranks; every rank returns the full tensors.
    """
    out = {}
    params = dict(model.named_parameters())
    for name, t in tensors.items():
        info = shard_info(params[name])
        if info.expert:
            if info.etp_dim is not None:
                t = _gather_dim(t, groups.etp, info.etp_dim)
            t = _gather_dim(t, groups.ep, 0)
        elif info.tp_dim is not None:
            t = _gather_dim(t, groups.tp, info.tp_dim)
        out[name] = t
    return out

