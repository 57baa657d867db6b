"""Per-layer costs: activation bytes by hand, recompute/offload semantics, planner options."""

import math

import pytest

from moeplan.cost_models import calibration_for, dense_layer, make_context, moe_layer
from moeplan.specs import Layout, TrainingSpec, load_cluster, load_model


def ctx_for(model, layout, seq=4096, precision="bf16", cluster="h100"):
    c = load_cluster(cluster, layout.world_size)
    t = TrainingSpec(seq_len=seq, global_batch_size=layout.dp * layout.mbs
                     * layout.num_microbatches, precision=precision)
    return make_context(load_model(model), c, t, layout, calibration_for(c.calibration))


def test_dense_gqa_swiglu_activation_bytes_by_hand():
    # llama3-8b: h 4096, f 14336, a 32, g 8, d 128; per token (bf16 unless noted):
    # layer input, norm out, mlp input, mlp norm out: 4·2h; q,k,v: 2(a+2g)d; attention out: 2ad;
    # softmax statistics: 4a (fp32); fc1 out 2·2f; SwiGLU out 2f
    h, f, a, g, d, s = 4096, 14336, 32, 8, 128, 4096
    per_token = 4 * 2 * h + 2 * (a + 2 * g) * d + 2 * a * d + 4 * a + 2 * 2 * f + 2 * f
    lc = dense_layer(ctx_for("llama3-8b", Layout(dp=1)))
    assert lc.activation_bytes() == pytest.approx(per_token * s)
    # with tp 2 and sequence parallelism every tensor halves
    lc2 = dense_layer(ctx_for("llama3-8b", Layout(tp=2, dp=1)))
    assert lc2.activation_bytes() == pytest.approx(per_token * s / 2)


def test_moe_routed_tensors_scale_with_top_k_and_imbalance():
    m = load_model("mixtral-8x7b")  # top-2, expert FFN 14336
    L = Layout(dp=8, ep=8)
    lc = moe_layer(ctx_for("mixtral-8x7b", L))
    names = {t.name: t.bytes for t in lc.tensors}
    R = 4096 * m.moe_top_k
    assert names["expert_fc1_in"] == pytest.approx(2 * R * m.hidden_size)
    assert names["expert_fc1_out"] == pytest.approx(2 * R * 2 * m.moe_ffn_hidden_size)
    assert names["expert_act_out"] == pytest.approx(2 * R * m.moe_ffn_hidden_size)
    skew = moe_layer(ctx_for("mixtral-8x7b", L), imbalance=1.5)
    assert {t.name: t.bytes for t in skew.tensors}["expert_fc1_in"] == pytest.approx(
        1.5 * names["expert_fc1_in"])
    assert skew.ep_s > lc.ep_s and skew.fwd_s > lc.fwd_s


def test_expert_params_sharded_over_ep_and_etp():
    m = load_model("qwen3-30b-a3b")
    lc = moe_layer(ctx_for("qwen3-30b-a3b", Layout(dp=8, ep=8)))
    assert lc.expert_params == pytest.approx(m.num_experts * m.expert_params() / 8)


def test_recompute_and_offload_semantics():
    lc = moe_layer(ctx_for("deepseek-v3", Layout(dp=64, ep=64)))
    base = lc.activation_bytes()
    for r in ("moe_act", "layernorm", "mla_up_proj", "moe", "shared_experts"):
        assert lc.activation_bytes([r]) < base, r
        assert lc.recompute_s([r]) > 0, r
    full = lc.activation_bytes(["full"])
    assert full == pytest.approx(next(t.bytes for t in lc.tensors if t.name == "layer_input"))
    assert lc.recompute_s(["full"]) >= lc.fwd_s
    # offload moves bytes off the GPU; a tensor both recomputed and offloaded is only recomputed
    assert lc.activation_bytes([], ["expert_fc1"]) < base
    assert lc.offload_bytes([], ["expert_fc1"]) == pytest.approx(
        base - lc.activation_bytes([], ["expert_fc1"]))
    assert lc.offload_bytes(["moe"], ["expert_fc1"]) == 0.0


def test_fp8_lowers_gemm_time():
    L = Layout(dp=8, ep=8)
    # device time (a host-bound layer at micro-batch 1 pays FP8's extra quantize launches)
    bf = moe_layer(_without_host(ctx_for("qwen3-30b-a3b", L)))
    f8 = moe_layer(_without_host(ctx_for("qwen3-30b-a3b", L, precision="fp8-tensorwise")))
    assert f8.fwd_s < bf.fwd_s and f8.bwd_s < bf.bwd_s


@pytest.mark.parametrize(("precision", "per_element"), [
    ("bf16", 0.0),
    ("fp8-delayed", 2 + 2 * 1.0),              # one read, FP8 and FP8-transposed copies
    ("mxfp8", 2 + 2 * (1 + 1 / 32)),           # row- and column-wise, an E8M0 scale per 32
    ("fp8-blockwise", 2 + 2 * (1 + 4 / 128)),  # an fp32 scale per 128
    ("fp8-tensorwise", 2 * 2 + 2 * 1.0),       # current scaling reads once more for its amax
    ("nvfp4", 2 * 2 + 2 * (0.5 + 1 / 16)),     # its per-tensor scale's amax, FP8 scale per 16
])
def test_a_quantize_reads_its_input_and_writes_both_copies_training_uses(precision, per_element):
    """Transformer Engine quantizes a GEMM operand once for the forward GEMM (row-wise) and the
    weight-gradient GEMM (column-wise) in one pass; current scaling and NVFP4 read the input
    first for its amax, in a kernel of their own, which the launch count carries too."""
    from moeplan.cost_models.host import quantize_launches
    from moeplan.cost_models.layers import _cast_bytes

    ctx = ctx_for("llama3-8b", Layout(dp=1), precision=precision,
                  cluster="gb200-nvl72" if precision in ("mxfp8", "nvfp4") else "h100")
    assert _cast_bytes(ctx, 1000.0) == pytest.approx(1000.0 * per_element)
    kernels = quantize_launches(precision)[0]
    assert kernels == {"bf16": 0, "fp8-tensorwise": 3, "nvfp4": 2}.get(precision, 1)


def test_flex_dispatcher_sends_fewer_bytes_across_domains_than_alltoall():
    L = dict(dp=64, ep=64)
    a2a = moe_layer(ctx_for("deepseek-v3", Layout(**L)))
    flex = moe_layer(ctx_for("deepseek-v3", Layout(dispatcher="flex", **L)))
    assert flex.ep_s < a2a.ep_s
    # inside one NVLink domain the two coincide
    same = moe_layer(ctx_for("deepseek-v3", Layout(dispatcher="flex", dp=8, ep=8)))
    assert same.ep_s == pytest.approx(moe_layer(ctx_for("deepseek-v3", Layout(dp=8, ep=8))).ep_s)


def test_allgather_dispatcher_moves_the_whole_ep_groups_tokens():
    a2a = moe_layer(ctx_for("qwen3-30b-a3b", Layout(dp=8, ep=8)))
    ag = moe_layer(ctx_for("qwen3-30b-a3b", Layout(dp=8, ep=8, dispatcher="allgather")))
    assert ag.ep_s != a2a.ep_s and ag.ep_s > 0


def test_sliding_window_layer_prices_the_tiles_its_kernel_computes():
    # gpt-oss-120b: w = 128, 64 heads of d = 64; a sliding layer's core attention does
    # 2·128 keys per query (two 128-key tiles), a full layer (s + 128)/2
    from moeplan.cost_models.compute import attended_keys, attention_time

    c = ctx_for("gpt-oss-120b", Layout(dp=8, ep=8))
    m, s = c.model, 4096
    full, swa = dense_layer(c), dense_layer(c, sliding=True)
    per_key = s * m.num_attention_heads * 2 * (2 * m.head_dim_)  # QKᵀ + PV FLOPs per key
    f_full = attention_time(per_key * attended_keys(s), c.peak, c.cal, c.arch, m.head_dim_,
                            kv_len=s)[0]
    # the window's short kernel runs at the efficiency of its two key tiles per query tile
    # (attention_length_factors, windowed)
    f_swa = attention_time(per_key * 256, c.peak, c.cal, c.arch, m.head_dim_, kv_len=128,
                           windowed=True)[0]
    assert full.recompute_fwd_s["core_attn"] == pytest.approx(f_full)
    assert swa.recompute_fwd_s["core_attn"] == pytest.approx(f_swa)
    # flash attention keeps no s² scores: the window does not change the saved activations
    assert swa.activation_bytes() == pytest.approx(full.activation_bytes())


def test_context_parallel_adds_per_step_corrections():
    # llama3-8b, s 16384 over cp 2: N = 8192 queries per rank over (s + 128)/2 keys, plus c
    # per-step fp32 merges of the partial output (read + write, 8 bytes per element)
    from moeplan.cost_models.compute import attended_keys, attention_time, membound_time
    from moeplan.cost_models.layers import cp_kernel_lengths

    c = ctx_for("llama3-8b", Layout(cp=2, dp=1), seq=16384)
    m, s, N = c.model, 16384, 8192
    a, d = m.num_attention_heads, m.head_dim_
    work = N * attended_keys(s) * a * 2 * (2 * d)
    # each ring step's kernel runs over its own K/V: s/cp keys, or one chunk of s/(2·cp)
    core = sum(attention_time(share * work, c.peak, c.cal, c.arch, d, kv_len=keys)[0]
               for share, keys in cp_kernel_lengths(s, 2))
    merge = membound_time(2 * 8 * N * a * d, c.cluster.hbm_tb_s, c.cal)
    assert dense_layer(c).recompute_fwd_s["core_attn"] == pytest.approx(core + merge)


def _without_host(ctx):
    """The context with no host time per launch: device time only."""
    from dataclasses import replace

    from moeplan.cost_models import make_context

    return make_context(ctx.model, ctx.cluster, ctx.training, ctx.layout,
                        replace(ctx.cal, launch_us={}))


def test_yarn_with_a_cos_sin_factor_runs_rope_unfused_and_prices_its_traffic():
    # gpt-oss-120b: yarn s = 32 without mscale/mscale_all_dim, cos/sin × (0.1·ln 32 + 1);
    # Megatron Core then applies RoPE with PyTorch kernels: 20 more bytes per q/k element
    # forward, 14 backward, and 23 more launches forward
    from moeplan.cost_models.compute import membound_time
    from moeplan.cost_models.host import UNFUSED_ROPE_FWD, layer_launches, unfused_rope

    c = _without_host(ctx_for("gpt-oss-120b", Layout(dp=8, ep=8)))
    m = c.model
    assert m.rope_scaling.yarn_attention_factor() == pytest.approx(0.1 * math.log(32) + 1)
    plain = m.model_copy(update={"rope_scaling": None})
    # DeepSeek-V3's yarn sets mscale = mscale_all_dim = 1: factor 1, TE's fused kernel
    ds = m.model_copy(update={"rope_scaling": m.rope_scaling.model_copy(
        update={"mscale": 1.0, "mscale_all_dim": 1.0})})
    assert unfused_rope(m) and not unfused_rope(plain) and not unfused_rope(ds)
    base = _without_host(make_context(plain, c.cluster, c.training, c.layout, c.cal))
    elems = 4096 * (m.num_attention_heads + m.kv_heads) * m.head_dim_
    hbm = c.cluster.hbm_tb_s
    full, ref = dense_layer(c), dense_layer(base)
    assert full.fwd_s - ref.fwd_s == pytest.approx(membound_time(20 * elems, hbm, c.cal))
    assert full.bwd_s - ref.bwd_s == pytest.approx(membound_time(14 * elems, hbm, c.cal))
    n, n0 = (layer_launches(x, c.layout, "bf16", "dense") for x in (m, plain))
    assert n.pre - n0.pre == UNFUSED_ROPE_FWD and n.bwd > n0.bwd


def test_expert_output_biases_price_megatrons_eager_weighted_bias_path():
    # gpt-oss experts carry biases; Megatron Core adds the fc2 bias times each copy's fp32
    # routing probability expert by expert: 28 bytes per routed element forward, 36 backward,
    # 2 launches per local expert (+2) forward and 5 (+1) backward
    from moeplan.cost_models.compute import membound_time
    from moeplan.cost_models.host import layer_launches

    L = Layout(dp=8, ep=8)
    c = _without_host(ctx_for("gpt-oss-120b", L))
    m = c.model
    nob = m.model_copy(update={"mlp_bias": False})
    base = _without_host(make_context(nob, c.cluster, c.training, L, c.cal))
    n = 4096 * m.moe_top_k * m.hidden_size
    hbm = c.cluster.hbm_tb_s
    lc, ref = moe_layer(c), moe_layer(base)
    assert lc.fwd_s - ref.fwd_s == pytest.approx(membound_time(28 * n, hbm, c.cal))
    assert lc.bwd_s - ref.bwd_s == pytest.approx(membound_time(36 * n, hbm, c.cal))
    local = m.num_experts // L.ep
    a, b = (layer_launches(x, L, "bf16", "moe") for x in (m, nob))
    assert (a.post - b.post, a.bwd - b.bwd) == (2 * local + 2, 5 * local + 1)


def test_deepep_inside_an_nvl72_runs_at_its_measured_bandwidth_and_hybridep_at_nvlinks():
    """DeepEP across the trays of an NVL72 reaches 400 GB/s dispatch and 190 GB/s combine
    (NVIDIA's DeepSeek-V3 GB200 guide); HybridEP and NCCL's all-to-all run at the NVLink model.
    Two of each transfer per layer: a dispatch's backward is a combine and vice versa."""
    from moeplan.cost_models import comm as C

    lay = dict(dp=32, pp=8, ep=32, vpp=4, num_microbatches=64)
    hybrid = moe_layer(ctx_for("deepseek-v3", Layout(dispatcher="flex", **lay), cluster="gb200-nvl72"))
    a2a = moe_layer(ctx_for("deepseek-v3", Layout(**lay), cluster="gb200-nvl72"))
    deep_ctx = ctx_for("deepseek-v3", Layout(dispatcher="flex", flex_backend="deepep", **lay),
                       cluster="gb200-nvl72")
    deep = moe_layer(deep_ctx)
    assert hybrid.ep_s == pytest.approx(a2a.ep_s)
    m = deep_ctx.model
    token_bytes = deep_ctx.n_sp * m.hidden_size * 2
    hits = C.ranks_hit(m.num_experts, m.moe_top_k, 32, m.router_num_groups,
                       m.router_groups_per_token)
    by_hand = 2 * hits * token_bytes * (1 / 400e9 + 1 / 190e9)
    assert deep.ep_s == pytest.approx(by_hand, rel=0.01)
    assert deep.ep_s > 1.5 * hybrid.ep_s
    # on an HGX node (one 8-GPU NVLink domain per node) DeepEP's intranode kernels are NVLink's
    hgx = dict(dp=8, ep=8)
    assert moe_layer(ctx_for("deepseek-v3", Layout(dispatcher="flex", flex_backend="deepep",
                                                   **hgx))).ep_s == pytest.approx(
        moe_layer(ctx_for("deepseek-v3", Layout(dispatcher="flex", **hgx))).ep_s)


def test_deepep_exposes_its_slower_combine_without_ep_overlap():
    lay = dict(dp=32, pp=8, ep=32, vpp=4, num_microbatches=64, dispatcher="flex")
    hybrid = moe_layer(ctx_for("deepseek-v3", Layout(**lay), cluster="gb200-nvl72"))
    deep = moe_layer(ctx_for("deepseek-v3", Layout(flex_backend="deepep", **lay),
                             cluster="gb200-nvl72"))
    assert deep.exposed_s(1.0) - hybrid.exposed_s(1.0) == pytest.approx(
        deep.ep_s - hybrid.ep_s, rel=1e-6)
