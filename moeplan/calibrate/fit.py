"""Fits from microbenchmark timings to the cost models' constants: pure numpy, no torch, no I/O.

Every fit is least squares on the quantity the cost model predicts, in the model's own form
(moeplan/cost_models/compute.py and comm.py), so that the fitted constants plug straight in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GemmSample:
    """One timed GEMM: (m×k)·(k×n) forward, achieved TFLOPS."""

    m: int
    k: int
    n: int
    tflops: float


def gemm_shape_factor(m: float, k: float, n: float, half_dim: float) -> float:
    """compute.gemm_efficiency without eff_max: m/(m+h) · n/(n+h) · k/(k+h/4)."""
    return m / (m + half_dim) * n / (n + half_dim) * k / (k + half_dim / 4)


def fit_gemm_curve(samples: Sequence[GemmSample], peak_tflops: float,
                   half_dims: Sequence[float] | None = None) -> tuple[float, float, float]:
    """(eff_max, half_dim, rms log error) of compute.gemm_efficiency fitted to achieved TFLOPS.

    Minimises Σ (log(achieved/peak) − log eff_max − log shape(h))² : for each candidate h (a
    log-spaced grid, refined around the best) eff_max has the closed form exp(mean residual).
    """
    if not samples:
        raise ValueError("no GEMM samples to fit")
    y = np.log([s.tflops / peak_tflops for s in samples])

    def solve(h: float) -> tuple[float, float]:
        f = np.log([gemm_shape_factor(s.m, s.k, s.n, h) for s in samples])
        c = float(np.mean(y - f))
        return float(np.sqrt(np.mean((y - f - c) ** 2))), c

    grid = list(half_dims) if half_dims else list(np.geomspace(1.0, 8192.0, 53))
    best = min(grid, key=lambda h: solve(h)[0])
    # golden-section search on log h between the grid neighbours of the best point
    lo, hi = math.log(best / 1.2), math.log(best * 1.2)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if solve(math.exp(a))[0] < solve(math.exp(b))[0]:
            hi = b
        else:
            lo = a
    best = math.exp((lo + hi) / 2)
    err, c = solve(best)
    return math.exp(c), best, err


@dataclass(frozen=True)
class AlphaBeta:
    """t(S) = alpha_s + S / (beta_gb_s · 1e9) for one collective's timings, in the cost model's
    per-link terms (see `fit_collective`)."""

    alpha_us: float
    beta_gb_s: float
    rms_log_error: float


def fit_line(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(c0, c1) ≥ 0 of t = c0 + c1·S, least squares weighted by 1/t (relative error), so small
    messages set the latency and large ones the bandwidth."""
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    w = 1.0 / t
    A = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (c0, c1), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if c1 <= 0:  # all latency: bandwidth unmeasurably high over these sizes
        c1 = float(np.min(t / s)) * 1e-3
    if c0 < 0:  # all bandwidth
        c0 = 0.0
        c1 = float(np.sum(w * w * s * t) / np.sum(w * w * s * s))
    return float(c0), float(c1)


def fit_collective(kind: str, n: int, sizes: Sequence[float], times: Sequence[float]
                   ) -> AlphaBeta:
    """α (µs per message step) and β (GB/s) of one collective over n ranks, in the form comm.py
    prices it; `sizes` are the bytes comm.py passes in (SPEC: gathered size for all-gather /
    reduce-scatter / all-reduce, bytes each rank holds for all-to-all, message for p2p).

    ring (all-gather, reduce-scatter): t = (n−1)·α + (n−1)/n·S/β
    all-reduce: t = 2·[(n−1)·α + (n−1)/n·S/β]
    all-to-all: t = α·(1 + log2 n) + (n−1)/n·S/β        p2p: t = α + S/β
    """
    c0, c1 = fit_line(sizes, times)
    if kind in ("all_gather", "reduce_scatter"):
        alpha, beta = c0 / (n - 1), (n - 1) / n / c1
    elif kind == "all_reduce":
        alpha, beta = c0 / (2 * (n - 1)), 2 * (n - 1) / n / c1
    elif kind == "all_to_all":
        alpha, beta = c0 / (1 + math.log2(n)), (n - 1) / n / c1
    elif kind == "p2p":
        alpha, beta = c0, 1.0 / c1
    else:
        raise ValueError(f"unknown collective {kind!r}")
    pred = np.asarray([c0 + c1 * s for s in sizes])
    err = float(np.sqrt(np.mean(np.log(pred / np.asarray(times)) ** 2)))
    return AlphaBeta(alpha * 1e6, beta / 1e9, err)
