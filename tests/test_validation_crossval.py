"""Cross-validation by model and by release (`moeplan validate --cv`): a left-out group is
predicted by a calibration that never saw it, and the command reports per family."""

import json
import re
import subprocess
import sys

import pytest

from moeplan.cli import main
from moeplan.validation import read_rows
from moeplan.validation.crossval import cases_of, cross_validate_rows, release_label

MODELS = ("llama3-8b", "mixtral-8x7b", "qwen3-30b-a3b")


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    """Two predictable published rows of each of three models (small: every fold refits)."""
    shipped = [r for r in read_rows() if r["model_preset"] in MODELS]
    ok = {c.id for c in cases_of(shipped) if c.published_tokens}
    out = []
    for m in MODELS:
        out += [r for r in shipped if r["model_preset"] == m and r["id"] in ok][:2]
    assert len(out) == 6
    return out


@pytest.fixture
def runs_csv(rows, tmp_path):
    """The fixture's rows as a CSV file, what `moeplan validate RUNS.csv --cv` reads."""
    import csv

    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def _preds(res: dict) -> dict[str, float]:
    return {r["id"]: r["predicted"] for r in res["rows"]}


def test_a_left_out_model_is_predicted_without_its_own_published_figures(rows):
    """Tripling one model's published throughput leaves its own cross-validated predictions
    exactly as they were (its fold never reads them) and moves the other models' (theirs do)."""
    before = cross_validate_rows(rows, "model")
    doctored = [{**r, "tokens_per_s_per_gpu": str(3 * float(r["tokens_per_s_per_gpu"]))}
                if r["model_preset"] == "mixtral-8x7b" else r for r in rows]
    after = cross_validate_rows(doctored, "model")
    a, b = _preds(before), _preds(after)
    mixtral = {r["id"] for r in rows if r["model_preset"] == "mixtral-8x7b"}
    assert all(a[i] == b[i] for i in mixtral)
    assert any(a[i] != b[i] for i in a if i not in mixtral)
    assert {f["group"] for f in before["folds"]} == set(MODELS)


def test_bridge_releases_are_separate_folds():
    by_label = {release_label(c) for c in cases_of(read_rows())
                if c.row["source"].startswith("NVIDIA Megatron-Bridge")}
    assert {"NVIDIA Megatron-Bridge performance summary 25.09",
            "NVIDIA Megatron-Bridge performance summary 26.06"} <= by_label


def test_validate_cv_reports_every_row_once_with_per_family_errors(rows, runs_csv, capsys):
    assert main(["validate", str(runs_csv), "--cv", "model", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["by"] == "model" and doc["refit"] == "quick"
    assert sorted(r["id"] for r in doc["rows"]) == sorted(r["id"] for r in rows)
    assert set(doc["by_family"]) == {"llama3", "mixtral", "qwen3"}
    errs = [abs(r["predicted"] / r["published"] - 1) for r in doc["rows"]]
    assert doc["mape"] == pytest.approx(sum(errs) / len(errs))
    # each model on each GPU family with two or more rows, its mean error, off beyond ±30%
    by: dict[tuple[str, str], list[float]] = {}
    for r in doc["rows"]:
        by.setdefault((r["model"], r["gpu_family"]), []).append(r["error"])
    want = {k: sum(v) / len(v) for k, v in by.items() if len(v) >= 2}
    got = {(g["model"], g["gpu_family"]): g for g in doc["model_gpu_groups"]}
    assert set(got) == set(want) and want
    for k, mean in want.items():
        assert got[k]["mean_error"] == pytest.approx(mean)
        assert got[k]["off"] == (abs(mean) > 0.30)


def test_validate_cv_refuses_an_unknown_grouping(capsys):
    assert main(["validate", "--cv", "gpu"]) == 2
    assert "--cv" in capsys.readouterr().err


def test_validate_cv_fits_an_80_column_terminal_with_every_figure_whole(runs_csv):
    from .test_cli_terminal import assert_fits_and_whole, json_of, render_in_pty

    args = ("validate", str(runs_csv), "--cv", "model")
    doc = json_of(args)
    nums = [f"{v['mape']:.1%}" for v in doc["by_family"].values()]
    nums += [f"{v['bias']:+.1%}" for v in doc["by_family"].values()] + [f"{doc['mape']:.1%}"]
    assert_fits_and_whole(render_in_pty(args, 80), 80, nums)


def test_validate_of_one_run_counts_it_in_the_singular_and_refuses_to_leave_its_model_out(
        rows, tmp_path):
    """One run: "1 row", never "1 rows"; and leaving its only model out would refit on no row
    at all (the title said "refitted" over a fit of 0 rows): exit 2, naming the model."""
    import csv

    from .test_cli_terminal import render_in_pty

    path = tmp_path / "one.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerow(rows[0])
    plain = " ".join(render_in_pty(("validate", str(path)), 80).split())
    assert "validated: 100% (1 row: 1 predicted, 0 skipped)" in plain, plain
    assert not re.search(r"\b1 (runs|folds|rows)\b", plain), plain
    r = subprocess.run([sys.executable, "-m", "moeplan", "validate", str(path), "--cv", "model"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    said = " ".join(r.stderr.split())
    assert "--cv model: the CSV's scored rows hold one model (" in said, said
    assert "no row to refit" in said and "two or more models" in said, said


def test_the_fit_keeps_the_grace_launch_time_at_or_above_the_x86_one():
    """Physics the fit may not trade away (`fit.ORDERED`): a move of either launch time that
    would put Grace below x86 drags the other along."""
    from moeplan.validation.fit import ORDERED, get_key, keep_order, set_key

    assert ("launch_us.x86", "launch_us.grace") in ORDERED
    over = {"launch_us": {"x86": 20.0, "grace": 30.0}}
    set_key(over, "launch_us.grace", 10.0)
    assert keep_order(over, "launch_us.grace")
    assert get_key(over, "launch_us.x86") == 10.0
    set_key(over, "launch_us.x86", 25.0)
    assert keep_order(over, "launch_us.x86") and get_key(over, "launch_us.grace") == 25.0
    set_key(over, "launch_us.grace", 35.0)
    assert not keep_order(over, "launch_us.grace")
    assert (get_key(over, "launch_us.x86"), get_key(over, "launch_us.grace")) == (25.0, 35.0)


def test_folds_refitted_in_worker_processes_equal_the_folds_of_one_process(rows):
    """`--jobs` changes where the folds run, never what they predict: every fold's refit, its
    objective and each left-out row's prediction come back bit for bit through JSON."""
    one = cross_validate_rows(rows, "model")
    three = cross_validate_rows(rows, "model", jobs=3)
    assert three == one
    assert len(one["folds"]) == 3


def test_validate_cv_jobs_prints_what_one_process_prints(runs_csv, capsys):
    docs = []
    for jobs in ("1", "2"):
        assert main(["validate", str(runs_csv), "--cv", "release", "--jobs", jobs,
                     "--json"]) == 0
        docs.append(json.loads(capsys.readouterr().out))
    assert docs[0] == docs[1] and docs[0]["rows"]


def test_jobs_without_cv_is_refused_naming_the_flag(capsys):
    assert main(["validate", "--jobs", "4"]) == 2
    msg = capsys.readouterr().err
    assert "--jobs 4" in msg and "--cv" in msg and "Traceback" not in msg


def test_a_fold_that_fails_in_its_worker_stops_the_run_and_leaves_no_process(rows):
    """A worker that dies reports its fold and its error; the others are killed, not left
    running."""
    import os

    from moeplan.runtime.lifecycle import child_pids
    from moeplan.validation.crossval import run_folds

    cases = cases_of(rows)
    before = set(child_pids(os.getpid()))  # earlier tests' helpers (a resource tracker) stay
    # both running workers fail; whichever exits first is the one reported
    with pytest.raises(RuntimeError, match="fold '[ab]' failed in its worker process") as err:
        run_folds(cases, "no-such-grouping", ["a", "b", "c"], "quick", jobs=2)  # type: ignore[arg-type]
    assert "KeyError" in str(err.value)
    assert set(child_pids(os.getpid())) - before == set()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"),
                    reason="parent-death signals are Linux's")
def test_fold_workers_die_with_a_cross_validation_killed_outright(tmp_path):
    """SIGKILL leaves the parent no cleanup to run; the workers go anyway (their parent-death
    signal), so no refit keeps burning CPU after the command that started it is gone."""
    import signal
    import subprocess
    import sys
    import time

    from moeplan.runtime.lifecycle import child_pids

    script = ("from moeplan.validation import read_rows\n"
              "from moeplan.validation.crossval import cases_of, folds_of, run_folds\n"
              "from moeplan.validation.fit import scored\n"
              "cases = scored(cases_of(read_rows()))\n"
              "run_folds(cases, 'model', folds_of(cases, 'model')[:2], 'full', jobs=2)\n")
    import os

    # the killed parent cannot remove its scratch directory: keep it in the test's own
    parent = subprocess.Popen([sys.executable, "-c", script],
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = child_pids(parent.pid)
            time.sleep(0.1)
        assert len(workers) == 2, "the fold workers did not start"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        alive = workers
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in workers if _running(p)]
        assert alive == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
