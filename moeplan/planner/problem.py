"""The MILP's data (`StageProblem`, its items and module options) and how one layout becomes it,
by the cost models' own per-layer numbers.

`stage_problem` prices items with the estimator's own per-rank step function
(`cost_models.estimate.stage_terms`): item times, the passes that hide each item's offload
copies, static bytes and the memory budget come from the `StageTerms` that
`estimate_breakdown` adds a plan's ranks up from, and in-flight micro-batches are the schedule's
— so the MILP's objective plus `constant_s` is the estimate of the decoded plan. Two terms
depend on which rank ends up critical (the DP exposure and the optimizer step over that rank's
shard); they enter as the balanced layout's values (`Built.extras`), and the final ranking
re-scores every plan with `estimate` itself. Interleaved layer kinds are priced as one average
layer, where the estimate prices each layer.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, NamedTuple

from ..cost_models.breakdown import StepExtras
from ..cost_models.calibration import Calibration
from ..cost_models.estimate import layer_table_costs, stage_terms
from ..cost_models.layers import LayerCost, make_context
from ..cost_models.overlap import edge_weight
from ..cost_models.pipeline import in_flight_chunks, pipeline_time
from ..specs import (
    OFFLOAD_MODULES,
    RECOMPUTE_MODULES,
    Choices,
    ClusterSpec,
    Layout,
    ModelSpec,
    TrainingSpec,
)
from ..specs.rules import (
    Combo,
    Facts,
    allowed,
    option_rules,
    rules_for,
    uniform_stage_choices,
)


class Option(NamedTuple):
    """One module decision o ∈ O of the MILP: re-run a module's forward in backward
    (`recompute`), or move the activation it saves to host memory (`offload`).

    The two kinds share module names (`core_attn`, `moe_act`), so the kind travels with the
    name; a plan's Choices lists them apart again (`split_options`). A NamedTuple: the MILP's
    set arithmetic hashes options in its inner loops, and a tuple hashes in C."""

    kind: Literal["recompute", "offload"]
    module: str

    @classmethod
    def recompute(cls, module: str) -> Option:
        return cls("recompute", module)

    @classmethod
    def offload(cls, module: str) -> Option:
        return cls("offload", module)

    def __str__(self) -> str:
        return self.module if self.kind == "recompute" else f"offload {self.module}"


FULL = Option.recompute("full")
OPTIONS: tuple[Option, ...] = (tuple(Option.recompute(m) for m in RECOMPUTE_MODULES)
                               + tuple(Option.offload(m) for m in OFFLOAD_MODULES))
"""Every recompute and offload option of SPEC §3; which a layout of a target may take, and in
which combinations, is the rules table's (`menu`)."""


def as_combo(c: Combo | Sequence[Option]) -> Combo:
    """A forbidden combination; a bare pair (a, b) of options reads "not both"."""
    return c if isinstance(c, Combo) else Combo(tuple(c))


@dataclass(frozen=True)
class Menu:
    """What the MILP may pick for one layout of one target (`menu`): the options, the
    combinations no rank's set may hold, and whether one set serves every rank."""

    options: tuple[Option, ...]
    forbidden: tuple[Combo, ...] = ()
    uniform: bool = False
    optimizer_offload: bool = True  # whether the target takes optimizer CPU offload here

    def close(self, chosen: Sequence[Option]) -> list[Option]:
        """A decoded set with the options its forbidden combinations ask to be present added:
        the MILP leaves out an option no item reacts to (it costs nothing), but the executor
        still wants it named (offloading attn_proj names core_attn too)."""
        out = list(chosen)
        for c in self.forbidden:
            if c.hit(set(out)):
                out += [Option(*o) for o in c.absent if o not in out]
        return out


def menu(model: ModelSpec, training: TrainingSpec, layout: Layout, target: str,
         options: Sequence[Option] = OPTIONS) -> Menu:
    """The module options a layout of `target` may take, from the rules table: options some
    rule bans outright leave, the other forbidden combinations go to the MILP, and Megatron's
    one-setting-for-all-stages becomes `uniform`."""
    facts = Facts(model, training, layout)
    opts, combos = allowed(options, option_rules(facts, target))
    return Menu(tuple(o for o in options if o in opts), tuple(combos),
                uniform_stage_choices(target), optimizer_offload(model, training, layout, target))


def optimizer_offload(model: ModelSpec, training: TrainingSpec, layout: Layout,
                      target: str) -> bool:
    """Whether `target` takes the optimizer on the host for this layout: no rule that holds
    without it breaks with it (Megatron's precision-aware optimizer needs the distributed
    optimizer; with FP8 parameter gather, the delayed recipe)."""
    on, off = (Facts(model, training, layout, Choices(optimizer_offload_fraction=f))
               for f in (1.0, 0.0))
    # only the rules it breaks need asking again without it (one pass of the table, not two)
    return all(r.applies(off, target) and not r.ok(off) for r in rules_for(target)
               if r.applies(on, target) and not r.ok(on))


def split_options(options: Iterable[Option]) -> tuple[list[str], list[str]]:
    """(recompute modules, offload modules), each in the given order: a plan's Choices lists."""
    opts = list(options)
    return ([o.module for o in opts if o.kind == "recompute"],
            [o.module for o in opts if o.kind == "offload"])


@dataclass(frozen=True)
class Group:
    """Activation bytes of one item that the same options free or move."""

    bytes: float
    recompute_by: frozenset[Option] = frozenset()
    offload_by: Option | None = None


@dataclass(frozen=True)
class Item:
    """One layer kind (or the embedding/loss/MTP) for one micro-batch on one GPU."""

    name: str
    time_s: float  # t_i
    fwd_s: float  # forward compute that hides the device-to-host copies
    bwd_s: float  # backward compute that hides the host-to-device copies
    static_bytes: float  # w_i
    groups: tuple[Group, ...] = ()
    recompute_s: tuple[tuple[Option, float], ...] = ()


@dataclass(frozen=True)
class StageProblem:
    """Everything the MILP (`planner.ilp`) needs for one layout; built by `stage_problem`."""

    items: tuple[Item, ...]
    layer_item: int  # ℓ: the repeated kind whose count per stage is decided
    free_layers: int  # L − D: layers of kind ℓ to place
    fixed: tuple[tuple[tuple[int, int], ...], ...]  # per stage: (item, count) fixed there
    pp: int
    vpp: int
    inflight: tuple[float, ...]  # ψ_s
    host_s_per_byte: float
    budget_bytes: tuple[float, ...]  # B_r
    alpha: float
    beta: float
    options: tuple[Option, ...]  # O
    forbidden: tuple[Combo, ...] = ()  # option combinations no rank's set may hold
    fixed_layers: tuple[int, ...] | None = None  # X_r given (a user's stage layout)
    uniform: bool = False  # one module set for every rank (Megatron's one setting)

    def __post_init__(self) -> None:
        object.__setattr__(self, "forbidden", tuple(as_combo(c) for c in self.forbidden))

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, s: int) -> int:
        return s % self.pp

    def mean_inflight(self, r: int) -> float:
        """ψ̄_r: mean in-flight micro-batches over rank r's chunks."""
        return sum(self.inflight[r::self.pp]) / self.vpp

    def chunk_layers(self, X: Sequence[int]) -> list[int]:
        """x_s from X_r: even split, the remainder to the chunks holding fewest micro-batches."""
        x = [0] * self.stages
        for r in range(self.pp):
            q, extra = divmod(int(X[r]), self.vpp)
            chunks = sorted(range(self.vpp), key=lambda v: (self.inflight[v * self.pp + r], -v))
            for rank_in_order, v in enumerate(chunks):
                x[v * self.pp + r] = q + (1 if rank_in_order < extra else 0)
        return x


@dataclass(frozen=True)
class LayerTable:
    """Per-layer costs of one (tp, cp, ep, etp, mbs, dispatcher, overlap, precision) key: they
    do not depend on dp, pp or vpp, so a search computes them once per key."""

    costs: dict[str, LayerCost]
    keys: list[str]
    imbalance: float
    groups: dict[str, tuple[Group, ...]] = field(default_factory=dict, compare=False)
    recompute: dict[str, tuple[tuple[Option, float], ...]] = field(default_factory=dict,
                                                                    compare=False)
    memo: dict[str, Any] = field(default_factory=dict, compare=False)

    def groups_of(self, name: str) -> tuple[Group, ...]:
        """`_groups` of one layer kind, built once: every layout of the key reuses it."""
        if name not in self.groups:
            self.groups[name] = _groups(self.costs[name])
        return self.groups[name]

    def recompute_of(self, name: str) -> tuple[tuple[Option, float], ...]:
        """`_recompute_s` of one layer kind, built once like `groups_of`."""
        if name not in self.recompute:
            self.recompute[name] = _recompute_s(self.costs[name])
        return self.recompute[name]

    def total_time_s(self, mtp_layers: int, edge: float = 0.0) -> float:
        """Σ over every decoder layer, the embedding, the loss and MTP of one micro-batch's time
        (`edge`: overlap.edge_weight of the schedule; 0 is the steady state, a lower bound)."""
        t = sum(n * _item_time(self.costs[k], edge) for k, n in self.kind_counts().items())
        t += _item_time(self.costs["E"], edge) + _item_time(self.costs["L"], edge)
        if mtp_layers:
            t += mtp_layers * _item_time(self.costs["m"], edge)
        return t


    def kind_counts(self) -> Counter[str]:
        """Decoder layers per kind, counted once per table."""
        if "counts" not in self.memo:
            self.memo["counts"] = Counter(self.keys)
        return self.memo["counts"]

    def placement(self) -> tuple[str, int, str | None, int] | None:
        """How `stage_problem` places this table's decoder layers: (repeated kind ℓ, its layers
        to split, the leading kind fixed in stage 0 or None, its count); None for interleaved
        kinds, which the problem prices as one average layer. Derived once per table."""
        if "placement" not in self.memo:
            counts = Counter(self.keys)
            kinds = list(counts)
            place: tuple[str, int, str | None, int] | None = None
            if len(kinds) == 1:
                place = kinds[0], len(self.keys), None, 0
            elif len(kinds) == 2 and self.keys == [kinds[0]] * counts[kinds[0]] + [kinds[1]] * (
                    counts[kinds[1]]):
                place = kinds[1], counts[kinds[1]], kinds[0], counts[kinds[0]]
            self.memo["placement"] = place
        return self.memo["placement"]

    def balanced_pipeline_s(self, mtp_layers: int, pp: int, vpp: int, num_microbatches: int,
                            steady: bool = False) -> float:
        """A lower bound on the pipeline time (`pipeline.pipeline_time`) of every plan the
        search can decode for a layout of this table at (pp, vpp, m), at any stage split: the
        layers split by `level_split` (no split has a shorter bare pipeline), the embedding and
        the leading layers on rank 0, the loss and MTP on the last rank (as `stage_problem`
        places them), each item at its bare time at the schedule's edge weight. Recompute and
        offload only add time, the optimizer-offload fraction changes no item time, so no
        choice at any fraction is faster. Interleaved
        layer kinds (priced as one average layer, where a rank's real layers may be cheaper)
        get every item's time spread evenly over the ranks instead.

        `steady`: items at their steady-state time (edge weight 0, the least, as
        `total_time_s` takes it), computed once per table: the cheap form a search orders
        thousands of layouts by."""
        if steady:
            if "steady" not in self.memo:
                self.memo["steady"] = self._bare_times(mtp_layers, 0.0)
            ell_s, first, last, total = self.memo["steady"]
        else:
            ell_s, first, last, total = self._bare_times(
                mtp_layers, edge_weight(num_microbatches, pp, vpp))
        place = self.placement()
        if place is None:
            return pipeline_time([total / pp] * pp, num_microbatches, vpp)[0]
        fixed = [0.0] * pp
        fixed[0] += first
        fixed[pp - 1] += last
        # the levelled split: the least bare pipeline of any split, so a bound on the balanced
        # split the screen decodes, on the levelled one, and on the MILP's (`refine`)
        X = level_split(place[1], fixed, ell_s)
        return pipeline_time([x * ell_s + f for x, f in zip(X, fixed, strict=True)],
                             num_microbatches, vpp)[0]

    def _bare_times(self, mtp_layers: int, edge: float) -> tuple[float, float, float, float]:
        """(repeated layer, rank 0's fixed items, the last rank's fixed items, all items) at
        their bare time at this edge weight, placed as `placement` says."""
        costs = self.costs
        first = _item_time(costs["E"], edge)
        last = _item_time(costs["L"], edge) + (
            mtp_layers * _item_time(costs["m"], edge) if mtp_layers else 0.0)
        place = self.placement()
        if place is None:
            total = first + last + sum(n * _item_time(costs[k], edge)
                                       for k, n in self.kind_counts().items())
            return 0.0, first, last, total
        ell, free, lead, n_lead = place
        t = _item_time(costs[ell], edge)
        first += n_lead * _item_time(costs[lead], edge) if lead else 0.0
        return t, first, last, free * t + first + last


def recompute_pipeline_s(table: LayerTable, problem: StageProblem, layers: Sequence[int],
                         options: Sequence[Sequence[Option]], num_microbatches: int) -> float:
    """A lower bound on the pipeline time `estimate` gives the plan decoded from a solution
    (layers X_r and each rank's options): every item at its bare time plus the forwards its
    rank's recompute re-runs, counted as `LayerCost.recompute_s` counts them. Offload copies
    only add time, so leaving them out keeps this a bound. 0 for a problem that prices
    interleaved layer kinds as one average layer."""
    P = problem
    if any(it.name not in table.costs for it in P.items):
        return 0.0
    lay = P.items[P.layer_item]
    T = []
    for r in range(P.pp):
        rc = [o.module for o in options[r] if o.kind == "recompute"]
        t = layers[r] * (lay.time_s + table.costs[lay.name].recompute_s(rc))
        for s in range(r, P.stages, P.pp):
            for i, n in P.fixed[s]:
                it = P.items[i]
                t += n * (it.time_s + table.costs[it.name].recompute_s(rc))
        T.append(t)
    return pipeline_time(T, num_microbatches, P.vpp)[0]


@lru_cache(maxsize=4096)
def inflight_per_stage(pp: int, vpp: int, num_microbatches: int) -> tuple[float, ...]:
    """ψ_s: micro-batches each virtual stage holds at its rank's peak (`in_flight_chunks`);
    a function of the schedule only, which thousands of layouts of a search share."""
    inflight = [0.0] * (pp * vpp)
    for r in range(pp):
        for v in in_flight_chunks(r, pp, vpp, num_microbatches):
            inflight[v * pp + r] += 1
    return tuple(inflight)


def balanced_split(free_layers: int, pp: int, vpp: int, inflight: Sequence[float]) -> list[int]:
    """X_r as even as possible, the remainder to the ranks holding the fewest micro-batches
    (ψ̄_r, `StageProblem.mean_inflight`): the screening's stage split (`ilp.balanced_layers`)."""
    q, extra = divmod(free_layers, pp)
    ranks = sorted(range(pp), key=lambda r: (sum(inflight[r::pp]) / vpp, -r))
    X = [q] * pp
    for r in ranks[:extra]:
        X[r] += 1
    return X


def level_split(free_layers: int, fixed_s: Sequence[float], layer_s: float,
                order: Sequence[float] | None = None) -> list[int]:
    """X_r minimising the slowest rank's bare time layer_s·X_r + fixed_s[r] (the items fixed on
    rank r: the embedding and leading layers on the first, the loss and MTP on the last): each
    layer goes to the rank it leaves least loaded, ties to the rank of least `order` (its mean
    in-flight micro-batches: the least memory). With every layer the same size, this greedy
    is optimal (the last layer placed sets the maximum, and no other placement of it is
    lower), and since the pipeline time grows with its slowest rank at a fixed sum of rank
    times (`pipeline.pipeline_time`), no split of the layers has a shorter bare pipeline: the
    balanced split can be a layer or more longer where the first or last rank carries fixed
    items (DeepSeek-V3's 61 layers, MTP and loss over PP 4)."""
    pp = len(fixed_s)
    order = order or [0.0] * pp
    X = [0] * pp
    if layer_s <= 0:
        q, extra = divmod(free_layers, pp)
        return [q + (r < extra) for r in range(pp)]
    heap = [(fixed_s[r] + layer_s, order[r], r) for r in range(pp)]
    heapq.heapify(heap)
    for _ in range(free_layers):
        t, o, r = heapq.heappop(heap)
        X[r] += 1
        heapq.heappush(heap, (t + layer_s, o, r))
    return X


def _item_time(lc: LayerCost, edge: float) -> float:
    """t_i as `StageTerms.item_time_s` prices it at this edge weight: fwd + bwd + two launch
    overheads + exposed comm."""
    return lc.time_at(edge)


EP_BLIND = ("attention_block", "dense_layer", "embedding_layer", "loss_layer")
"""The per-layer cost functions (cost_models.layers, memoised per context) that read none of the
expert axes (ep, etp, their placements, the MoE dispatcher, EP overlap): layouts that differ
only in those share their results (`test_layer_tables_shared_across_expert_axes_equal_fresh_ones`
keeps this true)."""


def layer_table(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                cal: Calibration, imbalance: float = 1.0, shared: dict | None = None
                ) -> LayerTable:
    """The layout's per-layer costs. `shared`: the EP_BLIND results of a layout that differs
    at most in the expert axes (EP_BLIND), reused here and filled for the next such layout
    (a search prices dozens of expert layouts per group of tp, cp and mbs)."""
    ctx = make_context(model, cluster, training, layout, cal)
    if shared:
        ctx.memo.update(shared)
    costs, keys = layer_table_costs(ctx, imbalance)
    if shared is not None:
        shared.update((k, v) for k, v in ctx.memo.items() if k[0] in EP_BLIND)
    return LayerTable(costs, keys, imbalance)


def _groups(lc: LayerCost) -> tuple[Group, ...]:
    """Merge an item's activation tensors by (recompute options, offload option); `full` frees
    everything but the layer input, as `LayerCost._kept` says."""
    merged: dict[tuple[frozenset[Option], Option | None], float] = {}
    for t in lc.tensors:
        rb = frozenset(Option.recompute(o) for o in t.recompute_by) | (
            {FULL} if t.name != "layer_input" else set())
        key = (rb, Option.offload(t.offload_by) if t.offload_by else None)
        merged[key] = merged.get(key, 0.0) + t.bytes
    return tuple(Group(b, rb, ob) for (rb, ob), b in sorted(
        merged.items(), key=lambda kv: (sorted(o.module for o in kv[0][0]),
                                        kv[0][1].module if kv[0][1] else "")))


def _recompute_s(lc: LayerCost) -> tuple[tuple[Option, float], ...]:
    """The forward seconds each recompute option re-runs, in module order."""
    return tuple((Option.recompute(o), t) for o, t in sorted(lc.recompute_fwd_s.items()))


@dataclass(frozen=True)
class Built:
    problem: StageProblem
    constant_s: float  # step time outside the pipeline (p2p, DP, optimizer, per-step overhead)
    leading_layers: int  # decoder layers fixed in stage 0 (the dense layers before the MoE ones)
    # the step outside the pipeline as `constant_s` prices it, on the balanced rank: its
    # dp_exposed_s and optimizer_s are the two terms that depend on which rank is critical
    extras: StepExtras | None = None


def stage_problem(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
    cal: Calibration, table: LayerTable, options: Menu | tuple[Option, ...],
    optimizer_offload_fraction: float = 0.0, fixed_layers: tuple[int, ...] | None = None,
) -> Built:
    """The MILP's data for one layout at one optimizer-offload fraction (module docstring).
    `options`: the layout's `menu`; a bare tuple of options is read under the rules both
    targets share (one set per rank)."""
    m_ = options if isinstance(options, Menu) else menu(model, training, layout, "moeplan",
                                                         options)
    L = layout
    S, pp, vpp, m = L.pp * L.vpp, L.pp, L.vpp, L.num_microbatches
    terms = stage_terms(model, cluster, training, L, cal, table.imbalance,
                        table=(table.costs, table.keys))
    f = optimizer_offload_fraction

    def item(name: str, lc: LayerCost) -> Item:
        fwd_s, bwd_s = terms.windows_s(lc)
        return Item(name, terms.item_time_s(lc), fwd_s, bwd_s,
                    terms.item_static(name, lc, f).total,
                    table.groups_of(name), table.recompute_of(name))

    keys = table.keys
    kinds = list(dict.fromkeys(keys))
    items: list[Item] = []
    fixed: list[list[tuple[int, int]]] = [[] for _ in range(S)]
    leading = 0
    if len(kinds) == 1:
        items.append(item(kinds[0], table.costs[kinds[0]]))
        free = model.num_layers
    elif len(kinds) == 2 and keys == [kinds[0]] * keys.count(kinds[0]) + [kinds[1]] * keys.count(
            kinds[1]):
        # the first D layers (dense) sit in stage 0; the repeated kind is spread by the MILP
        items += [item(kinds[1], table.costs[kinds[1]]), item(kinds[0], table.costs[kinds[0]])]
        fixed[0].append((1, keys.count(kinds[0])))
        free = keys.count(kinds[1])
        leading = keys.count(kinds[0])
    else:  # interleaved kinds (e.g. sliding/full attention): one average layer
        items.append(_average_item([item(k, table.costs[k]) for k in keys]))
        free = model.num_layers
    items.append(item("E", table.costs["E"]))
    fixed[0].append((len(items) - 1, 1))
    items.append(item("L", table.costs["L"]))
    fixed[S - 1].append((len(items) - 1, 1))
    if model.mtp_layers:
        items.append(item("m", table.costs["m"]))
        fixed[S - 1].append((len(items) - 1, model.mtp_layers))

    problem = StageProblem(
        items=tuple(items), layer_item=0, free_layers=free,
        fixed=tuple(tuple(e) for e in fixed), pp=pp, vpp=vpp,
        inflight=inflight_per_stage(pp, vpp, m),
        host_s_per_byte=1.0 / (cluster.host_link_gb_s * 1e9),
        budget_bytes=(terms.budget_bytes,) * pp, alpha=m - 1.0 / vpp, beta=1.0 / vpp,
        options=m_.options, forbidden=m_.forbidden, fixed_layers=fixed_layers,
        uniform=m_.uniform)
    extras = terms.balanced_extras(f)
    return Built(problem, constant_time_s(extras, cal), leading, extras)


def _average_item(parts: Sequence[Item]) -> Item:
    """One average layer of interleaved kinds: every number the mean over the layers, each
    tensor group kept with its share of the bytes."""
    n = len(parts)
    groups: list[Group] = []
    for p in parts:
        groups += [Group(g.bytes / n, g.recompute_by, g.offload_by) for g in p.groups]
    rec: dict[Option, float] = {}
    for p in parts:
        for o, t in p.recompute_s:
            rec[o] = rec.get(o, 0.0) + t / n
    return Item("layer", sum(p.time_s for p in parts) / n, sum(p.fwd_s for p in parts) / n,
                sum(p.bwd_s for p in parts) / n, sum(p.static_bytes for p in parts) / n,
                tuple(groups), tuple(sorted(rec.items())))


def constant_time_s(extras: StepExtras, cal: Calibration) -> float:
    """Step time outside the pipeline: PP exposure, DP exposure, optimizer, per-step overhead."""
    return extras.pp_exposed_s + extras.dp_exposed_s + extras.optimizer_s + cal.step_overhead_s
