"""Pipeline schedules: step time from per-rank micro-batch times, in-flight micro-batches.

1F1B (Narayanan et al. 2021 §2.2.1): with p stages, m micro-batches and per-micro-batch stage
times t_r, the step takes (m−1)·max t_r + Σ t_r — for equal stages (m + p − 1)·t, a bubble of
(p−1)/m of the ideal time. Interleaved with v model chunks per rank: the warm-up and cool-down
shrink v-fold, bubble (Σ t_r − max t_r)/v, i.e. (p−1)/(v·m) for equal stages.

In-flight activations (Megatron Core `schedules.py`, forward_backward_pipelining_*): rank r of p
runs min(m, p − r − 1) warm-up forwards before its first backward (1F1B), so it holds up to
min(m, p − r) micro-batches; interleaved, it runs (p − r − 1)·2 + (v − 1)·p warm-up forwards of
model chunks, visiting its chunks in groups of p micro-batches.
"""

from __future__ import annotations


def pipeline_time(rank_times: list[float], num_microbatches: int, vpp: int = 1
                  ) -> tuple[float, float]:
    """(step time, bubble time) from each pp rank's time for one micro-batch (all its chunks)."""
    if not rank_times:
        return 0.0, 0.0
    slowest = max(rank_times)
    bubble = (sum(rank_times) - slowest) / vpp
    return num_microbatches * slowest + bubble, bubble


def in_flight_chunks(rank: int, pp: int, vpp: int, num_microbatches: int) -> list[int]:
    """Model-chunk index (0..vpp−1) of each forward whose activations rank `rank` holds at its
    peak, in schedule order (the warm-up forwards plus the first steady-state forward)."""
    m = num_microbatches
    if vpp == 1:
        return [0] * max(1, min(m, pp - rank))
    total = m * vpp
    warmup = min(total, (pp - rank - 1) * 2 + (vpp - 1) * pp)
    n = min(total, warmup + 1)
    return [(i // pp) % vpp for i in range(n)]


def bubble_fraction(pp: int, num_microbatches: int, vpp: int = 1) -> float:
    """Ideal bubble over ideal compute for equal stages: (p − 1)/(v·m)."""
    return (pp - 1) / (vpp * num_microbatches)
