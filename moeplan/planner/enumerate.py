"""Enumerate every folded layout as rows of a numpy array, pruning by named rules.

A search over DeepSeek-V3 on 1,024 GPUs meets ~10⁶ axis combinations; building a pydantic Layout
for each costs seconds, so candidates stay integer rows until they survive the bounds. Each rule
that removes a branch is counted by name: the explanation of a search reports these counts.

The validity rules are the target executor's, read from the one table (`moeplan.specs.rules`):
each is evaluated at the first loop level where the axes it reads are bound (`LEVELS`). The
planner's own placement rules (NVLink domains, the space's limits, vpp values that split the
layers) are named here; `tests/test_planner_enumerate.py` checks that every surviving row is a
valid Layout and that no valid layout is lost except by a named placement rule.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..specs import ClusterSpec, ModelSpec, TrainingSpec
from ..specs.rules import Facts, layout_rules

DISPATCHERS = ("alltoall", "allgather", "flex")
# Columns of a candidate row, in order.
COLUMNS = ("tp", "cp", "dp", "pp", "vpp", "ep", "etp", "edp", "mbs", "nmb", "dispatcher",
           "ep_overlap", "dist_opt", "precision")
COL = {name: i for i, name in enumerate(COLUMNS)}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    """Which values each axis may take; `target` restricts to what a backend can execute."""

    precisions: tuple[str, ...]
    dispatchers: tuple[str, ...] = DISPATCHERS
    max_mbs: int = 4
    max_vpp: int = 8
    allow_ep_overlap: bool = True
    allow_no_dist_opt: bool = True
    max_pp: int | None = None
    max_cp: int | None = None
    max_tp: int | None = None
    # stack settings the search turns on where the target runs them: TP comm overlap wherever
    # tp > 1 (it only removes exposed time: same memory), CUDA graphs on the top plans where
    # their memory fits (screen.with_graphs)
    tp_comm_overlap: bool = True
    cuda_graphs: bool = True


@dataclass
class Enumeration:
    """Candidate rows (int64 array, columns COLUMNS) and per-rule prune counts."""

    rows: np.ndarray
    precisions: tuple[str, ...]
    pruned: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return len(self.rows) + sum(self.pruned.values())


def _vpp_options(model: ModelSpec, pp: int, space: SearchSpace) -> list[int]:
    """vpp values that split the layers evenly over pp·vpp, or evenly once the embedding, loss
    and MTP layers are counted as layers (Megatron's uneven --pipeline-model-parallel-layout)."""
    if pp == 1:
        return [1]
    L, extra = model.num_layers, 2 + model.mtp_layers
    out = []
    for v in range(1, space.max_vpp + 1):
        stages = pp * v
        if stages > L:
            break
        if L % stages == 0 or (L + extra) % stages == 0 or v == 1:
            out.append(v)
    return out


class _Axes:
    """The enumeration's partly bound layout: the fields the rules read (`rules.Facts.layout`),
    set one loop level at a time."""

    tp = cp = dp = pp = vpp = ep = etp = edp = mbs = num_microbatches = 1
    dispatcher = "alltoall"
    ep_overlap = tp_comm_overlap = cuda_graphs = False
    distributed_optimizer = True


LEVELS = ("tp", "cp", "pp/dp", "mbs/num_microbatches", "vpp", "ep/etp/edp", "dispatcher",
          "ep_overlap", "distributed_optimizer")
"""The order the loops bind the axes in: a rule of the table is evaluated at the first level
where every axis it reads is bound."""


def enumerate_layouts(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, world: int,
    space: SearchSpace, target: str = "megatron",
) -> Enumeration:
    """All valid (tp, cp, dp, pp, vpp, ep, etp, edp, mbs, nmb, dispatcher, ep_overlap, dist_opt,
    precision) rows, with prune counts per rule name: the target's rules (`specs.rules`) plus
    the planner's placement rules (NVLink domains, the space's limits)."""
    pruned: Counter[str] = Counter()
    rows: list[tuple[int, ...]] = []
    ax = _Axes()
    facts = Facts(model, training, ax, None, cluster, world)
    levels = layout_rules(target, LEVELS)

    def broken(level: int) -> bool:
        for r in levels[level]:
            if not r.ok(facts):
                pruned[r.name] += 1
                return True
        return False

    # levels without a rule cost nothing: their check is skipped, not called
    has = [bool(rules) for rules in levels]

    nvl = cluster.nvlink_domain_gpus
    experts = model.num_experts
    moe_ffn = model.moe_ffn_hidden_size or 0
    ep_opts = divisors(experts) if experts else [1]
    etp_opts = [d for d in divisors(moe_ffn) if d <= nvl] if experts else [1]
    dispatchers = space.dispatchers if experts else ("alltoall",)
    domain = cluster.usable_domain(world)
    for tp in divisors(world):
        if space.max_tp and tp > space.max_tp:
            pruned["target_max_tp"] += 1
            continue
        ax.tp = tp
        if has[0] and broken(0):
            continue
        for cp in divisors(world // tp):
            if space.max_cp and cp > space.max_cp:
                pruned["target_max_cp"] += 1
                continue
            ax.cp = cp
            if has[1] and broken(1):
                continue
            if tp * cp > nvl:
                pruned["tp_cp_within_nvlink"] += 1
                continue
            for pp in divisors(world // (tp * cp)):
                if space.max_pp and pp > space.max_pp:
                    pruned["target_max_pp"] += 1
                    continue
                ax.pp, ax.dp = pp, world // (tp * cp * pp)
                if has[2] and broken(2):
                    continue
                dp = ax.dp
                for mbs in (m for m in (1, 2, 4, 8, 16) if m <= space.max_mbs):
                    ax.mbs = mbs
                    ax.num_microbatches = max(1, training.global_batch_size // (mbs * dp))
                    if has[3] and broken(3):
                        continue
                    nmb = ax.num_microbatches
                    for vpp in _vpp_options(model, pp, space):
                        ax.vpp = vpp
                        if has[4] and broken(4):
                            continue
                        for ep, etp in itertools.product(ep_opts, etp_opts):
                            ax.ep, ax.etp = ep, etp
                            n = etp * ep * pp
                            ax.edp = world // n if world % n == 0 else 0
                            if has[5] and broken(5):
                                continue
                            edp = ax.edp
                            for disp in dispatchers:
                                # etp and ep are adjacent in both rank orders: an ep group
                                # spanning etp·ep ranks that divides the domain stays inside
                                # it, where flex is the all-to-all exchange (same plan twice)
                                if disp == "flex" and domain % (etp * ep) == 0:
                                    pruned["flex_inside_nvlink"] += 1
                                    continue
                                ax.dispatcher = disp
                                if has[6] and broken(6):
                                    continue
                                for ovl in (0, 1) if (experts and space.allow_ep_overlap) else (0,):
                                    ax.ep_overlap = bool(ovl)
                                    if has[7] and broken(7):
                                        continue
                                    for dopt in (1, 0) if space.allow_no_dist_opt else (1,):
                                        ax.distributed_optimizer = bool(dopt)
                                        if has[8] and broken(8):
                                            continue
                                        for pi in range(len(space.precisions)):
                                            rows.append((tp, cp, dp, pp, vpp, ep, etp, edp, mbs,
                                                         nmb, DISPATCHERS.index(disp), ovl, dopt,
                                                         pi))
                                    ax.distributed_optimizer = True
                                ax.ep_overlap = False
    arr = np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))
    return Enumeration(arr, space.precisions, pruned)
