"""Fit the 80 % prediction intervals and the memory margin (moeplan/cost_models/intervals.json).

    python bench/fit_intervals.py DATA/published_runs.csv [-o moeplan/cost_models/intervals.json]

Split conformal (see moeplan.cost_models.uncertainty): the constants were fitted on the fit rows
only, so the held-out rows' log-residuals log(published / predicted) tokens/s/GPU are honest
samples of the model's error. Per regime (most specific first, backing off while a regime has
fewer than MIN_ROWS held-out rows) the conformal 10 % / 90 % bounds are taken over all held-out
rows; that is what ships. How well such bounds cover rows they never saw is measured by
cross-conformal evaluation: the held-out rows are cut into K folds by configuration, each
fold's intervals are built from the other folds' residuals only, and coverage and median width
are counted over all folds. Evidence for the named assumptions comes from the fit rows; the
memory margin from the DeepSeek-V3 anatomy (worst part's relative error). Deterministic.
"""

from __future__ import annotations

import argparse
import math
import sys
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

from moeplan.cost_models import uncertainty as U
from moeplan.fsio import write_json
from moeplan.validation import (
    anatomy_parts,
    config_key,
    inside,
    median_width,
    read_rows,
    validate_rows,
)

K_FOLDS = 5
PROFILE = Path(__file__).resolve().parents[1] / "moeplan" / "cost_models" / "intervals.json"


def regime_bounds(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Conformal bounds of every regime name that has at least MIN_ROWS rows."""
    by: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        res = math.log(r["published_tokens_per_s_per_gpu"] / r["predicted_tokens_per_s_per_gpu"])
        for k in r["regimes"]:
            by[k].append(res)
    out = {}
    for k, res in sorted(by.items()):
        b = U.conformal_bounds(res) if len(res) >= U.MIN_ROWS else None
        if b:
            out[k] = {"q_lo": round(b[0], 5), "q_hi": round(b[1], 5), "rows": len(res)}
    return out


def model_evidence(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model preset, the fit rows' published/predicted ratio where it is off as a whole
    (`uncertainty.off_as_a_whole`: enough rows, a median beyond `uncertainty.MODEL_RATIO`). A
    bias the fit leaves in one model's rows is one the constants could not take up without
    hurting the others (a recipe's software, not the hardware); `estimate` names it for plans
    of that model."""
    by_model: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["split"] == "fit" and r["family"] != "gpt-dense":
            by_model[r["model"]].append(r["published_tokens_per_s_per_gpu"]
                                        / r["predicted_tokens_per_s_per_gpu"])
    out = {}
    for name, ratios in sorted(by_model.items()):
        med = sorted(ratios)[len(ratios) // 2]
        if U.off_as_a_whole(ratios):
            out[name] = {"rows": len(ratios), "median": round(med, 3),
                         "low": round(min(ratios), 3), "high": round(max(ratios), 3)}
    return out


def split_evidence(rows: list[dict[str, Any]]) -> tuple[dict[str, list[str]],
                                                       dict[str, dict[str, Any]]]:
    """(validated, contradicted) evidence per assumption key from the fit rows: the fit rows
    that rely on an effect validate it unless their median published/predicted ratio is off
    by `uncertainty.MODEL_RATIO` or more either way, the threshold a model is "off as a whole" at. Rows that
    use an effect and miss it say the effect may not deliver what it is priced at, so it keeps
    its pessimistic low end."""
    ids: dict[str, list[str]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if r["split"] != "fit":
            continue
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


def profile_doc(regimes: dict, evidence: dict, memory: dict, cv: dict,
                models: dict | None = None, contradicted: dict | None = None
                ) -> dict[str, Any]:
    return {"_about": "80 % prediction intervals of moeplan (bench/fit_intervals.py): conformal "
            "bounds of held-out published runs per regime, assumption evidence from fit rows, "
            "memory-model error from the DeepSeek-V3 anatomy, models whose fit rows are off "
            "as a whole.",
            "level": U.LEVEL, "min_rows": U.MIN_ROWS, "regimes": regimes, "memory": memory,
            "evidence": evidence, "contradicted": contradicted or {}, "cross_validated": cv,
            "models": models or {}}


def scored(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["published_tokens_per_s_per_gpu"]
            and r["predicted_tokens_per_s_per_gpu"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?", default=None,
                    help="published-runs CSV (default: the shipped moeplan/validation/data copy)")
    ap.add_argument("-o", "--out", default=str(PROFILE))
    args = ap.parse_args()
    raw = read_rows(args.csv)
    by_id = {r["id"]: r for r in raw}
    # 1. evidence from the fit rows (what each fit row's layout relies on)
    first = validate_rows(raw)
    evidence, contradicted = split_evidence(first["rows"])
    parts = anatomy_parts()
    worst = max(parts, key=lambda k: abs(parts[k][0] / parts[k][1] - 1))
    err = abs(parts[worst][0] / parts[worst][1] - 1)
    memory = {"rel_error": round(err, 4),
              "evidence": f"DeepSeek-V3 anatomy (Megatron Core MoE report): worst part "
              f"'{worst}' off by {err:.1%}; parts " + ", ".join(
                  f"{k} {100 * (a / b - 1):+.1f}%" for k, (a, b) in parts.items())}
    # 2. re-predict with that evidence (the pessimistic low ends depend on it)
    out = Path(args.out)
    write_json(out, indent=1, data=profile_doc({}, dict(evidence), memory, {}, None, contradicted))
    U.default_profile.cache_clear()
    rows = scored(validate_rows(raw)["rows"])
    held = [r for r in rows if r["split"] == "held-out"]
    # 3. cross-conformal coverage on held-out rows never used for their own bounds
    fold = {r["id"]: zlib.crc32(config_key(by_id[r["id"]]).encode()) % K_FOLDS for r in held}
    cv_rows = []
    for k in range(K_FOLDS):
        train = [r for r in held if fold[r["id"]] != k]
        prof = U.profile_from_dict(profile_doc(regime_bounds(train), evidence, memory, {}, None,
                                               contradicted))
        for r in held:
            if fold[r["id"]] == k:
                lo, hi, regime, _ = U.tokens_interval(
                    r["predicted_tokens_per_s_per_gpu"], r["pessimistic_tokens_per_s_per_gpu"],
                    r["regimes"], prof)
                cv_rows.append({**r, "predicted_interval_tokens_per_s_per_gpu": [lo, hi],
                                "cv_regime": regime})
    hits = [inside(r) for r in cv_rows]
    by_regime: dict[str, list[bool]] = defaultdict(list)
    for r, h in zip(cv_rows, hits, strict=True):
        by_regime[r["regimes"][2]].append(bool(h))  # generation/kind
    cv = {"folds": K_FOLDS, "rows": len(cv_rows),
          "coverage": round(sum(hits) / len(hits), 4),
          "median_width": round(median_width(cv_rows), 4),
          "by_regime": {k: {"rows": len(v), "coverage": round(sum(v) / len(v), 4)}
                        for k, v in sorted(by_regime.items())}}
    regimes = regime_bounds(held)
    models = model_evidence(rows)
    write_json(out, indent=1, data=profile_doc(regimes, dict(evidence), memory, cv, models, contradicted))
    U.default_profile.cache_clear()
    print(f"held-out rows {len(held)}; cross-validated coverage {cv['coverage']:.1%}, median "
          f"width {cv['median_width']:.1%}; {len(regimes)} regimes; memory error "
          f"{err:.1%}; models off as a whole: {', '.join(models) or 'none'}; effects their "
          f"fit rows contradict: {', '.join(contradicted) or 'none'}; wrote {out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
