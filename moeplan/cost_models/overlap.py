"""Overlap as physics: how much of a communication can hide, and what hiding costs.

One rule for every hidden term (EP all-to-all under the merged forward/backward, TP
communication behind the GEMMs, DP reduce-scatter/all-gather behind backward/forward, the CP
ring behind attention, offload copies behind compute):

    exposed = max(comm − concurrent, (1 − η)·comm)

where `concurrent` is the compute that actually runs at the same time (never more than
there is) and η ≤ 1 the best fraction an overlap achieves even when compute is long (launch
gaps, dependencies at the ends of a window). A class can therefore never hide more than the
compute beside it, and no class's wall time can exceed the step.

Hiding is not free: communication kernels occupy streaming multiprocessors while they run
(NCCL channels; DeepEP/HybridEP reserve a fixed SM budget), so the compute beside them runs
slower. The price is `slowdown · hidden`, with `slowdown` the fraction of the GPU's compute the
communication kernels take (calibration `comm_sm_fraction`, per architecture).
"""

from __future__ import annotations


def exposed_time(comm_s: float, concurrent_s: float, eta: float = 1.0) -> float:
    """The part of `comm_s` left on the critical path beside `concurrent_s` of compute."""
    if comm_s <= 0.0:
        return 0.0
    return max(comm_s - max(concurrent_s, 0.0), (1.0 - min(max(eta, 0.0), 1.0)) * comm_s)


def staged_exposed_time(comm_s: float, chunks: int, own_pass_s: float, gap_s: float) -> float:
    """Exposure of a communication issued in `chunks` equal parts, one per model chunk, each
    able to run beside its own chunk's pass (`own_pass_s`: bucketed, as Megatron's
    overlap_grad_reduce / overlap_param_gather issue it) and beside the `gap_s` of other
    chunks' passes that separate consecutive parts (the interleaved schedule runs pp passes of
    one chunk before the next chunk's: a stage's chunk j finishes its last backward pp·j chunk
    passes before the stage's last, and starts its first forward pp·j passes after the first).
    One link serves the parts in turn, so what is left after the last pass is the worst
    backlog, max over k of ((k+1)·part − own − k·gap); one chunk gives `exposed_time(comm,
    own)`. Never more than the whole communication, never negative."""
    if comm_s <= 0.0:
        return 0.0
    part = comm_s / max(chunks, 1)
    worst = max((k + 1) * part - own_pass_s - k * gap_s for k in range(max(chunks, 1)))
    return min(comm_s, max(0.0, worst))


def overlap_cost(comm_s: float, concurrent_s: float, eta: float, sm_fraction: float) -> float:
    """Critical-path seconds of overlapping `comm_s` with `concurrent_s` of compute: the
    exposed part plus the slowdown of the compute that ran beside the hidden part."""
    exp = exposed_time(comm_s, concurrent_s, eta)
    return exp + sm_fraction * (comm_s - exp)


def edge_weight(num_microbatches: int, pp: int, vpp: int) -> float:
    """Weight of a micro-batch's un-overlapped ("edge") time in a pipeline rank's per-micro-batch
    time, so that `pipeline_time` of the blended times equals the schedule's real cost.

    An overlap that pairs the forward of one micro-batch with the backward of another (Megatron
    Core's merged 1F1B) has no partner in the warm-up and cool-down: with pp = 1 the first
    forward and the last backward run alone, one micro-batch's worth; with pp > 1 the bubble's
    (p − 1)/v micro-batch times run alone too. For equal stages the step is
    (m − 1)·t_ovl + (1 + (p−1)/v)·t_alone, and pipeline_time gives (m + (p−1)/v)·t, so
    t = t_ovl + w·(t_alone − t_ovl) with w = (1 + (p−1)/v) / (m + (p−1)/v).
    """
    edge = 1.0 + (pp - 1) / vpp
    return min(1.0, edge / (num_microbatches + (pp - 1) / vpp))
