"""Fit the cost models' efficiency constants on the fit rows of the published runs.

    python bench/fit_calibration.py [CSV] [-o moeplan/cost_models/calibration.json]

Only rows whose configuration split (`moeplan.validation.split_of`) is `fit` are used; held-out
rows are never read by the objective. Every fit row stays in, whatever its model: a model the
physics misses keeps its rows in the fit, and its interval must cover it. The procedure
(objective, grid, coordinate descent, polish) is `moeplan.validation.fit.fit`, the same one
every cross-validation fold runs (`bench/cross_validate.py`). The same CSV always gives the
same profile.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moeplan.fsio import write_json
from moeplan.validation import read_rows, split_of
from moeplan.validation.crossval import cases_of
from moeplan.validation.fit import fit, shipped_profile, stderr


def fit_cases(rows: list[dict[str, str]]) -> list:
    """The cases the shipped profile is fitted on: the configuration split's fit rows."""
    return [c for c in cases_of(rows) if split_of(c.row) == "fit"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?", default=None,
                    help="published-runs CSV (default: the shipped moeplan/validation/data copy)")
    ap.add_argument("-o", "--out", default=str(Path(__file__).resolve().parents[1] / "moeplan"
                                               / "cost_models" / "calibration.json"))
    ap.add_argument("--sweeps", type=int, default=12)
    args = ap.parse_args()
    cases = fit_cases(read_rows(args.csv))
    res = fit(cases, args.sweeps, log=stderr)
    about = ("Efficiency constants of the moeplan cost models, fitted by "
             "bench/fit_calibration.py on the fit rows of published_runs.csv "
             f"({res.rows} rows, objective {res.objective:.4f}: mean |log error| plus the "
             "ranking hinge over pairs of fit rows); held-out rows are not used.")
    write_json(args.out, shipped_profile(res, cases, about))  # strict, temp + fsync + rename
    stderr(f"wrote {args.out}")


if __name__ == "__main__":
    main()
