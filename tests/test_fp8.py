"""FP8/FP4 precision recipes: quantisers on hand-derived cases, every backend against the fp32
reference within its recipe's tolerance, backend selection, and FP8 training that follows fp32."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from moeplan.errors import NotYetAvailable
from moeplan.kernels import (
    FP8_RECIPES,
    EmulatedBackend,
    TorchBackend,
    TorchFp8Backend,
    choose_backend,
    get_backend,
    scaled_mm_available,
    te_importable,
)
from moeplan.kernels.quant import (
    E2M1_GRID,
    DelayedScalingState,
    cast_fp8,
    e8m0_is_power_of_two,
    mx_scale,
    quantise_blockwise,
    quantise_mxfp8,
    quantise_nvfp4,
    quantise_tensorwise,
    round_e2m1,
)

from .conftest import DATA

# relative Frobenius error of output and both gradients against fp32, per recipe: E4M3 keeps 3
# mantissa bits (≈2^-4 relative rounding), E5M2 gradients 2 bits, E2M1 1 bit
TOLERANCE = {"fp8-tensorwise": 0.08, "fp8-delayed": 0.08, "fp8-blockwise": 0.05, "mxfp8": 0.05,
             "nvfp4": 0.2}


# --- quantisers ---------------------------------------------------------------------------------

def test_fp8_formats_saturate_at_their_largest_finite_value():
    big = torch.tensor([1e6, -1e6, 448.0, 500.0])
    assert cast_fp8(big, "e4m3").tolist() == [448.0, -448.0, 448.0, 448.0]
    assert cast_fp8(big, "e5m2").tolist() == [57344.0, -57344.0, 448.0, 512.0]


def test_tensorwise_maps_amax_to_448_and_rounds_the_rest_in_e4m3():
    # scale = 448/3: 3 → 448 exactly; 1 → 149.33, between E4M3 neighbours 144 and 160 → 144
    q = quantise_tensorwise(torch.tensor([1.0, -3.0]), "e4m3")
    assert q.tolist() == pytest.approx([144 * 3 / 448, -3.0], rel=1e-6)


def test_delayed_scaling_uses_the_history_amax_not_the_current_one():
    st = DelayedScalingState("e4m3", history_len=1024, algo="max")
    # first call: scale 1 (TE's initial value); 0.3 = 0.25·1.2 → mantissa 1.6/8 → 0.3125
    assert st.quantise(torch.tensor([0.3])).item() == 0.3125
    # second call: scale 448/0.3 from the history, not 448/0.1 (which would give 0.1 exactly):
    # 0.1·448/0.3 = 149.33 → 144 → 144·0.3/448
    assert st.quantise(torch.tensor([0.1])).item() == pytest.approx(144 * 0.3 / 448, rel=1e-6)
    assert st.quantise(torch.tensor([0.1])).item() == pytest.approx(144 * 0.3 / 448, rel=1e-6)


def test_delayed_scaling_window_and_most_recent_algorithm():
    st = DelayedScalingState("e4m3", history_len=2, algo="max")
    for v in (4.0, 1.0, 1.0):  # 4 leaves the window of 2 after the third call
        st.quantise(torch.tensor([v]))
    assert st.scale.item() == pytest.approx(448.0)
    recent = DelayedScalingState("e4m3", history_len=1024, algo="most_recent")
    for v in (4.0, 2.0):
        recent.quantise(torch.tensor([v]))
    assert recent.scale.item() == pytest.approx(224.0)


def test_blockwise_tiles_isolate_an_outlier_that_per_tensor_scaling_flushes():
    torch.manual_seed(0)
    x = torch.randn(1, 256) * 1e-3
    x[0, 0] = 1e4  # tile 0 only
    tail = slice(128, 256)
    per_tensor = quantise_tensorwise(x, "e4m3")
    assert per_tensor[0, tail].abs().max() == 0  # 1e-3·448/1e4 is below E4M3's smallest value
    tiled = quantise_blockwise(x, "e4m3", (1, 128))
    torch.testing.assert_close(tiled[0, tail], x[0, tail], rtol=0.07, atol=0)


def test_blockwise_weight_blocks_are_128x128_with_power_of_two_scales():
    w = torch.ones(256, 256)
    w[:128, :128] *= 3.0  # one block; 3 → scale 2^floor(log2(448/3)) = 128 → 384, exact
    q = quantise_blockwise(w, "e4m3", (128, 128))
    torch.testing.assert_close(q, w)
    x = torch.full((1, 128), 0.7)  # scale 2^floor(log2(640)) = 512: 358.4 → E4M3 352 → 0.6875
    assert quantise_blockwise(x, "e4m3", (1, 128)).unique().item() == 352 / 512


def test_mxfp8_scales_are_powers_of_two_that_never_saturate():
    assert mx_scale(torch.tensor([1000.0, 448.0, 449.0, 1.0, 0.0]), "e4m3").tolist() == \
        [4.0, 1.0, 2.0, 2.0 ** -8, 1.0]
    torch.manual_seed(0)
    x = torch.randn(8, 96) * torch.logspace(-3, 3, 96)
    blocks = x.view(8, 3, 32).abs().amax(-1)
    scales = mx_scale(blocks, "e4m3")
    assert e8m0_is_power_of_two(scales) and (blocks / scales <= 448).all()
    q = quantise_mxfp8(x, "e4m3")
    # no saturation: within half an E4M3 step (2^-4 relative; 2^-10·scale among subnormals)
    half_step = torch.maximum(x.abs() / 16, scales.repeat_interleave(32, 1) * 2.0 ** -10)
    assert ((q - x).abs() <= half_step * (1 + 1e-6)).all()
    # each element is an E4M3 value times its block's scale
    on_grid = q.view(8, 3, 32) / scales.unsqueeze(-1)
    assert torch.equal(cast_fp8(on_grid, "e4m3"), on_grid)


def test_e2m1_rounds_to_nearest_with_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -2.6, 0.0])
    assert round_e2m1(x).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -3.0, 0.0]


def test_nvfp4_values_lie_on_the_e2m1_grid_times_an_e4m3_block_scale():
    one_block = torch.tensor([[6.0, 3.0, 1.0, 0.25, 5.0, 2.5] + [0.0] * 10])
    # amax 6: global scale 448·6/6, block scale E4M3(1·448) = 448 → elements round as E2M1
    assert quantise_nvfp4(one_block).tolist()[0][:6] == [6.0, 3.0, 1.0, 0.0, 4.0, 2.0]
    torch.manual_seed(0)
    x = torch.randn(4, 64) * torch.logspace(-2, 1, 64)
    q = quantise_nvfp4(x)
    s_enc = 448 * 6 / x.abs().max()
    scale_b = cast_fp8(x.view(4, 4, 16).abs().amax(-1, keepdim=True) / 6 * s_enc, "e4m3")
    elems = q.view(4, 4, 16) * s_enc / scale_b
    grid = torch.tensor(E2M1_GRID)
    assert torch.isclose(elems.abs().unsqueeze(-1), grid, rtol=1e-5, atol=1e-6).any(-1).all()


# --- backends against the fp32 reference --------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _errors(fn, ref, x0, w0, g0) -> list[float]:
    """Relative errors of output, dx, dw of `fn` against `ref` on the same inputs."""
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = fn(x, w)
    y.backward(g0)
    x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y2 = ref(x2, w2)
    y2.backward(g0)
    return [_rel(y, y2), _rel(x.grad, x2.grad), _rel(w.grad, w2.grad)]


def _linear_case(backend):
    torch.manual_seed(0)
    x, w, g = torch.randn(2, 32, 256), torch.randn(192, 256) * 0.02, torch.randn(2, 32, 192)
    return _errors(lambda a, b: backend.linear(a, b), lambda a, b: a @ b.t(), x, w, g)


def _grouped_case(backend):
    torch.manual_seed(1)
    counts = torch.tensor([20, 0, 30, 14])
    x, w, g = torch.randn(64, 96), torch.randn(4, 96, 48) * 0.05, torch.randn(64, 48)
    ref = TorchBackend(use_grouped_mm=False)
    return _errors(lambda a, b: backend.grouped_mm(a, b, counts),
                   lambda a, b: ref.grouped_mm(a, b, counts), x, w, g)


@pytest.mark.parametrize("case", [_linear_case, _grouped_case], ids=["linear", "grouped_mm"])
@pytest.mark.parametrize("precision", FP8_RECIPES)
def test_emulated_recipe_matches_fp32_within_its_tolerance(precision, case):
    backend = EmulatedBackend(precision)
    errors = case(backend)
    assert max(errors) < TOLERANCE[precision], errors
    assert min(errors) > 1e-3, errors  # really quantised, not the fp32 path
    assert backend.recipe.calls > 0


def test_emulated_keeps_delayed_scaling_state_per_weight_across_calls():
    b = EmulatedBackend("fp8-delayed")
    w1, w2 = torch.randn(16, 32), torch.randn(16, 32)
    for _ in range(3):
        b.linear(torch.randn(4, 32), w1)
    b.linear(torch.randn(4, 32), w2)
    assert b.site_state(w1)["input"].calls == 3 and b.site_state(w1)["weight"].calls == 3
    assert b.site_state(w2)["input"].calls == 1
    experts = torch.randn(2, 32, 16, requires_grad=True)
    b.grouped_mm(torch.randn(5, 32), experts, torch.tensor([2, 3])).sum().backward()
    assert b.site_state(experts, 1)["grad"].calls == 1  # one history per expert GEMM


def _graph_nodes(t: torch.Tensor) -> int:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        todo.extend(f for f, _ in fn.next_functions)
    return len(seen)


def test_an_expert_without_tokens_keeps_its_gemm_in_the_autograd_graph():
    """Ranks whose experts get different token counts must build graphs of one shape, or
    backward reorders their TP and EP collectives and the ranks deadlock."""
    b = EmulatedBackend("fp8-tensorwise")
    experts = torch.randn(3, 32, 16, requires_grad=True)
    shapes = []
    for counts in ([2, 1, 2], [3, 0, 2]):
        x = torch.randn(5, 32, requires_grad=True)
        y = b.grouped_mm(x, experts, torch.tensor(counts))
        shapes.append(_graph_nodes(y))
        y.sum().backward()
    assert shapes[0] == shapes[1]
    assert experts.grad is not None


def test_a_rank_without_tokens_builds_the_grouped_gemms_graph_shape_in_the_torch_backend():
    from moeplan.kernels import get_backend

    b = get_backend("torch")
    experts = torch.randn(2, 32, 16, requires_grad=True)
    shapes = []
    for counts in ([3, 2], [0, 0]):
        x = torch.randn(sum(counts), 32, requires_grad=True)
        y = b.grouped_mm(x, experts, torch.tensor(counts))
        shapes.append(_graph_nodes(y))
        (y.sum() + 0 * experts.sum()).backward()
    assert shapes[0] == shapes[1]


def test_delayed_scaling_histories_round_trip_through_extra_state():
    """What a checkpoint saves restores the same quantisation on the next call."""
    w = torch.randn(16, 32)
    a, b = EmulatedBackend("fp8-delayed"), EmulatedBackend("fp8-delayed")
    for _ in range(3):
        a.linear(torch.randn(4, 32) * 5, w)
    state = a.extra_state({"w": w})
    assert {"w/0/input/history", "w/0/weight/calls"} <= state.keys()
    assert b.load_extra_state({"w": w}, state) == 2
    x = torch.randn(4, 32)
    assert torch.equal(a.linear(x, w), b.linear(x, w))
    assert not torch.equal(EmulatedBackend("fp8-delayed").linear(x, w), a.linear(x, w))


def test_bias_is_added_in_high_precision():
    torch.manual_seed(0)
    x, w, bias = torch.randn(4, 32), torch.randn(8, 32), torch.randn(8) * 100
    b = EmulatedBackend("fp8-tensorwise")
    torch.testing.assert_close(b.linear(x, w, bias) - b.linear(x, w), bias.expand(4, 8))


@pytest.mark.skipif(not scaled_mm_available(), reason="torch._scaled_mm needs a CUDA GPU of "
                    "compute capability 8.9+ (Ada/Hopper or newer); none here")
@pytest.mark.parametrize("case", [_linear_case, _grouped_case], ids=["linear", "grouped_mm"])
def test_torch_fp8_matches_fp32_and_the_emulated_recipe(case):
    cuda = get_backend("torch-fp8")
    with torch.device("cuda"):
        errors = case(cuda)
        emulated = case(EmulatedBackend("fp8-tensorwise"))
    assert max(errors) < TOLERANCE["fp8-tensorwise"], errors
    assert all(abs(a - b) < 0.01 for a, b in zip(errors, emulated, strict=True))


def _cpu_scaled_mm() -> bool:
    try:  # some torch builds have FP8 `_scaled_mm` kernels on the CPU too
        a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0),
                         out_dtype=torch.float32)
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch build has no CPU _scaled_mm")
@pytest.mark.parametrize("case", [_linear_case, _grouped_case], ids=["linear", "grouped_mm"])
def test_torch_fp8_gemms_match_the_emulated_recipe_through_cpu_scaled_mm(case, monkeypatch):
    """The three _scaled_mm GEMMs (operand layouts, scales, row padding) checked on a CPU:
    the same recipe as the emulated backend, so equal up to fp32 accumulation order."""
    monkeypatch.setattr(TorchFp8Backend, "check_device", lambda self, x: None)
    fp8 = TorchFp8Backend()
    errors, emulated = case(fp8), case(EmulatedBackend("fp8-tensorwise"))
    assert fp8.recipe.calls > 0
    assert errors == pytest.approx(emulated, rel=1e-3), (errors, emulated)


def test_torch_fp8_refuses_to_run_without_a_capable_gpu():
    if scaled_mm_available():
        pytest.skip("a capable GPU is present")
    with pytest.raises(NotYetAvailable, match="8.9"):
        get_backend("torch-fp8").linear(torch.randn(16, 16), torch.randn(16, 16))


@pytest.mark.skipif(not te_importable(), reason="Transformer Engine does not import here "
                    "(needs TE and a CUDA GPU)")
@pytest.mark.parametrize("precision", ["fp8-delayed", "fp8-tensorwise"])
def test_te_matches_fp32_within_tolerance(precision):
    te = get_backend("te", precision=precision)
    with torch.device("cuda"):
        errors = _linear_case(te) + _grouped_case(te)
    assert max(errors) < TOLERANCE[precision], errors


def test_selection_bf16_is_torch_and_fp8_on_cpu_is_emulated_with_a_reason():
    assert choose_backend("bf16", "cpu").backend.name == "torch"
    for p in FP8_RECIPES:
        choice = choose_backend(p, "cpu")
        assert choice.backend.name == "emulated" and choice.backend.recipe.precision == p
        assert choice.reason == f"{p}: emulated backend (no GPU)"


def test_recipe_formats_follow_megatrons_pairing():
    fmt = {p: EmulatedBackend(p).recipe.fp8_format for p in FP8_RECIPES}
    assert fmt["fp8-delayed"] == fmt["fp8-tensorwise"] == "hybrid"
    assert fmt["fp8-blockwise"] == fmt["mxfp8"] == "e4m3"
    assert EmulatedBackend("fp8-delayed").recipe.fmt("grad") == "e5m2"


# --- training -----------------------------------------------------------------------------------

def _plan(precision: str, world: int = 1, gbs: int = 8, lr: float = 3e-3, **axes):
    from moeplan.specs import Layout, Plan, TrainingSpec, load_cluster, load_model

    training = TrainingSpec(seq_len=32, global_batch_size=gbs, lr=lr, warmup_steps=1,
                            precision=precision)
    return Plan(model=load_model(DATA / "tiny_qwen3_moe.yaml"),
                cluster=load_cluster("h100", gpus=world), training=training,
                layout=Layout.build(world, gbs, **axes))


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    """A one-process gloo group for in-process Trainers (one thread: tiny GEMMs)."""
    store = tmp_path_factory.mktemp("pg") / "store"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


def _train(plan, steps: int, seed: int = 1234):
    from moeplan.runtime.groups import build_groups
    from moeplan.runtime.train import Trainer
    from moeplan.specs.grid import RankGrid

    trainer = Trainer(plan, build_groups(RankGrid.from_layout(plan.layout)), seed=seed)
    return trainer, [trainer.step(s)[0].loss for s in range(steps)]


@pytest.mark.parametrize("precision", ["fp8-delayed", "mxfp8"])
def test_fp8_training_follows_the_fp32_loss_and_is_not_the_fp32_path(world1, precision):
    steps = 20
    _, ref = _train(_plan("bf16", mbs=8), steps)  # --dtype fp32 on CPU: the fp32 reference
    trainer, losses = _train(_plan(precision, mbs=8), steps)
    assert trainer.kernels.backend.name == "emulated"
    assert trainer.kernels.backend.recipe.calls > 0
    gaps = [abs(a - b) / b for a, b in zip(losses, ref, strict=True)]
    assert max(gaps) < 0.03, gaps  # follows fp32 within a few percent ...
    assert sum(gaps) / steps > 1e-5, gaps  # ... without being the fp32 path
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.slow
def test_moeplan_run_trains_fp8_on_two_ranks_and_records_the_backend(cli, world1, tmp_path):
    """tp2·ep2 under fp8-delayed through `moeplan run`: the emulated backend is logged and
    recorded, and the losses follow the single-process fp32 run of the same seed."""
    plan = _plan("fp8-delayed", world=2, gbs=4, tp=2, ep=2)
    path = tmp_path / "fp8.json"
    path.write_text(plan.model_dump_json())
    out = tmp_path / "run"
    r = cli("run", str(path), "--steps", "6", "--out", str(out), "--seed", "7", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fp8-delayed: emulated backend (no GPU)" in r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kernel_backend"] == "emulated" and summary["precision"] == "fp8-delayed"
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    _, ref = _train(_plan("bf16", gbs=4), 6, seed=7)
    assert losses != pytest.approx(ref, rel=1e-6)
    assert all(math.isclose(a, b, rel_tol=0.08) for a, b in zip(losses, ref, strict=True))
