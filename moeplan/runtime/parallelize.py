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
from torch import nn

from ..specs import Choices, Layout
from .comm import SINGLE, Axis, all_gather_dim0
from .groups import ParallelGroups
from .layers import (
    MLP,
    Attention,
    Linear,
    MLAttention,
    shard_,
    shard_info,
    update_shard_info,
)
from .memory import apply_memory
from .model import Transformer
from .moe import AllGatherDispatcher, AllToAllDispatcher, FlexDispatcher, GroupedExperts


@dataclass(frozen=True)
class ExpertParallel:
    """What `apply_ep` needs: the expert groups, the dispatcher the layout names, and the tp-cp
    group sharing one micro-batch's tokens (the router's aux loss counts tokens over it)."""

    ep: Axis = SINGLE
    etp: Axis = SINGLE
    tp_ep: Axis = SINGLE  # the etp×ep group (etp fastest): token counts are exchanged over it
    seq: Axis = SINGLE
    dispatcher: str = "alltoall"
    # the flex dispatcher's split of the ep group by NVLink domain (ParallelGroups)
    ep_domain: Axis = SINGLE
    ep_rail: Axis = SINGLE
    tp_ep_domain: Axis = SINGLE

    @classmethod
    def of(cls, groups: ParallelGroups, dispatcher: str) -> ExpertParallel:
        return cls(groups.ep, groups.etp, groups.tp_ep, groups.tp_cp, dispatcher,
                   groups.ep_domain, groups.ep_rail, groups.tp_ep_domain)

# ---------------------------------------------------------------------------------- apply_*
def _column(lin: Linear, tp: Axis) -> None:
    for p in (lin.weight, lin.bias):
        if p is not None:
            shard_(p, 0, tp)
            update_shard_info(p, tp_dim=0)


def _row(lin: Linear, tp: Axis) -> None:
    shard_(lin.weight, 1, tp)
    update_shard_info(lin.weight, tp_dim=1)


def apply_tp(model: Transformer, tp: Axis) -> None:
    """Megatron TP with sequence parallelism: heads and FFN columns split over tp, vocab-parallel
    embedding and output. Everything else stays replicated (its gradients are summed over tp)."""
    if tp.trivial:
        return
    emb = model.embedding  # None on pipeline stages without embedding or loss head
    for p in (None if emb is None else emb.weight, model.output):
        if p is not None:
            shard_(p, 0, tp)
            update_shard_info(p, tp_dim=0)
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


def apply_ep(model: Transformer, xp: ExpertParallel) -> None:
    """Experts split over ep (dim 0) and their FFN over etp; each MoE layer gets the layout's
    dispatcher over its groups (flex across NVLink domains, the all-to-all one inside one); the
    router's aux loss counts tokens over `xp.seq`."""
    for moe in model.moe_layers():
        ex: GroupedExperts = moe.experts
        for name in ("w_gate", "w_up", "w_down"):
            p = getattr(ex, name)
            if p is None:
                continue
            etp_dim = 1 if name == "w_down" else 2
            shard_(p, 0, xp.ep)
            shard_(p, etp_dim, xp.etp)
            update_shard_info(p, expert=True, etp_dim=etp_dim)
        E = moe.router.E
        if xp.dispatcher == "allgather":
            moe.dispatcher = AllGatherDispatcher(E, ex.backend, xp.ep, xp.tp_ep)
        elif xp.dispatcher == "flex" and not xp.ep_rail.trivial:
            moe.dispatcher = FlexDispatcher(E, ex.backend, xp.ep_domain, xp.ep_rail, xp.etp,
                                            xp.tp_ep_domain)
        else:  # alltoall, or flex inside one NVLink domain (the same exchange)
            moe.dispatcher = AllToAllDispatcher(E, ex.backend, xp.ep, xp.etp, xp.tp_ep)
        moe.router.seq_axis = xp.seq


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
    apply_ep(model, ExpertParallel.of(groups, layout.dispatcher))
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

