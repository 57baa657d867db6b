"""The host floor: a layer cannot run faster than its host launches its kernels.

Megatron Core runs each layer as eager PyTorch: every kernel costs the host a fixed time
(Python module code, the PyTorch dispatcher, `cudaLaunchKernel`), whatever the kernel's size.
NVIDIA's Nsight Systems guide measures that round trip at about 20 µs for one PyTorch
element-wise kernel (V100-era host), the CUDA launch itself at 4–6 µs of it. While the host is
ahead, launches hide behind device work; a layer whose kernels are small (a fine-grained MoE
at micro-batch 1, an FP8 recipe that doubles the kernels and halves their time) becomes
host-bound, and its time is the host's, not the device's: the floor is a max with the device
time, never a sum.

Three things move the floor (Megatron Core MoE report, arXiv 2603.07685, §4.3.6–4.3.7):
- The kernel count (`layer_launches`), counted module by module as Megatron Core + Transformer
  Engine launch them with their fused kernels on (fused RoPE, cuDNN attention, fused bias-SwiGLU,
  `--moe-router-fusion`, `--moe-permute-fusion`). A grouped expert GEMM of Transformer Engine's
  `GroupedLinear` launches one GEMM per local expert (forward; data and weight gradient in
  backward), so the count grows with the experts a rank holds. FP8, MXFP8 and NVFP4 recipes
  quantize each activation operand before its GEMM and each output gradient before the backward
  GEMMs (`quantize_launches`): current scaling in three kernels per tensor (amax, scale, cast),
  the others in one; a grouped operand (`GroupedLinear`, `tex.split_quantize`) expert by
  expert, except delayed scaling's and NVFP4's fused multi-tensor kernels.
- Host syncs of dropless routing. The all-to-all split sizes and the grouped GEMM's
  `m_splits` are host values computed from the router's device histogram, so each MoE
  layer's forward waits for the device once (Megatron's `cuda_sync_point`,
  "before_ep_alltoall"): the host stops running ahead, and the layer's forward becomes two
  segments. The first is its own max of host and device time; the second starts with an empty
  queue, after the restart gap (the device idles until the host's next launch reaches it,
  ≈ 2 launches), and runs as a flow shop (`after_sync_s`): with no lead left, each run of short
  kernels (a quantize kernel per local expert) starves the device for its launches. Backward
  reuses the saved splits.
  Token dropping padded to capacity (`TrainingSpec.static_moe_shapes`) has static shapes and
  no sync; a capacity factor without padding keeps it.
- CUDA graphs: a captured region launches as one graph (the whole dense layer, and the whole
  MoE layer padded to capacity; of a dropless MoE layer, the attention block and router, the
  part before its sync: `layers.host_floor`).

The per-launch host time is `Calibration.launch_us`, per host CPU (x86 beside PCIe GPUs, Grace
beside NVL72 GPUs over NVLink-C2C), fitted within physical bounds or measured by
`moeplan calibrate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..specs.cluster import ClusterSpec
from ..specs.layout import Layout
from ..specs.model import ModelSpec

GRACE_C2C_GB_S = 100.0
"""A host link faster than this is NVLink-C2C (a Grace CPU; PCIe Gen5 x16 carries 64 GB/s)."""

SYNC_GAP_LAUNCHES = 2.0
"""Device idle after a host sync, in launches: the host's next launch must reach an empty queue."""

# forward kernel launches per module, Megatron Core + Transformer Engine with fused kernels
ATTN_GQA = 6     # LayerNormLinear (norm, QKV GEMM), fused RoPE, cuDNN attention, proj, add
ATTN_MLA = 13    # q/kv down GEMMs and norms, q/kv up GEMMs, two RoPE, concat, attention, proj, add
DENSE_MLP = 5    # LayerNormLinear (norm, fc1), bias-SwiGLU, fc2, add
TP_COLLECTIVES = 2   # sequence parallelism: all-gather in, reduce-scatter out, per block
# MoE block around its experts: norm, router GEMM, fused top-k/softmax/aux-loss (2), counts
# (histogram, all-gather, device-to-host copy), fused permute, all-to-all, chunk sort, fused
# activation, chunk unsort, all-to-all, fused unpermute, add
MOE_FIXED = 15
SHARED_EXPERT = 4    # fc1, SwiGLU, fc2, add of the shared experts (a dense MLP beside them)
CP_STEP = 3          # per context-parallel ring step: attention kernel, K/V send/recv, correction
LOSS = 8             # final norm, output GEMM, vocab-parallel cross-entropy pieces
BWD_FACTOR = 2.0     # each non-GEMM forward kernel has about two backward kernels
# without Megatron's MoE fusions (TrainingSpec.fused_moe_kernels), the router (softmax, top-k,
# aux-loss pieces) and the permutation (argsort, index_select, scatter-add, the probabilities'
# multiply) as separate kernels
UNFUSED_MOE = 12
# RoPE outside TE's fused kernel (`unfused_rope`), per call on q and on k: cos and sin of the
# angles, each scaled and cast (6), t·cos, rotate-half (neg, cat), ·sin, add, the concat with
# the pass-through dims (6): 24 forward kernels in place of one; 5 per call backward
UNFUSED_ROPE_FWD, UNFUSED_ROPE_BWD = 23, 10
# experts' output bias weighted by the routing probability in Megatron Core's eager path
# (TEGroupedMLP._apply_bias): per local expert bias·prob and the add forward, then one concat
# and one cast; backward the cast, the two products and the two reductions per expert
EXPERT_BIAS_FWD, EXPERT_BIAS_BWD = 2, 5


def unfused_rope(model: ModelSpec) -> bool:
    """Whether Megatron Core applies RoPE with separate PyTorch kernels: yarn with a cos/sin
    factor other than 1 (gpt-oss's get_mscale(32) = 1.347), which Transformer Engine's fused
    RoPE does not take (`rope_utils.apply_rotary_pos_emb`: "mscale ... is not supported by TE's
    fused RoPE. Using unfused implementation."). MLA's decoupled RoPE is not priced here."""
    r = model.rope_scaling
    return (model.attention != "mla" and r is not None and r.kind == "yarn"
            and abs(r.yarn_attention_factor() - 1.0) > 1e-9)


def host_kind(cluster: ClusterSpec) -> str:
    """'grace' for GPUs beside a Grace CPU (NVLink-C2C host link), else 'x86'."""
    return "grace" if cluster.host_link_gb_s > GRACE_C2C_GB_S else "x86"


@dataclass(frozen=True)
class Launches:
    """Kernel launches of one layer per micro-batch: forward before the MoE sync (`pre`) and
    after it (`post`; zero for a layer without one), backward, and the host syncs. An MoE
    layer's `after_sync` splits `post` into the blocks it launches in order (`AFTER_SYNC`)."""

    pre: float
    post: float
    bwd: float
    syncs: int = 0
    after_sync: tuple[float, ...] = ()


AFTER_SYNC = ("dispatch", "fc1 quantize", "fc1", "activation", "fc2 quantize", "fc2", "combine")
"""The launch blocks of a dropless MoE layer's forward after its routing sync, in launch order:
the routing counts, permute, all-to-all and chunk sort; the fc1 operand's quantize kernels (per
local expert unless the recipe fuses them); the fc1 GEMMs, one per local expert; the fused
activation (and the experts' biases); the fc2 operand's quantize kernels and GEMMs; then the
chunk unsort, all-to-all, unpermute, residual add and the shared experts."""


def after_sync_s(blocks: tuple[tuple[float, float], ...], launch_s: float) -> float:
    """Seconds from a host sync until the device finishes `blocks`, each (launches, device
    seconds) spread evenly over its kernels, in launch order.

    The sync empties the device's queue and the host's lead with it, so from there the two run
    as a two-stage flow shop: kernel i starts when the host has launched it and the device has
    finished kernel i − 1. The host restarts after the restart gap (`SYNC_GAP_LAUNCHES`); a run
    of n kernels of device time k each, launched every `launch_s`, then ends at the latest of
    the device's own pace, the host's first launch plus the run's device time, and the host's
    last launch plus one kernel. So a block of short kernels (a quantize kernel per expert)
    starves the device for its launches even when the layer's total host time is below its
    device time, which max(host, device) over the whole stretch cannot see."""
    host = (SYNC_GAP_LAUNCHES - 1.0) * launch_s
    end = 0.0
    for n, d in blocks:
        if n <= 0:
            end += d
            continue
        end = max(end + d, host + launch_s + d, host + n * launch_s + d / n)
        host += n * launch_s
    return end


def attention_launches(model: ModelSpec, layout: Layout) -> tuple[float, int]:
    """(forward launches, of which GEMMs) of the attention block."""
    n, gemms = (ATTN_MLA, 5) if model.attention == "mla" else (ATTN_GQA, 2)
    if unfused_rope(model):
        n += UNFUSED_ROPE_FWD
    if layout.tp > 1:
        n += TP_COLLECTIVES
    if layout.cp > 1:
        n += CP_STEP * layout.cp - 1  # one attention kernel per ring step instead of one
    return n, gemms


AMAX_PASS = frozenset({"fp8-tensorwise", "nvfp4"})
"""Recipes whose scale needs the whole tensor's amax before the cast, in a kernel of its own
that reads the input once more: FP8 current scaling (`Float8CurrentScalingQuantizer::
quantize_impl`: `nvte_compute_amax`, then the scale, then the cast) and NVFP4's per-tensor
second-level scale (`NVFP4Quantizer::quantize_impl`: `nvte_compute_amax` or, with the random
Hadamard transform, `nvte_hadamard_transform_amax`; grouped, their multi-tensor forms).
Delayed scaling takes its scale from the amax history and MXFP8 and blockwise FP8 their
local scales inside the cast (Transformer Engine `csrc/quantizer.cpp`, `extensions/cast.cpp`)."""


def quantize_launches(precision: str) -> tuple[int, bool]:
    """(kernels per quantized tensor, whether a grouped operand is quantized in one kernel) of a
    precision recipe, as Transformer Engine runs them: the cast, after its amax kernel where the
    recipe needs one (`AMAX_PASS`), current scaling also a scale-from-amax kernel between them
    (three in all; NVFP4 derives its scale in the cast: two). `split_quantize`, which quantizes a
    grouped GEMM's operand, has a fused multi-tensor kernel for delayed scaling
    (`nvte_multi_cast_transpose`) and for NVFP4 only; every other recipe quantizes it expert by
    expert (`multi_tensor_quantize_impl`: "Currently only have fused kernel for FP8 delayed
    scaling")."""
    if precision == "bf16":
        return 0, True
    kernels = 1 + (precision in AMAX_PASS) + (precision == "fp8-tensorwise")
    return kernels, precision in ("fp8-delayed", "nvfp4")


def layer_launches(model: ModelSpec, layout: Layout, precision: str, kind: str,
                   fused_moe: bool = True, fused_mlp: bool = False) -> Launches:
    """Launches of one decoder layer (`kind` "dense" or "moe") or of the loss head ("loss").

    Backward: BWD_FACTOR kernels per forward non-GEMM kernel, a data- and a weight-gradient
    GEMM per forward GEMM. A quantizing recipe quantizes each GEMM input forward and each
    output gradient backward (`quantize_launches`: its kernels per tensor, a grouped operand
    once per local expert unless the recipe fuses it). The fused grouped MLP (`fused_mlp`,
    `Layout.fused_grouped_mlp`) launches each of the experts' GEMMs once for every local
    expert, with the activation, the biases and the fc2 operand's quantisation in the fc1
    GEMM's epilogue (and their gradients in the fc2 data-gradient GEMM's), after one grouped
    quantize of the fc1 operand (Transformer Engine `ops/fused/grouped_mlp.py`)."""
    if kind == "loss":
        return Launches(LOSS, 0.0, BWD_FACTOR * LOSS)
    q, fused_group = quantize_launches(precision)
    attn, attn_gemms = attention_launches(model, layout)
    # the unfused RoPE's backward is counted as it runs, not as BWD_FACTOR per forward kernel
    rope_b = (UNFUSED_ROPE_BWD - BWD_FACTOR * UNFUSED_ROPE_FWD) if unfused_rope(model) else 0.0
    if kind != "moe":
        tp = TP_COLLECTIVES if layout.tp > 1 else 0
        gemms = attn_gemms + 2
        fwd = attn + DENSE_MLP + tp + q * gemms
        bwd = BWD_FACTOR * (attn + DENSE_MLP + tp - gemms) + 2 * gemms + q * gemms + rope_b
        return Launches(fwd, 0.0, bwd)
    local = max(1, (model.num_experts or 1) // layout.ep)
    unfused = 0 if fused_moe else UNFUSED_MOE
    shared = SHARED_EXPERT if model.num_shared_experts else 0
    fused_mlp = fused_mlp and q > 0
    # launches of one expert GEMM over the local experts; the activation kernel
    egemm, act = (1, 0) if fused_mlp else (local, 1)
    grouped = 1 if fused_group or fused_mlp else local  # kernels quantizing a grouped operand
    # fc1 and fc2 inputs of the grouped GEMMs (tensors quantized; the fused MLP quantizes the
    # fc2 input and the fc1 output gradient in its epilogues), and the shared experts' two
    grouped_ops = (1 if fused_mlp else 2) * grouped + (2 if shared else 0)
    pre = attn + 3 + q * attn_gemms + unfused / 2     # attention, norm, router GEMM, top-k
    bias_f, bias_b = ((EXPERT_BIAS_FWD * local + 2, EXPERT_BIAS_BWD * local + 1)
                      if model.mlp_bias and not fused_mlp else (0, 0))
    quant = q * grouped                                # one grouped operand's quantize kernels
    # MOE_FIXED less the three before the sync: top-k's second kernel, the counts (3), permute,
    # all-to-all, chunk sort; the activation; chunk unsort, all-to-all, unpermute, add
    after = (7 + unfused / 2, quant, egemm, act + bias_f, 0 if fused_mlp else quant, egemm,
             4 + shared + (2 * q if shared else 0))
    post = sum(after)
    gemms = attn_gemms + 1 + 2 * egemm + (2 if shared else 0)
    non_gemm = attn + MOE_FIXED - 1 + act + shared - gemms + 2 * egemm + unfused
    bwd = BWD_FACTOR * non_gemm + 2 * gemms + q * (attn_gemms + grouped_ops) + rope_b + bias_b
    return Launches(pre, post, bwd, 1, after)


def floor_excess(host_s: float, device_s: float) -> float:
    """Time a host-bound stretch adds over its device time: max(host, device) − device."""
    return max(0.0, host_s - device_s)
