"""Compute time: GEMM FLOPs at a shape-dependent efficiency, attention core, memory-bound work.

Conventions (Megatron-LM `training.py::num_floating_point_operations`, Narayanan et al. 2021
§5.1): a GEMM of an (m×k) input with a (k×n) weight costs 2·m·k·n FLOPs forward and twice that
backward (data gradient + weight gradient). Core attention costs 2·2·s_q·s_kv·d per head forward
(QKᵀ and PV), halved by the causal mask.
"""

from __future__ import annotations

import math

from .calibration import Calibration


def gemm_flops(m: float, k: float, n: float) -> float:
    """Forward FLOPs of an (m×k)·(k×n) matmul: 2·m·k·n."""
    return 2.0 * m * k * n


def gemm_efficiency(m: float, k: float, n: float, eff_max: float, half_dim: float) -> float:
    """Fraction of peak a GEMM reaches: eff_max · Π_d d/(d + half_dim) over its output dims m, n,
    and d/(d + half_dim/4) over the reduction dim k.

    A saturating roofline-style curve: large GEMMs approach eff_max, a GEMM with a small output
    dim (fine-grained experts receiving ~100 tokens, a 2048-wide expert FFN sharded by ETP) falls
    well below it, as cuBLAS/CUTLASS tile quantisation and wave effects do. The reduction dim
    only sets how long each tile streams, so it matters four times less. `half_dim` is the size
    at which one output dim alone halves the efficiency; it is a fitted calibration constant.
    """
    return (eff_max * m / (m + half_dim) * n / (n + half_dim)
            * k / (k + half_dim / 4))


def lowp_speedup(peak_bf16: float, peak_lowp: float | None, gain: float) -> float:
    """GEMM speed-up of an FP8/FP4 recipe over BF16: 1 + (peak ratio − 1) · gain.

    `gain` ∈ [0, 1] is the share of the datasheet ratio real recipes keep after quantisation,
    scaling-factor and amax work (calibrated per recipe); 0 means no speed-up.
    """
    if not peak_lowp:
        return 1.0
    return 1.0 + (peak_lowp / peak_bf16 - 1.0) * gain


def gemm_time(m: float, k: float, n: float, peak_tflops: float, cal: Calibration,
              eff_max: float, speedup: float = 1.0, count: float = 1.0,
              half_dim: float | None = None, ceiling_tflops: float | None = None) -> float:
    """Forward seconds of `count` identical GEMMs of shape (m×k)·(k×n) at BF16 peak × speed-up,
    `eff_max` the GPU's calibrated peak GEMM efficiency, `half_dim` its architecture's shape
    curve (`Calibration.half_dim_for`; the shared one when None). `ceiling_tflops` is the
    measured maximum achievable matmul rate of the GPU in that format
    (`ClusterSpec.mamf`): the fitted curve may never run a GEMM faster than the hardware was
    measured to go."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    eff = gemm_efficiency(m, k, n, eff_max, cal.gemm_half_dim if half_dim is None else half_dim)
    rate = peak_tflops * eff * speedup
    if ceiling_tflops:
        rate = min(rate, ceiling_tflops)
    return count * gemm_flops(m, k, n) / (rate * 1e12)


FLASH_BLOCK = 128  # query/key tile of FlashAttention-2/3 and cuDNN fused attention (Dao 2023 §3)


def attended_keys(seq_len: float, window: float | None = None, block: int = FLASH_BLOCK
                  ) -> float:
    """Mean keys per query whose scores a tiled (flash) attention kernel actually computes.

    FlashAttention-2 (Dao 2023, Algorithm 1 and §3.1) and cuDNN's fused attention walk the key
    sequence in tiles of `block` and skip only tiles that the mask empties entirely; a tile the
    mask cuts is computed whole. Causal, full range: query tile j computes tiles 0..j, so
    n = ⌈s/B⌉ tiles give B²·n(n+1)/2 scores, (s + B)/2 keys per query (s/2 in Megatron's count).
    Causal sliding window w (keys i−w < j ≤ i, cuDNN ≥ 9.2 / FA2 `window_size`): a query tile
    reaches back over w − 1 keys, so it touches ⌈(w − 1)/B⌉ + 1 tiles: 2·B = 256 keys per query
    for gpt-oss's w = 128, twice the w the FLOP count credits (never more than the causal case).
    """
    causal = (seq_len + block) / 2.0
    if window is None or window >= seq_len:
        return causal
    tiles = math.ceil((window - 1) / block) + 1
    return min(float(tiles * block), causal)


ATTN_REF_HEAD_DIM = 160.0  # mean of d_qk = 192 and d_v = 128: the REFERENCE cuDNN shapes


def attention_head_dim_factor(head_dim: float, half_dim: float) -> float:
    """Attention kernel efficiency at head dim d relative to the calibrated reference shape:
    [d/(d + D)] / [d_ref/(d_ref + D)], d_ref = 160 (DeepSeek-V3's MLA, where the attention
    efficiencies were measured).

    A flash kernel does 4·d FLOPs per score but also a fixed per-score softmax (exp, max,
    rescale on the CUDA cores, not the tensor cores), so small head dims spend a larger share of
    each tile off the tensor cores: FlashAttention-3 (Shah et al. 2024, Fig. 5, H100 BF16)
    reaches ≈ 0.7–0.75 of the d = 128 throughput at d = 64 and ≈ 1.15–1.2 of it at d = 256,
    which D ≈ 64 reproduces. `half_dim` (D) is a calibration constant. Capped at 1: head dims
    above the reference keep the measured efficiency, which `estimate.lower_bound` takes as the
    best any attention kernel reaches.
    """
    if head_dim <= 0 or half_dim <= 0:
        return 1.0
    return min(1.0, (head_dim / (head_dim + half_dim))
               / (ATTN_REF_HEAD_DIM / (ATTN_REF_HEAD_DIM + half_dim)))


def softmax_share(head_dim: float, half_dim: float) -> float:
    """Share of a flash kernel's forward time its softmax takes at head dim d: D/(d + D).

    `attention_head_dim_factor` prices a score as d tensor-core units plus a fixed D of softmax
    work off the tensor cores, almost all of it the exponential, which runs on the special
    function units (MUFU.EX2). Priced so, NVIDIA's measurement on Blackwell Ultra, whose SFUs
    run the exponential twice as fast, follows: DeepSeek-V3's attention (d = 160) in FP8, where
    the tensor part takes half its BF16 time, is (80 + 64)/(80 + 32) = 1.29x faster on GB300
    than on GB200 where NVIDIA measured about 1.35x ("Making Softmax More Efficient with NVIDIA
    Blackwell Ultra", NVIDIA technical blog, 2026)."""
    if head_dim <= 0 or half_dim <= 0:
        return 0.0
    return half_dim / (head_dim + half_dim)


def sfu_saving(fwd_s: float, head_dim: float | None, half_dim: float, exp_scale: float
               ) -> float:
    """Seconds a GPU whose SFUs run the exponential `exp_scale` times its architecture's base
    rate (`ClusterSpec.sfu_exp_scale`) saves on a flash kernel's forward of `fwd_s` at the base
    rate: the softmax share (`softmax_share`) runs 1/exp_scale as long. The backward
    recomputes each probability once from the saved statistics, the same exponentials, so it
    saves the same seconds."""
    if not head_dim or exp_scale <= 1.0:
        return 0.0
    return fwd_s * softmax_share(head_dim, half_dim) * (1.0 - 1.0 / exp_scale)


def sfu_gains(cal: Calibration, arch: str, exp_scale: float) -> tuple[float, float]:
    """(forward, backward) speed-up of the fastest attention kernel on a GPU of `exp_scale`
    (the reference head dim, where `attention_head_dim_factor` peaks): what a lower bound on
    step time must allow attention to gain over the calibrated rates."""
    if exp_scale <= 1.0:
        return 1.0, 1.0
    base = attention_time(1.0, 1.0, cal, arch, ATTN_REF_HEAD_DIM)
    fast = attention_time(1.0, 1.0, cal, arch, ATTN_REF_HEAD_DIM, exp_scale=exp_scale)
    return base[0] / fast[0], base[1] / fast[1]


# cuDNN attention for DeepSeek-V3 shapes, TFLOPS forward/backward at s = 4096 and s = 16384
# (REFERENCE.md, "Time"): the kernels gain with the keys they run over. Ampere has no such
# figure: Hopper's curve.
ATTN_LENGTH_TFLOPS = {"hopper": ((553.0, 422.0), (638.0, 523.0)),
                      "blackwell": ((1324.0, 1083.0), (1698.0, 1298.0))}
ATTN_REF_SEQ = 4096.0


def key_tiles(kv_len: float, windowed: bool = False, block: int = FLASH_BLOCK) -> float:
    """Key tiles one query tile of a flash kernel iterates over, on the average: (L/B + 1)/2
    for a causal kernel over L keys, ⌈(w − 1)/B⌉ + 1 under a sliding window of w keys."""
    if windowed:
        return float(math.ceil((kv_len - 1) / block) + 1)
    return (kv_len / block + 1.0) / 2.0


def tile_overhead(arch: str) -> tuple[float, float]:
    """(forward, backward) fixed cost of a query tile in key-tile units, c: a query tile costs
    c + n tile-times for its n key tiles (loading Q, the softmax epilogue, writing O and its
    statistics, the pipeline's fill), so a kernel reaches n/(n + c) of its asymptote. Solved
    from the two measured lengths: g = t(16K)/t(4K) = [n₁₆/(n₁₆+c)]/[n₄/(n₄+c)] gives
    c = n₄·n₁₆·(g − 1)/(n₁₆ − g·n₄) (Hopper ≈ 3.6 / 5.8 tiles, Blackwell ≈ 6.9 / 4.7)."""
    (f4, b4), (f16, b16) = ATTN_LENGTH_TFLOPS.get(arch, ATTN_LENGTH_TFLOPS["hopper"])
    n4, n16 = key_tiles(ATTN_REF_SEQ), key_tiles(4 * ATTN_REF_SEQ)
    return tuple(n4 * n16 * (g - 1) / (n16 - g * n4)  # type: ignore[return-value]
                 for g in (f16 / f4, b16 / b4))


def attention_length_factors(kv_len: float, arch: str, windowed: bool = False
                             ) -> tuple[float, float]:
    """(forward, backward) attention efficiency of a kernel over `kv_len` keys (a window of
    `kv_len` keys when `windowed`) relative to the calibrated causal s = 4096:
    [n/(n + c)] / [n₄/(n₄ + c)], n its key tiles per query tile (`key_tiles`), c the query
    tile's fixed cost (`tile_overhead`). It reproduces the measured 4K → 16K gain, saturates
    at (n₄ + c)/n₄ for the longest kernels (Hopper 1.22× forward, Blackwell 1.42×), and
    prices the short kernels a context-parallel ring step or a 128-token window runs (two key
    tiles per query tile: 0.43× the 4K forward efficiency on Hopper)."""
    n, n4 = key_tiles(kv_len, windowed), key_tiles(ATTN_REF_SEQ)
    f, b = ((n / (n + c)) / (n4 / (n4 + c)) for c in tile_overhead(arch))
    return f, b


def attention_length_ceiling(arch: str) -> tuple[float, float]:
    """(forward, backward) factor of the longest kernels: the asymptote (n₄ + c)/n₄."""
    n4 = key_tiles(ATTN_REF_SEQ)
    f, b = ((n4 + c) / n4 for c in tile_overhead(arch))
    return f, b


def attention_time(flops_fwd: float, peak_bf16: float, cal: Calibration, arch: str,
                   head_dim: float | None = None, kv_len: float | None = None,
                   windowed: bool = False, current_kernels: bool = True,
                   exp_scale: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of flash/cuDNN attention; backward does 2.5× the forward FLOPs
    (recomputes the scores) at its own measured efficiency (REFERENCE: cuDNN MLA shapes), both
    scaled by `attention_head_dim_factor` when the head dim (mean of d_qk and d_v) is given and
    by `attention_length_factors` when the keys per kernel call are (a window's when
    `windowed`). The measured rates are today's cuDNN kernels, which a step on the current
    stack runs as measured; an older stack (`current_kernels` False: Megatron Core and
    Transformer Engine of 2024 and before) ran older kernels, at the share of today's rate the
    published runs of those stacks realised (`Calibration.attn_realised`, fitted on them only).
    On a GPU whose SFUs run the exponential `exp_scale` times faster (Blackwell Ultra) both
    passes save the softmax's share (`sfu_saving`).
    `flops_fwd` is the work the kernel does (see `attended_keys`), not the model count."""
    f = attention_head_dim_factor(head_dim, cal.attn_head_dim_half) if head_dim else 1.0
    lf, lb = attention_length_factors(kv_len, arch, windowed) if kv_len else (1.0, 1.0)
    if not current_kernels:
        f *= min(1.0, cal.attn_realised.get(arch, 1.0))
    fwd = flops_fwd / (peak_bf16 * 1e12 * cal.attn_fwd_eff[arch] * f * lf)
    bwd = 2.5 * flops_fwd / (peak_bf16 * 1e12 * cal.attn_bwd_eff[arch] * f * lb)
    saved = sfu_saving(fwd, head_dim, cal.attn_head_dim_half, exp_scale)
    return fwd - saved, bwd - saved


def membound_time(nbytes: float, hbm_tb_s: float, cal: Calibration) -> float:
    """Seconds to stream `nbytes` through HBM (norms, activations, permutation, casts, Adam)."""
    return cal.membound_scale * nbytes / (hbm_tb_s * 1e12 * cal.hbm_eff)


def adam_step_bytes(params: float, moments_bytes: int = 4) -> float:
    """HBM bytes of one Adam step per parameter shard: read grad (4), master (4), m, v; write
    master, m, v and the bf16 parameter (2)."""
    return params * (4 + 4 + 2 * moments_bytes + 4 + 2 * moments_bytes + 2)
