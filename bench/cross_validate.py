"""Leave-one-model-out, leave-one-release-out and configuration-split accuracy, full refit.

    python bench/cross_validate.py [CSV] [--by model,release,config] [--refit full|quick]
                                   [--jobs 2] [-o bench/data/crossval.json]

Each fold refits the calibration with the shipped profile's own procedure (`refit="full"`:
sweeps to convergence with the polish step, `moeplan.validation.fit.fit`) on every scored row
outside the fold, and predicts the fold's rows with that profile alone. `moeplan validate --cv`
runs the same folds with the quick refit (one sweep); `--refit quick` runs that here
(written to bench/data/crossval_quick.json unless -o says otherwise), so the two can be set side
by side. The JSON of the full refit is what
`bench/fit_intervals.py` (interval widths by distance from the fit) and
`bench/accuracy_report.py` (the headline) read.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from moeplan.fsio import write_json
from moeplan.validation import read_rows
from moeplan.validation.crossval import assemble, cases_of, folds_of, run_folds
from moeplan.validation.fit import scored

OUT = Path(__file__).resolve().parent / "data" / "crossval.json"


def run(csv: str | None, by: str, refit: str, jobs: int) -> dict[str, Any]:
    """The folds of `by`, `jobs` at a time in worker processes (`crossval.run_folds`: the
    same folds as one after another), and their rows and summary."""
    cases = scored(cases_of(read_rows(csv)))
    t0 = time.monotonic()
    folds = run_folds(cases, by, folds_of(cases, by), refit, jobs=jobs)  # type: ignore[arg-type]
    res = assemble(cases, by, refit, folds)  # type: ignore[arg-type]
    res["wall_seconds"] = round(time.monotonic() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?", default=None,
                    help="published-runs CSV (default: the shipped moeplan/validation/data copy)")
    ap.add_argument("--by", default="model,release,config")
    ap.add_argument("--jobs", type=int, default=1, help="folds refitted at once, each in a "
                    "worker process")
    ap.add_argument("--refit", choices=("full", "quick"), default="full")
    ap.add_argument("-o", "--out", default=None)
    args = ap.parse_args()
    out = args.out or str(OUT if args.refit == "full" else OUT.with_name("crossval_quick.json"))
    doc: dict[str, Any] = {"_about": "Cross-validated accuracy of moeplan's cost models "
                           f"(bench/cross_validate.py, {args.refit} refit): each fold refits "
                           "the calibration without its rows and predicts them."}
    for by in args.by.split(","):
        res = run(args.csv, by, args.refit, args.jobs)
        doc[by] = res
        print(f"leave-one-{by}-out ({args.refit} refit): MAPE {100 * res['mape']:.1f}% over "
              f"{res['count']} rows, median {100 * res['median_ape']:.1f}%, p90 "
              f"{100 * res['p90_ape']:.1f}%", file=sys.stderr)
    write_json(out, doc, indent=1)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
