"""Communication: where each parallel group's ranks sit, and α–β times of its collectives.

Topology: a networkx graph with one node per GPU, one per NVLink switch domain, one for the
scale-out fabric; GPU–switch edges carry the NVLink bandwidth, GPU–fabric edges the per-GPU NIC
bandwidth. Ranks are placed in Megatron Core's order (`RankGenerator`, REFERENCE "Rank order"):
attention rank = tp + t·(cp + c·(dp + d·pp)), expert rank = etp + etp_size·(ep + e·(edp + …)).
A group whose ranks share one NVLink domain talks over NVLink, otherwise its traffic to other
domains crosses the scale-out NICs.

Collective times, ring algorithms (Thakur et al. 2005; NCCL's documented bus-bandwidth model):
all-gather / reduce-scatter of S bytes total over n ranks: (n−1)·α + (n−1)/n·S/B;
all-reduce: twice that; all-to-all where each rank holds S bytes for all peers: each rank sends
(n−1)/n·S, the share bound for other domains at scale-out bandwidth; point-to-point: α + S/B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..specs.cluster import ClusterSpec
from ..specs.layout import Layout
from .calibration import Calibration


@lru_cache(maxsize=16)
def _topology_key(world: int, gpus_per_node: int, domain: int) -> tuple[int, ...]:
    """Domain id of every rank, read off the networkx topology graph (cached per shape)."""
    import networkx as nx  # lazy: keeps `import moeplan` and the CLI start-up light

    g = nx.Graph()
    g.add_node("fabric", kind="scaleout")
    for r in range(world):
        dom = r // domain
        g.add_node(("gpu", r), kind="gpu", node=r // gpus_per_node, domain=dom)
        g.add_edge(("gpu", r), ("nvswitch", dom), link="nvlink")
        g.add_edge(("gpu", r), "fabric", link="scaleout")
    return tuple(next(n[1] for n in g.neighbors(("gpu", r)) if n != "fabric")
                 for r in range(world))


def _grid(layout: Layout, expert: bool) -> tuple[list[str], list[int]]:
    """Axis names and sizes, fastest-varying first, of the attention or expert grid."""
    L = layout
    if expert:
        edp = L.edp or 1
        names, sizes = ["tp", "cp", "ep", "dp", "pp"], [L.etp, 1, L.ep, edp, L.pp]
    else:
        names, sizes = ["tp", "cp", "ep", "dp", "pp"], [L.tp, L.cp, 1, L.dp, L.pp]
    if L.order == "tp-cp-ep-pp-dp":
        names[3], names[4], sizes[3], sizes[4] = names[4], names[3], sizes[4], sizes[3]
    return names, sizes


def group_ranks(layout: Layout, axis: str) -> np.ndarray:
    """All groups of one axis as rows of ranks, as Megatron Core builds them.

    axis ∈ tp, cp, dp, pp (attention grid) or etp, ep, edp (expert grid).
    """
    expert = axis in ("etp", "ep", "edp")
    name = {"etp": "tp", "edp": "dp"}.get(axis, axis)
    names, sizes = _grid(layout, expert)
    ranks = np.arange(int(np.prod(sizes))).reshape(sizes[::-1])  # C order: slowest first
    i = len(names) - 1 - names.index(name)
    return np.moveaxis(ranks, i, -1).reshape(-1, sizes[names.index(name)])


@dataclass(frozen=True)
class GroupPlacement:
    """How a group's ranks sit: size, members per NVLink domain, domains spanned."""

    size: int
    per_domain: int
    domains: int

    @property
    def inside_nvlink(self) -> bool:
        return self.domains == 1


class _Axes(NamedTuple):
    """The layout fields rank placement reads: hashable, so placements are cached."""

    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int
    order: str
    world_size: int


def placement(layout: Layout, axis: str, cluster: ClusterSpec) -> GroupPlacement:
    """The worst-placed group of an axis (the slowest group sets the step)."""
    L = layout
    world = L.world_size
    return _placement(_Axes(L.tp, L.cp, L.dp, L.pp, L.ep, L.etp, L.edp or 1, L.order, world),
                      axis, cluster.gpus_per_node, cluster.usable_domain(world))


@lru_cache(maxsize=8192)
def _placement(axes: _Axes, axis: str, gpus_per_node: int, domain: int) -> GroupPlacement:
    # a search asks for the same few thousand placements tens of thousands of times
    groups = group_ranks(axes, axis)  # type: ignore[arg-type]
    n = groups.shape[1]
    if n == 1:
        return GroupPlacement(1, 1, 1)
    dom = np.asarray(_topology_key(axes.world_size, gpus_per_node, domain))[groups]
    spans = [len(set(row.tolist())) for row in dom[: min(len(dom), 64)]]
    domains = max(spans)
    return GroupPlacement(n, max(1, n // domains), domains)


def ring_time(total_bytes: float, p: GroupPlacement, cluster: ClusterSpec, cal: Calibration
              ) -> float:
    """All-gather or reduce-scatter of `total_bytes` (the gathered size) over the group."""
    n = p.size
    if n <= 1 or total_bytes <= 0:
        return 0.0
    if p.inside_nvlink:
        bw, alpha = cluster.nvlink_gb_s * cal.nvlink_eff, cluster.nvlink_latency_us
    else:
        bw, alpha = cluster.scaleout_gb_s * cal.scaleout_eff, cluster.scaleout_latency_us
    return (n - 1) * alpha * 1e-6 + (n - 1) / n * total_bytes / (bw * 1e9)


def all_reduce_time(total_bytes: float, p: GroupPlacement, cluster: ClusterSpec,
                    cal: Calibration) -> float:
    """Ring all-reduce = reduce-scatter + all-gather."""
    return 2.0 * ring_time(total_bytes, p, cluster, cal)


def all_to_all_time(bytes_per_rank: float, p: GroupPlacement, cluster: ClusterSpec,
                    cal: Calibration) -> float:
    """All-to-all where each rank holds `bytes_per_rank` spread evenly over the group's ranks.

    Bytes for peers in the same NVLink domain go over NVLink, the rest over the NIC; both run
    at once, so the slower share sets the time (REFERENCE: measured EP64 dispatch on H100,
    7168-wide tokens, 4096 per rank, top-8 ≈ 9.2 ms with NCCL, which this reproduces).
    """
    n = p.size
    if n <= 1 or bytes_per_rank <= 0:
        return 0.0
    local = (p.per_domain - 1) / n * bytes_per_rank
    remote = (n - p.per_domain) / n * bytes_per_rank
    t_nv = local / (cluster.nvlink_gb_s * cal.a2a_nvlink_eff * 1e9)
    t_so = remote / (cluster.scaleout_gb_s * cal.a2a_scaleout_eff * 1e9) if remote else 0.0
    alpha = cluster.nvlink_latency_us if p.inside_nvlink else cluster.scaleout_latency_us
    return max(t_nv, t_so) + alpha * 1e-6 * (1 + math.log2(n))


def p2p_time(nbytes: float, cross_domain: bool, cluster: ClusterSpec, cal: Calibration) -> float:
    """Point-to-point send of `nbytes` (pipeline activations)."""
    if nbytes <= 0:
        return 0.0
    if cross_domain:
        return cluster.scaleout_latency_us * 1e-6 + nbytes / (
            cluster.scaleout_gb_s * cal.scaleout_eff * 1e9)
    return cluster.nvlink_latency_us * 1e-6 + nbytes / (cluster.nvlink_gb_s * cal.nvlink_eff * 1e9)


def host_copy_time(nbytes: float, cluster: ClusterSpec) -> float:
    """GPU↔host copy over PCIe or NVLink-C2C (offload), one direction."""
    return nbytes / (cluster.host_link_gb_s * 1e9)
