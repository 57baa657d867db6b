"""Training settings under Megatron's names: the learning rate is megatron-core's own scheduler's,
the flags (or one config file) land in the plan's training section, and the Megatron export of
that plan emits the same flags."""

from __future__ import annotations

import json
import time
import warnings
from types import SimpleNamespace

import pytest

from moeplan import Layout, Plan, TrainingSpec, load_cluster, load_model
from moeplan.cli import main
from moeplan.errors import SpecError
from moeplan.planner.export import export, to_megatron_args
from moeplan.runtime.options import RunOptions
from moeplan.runtime.settings import apply_settings, read_config
from moeplan.specs import load_training

with warnings.catch_warnings():  # megatron-core warns that Apex/TE are absent on CPU
    warnings.simplefilter("ignore")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from .test_cli_surface import _flags
from .test_run_cli import write_plan


def megatron_lr(t: TrainingSpec, step: int) -> float:
    """megatron-core's learning rate after `step` + 1 scheduler steps (see TrainingSpec.lr_at)."""
    s = OptimizerParamScheduler(
        SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters, lr_decay_steps=t.decay_iters,
        lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant", wsd_decay_steps=t.lr_wsd_decay_iters,
        lr_wsd_decay_style=t.lr_wsd_decay_style)
    s.step(step + 1)
    return s.get_lr({})


SCHEDULES = [
    {"lr_decay_style": "constant"},
    {"lr_decay_style": "linear"},
    {"lr_decay_style": "cosine"},
    {"lr_decay_style": "cosine", "lr_warmup_iters": 0},
    *({"lr_decay_style": "WSD", "lr_wsd_decay_iters": 30, "lr_wsd_decay_style": w}
      for w in ("linear", "cosine", "exponential", "minus_sqrt")),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "-".join(map(str, s.values())))
def test_lr_is_megatron_cores_scheduler_for_every_decay_style(schedule):
    t = TrainingSpec(**{"global_batch_size": 8, "lr": 3e-3, "min_lr": 1e-4,
                        "lr_warmup_iters": 10, "lr_decay_iters": 100, "train_iters": 120,
                        **schedule})
    got = [t.lr_at(s) for s in range(130)]
    assert got == pytest.approx([megatron_lr(t, s) for s in range(130)], rel=1e-12, abs=0)
    assert len(set(got)) > (1 if schedule["lr_decay_style"] == "constant" else 30)


def test_decay_ends_at_train_iters_when_no_decay_iters_are_given():
    t = TrainingSpec(global_batch_size=8, lr=1.0, min_lr=0.0, lr_warmup_iters=5,
                     train_iters=50, lr_decay_style="linear")
    assert t.decay_iters == 50 and t.lr_at(49) == 0.0 and t.lr_at(48) > 0  # Megatron's default


@pytest.mark.parametrize("settings,field", [
    ({"lr_warmup_iters": 100, "lr_decay_iters": 100}, "lr_warmup_iters"),
    ({"lr_decay_style": "WSD"}, "lr_wsd_decay_iters"),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_iters": 999}, "lr_wsd_decay_iters"),
    ({"lr_decay_style": "step"}, "lr_decay_style"),
    ({"min_lr": 1.0}, "min_lr"),
    ({"train_iters": 0}, "train_iters"),
])
def test_a_bad_schedule_is_refused_naming_the_setting(settings, field):
    with pytest.raises(SpecError, match=f"`{field}`"):
        load_training(TrainingSpec(global_batch_size=8), **settings)


def test_plans_written_with_the_old_names_still_load():
    t = TrainingSpec.model_validate({"global_batch_size": 8, "warmup_steps": 3,
                                     "decay_steps": 40, "grad_clip": 0.5})
    assert (t.lr_warmup_iters, t.lr_decay_iters, t.clip_grad) == (3, 40, 0.5)
    assert "warmup_steps" not in t.model_dump()


def qwen_plan() -> Plan:
    return Plan(model=load_model("qwen3-30b-a3b"), cluster=load_cluster("h100", 8),
                training=TrainingSpec(seq_len=4096, global_batch_size=64),
                layout=Layout.build(8, 64, ep=8))


def test_run_settings_enter_the_plans_training_section_and_the_megatron_export():
    opts = RunOptions(training={"lr": 2e-4, "min_lr": 2e-5, "lr_warmup_iters": 50,
                                "lr_decay_style": "WSD", "lr_wsd_decay_iters": 100,
                                "lr_wsd_decay_style": "linear", "lr_decay_iters": 900,
                                "weight_decay": 0.05, "clip_grad": 0.8, "train_iters": 1000})
    plan = apply_settings(qwen_plan(), opts)
    t = plan.training
    assert (t.lr, t.lr_warmup_iters, t.lr_decay_style, t.train_iters) == (2e-4, 50, "WSD", 1000)
    assert opts.steps == 1000  # no --steps: the run trains its train_iters
    f = _flags(to_megatron_args(plan)[0])
    assert f["--lr"] == ["0.0002"] and f["--min-lr"] == ["2e-05"]
    assert f["--lr-decay-style"] == ["WSD"] and f["--lr-wsd-decay-style"] == ["linear"]
    assert f["--lr-wsd-decay-iters"] == ["100"] and f["--lr-decay-iters"] == ["900"]
    assert f["--lr-warmup-iters"] == ["50"] and f["--train-iters"] == ["1000"]
    assert f["--weight-decay"] == ["0.05"] and f["--clip-grad"] == ["0.8"]
    assert export(plan)["schedule"] == {"train_iters": 1000, "lr_warmup_iters": 50,
                                        "lr_decay_iters": 900}


def test_train_tokens_become_train_iters_at_the_plans_batch():
    opts = RunOptions(training={"train_tokens": 1e9})
    plan = apply_settings(qwen_plan(), opts)
    assert plan.training.train_iters == -(-10**9 // (4096 * 64)) == opts.steps
    with pytest.raises(SpecError, match="not both"):
        apply_settings(qwen_plan(), RunOptions(training={"train_tokens": 1e9, "train_iters": 5}))
    assert apply_settings(qwen_plan(), RunOptions(steps=7)).training == qwen_plan().training


def test_eval_iters_alone_evaluates_once_at_the_last_step_as_megatron_does_at_the_end():
    """--eval-iters without --eval-interval was ignored: no evaluation, no word of it."""
    from moeplan.runtime.runlog import eval_due

    alone = RunOptions(steps=7, eval_iters=3)
    apply_settings(qwen_plan(), alone)
    assert [s for s in range(1, 8) if eval_due(s, alone)] == [7] and alone.batches_per_eval == 3
    both = RunOptions(steps=7, eval_interval=3)
    apply_settings(qwen_plan(), both)
    assert [s for s in range(1, 8) if eval_due(s, both)] == [3, 6, 7]
    assert both.batches_per_eval == 10
    none = RunOptions(steps=7)
    apply_settings(qwen_plan(), none)
    apply_settings(qwen_plan(), none)  # applied twice, still no evaluation
    assert not any(eval_due(s, none) for s in range(1, 8))
    valid = RunOptions(steps=7, valid_data="b")  # a validation set alone: evaluated at the end
    apply_settings(qwen_plan(), valid)
    assert [s for s in range(1, 8) if eval_due(s, valid)] == [7] and valid.split == "100,0,0"


def test_one_config_file_holds_the_settings_under_the_flags_names(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("lr: 1.0e-3\nlr-warmup-iters: 4\n--lr-decay-style: linear\n"
                    "eval-interval: 5\ndata: synthetic\n")
    training, options = read_config(path)
    assert training == {"lr": 1e-3, "lr_warmup_iters": 4, "lr_decay_style": "linear"}
    assert options == {"eval_interval": 5, "data": "synthetic"}
    path.write_text("learning_rate: 1.0\n")
    with pytest.raises(SpecError, match="unknown setting 'learning_rate'.*lr-warmup-iters"):
        read_config(path)
    path.write_text("eval-interval: ten\n")
    with pytest.raises(SpecError, match="`eval-interval` must be a whole number"):
        read_config(path)


def test_run_flags_and_config_reach_the_run_and_bad_ones_stop_it_before_any_worker(
        cli, tmp_path, capsys):
    plan = write_plan(tmp_path / "p.json", 1)
    (tmp_path / "c.yaml").write_text("lr-decay-style: linear\nlr: 0.5\n")
    start = time.perf_counter()
    r = cli("run", plan, "--config", str(tmp_path / "c.yaml"), "--lr", "0.02",
            "--lr-warmup-iters", "7", "--train-iters", "3", "--lr-decay-iters", "20",
            "--out", str(tmp_path / "o"), "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = json.loads((tmp_path / "o" / "plan.json").read_text())["training"]
    assert (saved["lr"], saved["lr_decay_style"], saved["lr_warmup_iters"]) == (0.02, "linear", 7)
    rows = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]  # --train-iters 3 without --steps
    assert rows[0]["lr"] == pytest.approx(0.02 / 7)
    for flags, needle in ((["--lr-decay-style", "step"], "lr_decay_style"),
                          (["--lr-warmup-iters", "2000"], "lr_warmup_iters"),
                          (["--eval-interval", "0"], "--eval-interval must be between"),
                          (["--split", "9,1,0"], "--split cuts the datasets")):
        code = main(["run", plan, "--out", str(tmp_path / "bad"), *flags])
        said = capsys.readouterr().err
        assert code == 2 and needle in " ".join(said.split()), said
        assert "Traceback" not in said and not (tmp_path / "bad").exists()
    assert time.perf_counter() - start < 60
