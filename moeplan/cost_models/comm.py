"""Communication: where each parallel group's ranks sit, and α–β times of its collectives.

Topology: GPUs in NVLink switch domains of `ClusterSpec.usable_domain` GPUs (rank r sits in
domain r // domain), every GPU also on the scale-out fabric with its per-GPU NIC bandwidth.
Ranks form groups as Megatron Core builds them (`specs.grid.RankGrid`, the grid the runtime
builds its process groups from; REFERENCE "Rank order"):
attention rank = tp + t·(cp + c·(dp + d·pp)), expert rank = etp + etp_size·(ep + e·(edp + …)).
A group whose ranks share one NVLink domain talks over NVLink, otherwise its traffic to other
domains crosses the scale-out NICs.

Collective times, ring algorithms (Thakur et al. 2005; NCCL's documented bus-bandwidth model):
all-gather / reduce-scatter of S bytes total over n ranks: (n−1)·α + (n−1)/n·S/B, a group
spanning NVLink domains with k ranks in each crossing them through k NICs at once (`ring_time`);
all-reduce: twice that; all-to-all where each rank holds S bytes for all peers: each rank sends
(n−1)/n·S, the share bound for other domains at scale-out bandwidth; point-to-point: α + S/B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..specs.cluster import ClusterSpec
from ..specs.grid import RankGrid, span
from ..specs.layout import Layout
from .calibration import Calibration


def group_ranks(layout: Layout, axis: str) -> list[list[int]]:
    """All groups of one axis as lists of ranks, as Megatron Core builds them (the RankGrid's).

    axis ∈ tp, cp, dp, pp (attention grid) or etp, ep, edp (expert grid).
    """
    return RankGrid.from_layout(layout).groups(axis)


@dataclass(frozen=True)
class GroupPlacement:
    """How a group's ranks sit: size, members per NVLink domain, domains spanned."""

    size: int
    per_domain: int
    domains: int

    @property
    def inside_nvlink(self) -> bool:
        return self.domains == 1


def placement(layout: Layout, axis: str, cluster: ClusterSpec) -> GroupPlacement:
    """The worst-placed group of an axis (the slowest group sets the step)."""
    L = layout
    return _placement((L.tp, L.cp, L.dp, L.pp, L.ep, L.etp, L.order), axis,
                      cluster.usable_domain(L.world_size))


@lru_cache(maxsize=8192)
def _placement(sizes: tuple[int, int, int, int, int, int, str], axis: str, domain: int
               ) -> GroupPlacement:
    # a search asks for the same few thousand placements tens of thousands of times
    return GroupPlacement(*span(sizes, axis, domain))


def ring_time(total_bytes: float, p: GroupPlacement, cluster: ClusterSpec, cal: Calibration
              ) -> float:
    """All-gather or reduce-scatter of `total_bytes` (the gathered size) over the group.

    Each rank moves (n−1)/n·S. Inside one NVLink domain all of it goes over NVLink. A group
    spanning domains with k members in each runs k rings at once (NCCL's channels), each
    carrying S/k, each crossing every domain boundary once through a different member's NIC:
    a rank sends its share of one ring over its NIC, (n−1)/n·S/k, and the other k − 1 shares
    over NVLink, and both links run at once. So k members of a domain reduce over k NICs
    (NCCL's multi-node bus bandwidth: the node's NICs together, not one GPU's); a group with one
    member per domain (k = 1) sends everything over its one NIC.
    """
    n = p.size
    if n <= 1 or total_bytes <= 0:
        return 0.0
    share = (n - 1) / n * total_bytes
    nv = cluster.nvlink_gb_s * cal.nvlink_eff * 1e9
    if p.inside_nvlink:
        return (n - 1) * cluster.nvlink_latency_us * 1e-6 + share / nv
    k = max(1, p.per_domain)
    so = cluster.scaleout_gb_s * cal.scaleout_eff * 1e9
    return (n - 1) * cluster.scaleout_latency_us * 1e-6 + max(share / k / so,
                                                              share * (k - 1) / k / nv)


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


DEEPEP_MNNVL_GB_S = (400.0, 190.0)
"""(dispatch, combine) algorithm bandwidth per GPU of DeepEP inside a multi-node NVLink domain
(its ranks on more than one node of an NVL72): EP32 on GB200 with 24 SMs through the community
support of DeepEP PR 218, "a large gap from the unidirectional bandwidth of 900 GB/s" (NVIDIA,
Megatron-LM docs/discussions/deepseek-v3-gb200-optimization, §2.2.1; Megatron Core: "only
hybridep supports the MNNVL case"). DeepEP's own tests count the bytes each rank receives: one
copy per token and destination rank (`ranks_hit`)."""


@lru_cache(maxsize=4096)
def ranks_hit(num_experts: int, top_k: int, ep: int, groups: int | None = None,
              groups_per_token: int | None = None) -> float:
    """Expected number of EP ranks (or NVLink domains: pass their count as `ep`) one token's
    top-k experts fall on: k distinct experts drawn evenly from those its routing allows
    (group-limited routing: `groups_per_token` of `groups` equal expert groups, chosen evenly),
    each rank holding num_experts / ep contiguous experts. DeepEP and HybridEP send a token once
    per destination rank, and once per remote domain over the scale-out NICs, however many of
    its experts that rank or domain holds.

    A rank holds either part of one group or several whole groups (DeepSeek-V3's 8 groups of 32
    experts: EP 32 over four 8-GPU nodes puts two groups in each node), so the number of the
    token's groups on one rank is hypergeometric, and the rank is hit unless none of the k
    experts lands among its allowed experts."""
    if ep <= 1:
        return 1.0
    per_rank = max(1, num_experts // ep)
    if not (groups and groups_per_token and groups_per_token < groups):
        groups, groups_per_token = 1, 1
    size = num_experts // groups
    pool = groups_per_token * size                   # the experts this token may choose
    if per_rank <= size:                             # a rank holds part of one group
        spread = ((1, groups_per_token / groups),)  # (groups on the rank, probability)
        held = per_rank
    else:                                            # a rank holds several whole groups
        g = per_rank // size
        spread = tuple((j, math.comb(g, j) * math.comb(groups - g, groups_per_token - j)
                        / math.comb(groups, groups_per_token))
                       for j in range(1, min(g, groups_per_token) + 1))
        held = size
    none = math.comb(pool, top_k)
    hit = sum(pr * (1.0 - math.comb(pool - j * held, top_k) / none) for j, pr in spread)
    return min(ep, num_experts / per_rank) * hit


def multi_node_nvlink(p: GroupPlacement, cluster: ClusterSpec) -> bool:
    """Whether a group's ranks inside one NVLink domain sit on more than one node (the trays
    of an NVL72): the multi-node NVLink case, which DeepEP's intranode kernels do not cover."""
    return cluster.nvlink_domain_gpus > cluster.gpus_per_node and p.per_domain > cluster.gpus_per_node


def deepep_mnnvl_times(token_bytes: float, hits: float, p: GroupPlacement,
                       cluster: ClusterSpec) -> tuple[float, float]:
    """(dispatch, combine) seconds of DeepEP over the part of an EP group inside one multi-node
    NVLink domain, at its measured algorithm bandwidth (`DEEPEP_MNNVL_GB_S`): `hits` copies of
    a rank's `token_bytes`, the domain's share of them."""
    share = hits * token_bytes * p.per_domain / p.size
    alpha = cluster.nvlink_latency_us * 1e-6 * (1 + math.log2(max(2, p.per_domain)))
    return tuple(share / (bw * 1e9) + alpha for bw in DEEPEP_MNNVL_GB_S)  # type: ignore[return-value]


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
