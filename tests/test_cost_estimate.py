"""Whole-step estimates: directional truths, the DeepSeek-V3 memory anatomy, speed, bounds."""

import time

import pytest

from moeplan.cost_models import estimate, estimate_breakdown, lower_bound
from moeplan.errors import LayoutError
from moeplan.specs import Choices, Layout, TrainingSpec, load_cluster, load_model

GB = 1e9


def run(model, cluster, gpus, gbs, seq=4096, precision="bf16", choices=None, **axes):
    m, c = load_model(model), load_cluster(cluster, gpus)
    t = TrainingSpec(seq_len=seq, global_batch_size=gbs, precision=precision)
    return estimate(m, c, t, Layout.build(gpus, gbs, **axes), choices)


def test_recompute_lowers_activations_and_raises_time():
    base = run("qwen3-30b-a3b", "h100", 16, 256, ep=8, pp=2)
    rec = run("qwen3-30b-a3b", "h100", 16, 256, ep=8, pp=2,
              choices=Choices(recompute=["moe_act", "layernorm"]))
    full = run("qwen3-30b-a3b", "h100", 16, 256, ep=8, pp=2, choices=Choices(recompute=["full"]))
    assert full.memory.activations_gb < rec.memory.activations_gb < base.memory.activations_gb
    assert full.step_time_s > rec.step_time_s > base.step_time_s
    assert full.time.recompute_s > 0 and base.time.recompute_s == 0


def test_fp8_lowers_compute_time():
    bf = run("llama3-70b", "h100", 64, 128, tp=4, pp=4)
    f8 = run("llama3-70b", "h100", 64, 128, tp=4, pp=4, precision="fp8-tensorwise")
    assert f8.time.compute_s < bf.time.compute_s
    assert f8.tokens_per_s_per_gpu > bf.tokens_per_s_per_gpu


def test_ep_beyond_nvlink_domain_costs_more_ep_time():
    m = load_model("qwen3-30b-a3b")
    t = TrainingSpec(seq_len=4096, global_batch_size=64)
    L = Layout.build(16, 64, ep=16)
    h100 = load_cluster("h100", 16)
    wide = h100.model_copy(update={"nvlink_domain_gpus": 16, "gpus_per_node": 16})
    across, inside = estimate(m, h100, t, L), estimate(m, wide, t, L)
    assert across.time.ep_comm_s > 1.5 * inside.time.ep_comm_s
    assert across.step_time_s > inside.step_time_s


def test_larger_pp_raises_bubble_at_fixed_microbatches():
    # 16 micro-batches per replica either way: pp 2 → dp 8 (gbs 128), pp 4 → dp 4 (gbs 64)
    p2 = run("llama3-8b", "h100", 16, 128, pp=2)
    p4 = run("llama3-8b", "h100", 16, 64, pp=4)
    assert p4.time.pp_bubble_s / p4.step_time_s > p2.time.pp_bubble_s / p2.step_time_s


def test_offload_lowers_memory():
    base = run("mixtral-8x7b", "h100", 16, 64, ep=8, pp=2)
    off = run("mixtral-8x7b", "h100", 16, 64, ep=8, pp=2,
              choices=Choices(offload=["expert_fc1", "moe_act"]))
    assert off.memory.activations_gb < base.memory.activations_gb
    assert off.memory.peak_gb < base.memory.peak_gb


def test_offload_copies_hide_only_behind_their_own_layers_compute():
    # a layer that moves many bytes and computes little cannot borrow its neighbour's compute:
    # the chunk exposes what each layer's own forward and backward leave uncovered
    from moeplan.cost_models import calibration_for, stage_terms
    from moeplan.cost_models.comm import host_copy_time
    from moeplan.cost_models.layers import ActTensor, LayerCost

    m, c = load_model("mixtral-8x7b"), load_cluster("h100", 16)
    t = TrainingSpec(seq_len=4096, global_batch_size=64)
    terms = stage_terms(m, c, t, Layout.build(16, 64, ep=8, pp=2), calibration_for(None))
    copy_s = host_copy_time(1e9, c)
    heavy = LayerCost("heavy", fwd_s=0.25 * copy_s, bwd_s=0.5 * copy_s,
                      tensors=(ActTensor("x", 1e9, offload_by="moe_act"),))
    busy = LayerCost("busy", fwd_s=4 * copy_s, bwd_s=4 * copy_s)
    chunk = terms.chunk([("heavy", heavy), ("busy", busy)], [], ["moe_act"])
    assert chunk.offload_bytes == 1e9
    assert chunk.offload_s == pytest.approx(0.75 * copy_s + 0.5 * copy_s, rel=1e-12)
    # the busy layer's passes alone would have hidden both copies
    assert chunk.fwd_s > copy_s and chunk.bwd_s > copy_s


def test_imbalance_raises_step_time_and_histogram_matches_factor():
    m, c = load_model("qwen3-30b-a3b"), load_cluster("h100", 16)
    t = TrainingSpec(seq_len=4096, global_batch_size=64)
    L = Layout.build(16, 64, ep=8)
    flat = estimate(m, c, t, L)
    skew = estimate(m, c, t, L, imbalance=1.5)
    assert skew.step_time_s > flat.step_time_s
    # 8 EP ranks with 16 experts each; rank 0 gets 1.5× the mean
    tpe = [168.0] * 16 + [104.0] * 112  # 16·168 / ((16·168 + 112·104) / 8) = 1.5
    assert abs(sum(tpe[:16]) / (sum(tpe) / 8) - 1.5) < 1e-9
    hist = {"layers": [{"layer": i, "tokens_per_expert": tpe} for i in range(m.num_layers)]}
    from_hist = estimate(m, c, t, L, routing_histogram=hist)
    assert from_hist.step_time_s == pytest.approx(skew.step_time_s)


def test_invalid_layout_names_each_rule():
    m, c = load_model("deepseek-v3"), load_cluster("h100", 64)
    t = TrainingSpec(seq_len=4096, global_batch_size=64)
    with pytest.raises(LayoutError) as e:
        estimate(m, c, t, Layout(dp=64, ep=3, num_microbatches=1))
    assert "experts_divisible_by_ep" in [r for r, _ in e.value.violations]


def test_not_fitting_returns_fits_false():
    e = run("deepseek-v3", "h100", 256, 1024, pp=4, vpp=4, ep=64)
    assert e.fits is False and e.bottleneck == "memory"
    assert e.memory.peak_gb > load_cluster("h100").hbm_gb


def test_deepseek_v3_memory_anatomy_within_15_percent():
    """Megatron Core MoE report: DeepSeek-V3, 256 GPUs, PP4 VPP4 EP64, TP1, ETP1, MBS1, s 4096,
    BF16, distributed optimizer, no memory optimisation: weights+grads 36.4, master+optimizer
    32.1, activations 131.0, total 199.5 GB per GPU. We compare the peak GPU."""
    m, c = load_model("deepseek-v3"), load_cluster("h100", 256)
    t = TrainingSpec(seq_len=4096, global_batch_size=1024)
    b = estimate_breakdown(m, c, t, Layout.build(256, 1024, pp=4, vpp=4, ep=64))
    mem = b.estimate.memory
    parts = {"weights+grads": (mem.weights_gb + mem.grads_gb, 36.4),
             "optimizer": (mem.optimizer_gb, 32.1),
             "activations": (mem.activations_gb, 131.0),
             "total": (mem.weights_gb + mem.grads_gb + mem.optimizer_gb + mem.activations_gb,
                       199.5)}
    for name, (ours, report) in parts.items():
        assert abs(ours / report - 1) <= 0.15, (name, ours, report)


def test_estimate_is_fast_in_process():
    m, c = load_model("deepseek-v3"), load_cluster("gb200-nvl72", 1024)
    t = TrainingSpec(seq_len=4096, global_batch_size=4096)
    L = Layout.build(1024, 4096, pp=8, vpp=4, ep=64)
    t0 = time.process_time()  # CPU time: a busy machine does not count against it
    estimate(m, c, t, L)
    assert time.process_time() - t0 < 1.0


def test_lower_bound_never_exceeds_estimate():
    m, c = load_model("qwen3-235b-a22b"), load_cluster("h100", 256)
    t = TrainingSpec(seq_len=4096, global_batch_size=1024)
    for axes in ({"tp": 2, "pp": 8, "ep": 8}, {"tp": 1, "pp": 4, "ep": 32, "vpp": 2},
                 {"tp": 4, "pp": 4, "ep": 16, "etp": 1}):
        L = Layout.build(256, 1024, **axes)
        e = estimate(m, c, t, L, Choices(recompute=["full"]))
        lb_s, lb_bytes = lower_bound(m, c, t, L.tp, L.cp, L.dp, L.pp, L.ep, L.etp)
        assert 0 < lb_s <= e.step_time_s
        assert 0 < lb_bytes <= e.memory.peak_gb * GB


def test_mfu_and_tflops_follow_megatron_flop_count():
    e = run("llama3-8b", "h100", 8, 64)
    m = load_model("llama3-8b")
    tokens = 64 * 4096
    assert e.tflops_per_gpu == pytest.approx(m.flops_per_token(4096) * tokens / e.step_time_s
                                             / 8 / 1e12)
    assert e.mfu == pytest.approx(e.tflops_per_gpu / 989)
    assert e.tokens_per_s_per_gpu == pytest.approx(tokens / e.step_time_s / 8)


def test_confidence_label_present():
    e = run("llama3-8b", "a100-80g", 8, 64)
    assert e.confidence is not None and e.confidence.label in ("calibrated", "extrapolated")


@pytest.mark.parametrize(("model", "cluster", "precision", "axes"), [
    ("gpt-oss-120b", "b200", "bf16", {"ep": 8}),  # fit rows only of a model the fit misses
    ("qwen3-30b-a3b", "h100", "bf16", {"ep": 8}),
    ("deepseek-v3", "h800", "fp8-blockwise", {"ep": 8, "pp": 8}),
    ("llama3-8b", "gb200-nvl72", "mxfp8", {}),
])
def test_the_confidence_label_and_the_calibration_assumption_never_disagree(model, cluster,
                                                                           precision, axes):
    """One estimate printed "not validated: B200 calibration for bf16 MoE models" beside
    "confidence: calibrated": both now ask whether fit rows validate the calibration."""
    e = run(model, cluster, 64, 512, precision=precision, **axes)
    term = next(a for a in e.assumptions if a.term.endswith(" models")
                and "calibration for" in a.term)
    assert (e.confidence.label == "calibrated") == term.validated, (e.confidence, term)


def test_korthikanti_table5_dense_a100_runs_within_5_percent():
    """Calculon's validation set (Korthikanti et al. 2022 Table 5: GPT 22B to 1T on A100, full
    and selective recomputation), never seen by the fit, priced on the stack it ran
    (`megatron-2022`: unfused attention, dropout, no DP overlap): MAPE within 5% (the issue's
    bar), no run past 9% either way, and full against selective recomputation in the measured
    ratio within 3% for every size (both recompute modes right, not one compensating the
    other)."""
    from pathlib import Path

    from moeplan.validation import read_rows, validate_rows

    out = validate_rows(read_rows(Path(__file__).parent.parent / "bench" / "data"
                                  / "korthikanti_2022_table5.csv"))
    assert not out["skipped"] and len(out["rows"]) == 8
    assert {r["assumed"].get("software_stack") for r in out["rows"]} == {"megatron-2022"}
    errors = {r["id"]: r["predicted_tokens_per_s_per_gpu"] / r["published_tokens_per_s_per_gpu"]
              - 1 for r in out["rows"]}
    assert sum(map(abs, errors.values())) / len(errors) <= 0.05
    assert max(map(abs, errors.values())) <= 0.09
    for size in ("22B", "175B", "530B", "1000B"):
        full, sel = errors[f"K22-{size}-full"], errors[f"K22-{size}-selective"]
        assert abs((1 + full) / (1 + sel) - 1) <= 0.03
