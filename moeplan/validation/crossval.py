"""Cross-validation by model and by release: the error on runs the fit never saw.

A split by configuration (`cases.split_of`) leaves other configurations of the same model and
release on the fit side, so it rewards fitting the table. Here whole groups are left out:

  model     every row of one model (all releases, GPUs and precisions); the GPTs that papers
            spell out by their dimensions count as one model
  release   every row of one software release (one Megatron-Bridge or NeMo container, one paper)
  config    the configuration split itself, as one fold: fit rows in, held-out rows out

For each group the calibration is refitted (`fit.fit`) on every other scored row, and that
profile predicts the group's rows. Nothing of the left-out group reaches its own prediction:
the profile a fold predicts with is built from the fold's fit alone (`fit.shipped_profile`),
never from the shipped calibration.

`refit` says how hard each fold searches. `full` is the shipped profile's own procedure
(sweeps to convergence with the polish step); `quick` stops after one sweep without the
polish, several times cheaper, for `moeplan validate --cv`. Both are reported under their
name; `bench/cross_validate.py` runs `full`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .cases import RunCase, split_of
from .fit import FitResult, fit, point, scored, shipped_profile
from .rows import release_of
from .scoring import cluster_of, family_groups, published_tokens

By = Literal["model", "release", "config"]
Refit = Literal["full", "quick"]
REFITS: dict[str, dict[str, Any]] = {"full": {"sweeps": 12, "polish": True},
                                     "quick": {"sweeps": 1, "polish": False}}
GPT_OWN_DIMENSIONS = "gpt (own dimensions)"


def model_group(case: RunCase) -> str:
    """The model a row ran: its preset, or one group for the GPTs papers spell out."""
    return GPT_OWN_DIMENSIONS if case.family == "gpt-dense" else case.model.name


def release_label(case: RunCase) -> str:
    """The software release a row ran: its source and container release (or its source alone,
    for a paper or a one-off table)."""
    src = (case.row.get("source") or "").strip()
    rel = release_of(case.row)
    return f"{src} {rel[0]}.{rel[1]:02d}" if rel else src


def family_group(case: RunCase) -> str:
    """The model family (deepseek, qwen3, llama3, gpt-oss, ...) a row's model belongs to; the
    GPTs papers spell out by their dimensions are the family "gpt"."""
    return "gpt" if case.family == "gpt-dense" else case.family


GROUPS: dict[str, Callable[[RunCase], str]] = {
    "model": model_group, "release": release_label,
    "config": lambda c: "held-out" if split_of(c.row) == "held-out" else "fit"}


@dataclass(frozen=True)
class Fold:
    group: str
    train_rows: int
    objective: float
    predictions: dict[str, float]  # case id -> predicted tokens/s/GPU


WORKER_MODULE = "moeplan.validation.fold_worker"
"""What `run_folds` runs each fold in when it runs several at once (`python -m`)."""
PARENT_PID_ENV = "MOEPLAN_CV_PARENT_PID"
"""The pid of the process that started a fold worker: the worker exits at once when its parent
is already gone, and dies with it otherwise (`runtime.lifecycle.set_parent_death_signal`)."""
ROWS_LIMIT_BYTES = 64 * 1024 * 1024
"""Bound on the rows and fold files a worker and its parent read: the rows come from a CSV of at
most `limits.MAX_FILE_BYTES` (8 MiB), and JSON's quoting cannot grow that eightfold."""


def fold_document(fold: Fold) -> dict[str, Any]:
    """A fold as the JSON a worker hands back (`fold_of_document` reads it)."""
    return {"group": fold.group, "train_rows": fold.train_rows, "objective": fold.objective,
            "predictions": dict(fold.predictions)}


def fold_of_document(doc: dict[str, Any]) -> Fold:
    """The fold a worker's JSON describes (`fold_document` writes it)."""
    return Fold(str(doc["group"]), int(doc["train_rows"]), float(doc["objective"]),
                {str(k): float(v) for k, v in doc["predictions"].items()})


def run_fold(cases: Sequence[RunCase], by: By, group: str, refit: Refit = "full",
             log: Callable[[str], None] | None = None, train_split: str = "all") -> Fold:
    """Refit without `group`'s rows and predict them; `train_split` "fit" keeps only the
    configuration split's fit rows on the training side (the shipped profile's rows)."""
    key = GROUPS[by]
    train = [c for c in cases if key(c) != group
             and (train_split == "all" or split_of(c.row) == "fit")]
    test = [c for c in cases if key(c) == group]
    res: FitResult = fit(train, log=log, **REFITS[refit])
    profile = shipped_profile(res, train, "")
    profile.pop("_about")
    preds = {c.id: q for c in test if (q := point(c, profile)) is not None}
    return Fold(group, res.rows, res.objective, preds)


def folds_of(cases: Sequence[RunCase], by: By) -> list[str]:
    """The groups a cross-validation leaves out, one fold each (`config`: the held-out one)."""
    if by == "config":
        return ["held-out"]
    return sorted({GROUPS[by](c) for c in scored(cases)})


def cross_validate(cases: Sequence[RunCase], by: By, refit: Refit = "full",
                   log: Callable[[str], None] | None = None, train_split: str = "all",
                   jobs: int = 1) -> dict[str, Any]:
    """Every fold of `by`, and the scored rows each predicted: {"by", "refit", "folds",
    "rows": [{"id", "group", "family", "model", "gpu", "gpu_family", "precision", "published",
    "predicted", "error"}], and the summary of `summarise`. `jobs`: folds run at once, each in
    a process of its own (`run_folds`); the result does not depend on it."""
    cases = scored(cases)
    folds = run_folds(cases, by, folds_of(cases, by), refit, log, train_split, jobs)
    return assemble(cases, by, refit, folds)


def run_folds(cases: Sequence[RunCase], by: By, groups: Sequence[str], refit: Refit = "full",
              log: Callable[[str], None] | None = None, train_split: str = "all",
              jobs: int = 1) -> list[Fold]:
    """The fold of each of `groups`, in their order: one after another in this process, or,
    with `jobs` > 1, up to `jobs` at a time in worker processes (`fold_worker`).

    A fold's refit is a pure function of its training rows, so where it runs changes nothing
    but the wall time: the workers rebuild the cases from the same CSV rows (`cases_of` of
    each case's `row`, written once as JSON) and hand their fold back as JSON, never as a
    pickle. A worker that fails stops the rest, and no worker outlives this call: an error or
    an interrupt kills the ones still running, and each dies with this process if it is killed
    outright."""
    if jobs <= 1 or len(groups) <= 1:
        out = []
        for k, g in enumerate(groups, 1):
            if log:
                log(f"fold {g} ({k} of {len(groups)})")
            out.append(run_fold(cases, by, g, refit, log, train_split))
        return out
    return _worker_folds(cases, by, groups, refit, log, train_split, jobs)


def _worker_folds(cases: Sequence[RunCase], by: By, groups: Sequence[str], refit: Refit,
                  log: Callable[[str], None] | None, train_split: str, jobs: int
                  ) -> list[Fold]:
    import os
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from ..fsio import loads_json, read_regular, write_json

    columns = list(dict.fromkeys(k for c in cases for k in c.row))
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(filter(None, (package_root,
                                                        os.environ.get("PYTHONPATH"))))}
    done: dict[int, Fold] = {}
    running: dict[int, tuple[subprocess.Popen, Path]] = {}
    with tempfile.TemporaryDirectory(prefix="moeplan-cv-") as tmp:
        rows = Path(tmp) / "rows.json"
        write_json(rows, {"columns": columns,
                          "rows": [[c.row.get(k, "") for k in columns] for c in cases]}, None)
        pending = list(enumerate(groups))
        try:
            while pending or running:
                while pending and len(running) < jobs:
                    i, g = pending.pop(0)
                    if log:
                        log(f"fold {g} ({i + 1} of {len(groups)}, {len(running) + 1} running)")
                    with (Path(tmp) / f"fold-{i}.err").open("xb") as err:
                        proc = subprocess.Popen(
                            [sys.executable, "-m", WORKER_MODULE, str(rows),
                             by, g, refit, train_split, str(Path(tmp) / f"fold-{i}.json")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                            env=env)
                    running[i] = (proc, Path(tmp) / f"fold-{i}.err")
                for i, (proc, err_path) in list(running.items()):
                    code = proc.poll()
                    if code is None:
                        continue
                    del running[i]
                    if code != 0:
                        tail = err_path.read_text(errors="replace").strip()[-2000:]
                        raise RuntimeError(f"cross-validation fold {groups[i]!r} failed in its "
                                           f"worker process (exit {code}): {tail}")
                    doc = loads_json(read_regular(Path(tmp) / f"fold-{i}.json",
                                                  ROWS_LIMIT_BYTES))
                    done[i] = fold_of_document(doc)
                if running:
                    time.sleep(0.05)
        finally:
            for proc, _ in running.values():
                proc.kill()
                proc.wait()
    return [done[i] for i in range(len(groups))]


def assemble(cases: Sequence[RunCase], by: By, refit: Refit, folds: Sequence[Fold]
             ) -> dict[str, Any]:
    """The rows and summary of a set of folds (the folds may have been run apart)."""
    from ..cost_models.uncertainty import generation

    pred = {i: (f.group, q) for f in folds for i, q in f.predictions.items()}
    rows = []
    for c in scored(cases):
        if c.id not in pred:
            continue
        pub = published_tokens(c)[0]
        group, q = pred[c.id]
        rows.append({"id": c.id, "group": group, "family": family_group(c),
                     "model": model_group(c), "gpu": c.gpu,
                     "gpu_family": generation(cluster_of(c)), "precision": c.training.precision,
                     "published": pub, "predicted": q, "error": q / pub - 1})
    return {"by": by, "refit": refit,
            "folds": [{"group": f.group, "train_rows": f.train_rows,
                       "objective": round(f.objective, 5)} for f in folds],
            "rows": rows, **summarise(rows)}


def _mape(rows: Sequence[dict[str, Any]]) -> float | None:
    return sum(abs(r["error"]) for r in rows) / len(rows) if rows else None


def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """MAPE over all rows, the median and 90th-percentile absolute error, and per family and
    per model: rows, MAPE and mean signed error (a family missed one way shows as a bias); and
    the model × GPU-family groups of two or more rows, those off as a whole marked
    (`scoring.family_groups`)."""
    def per(key: str) -> dict[str, dict[str, Any]]:
        by: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            by[r[key]].append(r)
        return {k: {"rows": len(v), "mape": _mape(v),
                    "bias": sum(r["error"] for r in v) / len(v)} for k, v in sorted(by.items())}

    errs = sorted(abs(r["error"]) for r in rows)
    q = (lambda p: errs[min(len(errs) - 1, math.ceil(p * len(errs)) - 1)]) if errs else None
    return {"mape": _mape(rows), "count": len(rows),
            "median_ape": q(0.5) if q else None, "p90_ape": q(0.9) if q else None,
            "by_family": per("family"), "by_model": per("model"),
            "model_gpu_groups": family_groups(rows, lambda r: r["error"])}


CLI_CHOICES = ("model", "release")
"""What `moeplan validate --cv` leaves out (the configuration fold is the plain `validate`)."""


def cases_of(rows: Sequence[dict[str, str]]) -> list[RunCase]:
    """The predictable cases of CSV rows (`cases.case_of`), skipping the rest."""
    from ..specs import list_presets
    from .cases import case_of

    presets = list_presets()
    return [c for r in rows for c in [case_of(r, presets)] if not isinstance(c, str)]


def cross_validate_rows(rows: Sequence[dict[str, str]], by: By, refit: Refit = "quick",
                        log: Callable[[str], None] | None = None, jobs: int = 1
                        ) -> dict[str, Any]:
    """`cross_validate` of a CSV's rows (what `moeplan validate --cv` prints). Refused
    (SpecError) when its scored rows hold fewer than two groups of `by`: leaving the one out
    leaves no row to refit on, and the fold would be "refitted" on nothing."""
    from ..errors import SpecError

    cases = cases_of(rows)
    groups = folds_of(scored(cases), by)
    if by != "config" and not groups:
        raise SpecError(f"--cv {by}: no row of the CSV can be scored (none has a published "
                        "tokens/s or TFLOPS figure with a layout moeplan prices), so there is "
                        "nothing to cross-validate; `moeplan validate` without --cv says why "
                        "each row is skipped.")
    if by != "config" and len(groups) < 2:
        raise SpecError(f"--cv {by}: the CSV's scored rows hold one {by} ({groups[0]}), and "
                        "leaving it out leaves no row to refit the calibration on. Give a CSV "
                        f"with runs of two or more {by}s, or run `moeplan validate` without "
                        "--cv for the shipped profile's error on these rows.")
    return cross_validate(cases, by, refit, log, jobs=jobs)
