"""Cost models: time and memory of any layout, as pure functions of the specs.

No torch, no I/O (the shipped calibration profile `calibration.json` is the one file read).
Every function cites its formula's source; breakdowns are frozen dataclasses.

Modules
-------
compute      GEMM FLOPs and shape-dependent efficiency, attention core, memory-bound bytes
comm         NVLink domains, rank placement (specs.grid.RankGrid), α–β collectives
memory       weights / grads / optimizer bytes (distributed optimizer sharding)
pipeline     1F1B and interleaved step time, in-flight micro-batches per rank
layers       per-layer, per-micro-batch costs split per recompute/offload module
estimate     the whole step: `estimate`, `estimate_breakdown`, `lower_bound`, and the per-rank
             step function `stage_terms` the planner's MILP prices stages with
breakdown    the frozen per-chunk, per-rank and whole-step results of `estimate_breakdown`
calibration  the efficiency constants (shipped JSON, overridable per cluster)

API for the planner
-------------------
Per layout (a `Layout`; choices are what the planner decides):

``make_context(model, cluster, training, layout, cal) -> Context``
    Derived shapes and group placements, computed once per layout. ``cal`` is
    ``calibration_for(cluster.calibration)``.

``dense_layer(ctx, sliding=False)``, ``moe_layer(ctx, sliding=False, imbalance=1.0)``,
``embedding_layer(ctx)``, ``loss_layer(ctx)``, ``mtp_layer(ctx, imbalance=1.0)`` -> ``LayerCost``
    One layer for one micro-batch on one GPU (the busiest EP rank). Fields: ``fwd_s``, ``bwd_s``
    (compute incl. memory-bound work), ``tp_s``/``cp_s``/``ep_s`` (collectives before overlap),
    ``exposed_fwd_s``/``exposed_bwd_s`` (what overlap leaves), ``tensors`` (every saved
    activation as ``ActTensor(name, bytes, recompute_by, offload_by)``), ``recompute_fwd_s``
    (option -> forward seconds re-run), ``dense_params``/``expert_params`` on this GPU.
    Methods: ``activation_bytes(recompute, offload)``, ``offload_bytes(recompute, offload)``,
    ``recompute_s(recompute)`` — exact for any combination — and ``options()`` ->
    ``{"recompute": {name: (bytes_saved, seconds)}, "offload": {name: (bytes, 0.0)}}`` for
    each option alone (a tensor dropped by two options is counted in both: add a
    "tensor kept" variable per tensor in the MILP, or use the exact methods to check).
    The MoE layer's EP time follows ``layout.dispatcher`` (alltoall, flex with per-domain
    de-duplication, allgather) and is priced at the busiest EP rank (``imbalance``).
    Recompute names: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts,
    full; offload names: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1,
    moe_act. Offload time is ``comm.host_copy_time(bytes, cluster)`` each way, hidden behind the
    layer's own forward (device-to-host) and backward (host-to-device).

``layer_imbalances(model, ep, imbalance, histogram) -> [per decoder layer]`` and
``layer_costs(ctx, imbalances) -> ({kind key: LayerCost}, [key per decoder layer])``
    The whole per-layout table at once (layer kinds deduplicated; "E", "L", "m" included);
    ``layer_table_costs(ctx, imbalance, histogram)`` is the two in one call.

``stage_terms(model, cluster, training, layout, cal, imbalance, histogram, table=None)
-> StageTerms``
    The one per-rank step function: item times at the schedule's edge weight, the passes each
    item's offload copies hide behind, static bytes and buffers of a rank's parameters, the
    memory budget, the step outside the pipeline. ``estimate_breakdown`` adds a plan's ranks
    up from it and the planner's MILP prices every stage split from it.

``static_memory(dense_params, expert_params, dense_shards=dp·cp, expert_shards=edp,
moments_bytes=4, distributed_optimizer=True, optimizer_offload_fraction=0.0, grad_bytes=4,
gemm_weight_bytes=2.0, embedding_params=0.0) -> StaticMemory``
    Weights, grads, optimizer bytes of a stage (sum the layers' params); `grad_bytes` is
    ``estimate.grad_reduce_bytes(training)`` (2 when gradients are reduced in bf16),
    `gemm_weight_bytes` is ``memory.weight_bytes`` (an FP8/FP4 recipe's quantized copies);
    ``StageTerms.static`` fills in the layout's shards and the training's byte widths.

``pipeline_time(rank_times, num_microbatches, vpp) -> (step_s, bubble_s)`` and
``in_flight_chunks(rank, pp, vpp, m) -> [chunk index per in-flight forward]``
    Step time from per-rank times, and which chunks' activations a rank holds at its peak.

``estimate_breakdown(model, cluster, training, layout, choices, ...) -> Breakdown``
    The whole step (``.estimate`` is the SPEC Estimate; ``.ranks`` per pp rank; ``.layer_costs``).

Lower bounds (cheap, plain integers):

``lower_bound(model, cluster, training, tp, cp, dp, pp, ep=1, etp=1) -> (seconds, bytes)``
    No vpp, mbs, recompute, offload or stage layout beats it: all model FLOPs at the best
    kernel efficiency with the recipe's speed-up on all of them; weights + grads of a perfectly
    balanced stage (optimizer states and activations may be offloaded or recomputed away).
"""

from .breakdown import Breakdown, ChunkCost, RankCost, StepExtras
from .calibration import Calibration, calibration_for, default_calibration
from .comm import GroupPlacement, group_ranks, placement
from .estimate import (
    StageTerms,
    estimate,
    estimate_breakdown,
    imbalance_from_histogram,
    layer_costs,
    layer_imbalances,
    layer_table_costs,
    lower_bound,
    stage_terms,
)
from .layers import (
    ActTensor,
    Context,
    LayerCost,
    dense_layer,
    embedding_layer,
    loss_layer,
    make_context,
    moe_layer,
    mtp_layer,
)
from .memory import StaticMemory, static_memory
from .pipeline import bubble_fraction, in_flight_chunks, pipeline_time

__all__ = [
    "ActTensor", "Breakdown", "Calibration", "ChunkCost", "Context", "GroupPlacement",
    "LayerCost", "RankCost", "StageTerms", "StaticMemory", "StepExtras", "bubble_fraction", "calibration_for",
    "default_calibration", "dense_layer", "embedding_layer", "estimate", "estimate_breakdown",
    "group_ranks", "imbalance_from_histogram", "in_flight_chunks", "layer_costs",
    "layer_imbalances", "layer_table_costs", "loss_layer", "lower_bound",
    "make_context", "moe_layer", "mtp_layer", "pipeline_time", "placement", "stage_terms", "static_memory",
]
