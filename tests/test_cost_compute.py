"""Hand calculations for the compute cost functions."""

import math

import pytest

from moeplan.cost_models.calibration import default_calibration
from moeplan.cost_models.compute import (
    adam_step_bytes,
    attended_keys,
    attention_head_dim_factor,
    attention_time,
    gemm_efficiency,
    gemm_flops,
    gemm_time,
    lowp_speedup,
    membound_time,
)


def test_gemm_flops_is_two_m_k_n():
    assert gemm_flops(2, 3, 4) == 48


def test_gemm_efficiency_saturating_curve_by_hand():
    # m = n = half → ½ each; k = half/4 → ½: 0.8 · ½ · ½ · ½
    assert gemm_efficiency(100, 25, 100, 0.8, 100) == pytest.approx(0.1)
    big = gemm_efficiency(1e6, 1e6, 1e6, 0.8, 100)
    assert big == pytest.approx(0.8, rel=1e-3)


def test_small_expert_gemms_run_far_below_large_ones():
    assert gemm_efficiency(128, 7168, 2048, 0.8, 96) < 0.6 * gemm_efficiency(8192, 7168, 8192,
                                                                            0.8, 96)


def test_lowp_speedup_by_hand():
    assert lowp_speedup(1000, 2000, 0.5) == pytest.approx(1.5)
    assert lowp_speedup(1000, None, 0.5) == 1.0
    assert lowp_speedup(1000, 4000, 0.0) == 1.0


def test_gemm_time_by_hand():
    cal = default_calibration()
    eff = gemm_efficiency(4096, 4096, 4096, cal.gemm_eff_max["hopper"], cal.gemm_half_dim)
    t = gemm_time(4096, 4096, 4096, 989, cal, cal.gemm_eff_max["hopper"], speedup=2.0, count=3)
    assert t == pytest.approx(3 * 2 * 4096**3 / (989e12 * eff * 2.0))
    assert gemm_time(0, 4096, 4096, 989, cal, 0.8) == 0.0


def test_attention_time_uses_measured_efficiencies():
    # the current stack runs today's kernels at the rate they are measured at
    cal = default_calibration()
    f, b = attention_time(1e15, 989, cal, "hopper")
    assert f == pytest.approx(1e15 / (989e12 * cal.attn_fwd_eff["hopper"]))
    assert b == pytest.approx(2.5e15 / (989e12 * cal.attn_bwd_eff["hopper"]))


def test_attended_keys_count_whole_flash_tiles():
    # causal over the whole range: tiles 0..j for query tile j, (s + B)/2 keys per query
    assert attended_keys(4096) == pytest.approx((4096 + 128) / 2)
    # gpt-oss's window of 128: a query tile reaches back 127 keys, into one more tile: 2 tiles
    assert attended_keys(4096, 128) == 256
    assert attended_keys(4096, 129) == 256 and attended_keys(4096, 130) == 384
    assert attended_keys(4096, 1) == 128
    # a window as long as the sequence is plain causal attention; never more work than causal
    assert attended_keys(4096, 4096) == attended_keys(4096)
    assert attended_keys(512, 500) == attended_keys(512)


def test_head_dim_factor_by_hand():
    # [d/(d + D)] / [160/(160 + D)]: d = 64, D = 64 → 0.5 / (160/224) = 0.7
    assert attention_head_dim_factor(64, 64) == pytest.approx(0.5 * 224 / 160)
    assert attention_head_dim_factor(160, 64) == pytest.approx(1.0)
    assert attention_head_dim_factor(256, 64) == 1.0  # capped: the lower bound relies on it
    assert attention_head_dim_factor(128, 64) < 1.0


def test_attention_time_slower_at_small_head_dim():
    cal = default_calibration()
    f_ref, b_ref = attention_time(1e15, 989, cal, "hopper")
    f64, b64 = attention_time(1e15, 989, cal, "hopper", head_dim=64)
    k = attention_head_dim_factor(64, cal.attn_head_dim_half)
    assert f64 == pytest.approx(f_ref / k) and b64 == pytest.approx(b_ref / k)
    assert attention_time(1e15, 989, cal, "hopper", head_dim=160)[0] == pytest.approx(f_ref)


def test_membound_and_adam_bytes_by_hand():
    cal = default_calibration()
    assert membound_time(1e12, 2.0, cal) == pytest.approx(
        cal.membound_scale * 1e12 / (2e12 * cal.hbm_eff))
    # read grad 4, master 4, m 4, v 4; write master 4, m 4, v 4, bf16 param 2
    assert adam_step_bytes(1) == 30
    assert adam_step_bytes(1, moments_bytes=2) == 22
    assert math.isfinite(adam_step_bytes(1e9))


def test_attention_runs_faster_on_longer_kernels_as_measured():
    from moeplan.cost_models.compute import (
        ATTN_LENGTH_TFLOPS,
        attention_length_ceiling,
        attention_length_factors,
    )

    # the REFERENCE cuDNN figures are reproduced at 16K, and 4K is the calibrated reference
    for arch, ((f4, b4), (f16, b16)) in ATTN_LENGTH_TFLOPS.items():
        assert attention_length_factors(4096, arch) == pytest.approx((1.0, 1.0))
        assert attention_length_factors(16384, arch) == pytest.approx((f16 / f4, b16 / b4))
        # longer kernels keep gaining, ever less, and never past the tile model's asymptote
        f = [attention_length_factors(s, arch)[0] for s in (2048, 8192, 65536, 1 << 20)]
        assert f == sorted(f) and f[-1] < attention_length_ceiling(arch)[0]
        assert f[-1] - f[-2] < f[1] - f[0]
    # a 128-token window runs two key tiles per query tile: well under half the 4K efficiency
    # on Hopper forward, as a query tile's fixed cost (≈ 3.6 tiles) dominates
    short = attention_length_factors(128, "hopper", windowed=True)
    assert 0.3 < short[0] < 0.5 and short[1] < short[0]


def test_context_parallel_attention_pays_for_shorter_kernels():
    from moeplan import Layout, TrainingSpec, load_cluster, load_model
    from moeplan.cost_models.calibration import default_calibration
    from moeplan.cost_models.layers import dense_layer, make_context

    m, c = load_model("llama3-70b"), load_cluster("h100", gpus=64)
    tr = TrainingSpec(seq_len=8192, global_batch_size=64)
    cal = default_calibration()
    tp4 = dense_layer(make_context(m, c, tr, Layout.build(64, 64, tp=4, pp=4), cal))
    tp2cp2 = dense_layer(make_context(m, c, tr, Layout.build(64, 64, tp=2, cp=2, pp=4), cal))
    # same attention FLOPs per GPU, but the cp=2 rank runs them over 4K-key kernels
    assert tp2cp2.recompute_fwd_s["core_attn"] > tp4.recompute_fwd_s["core_attn"]


def test_load_balanced_cp_runs_half_its_off_diagonal_ring_steps_over_one_kv_chunk():
    """TE's load-balanced causal ring: every rank holds two chunks of c = s/(2·cp) tokens and
    does the same work per step; the steps whose K/V come from an earlier rank attend over one
    chunk (c keys), the diagonal and later-rank steps over two (2c)."""
    from moeplan.cost_models.layers import cp_kernel_lengths

    assert cp_kernel_lengths(8192, 1) == ((1.0, 8192),)
    assert cp_kernel_lengths(8192, 1, window=128) == ((1.0, 128),)
    for cp in (2, 4, 8, 32):
        parts = cp_kernel_lengths(65536, cp)
        assert sum(share for share, _ in parts) == pytest.approx(1.0)
        (long_share, long_kv), (short_share, short_kv) = parts
        assert long_kv == 65536 / cp and short_kv == 65536 / (2 * cp)
        assert short_share == pytest.approx((cp - 1) / (2 * cp))  # → ½ of the work at large cp
    assert cp_kernel_lengths(65536, 4, window=4096) == ((0.625, 4096), (0.375, 4096))


def test_an_older_stack_realises_at_most_the_attention_microbenchmark():
    """`attn_realised` scales the measured kernel efficiencies down to what an older stack's
    attention realised, per architecture; above 1 it is clipped, so no fit can make attention
    beat today's kernel; the current stack runs the kernel as measured whatever it says."""
    base = default_calibration().with_overrides({"attn_realised": {"hopper": 1.0}})
    f1, b1 = attention_time(1e15, 989.0, base, "hopper", 128.0, 4096.0, current_kernels=False)
    slow = base.with_overrides({"attn_realised": {"hopper": 0.8}})
    f8, b8 = attention_time(1e15, 989.0, slow, "hopper", 128.0, 4096.0, current_kernels=False)
    assert f8 == pytest.approx(f1 / 0.8) and b8 == pytest.approx(b1 / 0.8)
    assert attention_time(1e15, 989.0, slow, "hopper", 128.0, 4096.0) == pytest.approx((f1, b1))
    fast = base.with_overrides({"attn_realised": {"hopper": 1.5}})
    assert attention_time(1e15, 989.0, fast, "hopper", 128.0, 4096.0,
                          current_kernels=False) == pytest.approx((f1, b1))
    # another architecture keeps its own share
    other = attention_time(1e15, 2250.0, slow, "blackwell", 128.0, 4096.0, current_kernels=False)
    assert other == pytest.approx(attention_time(1e15, 2250.0, base, "blackwell", 128.0, 4096.0,
                                                 current_kernels=False))


def test_long_context_moves_tflops_up_on_the_current_stack_as_attention_takes_over():
    """As sequence and CP grow together, attention (at today's kernel rate, faster than a
    fine-grained MoE's GEMMs) takes a growing share of the step, so model TFLOPS rise: the
    direction measured runs move in (docs/ACCURACY.md, long context)."""
    from moeplan.cost_models import estimate
    from moeplan.specs import Layout, TrainingSpec, load_cluster, load_model

    m, tf = load_model("qwen3-235b-a22b"), []
    for seq, cp in ((16384, 1), (32768, 2), (65536, 4), (131072, 8)):
        L = Layout.build(256, 4 * 8 * 256 // (2 * 8 * cp), tp=2, pp=8, cp=cp, ep=32)
        t = TrainingSpec(seq_len=seq, global_batch_size=L.dp * L.num_microbatches)
        tf.append(estimate(m, load_cluster("h100", 256), t, L).tflops_per_gpu)
    assert all(b > a for a, b in zip(tf, tf[1:], strict=False)) and tf[-1] > 1.2 * tf[0]


def test_no_gemm_runs_faster_than_the_gpus_measured_matmul_ceiling():
    """The fitted shape curve may promise more than the hardware does for large GEMMs; the
    measured ceiling (ClusterSpec.mamf) bounds every GEMM, and leaves smaller ones alone."""
    cal = default_calibration()
    big = gemm_time(16384, 16384, 16384, 989, cal, 0.95, ceiling_tflops=794.5)
    assert big == pytest.approx(gemm_flops(16384, 16384, 16384) / 794.5e12)
    assert big > gemm_time(16384, 16384, 16384, 989, cal, 0.95)
    small = gemm_time(128, 2048, 1024, 989, cal, 0.95, ceiling_tflops=794.5)
    assert small == pytest.approx(gemm_time(128, 2048, 1024, 989, cal, 0.95))
    fp8 = gemm_time(16384, 16384, 16384, 989, cal, 0.95, speedup=1.9, ceiling_tflops=1402.6)
    assert fp8 == pytest.approx(gemm_flops(16384, 16384, 16384) / 1402.6e12)


def test_a_faster_exponential_saves_the_softmax_share_of_both_passes():
    from moeplan.cost_models.compute import softmax_share

    cal = default_calibration()
    f1, b1 = attention_time(1e15, 2500, cal, "blackwell", head_dim=128)
    f2, b2 = attention_time(1e15, 2500, cal, "blackwell", head_dim=128, exp_scale=2.0)
    saved = f1 * softmax_share(128, cal.attn_head_dim_half) / 2
    assert f2 == pytest.approx(f1 - saved) and b2 == pytest.approx(b1 - saved)
    # no head dim, no split to price: the base rate stands
    assert attention_time(1e15, 2500, cal, "blackwell", exp_scale=2.0) == attention_time(
        1e15, 2500, cal, "blackwell")


def test_the_softmax_share_reproduces_nvidias_blackwell_ultra_attention_gain():
    """NVIDIA measured DeepSeek-V3's FP8 attention forward about 1.35x faster on GB300 than on
    GB200, whose SFUs run the exponential at half the rate: priced as d tensor units (half
    of them at FP8's rate) plus the softmax's D at the SFU's, the gain is within 10% of it."""
    from moeplan.cost_models.compute import ATTN_REF_HEAD_DIM, softmax_share

    s = softmax_share(ATTN_REF_HEAD_DIM, default_calibration().attn_head_dim_half)
    fp8 = s / (s + (1 - s) / 2)  # the softmax's share once the tensor part runs twice as fast
    gain = 1 / (1 - fp8 / 2)
    assert gain == pytest.approx(1.35, rel=0.10)


def test_blackwell_ultra_prices_attention_faster_and_its_bound_allows_it():
    from moeplan.cost_models.estimate import estimate, lower_bound
    from moeplan.specs import Layout, TrainingSpec, load_cluster, load_model

    m = load_model("llama3-8b")
    t = TrainingSpec(seq_len=131072, global_batch_size=8)
    lay = Layout.build(8, 8, cp=8)
    gb300 = load_cluster("gb300-nvl72", 8)
    assert gb300.sfu_exp_scale == 2.0 and load_cluster("gb200-nvl72", 8).sfu_exp_scale == 1.0
    base = gb300.model_copy(update={"sfu_exp_scale": 1.0})  # the same GPU at Blackwell's rate
    slow = estimate(m, base, t, lay, with_interval=False)
    fast = estimate(m, gb300, t, lay, with_interval=False)
    # at 128K attention is most of the step: the SFU's share shows
    assert 1.03 < slow.step_time_s / fast.step_time_s < 1.17
    assert lower_bound(m, gb300, t, 1, 8, 1, 1)[0] <= fast.step_time_s
