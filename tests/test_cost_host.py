"""The host floor (cost_models.host): a layer takes max(host, device), never their sum; CUDA
graphs launch their captured part as one graph; an MoE layer pays its routing sync and launches
a GEMM per local expert; quantizing recipes launch their kernels per operand and per expert;
an MoE layer padded to capacity has static shapes."""

import pytest

from moeplan import Layout, TrainingSpec, load_cluster, load_model
from moeplan.cost_models.calibration import default_calibration
from moeplan.cost_models.host import (
    AFTER_SYNC,
    SYNC_GAP_LAUNCHES,
    after_sync_s,
    host_kind,
    layer_launches,
)
from moeplan.cost_models.layers import dense_layer, make_context, moe_layer

LLAMA = load_model("llama3-8b")
QWEN = load_model("qwen3-30b-a3b")
H100 = load_cluster("h100", gpus=16)


def _layer(model, launch_us, precision="bf16", training=None, **axes):
    """A layer's cost with the host time per launch set to `launch_us` on every host."""
    cal = default_calibration().with_overrides({"launch_us": {"x86": launch_us,
                                                              "grace": launch_us}})
    tr = TrainingSpec(seq_len=4096, global_batch_size=64, precision=precision,
                      **(training or {}))
    ctx = make_context(model, H100, tr, Layout.build(16, 64, **axes), cal)
    return (moe_layer if model.is_moe else dense_layer)(ctx)


def test_a_host_bound_layer_takes_the_host_time_not_the_sum():
    device = _layer(LLAMA, 0.0, tp=8)          # no floor: the device's time
    slow = _layer(LLAMA, 1000.0, tp=8)         # a host far slower than the device
    fast = _layer(LLAMA, 1e-3, tp=8)           # a host far faster
    n = layer_launches(LLAMA, Layout.build(16, 64, tp=8), "bf16", "dense")
    # host-bound: forward + exposed communication is exactly the host's launches
    assert slow.fwd_s + slow.exposed_fwd_s == pytest.approx(n.pre * 1e-3)
    assert slow.bwd_s + slow.exposed_bwd_s == pytest.approx(n.bwd * 1e-3)
    # device-bound: the host adds nothing (a max, not an additive constant)
    assert fast.fwd_s == device.fwd_s and fast.bwd_s == device.bwd_s


def test_cuda_graphs_launch_a_dense_layer_as_one_graph():
    device = _layer(LLAMA, 0.0, tp=8)
    graphed = _layer(LLAMA, 1000.0, tp=8, cuda_graphs=True)
    assert graphed.fwd_s == device.fwd_s and graphed.bwd_s == device.bwd_s


def test_an_moe_layer_pays_its_routing_sync_and_launches_its_experts_even_under_graphs():
    t = 1000e-6
    device = _layer(QWEN, 0.0, ep=8)
    graphed = _layer(QWEN, 1000.0, ep=8, cuda_graphs=True)
    n = layer_launches(QWEN, Layout.build(16, 64, ep=8), "bf16", "moe")
    assert n.syncs == 1
    # the part after the sync (dispatch, grouped GEMMs, combine) stays eager under graphs
    extra = graphed.fwd_s - device.fwd_s
    assert extra >= n.post * t - (device.fwd_s + device.exposed_fwd_s)
    assert extra >= SYNC_GAP_LAUNCHES * t
    # fewer experts per rank, fewer grouped-GEMM launches
    wide = layer_launches(QWEN, Layout.build(16, 64, ep=16), "bf16", "moe")
    assert n.post - wide.post == 2 * (QWEN.num_experts // 8 - QWEN.num_experts // 16)
    assert n.bwd > wide.bwd


def test_quantizing_recipes_launch_their_kernels_per_operand_and_per_expert():
    lay = Layout.build(16, 64, tp=8)
    bf16, fp8, cs = (layer_launches(LLAMA, lay, p, "dense")
                     for p in ("bf16", "mxfp8", "fp8-tensorwise"))
    gemms = 2 + 2  # QKV, proj; fc1, fc2
    assert fp8.pre - bf16.pre == gemms and fp8.bwd - bf16.bwd == gemms
    # current scaling: amax, scale from amax and cast, three kernels per tensor
    assert cs.pre - bf16.pre == 3 * gemms and cs.bwd - bf16.bwd == 3 * gemms
    # a grouped GEMM's operand is quantized expert by expert (TE's split_quantize), except by
    # delayed scaling's and NVFP4's fused multi-tensor kernels; NVFP4's takes its amax kernel
    # first (its per-tensor scale), two kernels per grouped operand
    ep8 = Layout.build(16, 64, ep=8)
    local = QWEN.num_experts // 8
    moe = {p: layer_launches(QWEN, ep8, p, "moe")
           for p in ("bf16", "mxfp8", "fp8-tensorwise", "fp8-delayed", "nvfp4")}
    assert moe["mxfp8"].post - moe["bf16"].post == 2 * local          # fc1, fc2 inputs
    assert moe["fp8-tensorwise"].post - moe["bf16"].post == 3 * 2 * local
    assert moe["fp8-delayed"].post - moe["bf16"].post == 2
    assert moe["nvfp4"].post - moe["bf16"].post == 2 * 2
    # so a current-scaling layer at EP 8 launches far more than at EP 16 (8 local experts)
    ep16 = layer_launches(QWEN, Layout.build(16, 64, ep=16), "fp8-tensorwise", "moe")
    assert moe["fp8-tensorwise"].post - ep16.post == (2 + 3 * 2) * (local - local // 2)


def test_an_moe_layer_padded_to_capacity_has_no_sync_and_graphs_capture_all_of_it():
    t = 1000e-6
    pad = {"moe_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    dropless = _layer(QWEN, 1000.0, ep=8)
    padded = _layer(QWEN, 1000.0, training=pad, ep=8)
    n = layer_launches(QWEN, Layout.build(16, 64, ep=8), "bf16", "moe")
    # one stretch the host launches without waiting: no restart gap after a sync
    assert padded.fwd_s + padded.exposed_fwd_s == pytest.approx((n.pre + n.post) * t)
    assert dropless.fwd_s - padded.fwd_s == pytest.approx(SYNC_GAP_LAUNCHES * t)
    # CUDA graphs capture the padded layer whole (Megatron's `moe` graph scope)
    device = _layer(QWEN, 0.0, training=pad, ep=8)
    graphed = _layer(QWEN, 1000.0, training=pad, ep=8, cuda_graphs=True)
    assert graphed.fwd_s == device.fwd_s and graphed.bwd_s == device.bwd_s
    # a capacity factor without padding keeps dynamic shapes: the sync stays
    capped = _layer(QWEN, 1000.0, training={"moe_capacity_factor": 1.0}, ep=8)
    assert capped.fwd_s == pytest.approx(dropless.fwd_s)


def test_the_launch_time_is_the_host_cpus():
    assert host_kind(load_cluster("gb200-nvl72", 8)) == "grace"
    assert {host_kind(load_cluster(c, 8)) for c in ("h100", "b200", "a100-80g")} == {"x86"}
    cal = default_calibration()
    assert cal.launch_s("x86") > 0 and cal.launch_s("grace") > 0
    # the fitted times stay within physical bounds (NVIDIA's Nsight guide: ≈ 20 µs per
    # PyTorch kernel round trip on a V100-era host, 4–6 µs of it the CUDA launch)
    assert all(2.0 <= us <= 40.0 for us in cal.launch_us.values())


def _kernel_by_kernel(blocks, t):
    """The flow shop kernel by kernel: the host launches one kernel every t after the restart
    gap; the device starts each when it is launched and the one before it has finished."""
    host, end = (SYNC_GAP_LAUNCHES - 1) * t, 0.0
    for n, d in blocks:
        if n == 0:
            end += d
        for _ in range(int(n)):
            host += t
            end = max(end, host) + d / n
    return end


def test_after_the_routing_sync_a_run_of_short_kernels_starves_the_device():
    """The sync empties the queue, so the host has no lead: the time after it is a flow shop
    (host.after_sync_s), matching a kernel-by-kernel simulation, and a run of quantize kernels
    per expert after a short dispatch costs its launches even though the host's total is below
    the device's: max(host, device) over the stretch would not see it."""
    import random

    t = 40e-6
    rng = random.Random(1)
    for _ in range(200):
        blocks = tuple((rng.choice([0, 1, 2, 4, 8, 32]), rng.uniform(0, 2e-3)) for _ in range(7))
        assert after_sync_s(blocks, t) == pytest.approx(_kernel_by_kernel(blocks, t), rel=1e-12,
                                                        abs=1e-15)
    starved = ((1, 10e-6), (8, 8e-6), (8, 2.4e-3))       # dispatch, 8 quantizes, 8 GEMMs
    launches = sum(n for n, _ in starved)
    device = sum(d for _, d in starved)
    assert launches * t < device                          # the host is faster in total
    assert after_sync_s(starved, t) > device + SYNC_GAP_LAUNCHES * t + 8 * t - 8 * 1e-6
    # a long dispatch first gives the host its lead back: device time plus the restart gap
    led = ((1, 1e-3), (8, 8e-6), (8, 2.4e-3))
    assert after_sync_s(led, t) == pytest.approx(sum(d for _, d in led) + SYNC_GAP_LAUNCHES * t)


def test_an_moe_layer_prices_its_after_sync_blocks_as_a_flow_shop():
    """Qwen3-30B-A3B at EP 8 inside one H100 node, micro-batch 1: the NVLink dispatch is too
    short to give the host its lead back, so the fc1 and fc2 GEMMs, one per local expert, wait
    on their launches. The forward pays more than max(host, device) over the stretch after
    the sync plus the restart gap."""
    t = 40e-6
    eager, device = _layer(QWEN, 40.0, ep=8), _layer(QWEN, 0.0, ep=8)
    n = layer_launches(QWEN, Layout.build(16, 64, ep=8), "bf16", "moe")
    assert len(n.after_sync) == len(AFTER_SYNC) and sum(n.after_sync) == n.post
    whole = device.fwd_s + device.exposed_fwd_s
    assert (n.pre + n.post) * t < whole                  # the host is faster over the forward
    extra = eager.fwd_s - device.fwd_s
    assert extra > SYNC_GAP_LAUNCHES * t + 0.1 * whole
