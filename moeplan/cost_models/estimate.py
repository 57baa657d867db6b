"""Whole-step estimate: stage layout → per-rank chunk costs → pipeline, DP, memory peak.

The step's critical path is the pipeline schedule over the slowest pp rank (every DP/TP/EP
replica of a stage does the same work, at the most loaded EP rank's routing), plus the DP
gradient reduce-scatter and parameter all-gather that overlap could not hide, plus the
optimizer step. Memory is the peak over pp ranks of static memory + in-flight activations +
buffers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from ..specs.cluster import ClusterSpec
from ..specs.layout import Choices, Layout, check_layout
from ..specs.model import ModelSpec
from ..specs.plan import Confidence, Estimate, Interval, MemoryBreakdown, TimeBreakdown
from ..specs.stage_layout import format_stage_layout, plan_stages
from ..specs.training import TrainingSpec
from . import comm as C
from . import uncertainty as U
from .breakdown import Breakdown, ChunkCost, RankCost, StepExtras
from .calibration import Calibration, calibration_for, calibration_on
from .compute import (
    adam_step_bytes,
    attention_length_ceiling,
    lowp_speedup,
    membound_time,
    sfu_gains,
)
from .host import host_kind
from .layers import (
    BF16,
    QUANTIZED_BYTES,
    Context,
    LayerCost,
    dense_layer,
    embedding_layer,
    loss_layer,
    make_context,
    moe_layer,
    mtp_layer,
)
from .memory import GB, HOST_USABLE, StaticMemory, static_memory, weight_bytes
from .overlap import edge_weight, exposed_time, staged_exposed_time
from .pipeline import in_flight_chunks, pipeline_time


# ----------------------------------------------------------------------------- routing
def imbalance_from_histogram(tokens_per_expert: Sequence[float], ep: int) -> float:
    """Tokens on the most loaded EP rank over the mean, experts dealt to ranks in contiguous
    blocks of E/ep (Megatron's expert placement)."""
    n = len(tokens_per_expert)
    if n == 0 or n % ep:
        return 1.0
    per = n // ep
    sums = [sum(tokens_per_expert[i * per:(i + 1) * per]) for i in range(ep)]
    mean = sum(sums) / ep
    return max(sums) / mean if mean > 0 else 1.0


def routed_load(training: TrainingSpec | None, imbalance: float) -> float:
    """Token copies the busiest EP rank computes over the even share, once a capacity applies:
    padded to capacity every expert computes exactly its capacity (the capacity factor, however
    the router spread the tokens); dropping without padding cuts the busiest expert at it. A
    capacity below the even share is priced at the even share, the work the search's lower
    bound (`lower_bound`: every routed token) counts, so the bound stays a bound."""
    cf = training.moe_capacity_factor if training is not None else None
    if cf is None:
        return imbalance
    cf = max(cf, 1.0)
    return cf if training.moe_pad_expert_input_to_capacity else min(imbalance, cf)


def layer_imbalances(model: ModelSpec, ep: int, imbalance: float,
                     histogram: dict[str, Any] | None,
                     training: TrainingSpec | None = None) -> list[float]:
    """Imbalance per decoder layer: from a routing histogram when given, else `imbalance`,
    then capped or padded by the training's capacity (`routed_load`).

    Histogram entries name a decoder layer index; when those are not MoE layers (a histogram
    counted over MoE layers only), entries are matched to MoE layers in order. Layers the
    histogram does not cover get the mean of those it does.
    """
    if not histogram:  # one imbalance for every layer: a search asks this per layer table
        return [routed_load(training, imbalance)] * model.num_layers
    return [routed_load(training, x)
            for x in _histogram_imbalances(model, ep, imbalance, histogram)]


def _histogram_imbalances(model: ModelSpec, ep: int, imbalance: float,
                          histogram: dict[str, Any] | None) -> list[float]:
    moe = model.moe_layers()
    out = [imbalance] * model.num_layers
    if not histogram:
        return out
    entries = histogram.get("layers", [])
    moe_idx = [i for i, is_moe in enumerate(moe) if is_moe]
    vals: dict[int, float] = {}
    by_layer = all(0 <= int(e.get("layer", -1)) < len(moe) and moe[int(e["layer"])]
                   for e in entries)
    for j, e in enumerate(entries):
        idx = int(e["layer"]) if by_layer else (moe_idx[j] if j < len(moe_idx) else None)
        if idx is not None:
            vals[idx] = imbalance_from_histogram(e.get("tokens_per_expert", []), ep)
    if vals:
        mean = sum(vals.values()) / len(vals)
        out = [vals.get(i, mean) for i in range(model.num_layers)]
    return out


# ----------------------------------------------------------------------------- helpers
def layer_costs(ctx: Context, imbalances: list[float]) -> tuple[dict[str, LayerCost], list[str]]:
    """Cost of every distinct layer kind ("dense", "moe", "moe@1.3", "E", "L", "m", ...) and the
    key of each decoder layer in model order: the per-layout table the planner builds once."""
    m = ctx.model
    keys, kinds = _layer_kinds(tuple(m.moe_layers()), tuple(m.sliding_layers()),
                               tuple(imbalances))
    cache: dict[str, LayerCost] = {
        key: moe_layer(ctx, sliding, imb) if moe else dense_layer(ctx, sliding)
        for key, moe, sliding, imb in kinds}
    cache["E"] = embedding_layer(ctx)
    cache["L"] = loss_layer(ctx)
    if m.mtp_layers:
        cache["m"] = mtp_layer(ctx, imbalances[-1])
    return cache, list(keys)


@lru_cache(maxsize=64)
def _layer_kinds(moe: tuple[bool, ...], sliding: tuple[bool, ...], imbalances: tuple[float, ...]
                 ) -> tuple[tuple[str, ...], tuple[tuple[str, bool, bool, float], ...]]:
    """The key of each decoder layer ("dense", "moe-swa", "moe@1.3", ...) and each distinct
    kind once: a function of the model's layer pattern only, so a search of thousands of
    layouts derives it once."""
    keys, kinds = [], {}
    for is_moe, swa, imb in zip(moe, sliding, imbalances, strict=True):
        imb = round(imb, 4)
        key = f"{'moe' if is_moe else 'dense'}{'-swa' if swa else ''}" + (
            f"@{imb}" if is_moe and imb != 1.0 else "")
        kinds.setdefault(key, (key, is_moe, swa, imb))
        keys.append(key)
    return tuple(keys), tuple(kinds.values())


def layer_table_costs(ctx: Context, imbalance: float = 1.0,
                      routing_histogram: dict[str, Any] | None = None
                      ) -> tuple[dict[str, LayerCost], list[str]]:
    """`layer_costs` at the layout's `layer_imbalances`: the per-layer table of one context,
    which a search builds once per key of the fields the layer costs read and shares across
    dp, pp and vpp."""
    imbs = layer_imbalances(ctx.model, ctx.layout.ep, imbalance, routing_histogram,
                            ctx.training)
    return layer_costs(ctx, imbs)


# ----------------------------------------------------------------------------- one rank's step
@dataclass(frozen=True)
class StageTerms:
    """The pieces one layout's step is added up from, for any stage split and choices
    (`stage_terms`): the per-layer table, the schedule's edge weight, how static bytes, buffers
    and the memory budget follow from the parameters a rank holds, and the step outside the
    pipeline. `estimate_breakdown` prices the stages of one plan from them and the MILP's data
    (`planner.problem.stage_problem`) prices every split and module set from them, so the
    MILP's objective plus its constant is the estimate of the plan it decodes."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    layout: Layout
    cal: Calibration
    costs: Mapping[str, LayerCost]  # per layer kind ("dense", "moe@1.3", "E", "L", "m")
    keys: Sequence[str]  # the kind of each decoder layer, in model order
    imbalances: Sequence[float]  # routing imbalance per decoder layer
    edge: float  # overlap.edge_weight of the schedule
    moments_bytes: int  # per Adam moment
    grad_bytes: int  # per main gradient (grad_reduce_bytes)
    budget_bytes: float  # static + activation bytes a rank with MoE layers may hold

    def item_time_s(self, lc: LayerCost) -> float:
        """One item for one micro-batch before recompute and offload: forward + backward, two
        launch overheads, exposed communication at the schedule's edge weight."""
        return lc.time_at(self.edge)

    def windows_s(self, lc: LayerCost) -> tuple[float, float]:
        """(forward, backward) seconds of one item that its offload copies can hide behind."""
        return lc.fwd_s + lc.launch_s, lc.bwd_s + lc.launch_s

    def offload_s(self, lc: LayerCost, nbytes: float) -> float:
        """Exposed seconds of moving `nbytes` of one item's activations to host in its forward
        (D2H) and back in its backward (H2D), each hidden behind that item's own pass only
        (`overlap.exposed_time`, η = 1). Fine-grained activation offloading (Megatron Core's,
        and `runtime.memory`) moves saved tensors in one group per layer on a side stream: the
        D2H copies run while the layer's forward produces them, the H2D copies come back one
        layer at a time, each group brought in as the backward reaches the layer next to it.
        A layer's copies therefore have about one layer's pass to hide behind; they cannot
        pool behind the whole chunk's pass, as a sum over the chunk would let a layer with
        little compute and many bytes borrow its neighbours' compute. The MILP
        (`planner.sets.item_cost`) prices the same sum per item, so the two agree."""
        copy = C.host_copy_time(nbytes, self.cluster)
        fwd, bwd = self.windows_s(lc)
        return exposed_time(copy, fwd) + exposed_time(copy, bwd)

    def chunk(self, items: Sequence[tuple[str, LayerCost]], recompute: Sequence[str],
              offload: Sequence[str]) -> ChunkCost:
        """One chunk for one micro-batch under the stage's recompute and offload choices.
        Items of one kind cost the same, so each kind is priced once and counted (a chunk of
        DeepSeek-V3 holds up to 32 layers of one or two kinds)."""
        edge = self.edge
        fwd = bwd = rec = exp = ep_exp = tp = cp = ep = act = off = off_s = dense = expert = 0.0
        kinds = dict(items)
        for k, n in Counter(k for k, _ in items).items():
            lc = kinds[k]
            fwd += n * (lc.fwd_s + lc.launch_s)
            bwd += n * (lc.bwd_s + lc.launch_s)
            rec += n * lc.recompute_s(recompute)
            exp += n * lc.exposed_s(edge)
            tp, cp, ep = tp + n * lc.tp_s, cp + n * lc.cp_s, ep + n * lc.ep_s
            ep_exp += n * (lc.ep_s - (1.0 - edge) * lc.edge_exposed_s)
            act += n * lc.activation_bytes(recompute, offload)
            moved = lc.offload_bytes(recompute, offload)
            off += n * moved
            off_s += n * self.offload_s(lc, moved) if moved else 0.0
            dense, expert = dense + n * lc.dense_params, expert + n * lc.expert_params
        return ChunkCost(tuple(k for k, _ in items), fwd, bwd, rec, exp, ep_exp, off_s, tp, cp,
                         ep, act, off, dense, expert)

    def static(self, dense_params: float, expert_params: float,
               optimizer_offload_fraction: float = 0.0, embedding_params: float = 0.0
               ) -> StaticMemory:
        """Weights, grads and optimizer bytes of a rank (or one item) holding these parameters
        (`embedding_params` of the dense ones in the embedding and output layer)."""
        L, t = self.layout, self.training
        return static_memory(dense_params, expert_params, L.dp * L.cp, max(1, L.edp),
                             self.moments_bytes, L.distributed_optimizer,
                             optimizer_offload_fraction, self.grad_bytes,
                             weight_bytes(QUANTIZED_BYTES.get(t.precision), t.fp8_param_gather),
                             embedding_params)

    def item_static(self, name: str, lc: LayerCost, optimizer_offload_fraction: float = 0.0
                    ) -> StaticMemory:
        """`static` of one layer-table item (`name` its key: the embedding and output layer
        hold bf16 weights whatever the recipe)."""
        return self.static(lc.dense_params, lc.expert_params, optimizer_offload_fraction,
                           lc.dense_params if name in EMBEDDING_KINDS else 0.0)

    def buffer_bytes(self, has_moe: bool = True) -> float:
        """`fixed_buffer_bytes` of a rank, at the most imbalanced layer's routing."""
        return fixed_buffer_bytes(self.model, self.training, self.layout, self.cal,
                                  max(self.imbalances, default=1.0), has_moe)

    def extras(self, dense_params: float, expert_params: float, fwd_window_s: float,
               bwd_window_s: float, optimizer_offload_fraction: float = 0.0,
               embedding_params: float = 0.0) -> StepExtras:
        """`step_extras` of a rank holding these parameters with these pass windows."""
        return step_extras(self.model, self.cluster, self.training, self.layout, self.cal,
                           dense_params, expert_params, fwd_window_s, bwd_window_s,
                           optimizer_offload_fraction, embedding_params)

    def rank_extras(self, rank: RankCost, optimizer_offload_fraction: float = 0.0
                    ) -> StepExtras:
        """`extras` of one priced pipeline rank: its parameters, its chunks' passes as the
        windows, its embedding and output layer kept bf16 by an FP8 parameter gather."""
        ch = rank.chunks
        return self.extras(
            sum(c.dense_params for c in ch), sum(c.expert_params for c in ch),
            sum(c.fwd_s for c in ch), sum(c.bwd_s for c in ch), optimizer_offload_fraction,
            sum(self.costs[k].dense_params for c in ch for k in c.layers
                if k in EMBEDDING_KINDS))

    def balanced_extras(self, optimizer_offload_fraction: float = 0.0) -> StepExtras:
        """`extras` of the average rank of a balanced stage split, the decoder layers'
        parameters and passes over pp: what the MILP adds to its objective as a constant
        before the stage split is known. Of its terms, the DP exposure and the optimizer step
        depend on which rank ends up critical, where `rank_extras` prices them for a plan."""
        costs, keys, pp = self.costs, self.keys, self.layout.pp
        return self.extras(
            dense_params=sum(costs[k].dense_params for k in keys) / pp,
            expert_params=sum(costs[k].expert_params for k in keys) / pp,
            fwd_window_s=sum(costs[k].fwd_s for k in keys) / pp,
            bwd_window_s=sum(costs[k].bwd_s for k in keys) / pp,
            optimizer_offload_fraction=optimizer_offload_fraction)


def stage_terms(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                cal: Calibration, imbalance: float = 1.0,
                routing_histogram: dict[str, Any] | None = None,
                table: tuple[Mapping[str, LayerCost], Sequence[str]] | None = None
                ) -> StageTerms:
    """The `StageTerms` of one layout. `table`: its (costs, keys) from `layer_table_costs` when
    the caller already holds them (a search shares one table across dp, pp and vpp)."""
    imbs = layer_imbalances(model, layout.ep, imbalance, routing_histogram, training)
    if table is None:
        table = layer_costs(make_context(model, cluster, training, layout, cal), imbs)
    costs, keys = table
    buffers = fixed_buffer_bytes(model, training, layout, cal, max(imbs, default=1.0))
    return StageTerms(model, cluster, training, layout, cal, costs, keys, imbs,
                      edge_weight(layout.num_microbatches, layout.pp, layout.vpp),
                      moments_bytes(training), grad_reduce_bytes(training),
                      U.static_activation_budget_bytes(cluster, cal, buffers))


def _confidence(cal: Calibration, cluster: ClusterSpec, training: TrainingSpec,
                model: ModelSpec) -> Confidence:
    key = f"{cluster.gpu}/{training.precision}/{'moe' if model.is_moe else 'dense'}"
    if cluster.calibration:
        return Confidence(label="calibrated", reason="cluster carries measured calibration "
                          "constants")
    if key in cal.calibrated and U.validated(f"calibration/{key}"):
        return Confidence(label="calibrated", reason=f"fit data covers {key}")
    if key in cal.calibrated:  # the one judgement the assumption list also makes (`U._term`)
        return Confidence(label="extrapolated", reason=f"the fit's rows for {key} are all of a "
                          "model it misses as a whole, so they validate nothing; constants "
                          "carried over from other GPUs, precisions or model kinds")
    return Confidence(label="extrapolated", reason=f"no fit rows for {key}; constants carried "
                      "over from other GPUs, precisions or model kinds")


def step_extras(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                cal: Calibration, dense_params: float, expert_params: float,
                fwd_window_s: float, bwd_window_s: float,
                optimizer_offload_fraction: float = 0.0,
                embedding_params: float = 0.0) -> StepExtras:
    """PP point-to-point exposure, DP gradient reduce-scatter / parameter all-gather and their
    exposure, and the optimizer step, for a rank holding these parameters.

    PP: activations (SP-sharded) cross between consecutive virtual stages; the steady state
    overlaps them, warm-up and cool-down do not. DP: grads reduce-scatter (fp32, or bf16 with
    `TrainingSpec.grad_reduce_dtype`) and params all-gather (bf16), hidden behind the last
    micro-batch's backward and the first one's forward (Megatron overlap_grad_reduce,
    overlap_param_gather). Optimizer: Adam over the rank's shard in
    HBM; the offloaded share crosses the host link (grads down, params up). With
    `TrainingSpec.fp8_param_gather` the GEMM weights gather in one byte each; the
    `embedding_params` among `dense_params` (embedding and output layer, no FP8 GEMM of their
    own in the recipes) stay bf16.
    """
    L = layout
    n_sp = L.mbs * training.seq_len / L.cp / L.tp
    pp_place = C.placement(L, "pp", cluster)
    p2p = C.p2p_time(BF16 * n_sp * model.hidden_size, not pp_place.inside_nvlink, cluster, cal)
    # warm-up and cool-down transfers wait in full; every chunk pass of the steady state also
    # ends at a stage boundary (send/recv handshake, the next chunk's launch): pp_boundary_s each
    pp_exposed = (2 * (L.pp * L.vpp - 1) * p2p
                  + 2 * L.num_microbatches * L.vpp * cal.pp_boundary_s) if L.pp > 1 else 0.0
    dp_place = C.placement(L, "dp", cluster)
    dense_dp = C.GroupPlacement(L.dp * L.cp, dp_place.per_domain,
                                max(dp_place.domains, C.placement(L, "cp", cluster).domains))
    edp_place = C.placement(L, "edp", cluster)
    grad = grad_reduce_bytes(training)
    if L.distributed_optimizer:
        rs = C.ring_time(grad * dense_params, dense_dp, cluster, cal) + C.ring_time(
            grad * expert_params, edp_place, cluster, cal)
        w = 1 if training.fp8_param_gather else 2
        ag = C.ring_time(2 * embedding_params + w * (dense_params - embedding_params), dense_dp,
                         cluster, cal) + C.ring_time(w * expert_params, edp_place, cluster, cal)
    else:
        rs = C.all_reduce_time(grad * dense_params, dense_dp, cluster, cal) + C.all_reduce_time(
            grad * expert_params, edp_place, cluster, cal)
        ag = 0.0
    # each model chunk's grads reduce-scatter once its last backward is done and its params
    # all-gather before its first forward; the interleaved schedule spaces a stage's chunks
    # pp passes apart at both ends of the step (overlap.staged_exposed_time)
    v = L.vpp
    if training.dp_comm_overlap:
        dp_exposed = (staged_exposed_time(rs, v, bwd_window_s / v, L.pp * bwd_window_s / v)
                      + staged_exposed_time(ag, v, fwd_window_s / v, L.pp * fwd_window_s / v))
    else:  # the reduction starts once the backward is done, the gathers end before the forward
        dp_exposed = rs + ag
    moments = moments_bytes(training)
    dense_shards, expert_shards = (L.dp * L.cp, max(1, L.edp)) if L.distributed_optimizer else (
        1, 1)
    shard = dense_params / dense_shards + expert_params / expert_shards
    frac = optimizer_offload_fraction
    opt_s = membound_time(adam_step_bytes(shard * (1 - frac), moments), cluster.hbm_tb_s, cal)
    if frac > 0:
        # offloaded share (Megatron's HybridDeviceOptimizer): fp32 grads down, the host runs
        # Adam over its fp32 master and moments, bf16 params back up. The host step is
        # memory-bound (Adam touches every state once); it runs while the GPU updates its own
        # share, so the slower of the two sides sets the time.
        host_s = adam_step_bytes(shard * frac, 4) / (
            cluster.host_memory_bw_gb_s * cal.host_mem_eff * 1e9)
        opt_s = max(opt_s, C.host_copy_time(shard * frac * 6, cluster) + host_s)
    return StepExtras(pp_exposed, rs, ag, dp_exposed, opt_s)


def fixed_buffer_bytes(model: ModelSpec, training: TrainingSpec, layout: Layout,
                       cal: Calibration, imbalance: float = 1.0, has_moe: bool = True) -> float:
    """Bytes a rank holds outside weights, optimizer and saved activations: the dispatcher's
    send/recv buffers of one MoE layer (at the busiest rank), the TP all-gather buffer, the CUDA
    graphs' memory when the layout captures them, and the fixed workspace. Fragmentation comes on top (`frag_frac` of static + activations)."""
    L = layout
    n_tok = L.mbs * training.seq_len / L.cp
    disp = (2 * BF16 * n_tok / L.tp * model.moe_top_k * L.etp * model.hidden_size * imbalance
            if model.is_moe and has_moe else 0.0)
    tp_buf = BF16 * n_tok * model.hidden_size if L.tp > 1 else 0.0
    graphs = cal.cuda_graph_gb * GB if L.cuda_graphs else 0.0
    return disp + tp_buf + graphs + cal.workspace_gb * GB


EMBEDDING_KINDS = ("E", "L")
"""Layer-table keys of the embedding and the output layer: parameters without an FP8 GEMM."""


def grad_reduce_bytes(training: TrainingSpec) -> int:
    """Bytes per gradient the data-parallel reduction moves: 4 (fp32 main grads, Megatron's
    default) or 2 (`--grad-reduce-in-bf16`)."""
    return 2 if training.grad_reduce_dtype == "bf16" else 4


def moments_bytes(training: TrainingSpec) -> int:
    """Bytes per Adam moment (m and v each): 2 with BF16 moments, else 4."""
    return 2 if training.optimizer_moments_dtype == "bf16" else 4


# ----------------------------------------------------------------------------- estimate
def estimate_breakdown(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    layout: Layout,
    choices: Choices | None = None,
    imbalance: float = 1.0,
    routing_histogram: dict[str, Any] | None = None,
    calibration: dict[str, Any] | None = None,
    check: bool = True,
    with_interval: bool = True,
    target: str = "megatron",
    table: tuple[Mapping[str, LayerCost], Sequence[str]] | None = None,
) -> Breakdown:
    """Predict one layout; see `estimate` (this also returns per-rank and per-layer costs).
    `table`: the layout's per-layer costs at `imbalance` (`layer_table_costs`) when the caller
    holds them already, as a search does (`stage_terms`)."""
    choices = choices or Choices()
    if check:
        check_layout(model, training, layout, cluster.num_gpus or layout.world_size, choices,
                     cluster, target)
    cal = calibration_on(cluster, calibration)
    terms = stage_terms(model, cluster, training, layout, cal, imbalance, routing_histogram,
                        table)
    stages = plan_stages(model, layout, choices)
    ranks = rank_costs(terms, stages, choices)
    warnings = _warnings(terms, stages, choices)
    est, extras = _step_estimate(terms, ranks, choices, warnings)
    if with_interval:
        est = _with_interval(est, model, cluster, training, layout, choices, imbalance,
                             routing_histogram, calibration)
    return Breakdown(est, tuple(ranks), format_stage_layout(stages), terms.costs, extras)


def rank_costs(terms: StageTerms, stages: Sequence[Sequence[str]], choices: Choices
               ) -> list[RankCost]:
    """Every pipeline rank of one stage layout (`specs.stage_layout.plan_stages`: per virtual
    stage, "t" for each decoder layer in model order, "E", "L", "m") under the choices: its
    chunks, per-micro-batch time, static bytes, in-flight activations at its peak and buffers."""
    L, cal = terms.layout, terms.cal
    layer_iter = iter(terms.keys)
    stage_items: list[list[tuple[str, LayerCost]]] = []
    for st in stages:
        items = []
        for ch in st:
            key = next(layer_iter) if ch == "t" else ch
            items.append((key, terms.costs[key]))
        stage_items.append(items)
    ranks: list[RankCost] = []
    # chunks of the same layers under the same choices cost the same: a deep interleaved
    # pipeline (pp 4, vpp 8) has 32 chunks of two or three distinct kinds
    priced: dict[tuple, ChunkCost] = {}

    def chunk(items: list[tuple[str, LayerCost]], rc: list[str], off: list[str]) -> ChunkCost:
        ck = (tuple(k for k, _ in items), tuple(rc), tuple(off))
        if ck not in priced:
            priced[ck] = terms.chunk(items, rc, off)
        return priced[ck]

    for r in range(L.pp):
        rc, off = choices.recompute_for_stage(r), choices.offload_for_stage(r)
        chunks = tuple(chunk(stage_items[v * L.pp + r], rc, off) for v in range(L.vpp))
        static = terms.static(sum(c.dense_params for c in chunks),
                              sum(c.expert_params for c in chunks),
                              choices.optimizer_offload_fraction,
                              sum(terms.costs[k].dense_params for c in chunks for k in c.layers
                                  if k in EMBEDDING_KINDS))
        held = in_flight_chunks(r, L.pp, L.vpp, L.num_microbatches)
        act = sum(chunks[v].activation_bytes for v in held)
        has_moe = terms.model.is_moe and any("moe" in k for c in chunks for k in c.layers)
        buffers = terms.buffer_bytes(has_moe) + cal.frag_frac * (static.total + act)
        host = static.host + sum(chunks[v].offload_bytes for v in held)
        ranks.append(RankCost(r, chunks, sum(c.time_s for c in chunks), static, act, buffers,
                              host))
    return ranks


def _warnings(terms: StageTerms, stages: Sequence[Sequence[str]], choices: Choices) -> list[str]:
    """What the estimate assumed that its user should know: an uneven default stage split,
    routing imbalance, a model family the fit rows bias."""
    model, L, imbs = terms.model, terms.layout, terms.imbalances
    warnings: list[str] = []
    if model.num_layers % (L.pp * L.vpp) and not choices.stage_layout:
        warnings.append(f"{model.num_layers} layers do not split evenly over pp·vpp = "
                        f"{L.pp * L.vpp}; using the balanced layout {format_stage_layout(stages)}")
    if max(imbs, default=1.0) > 1.0:
        warnings.append(f"routing imbalance up to {max(imbs):.2f}× priced at the busiest EP rank")
    if (biased := U.model_warning(model)) is not None:
        warnings.append(biased)
    return warnings


def _step_estimate(terms: StageTerms, ranks: Sequence[RankCost], choices: Choices,
                   warnings: list[str]) -> tuple[Estimate, StepExtras]:
    """The SPEC Estimate of priced ranks: the pipeline schedule over them, the step outside it
    on the critical rank (`StageTerms.rank_extras`), the time split, the memory peak."""
    model, cluster, training, L, cal = (terms.model, terms.cluster, terms.training, terms.layout,
                                        terms.cal)
    m_ = L.num_microbatches
    pipe_s, bubble = pipeline_time([r.time_s for r in ranks], m_, L.vpp)
    crit = max(ranks, key=lambda r: r.time_s)
    extras = terms.rank_extras(crit, choices.optimizer_offload_fraction)
    pp_exposed, dp_exposed, opt_s = extras.pp_exposed_s, extras.dp_exposed_s, extras.optimizer_s
    step = pipe_s + pp_exposed + dp_exposed + opt_s + cal.step_overhead_s
    # a model whose published runs ran slower as a whole than its kernels' work prices
    # (Calibration.model_residual) carries the measured shortfall, named apart from the physics
    residual = cal.residual_for(model.name, training.precision)
    unmodelled = step * (1.0 / residual - 1.0)
    step += unmodelled
    if unmodelled > 0:
        warnings.append(
            f"published {training.precision} runs of {model.name} ran {residual:.2f}x the speed "
            f"the cost models price for their work (the median of its fit rows, a software "
            f"path they do not explain: docs/ACCURACY.md); this estimate carries the "
            f"{unmodelled:.3g} s per step as unmodelled time")

    world = L.world_size
    tokens = training.global_batch_size * training.seq_len
    tflops = model.flops_per_token(training.seq_len) * tokens / step / world / 1e12
    per_mb = {f: m_ * sum(getattr(c, f) for c in crit.chunks)
              for f in ("recompute_s", "offload_s", "exposed_comm_s", "ep_exposed_s", "tp_s",
                        "cp_s", "ep_s")}
    compute = m_ * sum(c.fwd_s + c.bwd_s for c in crit.chunks)
    time = TimeBreakdown(
        compute_s=compute + opt_s, tp_comm_s=per_mb["tp_s"], cp_comm_s=per_mb["cp_s"],
        ep_comm_s=per_mb["ep_s"], dp_comm_s=extras.reduce_scatter_s + extras.all_gather_s,
        pp_bubble_s=bubble, recompute_s=per_mb["recompute_s"], offload_s=per_mb["offload_s"],
        exposed_comm_s=per_mb["exposed_comm_s"] + dp_exposed + pp_exposed)
    memory, fits = _memory(terms, ranks, warnings)
    parts = {"compute": compute, "pipeline bubble": bubble, "recompute": per_mb["recompute_s"],
             "offload": per_mb["offload_s"], "ep communication": per_mb["ep_exposed_s"],
             "tp/cp communication": per_mb["exposed_comm_s"] - per_mb["ep_exposed_s"],
             "dp communication": dp_exposed, "optimizer": opt_s, "unmodelled": unmodelled}
    bottleneck = "memory" if not fits else max(parts, key=lambda k: parts[k])
    est = Estimate(
        step_time_s=step, tokens_per_s_per_gpu=tokens / step / world, tflops_per_gpu=tflops,
        mfu=tflops / cluster.bf16_tflops, memory=memory, time=time, bottleneck=bottleneck,
        fits=fits, warnings=warnings, confidence=_confidence(cal, cluster, training, model),
        unmodelled_s=unmodelled)
    return est, extras


def _memory(terms: StageTerms, ranks: Sequence[RankCost], warnings: list[str]
            ) -> tuple[MemoryBreakdown, bool]:
    """The peak rank's memory and whether it fits (headroom ≥ margin); a warning when not."""
    cluster, cal = terms.cluster, terms.cal
    peak_rank = max(ranks, key=lambda r: r.peak_bytes)
    peak_gb = peak_rank.peak_bytes / GB
    margin = U.memory_margin_gb(peak_gb, cal)
    fits = peak_gb <= U.max_peak_gb(cluster, cal) * (1 + 1e-12)   # ⇔ headroom ≥ margin
    host_rank = max(ranks, key=lambda r: r.host_bytes)
    host_gb = host_rank.host_bytes / GB
    memory = MemoryBreakdown(
        peak_gb=peak_gb, weights_gb=peak_rank.static.weights / GB,
        grads_gb=peak_rank.static.grads / GB, optimizer_gb=peak_rank.static.optimizer / GB,
        activations_gb=peak_rank.activation_bytes / GB, buffers_gb=peak_rank.buffer_bytes / GB,
        margin_gb=margin, headroom_gb=cluster.hbm_gb - peak_gb, host_gb=host_gb)
    if not fits:
        warnings.append(f"peak {peak_gb:.1f} GB on pp rank {peak_rank.rank} leaves "
                        f"{cluster.hbm_gb - peak_gb:.1f} GB of {cluster.hbm_gb:g} GB HBM free, "
                        f"less than the {margin:.1f} GB margin (memory-model error "
                        f"{U.default_profile().memory_rel_error:.0%} of the peak plus "
                        f"{cal.reserve_gb:g} GB reserve)")
    host_room = HOST_USABLE * cluster.host_memory_gb
    if host_gb > host_room * (1 + 1e-12):
        fits = False
        warnings.append(f"pp rank {host_rank.rank} offloads {host_gb:.1f} GB to the host (the "
                        "optimizer's offloaded share with its fp32 gradient copies, and "
                        f"offloaded activations), more than the {host_room:.0f} GB a GPU's "
                        f"process may hold there ({HOST_USABLE:.0%} of the "
                        f"{cluster.host_memory_gb:g} GB of host memory per GPU); offload less")
    return memory, fits


def _with_interval(est: Estimate, model: ModelSpec, cluster: ClusterSpec,
                   training: TrainingSpec, layout: Layout, choices: Choices, imbalance: float,
                   routing_histogram: dict[str, Any] | None,
                   calibration: dict[str, Any] | None,
                   table: tuple[Mapping[str, LayerCost], Sequence[str]] | None = None
                   ) -> Estimate:
    """The estimate with its assumptions and 80 % interval (cost_models.uncertainty): the
    low end is priced with every unvalidated effect disappointing at once. `table`: the
    layout's per-layer costs (`estimate_breakdown`), which a variant that keeps the layout
    and only slows the host link reads with that link (`_on_host`)."""
    terms = U.assumptions(model, cluster, training, layout, choices)
    pess = est.tokens_per_s_per_gpu
    variants = [t.pessimistic for t in U.failing(terms)]
    if variants:
        L, ch, cl = layout, choices, cluster
        for v in variants:
            L, ch, cl = v(L, ch, cl)
        reuse = _on_host(table, cl) if table is not None and layout == L and host_kind(
            cl) == host_kind(cluster) else None
        pess = estimate_breakdown(model, cl, training, L, ch, imbalance, routing_histogram,
                                  calibration, check=False, with_interval=False, table=reuse
                                  ).estimate.tokens_per_s_per_gpu
    keys = U.regime_keys(model, cluster, training.precision, layout)
    measured = U.measured_bounds(cluster)
    far = U.distance(model, cluster, training, layout)
    lo, hi, regime, n = U.tokens_interval(est.tokens_per_s_per_gpu, pess, keys,
                                          measured=measured, far=far)
    prof = U.default_profile()
    widened = [] if measured else U.widen(*prof.bounds(keys)[:2], keys, far, prof)[2]
    # tokens per GPU per step, exact: plans whose intervals share a low end then share a
    # robust key to the last bit, and the search breaks the tie by the expected step time
    # rather than by the rounding of tokens/s × step
    per_step = training.global_batch_size * training.seq_len / layout.world_size
    interval = Interval(level=U.LEVEL, tokens_per_s_per_gpu=(lo, hi),
                        step_time_s=(per_step / hi, per_step / lo),
                        pessimistic_tokens_per_s_per_gpu=pess, regime=regime, rows=n,
                        widened_by=widened)
    return est.model_copy(update={"interval": interval,
                                  "assumptions": [t.assumption for t in terms]})


def _on_host(table: tuple[Mapping[str, LayerCost], Sequence[str]], cluster: ClusterSpec
             ) -> tuple[dict[str, LayerCost], Sequence[str]]:
    """A layer table read on another host link of the same host kind: the link is the only
    thing a layer's costs take from the host (`LayerCost.host_link_gb_s`, for offload copies;
    the launch time goes by the host kind, `host.host_kind`)."""
    costs, keys = table
    return {k: replace(lc, host_link_gb_s=cluster.host_link_gb_s)
            for k, lc in costs.items()}, keys


def estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    layout: Layout,
    choices: Choices | None = None,
    imbalance: float = 1.0,
    routing_histogram: dict[str, Any] | None = None,
    calibration: dict[str, Any] | None = None,
    with_interval: bool = True,
    target: str = "megatron",
    point: Estimate | None = None,
    table: tuple[Mapping[str, LayerCost], Sequence[str]] | None = None,
) -> Estimate:
    """Step time, throughput, MFU, memory peak and bottleneck of one layout (SPEC §4), with
    its 80 % interval and assumptions unless `with_interval` is False (a search ranking by the
    point adds them to the plans it keeps).

    Raises LayoutError naming every rule of the target executor (`specs.rules`) the layout
    breaks; a valid layout that does not fit returns `fits=False`. `point`: this layout's and
    choices' estimate without its interval, already priced (a search's screen), so only the
    interval is added. `table`: the layout's per-layer costs at `imbalance`, when the caller
    holds them (a search's layer table).
    """
    if point is not None and with_interval:
        est = _with_interval(point, model, cluster, training, layout, choices or Choices(),
                             imbalance, routing_histogram, calibration, table)
    else:
        est = estimate_breakdown(model, cluster, training, layout, choices, imbalance,
                                 routing_histogram, calibration, with_interval=with_interval,
                                 target=target, table=table).estimate
    return _routing_said(est, imbalance, routing_histogram is not None)


def _routing_said(est: Estimate, imbalance: float, histogram: bool) -> Estimate:
    """The estimate with the routing it was priced at: the imbalance kept (a plan re-estimated
    prices it again) and, where routing is not balanced, the assumption list saying what was
    priced instead of "balanced routing"."""
    recorded = None if histogram else imbalance  # a histogram is a file, not one number
    if imbalance == 1.0 and not histogram:
        return est.model_copy(update={"imbalance": recorded})
    given = ("per-layer imbalance from the given routing histogram" if histogram else
             f"routing imbalance {imbalance:g}× at the busiest EP rank")
    said = [a if a.term != "balanced routing" else a.model_copy(update={
        "term": given, "evidence": "given (--imbalance or --routing-histogram), priced as "
        "given"}) for a in est.assumptions]
    return est.model_copy(update={"imbalance": recorded, "assumptions": said})


# ----------------------------------------------------------------------------- lower bound
def lower_bound(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                tp: int, cp: int, dp: int, pp: int, ep: int = 1, etp: int = 1,
                calibration: Calibration | None = None,
                params: tuple[float, float] | None = None) -> tuple[float, float]:
    """(step seconds, peak bytes) that no choice of vpp, mbs, recompute, offload or stage layout
    can beat: all model FLOPs at the best efficiency any GEMM or attention kernel reaches and the
    recipe's speed-up applied to all of them, spread perfectly over the GPUs; memory = static
    weights/grads/optimizer of a perfectly balanced stage, activations all offloaded/recomputed.
    Cheap: plain integers in, no layer walk. `params` = `model.bound_params()`, for callers that
    bound thousands of layouts of one model.
    """
    cal = calibration or calibration_for(cluster.calibration)
    world = tp * cp * dp * pp
    peak_lowp = cluster.peak_tflops(training.precision) if training.precision != "bf16" else None
    speed = lowp_speedup(cluster.bf16_tflops, peak_lowp, cal.lowp_gain.get(training.precision, 0))
    arch = cluster.architecture
    gain = attention_length_ceiling(arch)  # the longest kernels' efficiency
    sfu = sfu_gains(cal, arch, cluster.sfu_exp_scale)  # and a faster exponential's
    eff = max(cal.gemm_eff_max_for(cluster), cal.attn_fwd_eff[arch] * gain[0] * sfu[0],
              cal.attn_bwd_eff[arch] * gain[1] * sfu[1])
    tokens = training.global_batch_size * training.seq_len
    flops = model.flops_per_token(training.seq_len) * tokens
    t = flops / (world * cluster.bf16_tflops * 1e12 * eff * speed)
    dense, experts = params or model.bound_params()
    edp = max(1, world // (etp * ep * pp))
    moments = moments_bytes(training)
    st = static_memory(dense / (tp * pp), experts / (ep * etp * pp), dp * cp, edp, moments, True,
                       grad_bytes=grad_reduce_bytes(training))
    return t, st.weights + st.grads
