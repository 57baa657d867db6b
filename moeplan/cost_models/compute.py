"""Compute time: GEMM FLOPs at a shape-dependent efficiency, attention core, memory-bound work.

Conventions (Megatron-LM `training.py::num_floating_point_operations`, Narayanan et al. 2021
§5.1): a GEMM of an (m×k) input with a (k×n) weight costs 2·m·k·n FLOPs forward and twice that
backward (data gradient + weight gradient). Core attention costs 2·2·s_q·s_kv·d per head forward
(QKᵀ and PV), halved by the causal mask.
"""

from __future__ import annotations

from .calibration import Calibration

BWD_GEMM_FACTOR = 2.0  # dgrad + wgrad, each the forward's FLOPs


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
              eff_max: float, speedup: float = 1.0, count: float = 1.0) -> float:
    """Forward seconds of `count` identical GEMMs of shape (m×k)·(k×n) at BF16 peak × speed-up,
    `eff_max` the GPU's calibrated peak GEMM efficiency."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    eff = gemm_efficiency(m, k, n, eff_max, cal.gemm_half_dim)
    return count * gemm_flops(m, k, n) / (peak_tflops * 1e12 * eff * speedup)


def causal_attention_flops(s_q: float, s_kv: float, heads: float, d_qk: float, d_v: float,
                           causal: bool = True) -> float:
    """Forward FLOPs of core attention for s_q queries over s_kv keys (per sequence).

    2·s_q·s_kv·h·d_qk for QKᵀ plus 2·s_q·s_kv·h·d_v for PV; the causal mask halves it when the
    queries see the whole key range (Megatron-LM's count).
    """
    f = 2.0 * s_q * s_kv * heads * (d_qk + d_v)
    return f / 2.0 if causal else f


def attention_time(flops_fwd: float, peak_bf16: float, cal: Calibration, arch: str
                   ) -> tuple[float, float]:
    """(forward, backward) seconds of flash/cuDNN attention; backward does 2.5× the forward FLOPs
    (recomputes the scores) at its own measured efficiency (REFERENCE: cuDNN MLA shapes)."""
    fwd = flops_fwd / (peak_bf16 * 1e12 * cal.attn_fwd_eff[arch])
    bwd = 2.5 * flops_fwd / (peak_bf16 * 1e12 * cal.attn_bwd_eff[arch])
    return fwd, bwd


def membound_time(nbytes: float, hbm_tb_s: float, cal: Calibration) -> float:
    """Seconds to stream `nbytes` through HBM (norms, activations, permutation, casts, Adam)."""
    return cal.membound_scale * nbytes / (hbm_tb_s * 1e12 * cal.hbm_eff)


def adam_step_bytes(params: float, moments_bytes: int = 4) -> float:
    """HBM bytes of one Adam step per parameter shard: read grad (4), master (4), m, v; write
    master, m, v and the bf16 parameter (2)."""
    return params * (4 + 4 + 2 * moments_bytes + 4 + 2 * moments_bytes + 2)
