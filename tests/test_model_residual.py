"""A model whose published runs the physics misses as a whole carries the measured slowdown as
unmodelled time, measured from fit rows only, named in its estimates, never a speed-up."""

import pytest

from moeplan.cost_models import estimate, lower_bound
from moeplan.cost_models.calibration import default_calibration
from moeplan.specs import Layout, TrainingSpec, load_cluster, load_model
from moeplan.validation import read_rows
from moeplan.validation.crossval import cases_of
from moeplan.validation.fit import model_residuals
from moeplan.validation.scoring import published_tokens


@pytest.fixture(scope="module")
def cases():
    keep = ("gpt-oss-120b", "llama3-8b", "mixtral-8x22b")
    return [c for c in cases_of([r for r in read_rows() if r["model_preset"] in keep])
            if published_tokens(c)[0]]


def _preds(cases, ratio):
    """Predictions that put each case's published/predicted ratio at ratio(case)."""
    return [published_tokens(c)[0] / ratio(c) for c in cases]


def test_only_a_model_and_precision_off_as_a_whole_slower_gets_a_residual(cases):
    """gpt-oss-120b's MXFP8 rows are too few to tell on their own: they take the median of
    all its rows when those are off as a whole, and none when they are not."""
    def ratio(c):
        if c.model.name == "gpt-oss-120b":
            return 0.7 if c.training.precision == "bf16" else 0.5  # mxfp8: 4 rows, too few
        return 1.3 if c.model.name == "mixtral-8x22b" else 0.9     # faster; within 20%
    got = model_residuals(cases, _preds(cases, ratio))
    assert got == {"gpt-oss-120b/bf16": 0.7, "gpt-oss-120b/mxfp8": 0.7}
    assert sum(c.model.name == "gpt-oss-120b" and c.training.precision == "mxfp8"
               for c in cases) < 5

    def bf16_on_time(c):
        if c.model.name == "gpt-oss-120b":
            return 1.0 if c.training.precision == "bf16" else 0.5
        return 1.0
    assert model_residuals(cases, _preds(cases, bf16_on_time)) == {}
    # rows the refit could not price (None) are no evidence either way
    assert model_residuals(cases, [None] * len(cases)) == {}


def test_a_folds_profile_replaces_the_shipped_residuals_instead_of_merging_them():
    shipped = default_calibration()
    assert shipped.residual_for("gpt-oss-120b", "bf16") < 1  # the fit rows measured it
    fold = shipped.with_overrides({"model_residual": {}})
    assert fold.model_residual == {} and fold.residual_for("gpt-oss-120b", "bf16") == 1.0
    # the other dict-valued constants still merge entry by entry
    merged = shipped.with_overrides({"launch_us": {"x86": 1.0}})
    assert merged.launch_us == {**shipped.launch_us, "x86": 1.0}
    # never above 1: a residual cannot price a run faster than its work
    assert shipped.with_overrides({"model_residual": {"llama3-8b/bf16": 1.5}}).residual_for(
        "llama3-8b", "bf16") == 1.0


def test_the_estimate_carries_the_residual_as_named_unmodelled_time():
    oss = load_model("gpt-oss-120b")
    c, lay = load_cluster("gb200-nvl72", 64), Layout.build(64, 1280, ep=64, mbs=4)
    f = default_calibration().residual_for(oss.name, "bf16")
    bf16 = TrainingSpec(seq_len=4096, global_batch_size=1280)
    got = estimate(oss, c, bf16, lay, with_interval=False)
    physics = estimate(oss, c, bf16, lay, with_interval=False,
                       calibration={"model_residual": {}})
    assert got.step_time_s == pytest.approx(physics.step_time_s / f, rel=1e-12)
    assert got.unmodelled_s == pytest.approx(got.step_time_s - physics.step_time_s)
    assert physics.unmodelled_s == 0.0
    assert any("unmodelled time" in w and f"{f:.2f}x" in w for w in got.warnings)
    # the search's bound, priced without the residual, stays a bound (the residual only slows)
    assert lower_bound(oss, c, bf16, tp=1, cp=1, dp=64, pp=1, ep=64)[0] <= got.step_time_s
    # its MXFP8 rows, too few to tell alone, carry the model's pooled residual; a precision
    # with no fit rows, and another model, carry none
    mx = TrainingSpec(seq_len=4096, global_batch_size=1280, precision="mxfp8")
    pooled = default_calibration().residual_for(oss.name, "mxfp8")
    assert 0.0 < pooled < 1.0 and pooled == pytest.approx(f, abs=0.05)
    assert estimate(oss, c, mx, lay, with_interval=False).unmodelled_s > 0.0
    cs = TrainingSpec(seq_len=4096, global_batch_size=1280, precision="fp8-tensorwise")
    assert estimate(oss, c, cs, lay, with_interval=False).unmodelled_s == 0.0
    llama = estimate(load_model("llama3-70b"), c, bf16, Layout.build(64, 1280, tp=4, pp=2),
                     with_interval=False)
    assert llama.unmodelled_s == 0.0
    assert not any("unmodelled" in w for w in llama.warnings)


@pytest.mark.parametrize("objective", ["robust", "expected"])
def test_the_search_ranks_and_prunes_a_slowed_model_exactly_as_its_physics(objective):
    """The residual slows every plan of a model and precision alike, so the search finds the
    same plans, screening the same rows, with every step time 1/residual longer: its bounds
    price the physics, its thresholds carry the residual (planner.objective)."""
    from moeplan.planner.search import search

    oss = load_model("gpt-oss-120b")
    c = load_cluster("gb200-nvl72", 64)
    tr = TrainingSpec(seq_len=4096, global_batch_size=1280)
    f = default_calibration().residual_for(oss.name, "bf16")
    assert f < 1
    got = search(oss, c, tr, 64, objective=objective)
    bare = search(oss, c.model_copy(update={"calibration": {"model_residual": {}}}), tr, 64,
                  objective=objective)
    assert [(p.layout, p.choices) for p in got.plans] == [(p.layout, p.choices)
                                                          for p in bare.plans]
    assert (got.screened, got.pruned) == (bare.screened, bare.pruned)
    for p, q in zip(got.plans, bare.plans, strict=True):
        assert p.estimate.step_time_s == pytest.approx(q.estimate.step_time_s / f, rel=1e-9)
        assert p.estimate.interval.step_time_s[1] == pytest.approx(
            q.estimate.interval.step_time_s[1] / f, rel=1e-9)


def test_the_step_anatomy_shows_the_unmodelled_time_as_its_own_term():
    from moeplan.planner.anatomy import step_parts
    from moeplan.specs import Plan

    oss = load_model("gpt-oss-120b")
    c, lay = load_cluster("gb200-nvl72", 64), Layout.build(64, 1280, ep=64, mbs=4)
    tr = TrainingSpec(seq_len=4096, global_batch_size=1280)
    est = estimate(oss, c, tr, lay)
    parts = step_parts(Plan(model=oss, cluster=c, training=tr, layout=lay, estimate=est))
    assert parts["unmodelled (measured for this model)"] == est.unmodelled_s > 0
    assert sum(parts.values()) == pytest.approx(est.step_time_s, rel=1e-9)
