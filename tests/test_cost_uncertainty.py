"""Honest predictions: conformal bounds, named assumptions, margins, measured narrowing."""

import math
from dataclasses import replace

import pytest

from moeplan.calibrate.refit import measured_interval
from moeplan.cost_models import uncertainty as U
from moeplan.cost_models.estimate import estimate
from moeplan.specs import Choices, Layout, TrainingSpec, load_cluster, load_model


def test_conformal_bounds_need_enough_rows_and_take_the_finite_sample_ranks():
    assert U.conformal_bounds([0.1] * 8) is None  # ⌈9·0.9⌉ = 9 > 8: no finite 80 % interval
    # nine rows make one: ⌈10·0.9⌉ = 9, though 10·0.9 is 9.000000000000002 in floating point
    assert U.conformal_bounds([i / 10 for i in range(9)]) == (0.0, 0.8)
    r = [i / 10 for i in range(-10, 11)]  # 21 residuals, -1.0 … 1.0
    lo, hi = U.conformal_bounds(r)
    assert (lo, hi) == (r[2 - 1], r[20 - 1])  # ⌊22·0.1⌋ = 2nd, ⌈22·0.9⌉ = 20th smallest


def test_unvalidated_overlap_pulls_the_low_end_to_the_plan_without_it():
    # no published row overlaps an EP group that leaves its NVL72 rack
    m, c = load_model("qwen3-235b-a22b"), load_cluster("gb200-nvl72", 256)
    t = TrainingSpec(seq_len=4096, global_batch_size=2048)
    ovl = Layout.build(256, 2048, ep=128, ep_overlap=True)
    e = estimate(m, c, t, ovl)
    plain = estimate(m, c, t, ovl.model_copy(update={"ep_overlap": False}))
    weak = [a for a in e.assumptions if not a.validated]
    assert any("EP overlap" in a.term for a in weak)
    assert e.interval.pessimistic_tokens_per_s_per_gpu == pytest.approx(
        plain.tokens_per_s_per_gpu)
    assert e.interval.tokens_per_s_per_gpu[0] < plain.tokens_per_s_per_gpu


def test_ep_overlap_evidence_is_filed_by_dispatcher_family_across_nodes_and_by_tp_or_cp():
    base = Layout.build(256, 2048, tp=2, ep=32, ep_overlap=True)
    nccl, flex = base, base.model_copy(update={"dispatcher": "flex"})
    assert U.ep_overlap_key("hopper", "scale-out", nccl) == "ep_overlap/hopper/scale-out/nccl/tp-cp"
    assert U.ep_overlap_key("hopper", "scale-out", flex) == "ep_overlap/hopper/scale-out/flex/tp-cp"
    tp1 = Layout.build(256, 2048, ep=32, ep_overlap=True, dispatcher="flex")
    assert U.ep_overlap_key("hopper", "scale-out", tp1) == "ep_overlap/hopper/scale-out/flex"
    # over NVLink both families copy with SMs: one key
    assert U.ep_overlap_key("blackwell-nvl72", "nvlink", flex) == (
        "ep_overlap/blackwell-nvl72/nvlink/tp-cp")
    # the harder case backs the easier one, never the converse
    prof = U.default_profile()
    shown = replace(prof, evidence={"ep_overlap/x/scale-out/nccl/tp-cp": ["A"]})
    assert U.evidence_for("ep_overlap/x/scale-out/nccl", shown) == ["A"]
    tp1_only = replace(prof, evidence={"ep_overlap/x/scale-out/nccl": ["B"]})
    assert U.evidence_for("ep_overlap/x/scale-out/nccl/tp-cp", tp1_only) == []


def test_flex_overlap_across_hgx_nodes_beside_tp_is_priced_without_it_at_the_low_end():
    # no fit row overlaps the flex dispatcher's transfers beside TP collectives (Megatron-LM's
    # TP 2 recipes that do, on H100, B200 and B300, measured 20-57 % below the overlap's price)
    m, c = load_model("qwen3-235b-a22b"), load_cluster("h100", 256)
    t = TrainingSpec(seq_len=4096, global_batch_size=2048)
    lay = Layout.build(256, 2048, tp=2, pp=8, vpp=4, ep=32, ep_overlap=True, dispatcher="flex")
    e = estimate(m, c, t, lay)
    plain = estimate(m, c, t, lay.model_copy(update={"ep_overlap": False}))
    weak = [a.term for a in e.assumptions if not a.validated]
    assert any("flex dispatcher" in w and "beside TP/CP" in w for w in weak)
    assert e.interval.pessimistic_tokens_per_s_per_gpu == pytest.approx(
        plain.tokens_per_s_per_gpu)
    # the NCCL all-to-all beside TP 2 on H100 is what Megatron-Bridge's Qwen3 rows run
    nccl = estimate(m, c, t, lay.model_copy(update={"dispatcher": "alltoall"}))
    assert all(a.validated for a in nccl.assumptions if "EP overlap" in a.term)


def test_an_moe_layer_graphed_whole_is_an_effect_the_token_drop_rows_contradict():
    """Megatron-Bridge's token-drop runs capture each MoE layer, padded to capacity, in CUDA
    graphs, and measured 0.68-0.93x their prediction: those rows do not back the capture, so
    such a plan's low end is priced without the graphs; the dropless twin relies on no such
    effect."""
    m, c = load_model("qwen3-30b-a3b"), load_cluster("b200", 8)
    padded = TrainingSpec(seq_len=4096, global_batch_size=512, precision="mxfp8",
                          moe_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    lay = Layout.build(8, 512, ep=8, mbs=1, dispatcher="alltoall", cuda_graphs=True)
    e = estimate(m, c, padded, lay)
    eager = estimate(m, c, padded, lay.model_copy(update={"cuda_graphs": False}))
    weak = [a for a in e.assumptions if not a.validated]
    assert any("whole MoE layer" in a.term and "measured" in a.evidence for a in weak)
    assert eager.tokens_per_s_per_gpu < e.tokens_per_s_per_gpu
    assert e.interval.pessimistic_tokens_per_s_per_gpu == pytest.approx(
        eager.tokens_per_s_per_gpu)
    dropless = padded.model_copy(update={"moe_capacity_factor": None,
                                         "moe_pad_expert_input_to_capacity": False})
    assert "moe_layer_graphs" not in U.assumption_keys(m, c, dropless, lay, Choices())
    assert "moe_layer_graphs" in U.assumption_keys(m, c, padded, lay, Choices())


def test_fits_means_headroom_at_least_margin():
    m, c = load_model("deepseek-v3"), load_cluster("gb200-nvl72", 256)
    t = TrainingSpec(seq_len=4096, global_batch_size=4096, precision="mxfp8")
    for axes in ({"pp": 4, "vpp": 4, "ep": 64}, {"pp": 2, "ep": 64}, {"pp": 8, "ep": 32}):
        e = estimate(m, c, t, Layout.build(256, 4096, **axes), Choices(recompute=["full"]))
        mem = e.memory
        assert mem.margin_gb > 0
        assert mem.headroom_gb == pytest.approx(c.hbm_gb - mem.peak_gb)
        assert e.fits == (mem.headroom_gb >= mem.margin_gb - 1e-9)


def test_runs_measured_on_a_cluster_narrow_its_intervals():
    m, c = load_model("llama3-8b"), load_cluster("h100", 8)
    t = TrainingSpec(seq_len=4096, global_batch_size=64)
    L = Layout.build(8, 64, tp=1)
    wide = estimate(m, c, t, L).interval
    rows = [{"split": "held-out", "measured_s": 1.0, "after_s": 1.0 + d / 250}
            for d in range(-4, 6)]  # ten runs within ±2 % of the refitted prediction
    band = measured_interval(rows)
    assert band is not None and band["runs"] == 10
    narrow = estimate(m, c.model_copy(update={"calibration": {"interval_runs": band}}), t,
                      L).interval
    width = lambda iv: iv.tokens_per_s_per_gpu[1] / iv.tokens_per_s_per_gpu[0]  # noqa: E731
    assert narrow.regime == "runs measured on this cluster"
    assert math.log(width(narrow)) < 0.5 * math.log(width(wide))


def test_too_few_runs_leave_the_published_interval():
    assert measured_interval([{"split": "fit", "measured_s": 1.0, "after_s": 1.0}] * 5) is None


def test_a_model_whose_fit_rows_are_off_as_a_whole_is_named_in_its_estimates():
    """A model whose held-out published runs sit off as a whole (and that no measured residual
    takes up: gpt-oss-120b's BF16 shortfall is one, tests/test_model_residual.py) is named in
    its estimates with the measured range; a model the fit explains is not; the evidence is
    recomputed from held-out rows by the interval fit."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "fit_intervals.py"
    spec = importlib.util.spec_from_file_location("fit_intervals", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model_evidence = bench.model_evidence

    oss, llama = load_model("gpt-oss-120b"), load_model("llama3-70b")
    prof = dataclasses.replace(U.default_profile(), models={"gpt-oss-120b": (9, 0.7, 0.6, 0.8)})
    warning = U.model_warning(oss, prof)
    assert warning is not None and "gpt-oss-120b ran slower" in warning
    assert "0.60-0.80x" in warning and "9 fit rows" in warning
    assert U.model_warning(llama, prof) is None
    c, tr = load_cluster("gb200-nvl72", 64), TrainingSpec(seq_len=4096, global_batch_size=256)
    plain = estimate(llama, c, tr, Layout.build(64, 256, tp=4, pp=2), with_interval=False)
    assert not any("ran slower" in w or "ran faster" in w for w in plain.warnings)

    def row(model, pub, pred, family="x"):  # cross-validated rows: held out of their refit
        return {"model": model, "family": family, "published": pub, "predicted": pred}
    rows_ = ([row("a", 60, 100)] * 5 + [row("b", 95, 100)] * 9 + [row("c", 50, 100)] * 4
             + [row("d", 50, 100, family="gpt")] * 9)
    # b within 20%, c too few rows, d GPTs at their own dimensions (not one model)
    assert set(model_evidence(rows_)) == {"a"}
    assert model_evidence(rows_)["a"] == {"rows": 5, "median": 0.6, "low": 0.6, "high": 0.6}


def test_fit_rows_that_use_an_effect_but_miss_it_do_not_validate_it():
    """An effect is validated by the fit rows that rely on it only when they sit within the
    "off as a whole" ratio in the median; otherwise it keeps its pessimistic low end and says
    what its rows measured."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "fit_intervals.py"
    spec = importlib.util.spec_from_file_location("fit_intervals", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def row(i, key, pub, pred):
        return {"id": i, "assumption_keys": [key],
                "published_tokens_per_s_per_gpu": pub, "predicted_tokens_per_s_per_gpu": pred}

    rows = [row("A", "flex/x", 100, 130), row("B", "flex/x", 100, 128),
            row("C", "ep_overlap/x", 100, 103), row("D", "ep_overlap/x", 100, 97)]
    validated, contradicted = mod.split_evidence(rows)
    assert validated == {"ep_overlap/x": ["C", "D"]}
    assert contradicted == {"flex/x": {"rows": ["A", "B"], "median": round(100 / 128, 3)}}

    prof = U.profile_from_dict({
        "level": 0.8, "regimes": {}, "memory": {"rel_error": 0.1, "evidence": "-"},
        "evidence": validated, "contradicted": contradicted})
    strip = object()
    term = U._term("flex/x", "flex", prof, "no rows", strip)
    assert not term.assumption.validated and term.pessimistic is strip
    assert "2 fit rows use it (A, B)" in term.assumption.evidence
    assert U._term("ep_overlap/x", "overlap", prof, "no rows", strip).assumption.validated


def _far_profile(**extra):
    base = {"level": 0.8, "memory": {"rel_error": 0.1, "evidence": "-"}, "evidence": {},
            "regimes": {"all": {"q_lo": -0.1, "q_hi": 0.1, "rows": 50}},
            "unseen": {"all": {"q_lo": -0.3, "q_hi": 0.2, "rows": 90}},
            "family_unseen": {"q_lo": -0.5, "q_hi": 0.25, "rows": 40},
            "model_bands": {"odd-1b": {"q_lo": -0.6, "q_hi": 0.05, "rows": 9}},
            "seen_models": ["seen-7b", "odd-1b"], "seen_families": ["seen", "odd"],
            "ranges": {"micro_batch": [1, 8], "seq_len": [2048, 32768]},
            "per_doubling": 0.1, "gpu_precision_rows": {"H100-SXM/bf16": 40}}
    return U.profile_from_dict({**base, **extra})


def _far(model="seen-7b", seen=True, family=True, doublings=None, rows=40):
    return U.Distance(model, seen, family, doublings or {}, rows)


def test_intervals_widen_with_the_distance_from_the_fit_evidence():
    """Near the evidence the regime's held-out band; a model no fit row has takes the band of
    models left out of the fit, a family no fit row has the band of families left out; a GPU
    and precision with few rows the unseen band; each doubling beyond the fit rows' range
    widens both ends; a model whose rows the fit misses keeps its own measured band."""
    p, keys = _far_profile(), ["all"]
    assert U.widen(-0.1, 0.1, keys, _far(), p)[:2] == (-0.1, 0.1)
    assert U.widen(-0.1, 0.1, keys, _far("new-9b", False), p)[:2] == (-0.3, 0.2)
    lo, hi, why = U.widen(-0.1, 0.1, keys, _far("alien-9b", False, False), p)
    assert (lo, hi) == (-0.5, 0.25) and "family" in why[0]
    assert U.widen(-0.1, 0.1, keys, _far(rows=2), p)[:2] == (-0.3, 0.2)
    lo, hi, why = U.widen(-0.1, 0.1, keys, _far(doublings={"micro_batch": 2.0}), p)
    assert (lo, hi) == pytest.approx((-0.3, 0.3)) and "micro batch" in why[-1]
    assert U.widen(-0.1, 0.1, keys, _far("odd-1b"), p)[:2] == (-0.6, 0.1)


def test_distance_measures_doublings_outside_the_fit_range():
    p = _far_profile()
    m, c = load_model("llama3-8b"), load_cluster("h100", 64)
    inside = U.distance(m, c, TrainingSpec(seq_len=4096, global_batch_size=64),
                        Layout.build(64, 64, tp=8, mbs=1), p)
    beyond = U.distance(m, c, TrainingSpec(seq_len=131072, global_batch_size=64),
                        Layout.build(64, 64, tp=8, mbs=1), p)
    assert inside.doublings == {} and beyond.doublings == {"seq_len": pytest.approx(2.0)}
    assert not inside.model_seen  # llama3-8b is not among this profile's fit models


def test_the_shipped_intervals_never_narrow_the_regime_band():
    """A search bounds robust keys by the regime's band alone (planner.search's
    `_least_key_factor`): every widening must keep the interval at least that wide."""
    prof = U.default_profile()
    for name in ("gpt-oss-120b", "qwen3-30b-a3b", "deepseek-v3", "llama3-8b"):
        m, c = load_model(name), load_cluster("gb200-nvl72", 64)
        tr = TrainingSpec(seq_len=4096, global_batch_size=256)
        lay = Layout.build(64, 256, ep=8 if m.is_moe else 1, tp=1 if m.is_moe else 8)
        keys = U.regime_keys(m, c, tr.precision, lay)
        q_lo, q_hi = prof.bounds(keys)[:2]
        lo, hi, _ = U.widen(q_lo, q_hi, keys, U.distance(m, c, tr, lay), prof)
        assert lo <= q_lo and hi >= q_hi


def test_the_least_low_end_bounds_every_layouts_widened_band_and_counts_the_model():
    """A search turns the k-th robust key into a point threshold with the least downside any
    of its layouts can have (planner.objective.least_key_factor: e^(−q) of the largest
    `uncertainty.least_low_end` over the EP fabrics): no layout's widened low end may lie above
    it, and the model-level distance (a model whose own rows the fit misses) must be in it, or
    the threshold is looser than the keys and the robust search screens thousands of rows."""
    prof = U.default_profile()
    c = load_cluster("h100", 64)
    for name in ("gpt-oss-120b", "qwen3-30b-a3b", "deepseek-v3", "llama3-8b"):
        m = load_model(name)
        tr = TrainingSpec(seq_len=4096, global_batch_size=256)
        least = max(U.least_low_end(m, c, tr.precision, fab, prof)
                    for fab in ("nvlink", "scale-out"))
        for mbs in (1, 2, 4):
            for ep in ((1, 8, 64) if m.is_moe else (1,)):
                lay = Layout.build(64, 256, ep=ep, mbs=mbs, tp=1 if m.is_moe else 8)
                keys = U.regime_keys(m, c, tr.precision, lay)
                q_lo, q_hi = prof.bounds(keys)[:2]
                lo = U.widen(q_lo, q_hi, keys, U.distance(m, c, tr, lay), prof)[0]
                assert lo <= least + 1e-12, (name, mbs, ep)
    gpt = load_model("gpt-oss-120b")
    assert gpt.name in prof.model_bands  # the fit misses its rows as a whole
    regime = prof.bounds(U.regime_names(gpt, c, "bf16", "scale-out"))[0]
    assert U.least_low_end(gpt, c, "bf16", "scale-out", prof) < regime


def test_an_interval_added_to_a_priced_point_equals_the_estimate_priced_whole():
    # A search prices the point of every screened plan and adds the interval only to the
    # winners (`estimate(..., point=...)`): the result must be the whole estimate's
    m, c = load_model("deepseek-v3"), load_cluster("h100", 1024)
    tr = TrainingSpec(seq_len=4096, global_batch_size=8192)
    for ovl, disp, off in ((True, "flex", ["attn_norm"]), (False, "alltoall", [])):
        lay = Layout.build(1024, 8192, tp=4, pp=2, vpp=2, ep=256, dispatcher=disp,
                           ep_overlap=ovl, tp_comm_overlap=True)
        ch = Choices(offload=[off] if off else [])
        point = estimate(m, c, tr, lay, ch, with_interval=False)
        assert point.interval is None
        assert estimate(m, c, tr, lay, ch, point=point) == estimate(m, c, tr, lay, ch)


def test_only_a_model_missed_as_a_whole_carries_its_own_band():
    """A model the fit explains has its held-out rows in its regime's band already; a band of
    its own as well would count the same rows' spread twice (the wider of two bands)."""
    from moeplan.cost_models.calibration import default_calibration

    prof = U.default_profile()
    residual = default_calibration().residual_models()
    assert set(prof.model_bands) <= set(prof.models) | residual
    assert "gpt-oss-120b" in prof.model_bands  # carries a residual: its spread is its own
