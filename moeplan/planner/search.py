"""`moeplan search`: every folded layout, pruned by rules and bounds, a MILP for the best.

The public entry point and what searches share: `search` sets one search up (the space its
target runs, the enumeration, the row bounds) and runs the branch and bound of
`planner.branch` under the objective of `planner.objective`; `SearchCache` carries layer
tables and module sets across the searches of one what-if sweep; `SearchResult` is what
`moeplan search --json` prints.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..cost_models.calibration import calibration_for
from ..cost_models.memory import GB
from ..cost_models.uncertainty import static_activation_budget_bytes
from ..errors import InfeasibleError, SpecError
from ..limits import check_imbalance
from ..specs import ClusterSpec, ModelSpec, Plan, TrainingSpec
from ..specs.layout import check_layout
from ..specs.rules import (
    STACK_FEATURES,
    TARGETS,
    Facts,
    check_target,
    rules_for,
    runs_cuda,
    shards_optimizer,
    stack_lacks,
)
from .branch import BranchAndBound, row_bounds
from .enumerate import SearchSpace, enumerate_layouts
from .explain import explain_plans, no_valid_layout, nothing_fits
from .objective import OBJECTIVES, objective_for
from .problem import OPTIONS, LayerTable, Option
from .screen import Problem

__all__ = ["AUTO_PRECISION", "OBJECTIVES", "SearchCache", "SearchResult", "default_gbs",
           "search", "search_space"]

AUTO_PRECISION = {"ampere": ("bf16",), "hopper": ("bf16", "fp8-tensorwise"),
                  "blackwell": ("bf16", "mxfp8")}


def default_gbs(seq: int, tokens: int = 4 * 1024 * 1024) -> int:
    """About `tokens` per step, as a power of two sequences (so many layouts divide it)."""
    return 1 << max(0, round(math.log2(max(1.0, tokens / seq))))


@dataclass
class SearchResult:
    plans: list[Plan]
    layouts: int  # candidate layouts enumerated after the validity rules
    feasible: int  # layouts whose MILP found a plan that fits
    solved: int  # MILPs solved (HiGHS)
    seconds: float
    pruned: Counter[str] = field(default_factory=Counter)
    stopped_early: bool = False
    screened: int = 0  # rank-separable problems solved with even stages (per layout and fraction)
    objective: str = "robust"
    best_validated: Plan | None = None  # the best plan priced that rests on validated terms only

    def to_json(self) -> dict[str, Any]:
        """The `moeplan search --json` document (SPEC §4)."""
        return {
            "plans": [p.model_dump(mode="json") for p in self.plans],
            "searched": {"layouts": self.layouts, "feasible": self.feasible,
                         "seconds": round(self.seconds, 3), "milps_solved": self.solved,
                         "screened": self.screened,
                         "pruned": dict(sorted(self.pruned.items())),
                         "stopped_early": self.stopped_early},
            "objective": self.objective,
            "best_validated": (self.best_validated.model_dump(mode="json")
                               if self.best_validated is not None else None),
        }


@dataclass
class SearchCache:
    """Work that searches of the same model can share (a what-if sweep over GPU counts).

    Layer-cost tables and the module sets built from them depend on the model, the cluster's
    hardware, the sequence length, the precision and the layout key (tp, cp, ep, etp, mbs,
    dispatcher, overlap, and whether a tied output layer shares the first stage), plus where the
    tp/cp/ep/etp groups sit (inside one NVLink domain or not), but not on the GPU count or the
    batch: entries are keyed by exactly those, so a hit is the table the search would build.
    """

    tables: dict[tuple, LayerTable] = field(default_factory=dict)
    sets: dict[tuple, Any] = field(default_factory=dict)
    twins: dict[tuple, dict] = field(default_factory=dict)  # problem.layer_table's `shared`
    sigs: dict[str, int] = field(default_factory=dict)

    def signature(self, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                  imbalance: float) -> int:
        """A small id for everything outside the layout key that layer costs depend on."""
        text = "\n".join((model.model_dump_json(),
                          cluster.model_copy(update={"num_gpus": None}).model_dump_json(),
                          training.model_dump_json(exclude={"global_batch_size"}),
                          repr(imbalance)))
        return self.sigs.setdefault(text, len(self.sigs))


def refuse_specs(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                 target: str) -> None:
    """Exit 2 before any enumeration when the target refuses the model or the training itself
    (a rule that reads no layout axis, e.g. a model feature `moeplan run` does not build): no
    layout could keep it, so this is the spec's error with its fix, not an infeasible search
    (exit 3) offering GPU counts that would fail the same way."""
    facts = Facts(model, training, None, None, cluster)
    broken = [r.why(facts) for r in rules_for(target)
              if not r.axes and not r.needs - {"cluster"} and r.applies(facts, target)
              and not r.ok(facts)]
    if broken:
        other = (" Search with --target megatron to plan it for Megatron-LM."
                 if target == "moeplan" else "")
        raise SpecError(f"the {target} target cannot run this model and training, whatever "
                        f"the layout: {'; '.join(broken)}.{other}")


def search_space(cluster: ClusterSpec, precision: str, target: str,
                 stack: str = "current") -> SearchSpace:
    """The axes a target can run: `megatron` is everything Megatron Core runs, as far as the
    software stack the plans are priced on has it (`rules.STACK_FEATURES`: an older stack's
    flex dispatcher is DeepEP, and it may lack TP comm overlap, CUDA graphs or the distributed
    optimizer); `moeplan` is
    what `moeplan run` executes (no TP comm overlap or CUDA graphs; the rest is the rules
    table's). A CPU host runs neither CUDA setting, whatever the target (`rules.runs_cuda`)."""
    if target not in TARGETS:
        raise SpecError(f"--target takes {' or '.join(TARGETS)}, got {target!r}.")
    check_target(target)
    if precision == "auto":
        precisions = tuple(p for p in AUTO_PRECISION.get(cluster.architecture, ("bf16",))
                           if p not in STACK_FEATURES or not stack_lacks(stack, p))
    else:
        if not cluster.supports(precision):
            raise SpecError(f"--precision {precision}: {cluster.gpu} ({cluster.architecture}) "
                            "cannot run it; use bf16, auto, or an FP8 recipe the GPU has.")
        precisions = (precision,)
    megatron, cuda = target == "megatron", runs_cuda(cluster)
    return SearchSpace(
        precisions=precisions,
        allow_dist_opt=shards_optimizer(stack, target),
        tp_comm_overlap=megatron and cuda and not stack_lacks(stack, "tp_comm_overlap"),
        cuda_graphs=megatron and cuda and not stack_lacks(stack, "cuda_graphs"),
        flex_backend="deepep" if megatron and stack_lacks(stack, "hybridep") else "hybridep")


def search(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    gpus: int | None = None,
    *,
    top_k: int = 5,
    precision: str | None = None,
    target: str = "megatron",
    time_limit_s: float | None = None,
    imbalance: float = 1.0,
    progress: Callable[[int, int], None] | None = None,
    space: SearchSpace | None = None,
    options: tuple[Option, ...] | None = None,
    cache: SearchCache | None = None,
    objective: str = "robust",
    grad_reduce_flag: bool = True,
) -> SearchResult:
    """The top-k plans for a model on a cluster, best first (SPEC §4 `moeplan search`), each
    one its target executor runs as priced.

    `objective`: "robust" (default) ranks by the high end of the step time's 80 % interval,
    "expected" by the point (`planner.objective`). Raises InfeasibleError (exit 3) with the
    closest candidate when nothing fits, and what would make it fit (`explain.nothing_fits`;
    `grad_reduce_flag` False for a caller that offers no --grad-reduce, whose user could not
    act on that suggestion). `cache` lets searches of one sweep share layer tables and module
    sets (`SearchCache`).
    """
    rank = objective_for(objective)
    check_imbalance(imbalance)
    start = time.perf_counter()
    world = gpus or cluster.num_gpus
    if not world:
        raise SpecError("search needs a GPU count: pass --gpus N or set num_gpus in the cluster.")
    cluster = cluster.with_gpus(world)
    refuse_specs(model, cluster, training, target)
    space = space or search_space(cluster, precision or training.precision, target,
                                  training.software_stack)
    enum = enumerate_layouts(model, cluster, training, world, space, target)
    pruned: Counter[str] = Counter(enum.pruned)
    if not len(enum.rows):
        raise InfeasibleError(no_valid_layout(model, cluster, training, world, space, pruned,
                                              target))
    pb = Problem(model, cluster, training, calibration_for(cluster.calibration), target,
                 imbalance)
    t_lb, mem_lb = row_bounds(pb, enum)
    fits = mem_lb <= static_activation_budget_bytes(cluster, pb.cal, pb.cal.workspace_gb * GB)
    pruned["memory_bound"] += int((~fits).sum())
    cache = cache if cache is not None else SearchCache()
    bb = BranchAndBound(pb, enum, space, rank, OPTIONS if options is None else options,
                        cache.tables, cache.sets, cache.twins,
                        cache.signature(model, cluster, training, imbalance), top_k, imbalance,
                        fits, t_lb)
    stopped = bb.run(start, time_limit_s, progress)
    bb.refine()
    plans = bb.ranked()
    pruned.update(bb.pruned)
    result = SearchResult([], len(enum.rows), bb.feasible, bb.solved_milps,
                          time.perf_counter() - start, pruned, stopped, bb.screened, rank.name)
    if not plans:
        raise InfeasibleError(nothing_fits(model, cluster, training, world, enum, mem_lb,
                                           pb.cal, bb.closest, grad_reduce_flag))
    result.best_validated = (rank.finish([bb.best_validated], imbalance)[0]
                             if bb.best_validated else None)
    for p in [*plans, *([result.best_validated] if result.best_validated else [])]:
        check_layout(p.model, p.training, p.layout, world, p.choices, p.cluster, target)
    result.plans = explain_plans(rank.finish(plans, imbalance), result)
    return result
