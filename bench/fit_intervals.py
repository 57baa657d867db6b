"""Fit the 80 % prediction intervals and the memory margin (moeplan/cost_models/intervals.json).

    python bench/fit_intervals.py [CSV] [--crossval bench/data/crossval.json]
                                  [-o moeplan/cost_models/intervals.json]

The shipped calibration is fitted on every scored row, so its own errors on them prove nothing.
The honest samples of the model's error are the cross-validated predictions of
`bench/cross_validate.py`, each made by a refit that never saw the row:

- the configuration split's held-out rows, predicted by a refit on its fit rows: the error on
  a new configuration of a model the fit knows. Their conformal 10 % / 90 % bounds per regime
  (most specific first, backing off while a regime has fewer than MIN_ROWS rows; rows of a
  model missed as a whole left out, its own band carrying its error) are the interval of an
  estimate near the evidence;
- every row, predicted by a refit without its model (leave-one-model-out): the error on a
  model the fit never saw, per regime (`unseen`), and pooled over the rows whose family had no
  other model in the fit (`family_unseen`);
- per model the fit misses as a whole (`models`), or whose miss the shipped fit carries as a
  measured residual (`Calibration.model_residual`, which centres its rows but leaves their
  spread), the conformal band of its own held-out rows (`model_bands`, at least MODEL_ROWS):
  it keeps its rows in the fit, its rows stay out of the regime bands, and this band covers it. A model the fit explains has no band of its own: its
  held-out rows are already in its regime's band, and taking the wider of two bands measured
  on the same rows would count their spread twice.

An estimate's interval starts from its regime's band and widens by its distance from the fit
evidence (`uncertainty.widen`): a model or family no fit row has, a GPU and precision with
few rows, a micro-batch, tokens per expert or sequence beyond the fit rows' range
(`per_doubling` per doubling: the least value, at least PER_DOUBLING_FLOOR, that covers 80 % of
the leave-one-model-out rows lying beyond their fold's range, models missed as a whole aside).
Coverage is measured on rows none of whose bounds used them:
cross-conformal over K folds of the configuration split, per family under leave-one-model-out,
each model's band built from the other models' rows only, and under leave-one-release-out,
each release's bands from the other releases' rows. Evidence for the
named assumptions comes from the rows the fit saw, a model missed as a whole aside; the memory margin from the DeepSeek-V3
anatomy (worst part's relative error). Deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zlib
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from moeplan.cost_models import uncertainty as U
from moeplan.cost_models.calibration import default_calibration
from moeplan.fsio import write_json
from moeplan.validation import anatomy_parts, config_key, read_rows, validate_rows
from moeplan.validation.crossval import cases_of

K_FOLDS = 5
MODEL_ROWS = 5
PER_DOUBLING_GRID = [0.0, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3]
PROFILE = Path(__file__).resolve().parents[1] / "moeplan" / "cost_models" / "intervals.json"
CROSSVAL = Path(__file__).resolve().parent / "data" / "crossval.json"


def residual(r: dict[str, Any]) -> float:
    return math.log(r["published"] / r["predicted"])


def bands(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Conformal bounds of every regime name that has at least MIN_ROWS rows."""
    by: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        for k in r["regimes"]:
            by[k].append(residual(r))
    out = {}
    for k, res in sorted(by.items()):
        b = U.conformal_bounds(res) if len(res) >= U.MIN_ROWS else None
        if b:
            out[k] = {"q_lo": round(b[0], 5), "q_hi": round(b[1], 5), "rows": len(res)}
    return out


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    b = U.conformal_bounds([residual(r) for r in rows])
    return None if b is None else {"q_lo": round(b[0], 5), "q_hi": round(b[1], 5),
                                   "rows": len(rows)}


def model_bands(rows: list[dict[str, Any]], off: set[str]) -> dict[str, dict[str, Any]]:
    """The held-out band of each model in `off` (missed as a whole) with MODEL_ROWS rows."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["model"] in off and r["family"] != "gpt":  # GPTs at their own dimensions vary
            by[r["model"]].append(r)
    return {m: b for m, rs in sorted(by.items()) if len(rs) >= MODEL_ROWS
            and (b := pooled(rs)) is not None}


def model_evidence(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model, the held-out rows' published/predicted ratio where it is off as a whole
    (`uncertainty.off_as_a_whole`): a bias the fit leaves in one model's rows (a recipe's
    software, not the hardware); `estimate` names it for plans of that model."""
    by: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["family"] != "gpt":
            by[r["model"]].append(r["published"] / r["predicted"])
    return {m: {"rows": len(v), "median": round(sorted(v)[len(v) // 2], 3),
                "low": round(min(v), 3), "high": round(max(v), 3)}
            for m, v in sorted(by.items()) if U.off_as_a_whole(v)}


def split_evidence(rows: list[dict[str, Any]]) -> tuple[dict[str, list[str]],
                                                       dict[str, dict[str, Any]]]:
    """(validated, contradicted) evidence per assumption key from the rows the fit saw: the
    rows that rely on an effect validate it unless their median published/predicted ratio is
    off by `uncertainty.MODEL_RATIO` or more either way. Rows that use an effect and miss it
    say the effect may not deliver what it is priced at, so it keeps its pessimistic low end."""
    ids: dict[str, list[str]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        for k in r["assumption_keys"]:
            ids[k].append(r["id"])
            if r["published_tokens_per_s_per_gpu"] and r["predicted_tokens_per_s_per_gpu"]:
                ratios[k].append(r["published_tokens_per_s_per_gpu"]
                                 / r["predicted_tokens_per_s_per_gpu"])
    validated, contradicted = {}, {}
    for k, rs in ids.items():
        rt = sorted(ratios[k])
        if U.off_as_a_whole(rt, min_rows=1):
            contradicted[k] = {"rows": rs, "median": round(rt[len(rt) // 2], 3)}
        else:
            validated[k] = rs
    return validated, contradicted


def dimension_ranges(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each dimension's range over the rows (`uncertainty.DIMENSIONS`)."""
    by: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        for d, x in r["dims"].items():
            by[d].append(x)
    return {d: [min(v), max(v)] for d, v in sorted(by.items())}


def doublings(dims: dict[str, float], ranges: dict[str, list[float]]) -> float:
    out = 0.0
    for d, x in dims.items():
        if d in ranges and x > 0:
            out += math.log2(max(ranges[d][0] / x, x / ranges[d][1], 1.0))
    return out


def interval(r: dict[str, Any], q_lo: float, q_hi: float) -> list[float]:
    """The interval of a cross-validated row: its low end from its pessimistic prediction,
    scaled from the shipped profile's to the fold's point."""
    pess = r["predicted"] * r["pessimistic_ratio"]
    return [min(r["predicted"], pess) * math.exp(min(q_lo, 0.0)),
            r["predicted"] * math.exp(max(q_hi, 0.0))]


def covered(r: dict[str, Any], iv: list[float]) -> bool:
    return iv[0] <= r["published"] <= iv[1]


def width(r: dict[str, Any], iv: list[float]) -> float:
    return (iv[1] - iv[0]) / r["predicted"]


def median(v: list[float]) -> float:
    s = sorted(v)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def profile_doc(**parts: Any) -> dict[str, Any]:
    return {"_about": "80 % prediction intervals of moeplan (bench/fit_intervals.py): conformal "
            "bounds of cross-validated published runs per regime, widened by the distance "
            "from the fit evidence; assumption evidence from the rows the fit saw; "
            "memory-model error from the DeepSeek-V3 anatomy; models off as a whole.",
            "level": U.LEVEL, "min_rows": U.MIN_ROWS, **parts}


def enrich(cv_rows: list[dict[str, Any]], shipped: dict[str, dict[str, Any]],
           cases: dict[str, Any]) -> list[dict[str, Any]]:
    """Cross-validated rows with the regimes, pessimistic ratio, dimensions and "GPU/precision"
    of their case."""
    out = []
    for r in cv_rows:
        s = shipped.get(r["id"])
        if s is None or not s["predicted_tokens_per_s_per_gpu"]:
            continue
        c = cases[r["id"]]
        ratio = (s["pessimistic_tokens_per_s_per_gpu"] or s["predicted_tokens_per_s_per_gpu"]
                 ) / s["predicted_tokens_per_s_per_gpu"]
        out.append({**r, "regimes": s["regimes"], "pessimistic_ratio": ratio,
                    "dims": U.dimensions(c.model, c.training, c.layout),
                    "gpu_precision": f"{c.cluster.gpu}/{c.training.precision}"})
    return out


def lone_families(lomo: list[dict[str, Any]]) -> set[str]:
    """Families with a single model in the rows: leaving that model out leaves the family."""
    models: dict[str, set[str]] = defaultdict(set)
    for r in lomo:
        models[r["family"]].add(r["model"])
    return {f for f, ms in models.items() if len(ms) == 1}


def distance_parts(held: list[dict[str, Any]], lomo: list[dict[str, Any]],
                   per_doubling: float, off: set[str] = frozenset()) -> dict[str, Any]:
    """The profile's distance bands and ranges from the rows given (what `uncertainty.widen`
    reads): every held-out band, every unseen band, the fit rows' ranges and counts. The
    regime bands leave out the models in `off` (missed as a whole: their own band carries
    their error, which would otherwise widen every other model's interval)."""
    lone = lone_families(lomo)
    counts: dict[str, int] = defaultdict(int)
    for r in lomo:
        counts[r["gpu_precision"]] += 1
    return {"regimes": bands([r for r in held if r["model"] not in off]), "unseen": bands(lomo),
            "family_unseen": pooled([r for r in lomo if r["family"] in lone]),
            "model_bands": model_bands(held, set(off)),
            "seen_models": sorted({r["model"] for r in lomo if r["family"] != "gpt"}),
            "seen_families": sorted({r["family"] for r in lomo if r["family"] != "gpt"}),
            "ranges": dimension_ranges(lomo), "per_doubling": per_doubling,
            "gpu_precision_rows": dict(sorted(counts.items()))}


def fold_profile(held: list[dict[str, Any]], lomo: list[dict[str, Any]], per_doubling: float,
                 off: set[str] = frozenset()) -> U.IntervalProfile:
    """The interval profile a fold's rows alone would give (no memory margin, no assumption
    evidence): what each coverage measure builds for the rows it holds out."""
    return U.profile_from_dict(profile_doc(
        memory={"rel_error": 0.0, "evidence": ""}, evidence={},
        **distance_parts(held, lomo, per_doubling, off)))


def coverage_summary(hits: dict[str, list[bool]], widths: list[float]) -> dict[str, Any]:
    """Coverage and median width over every held-out row, and coverage per family."""
    allh = [h for v in hits.values() for h in v]
    return {"rows": len(allh), "coverage": round(sum(allh) / len(allh), 4),
            "median_width": round(median(widths), 4),
            "by_family": {k: {"rows": len(v), "coverage": round(sum(v) / len(v), 4)}
                          for k, v in sorted(hits.items())}}


def cv_interval(r: dict[str, Any], prof: U.IntervalProfile, model_seen: bool) -> list[float]:
    """A row's interval under a fold's profile, built exactly as `estimate` builds it
    (`uncertainty.widen` on the regime's band)."""
    steps = {d: math.log2(max(lo / x, x / hi, 1.0)) for d, x in r["dims"].items()
             if (rg := prof.ranges.get(d)) and x > 0 for lo, hi in [rg]}
    far = U.Distance(r["model"], model_seen, r["family"] in prof.seen_families,
                     {d: v for d, v in steps.items() if v > 0},
                     prof.gpu_precision_rows.get(r["gpu_precision"], 0))
    q_lo, q_hi, _, _ = prof.bounds(r["regimes"])
    q_lo, q_hi, _ = U.widen(q_lo, q_hi, r["regimes"], far, prof)
    return interval(r, q_lo, q_hi)


def lomo_coverage(held: list[dict[str, Any]], lomo: list[dict[str, Any]], per_doubling: float,
                  off: set[str] = frozenset()) -> dict[str, Any]:
    """Coverage under leave-one-model-out: each model's rows get the interval a profile built
    without that model's rows would give them (its held-out, unseen and family bands, ranges
    and counts all from the other models), as `estimate` would for a model no fit row has."""
    hits: dict[str, list[bool]] = defaultdict(list)
    widths: list[float] = []
    for model in sorted({r["model"] for r in lomo}):
        others = [r for r in lomo if r["model"] != model]
        prof = fold_profile([r for r in held if r["model"] != model], others, per_doubling,
                            off)
        for r in (r for r in lomo if r["model"] == model):
            iv = cv_interval(r, prof, model_seen=False)
            hits[r["family"]].append(covered(r, iv))
            widths.append(width(r, iv))
    return coverage_summary(hits, widths)


def release_coverage(held: list[dict[str, Any]], lomo: list[dict[str, Any]],
                     rel: list[dict[str, Any]], per_doubling: float,
                     off: set[str] = frozenset()) -> dict[str, Any]:
    """Coverage under leave-one-release-out, the nearest thing to runs of a release nobody
    fitted: each release's rows, predicted by a refit without that release, get the interval a
    profile built from the other releases' rows would give them (the model seen when another
    release has its rows)."""
    release = {r["id"]: r["group"] for r in rel}
    hits: dict[str, list[bool]] = defaultdict(list)
    widths: list[float] = []
    for g in sorted({r["group"] for r in rel}):
        others = [r for r in lomo if release.get(r["id"]) != g]
        prof = fold_profile([r for r in held if release.get(r["id"]) != g], others,
                            per_doubling, off)
        seen = {r["model"] for r in others}
        for r in (r for r in rel if r["group"] == g):
            iv = cv_interval(r, prof, model_seen=r["model"] in seen)
            hits[r["family"]].append(covered(r, iv))
            widths.append(width(r, iv))
    return coverage_summary(hits, widths)


PER_DOUBLING_FLOOR = 0.05
"""The least widening per doubling beyond the fit rows' range, whatever the rows measure: a
size no fit row has is territory no row has checked."""


def fit_per_doubling(held: list[dict[str, Any]], lomo: list[dict[str, Any]],
                     off: set[str] = frozenset()) -> tuple[float, int]:
    """The least widening per doubling (at least PER_DOUBLING_FLOOR) that covers LEVEL of the
    leave-one-model-out rows lying beyond their fold's range (their model's rows are not in
    the fold), with their count. Rows of the models in `off` (missed as a whole, whatever
    their size: their own band covers them) do not measure it."""
    folds = {}
    for model in sorted({r["model"] for r in lomo}):
        others = [r for r in lomo if r["model"] != model]
        folds[model] = fold_profile([r for r in held if r["model"] != model], others, 0.0, off)
    far = [r for r in lomo if r["model"] not in off
           and doublings(r["dims"], {d: list(v) for d, v in folds[r["model"]].ranges.items()}) > 0]
    if len(far) < U.MIN_ROWS:
        return 0.1, len(far)  # prior: a tenth of e per doubling (too few rows to measure)
    for k in (k for k in PER_DOUBLING_GRID if k >= PER_DOUBLING_FLOOR):
        hit = 0
        for r in far:

            prof = replace(folds[r["model"]], per_doubling=k)
            hit += covered(r, cv_interval(r, prof, model_seen=False))
        if hit >= U.LEVEL * len(far):
            return k, len(far)
    return PER_DOUBLING_GRID[-1], len(far)


def config_coverage(held: list[dict[str, Any]], lomo: list[dict[str, Any]],
                    by_id: dict[str, dict[str, str]], per_doubling: float,
                    off: set[str] = frozenset()) -> dict[str, Any]:
    """Cross-conformal coverage of the configuration split's held-out rows: K folds by
    configuration, each fold's bands built from the other folds' rows only, the model seen."""
    fold = {r["id"]: zlib.crc32(config_key(by_id[r["id"]]).encode()) % K_FOLDS for r in held}
    hits, widths, by_regime = [], [], defaultdict(list)
    for k in range(K_FOLDS):
        prof = fold_profile([r for r in held if fold[r["id"]] != k], lomo, per_doubling, off)
        for r in held:
            if fold[r["id"]] == k:
                iv = cv_interval(r, prof, model_seen=True)
                hits.append(covered(r, iv))
                widths.append(width(r, iv))
                by_regime[r["regimes"][2]].append(hits[-1])
    return {"folds": K_FOLDS, "rows": len(hits), "coverage": round(sum(hits) / len(hits), 4),
            "median_width": round(median(widths), 4),
            "by_regime": {k: {"rows": len(v), "coverage": round(sum(v) / len(v), 4)}
                          for k, v in sorted(by_regime.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?", default=None,
                    help="published-runs CSV (default: the shipped moeplan/validation/data copy)")
    ap.add_argument("--crossval", default=str(CROSSVAL))
    ap.add_argument("-o", "--out", default=str(PROFILE))
    args = ap.parse_args()
    raw = read_rows(args.csv)
    by_id = {r["id"]: r for r in raw}
    cv = json.loads(Path(args.crossval).read_text())
    cases = {c.id: c for c in cases_of(raw)}
    # 1. evidence from the rows the shipped profile saw, less the rows of a model the fit misses
    # as a whole (its own band carries its error; its miss says nothing of an effect other
    # models' rows rely on)
    # a model the shipped fit carries a measured residual for (Calibration.model_residual) was
    # missed as a whole before it: its rows keep a band of their own, as an off model's do, so
    # its spread (what the residual centres, not narrows) stays out of the regimes' bands
    residual = default_calibration().residual_models()
    off = set(model_evidence(cv["config"]["rows"])) | residual
    first = validate_rows(raw)
    seen = [r for r in first["rows"] if r["published_tokens_per_s_per_gpu"]
            and r["model"] not in off]
    evidence, contradicted = split_evidence(seen)
    parts = anatomy_parts()
    worst = max(parts, key=lambda k: abs(parts[k][0] / parts[k][1] - 1))
    err = abs(parts[worst][0] / parts[worst][1] - 1)
    memory = {"rel_error": round(err, 4),
              "evidence": f"DeepSeek-V3 anatomy (Megatron Core MoE report): worst part "
              f"'{worst}' off by {err:.1%}; parts " + ", ".join(
                  f"{k} {100 * (a / b - 1):+.1f}%" for k, (a, b) in parts.items())}
    # 2. re-predict with that evidence (the pessimistic low ends depend on it)
    out = Path(args.out)
    write_json(out, indent=1, data=profile_doc(regimes={}, memory=memory, evidence=evidence,
                                               contradicted=contradicted))
    U.default_profile.cache_clear()
    shipped = {r["id"]: r for r in validate_rows(raw)["rows"]}
    held = enrich(cv["config"]["rows"], shipped, cases)
    lomo = enrich(cv["model"]["rows"], shipped, cases)
    rel = enrich(cv["release"]["rows"], shipped, cases)
    # 3. the distance bands, the widening per doubling, and coverage on unseen rows
    models = model_evidence(held)
    own = set(models) | residual
    per_doubling, far_rows = fit_per_doubling(held, lomo, own)
    doc = profile_doc(
        memory=memory, evidence=evidence, contradicted=contradicted,
        models=models, **distance_parts(held, lomo, per_doubling, own),
        per_doubling_rows=far_rows,
        cross_validated=config_coverage(held, lomo, by_id, per_doubling, own),
        leave_one_model_out=lomo_coverage(held, lomo, per_doubling, own),
        leave_one_release_out=release_coverage(held, lomo, rel, per_doubling, own))
    # each yardstick's MAPE beside its coverage (what `moeplan validate` quotes as evidence)
    for key, by in (("leave_one_model_out", "model"), ("leave_one_release_out", "release"),
                    ("cross_validated", "config")):
        doc[key]["mape"] = round(cv[by]["mape"], 4)
    write_json(out, indent=1, data=doc)
    U.default_profile.cache_clear()
    lc, cc, rc = doc["leave_one_model_out"], doc["cross_validated"], doc["leave_one_release_out"]
    print(f"configuration split: coverage {cc['coverage']:.1%}, median width "
          f"{cc['median_width']:.1%} ({cc['rows']} rows); leave-one-model-out: coverage "
          f"{lc['coverage']:.1%}, median width {lc['median_width']:.1%} ({lc['rows']} rows); "
          f"leave-one-release-out: coverage {rc['coverage']:.1%}, median width "
          f"{rc['median_width']:.1%} ({rc['rows']} rows); "
          f"per doubling beyond the fit range {per_doubling} ({far_rows} rows); memory error "
          f"{err:.1%}; models off as a whole: {', '.join(doc['models']) or 'none'}; wrote {out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
