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


def test_a_low_precision_recipe_keeps_the_quantized_weight_copies_beside_the_bf16_weights():
    """Transformer Engine keeps each GEMM weight's row-wise and column-wise quantized copies
    through the step (Megatron: "mxfp8 without ... fp8_param_gather will use significant
    amount additional GPU memory"); priced as bf16 weights alone, an MXFP8 plan that fit on
    paper ran out of memory. With --fp8-param-gather the copies are the parameters. The
    embedding and output layer keep bf16."""
    from moeplan import Layout, TrainingSpec, load_cluster, load_model
    from moeplan.cost_models.estimate import estimate
    from moeplan.cost_models.memory import weight_bytes

    assert weight_bytes(None, False) == 2.0
    assert weight_bytes(1 + 1 / 32, False) == pytest.approx(2 + 2 * (1 + 1 / 32))
    assert weight_bytes(1 + 1 / 32, True) == pytest.approx(2 * (1 + 1 / 32))
    st = static_memory(10e9, 0, 1, 1, gemm_weight_bytes=4.0, embedding_params=1e9)
    assert st.weights == pytest.approx(2 * 1e9 + 4 * 9e9) and st.grads == 40e9
    model, cluster = load_model("llama3-8b"), load_cluster("b200", gpus=8)
    layout = Layout(dp=8, num_microbatches=1)
    embed = model.vocab_size * model.hidden_size * 2  # untied embedding and output
    params = model.total_params()

    def weights(**training) -> float:
        t = TrainingSpec(seq_len=4096, global_batch_size=8, **training)
        return estimate(model, cluster, t, layout).memory.weights_gb * 1e9

    assert weights() == pytest.approx(2 * params, rel=1e-4)
    mx = 1 + 1 / 32
    assert weights(precision="mxfp8") == pytest.approx(
        2 * embed + (2 + 2 * mx) * (params - embed), rel=1e-3)
    assert weights(precision="mxfp8", fp8_param_gather=True) == pytest.approx(
        2 * embed + 2 * mx * (params - embed), rel=1e-3)


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


def test_the_offloaded_optimizer_share_lives_in_host_memory_with_its_gradient_copies():
    """Megatron's HybridDeviceOptimizer keeps an fp32 parameter copy, an fp32 gradient copy and
    the moments of each offloaded parameter on the host: 16 bytes with fp32 moments."""
    st = static_memory(8e9, 0.0, 8, 1, optimizer_offload_fraction=0.5)
    assert st.optimizer == pytest.approx(12 * 1e9 * 0.5)
    assert st.host == pytest.approx(16 * 1e9 * 0.5)
    assert static_memory(8e9, 0.0, 8, 1).host == 0.0


def test_a_plan_that_offloads_more_than_the_host_holds_does_not_fit():
    """The search recommended Qwen3-235B-A22B on 8 B300 with the whole optimizer offloaded:
    about 30B parameters per GPU whose expert shards have one replica, some 470 GB of host
    memory per GPU where a B300 has 256."""
    from moeplan import load_cluster, load_model
    from moeplan.cost_models.estimate import estimate
    from moeplan.cost_models.memory import HOST_USABLE
    from moeplan.specs import Choices, Layout, TrainingSpec

    model, cluster = load_model("qwen3-235b-a22b"), load_cluster("b300", gpus=8)
    tr = TrainingSpec(seq_len=4096, global_batch_size=256)
    layout = Layout.build(8, 256, tp=4, ep=8)
    est = estimate(model, cluster, tr, layout, Choices(optimizer_offload_fraction=1.0))
    assert est.memory.host_gb > 400 and not est.fits
    assert any("to the host" in w and "offload less" in w for w in est.warnings)
    # on hosts that hold it, the same plan fits: the host alone refused it
    big = cluster.model_copy(update={"host_memory_gb": 1.01 * est.memory.host_gb / HOST_USABLE})
    roomy = estimate(model, big, tr, layout, Choices(optimizer_offload_fraction=1.0))
    assert roomy.fits and roomy.memory.host_gb == pytest.approx(est.memory.host_gb)
