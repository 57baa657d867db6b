"""Overlap as physics: no communication hides behind compute that is not there, and no
recommended plan has a communication class longer than its step."""

import pytest

from moeplan.cost_models.overlap import (
    edge_weight,
    exposed_time,
    overlap_cost,
    staged_exposed_time,
)
from moeplan.cost_models.pipeline import pipeline_time
from moeplan.planner.search import search
from moeplan.specs import TrainingSpec, load_cluster, load_model


def test_exposed_never_below_comm_minus_concurrent_compute():
    assert exposed_time(10.0, 3.0, eta=0.99) == pytest.approx(7.0)
    assert exposed_time(1.0, 100.0, eta=0.93) == pytest.approx(0.07)  # η caps what hides
    assert exposed_time(1.0, 100.0, eta=1.0) == 0.0
    assert exposed_time(0.0, 5.0) == 0.0


def test_staged_exposure_of_one_chunk_is_the_plain_overlap_rule():
    for comm, own in ((1.0, 0.3), (0.2, 0.5), (2.0, 2.0)):
        assert staged_exposed_time(comm, 1, own, gap_s=10.0) == pytest.approx(
            exposed_time(comm, own))


def test_interleaved_chunks_spread_dp_communication_over_the_schedule_ends():
    """Four chunks pp passes apart: only the last chunk's part waits after the last pass when
    the gaps are long; with no gap the parts queue and the whole backlog is left; never more
    than the communication, never less than zero, and more gap never exposes more."""
    comm, own = 1.0, 0.1
    assert staged_exposed_time(comm, 4, own, gap_s=10.0) == pytest.approx(comm / 4 - own)
    assert staged_exposed_time(comm, 4, own, gap_s=0.0) == pytest.approx(comm - own)
    prev = comm
    for gap in (0.0, 0.05, 0.1, 0.2, 0.5):
        e = staged_exposed_time(comm, 4, own, gap)
        assert 0.0 <= e <= prev + 1e-12
        prev = e
    # pp = 2: two passes of a chunk between parts, against one window of the four passes
    assert staged_exposed_time(comm, 4, own, 2 * own) < exposed_time(comm, 4 * own)
    assert staged_exposed_time(0.0, 4, own, 0.1) == 0.0


def test_hiding_costs_the_compute_beside_it():
    # 1 s hidden behind long compute still costs the SM share of that second
    assert overlap_cost(1.0, 100.0, eta=1.0, sm_fraction=0.15) == pytest.approx(0.15)
    assert overlap_cost(1.0, 0.0, eta=1.0, sm_fraction=0.15) == pytest.approx(1.0)


@pytest.mark.parametrize(("m", "pp", "vpp"), [(1, 1, 1), (8, 1, 1), (16, 4, 1), (32, 4, 2)])
def test_edge_weight_prices_unpaired_micro_batches_exactly(m, pp, vpp):
    # merged 1F1B: (m − 1) paired micro-batches plus the edge (1 + (p−1)/v) unpaired
    t_ovl, t_alone = 1.0, 3.0
    w = edge_weight(m, pp, vpp)
    blended = t_ovl + w * (t_alone - t_ovl)
    step, _ = pipeline_time([blended] * pp, m, vpp)
    assert step == pytest.approx((m - 1) * t_ovl + (1 + (pp - 1) / vpp) * t_alone)


SEARCHES = [("qwen3-235b-a22b", "h100", 256, 2048), ("deepseek-v3", "gb200-nvl72", 256, 4096),
            ("mixtral-8x7b", "h100", 64, 1024), ("qwen3-30b-a3b", "b200", 16, 512),
            ("llama3-70b", "gb200-nvl72", 64, 512)]


@pytest.mark.parametrize(("model", "cluster", "gpus", "gbs"), SEARCHES)
def test_no_top_plan_has_a_class_longer_than_its_step(model, cluster, gpus, gbs):
    for objective in ("robust", "expected"):
        res = search(load_model(model), load_cluster(cluster), TrainingSpec(
            seq_len=4096, global_batch_size=gbs), gpus, top_k=5, objective=objective)
        for p in res.plans:
            e = p.estimate
            t = e.time
            for cls in ("tp_comm_s", "cp_comm_s", "ep_comm_s", "dp_comm_s"):
                assert getattr(t, cls) <= e.step_time_s, (cls, p.layout)
            assert t.compute_s + t.recompute_s <= e.step_time_s, p.layout
            assert t.exposed_comm_s <= e.step_time_s
