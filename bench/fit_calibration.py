"""Fit the cost models' efficiency constants on every scored published run.

    python bench/fit_calibration.py [CSV] [-o moeplan/cost_models/calibration.json]

The shipped profile sees every row that publishes (or lets one derive) tokens/s/GPU, whatever
its model: a model the physics misses keeps its rows in the fit, and its interval must cover
it. No score of this profile on these rows is evidence; the honest figures are the
cross-validated ones (`bench/cross_validate.py`, `moeplan validate --cv`), whose folds run the
same procedure (`moeplan.validation.fit.fit`: objective, grid, coordinate descent, polish)
without the rows they predict: leave one model out, leave one release out, and the
configuration split's fit rows against its held-out rows. The same CSV always gives the same
profile.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moeplan.fsio import write_json
from moeplan.validation import read_rows
from moeplan.validation.crossval import cases_of
from moeplan.validation.fit import fit, scored, shipped_profile, stderr


def fit_cases(rows: list[dict[str, str]]) -> list:
    """The cases the shipped profile is fitted on: every scored row."""
    return scored(cases_of(rows))


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
             "bench/fit_calibration.py on every scored row of published_runs.csv "
             f"({res.rows} rows, objective {res.objective:.4f}: mean |log error| plus the "
             "ranking hinge over pairs of layouts of one release); its error on those rows "
             "is not evidence: the cross-validated figures are (bench/cross_validate.py).")
    write_json(args.out, shipped_profile(res, cases, about))  # strict, temp + fsync + rename
    stderr(f"wrote {args.out}")


if __name__ == "__main__":
    main()
