"""Static memory and pipeline schedule formulas, by hand."""

import pytest

from moeplan.cost_models.memory import static_memory
from moeplan.cost_models.pipeline import bubble_fraction, in_flight_chunks, pipeline_time


def test_static_memory_distributed_optimizer_by_hand():
    st = static_memory(1e9, 1e9, dense_shards=4, expert_shards=2)
    assert st.weights == 4e9 and st.grads == 8e9
    assert st.optimizer == pytest.approx(12 * (1e9 / 4 + 1e9 / 2))
    plain = static_memory(1e9, 1e9, 4, 2, distributed_optimizer=False)
    assert plain.optimizer == 24e9  # 18 bytes/param without sharding: 6 + 12
    bf16 = static_memory(1e9, 0, 1, 1, moments_bytes=2)
    assert bf16.optimizer == 8e9
    off = static_memory(1e9, 0, 1, 1, optimizer_offload_fraction=0.5)
    assert off.optimizer == 6e9


def test_pipeline_time_1f1b_and_interleaved():
    assert pipeline_time([1.0] * 4, 8, 1) == (pytest.approx(11.0), pytest.approx(3.0))
    step, bubble = pipeline_time([1.0] * 4, 8, 2)
    assert bubble == pytest.approx(1.5) and step == pytest.approx(9.5)
    # an uneven slow stage sets the steady state
    step, _ = pipeline_time([1.0, 2.0, 1.0, 1.0], 8, 1)
    assert step == pytest.approx(8 * 2 + 3)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)


def test_in_flight_micro_batches():
    assert in_flight_chunks(0, 4, 1, 8) == [0, 0, 0, 0]
    assert in_flight_chunks(3, 4, 1, 8) == [0]
    assert in_flight_chunks(0, 4, 1, 2) == [0, 0]
    # interleaved: (p − r − 1)·2 + (v − 1)·p warm-up forwards + 1, chunks in groups of p
    assert in_flight_chunks(0, 4, 2, 8) == [0] * 4 + [1] * 4 + [0] * 3
    n = len(in_flight_chunks(0, 4, 4, 16))
    assert n == 19  # ≈ p·v·(1 + (p−1)/(p·v)) = 16 · 19/16
