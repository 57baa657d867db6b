"""One cross-validation fold in a process of its own (`crossval.run_folds` with jobs > 1).

    python -m moeplan.validation.fold_worker ROWS.json BY GROUP REFIT TRAIN_SPLIT OUT.json

ROWS.json holds the CSV rows the parent read (`{"columns": [...], "rows": [[...], ...]}`, every
cell a string, as `validation.read_rows` gives them); the worker rebuilds their cases, refits
without GROUP's rows (`crossval.run_fold`) and writes the fold to OUT.json (strict JSON,
atomically). Parent and worker exchange JSON files only, never pickles. The worker dies with the
process that started it (Linux's parent-death signal), so an interrupted cross-validation
leaves nothing running.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from ..fsio import loads_json, read_regular, write_json
    from ..runtime.lifecycle import set_parent_death_signal
    from .crossval import PARENT_PID_ENV, ROWS_LIMIT_BYTES, cases_of, fold_document, run_fold
    from .fit import scored

    set_parent_death_signal(PARENT_PID_ENV)
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 6:
        print(__doc__, file=sys.stderr)
        return 2
    rows_path, by, group, refit, train_split, out = args
    doc = loads_json(read_regular(rows_path, ROWS_LIMIT_BYTES))
    rows = [dict(zip(doc["columns"], r, strict=True)) for r in doc["rows"]]
    fold = run_fold(scored(cases_of(rows)), by, group, refit,  # type: ignore[arg-type]
                    train_split=train_split)
    write_json(out, fold_document(fold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
