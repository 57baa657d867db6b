"""Enumerate every folded layout as rows of a numpy array, pruning by named rules.

A search over DeepSeek-V3 on 1,024 GPUs meets ~10⁶ axis combinations; building a pydantic Layout
for each costs seconds, so candidates stay integer rows until they survive the bounds. Each rule
that removes a branch is counted by name: the explanation of a search reports these counts.

The validity rules are the target executor's, read from the one table (`moeplan.specs.rules`):
each is evaluated at the first loop level where the axes it reads are bound (`LEVELS`). The
planner's own placement rules (NVLink domains, the space's limits, vpp values that split the
layers) are named here; `tests/test_planner_enumerate.py` checks that every surviving row is a
valid Layout and that no valid layout is lost except by a named placement rule.

So are the settings that change nothing at a row's sizes (`SAME_JOB`): rows differing only in
one of them are one job priced twice, which would fill the top k with copies and rank them by a
tie of equal numbers. One canonical row stands for them, the first the space lists that the
rules keep (alltoall; the distributed optimizer where the stack shards it,
`rules.shards_optimizer`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..specs import ClusterSpec, ModelSpec, TrainingSpec
from ..specs.rules import STACK_RULES, Facts, layout_rules

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
    allow_dist_opt: bool = True  # False on a software stack that predates it
    max_pp: int | None = None
    max_cp: int | None = None
    max_tp: int | None = None
    # stack settings the search turns on where the target runs them: TP comm overlap wherever
    # tp > 1 (it only removes exposed time: same memory), CUDA graphs on the top plans where
    # their memory fits (screen.with_graphs)
    tp_comm_overlap: bool = True
    cuda_graphs: bool = True
    # the flex dispatcher's library: HybridEP, never slower, where the software stack has it
    flex_backend: str = "hybridep"


@dataclass
class Enumeration:
    """Candidate rows (int64 array, columns COLUMNS) and per-rule prune counts."""

    rows: np.ndarray
    precisions: tuple[str, ...]
    pruned: Counter[str] = field(default_factory=Counter)
    flex_backend: str = "hybridep"  # the flex dispatcher's library in the rows (SearchSpace)

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
    flex_backend = "hybridep"  # SearchSpace.flex_backend
    ep_overlap = tp_comm_overlap = cuda_graphs = False
    distributed_optimizer = True


SAME_JOB = {
    "dispatcher_without_ep": "the same job under another dispatcher (with ep 1 none sends a "
                             "token to another expert rank)",
    "dist_opt_without_dp": "the same job with the distributed optimizer flipped (one "
                           "data-parallel rank, dp·cp 1 and edp 1: nothing to shard)",
}
"""The prune counts of rows that repeat a kept row's job (module docstring), in words."""


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
    walk = _Walk(model, cluster, training, world, space, target)
    walk.attention()
    # from a flat iterator: twice as fast as np.array over a list of tuples
    arr = np.fromiter(itertools.chain.from_iterable(walk.rows), dtype=np.int64,
                      count=len(walk.rows) * len(COLUMNS)).reshape(-1, len(COLUMNS))
    return Enumeration(arr, space.precisions, walk.pruned, space.flex_backend)


class _Walk:
    """One enumeration: nested loops binding the axes level by level (LEVELS), each level's
    rules checked once its axes are bound, the valid rows and the prune counts collected. The
    attention axes and the expert axes are two methods, the second run inside the first."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                 world: int, space: SearchSpace, target: str) -> None:
        self.model, self.training, self.world, self.space = model, training, world, space
        self.pruned: Counter[str] = Counter()
        self.rows: list[tuple[int, ...]] = []
        self.ax = _Axes()
        self.ax.flex_backend = space.flex_backend
        self.facts = Facts(model, training, self.ax, None, cluster, world)
        # today's stack has every feature its rules date: they cannot fail, so are not asked
        current = training.software_stack == "current"
        self.levels = [[r for r in rules if not (current and r.name in STACK_RULES)]
                       for rules in layout_rules(target, LEVELS)]
        # levels without a rule cost nothing: their check is skipped, not called
        self.has = [bool(rules) for rules in self.levels]
        self.nvl = cluster.nvlink_domain_gpus
        experts, moe_ffn = model.num_experts, model.moe_ffn_hidden_size or 0
        self.expert_axes = list(itertools.product(
            divisors(experts) if experts else [1],
            [d for d in divisors(moe_ffn) if d <= self.nvl] if experts else [1]))
        self.dispatchers = space.dispatchers if experts else ("alltoall",)
        self.overlaps = (0, 1) if (experts and space.allow_ep_overlap) else (0,)
        self.domain = cluster.usable_domain(world)

    def broken(self, level: int) -> bool:
        """Whether a rule of the level fails (counted under its name); callers skip the call
        where the level has no rule (`has`)."""
        for r in self.levels[level]:
            if not r.ok(self.facts):
                self.pruned[r.name] += 1
                return True
        return False

    def over(self, limit: int, value: int, name: str) -> bool:
        """Whether the search space's limit on an axis (0: none) excludes the value."""
        if limit and value > limit:
            self.pruned[name] += 1
            return True
        return False

    def attention(self) -> None:
        """tp, cp, pp (and so dp), mbs (and so the micro-batch count) and vpp."""
        ax, sp, world, broken, has = self.ax, self.space, self.world, self.broken, self.has
        for tp in divisors(world):
            ax.tp = tp
            if self.over(sp.max_tp, tp, "target_max_tp") or (has[0] and broken(0)):
                continue
            for cp in divisors(world // tp):
                ax.cp = cp
                if self.over(sp.max_cp, cp, "target_max_cp") or (has[1] and broken(1)):
                    continue
                if tp * cp > self.nvl:
                    self.pruned["tp_cp_within_nvlink"] += 1
                    continue
                for pp in divisors(world // (tp * cp)):
                    ax.pp, ax.dp = pp, world // (tp * cp * pp)
                    if self.over(sp.max_pp, pp, "target_max_pp") or (has[2] and broken(2)):
                        continue
                    for mbs in (m for m in (1, 2, 4, 8, 16) if m <= sp.max_mbs):
                        ax.mbs = mbs
                        ax.num_microbatches = max(1, self.training.global_batch_size
                                                  // (mbs * ax.dp))
                        if has[3] and broken(3):
                            continue
                        for vpp in _vpp_options(self.model, pp, sp):
                            ax.vpp = vpp
                            if not (has[4] and broken(4)):
                                self.experts()

    def experts(self) -> None:
        """ep, etp (and so edp), the dispatcher, EP overlap, the distributed optimizer and the
        precision, under the attention axes bound so far (the innermost loops: locals, and a
        level's check only where it has rules)."""
        ax, sp, world, broken, has = self.ax, self.space, self.world, self.broken, self.has
        head = (ax.tp, ax.cp, ax.dp, ax.pp, ax.vpp)
        tail = (ax.mbs, ax.num_microbatches)
        dopts = tuple(d for d, allowed in ((1, sp.allow_dist_opt), (0, sp.allow_no_dist_opt))
                      if allowed)
        precisions = range(len(sp.precisions))
        rows, moe = self.rows, self.model.is_moe
        one_dp = ax.dp * ax.cp == 1
        for ep, etp in self.expert_axes:
            ax.ep, ax.etp = ep, etp
            n = etp * ep * ax.pp
            edp = ax.edp = world // n if world % n == 0 else 0
            if has[5] and broken(5):
                continue
            # SAME_JOB: the first dispatcher (and optimizer) kept stands for the others
            one_disp, one_opt = ep == 1, one_dp and (edp == 1 or not moe)
            disp_kept = False
            for disp in self.dispatchers:
                if one_disp and disp_kept:
                    self.pruned["dispatcher_without_ep"] += 1
                    continue
                # etp and ep are adjacent in both rank orders: an ep group spanning etp·ep
                # ranks that divides the domain stays inside it, where flex is the all-to-all
                # exchange (the same plan twice)
                if disp == "flex" and self.domain % (etp * ep) == 0:
                    self.pruned["flex_inside_nvlink"] += 1
                    continue
                ax.dispatcher = disp
                if has[6] and broken(6):
                    continue
                d = DISPATCHERS.index(disp)
                for ovl in self.overlaps:
                    ax.ep_overlap = bool(ovl)
                    if has[7] and broken(7):
                        continue
                    opt_kept = False
                    for dopt in dopts:
                        if one_opt and opt_kept:
                            self.pruned["dist_opt_without_dp"] += 1
                            continue
                        ax.distributed_optimizer = bool(dopt)
                        if has[8] and broken(8):
                            continue
                        opt_kept = disp_kept = True
                        for pi in precisions:
                            rows.append((*head, ep, etp, edp, *tail, d, ovl, dopt, pi))
                    ax.distributed_optimizer = True
                ax.ep_overlap = False
