"""This rank's process groups for a layout, built once from the RankGrid and passed down frozen.

`build_groups` turns `specs.grid.RankGrid` (the pure rank layout, Megatron Core's order, the one
the cost models price) into torch.distributed groups; `ParallelGroups` is the bundle every
`apply_*` step (parallelize.py), the optimizer and the pipeline read their groups from. Nothing
here decides sharding.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..specs.grid import RankGrid
from .comm import SINGLE, Axis

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


def build_groups(grid: RankGrid, offset: int = 0, domain: int | None = None,
                 timeout: timedelta | None = None) -> ParallelGroups | None:
    """Create the torch.distributed groups of `grid` placed on global ranks offset..offset+world.

    Collective over the default process group: every process calls it with the same arguments
    (even those outside the grid, which get None), so several layouts can be carved out of one
    spawned world. Size-1 groups are not created. With `domain` (GPUs per NVLink domain the job
    uses, `ClusterSpec.usable_domain`), the ep groups are also split by domain for the flex
    dispatcher. `timeout`: how long the groups' collectives wait for a peer (a new group
    does not inherit the default group's; None: torch's default, 30 minutes on gloo).
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
            pg = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                found[axis] = Axis(pg, len(ranks), ranks.index(me), tuple(ranks))
    links = []
    if grid.pp > 1:
        for pp_ranks in grid.groups("pp"):
            ranks = [pp_ranks[0] + offset, pp_ranks[-1] + offset]
            pg = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                found["embd"] = Axis(pg, 2, ranks.index(me), tuple(ranks))
            # each link carries one kind of message one way, in one order on both ends, so
            # a send never queues behind a receive on the same communicator (NCCL)
            for kind, step in ((0, 1), (1, -1)):
                for i, src in enumerate(pp_ranks):
                    dst = pp_ranks[(i + step) % grid.pp]
                    pg = dist.new_group(sorted({src + offset, dst + offset}), timeout=timeout)
                    if me - offset in (src, dst):
                        links.append((kind, i, pg))
    if not offset <= me < offset + grid.world:
        return None
    return ParallelGroups(**found, pp_links=tuple(links))


def local_groups() -> ParallelGroups:
    """The bundle of a single-process run: every axis trivial."""
    return ParallelGroups()
