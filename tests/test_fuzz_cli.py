"""Fuzzing the CLI with hypothesis: flags, spec files, CSVs and plan files a hostile user could
hand it. Whatever the input, the claims hold: the exit code is 0, 2 or 3 (never an uncaught
exception, so never a traceback), `--json` output is strict JSON, an error is one short
paragraph, and every run ends within a bound.

Examples are derandomised (the same cases every CI run, no example database) and few enough to
keep this module under a minute on two cores; the cases in test_hostile_inputs.py are the named
regressions.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeplan.cli import main

from .conftest import DATA

TINY = str(DATA / "tiny_qwen3_moe.yaml")
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
SECONDS = 15.0  # per command: the slowest legitimate run here (a tiny search) takes under 1 s
MAX_MESSAGE = 2500


def _no_constants(name: str) -> Any:
    raise AssertionError(f"non-strict JSON constant {name} in --json output")


class Overran(Exception):
    """A command ran past SECONDS (raised by the interval timer, so a hang fails, not stalls)."""


def _overran(signum: int, frame: object) -> None:
    raise Overran(f"a command ran past {SECONDS} s")


def check_run(args: list[str], capsys) -> int:
    """Run one command in-process and assert the fuzzing claims; return the exit code."""
    previous = signal.signal(signal.SIGALRM, _overran)
    signal.setitimer(signal.ITIMER_REAL, SECONDS)
    t0 = time.perf_counter()
    try:
        code = main(args)  # an uncaught exception (a traceback for the user) fails the test
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - t0
    cap = capsys.readouterr()
    if os.environ.get("FUZZ_TIMES"):
        print(f"{elapsed:.2f}", args, file=sys.__stderr__)
    assert code in (0, 2, 3), (args, code, cap.err[-1500:])
    assert elapsed < SECONDS, (args, elapsed)
    if code == 2:
        assert len(cap.err) < MAX_MESSAGE, cap.err[:3000]
    if "--json" in args and code in (0, 3) and cap.out.strip():
        json.loads(cap.out, parse_constant=_no_constants)
    return code


# ------------------------------------------------------------------------ value strategies
NONFINITE_TEXT = st.sampled_from(["nan", "inf", "-inf", "NaN", "1e999"])
NUMBER_TEXT = st.sampled_from([
    "0", "-1", "1", "2", "8", "16", "4096", "131073", "1000000000000", "99999999999999999999999",
    "1e308", "1.5", "0x10", "", "abc", "１", "8,16", "0-8", "1-1000000", "--json", "\x00",
])
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
# each branch equally likely: non-finite numbers, edge numbers, any text, any integer
FLAG_VALUE = st.one_of(NONFINITE_TEXT, NUMBER_TEXT, TEXT, st.integers(-10, 10**15).map(str))
JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**20), 10**20),
              st.floats(allow_nan=True, allow_infinity=True), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)

NONFINITE = st.sampled_from([float("nan"), float("inf"), -float("inf")])
SPECIAL = st.sampled_from([0, -1, 1, 2, 10**9, 2**63, 1e308, 0.5, "abc", "", None, True, [], {},
                           [1, 2], "1e3"])
FIELD_VALUE = st.one_of(NONFINITE, SPECIAL, JSONISH)  # two in three aimed at a known weak spot


def flag_pairs(flags: list[str]) -> st.SearchStrategy[list[str]]:
    pairs = st.dictionaries(st.sampled_from(flags), FLAG_VALUE, max_size=3)
    return pairs.map(lambda ps: [tok for p in ps.items() for tok in p])


# ------------------------------------------------------------------------ flags
EST_FLAGS = ["--gpus", "--seq", "--gbs", "--tp", "--pp", "--vpp", "--cp", "--ep", "--etp",
             "--mbs", "--recompute", "--offload", "--precision", "--dispatcher",
             "--stage-layout", "--imbalance"]


EST_BASE = ["estimate", "--model", TINY, "--cluster", "h100", "--gpus", "8", "--seq", "256",
            "--gbs", "16"]


@settings(FUZZ, max_examples=60)
@given(flag=st.sampled_from(EST_FLAGS), value=FLAG_VALUE)
def test_one_hostile_estimate_flag_never_crashes(flag, value, capsys):
    check_run([*EST_BASE, flag, value, "--json"], capsys)


@FUZZ
@given(extra=flag_pairs(EST_FLAGS), model=st.sampled_from([TINY, "llama3-8b", "nope"]))
def test_estimate_flags_never_crash(extra, model, capsys):
    check_run([*EST_BASE[:2], model, *EST_BASE[3:], *extra, "--json"], capsys)


SEARCH_GPUS = st.sampled_from(["0", "-4", "1", "4", "8", "1000000000000", "nan", "x", "8.0"])


@settings(FUZZ, max_examples=15)
@given(gpus=SEARCH_GPUS, extra=flag_pairs(["--seq", "--gbs", "--precision", "--target",
                                           "--imbalance", "--top", "--time-limit"]))
def test_search_flags_never_crash(gpus, extra, capsys):
    extra = [t if t not in ("4096", "131072", "131073") else "512" for t in extra]
    check_run(["search", "--model", TINY, "--cluster", "h100", "--gpus", gpus, "--seq", "256",
               "--gbs", "16", *extra, "--json"], capsys)


WHATIF_GPUS = st.sampled_from(["0-8", "8-4", "4,8", "1-99999999999", "8,,", ",", "nan", "-8",
                               "4-8", "1e3", "8"])


@settings(FUZZ, max_examples=15)
@given(gpus=WHATIF_GPUS, extra=flag_pairs(["--tokens", "--days", "--budget",
                                           "--gpu-hour-price", "--precision"]))
def test_whatif_flags_never_crash(gpus, extra, capsys):
    check_run(["whatif", "--model", TINY, "--cluster", "h100", "--gpus", gpus, "--seq", "256",
               "--gbs", "16", "--workers", "1", *extra, "--json"], capsys)


@FUZZ
@given(extra=flag_pairs(["--gpus", "--tp", "--cp", "--pp", "--ep", "--etp", "--order"]))
def test_groups_flags_never_crash(extra, capsys):
    extra = [t.replace("131072", "8") for t in extra]  # valid but slow: 1M ranks printed
    check_run(["groups", "--gpus", "8", *extra, "--json"], capsys)


# ------------------------------------------------------------------------ spec files
TINY_DOC = yaml.safe_load(Path(TINY).read_text())
MODEL_FIELDS = sorted(TINY_DOC) + ["attention", "mtp_layers", "moe_layer_pattern", "bogus"]


def write_doc(path: Path, doc: Any, as_yaml: bool) -> None:
    if as_yaml:
        path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    else:
        path.write_text(json.dumps(doc))  # may hold NaN/Infinity: the loader must refuse them


@settings(FUZZ, max_examples=60)
@given(changes=st.dictionaries(st.sampled_from(MODEL_FIELDS), FIELD_VALUE, min_size=1,
                               max_size=3),
       as_yaml=st.booleans(), command=st.sampled_from(["show", "validate", "estimate"]))
def test_model_spec_files_never_crash(changes, as_yaml, command, tmp_path, capsys):
    spec = tmp_path / ("m.yaml" if as_yaml else "m.json")
    write_doc(spec, {**TINY_DOC, **changes}, as_yaml)
    if command == "estimate":
        args = ["estimate", "--model", str(spec), "--cluster", "h100", "--gpus", "8", "--seq",
                "256", "--gbs", "16", "--json"]
    else:
        args = ["specs", command, str(spec), "--json"]
    check_run(args, capsys)


HF_DIR = DATA / "hf"
HF_CONFIGS = sorted(p.name for p in HF_DIR.glob("*.json"))


def _hf_fields(name: str) -> list[str]:
    return sorted(json.loads((HF_DIR / name).read_text()))


@settings(FUZZ, max_examples=60)
@given(data=st.data(), name=st.sampled_from(HF_CONFIGS),
       command=st.sampled_from(["show", "estimate"]))
def test_hf_configs_never_crash(data, name, command, tmp_path, capsys):
    # a real Hugging Face config with up to three fields replaced by hostile values (wrong
    # types, NaN/inf, huge sizes, nested junk) or removed
    doc = json.loads((HF_DIR / name).read_text())
    fields = _hf_fields(name) + ["rope_scaling", "rope_parameters", "architectures"]
    changes = data.draw(st.dictionaries(st.sampled_from(fields),
                                        st.one_of(FIELD_VALUE, st.just("__drop__")),
                                        min_size=1, max_size=3))
    for k, v in changes.items():
        if v == "__drop__":
            doc.pop(k, None)
        else:
            doc[k] = v
    spec = tmp_path / "config.json"
    spec.write_text(json.dumps(doc))
    if command == "estimate":
        args = ["estimate", "--model", str(spec), "--cluster", "h100", "--gpus", "8", "--seq",
                "256", "--gbs", "16", "--json"]
    else:
        args = ["specs", "show", str(spec), "--json"]
    check_run(args, capsys)


H100 = yaml.safe_load((Path(__file__).parents[1] / "moeplan/specs/presets/clusters/h100.yaml")
                      .read_text())


@settings(FUZZ, max_examples=50)
@given(changes=st.dictionaries(st.sampled_from(sorted(H100) + ["calibration", "hbm_eff",
                                                                 "gemm_eff_max"]),
                               FIELD_VALUE, min_size=1, max_size=3), as_calibration=st.booleans())
def test_cluster_and_calibration_files_never_crash(changes, as_calibration, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    if as_calibration:
        write_doc(path, {"calibration": changes}, True)
        args = ["--cluster", "h100", "--calibration", str(path)]
    else:
        write_doc(path, {**H100, **changes}, True)
        args = ["--cluster", str(path)]
    check_run(["estimate", "--model", TINY, *args, "--gpus", "8", "--seq", "256", "--gbs", "16",
               "--json"], capsys)


@FUZZ
@given(blob=st.binary(max_size=300), suffix=st.sampled_from([".json", ".yaml", ".csv"]))
def test_arbitrary_bytes_as_any_file_never_crash(blob, suffix, tmp_path, capsys):
    path = tmp_path / f"f{suffix}"
    path.write_bytes(blob)
    cmd = ["validate", str(path), "--json"] if suffix == ".csv" else [
        "specs", "validate", str(path), "--json"]
    check_run(cmd, capsys)


# ------------------------------------------------------------------------ CSVs
CSV_COLS = ["id", "model_preset", "cluster_preset", "num_gpus", "seq_len", "global_batch_seqs",
            "micro_batch", "tp", "pp", "vpp", "cp", "ep", "etp", "tokens_per_s_per_gpu",
            "tflops_per_gpu", "mfu", "memory_gb", "precision_preset", "flops_convention",
            "other_notes"]
CSV_ROW = {"id": "r1", "model_preset": "llama3-8b", "cluster_preset": "h100", "num_gpus": "8",
           "seq_len": "4096", "global_batch_seqs": "64", "micro_batch": "1", "tp": "1",
           "pp": "1", "vpp": "", "cp": "", "ep": "", "etp": "", "tokens_per_s_per_gpu": "9000",
           "tflops_per_gpu": "", "mfu": "", "memory_gb": "", "precision_preset": "bf16",
           "flops_convention": "causal_halved", "other_notes": ""}
CELL = st.one_of(NUMBER_TEXT, TEXT)


@FUZZ
@given(rows=st.lists(st.dictionaries(st.sampled_from(CSV_COLS), CELL, max_size=3), min_size=1,
                     max_size=3))
def test_csv_cells_never_crash(rows, tmp_path, capsys):
    import csv

    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLS)
        w.writeheader()
        for r in rows:
            w.writerow({**CSV_ROW, **r})
    check_run(["validate", str(path), "--json"], capsys)


# ------------------------------------------------------------------------ plan files
@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["estimate", "--model", TINY, "--cluster", "h100", "--gpus", "8", "--seq", "256",
                 "--gbs", "16", "--ep", "2", "-o", str(path)]) == 0
    return json.loads(path.read_text())


def plan_paths(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    """Every (section, field) and top-level key of a plan, the places a mutation lands."""
    out: list[tuple[str, ...]] = [(k,) for k in doc]
    out += [(k, f) for k, v in doc.items() if isinstance(v, dict) for f in v]
    return sorted(out)


@FUZZ
@given(data=st.data(), command=st.sampled_from(["export-torchrun", "export-slurm",
                                                "export-megatron", "groups", "estimate",
                                                "validate"]))
def test_plan_files_never_crash(plan_doc, data, command, tmp_path, capsys):
    doc = json.loads(json.dumps(plan_doc))
    for where in data.draw(st.lists(st.sampled_from(plan_paths(plan_doc)), min_size=1,
                                    max_size=3)):
        target = doc
        for key in where[:-1]:
            target = target.setdefault(key, {}) if isinstance(target, dict) else {}
        if isinstance(target, dict):
            target[where[-1]] = data.draw(FIELD_VALUE)
    path = tmp_path / "plan.json"
    write_doc(path, doc, False)
    if data.draw(st.booleans()):  # also: a plan cut short, as by a crash mid-write
        path.write_text(path.read_text()[: data.draw(st.integers(0, 2000))])
    cmd, _, fmt = command.partition("-")
    args = {"export": ["export", str(path), "--format", fmt],
            "groups": ["groups", str(path)], "estimate": ["estimate", str(path)],
            "validate": ["specs", "validate", str(path)]}[cmd]
    check_run([*args, "--json"], capsys)
