"""Reading published runs: the CSV, its cells, and the shipped copy of the data.

A published-runs CSV is shaped like `data/published_runs.csv` (columns in `data/README.md`).
Cells are read here, bounded before any spec is built: a size (GPUs, sequence, batch, a
parallel degree) is a whole number within moeplan's limits, a measurement a finite positive
number, an empty cell "not published"; a file holds at most MAX_CSV_ROWS rows. Anything else is
a SpecError naming the row and column.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import re
from importlib import resources
from pathlib import Path

from ..errors import SpecError
from ..limits import (
    MAX_CSV_ROWS,
    MAX_GLOBAL_BATCH,
    MAX_GPUS,
    MAX_MEASURE,
    MAX_SEQ_LEN,
    MIN_MEASURE,
    excerpt,
)

PUBLISHED_RUNS = "published_runs.csv"
"""The published measured runs shipped with moeplan (`data/README.md` gives their sources)."""

RELEASE_PAT = re.compile(r"release (\d+)\.(\d+)")
_INT_LIMITS = {"seq_len": MAX_SEQ_LEN, "global_batch_seqs": MAX_GLOBAL_BATCH,
               "micro_batch": MAX_GLOBAL_BATCH}


def shipped_runs() -> Path:
    """Path of the shipped published-runs CSV (package data, so a clone or a wheel has it)."""
    return Path(str(resources.files("moeplan.validation") / "data" / PUBLISHED_RUNS))


def cell(row: dict[str, str], col: str) -> str:
    """A cell's text, stripped (empty where the row is short)."""
    return (row.get(col) or "").strip()


def bad_cell(row: dict[str, str], col: str, want: str) -> SpecError:
    return SpecError(f"row {excerpt(row.get('id', '?'))}, column `{col}`: "
                     f"{excerpt(cell(row, col))} is not {want}; fix the cell or leave it empty "
                     "(unpublished).")


def number(row: dict[str, str], col: str) -> float | None:
    """A published measurement: empty (None) or a number from MIN_MEASURE to MAX_MEASURE, else
    SpecError. A 0 is refused, not read as unpublished: no run measured nothing, and taking it
    for an empty cell would move the row from the fit rows to the held-out ones unsaid."""
    v = cell(row, col)
    if not v:
        return None
    try:
        x = float(v)
    except ValueError:
        raise bad_cell(row, col, "a number") from None
    if not math.isfinite(x) or x < 0:
        raise bad_cell(row, col, "a finite positive number")
    if not MIN_MEASURE <= x <= MAX_MEASURE:  # 1e-308 would overflow every ratio
        raise bad_cell(row, col, f"a measurement from {MIN_MEASURE:g} to {MAX_MEASURE:g} (or "
                                 "empty)")
    return x


def size(row: dict[str, str], col: str, default: int | None = None) -> int | None:
    """A size (GPUs, seq, batch, parallel degree): empty (`default`) or a whole number in
    1..limit, else SpecError naming the row and column, before any spec is built."""
    v = cell(row, col)
    if not v:
        return default
    try:
        x = float(v)
    except ValueError:
        raise bad_cell(row, col, "a whole number") from None
    if not math.isfinite(x) or x != int(x) or x < 1:
        raise bad_cell(row, col, "a positive whole number")
    n, limit = int(x), _INT_LIMITS.get(col, MAX_GPUS)
    if n > limit:
        raise bad_cell(row, col, f"at most {limit:,} (moeplan's limit)")
    return n


def release_of(row: dict[str, str]) -> tuple[int, int] | None:
    """The (year, month) of the container release a row names in its source detail, if any."""
    m = RELEASE_PAT.search(row.get("source_detail", "") or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def read_rows(path: str | Path | None = None) -> list[dict[str, str]]:
    """The CSV's rows as dicts (the shipped published runs when `path` is None); SpecError for
    a missing, oversized, non-UTF-8 or malformed file (cells are checked per row, in
    `cases.case_of`)."""
    from ..fsio import is_file
    from ..specs.loader import read_text

    p = shipped_runs() if path is None else Path(path)
    if not is_file(p):
        raise SpecError(f"{excerpt(str(path))} is not a readable CSV file. Pass a file shaped "
                        "like published_runs.csv.")
    text = read_text(p, "CSV file").removeprefix("\ufeff")  # a UTF-8 BOM, as Excel saves
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
        header = reader.fieldnames or []
        twice = next((c for i, c in enumerate(header) if c in header[:i]), None)
        if twice is not None:  # DictReader would keep the last column's cells silently
            raise SpecError(f"{p}: the column `{excerpt(twice)}` appears twice in the header; "
                            "give each column once.")
        rows = list(itertools.islice(reader, MAX_CSV_ROWS + 1))
    except csv.Error as err:
        raise SpecError(f"{p} is not a valid CSV file ({err}); fix the file.") from None
    if len(rows) > MAX_CSV_ROWS:  # each row is priced at every layout it may have run
        raise SpecError(f"{p} holds more than {MAX_CSV_ROWS:,} rows, moeplan's limit for a CSV "
                        "of runs; split it into files of at most that many rows and validate "
                        "each.")
    if not rows:
        raise SpecError(f"{p} holds no rows (an empty file, or a header alone); give a CSV "
                        "shaped like published_runs.csv, one published run per row.")
    missing = [" or ".join(f"`{c}`" for c in any_of) for any_of in REQUIRED_COLUMNS
               if not any(c in header for c in any_of)]
    if missing:
        raise SpecError(f"{p}: no {', '.join(missing)} column; the CSV must have the columns "
                        "of published_runs.csv (id, model_preset, cluster_preset, num_gpus, "
                        "seq_len, global_batch_seqs, tp, pp, ..., a published figure).")
    from ..specs.validated import unprintable

    for r in rows:  # the cells `validate` prints as they are
        for col in PRINTED_COLUMNS:
            bad = unprintable(r.get(col) or "")
            if bad is not None:
                raise SpecError(f"{p}: row {excerpt(r.get('id'))}, column `{col}` holds a "
                                f"control or formatting character ({bad}); fix the cell.")
    seen: set[str] = set()
    for r in rows:  # a row is named by its id in every table, skip reason and fold
        rid = (r.get("id") or "").strip()
        if rid and rid in seen:
            raise SpecError(f"{p}: the id {excerpt(rid)} names two rows; give each row its "
                            "own id (validate reports, skips and cross-validates rows by it).")
        seen.add(rid)
    long = next((r for r in rows if None in r), None)
    if long is not None:  # DictReader files the extra cells under None, read by no one
        raise SpecError(f"{p}: row {excerpt(long.get('id'))} has more cells than the header "
                        "has columns; quote cells that hold commas, or fix the row.")
    return rows


PRINTED_COLUMNS = ("id", "gpu", "model")
"""Cells `moeplan validate` prints in its table as they are: no terminal escape may hide in
one."""
REQUIRED_COLUMNS = (("id",), ("model_preset", "model"), ("cluster_preset", "gpu"),
                    ("num_gpus",), ("seq_len",), ("global_batch_seqs",), ("tp",), ("pp",),
                    ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu"))
"""Columns a CSV of runs must have (each tuple: one of them): without one, every row would be
skipped or priced at a default, and the command would still exit 0."""
