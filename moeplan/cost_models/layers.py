"""Per-layer costs of one micro-batch on one GPU, split per recompute-able / offload-able module.

This is the unit the planner's MILP works in: for every layer kind (dense layer, MoE layer,
embedding, loss/logits, MTP layer) a `LayerCost` holds compute time forward and backward,
communication before and after overlap, the activation tensors it keeps for backward (each
tagged with the recompute options that discard it and the offload option that moves it to host),
the forward time each recompute option re-runs, and the parameters it puts on this GPU.

Shapes, per micro-batch on one GPU (b micro-batch, s sequence, t/c tensor/context parallel):
  N   = b·s/c        tokens a CP rank processes (GEMM rows inside tensor-parallel regions)
  Nsp = N/t          tokens a rank holds between TP regions (sequence parallelism)
  R   = Nsp·k·etp·ι  routed token copies the most loaded expert rank receives (ι: imbalance)
Activation sizes follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Table 2) re-derived per tensor for SwiGLU, GQA, MLA and flash attention
(which stores q, k, v, the output and the softmax statistics instead of the s² scores).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..specs.cluster import ClusterSpec
from ..specs.layout import Layout
from ..specs.model import ModelSpec
from ..specs.training import TrainingSpec
from . import comm as C
from .calibration import Calibration
from .compute import attended_keys, attention_time, gemm_time, lowp_speedup, membound_time
from .host import (
    AMAX_PASS,
    SYNC_GAP_LAUNCHES,
    after_sync_s,
    floor_excess,
    host_kind,
    layer_launches,
    unfused_rope,
)
from .overlap import overlap_cost

BF16 = 2
T = TypeVar("T")


@dataclass(frozen=True)
class ActTensor:
    """One activation kept for backward: bytes per micro-batch on this GPU, which recompute
    options discard it (`full` discards everything but the layer input), which offload option
    moves it to host memory."""

    name: str
    bytes: float
    recompute_by: frozenset[str] = frozenset()
    offload_by: str | None = None


@dataclass(frozen=True)
class LayerCost:
    """Time and memory of one layer for one micro-batch on one GPU (the most loaded EP rank)."""

    kind: str
    fwd_s: float
    bwd_s: float
    tp_s: float = 0.0
    cp_s: float = 0.0
    ep_s: float = 0.0
    exposed_fwd_s: float = 0.0
    exposed_bwd_s: float = 0.0
    tensors: tuple[ActTensor, ...] = ()
    recompute_fwd_s: Mapping[str, float] = field(default_factory=dict)
    dense_params: float = 0.0
    expert_params: float = 0.0
    host_link_gb_s: float = 0.0  # GPU↔host bandwidth per direction, for offload times
    # extra exposure of a micro-batch that runs without an overlap partner (the warm-up and
    # cool-down of a merged forward/backward schedule): what it exposes minus exposed_fwd/bwd
    edge_exposed_s: float = 0.0
    # kernel-launch overhead of one forward or one backward pass (host-bound gaps between
    # kernels), after the share CUDA graphs capture (`graphed_share`)
    launch_s: float = 0.0

    def exposed_s(self, edge_weight: float = 0.0) -> float:
        """Exposed communication of one micro-batch, the steady state blended with the
        schedule's edge (`overlap.edge_weight`)."""
        return self.exposed_fwd_s + self.exposed_bwd_s + edge_weight * self.edge_exposed_s

    def time_at(self, edge_weight: float = 0.0) -> float:
        """Forward + backward + their launch overheads + exposed communication, no recompute
        or offload."""
        return self.fwd_s + self.bwd_s + 2 * self.launch_s + self.exposed_s(edge_weight)

    @property
    def time_s(self) -> float:
        """Steady-state forward + backward + exposed communication."""
        return self.time_at(0.0)

    def _kept(self, recompute: Iterable[str], offload: Iterable[str]) -> list[ActTensor]:
        rc, off = set(recompute), set(offload)
        if "full" in rc:
            return [t for t in self.tensors if t.name == "layer_input" and t.offload_by not in off]
        return [t for t in self.tensors if not (t.recompute_by & rc) and t.offload_by not in off]

    def activation_bytes(self, recompute: Iterable[str] = (), offload: Iterable[str] = ()
                         ) -> float:
        """Bytes kept on the GPU for backward after the given recompute and offload choices."""
        return sum(t.bytes for t in self._kept(recompute, offload))

    def offload_bytes(self, recompute: Iterable[str] = (), offload: Iterable[str] = ()) -> float:
        """Bytes moved to host (a tensor both recomputed and offloaded is only recomputed)."""
        rc, off = set(recompute), set(offload)
        if "full" in rc:
            return sum(t.bytes for t in self.tensors
                       if t.name == "layer_input" and t.offload_by in off)
        return sum(t.bytes for t in self.tensors if t.offload_by in off and not t.recompute_by & rc)

    def recompute_s(self, recompute: Iterable[str] = ()) -> float:
        """Extra forward time the backward pass spends re-running the chosen modules."""
        rc = set(recompute)
        if "full" in rc:
            return self.recompute_fwd_s.get("full", 0.0)
        return sum(self.recompute_fwd_s.get(r, 0.0) for r in sorted(rc))  # one order: one sum


@dataclass(frozen=True)
class Context:
    """Everything the per-layer functions need, derived once per estimate."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    layout: Layout
    cal: Calibration
    arch: str
    peak: float            # dense BF16 TFLOPS
    speedup: float         # low-precision GEMM speed-up for the GEMMs the recipe covers
    eff_max: float         # the GPU's peak GEMM efficiency
    tp_place: C.GroupPlacement
    cp_place: C.GroupPlacement
    ep_place: C.GroupPlacement
    etp_place: C.GroupPlacement
    # measured GEMM ceilings (ClusterSpec.mamf): the recipe's GEMMs, and those it leaves bf16
    ceiling: float | None = None
    ceiling_bf16: float | None = None
    # per-context results shared by the layer kinds (the attention block of a dense, an MoE and
    # an MTP layer is the same one)
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_tok(self) -> float:  # N: tokens per CP rank per micro-batch
        return self.layout.mbs * self.training.seq_len / self.layout.cp

    @property
    def n_sp(self) -> float:  # Nsp: tokens held between TP regions
        return self.n_tok / self.layout.tp

    @property
    def n_elem(self) -> float:
        """Tokens a rank's norms, dropouts and residual adds run over: Nsp with sequence
        parallelism, every token of the TP group without it (TrainingSpec.sequence_parallel)."""
        return self.n_sp if self.training.sequence_parallel else self.n_tok

    @property
    def lowp(self) -> bool:
        return self.training.precision != "bf16"


def make_context(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                 cal: Calibration) -> Context:
    peak_lowp = cluster.peak_tflops(training.precision) if training.precision != "bf16" else None
    speed = lowp_speedup(cluster.bf16_tflops, peak_lowp, cal.lowp_gain.get(training.precision, 0))
    return Context(
        model, cluster, training, layout, cal, cluster.architecture, cluster.bf16_tflops, speed,
        cal.gemm_eff_max_for(cluster), C.placement(layout, "tp", cluster), C.placement(layout, "cp", cluster),
        C.placement(layout, "ep", cluster), C.placement(layout, "etp", cluster),
        cluster.mamf(training.precision), cluster.mamf("bf16"),
    )


# ----------------------------------------------------------------------------- helpers
def _gemm(ctx: Context, m: float, k: float, n: float, covered: bool = True, count: float = 1
          ) -> float:
    """Forward seconds of a GEMM; `covered` GEMMs run at the precision recipe's speed-up."""
    return gemm_time(m, k, n, ctx.peak, ctx.cal, ctx.eff_max, ctx.speedup if covered else 1.0,
                     count, ctx.cal.half_dim_for(ctx.arch),
                     ctx.ceiling if covered else ctx.ceiling_bf16)


GRAPHED_SHARE = {"dense": 1.0, "moe": 0.5}
"""Share of a decoder layer's kernel launches that Megatron's CUDA graphs capture
(`--cuda-graph-scope attn mlp` for a dense layer, `attn moe_router moe_preprocess` for an MoE
layer): all of a dense layer's; of an MoE layer's, the attention block and the router (about
half its kernels: norm, QKV, RoPE, attention, projection and the router against the permute,
dispatch, grouped GEMMs, activation, combine and unpermute that dropless routing leaves
dynamic-shaped). Embedding and loss are never captured by per-layer graphs; a full-iteration
graph (`Layout.full_iteration_graphs`) captures every kernel of the forward-backward step."""


def graphed_share(kind: str, cuda_graphs: bool, static_moe: bool = False,
                  full_iteration: bool = False) -> float:
    """`GRAPHED_SHARE` of a layer kind; an MoE layer padded to capacity
    (`TrainingSpec.static_moe_shapes`) has no dynamic shape left and is captured whole, as
    a dense layer is (Megatron's `moe` graph scope); under a full-iteration graph every layer
    is (Megatron --cuda-graph-impl full_iteration replays the step's kernels as one graph)."""
    if not cuda_graphs:
        return 0.0
    if full_iteration:
        return 1.0
    return 1.0 if kind == "moe" and static_moe else GRAPHED_SHARE.get(kind, 0.0)


def _layer(ctx: Context, pre_device_s: float | None = None,
           after_sync: tuple[float, ...] = (), **fields: Any) -> LayerCost:
    """A LayerCost, built by keyword, carrying the cluster's host-link bandwidth (for offload
    option times), its forward and backward times raised to the host floor (`host_floor`;
    `pre_device_s`: an MoE layer's forward device time before its routing sync, `after_sync`
    the device seconds of its blocks after it, `host.AFTER_SYNC`) and any fixed
    per-layer overhead a calibration measured (`layer_overhead_s`), less the share CUDA graphs
    capture (an MTP module launches like the layer it wraps)."""
    if "launch_s" not in fields:
        kind = str(fields["kind"])
        share = graphed_share(kind, ctx.layout.cuda_graphs, ctx.training.static_moe_shapes,
                              ctx.layout.full_iteration_graphs)
        fields["launch_s"] = ctx.cal.layer_overhead_s * (1.0 - share)
        up_f, up_b = host_floor(ctx, kind, fields["fwd_s"] + fields.get("exposed_fwd_s", 0.0),
                                fields["bwd_s"] + fields.get("exposed_bwd_s", 0.0),
                                pre_device_s, after_sync)
        fields["fwd_s"] += up_f
        fields["bwd_s"] += up_b
    return LayerCost(**fields, host_link_gb_s=ctx.cluster.host_link_gb_s)


def host_floor(ctx: Context, kind: str, fwd_device_s: float, bwd_device_s: float,
               pre_device_s: float | None = None, after_sync: tuple[float, ...] = ()
               ) -> tuple[float, float]:
    """(forward, backward) seconds the host adds to a layer over its device time, compute plus
    exposed communication (`cost_models.host`): each stretch the host launches without waiting
    takes max(host, device). An MoE layer's forward splits at its routing sync into the
    attention and router part (`pre_device_s`) and the rest, which starts from an empty queue
    after the restart gap and runs as a flow shop over its blocks (`after_sync`, their device
    seconds; `host.after_sync_s`), never below max(host, device) of the whole rest; CUDA
    graphs launch a dense layer, and an MoE layer's part before the sync, as one graph. An MoE
    layer padded to capacity (`TrainingSpec.static_moe_shapes`) has no sync and is captured
    whole, like a dense layer. A full-iteration graph launches the whole step at once: no
    per-kernel host work is left inside it, and its MoE layers have static buffers (HybridEP's
    per-rank token budget), so no routing sync either."""
    if kind not in ("dense", "moe", "loss") or ctx.layout.full_iteration_graphs:
        return 0.0, 0.0
    t = ctx.cal.launch_s(host_kind(ctx.cluster))
    if t <= 0.0:
        return 0.0, 0.0
    n = layer_launches(ctx.model, ctx.layout, ctx.training.precision, kind,
                       ctx.training.fused_moe_kernels, fused_grouped_mlp(ctx))
    graphs = ctx.layout.cuda_graphs and kind != "loss"
    static = kind == "moe" and ctx.training.static_moe_shapes
    if kind != "moe" or static:
        if graphs:  # the whole layer is one graph each way
            return 0.0, 0.0
        # padded to capacity, an MoE layer has no sync: the host runs ahead through it
        return (floor_excess((n.pre + n.post) * t, fwd_device_s),
                floor_excess(n.bwd * t, bwd_device_s))
    pre_d = min(pre_device_s if pre_device_s is not None else 0.0, fwd_device_s)
    pre_h = t if graphs else n.pre * t
    captured = n.pre / (n.pre + n.post) if graphs else 0.0
    # moe_layer always prices its after-sync blocks: a layer without them fails here, loudly
    blocks = tuple(zip(n.after_sync, after_sync, strict=True))
    post = max(after_sync_s(blocks, t) - sum(after_sync),
               floor_excess(n.post * t, fwd_device_s - pre_d) + SYNC_GAP_LAUNCHES * t)
    return (floor_excess(pre_h, pre_d) + post,
            floor_excess(n.bwd * (1.0 - captured) * t, bwd_device_s))


def _tp_exposed(ctx: Context, tp_s: float, gemm_fwd_s: float) -> tuple[float, float]:
    """(forward, backward) exposure of a layer's TP communication: half of it each way. With TP
    comm overlap (Layout.tp_comm_overlap) it runs beside the layer's GEMMs (backward runs twice
    the forward GEMMs), at most the fraction `tp_overlap_hidden` hidden (overlap.exposed_time),
    plus the SM share the hidden part takes; without it, all of it is exposed."""
    if tp_s <= 0.0:
        return 0.0, 0.0
    if not ctx.layout.tp_comm_overlap:
        return tp_s / 2, tp_s / 2
    eta, sm = ctx.cal.tp_overlap_hidden, ctx.cal.sm_fraction(ctx.arch)
    return (overlap_cost(tp_s / 2, gemm_fwd_s, eta, sm),
            overlap_cost(tp_s / 2, 2 * gemm_fwd_s, eta, sm))


def _mem(ctx: Context, nbytes: float) -> float:
    return membound_time(nbytes, ctx.cluster.hbm_tb_s, ctx.cal)


def _norm_add(ctx: Context) -> float:
    """Seconds of one block's norm (read, write) and residual add over the hidden states, bf16
    (10 bytes per element), plus the hidden dropout (read, write, one-byte mask) of the stacks
    that train with it; over Nsp tokens, or all N without sequence parallelism."""
    per = 10 + (5 if ctx.training.dropout else 0)
    return _mem(ctx, per * ctx.n_elem * ctx.model.hidden_size)


def cast_bytes(precision: str) -> float:
    """HBM bytes of quantising one GEMM-input element under `precision` (0 under BF16): the
    bf16 input read, once more first where the recipe's scale needs the tensor's amax
    (`host.AMAX_PASS`), and both quantized copies written (`copy_bytes`)."""
    if precision not in QUANTIZED_BYTES:
        return 0.0
    return (2 if precision in AMAX_PASS else 1) * BF16 + copy_bytes(precision)


def copy_bytes(precision: str) -> float:
    """HBM bytes of writing one quantized GEMM-operand element as training needs it: a row-wise
    copy for the forward (or data-gradient) GEMM and a column-wise one for the weight-gradient
    GEMM, each with its scales (QUANTIZED_BYTES). Transformer Engine's quantizer makes both in
    one pass whenever the weight needs a gradient (FP8's cast-transpose, MXFP8's and NVFP4's
    row-wise and column-wise scaling)."""
    return 2.0 * QUANTIZED_BYTES[precision]


def _cast_bytes(ctx: Context, elems: float) -> float:
    """HBM bytes of quantising `elems` GEMM-input elements (`cast_bytes`)."""
    return elems * cast_bytes(ctx.training.precision)


def _tp_ring(ctx: Context, nbytes: float) -> float:
    return C.ring_time(nbytes, ctx.tp_place, ctx.cluster, ctx.cal)


# bytes per element of a quantized GEMM operand with its scales: FP8 one byte (blockwise an
# fp32 scale per 128, MXFP8 an E8M0 scale per 32), NVFP4 half a byte and an FP8 scale per 16
QUANTIZED_BYTES = {"fp8-delayed": 1.0, "fp8-tensorwise": 1.0, "fp8-blockwise": 1.0 + 4 / 128,
                   "mxfp8": 1.0 + 1 / 32, "nvfp4": 0.5 + 1 / 16}


def _tp_block(ctx: Context, n_tok: float) -> float:
    """Seconds of one block's sequence-parallel collectives (Korthikanti et al. 2022 §4.2.2):
    forward, the all-gather before the column-parallel GEMM and the reduce-scatter after the
    row-parallel one; backward, the reverse. Under an FP8/FP4 recipe Transformer Engine
    quantizes the GEMM input before the forward all-gather and gathers the quantized operand
    (`gather_along_first_dim(..., quantizer=input_quantizer)`, and the userbuffers path
    alike), so that one moves QUANTIZED_BYTES per element; the others carry bf16."""
    if ctx.layout.tp <= 1:
        return 0.0
    elems = n_tok * ctx.model.hidden_size
    gathered = QUANTIZED_BYTES.get(ctx.training.precision, BF16)  # bf16: no quantizing
    return 3 * _tp_ring(ctx, elems * BF16) + _tp_ring(ctx, elems * gathered)


# ----------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class _Attn:
    fwd: float
    bwd: float
    core_fwd: float
    up_fwd: float
    norm_fwd: float
    tp: float
    cp: float
    cp_exposed_fwd: float
    cp_exposed_bwd: float
    tensors: tuple[ActTensor, ...]
    params: float
    gemm_fwd: float  # the GEMMs TP communication can hide behind


def _per_context(fn: Callable[..., T]) -> Callable[..., T]:
    """Compute once per context and arguments: a dense, an MoE and an MTP layer share their
    attention block, and the MTP module repeats the last layer and the loss head."""

    @functools.wraps(fn)
    def cached(ctx: Context, *args: object, **kwargs: object) -> T:
        key = (fn.__name__, args, tuple(sorted(kwargs.items())))
        if key not in ctx.memo:
            ctx.memo[key] = fn(ctx, *args, **kwargs)
        return ctx.memo[key]

    return cached


def cp_kernel_lengths(seq: float, cp: int, window: float | None = None
                      ) -> tuple[tuple[float, float], ...]:
    """(share of the attention work, keys per kernel call) of one rank's attention.

    Without CP one kernel runs over the whole sequence (or the window). Load-balanced causal CP
    (Megatron/TE `AttnFuncWithCPAndKVP2P`) gives each rank two chunks of c = s/(2·cp) tokens
    and runs one kernel per ring step, every step the same work (2c² scores): the diagonal
    step and the steps whose K/V come from a later rank see 2c keys (the rank's full query
    against both K/V chunks, or its second query chunk against them), the steps from an
    earlier rank see c (both query chunks against that rank's first K/V chunk), which is
    (cp − 1)/2 of the cp steps on the average rank. Shorter kernels run at the measured
    fall-off (`compute.attention_length_factors`)."""
    if cp <= 1:
        return ((1.0, seq if window is None else min(seq, window)),)
    c = seq / (2 * cp)
    short = (cp - 1) / (2 * cp)
    lengths = (2 * c, c) if window is None else (min(2 * c, window), min(c, window))
    return ((1.0 - short, lengths[0]), (short, lengths[1]))


def unfused_attention(ctx: Context) -> bool:
    """Whether core attention runs unfused (Transformer Engine `UnfusedDotProductAttention`,
    or Megatron-LM 2021's batched GEMMs around a fused softmax): on the 'megatron-2021' stack
    always; with attention sinks (gpt-oss) on any stack before 'current', as TE takes learnable
    softmax offsets into cuDNN's fused kernel only from cuDNN 9.13.1 (TE PR 2148) and falls
    back before (TE issue 2318)."""
    tr = ctx.training
    return not tr.fused_attention or (ctx.model.attention_sinks and not tr.fused_sink_attention)


def _unfused_attention(ctx: Context, queries: float, keys: float, heads: float, d_qk: float,
                       d_v: float) -> tuple[float, float, float]:
    """(forward s, backward s, scores kept) of unfused attention: QKᵀ and PV as batched GEMMs
    over every key (masks, causal or windowed, cut no work) and the scores streamed through
    HBM between them: a fused scale-mask-softmax reads and writes each bf16 score (4 bytes)
    forward and reads two and writes one backward (6); the 2021–22 stacks also drop out
    attention probabilities as their GPT recipes did (attention dropout 0.1: read, write and
    a one-byte mask, 5 bytes each way). The probabilities are kept for backward."""
    n = heads * queries * keys
    drop = 5 if ctx.training.dropout else 0
    gemm = (_gemm(ctx, queries, d_qk, keys, covered=False, count=heads)
            + _gemm(ctx, queries, keys, d_v, covered=False, count=heads))
    return gemm + _mem(ctx, (4 + drop) * n), 2 * gemm + _mem(ctx, (6 + drop) * n), n


def _unfused_rope(ctx: Context, elems: float) -> tuple[float, float]:
    """(forward s, backward s) RoPE adds over the fused kernel's one read and write (priced
    with the QKV elementwise traffic) when it runs unfused (`host.unfused_rope`) on `elems`
    query and key elements: t·cos, the rotate-half's negation and concat, ·sin, the add and
    the concat with the pass-through dims read 6.5 and write 5.5 bf16 copies forward (24 bytes
    an element, 20 more than fused); autograd's products, negation and sum of the two paths
    about 18 backward (14 more)."""
    if not unfused_rope(ctx.model):
        return 0.0, 0.0
    return _mem(ctx, 20 * elems), _mem(ctx, 14 * elems)


def _expert_bias(ctx: Context, copies: float) -> tuple[float, float]:
    """(forward s, backward s) of the experts' output bias weighted by each copy's routing
    probability in Megatron Core's eager path (`TEGroupedMLP._apply_bias`, the default without
    `moe_single_grouped_bias`): per local expert t + b·p in fp32 (the probabilities are fp32),
    concatenated, cast back to bf16: 28 bytes per routed element forward (b·p written 4; t, b·p
    read 6, sum written 4; concat 8; cast 6); backward the cast (6), the add's bf16 gradient
    (6), and the products and row sums giving b's and p's gradients (12 each): 36. The fused
    grouped MLP adds the weighted bias in its GEMM instead (`scale_bias`): nothing here."""
    if not ctx.model.mlp_bias or fused_grouped_mlp(ctx):
        return 0.0, 0.0
    n = copies * ctx.model.hidden_size
    return _mem(ctx, 28 * n), _mem(ctx, 36 * n)


@_per_context
def attention_block(ctx: Context, sliding: bool) -> _Attn:
    """Input norm + attention (GQA or MLA) + output projection, SP/TP/CP sharded."""
    m, L, t = ctx.model, ctx.layout, ctx.layout.tp
    h, a, N, Nsp = m.hidden_size, m.num_attention_heads, ctx.n_tok, ctx.n_sp
    seq = float(ctx.training.seq_len)
    window = float(m.sliding_window) if sliding and m.sliding_window else None
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim  # type: ignore[operator]
        dv, kvr, qr = m.v_head_dim, m.kv_lora_rank, m.q_lora_rank
        down = (_gemm(ctx, N, h, qr) if qr else 0.0) + _gemm(ctx, N, h, kvr + m.qk_rope_head_dim)
        up = (_gemm(ctx, N, qr, a * qk / t) if qr else _gemm(ctx, N, h, a * qk / t))
        up += _gemm(ctx, N, kvr, a * (m.qk_nope_head_dim + dv) / t)
        proj = _gemm(ctx, N, a * dv / t, h)
        d_qk, d_v, kv_heads = qk, dv, a
        # q and the k/v up-projection outputs; RoPE is applied in place (TE fused RoPE)
        qkv_w = a * (qk + m.qk_nope_head_dim + dv) / t
        down_w = (qr or 0) + kvr + m.qk_rope_head_dim
        gemm_in = N * (h + (qr or 0) + kvr) + N * a * dv / t
    else:
        d = m.head_dim_
        g = m.kv_heads
        down, up = 0.0, _gemm(ctx, N, h, (a + 2 * g) * d / t)
        proj = _gemm(ctx, N, a * d / t, h)
        d_qk = d_v = d
        kv_heads = g
        qkv_w = (a + 2 * g) * d / t
        down_w = 0
        gemm_in = N * h + N * a * d / t
    # core attention: N queries (this CP rank's share; load-balanced CP gives every rank the
    # same causal share) over the keys a tiled kernel computes: (s + B)/2 causal, ⌈(w−1)/B⌉+1
    # tiles under a sliding window w (compute.attended_keys), at the head dim's efficiency
    flops = N * attended_keys(seq, window) * (a / t) * 2 * (d_qk + d_v)
    core_f = core_b = 0.0
    scores = 0.0  # query-key scores an unfused attention keeps for backward
    if unfused_attention(ctx):
        # this rank's queries against every key (over the ring's steps under CP)
        core_f, core_b, scores = _unfused_attention(ctx, N, seq, a / t, d_qk, d_v)
    for share, kv_len in (() if scores else cp_kernel_lengths(seq, ctx.layout.cp, window)):
        f_, b_ = attention_time(share * flops, ctx.peak, ctx.cal, ctx.arch, (d_qk + d_v) / 2,
                                kv_len, windowed=window is not None and kv_len >= window,
                                current_kernels=ctx.training.current_attention_kernels,
                                exp_scale=ctx.cluster.sfu_exp_scale)
        core_f, core_b = core_f + f_, core_b + b_
    norm = _norm_add(ctx)  # norm read/write + residual add, bf16
    elementwise = _mem(ctx, 4 * N * qkv_w + _cast_bytes(ctx, gemm_in))
    rope_f, rope_b = _unfused_rope(ctx, N * (a + kv_heads) / t * d_qk)
    gemm_f = down + up + proj
    fwd = norm + gemm_f + core_f + elementwise + rope_f
    bwd = 2 * (norm + gemm_f + elementwise) + core_b + rope_b
    # TP with sequence parallelism: all-gather before QKV, reduce-scatter after the projection,
    # the reverse in backward (Korthikanti et al. 2022 §4.2.2)
    tp = _tp_block(ctx, N)
    # CP ring: (c−1) K/V chunk exchanges forward, K/V plus their gradients backward
    # (the ring overlaps each exchange with the previous block's attention)
    cp = cp_f = cp_b = 0.0
    if L.cp > 1:
        # each of the c ring steps merges its partial output into an fp32 accumulator with the
        # softmax-statistics correction (read + write), and backward accumulates dQ and dK/dV in
        # fp32 per step (Transformer Engine `AttnFuncWithCPAndKVP2P`; Liu et al. 2023, Ring
        # Attention, Algorithm 1): memory-bound work the single-kernel case does not have
        corr_f = _mem(ctx, L.cp * 8 * N * (a / t) * d_v)
        corr_b = _mem(ctx, L.cp * 8 * N * (a / t * d_qk + kv_heads / t * (d_qk + d_v)))
        core_f, core_b = core_f + corr_f, core_b + corr_b
        fwd, bwd = fwd + corr_f, bwd + corr_b
        kv_bytes = N * kv_heads / t * (d_qk + d_v) * BF16
        step = C.p2p_time(kv_bytes, not ctx.cp_place.inside_nvlink, ctx.cluster, ctx.cal)
        cp = 3 * (L.cp - 1) * step
        cp_f = max(0.0, (L.cp - 1) * step - core_f)
        cp_b = max(0.0, 2 * (L.cp - 1) * step - core_b)
    act = BF16 * Nsp * h
    tensors = [
        ActTensor("layer_input", act, frozenset(), "attn_norm"),
        ActTensor("attn_norm_out", act, frozenset({"layernorm"}), "qkv_linear"),
        ActTensor("qkv", BF16 * N * qkv_w, frozenset({"mla_up_proj"}) if down_w else frozenset(),
                  "core_attn"),
        # unfused attention keeps its bf16 probabilities, and with dropout the mask and the
        # dropped-out copy (Korthikanti et al. 2022: 5·a·s² bytes per sequence)
        ActTensor("attn_stats", 4 * N * a / t + (5 if ctx.training.dropout else BF16) * scores,
                  frozenset({"core_attn"}), "core_attn"),
        ActTensor("attn_out", BF16 * N * a * d_v / t, frozenset(), "attn_proj"),
    ]
    if down_w:
        tensors.append(ActTensor("mla_latents", 2 * BF16 * N * down_w, frozenset(), None))
    tensors.append(ActTensor("mlp_input", act, frozenset(), "mlp_norm"))
    params = m.attention_params() / t + 2 * h
    return _Attn(fwd, bwd, core_f, up + _mem(ctx, 4 * N * qkv_w), norm, tp, cp, cp_f, cp_b,
                 tuple(tensors), params, gemm_f)


# ----------------------------------------------------------------------------- MLPs
def _ffn(ctx: Context, tokens: float, ffn: float, shard: int, count: float = 1.0
         ) -> tuple[float, float, float, float]:
    """(GEMM fwd s, activation-function fwd s, fc1-out elems, act-out elems) of an MLP whose
    intermediate size `ffn` is split `shard` ways, applied to `tokens` rows, `count` times."""
    mult = 2 if ctx.model.gated else 1
    f = ffn / shard
    g = _gemm(ctx, tokens, ctx.model.hidden_size, mult * f, count=count)
    g += _gemm(ctx, tokens, f, ctx.model.hidden_size, count=count)
    fc1, out = count * tokens * mult * f, count * tokens * f
    act = _mem(ctx, BF16 * (fc1 + out) + _cast_bytes(ctx, count * tokens * (ctx.model.hidden_size
                                                                             + f)))
    return g, act, fc1, out


@_per_context
def dense_layer(ctx: Context, sliding: bool = False) -> LayerCost:
    """A decoder layer with a dense MLP (Megatron's first_k_dense layers, dense models)."""
    at = attention_block(ctx, sliding)
    m, t, N, Nsp = ctx.model, ctx.layout.tp, ctx.n_tok, ctx.n_sp
    g, act, fc1, out = _ffn(ctx, N, m.ffn_hidden_size, t)
    norm2 = _norm_add(ctx)
    fwd = at.fwd + g + act + norm2
    bwd = at.bwd + 2 * (g + act + norm2)
    tp = at.tp + _tp_block(ctx, N)
    tensors = at.tensors + (
        ActTensor("mlp_norm_out", BF16 * Nsp * m.hidden_size, frozenset({"layernorm"}), None),
        ActTensor("mlp_fc1_out", BF16 * fc1, frozenset({"mlp"}), None),
        ActTensor("mlp_act_out", BF16 * out, frozenset({"mlp"}), None),
    )
    tp_f, tp_b = _tp_exposed(ctx, tp, at.gemm_fwd + g)
    exp_f, exp_b = tp_f + at.cp_exposed_fwd, tp_b + at.cp_exposed_bwd
    rec = {"core_attn": at.core_fwd, "layernorm": at.norm_fwd + norm2, "mlp": g + act,
           "full": fwd + exp_f}
    if m.attention == "mla":
        rec["mla_up_proj"] = at.up_fwd
    return _layer(ctx, kind="dense", fwd_s=fwd, bwd_s=bwd, tp_s=tp, cp_s=at.cp,
                  exposed_fwd_s=exp_f, exposed_bwd_s=exp_b, tensors=tensors,
                  recompute_fwd_s=rec,
                  dense_params=at.params + m.dense_mlp_params() / t + m.hidden_size)


def _dispatch_time(ctx: Context, token_bytes: float) -> tuple[float, float]:
    """(dispatch, combine) seconds of a rank's tokens of `token_bytes` total over EP. The
    backward of a dispatch is a combine and the backward of a combine a dispatch, so a layer's
    four transfers are two of each; only DeepEP inside a multi-node NVLink domain times them
    differently."""
    m, p, L = ctx.model, ctx.ep_place, ctx.layout
    k = m.moe_top_k
    if L.dispatcher == "allgather":
        t = C.ring_time(p.size * token_bytes, p, ctx.cluster, ctx.cal)
        return t, t
    local = C.GroupPlacement(p.per_domain, p.per_domain, 1)
    if L.dispatcher == "flex" and L.flex_backend == "deepep" and C.multi_node_nvlink(
            p, ctx.cluster):
        hits = C.ranks_hit(m.num_experts or 1, k, p.size, m.router_num_groups,
                           m.router_groups_per_token)
        nv = C.deepep_mnnvl_times(token_bytes, hits, p, ctx.cluster)
    else:
        t = C.all_to_all_time(k * token_bytes, local if L.dispatcher == "flex" else p,
                              ctx.cluster, ctx.cal)
        nv = (t, t)
    if L.dispatcher != "flex" or p.inside_nvlink:
        return nv
    d = p.domains
    # the domains a token's experts fall in (group-limited routing included), one of them its own
    distinct = C.ranks_hit(m.num_experts or 1, k, d, m.router_num_groups,
                           m.router_groups_per_token)
    remote = distinct * (d - 1) / d                 # copies that cross the scale-out NICs
    t_so = (remote * token_bytes / (ctx.cluster.scaleout_gb_s * ctx.cal.a2a_scaleout_eff * 1e9)
            + ctx.cluster.scaleout_latency_us * 1e-6)
    return max(t_so, nv[0]), max(t_so, nv[1])


PAGED_STASH_BUFFER = 1.10
"""Megatron Core's paged stash (`--moe-paged-stash`, what a full-iteration graph of a dropless
MoE layer keeps the experts' activations in): one buffer sized at this factor of the average
tokens the layers stash (`moe_paged_stash_buffer_size_factor_cuda`, default 1.10,
transformer_config.py at d98e8a6)."""


def fused_grouped_mlp(ctx: Context) -> bool:
    """Whether the experts run as Transformer Engine's fused grouped MLP
    (`Layout.fused_grouped_mlp`): a quantizing recipe and a gated activation, the two things
    its epilogue fuses (`specs.rules` names what else Megatron Core demands of it)."""
    return ctx.layout.fused_grouped_mlp and ctx.lowp and ctx.model.gated


def _expert_act(ctx: Context, routed: float, f: float, act: float) -> tuple[float, float]:
    """(activation seconds, fc2-operand quantize seconds) of the experts' `routed` copies at
    intermediate size `f` per rank, given the unfused activation time `act` (`_ffn`).

    Unfused, the activation kernel reads the fc1 output and writes its own (bf16), and a
    quantize kernel per GEMM operand reads bf16 and writes its quantized copies (`_cast_bytes`).
    The fused grouped MLP keeps the fc1 operand's grouped quantize and writes the activated
    output once, already quantized, from the fc1 GEMM's epilogue: the row-wise and column-wise
    copies (the fc2 GEMM's and its weight gradient's, `copy_bytes`), and nothing else
    (Transformer Engine `ops/fused/grouped_mlp.py`: `fc1_kernel_out` `d_tensor` and
    `d_col_tensor`; the backward's activation gradient and quantisation sit in the fc2
    data-gradient GEMM's epilogue the same way)."""
    q2 = _mem(ctx, _cast_bytes(ctx, routed * f))
    if not fused_grouped_mlp(ctx):
        return act, q2
    h = ctx.model.hidden_size
    written = copy_bytes(ctx.training.precision) * routed * f
    return _mem(ctx, _cast_bytes(ctx, routed * h) + written), 0.0


def paged_stash_factor(ctx: Context) -> float:
    """How much more the experts' saved activations take than their tokens: the paged stash's
    buffer factor under a full-iteration graph of a dropless MoE layer, else 1."""
    if ctx.layout.full_iteration_graphs and not ctx.training.static_moe_shapes:
        return PAGED_STASH_BUFFER
    return 1.0


@_per_context
def moe_layer(ctx: Context, sliding: bool = False, imbalance: float = 1.0) -> LayerCost:
    """A decoder layer with an MoE block: router, dispatch (EP all-to-all, ETP all-gather),
    grouped expert GEMMs over the tokens each local expert receives, combine, shared experts.

    Saved activations: the dispatched expert input (R·h), FC1 output (R·2f_e/etp), SwiGLU output
    (R·f_e/etp), router probabilities; the routing probabilities are applied inside the expert
    activation, so the unpermute keeps no copy of the expert output (with this the DeepSeek-V3
    anatomy of the Megatron Core MoE report is matched; see docs/ACCURACY.md).
    Dispatchers: `alltoall` sends each routed copy to its rank; `flex` (DeepEP/HybridEP) sends
    one copy per token per remote NVLink domain and fans out over NVLink, so scale-out traffic is
    the expected number of distinct remote domains a token's k experts fall in (capped by
    group-limited routing); `allgather` all-gathers the EP group's tokens and reduce-scatters
    the outputs.
    """
    at = attention_block(ctx, sliding)
    m, L, t = ctx.model, ctx.layout, ctx.layout.tp
    h, N, Nsp, k = m.hidden_size, ctx.n_tok, ctx.n_sp, m.moe_top_k
    fe = m.moe_ffn_hidden_size or 0
    local_experts = m.num_experts // L.ep
    R = Nsp * k * L.etp * imbalance                  # routed copies on the busiest rank
    per_expert = R / local_experts
    g_e, act_e, fc1_e, out_e = _ffn(ctx, per_expert, fe, L.etp, count=local_experts)
    act_e, q2 = _expert_act(ctx, R, fe / L.etp, act_e)
    # router: logits GEMM, then top-k, softmax and the aux loss over the fp32 logits: one
    # fused kernel's traffic (12 bytes per logit), or about six separate PyTorch passes (48)
    # on a stack without the fusions; permute + unpermute read and write each routed copy (bf16), or
    # twice that unfused (argsort + index_select, then a scatter-add with the probabilities)
    unfused = not ctx.training.fused_moe_kernels
    router = (_gemm(ctx, Nsp, h, m.num_experts, covered=False)
              + _mem(ctx, (48 if unfused else 12) * Nsp * m.num_experts))
    perm = _mem(ctx, (2 if unfused else 1) * 2 * 4 * R * h)
    shared_g = shared_act = 0.0
    sh_fc1 = sh_out = 0.0
    if m.num_shared_experts:
        shared_g, shared_act, sh_fc1, sh_out = _ffn(ctx, N, m.shared_expert_ffn_hidden_size or 0, t)
    norm2 = _mem(ctx, 10 * Nsp * h)
    bias_f, bias_b = _expert_bias(ctx, R)
    moe_f = router + perm + g_e + act_e
    fwd = at.fwd + norm2 + moe_f + shared_g + shared_act + bias_f
    bwd = at.bwd + 2 * (norm2 + moe_f + shared_g + shared_act) + bias_b
    # EP: dispatch + combine forward, the same backward, at the busiest rank (imbalance)
    dispatch, combine = _dispatch_time(ctx, Nsp * h * BF16 * imbalance)
    etp = C.ring_time(R * h * BF16, ctx.etp_place, ctx.cluster, ctx.cal) if L.etp > 1 else 0.0
    # forward dispatch and combine, then their backwards: a combine and a dispatch
    transfers = (dispatch + etp, combine + etp, combine + etp, dispatch + etp)
    ep = sum(transfers)
    tp = at.tp + (_tp_block(ctx, N) if m.num_shared_experts else 0.0)
    tp_f, tp_b = _tp_exposed(ctx, tp, at.gemm_fwd + g_e + shared_g)
    # EP overlap (Megatron Core's merged 1F1B, `--overlap-moe-expert-parallel-comm`): the
    # forward of one micro-batch runs beside the backward of another, layer by layer, and each
    # transfer beside one compute block of the other pass (the DeepSeek-V3 report's pairing,
    # §3.2.1 Figure 4): forward dispatch beside the MLP backward, backward dispatch beside the
    # MLP forward, forward combine beside the attention backward, backward combine beside the
    # attention forward. A transfer hides only behind its own partner, so a layer whose
    # attention is short exposes its combines even when the layer as a whole has time to spare.
    # Without overlap, dispatch feeds the experts and combine feeds the next layer: all of it is
    # on the critical path. A micro-batch with no partner (warm-up, cool-down) exposes all of
    # it: `edge_exposed_s`.
    mlp_f = norm2 + moe_f + shared_g + shared_act + bias_f
    eta, sm = ctx.cal.ep_overlap_hidden, ctx.cal.sm_fraction(ctx.arch)
    # transfers: forward dispatch, backward dispatch (a combine), forward combine, backward
    # combine (a dispatch)
    exposed = ([overlap_cost(x, beside, eta, sm)
                for x, beside in zip(transfers, (2 * mlp_f, mlp_f, at.bwd, at.fwd), strict=True)]
               if L.ep_overlap else list(transfers))
    ep_exp = sum(exposed)
    exp_f = tp_f + at.cp_exposed_fwd + ep_exp / 2
    exp_b = tp_b + at.cp_exposed_bwd + ep_exp / 2
    stash = paged_stash_factor(ctx)
    tensors = at.tensors + (
        ActTensor("mlp_norm_out", BF16 * Nsp * h, frozenset({"layernorm"}), None),
        ActTensor("router_probs", 4 * 2 * Nsp * m.num_experts, frozenset({"moe"}), None),
        ActTensor("expert_fc1_in", stash * BF16 * R * h, frozenset({"moe"}), "expert_fc1"),
        ActTensor("expert_fc1_out", stash * BF16 * fc1_e, frozenset({"moe"}), None),
        ActTensor("expert_act_out", stash * BF16 * out_e, frozenset({"moe", "moe_act"}),
                  "moe_act"),
        ActTensor("shared_fc1_out", BF16 * sh_fc1, frozenset({"shared_experts"}), None),
        ActTensor("shared_act_out", BF16 * sh_out, frozenset({"shared_experts"}), None),
    )
    rec = {"core_attn": at.core_fwd, "layernorm": at.norm_fwd + norm2, "moe_act": act_e,
           "moe": moe_f + bias_f + ep_exp / 2, "full": fwd + exp_f}
    if m.num_shared_experts:
        rec["shared_experts"] = shared_g + shared_act
    if m.attention == "mla":
        rec["mla_up_proj"] = at.up_fwd
    dense = at.params + m.router_params() + m.shared_expert_params() / t + h
    experts = m.num_experts * m.expert_params() / (L.ep * L.etp)
    # the forward after the routing sync, block by block (host.AFTER_SYNC): the experts' GEMMs
    # split by their FLOPs (fc1 is `mult` times fc2), the quantize kernels' traffic out of the
    # activation's
    mult = 2 if m.gated else 1
    q1 = _mem(ctx, _cast_bytes(ctx, R * h))
    after_sync = (perm / 2 + exposed[0], q1, g_e * mult / (mult + 1),
                  max(0.0, act_e - q1 - q2) + bias_f, q2, g_e / (mult + 1),
                  perm / 2 + exposed[2] + norm2 + shared_g + shared_act)
    return _layer(ctx, pre_device_s=at.fwd + norm2 + router + tp_f / 2 + at.cp_exposed_fwd,
                  after_sync=after_sync, kind="moe", fwd_s=fwd, bwd_s=bwd, tp_s=tp, cp_s=at.cp,
                  ep_s=ep,
                  exposed_fwd_s=exp_f, exposed_bwd_s=exp_b, tensors=tensors, recompute_fwd_s=rec,
                  dense_params=dense, expert_params=experts, edge_exposed_s=ep - ep_exp)


@_per_context
def embedding_layer(ctx: Context) -> LayerCost:
    """Vocab-parallel embedding lookup (a reduce-scatter over TP with SP), no GEMM."""
    m, t, N = ctx.model, ctx.layout.tp, ctx.n_tok
    fwd = _mem(ctx, 2 * BF16 * N * m.hidden_size)
    tp = 2 * _tp_ring(ctx, N * m.hidden_size * BF16) if t > 1 else 0.0
    tensors = (ActTensor("token_ids", 8 * N, frozenset(), None),)
    # no GEMM to hide behind: the lookup's reduce-scatter (and its backward) is exposed
    return _layer(ctx, kind="embedding", fwd_s=fwd, bwd_s=2 * fwd, tp_s=tp,
                  exposed_fwd_s=tp / 2, exposed_bwd_s=tp / 2, tensors=tensors,
                  dense_params=m.embedding_params() / t)


@_per_context
def loss_layer(ctx: Context, heads: int = 1) -> LayerCost:
    """Final norm, output layer (N×h by h×V/t GEMM, BF16 in Megatron's FP8 recipes) and
    vocab-parallel cross-entropy, for `heads` output heads (the main one; MTP adds its own
    through `mtp_layer`). Kept for backward: the fp32 softmax of the logits (Megatron's
    vocab-parallel cross-entropy saves it), N·V/t·4 bytes."""
    m, t, N, Nsp = ctx.model, ctx.layout.tp, ctx.n_tok, ctx.n_sp
    h, V = m.hidden_size, m.vocab_size
    g = _gemm(ctx, N, h, V / t, covered=False, count=heads)
    # fused cross-entropy: two reads of the bf16 logits forward (max, sum-exp), a read and a
    # gradient write backward
    ce = _mem(ctx, heads * 2 * BF16 * N * V / t)
    norm = _mem(ctx, 10 * Nsp * h)
    fwd = g + ce + norm
    bwd = 2 * g + ce + 2 * norm
    tp = 2 * _tp_ring(ctx, N * h * BF16) if t > 1 else 0.0
    tensors = (ActTensor("layer_input", BF16 * Nsp * h, frozenset(), None),
               ActTensor("logits_fp32", heads * 4 * N * V / t, frozenset(), None))
    params = (0 if m.tie_embeddings and ctx.layout.pp == 1 else V * h) / t + h
    tp_f, tp_b = _tp_exposed(ctx, tp, g)
    return _layer(ctx, kind="loss", fwd_s=fwd, bwd_s=bwd, tp_s=tp, exposed_fwd_s=tp_f,
                  exposed_bwd_s=tp_b, tensors=tensors, recompute_fwd_s={"full": fwd},
                  dense_params=params)


def mtp_layer(ctx: Context, imbalance: float = 1.0) -> LayerCost:
    """One multi-token-prediction module (DeepSeek-V3 §2.2): two norms, the 2h→h projection,
    one decoder layer of the last layer's kind, and its own logits and loss."""
    m = ctx.model
    body = moe_layer(ctx, False, imbalance) if m.moe_layers()[-1] else dense_layer(ctx, False)
    head = loss_layer(ctx)
    N, h, t = ctx.n_tok, m.hidden_size, ctx.layout.tp
    proj = _gemm(ctx, N, 2 * h, h / t) + _mem(ctx, 20 * ctx.n_sp * h)
    fwd = body.fwd_s + head.fwd_s + proj
    bwd = body.bwd_s + head.bwd_s + 2 * proj
    extra = (ActTensor("mtp_concat", BF16 * N * 2 * h / t, frozenset(), None),)
    rec = dict(body.recompute_fwd_s)
    rec["full"] = rec.get("full", 0.0) + proj
    return _layer(
        ctx, kind="mtp", fwd_s=fwd, bwd_s=bwd, tp_s=body.tp_s + head.tp_s, cp_s=body.cp_s,
        ep_s=body.ep_s, exposed_fwd_s=body.exposed_fwd_s + head.exposed_fwd_s,
        exposed_bwd_s=body.exposed_bwd_s + head.exposed_bwd_s,
        tensors=body.tensors + head.tensors[1:] + extra, recompute_fwd_s=rec,
        dense_params=body.dense_params + 2 * h * h / t + 3 * h,
        expert_params=body.expert_params, edge_exposed_s=body.edge_exposed_s,
        launch_s=body.launch_s)
