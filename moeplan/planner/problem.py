"""From one layout to the MILP's data, by the cost models' own per-layer numbers.

`stage_problem` mirrors `cost_models.estimate.estimate_breakdown` term by term — item times and
overheads as `_chunk` adds them, static bytes as `static_memory`, in-flight micro-batches as the
schedule holds them, buffers and fragmentation folded into each rank's budget — so the MILP's
objective plus `constant_s` is the estimate of the decoded plan. Two terms depend on which rank
ends up critical (the DP exposure and the optimizer step over that rank's shard); they enter as
the balanced layout's values, and the final ranking re-scores every plan with `estimate` itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..cost_models.calibration import Calibration
from ..cost_models.estimate import (
    fixed_buffer_bytes,
    layer_costs,
    layer_imbalances,
    moments_bytes,
    static_activation_budget_bytes,
    step_extras,
)
from ..cost_models.layers import LayerCost, make_context
from ..cost_models.memory import static_memory
from ..cost_models.overlap import edge_weight
from ..cost_models.pipeline import in_flight_chunks
from ..specs import ClusterSpec, Layout, ModelSpec, TrainingSpec
from .ilp import Group, Item, StageProblem

OFFLOAD_PREFIX = "offload:"  # recompute and offload share module names (core_attn, moe_act)
RECOMPUTE_EXCLUSIVE_WITH_FULL = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                                 "shared_experts")


@dataclass(frozen=True)
class LayerTable:
    """Per-layer costs of one (tp, cp, ep, etp, mbs, dispatcher, overlap, precision) key: they
    do not depend on dp, pp or vpp, so a search computes them once per key."""

    costs: dict[str, LayerCost]
    keys: list[str]
    imbalance: float
    groups: dict[str, tuple[Group, ...]] = field(default_factory=dict, compare=False)

    def groups_of(self, name: str) -> tuple[Group, ...]:
        """`_groups` of one layer kind, built once: every layout of the key reuses it."""
        if name not in self.groups:
            self.groups[name] = _groups(self.costs[name])
        return self.groups[name]

    def total_time_s(self, mtp_layers: int, edge: float = 0.0) -> float:
        """Σ over every decoder layer, the embedding, the loss and MTP of one micro-batch's time
        (`edge`: overlap.edge_weight of the schedule; 0 is the steady state, a lower bound)."""
        t = sum(n * _item_time(self.costs[k], edge)
                for k, n in Counter(self.keys).items())
        t += _item_time(self.costs["E"], edge) + _item_time(self.costs["L"], edge)
        if mtp_layers:
            t += mtp_layers * _item_time(self.costs["m"], edge)
        return t


def _item_time(lc: LayerCost, edge: float) -> float:
    """t_i as `estimate._chunk` adds it: fwd + bwd + two launch overheads + exposed comm."""
    return lc.time_at(edge)


def layer_table(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                cal: Calibration, imbalance: float = 1.0) -> LayerTable:
    ctx = make_context(model, cluster, training, layout, cal)
    imbs = layer_imbalances(model, layout.ep, imbalance, None)
    costs, keys = layer_costs(ctx, imbs)
    return LayerTable(costs, keys, imbalance)


def _groups(lc: LayerCost) -> tuple[Group, ...]:
    """Merge an item's activation tensors by (recompute options, offload option); `full` frees
    everything but the layer input, as `LayerCost._kept` says."""
    merged: dict[tuple[frozenset[str], str | None], float] = {}
    for t in lc.tensors:
        rb = frozenset(t.recompute_by | ({"full"} if t.name != "layer_input" else set()))
        key = (rb, OFFLOAD_PREFIX + t.offload_by if t.offload_by else None)
        merged[key] = merged.get(key, 0.0) + t.bytes
    return tuple(Group(b, rb, ob) for (rb, ob), b in sorted(
        merged.items(), key=lambda kv: (sorted(kv[0][0]), kv[0][1] or "")))


@dataclass(frozen=True)
class Built:
    problem: StageProblem
    constant_s: float  # step time outside the pipeline (p2p, DP, optimizer, per-step overhead)
    leading_layers: int  # decoder layers fixed in stage 0 (the dense layers before the MoE ones)


def stage_problem(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
    cal: Calibration, table: LayerTable, options: tuple[str, ...],
    optimizer_offload_fraction: float = 0.0, fixed_layers: tuple[int, ...] | None = None,
) -> Built:
    L = layout
    S, pp, vpp, m = L.pp * L.vpp, L.pp, L.vpp, L.num_microbatches
    moments = moments_bytes(training)
    dense_shards, expert_shards = L.dp * L.cp, max(1, L.edp)
    edge = edge_weight(m, pp, vpp)
    f = optimizer_offload_fraction

    def item(name: str, lc: LayerCost) -> Item:
        st = static_memory(lc.dense_params, lc.expert_params, dense_shards, expert_shards,
                           moments, L.distributed_optimizer, f)
        return Item(name, _item_time(lc, edge), lc.fwd_s + lc.launch_s, lc.bwd_s + lc.launch_s,
                    st.total,
                    table.groups_of(name), tuple(sorted(lc.recompute_fwd_s.items())))

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
        n = len(keys)
        parts = [item(k, table.costs[k]) for k in keys]
        groups: list[Group] = []
        for p in parts:
            groups += [Group(g.bytes / n, g.recompute_by, g.offload_by) for g in p.groups]
        rec: dict[str, float] = {}
        for p in parts:
            for o, t in p.recompute_s:
                rec[o] = rec.get(o, 0.0) + t / n
        items.append(Item("layer", sum(p.time_s for p in parts) / n,
                          sum(p.fwd_s for p in parts) / n, sum(p.bwd_s for p in parts) / n,
                          sum(p.static_bytes for p in parts) / n, tuple(groups),
                          tuple(sorted(rec.items()))))
        free = model.num_layers
    items.append(item("E", table.costs["E"]))
    fixed[0].append((len(items) - 1, 1))
    items.append(item("L", table.costs["L"]))
    fixed[S - 1].append((len(items) - 1, 1))
    if model.mtp_layers:
        items.append(item("m", table.costs["m"]))
        fixed[S - 1].append((len(items) - 1, model.mtp_layers))

    inflight = [0.0] * S
    for r in range(pp):
        for v in in_flight_chunks(r, pp, vpp, m):
            inflight[v * pp + r] += 1

    budget = static_activation_budget_bytes(
        cluster, cal, fixed_buffer_bytes(model, training, L, cal, table.imbalance))

    if L.ep_overlap:  # Megatron forbids full and `moe` recompute with EP overlap
        options = tuple(o for o in options if o not in ("full", "moe"))
    exclusive = tuple(("full", o) for o in RECOMPUTE_EXCLUSIVE_WITH_FULL)
    problem = StageProblem(
        items=tuple(items), layer_item=0, free_layers=free,
        fixed=tuple(tuple(e) for e in fixed), pp=pp, vpp=vpp,
        inflight=tuple(inflight), host_s_per_byte=1.0 / (cluster.host_link_gb_s * 1e9),
        budget_bytes=(budget,) * pp, alpha=m - 1.0 / vpp, beta=1.0 / vpp, options=options,
        exclusive=exclusive, fixed_layers=fixed_layers)
    return Built(problem, constant_time_s(model, cluster, training, layout, cal, table, f),
                 leading)


def constant_time_s(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                    layout: Layout, cal: Calibration, table: LayerTable, f: float = 0.0) -> float:
    """Step time outside the pipeline for a balanced stage split (`estimate.step_extras` on the
    average rank's parameters and windows) plus the per-step overhead."""
    pp = layout.pp
    e = step_extras(
        model, cluster, training, layout, cal,
        dense_params=sum(table.costs[k].dense_params for k in table.keys) / pp,
        expert_params=sum(table.costs[k].expert_params for k in table.keys) / pp,
        fwd_window_s=sum(table.costs[k].fwd_s for k in table.keys) / pp,
        bwd_window_s=sum(table.costs[k].bwd_s for k in table.keys) / pp,
        optimizer_offload_fraction=f)
    return e.pp_exposed_s + e.dp_exposed_s + e.optimizer_s + cal.step_overhead_s
