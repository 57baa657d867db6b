"""Pipeline schedules, stage splitting and the CP token layout, without processes."""

from __future__ import annotations

import pytest
import torch

from moeplan.cost_models.pipeline import bubble_fraction, in_flight_chunks
from moeplan.runtime.comm import Axis
from moeplan.runtime.cp import cp_positions
from moeplan.runtime.model import Chunk
from moeplan.runtime.pipeline import rank_chunks, schedule
from moeplan.runtime.scale import scale_down_model, scale_down_training
from moeplan.runtime.support import features_not_executed
from moeplan.specs import (
    Choices,
    Layout,
    Plan,
    TrainingSpec,
    check_layout,
    load_cluster,
    load_model,
    stage_layout_for,
)


def simulate(pp: int, vpp: int, m: int) -> tuple[int, list[int]]:
    """Run every rank's action list with blocking receives and unit-time actions.

    A forward of virtual stage s waits for stage s − 1's forward of that micro-batch, a backward
    for stage s + 1's backward. Returns (makespan, busy ticks per rank); raises on deadlock.
    """
    acts = {r: schedule(pp, vpp, r, m) for r in range(pp)}
    done: dict[tuple[str, int, int], int] = {}  # (kind, virtual stage, mb) → finish tick
    pos, clock, last = dict.fromkeys(range(pp), 0), dict.fromkeys(range(pp), 0), pp * vpp - 1
    while any(pos[r] < len(acts[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(acts[r]):
                continue
            kind, c, mb = acts[r][pos[r]]
            s = c * pp + r
            dep = (("F", s - 1, mb) if s > 0 else None) if kind == "F" else (
                ("B", s + 1, mb) if s < last else ("F", s, mb))
            if dep is not None and dep not in done:
                continue
            start = max(clock[r], done.get(dep, 0) if dep else 0)
            clock[r] = done[(kind, s, mb)] = start + 1
            pos[r] += 1
            progressed = True
        if not progressed:
            raise AssertionError(f"deadlock at {pos}")
    return max(clock.values()), [len(a) for a in acts.values()]


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 4), (4, 1, 8), (4, 1, 2), (2, 2, 4), (4, 2, 8),
                                      (4, 3, 4)])
def test_every_schedule_runs_each_forward_and_backward_once_without_deadlock(pp, vpp, m):
    for r in range(pp):
        acts = schedule(pp, vpp, r, m)
        assert sorted(acts) == sorted((k, c, b) for k in "BF" for c in range(vpp)
                                      for b in range(m))
        for c in range(vpp):
            for b in range(m):
                assert acts.index(("F", c, b)) < acts.index(("B", c, b))
    simulate(pp, vpp, m)


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (4, 2, 8), (8, 1, 16)])
def test_schedule_bubble_and_in_flight_match_the_cost_model(pp, vpp, m):
    """With equal forward and backward times the simulated idle share is the cost model's
    bubble (p − 1)/(v·m), and the chunks each rank runs forward before its first backward are
    the in-flight activations the memory model counts."""
    makespan, work = simulate(pp, vpp, m)
    ideal = work[0]  # 2·m·v unit actions per rank
    assert (makespan - ideal) / ideal == pytest.approx(bubble_fraction(pp, m, vpp))
    for r in range(pp):
        acts = schedule(pp, vpp, r, m)
        first_backward = next(i for i, a in enumerate(acts) if a[0] == "B")
        assert [c for _, c, _ in acts[:first_backward]] == in_flight_chunks(r, pp, vpp, m)


def test_rank_chunks_follow_megatrons_virtual_stage_order():
    stages = stage_layout_for(3, 2, 2, mtp_layers=1)  # [E] [t t] [t] [m L]
    assert rank_chunks(stages, 2, 0) == [Chunk(True, (), False), Chunk(False, (2,), False)]
    assert rank_chunks(stages, 2, 1) == [Chunk(False, (0, 1), False), Chunk(False, (), True)]
    even = stage_layout_for(4, 2, 1)
    assert rank_chunks(even, 2, 1) == [Chunk(False, (2, 3), True)]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_ranks_hold_one_early_and_one_late_chunk_covering_the_sequence_once(cp):
    seq = 32
    pos = [cp_positions(seq, Axis(None, cp, r, tuple(range(cp)))) for r in range(cp)]
    assert torch.cat(pos).sort().values.tolist() == list(range(seq))
    n = seq // (2 * cp)
    for r, p in enumerate(pos):
        assert p[:n].tolist() == list(range(r * n, (r + 1) * n))
        assert p[n:].min() == (2 * cp - 1 - r) * n
    work = [sum(int(t) + 1 for t in p) for p in pos]  # causal keys per query
    assert len(set(work)) == 1  # load balanced


def _plan(model: str, world: int, choices: Choices | None = None, **axes) -> Plan:
    t = TrainingSpec(seq_len=4096, global_batch_size=1024)
    return Plan(model=load_model(model), cluster=load_cluster("h100", gpus=world), training=t,
                layout=Layout.build(world, 1024, **axes), choices=choices or Choices())


def test_pipeline_and_context_parallel_plans_are_executed():
    assert features_not_executed(_plan("deepseek-v3", 256, tp=2, cp=2, pp=8, vpp=2, ep=8)) == []


def test_mtp_outside_the_last_stage_is_refused_by_name():
    plan = _plan("deepseek-v3", 48, Choices(stage_layout="Et*31|t*30m|L"), tp=2, pp=3, ep=8)
    assert any("MTP layers outside the last pipeline stage" in f
               for f in features_not_executed(plan))


def test_scale_down_keeps_pipeline_and_context_parallel_degrees_valid():
    plan = _plan("deepseek-v3", 64, tp=2, cp=2, pp=4, vpp=2, ep=8)
    small = scale_down_model(plan.model, plan.layout)
    training, layout = scale_down_training(plan.training, plan.layout)
    check_layout(small, training, layout)
    assert (layout.pp, layout.vpp, layout.cp) == (4, 2, 2)
    assert layout.num_microbatches % layout.pp == 0 and small.num_layers >= 8
