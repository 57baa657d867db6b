"""Activation recompute, activation offload and optimizer offload change memory, never the numbers.

Each claim in fp32 on the CPU, same seed: every recompute module, `full`, every offload module
and optimizer offload 0.5 / 1.0 train like the run without them (world 1 in process; tp2·ep2,
cp2·ep2 and pp2 with per-stage sets in one spawned gloo world of 4), and each choice lowers
the activation bytes a saved-tensor meter counts as kept on the device. The meter is also put
next to the cost model's per-layer activation prediction.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from moeplan.cost_models import calibration_for, dense_layer, make_context, moe_layer
from moeplan.runtime.comm import Axis
from moeplan.runtime.groups import ParallelGroups, local_groups
from moeplan.runtime.memory import apply_memory, measure_activations
from moeplan.runtime.model import Transformer
from moeplan.runtime.parallelize import parallelize
from moeplan.runtime.train import Trainer
from moeplan.specs import (
    OFFLOAD_MODULES,
    RECOMPUTE_MODULES,
    Choices,
    Layout,
    Plan,
    TrainingSpec,
    load_cluster,
    load_model,
)

from .conftest import DATA, run_world
from .equivalence_worker import make_plan
from .test_run_cli import ESTIMATE

MODELS = ["tiny_qwen3_moe", "tiny_deepseek_v3"]
STEPS = 2  # the second step's loss also checks the update the first one made


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Dozens of tiny runs: one intra-op thread is faster, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def present(model: str, module: str) -> bool:
    """Whether the model has the module at all (MLA up-projections, shared experts)."""
    spec = load_model(DATA / f"{model}.yaml")
    if module == "mla_up_proj":
        return spec.attention == "mla"
    if module == "shared_experts":
        return bool(spec.num_shared_experts)
    return True


def train(model: str, **choices) -> dict:
    """STEPS steps at world 1: losses, the first step's gradients, the final weights."""
    plan = make_plan(model, 1, {}).model_copy(update={"choices": Choices(**choices)})
    trainer = Trainer(plan, local_groups(), seed=1234)
    losses, grads = [], None
    for step in range(STEPS):
        metrics, g = trainer.step(step, capture_grads=step == 0)
        losses.append(metrics.loss)
        grads = grads if g is None else g
    return {"losses": losses, "grads": grads, "weights": trainer.full_state()}


@functools.cache
def reference(model: str) -> dict:
    return train(model)


def assert_same_training(got: dict, ref: dict, weights: bool = False) -> None:
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step + 1}: loss {a} vs {b}"
    for name, g in got["grads"].items():
        torch.testing.assert_close(g, ref["grads"][name], rtol=1e-6, atol=1e-9,
                                   msg=lambda m, n=name: f"{n}: {m}")
    for name, w in got["weights"].items() if weights else ():
        torch.testing.assert_close(w, ref["weights"][name], rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------- same numbers
@pytest.mark.parametrize("module", RECOMPUTE_MODULES)
@pytest.mark.parametrize("model", MODELS)
def test_recomputing_each_module_trains_like_the_run_without(model, module):
    if not present(model, module):
        pytest.skip(f"{model} has no {module}")
    assert_same_training(train(model, recompute=[module]), reference(model))


@pytest.mark.parametrize("module", OFFLOAD_MODULES)
@pytest.mark.parametrize("model", MODELS)
def test_offloading_each_module_trains_like_the_run_without(model, module):
    assert_same_training(train(model, offload=[module]), reference(model))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("model", MODELS)
def test_optimizer_offload_steps_the_same_weights(model, fraction):
    assert_same_training(train(model, optimizer_offload_fraction=fraction), reference(model),
                         weights=True)


def test_stage_sets_are_chosen_by_pipeline_rank():
    """stage_recompute[r] applies on pp rank r (the cost model's indexing, shared by vpp)."""
    choices = Choices(stage_recompute=[["full"], []])
    kept = []
    for rank in (0, 1):
        groups = ParallelGroups(pp=Axis(None, 2, rank, (0, 1)))
        model = parallelize(Transformer(load_model(DATA / "tiny_qwen3_moe.yaml")), groups,
                            Layout(), choices)
        kept.append(activation_meter(model).by_layer)
    assert len(kept[0]) == 3 and kept[1] == []  # rank 1: nothing wrapped, nothing metered


# ---------------------------------------------------------------------------- memory
def activation_meter(model: torch.nn.Module, seq: int = 64):
    """Forward of 2 sequences under the meter (then backward, so the graph is used)."""
    tokens = torch.randint(0, model.spec.vocab_size, (2, seq),
                           generator=torch.Generator().manual_seed(0))
    with measure_activations() as meter:
        terms = model(tokens, tokens)
    terms.ce_sum.backward()
    return meter


def kept(model: str, recompute=(), offload=()):
    spec = load_model(DATA / f"{model}.yaml")
    return activation_meter(apply_memory(Transformer(spec), recompute, offload, measure=True))


@pytest.mark.parametrize("module", RECOMPUTE_MODULES)
@pytest.mark.parametrize("model", MODELS)
def test_each_recompute_choice_keeps_fewer_activation_bytes(model, module):
    if not present(model, module):
        pytest.skip(f"{model} has no {module}")
    base, got = kept(model), kept(model, recompute=[module])
    print(f"{model} recompute {module}: {got.kept_bytes} of {base.kept_bytes} bytes kept "
          f"({1 - got.kept_bytes / base.kept_bytes:.1%} less)")
    assert got.kept_bytes < base.kept_bytes


@pytest.mark.parametrize("module", OFFLOAD_MODULES)
@pytest.mark.parametrize("model", MODELS)
def test_each_offload_choice_moves_activation_bytes_off_the_device(model, module):
    # the attention output is also saved by the core attention itself: moving the output
    # projection's copy frees it only when core attention keeps none (recomputed)
    other = ["core_attn"] if module == "attn_proj" else []
    base, got = kept(model, other), kept(model, other, [module])
    print(f"{model} offload {module}: {got.kept_bytes} of {base.kept_bytes} bytes kept, "
          f"{got.offloaded_bytes} moved")
    assert got.kept_bytes < base.kept_bytes and got.offloaded_bytes > 0


def test_offload_brings_back_the_layer_before_while_a_layer_runs_backward(monkeypatch):
    """The first copy a layer's backward needs also starts the copies of the layer that ran
    before it: every layer but the last one run is back before its backward asks."""
    from moeplan.runtime import memory

    spec = load_model(DATA / "tiny_qwen3_moe.yaml")  # 3 decoder layers
    model = apply_memory(Transformer(spec, seed=1), [], ["attn_proj", "moe_act"])
    ready_when_asked = []
    fetch = memory._OffloadGroup.fetch

    def watched(self, item):
        if self.items:  # this layer's first fetch
            ready_when_asked.append(all(it.on_device is not None for it in self.items))
        return fetch(self, item)

    monkeypatch.setattr(memory._OffloadGroup, "fetch", watched)
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).ce_sum.backward()
    assert ready_when_asked == [False, True, True]


def test_full_recompute_keeps_only_each_layer_input():
    spec = load_model(DATA / "tiny_qwen3_moe.yaml")
    layer_input = 64 * 2 * spec.hidden_size * 4  # (s, b, h) fp32
    assert kept("tiny_qwen3_moe", ["full"]).by_layer == [layer_input] * spec.num_layers


@pytest.mark.parametrize("model", MODELS)
def test_measured_activation_bytes_next_to_the_cost_model(model):
    """The eager runtime keeps 1.5–1.8× the cost model's per-layer bytes (scaled bf16 → fp32):
    it saves what fused kernels do not (SiLU's input and output besides the product, the
    pre-RoPE q/k and RoPE products, qk-norm inputs, the router's fp32 logits)."""
    spec = load_model(DATA / f"{model}.yaml")
    cluster = load_cluster("h100", 1)
    ctx = make_context(spec, cluster, TrainingSpec(seq_len=64, global_batch_size=2), Layout(mbs=2),
                       calibration_for(cluster.calibration))
    measured = kept(model).by_layer
    for i, is_moe in enumerate(spec.moe_layers()):
        predicted = 2 * (moe_layer(ctx) if is_moe else dense_layer(ctx)).activation_bytes()
        ratio = measured[i] / predicted
        print(f"{model} layer {i} ({'moe' if is_moe else 'dense'}): measured {measured[i]} B, "
              f"predicted {predicted:.0f} B (fp32), ratio {ratio:.2f}")
        assert 1.0 <= ratio <= 2.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_recompute_and_offload_lower_max_memory_allocated():
    spec = load_model(DATA / "tiny_qwen3_moe.yaml")
    dev = torch.device("cuda")

    def peak(recompute=(), offload=()) -> int:
        model = apply_memory(Transformer(spec), recompute, offload).to(dev)
        tokens = torch.randint(0, spec.vocab_size, (8, 1024), device=dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        terms = model(tokens, tokens)
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - start
        terms.ce_sum.backward()
        return used

    base = peak()
    assert peak(["full"]) < base
    assert peak(offload=["core_attn", "expert_fc1", "moe_act", "attn_norm"]) < base


# ----------------------------------------------------------------------- multi-rank
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("recompute_offload") / "results.pt"
    run_world("recompute_offload_worker.py", out)
    return torch.load(out)


@pytest.mark.parametrize("with_choices,without", [
    ("tp2_ep2_memory", "tp2_ep2"),
    ("cp2_dp2_ep2_recompute_moe", "cp2_dp2_ep2"),
    ("pp2_dp2_stages", "pp2_dp2"),
])
@pytest.mark.parametrize("model", MODELS)
def test_multi_rank_layouts_with_memory_choices_train_like_without(ranks, model, with_choices,
                                                                   without):
    """Recompute re-runs TP/EP/CP collectives in backward at the same point on every peer."""
    got, ref = ranks[(with_choices, model)], ranks[(without, model)]
    assert_same_training(got, ref)


@pytest.mark.parametrize("model", MODELS)
def test_bf16_gradient_reduction_trains_within_bf16_rounding_of_fp32(ranks, model):
    """`grad_reduce_dtype: bf16` accumulates and reduces gradients in bf16 (Megatron's
    --grad-reduce-in-bf16): the step's gradients agree with the fp32 run to bf16 precision, and
    they are really rounded (not silently reduced in fp32)."""
    got, ref = ranks[("cp2_dp2_ep2_bf16_grads", model)], ranks[("cp2_dp2_ep2", model)]
    rounded = 0
    for name, g in got["grads"].items():
        r = ref["grads"][name]
        assert g.dtype == torch.bfloat16, name
        torch.testing.assert_close(g.float(), r, rtol=2e-2, atol=1e-2 * r.abs().max().item(),
                                   msg=lambda m, n=name: f"{n}: {m}")
        rounded += int(not torch.equal(g.float(), r))
    assert rounded > 0
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-2 * abs(b)


# ------------------------------------------------------------------------------ CLI
@pytest.mark.slow
def test_run_executes_a_plan_with_recompute_offload_and_optimizer_offload(cli, tmp_path):
    plan = Plan(model=load_model(DATA / "tiny_deepseek_v3.yaml"),
                cluster=load_cluster("h100", gpus=2),
                training=TrainingSpec(seq_len=32, global_batch_size=4, lr=1e-2, warmup_steps=1),
                layout=Layout.build(2, 4, tp=2),
                choices=Choices(recompute=["core_attn", "moe_act", "mla_up_proj"],
                                offload=["attn_norm", "expert_fc1"],
                                optimizer_offload_fraction=0.5),
                estimate=ESTIMATE)
    path, out = tmp_path / "memory.json", tmp_path / "run"
    path.write_text(plan.model_dump_json())
    r = cli("run", str(path), "--steps", "3", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    measured = summary["measured"]
    assert len(measured["peak_mem_gb_per_rank"]) == 2
    assert measured["peak_mem_gb"] == max(measured["peak_mem_gb_per_rank"])
    assert summary["ratio"]["step_time_s"] == pytest.approx(measured["step_time_s"] / 0.5)
    assert summary["ratio"]["peak_mem_gb"] == pytest.approx(measured["peak_mem_gb"] / 1.0)
