"""The host floor (cost_models.host): a layer takes max(host, device), never their sum; CUDA
graphs launch their captured part as one graph; an MoE layer pays its routing sync and launches
a GEMM per local expert; quantizing recipes launch a kernel per operand."""

import pytest

from moeplan import Layout, TrainingSpec, load_cluster, load_model
from moeplan.cost_models.calibration import default_calibration
from moeplan.cost_models.host import (
    SYNC_GAP_LAUNCHES,
    host_kind,
    layer_launches,
)
from moeplan.cost_models.layers import dense_layer, make_context, moe_layer

LLAMA = load_model("llama3-8b")
QWEN = load_model("qwen3-30b-a3b")
H100 = load_cluster("h100", gpus=16)


def _layer(model, launch_us, precision="bf16", **axes):
    """A layer's cost with the host time per launch set to `launch_us` on every host."""
    cal = default_calibration().with_overrides({"launch_us": {"x86": launch_us,
                                                              "grace": launch_us}})
    tr = TrainingSpec(seq_len=4096, global_batch_size=64, precision=precision)
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


def test_quantizing_recipes_launch_a_kernel_per_operand():
    lay = Layout.build(16, 64, tp=8)
    bf16, fp8 = (layer_launches(LLAMA, lay, p, "dense") for p in ("bf16", "mxfp8"))
    gemms = 2 + 2  # QKV, proj; fc1, fc2
    assert fp8.pre - bf16.pre == gemms and fp8.bwd - bf16.bwd == gemms
    moe16, moe8 = (layer_launches(QWEN, Layout.build(16, 64, ep=8), p, "moe")
                   for p in ("bf16", "mxfp8"))
    assert moe8.post - moe16.post == 2  # fc1 and fc2 quantize their inputs, one kernel each


def test_the_launch_time_is_the_host_cpus():
    assert host_kind(load_cluster("gb200-nvl72", 8)) == "grace"
    assert {host_kind(load_cluster(c, 8)) for c in ("h100", "b200", "a100-80g")} == {"x86"}
    cal = default_calibration()
    assert cal.launch_s("x86") > 0 and cal.launch_s("grace") > 0
    # the fitted times stay within physical bounds (NVIDIA's Nsight guide: ≈ 20 µs per
    # PyTorch kernel round trip on a V100-era host, 4–6 µs of it the CUDA launch)
    assert all(2.0 <= us <= 40.0 for us in cal.launch_us.values())
