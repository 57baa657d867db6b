"""RankGrid: which global ranks form each parallel group, as a pure function of the sizes.

Megatron Core's Parallel Folding: the attention grid tp×cp×dp×pp and the expert grid
etp×ep×edp×pp cover the same ranks, each laid out in the plan's order (fastest-varying first).
This reproduces Megatron Core's `RankGenerator` and `generate_masked_orthogonal_rank_groups`
(megatron/core/parallel_state.py) so that a plan maps 1:1 onto a Megatron run: the attention
generator has ep = 1, the expert generator has tp → etp, cp = 1, dp → edp, same order string.
No processes here: the groups are tested against golden tables and the rank formula. The one
grid of the project: the cost models place groups on NVLink domains with it
(`cost_models.comm.placement`) and the runtime builds its process groups from it
(`runtime.groups.build_groups`), so a plan is priced on the links it runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import gcd
from typing import Any

import numpy as np

# Groups `moeplan groups` prints (SPEC §4) and the extra ones the runtime builds.
ATTENTION_AXES: dict[str, str] = {
    "tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "tp_cp": "tp-cp", "dp_cp": "dp-cp",
    "tp_cp_dp": "tp-cp-dp", "tp_pp": "tp-pp",
}
EXPERT_AXES: dict[str, str] = {
    "ep": "ep", "etp": "tp", "edp": "dp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp",
}
PRINTED_AXES = ("tp", "cp", "dp", "pp", "tp_cp", "ep", "etp", "edp")


def _prefix_product(a: list[int], init: int = 1) -> list[int]:
    out = [init]
    for v in a:
        init *= v
        out.append(init)
    return out


def _decompose(index: int, shape: list[int]) -> list[int]:
    stride = _prefix_product(shape)
    return [(index // d) % s for s, d in zip(shape, stride, strict=False)]


def masked_orthogonal_groups(world: int, sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Megatron's `generate_masked_orthogonal_rank_groups`: groups varying the masked axes.

    Rank = Σ index_i · stride_i over all axes (strides are prefix products of `sizes`); one group
    per setting of the unmasked axes, its ranks enumerated over the masked axes.
    """
    # rank = base(unmasked index) + offset(masked index): each part once, then every sum
    offsets, bases = group_parts(sizes, mask)
    return [list(map(base.__add__, offsets)) for base in bases]


def group_parts(sizes: list[int], mask: list[bool]) -> tuple[list[int], list[int]]:
    """(offsets, bases) of `masked_orthogonal_groups`: group g is bases[g] + each offset. What
    a question about every group's shape needs (where its ranks fall), without listing them."""
    (shape, strides), (other, other_strides) = _split(sizes, mask)
    return _mixed_radix(shape, strides), _mixed_radix(other, other_strides)


def group_parts_modulo(sizes: list[int], mask: list[bool], modulus: int
                       ) -> tuple[list[int], set[int]]:
    """(offsets, {base mod modulus}) of `group_parts`: where groups fall inside domains of
    `modulus` ranks depends only on which residues the bases leave, at most `modulus` of them,
    while the bases themselves are world / group size (131,072 at 131,072 ranks)."""
    (shape, strides), (other, other_strides) = _split(sizes, mask)
    return _mixed_radix(shape, strides), _residues(other, other_strides, modulus)


def _split(sizes: list[int], mask: list[bool]
           ) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """((sizes, strides) of the masked axes, the same of the others), each in axis order."""
    stride = _prefix_product(sizes)
    masked = [(s, d) for s, d, m in zip(sizes, stride, mask, strict=False) if m]
    unmasked = [(s, d) for s, d, m in zip(sizes, stride, mask, strict=False) if not m]
    return (([s for s, _ in masked], [d for _, d in masked]),
            ([s for s, _ in unmasked], [d for _, d in unmasked]))


def _residues(shape: list[int], strides: list[int], modulus: int) -> set[int]:
    """{Σ index_i · stride_i mod modulus} over every index of `shape`. An axis's steps
    i · stride repeat modulo `modulus` every modulus / gcd(stride, modulus) indices, so no
    more than that many are taken, and the set never holds more than `modulus` values."""
    out = {0}
    for size, stride in zip(shape, strides, strict=True):
        steps = {i * stride % modulus for i in range(min(size, modulus // gcd(stride, modulus)))}
        out = {(x + step) % modulus for x in out for step in steps}
    return out


def _mixed_radix(shape: list[int], strides: list[int]) -> list[int]:
    """Σ index_i · stride_i for every index of `shape`, the first axis fastest (= _decompose)."""
    out = [0]
    for size, stride in zip(shape, strides, strict=True):
        out = [x + i * stride for i in range(size) for x in out]
    return out


@dataclass(frozen=True)
class RankGenerator:
    """Megatron Core's RankGenerator: axis sizes plus an order string like 'tp-cp-ep-dp-pp'."""

    tp: int
    ep: int
    dp: int
    pp: int
    cp: int
    order: str

    @cached_property
    def _axes(self) -> tuple[list[str], list[int]]:
        sizes = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp}
        names = self.order.lower().split("-")
        for name, size in sizes.items():
            if name not in names:
                if size != 1:
                    raise ValueError(f"order {self.order!r} lacks {name} of size {size}")
                names.append(name)
        return names, [sizes[n] for n in names]

    @property
    def world_size(self) -> int:
        return self.tp * self.ep * self.dp * self.pp * self.cp

    def get_ranks(self, token: str) -> list[list[int]]:
        """Groups of the axes named in `token` (e.g. 'tp-cp'), in Megatron's enumeration order."""
        return masked_orthogonal_groups(self.world_size, *self._masked(token))

    def parts(self, token: str) -> tuple[list[int], list[int]]:
        """`group_parts` of `get_ranks(token)`: (offsets, bases)."""
        return group_parts(*self._masked(token))

    def parts_modulo(self, token: str, modulus: int) -> tuple[list[int], set[int]]:
        """`group_parts_modulo` of `get_ranks(token)`: (offsets, {base mod modulus})."""
        return group_parts_modulo(*self._masked(token), modulus)

    def _masked(self, token: str) -> tuple[list[int], list[bool]]:
        names, sizes = self._axes
        wanted = token.split("-")
        return sizes, [n in wanted for n in names]


@dataclass(frozen=True)
class RankGrid:
    """Both grids of one layout over `world` ranks; `groups(axis)` lists every group of an axis."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    order: str = "tp-cp-ep-dp-pp"

    def __post_init__(self) -> None:
        if self.world % (self.etp * self.ep * self.pp):
            raise ValueError(f"etp·ep·pp = {self.etp}·{self.ep}·{self.pp} does not divide the "
                             f"world of {self.world} ranks")

    @classmethod
    def from_layout(cls, layout: object) -> RankGrid:
        return cls(**{k: getattr(layout, k) for k in ("tp", "cp", "dp", "pp", "ep", "etp",
                                                       "order")})

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    @cached_property
    def attention(self) -> RankGenerator:
        return RankGenerator(self.tp, 1, self.dp, self.pp, self.cp, self.order)

    @cached_property
    def expert(self) -> RankGenerator:
        return RankGenerator(self.etp, self.ep, self.edp, self.pp, 1, self.order)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of `axis` (a key of ATTENTION_AXES or EXPERT_AXES)."""
        if axis in ATTENTION_AXES:
            return self.attention.get_ranks(ATTENTION_AXES[axis])
        if axis in EXPERT_AXES:
            return self.expert.get_ranks(EXPERT_AXES[axis])
        raise KeyError(f"unknown axis {axis!r}")

    def group_parts(self, axis: str) -> tuple[list[int], list[int]]:
        """(offsets, bases) of `groups(axis)`: group g is bases[g] + each offset."""
        if axis in ATTENTION_AXES:
            return self.attention.parts(ATTENTION_AXES[axis])
        if axis in EXPERT_AXES:
            return self.expert.parts(EXPERT_AXES[axis])
        raise KeyError(f"unknown axis {axis!r}")

    def group_parts_modulo(self, axis: str, modulus: int) -> tuple[list[int], set[int]]:
        """(offsets, {base mod modulus}) of `groups(axis)`."""
        if axis in ATTENTION_AXES:
            return self.attention.parts_modulo(ATTENTION_AXES[axis], modulus)
        if axis in EXPERT_AXES:
            return self.expert.parts_modulo(EXPERT_AXES[axis], modulus)
        raise KeyError(f"unknown axis {axis!r}")

    def all_groups(self, axes: tuple[str, ...] = PRINTED_AXES) -> dict[str, list[list[int]]]:
        return {a: self.groups(a) for a in axes}

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The group of `axis` that holds `rank`."""
        for g in self.groups(axis):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is outside the world of {self.world}")

    def coord(self, axis: str, rank: int) -> int:
        """`rank`'s index inside its `axis` group (its tp rank, ep rank, ...)."""
        return self.group_of(axis, rank).index(rank)


def domain_span(layout: object, axis: str, domain: int) -> tuple[int, int, int]:
    """(group size, ranks per NVLink domain, domains spanned) of the worst-placed group of
    `axis` when rank r sits in domain r // `domain`: the slowest group sets the step, and a
    launch sizes per-domain buffers (HybridEP's ranks per NVLink domain) by it."""
    L: Any = layout
    return span((L.tp, L.cp, L.dp, L.pp, L.ep, L.etp, L.order), axis, domain)


@lru_cache(maxsize=8192)
def span(sizes: tuple[int, int, int, int, int, int, str], axis: str, domain: int
         ) -> tuple[int, int, int]:
    """`domain_span` of the sizes (tp, cp, dp, pp, ep, etp, order)."""
    tp, cp, dp, pp, ep, etp, order = sizes
    offsets, firsts = RankGrid(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp,
                               order=order).group_parts_modulo(axis, domain)
    n = len(offsets)
    if n == 1:
        return 1, 1, 1
    # every group is its first rank (a base, offsets start at 0) + the offsets, so its span
    # depends only on that base modulo the domain; over the sorted offsets the domain index
    # (b + r) // domain never falls, so its distinct values are its steps up, plus one
    ranks = np.sort(np.asarray(offsets, dtype=np.int64))
    domains = max(1 + int(np.count_nonzero(np.diff((b + ranks) // domain))) for b in firsts)
    return n, max(1, n // domains), domains
