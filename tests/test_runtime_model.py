"""Single-process claims about the reference model, router, data and schedule (no processes)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from moeplan.runtime.data import MarkovData
from moeplan.runtime.layers import MLP
from moeplan.runtime.model import Transformer
from moeplan.runtime.moe import MoE
from moeplan.runtime.optimizer import lr_at
from moeplan.runtime.scale import scale_down_model, scale_down_training
from moeplan.runtime.support import features_not_executed
from moeplan.specs import (
    Choices,
    Layout,
    ModelSpec,
    Plan,
    TrainingSpec,
    check_layout,
    load_cluster,
    load_model,
)

from .conftest import DATA

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
            vocab_size=64)


def test_moe_with_one_expert_matches_dense_ffn():
    spec = ModelSpec(**BASE, num_experts=1, moe_top_k=1, moe_ffn_hidden_size=48)
    gen = torch.Generator().manual_seed(0)
    moe = MoE(spec, 0.02, 0.02, gen, Transformer(spec).backend, aux_coeff=0.0,
              capacity_factor=None)
    dense = MLP(spec, 48, 0.02, 0.02, torch.Generator().manual_seed(1), moe.experts.backend)
    with torch.no_grad():  # the expert's (in, out) weights are the dense (out, in) transposed
        dense.gate_proj.weight.copy_(moe.experts.w_gate[0].t())
        dense.up_proj.weight.copy_(moe.experts.w_up[0].t())
        dense.down_proj.weight.copy_(moe.experts.w_down[0].t())
    x = torch.randn(5, 2, 32)  # (s, b, h)
    torch.testing.assert_close(moe(x), dense(x))  # softmax over one expert: probability 1


def test_group_limited_routing_picks_only_allowed_groups():
    spec = load_model(DATA / "tiny_deepseek_v3.yaml")
    router = MoE(spec, 0.02, 0.02, torch.Generator().manual_seed(0),
                 Transformer(spec).backend, 0.0, None).router
    r = router(torch.randn(64, spec.hidden_size))
    groups_used = (r.experts // (spec.num_experts // spec.router_num_groups))
    for row in groups_used:
        assert len(set(row.tolist())) <= spec.router_groups_per_token
    # sigmoid scores renormalised over the top-k, then scaled by the routed scaling factor
    torch.testing.assert_close(r.probs.sum(-1), torch.full((64,), spec.routed_scaling_factor))


def test_capacity_factor_drops_copies_beyond_each_experts_capacity():
    spec = load_model(DATA / "tiny_qwen3_moe.yaml")
    gen = torch.Generator().manual_seed(0)
    moe = MoE(spec, 0.02, 0.02, gen, Transformer(spec).backend, 0.0, capacity_factor=0.5)
    x = torch.randn(64, spec.hidden_size)
    r = moe.router(x)
    cap = math.ceil(64 * spec.moe_top_k / spec.num_experts * 0.5)
    assert (r.counts <= cap).all() and (r.experts == spec.num_experts).any()
    assert (r.probs[r.experts == spec.num_experts] == 0).all()
    y = moe(x.view(64, 1, -1))  # dropped copies contribute nothing, shapes unchanged
    assert y.shape == (64, 1, spec.hidden_size) and torch.isfinite(y).all()
    big = MoE(spec, 0.02, 0.02, torch.Generator().manual_seed(0), moe.experts.backend, 0.0,
              capacity_factor=100.0)
    dropless = MoE(spec, 0.02, 0.02, torch.Generator().manual_seed(0), moe.experts.backend,
                   0.0, capacity_factor=None)
    torch.testing.assert_close(big(x.view(64, 1, -1)), dropless(x.view(64, 1, -1)))


def test_same_seed_builds_the_same_full_weights():
    spec = load_model(DATA / "tiny_deepseek_v3.yaml")
    a, b = Transformer(spec, seed=3), Transformer(spec, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    c = Transformer(spec, seed=4)
    assert not torch.equal(a.embedding.weight, c.embedding.weight)


def test_markov_data_is_a_function_of_seed_and_step_only():
    d = MarkovData(vocab=50, seq_len=16, global_batch=8, seed=1)
    assert torch.equal(d.global_batch(3), MarkovData(50, 16, 8, 1).global_batch(3))
    assert not torch.equal(d.global_batch(3), d.global_batch(4))
    # dp slices of the global batch, in rank order, rebuild it
    parts = [mb for r in range(4) for mb in d.micro_batches(3, r, 4, 1)]
    assert torch.equal(torch.cat([t for t, _ in parts]), d.global_batch(3)[:, :-1])
    # every transition is one of the token's four successors
    b = d.global_batch(0)
    ok = (d.successors[b[:, :-1]] == b[:, 1:].unsqueeze(-1)).any(-1)
    assert ok.all()


def test_lr_warms_up_then_decays_to_min_lr():
    t = TrainingSpec(global_batch_size=8, lr=1e-3, min_lr=1e-4, warmup_steps=2, decay_steps=10)
    assert lr_at(0, t) == pytest.approx(5e-4) and lr_at(1, t) == pytest.approx(1e-3)
    assert lr_at(2, t) < 1e-3  # decaying from step 2 on (tests/test_training_settings.py)
    assert lr_at(10, t) == pytest.approx(1e-4) and lr_at(50, t) == pytest.approx(1e-4)
    assert lr_at(3, t) > lr_at(6, t) > lr_at(9, t)


def _plan(model: str, world: int, **axes) -> Plan:
    t = TrainingSpec(seq_len=4096, global_batch_size=1024)
    return Plan(model=load_model(model), cluster=load_cluster("h100", gpus=world), training=t,
                layout=Layout.build(world, 1024, **axes))


@pytest.mark.parametrize("model,world,axes", [
    ("qwen3-30b-a3b", 64, {"tp": 2, "ep": 8, "etp": 1}),
    ("qwen3-235b-a22b", 32, {"tp": 4, "ep": 8, "etp": 2}),
    ("mixtral-8x7b", 16, {"tp": 2, "ep": 8}),
])
def test_scale_down_keeps_every_parallel_degree_valid(model, world, axes):
    plan = _plan(model, world, **axes)
    small = scale_down_model(plan.model, plan.layout)
    training, layout = scale_down_training(plan.training, plan.layout)
    check_layout(small, training, layout)  # raises on any broken rule
    assert layout.world_size == world and layout.ep == axes["ep"]
    assert small.hidden_size <= 256 and small.num_layers <= 4
    assert small.vocab_size % layout.tp == 0 and small.num_experts % layout.ep == 0


def test_features_the_runtime_does_not_execute_are_named():
    assert features_not_executed(_plan("deepseek-v3", 64, tp=2, ep=8)) == []  # MTP runs
    qwen = _plan("qwen3-30b-a3b", 64, tp=2, ep=8)
    assert features_not_executed(qwen) == []
    refused = qwen.model_copy(update={
        "layout": qwen.layout.model_copy(update={"ep_overlap": True, "dispatcher": "flex",
                                                 "etp": 2}),
        "choices": Choices(recompute=["moe_act"], offload=["expert_fc1"]),
    })
    # EP overlap runs (overlap.py), flex and etp 2 included, with activation offload too
    assert features_not_executed(refused) == []
    recompute_only = refused.model_copy(update={"choices": Choices(recompute=["moe_act"])})
    assert features_not_executed(recompute_only) == []
    flex = qwen.model_copy(update={"layout": qwen.layout.model_copy(
        update={"dispatcher": "flex"})})
    assert features_not_executed(flex) == []  # FlexDispatcher
    assert any("sliding" in f for f in features_not_executed(_plan("gpt-oss-120b", 8, ep=8)))


def test_cli_module_does_not_import_torch():
    code = "import sys, moeplan.cli, moeplan; moeplan.groups(gpus=4, tp=2); " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_rank_draws_only_its_shards_and_they_are_the_full_models_slices(monkeypatch):
    """Deferred init: before `materialize_` the large weights take no memory; afterwards a
    tp rank 1 of 2 / ep rank 1 of 2 holds exactly its slices of the model every plan starts
    from, and drew only its own experts and the embedding rows of its vocabulary shard."""
    from moeplan.runtime import layers
    from moeplan.runtime.comm import Axis
    from moeplan.runtime.layers import materialize_, shard_info
    from moeplan.runtime.parallelize import ExpertParallel, apply_ep, apply_tp
    from moeplan.specs import load_model

    spec = load_model(DATA / "tiny_qwen3_moe.yaml")
    monkeypatch.setattr(layers, "ROW_BLOCK", 16)  # the 256-row embedding: 16 blocks
    full = {n: p.detach().clone() for n, p in Transformer(spec, seed=7).named_parameters()}
    model = Transformer(spec, seed=7, materialize=False)
    assert model.layers[1].mlp.experts.w_up.is_meta and model.embedding.weight.is_meta
    two = Axis(None, 2, 1, (0, 1))
    apply_tp(model, two)
    apply_ep(model, ExpertParallel(ep=two, tp_ep=two, seq=two))
    drawn: list[str] = []
    real = layers._name_generator
    monkeypatch.setattr(layers, "_name_generator", lambda s, n: drawn.append(n) or real(s, n))
    materialize_(model, 7)
    for name, p in model.named_parameters():
        want, info = full[name], shard_info(p)
        if info.expert:
            want = want.narrow(0, want.shape[0] // 2, want.shape[0] // 2)
        elif info.tp_dim is not None:
            n = want.shape[info.tp_dim] // 2
            want = want.narrow(info.tp_dim, n, n)
        assert not p.is_meta and torch.equal(p.detach(), want), name
    experts = [n for n in drawn if ".experts.w_up/" in n and n.startswith("layers.1.")]
    assert experts == [f"layers.1.mlp.experts.w_up/{e}" for e in range(4, 8)]
    rows = [n for n in drawn if n.startswith("embedding.weight/")]  # vocab-parallel: dim 0
    assert rows == [f"embedding.weight/{b}" for b in range(8, 16)]
