"""`--scale-down` shrinks the model independently of the layout (so a scaled-down checkpoint
resumes under any plan of the model) and keeps the vocabulary when real data indexes it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeplan import Layout, Plan, TrainingSpec, load_cluster, load_model
from moeplan.runtime.launch import prepare_plan
from moeplan.runtime.options import RunOptions
from moeplan.runtime.scale import describe_scale_down, scale_down_plan
from moeplan.specs import check_layout, list_presets

from .test_checkpoint import last_per_step

LAYOUTS = [(1, {}), (2, {"ep": 2}), (2, {"tp": 2}), (4, {"tp": 2, "pp": 2}),
           (2, {"pp": 2, "vpp": 2}), (2, {"cp": 2}), (4, {"tp": 2, "ep": 2, "cp": 2}),
           (8, {"tp": 2, "ep": 4, "pp": 2}), (8, {"tp": 4, "ep": 8, "etp": 2})]


def plan_of(model: str, world: int, **axes) -> Plan:
    return Plan(model=load_model(model), cluster=load_cluster("h100", gpus=world),
                training=TrainingSpec(seq_len=4096, global_batch_size=64),
                layout=Layout.build(world, 64, **axes))


def valid_plans(model: str) -> list[Plan]:
    plans = []
    for world, axes in LAYOUTS:
        try:
            plan = plan_of(model, world, **axes)
            check_layout(plan.model, plan.training, plan.layout)
        except Exception:  # a layout this model does not allow
            continue
        plans.append(plan)
    return plans


@pytest.mark.parametrize("model", list_presets()["models"])
def test_scale_down_is_the_same_model_and_batch_under_every_layout(model):
    plans = valid_plans(model)
    assert len(plans) >= 4
    small = [scale_down_plan(p) for p in plans]
    for p, s in zip(plans, small, strict=True):
        check_layout(s.model, s.training, s.layout, choices=s.choices)  # runs as planned
        assert (s.layout.tp, s.layout.ep, s.layout.pp, s.layout.cp) == (
            p.layout.tp, p.layout.ep, p.layout.pp, p.layout.cp)
        assert s.model == small[0].model  # the same small network under every layout
        assert (s.training.seq_len, s.training.global_batch_size) == (128, 4)
    assert small[0].model.total_params() < 1e7  # GLM-4.5's 160 experts keep 40: 8.4 M
    assert "resume under any of them" in describe_scale_down(plans[0], small[0])


def test_qwen3_30b_under_ep2_and_tp2_has_one_parameter_count():
    ep2, tp2 = (scale_down_plan(plan_of("qwen3-30b-a3b", 2, **a)) for a in ({"ep": 2},
                                                                              {"tp": 2}))
    assert ep2.model.total_params() == tp2.model.total_params()  # was 1.48 M vs 2.04 M


def test_a_layout_beyond_the_small_model_grows_it_and_says_so():
    plan = plan_of("qwen3-30b-a3b", 16, ep=16)  # 16 experts: more than the 8 of the small one
    small = scale_down_plan(plan)
    assert small.model.num_experts == 16
    said = describe_scale_down(plan, small)
    assert "num_experts 8 → 16" in said and "resume only under layouts" in said


def test_scale_down_keeps_the_vocabulary_when_data_is_given(tmp_path):
    from moeplan.data.indexed import write_documents

    rng = np.random.default_rng(0)
    write_documents(tmp_path / "corpus", [rng.integers(0, 151_000, 500) for _ in range(20)],
                    np.int32)
    path = tmp_path / "q30.json"
    path.write_text(plan_of("qwen3-30b-a3b", 2, ep=2).model_dump_json())
    opts = RunOptions(steps=2, scale_down=True, data=str(tmp_path / "corpus"), split="9,1,0")
    given, running = prepare_plan(path, opts)
    assert running.model.vocab_size == given.model.vocab_size == 151_936
    said = describe_scale_down(given, running, keep_vocab=True)
    assert "vocabulary 151,936 kept for the data's token ids" in said
    without = prepare_plan(path, RunOptions(steps=2, scale_down=True))[1]
    assert without.model.vocab_size == 1024


@pytest.mark.slow
def test_a_scaled_down_checkpoint_resumes_under_another_layout_with_the_same_next_loss(
        cli, tmp_path):
    """qwen3-30b-a3b scaled down: 3 steps under ep2 (checkpoint at 2), then step 3 again from
    that checkpoint under tp2: the same step-3 loss."""
    ep2, tp2 = tmp_path / "ep2.json", tmp_path / "tp2.json"
    ep2.write_text(plan_of("qwen3-30b-a3b", 2, ep=2).model_dump_json())
    tp2.write_text(plan_of("qwen3-30b-a3b", 2, tp=2).model_dump_json())
    common = ["--scale-down", "--dtype", "fp32", "--lr", "1e-3", "--lr-warmup-iters", "1"]
    r = cli("run", str(ep2), "--steps", "3", "--ckpt-dir", str(tmp_path / "ckpt"),
            "--ckpt-every", "2", "--out", str(tmp_path / "a"), *common, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp_path / "ckpt" / "step_00000003").rename(tmp_path / "later")  # resume from step 2
    (tmp_path / "ckpt" / "latest").unlink()
    r = cli("run", str(tp2), "--steps", "3", "--ckpt-dir", str(tmp_path / "ckpt"), "--resume",
            "--out", str(tmp_path / "b"), *common, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    straight, resumed = (last_per_step(tmp_path / d / "metrics.jsonl") for d in ("a", "b"))
    assert sorted(resumed) == [3]
    assert resumed[3] == pytest.approx(straight[3], rel=1e-5)
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["resumed_from"] == 2


@pytest.mark.parametrize("share", [0.5, 0.25, 0.75])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 8])
def test_a_partial_rotary_model_scales_down_to_an_even_number_of_rotary_dims(share, tp):
    """GLM's half-head RoPE: the scaled head must still rotate an even whole number of dims
    (a head of 42 would rotate 21), at every tensor-parallel degree."""
    from moeplan.runtime.scale import scale_down_model

    spec = load_model("glm-4.5").model_copy(update={"rotary_percent": share})
    small = scale_down_model(spec, Layout(tp=tp, dp=1))
    rebuilt = type(small).model_validate(small.model_dump())  # the spec's own validation
    assert rebuilt.rotary_dim % 2 == 0 and rebuilt.rotary_dim == int(small.head_dim_ * share)
