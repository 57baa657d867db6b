"""The published runs moeplan validates against ship inside the package, with their sources,
so `moeplan validate` and every test read the same copy in any clone or install."""

import csv
import json
from importlib import resources

from moeplan.cli import main
from moeplan.validation import read_rows, shipped_runs


def test_shipped_data_carries_the_runs_the_hardware_and_their_sources():
    data = resources.files("moeplan.validation") / "data"
    names = {p.name for p in data.iterdir()}
    assert {"published_runs.csv", "hardware.csv", "README.md"} <= names
    rows = read_rows()
    assert len(rows) > 400 and all(r["source"] for r in rows)  # every row names its source
    with (data / "hardware.csv").open() as f:
        hw = list(csv.DictReader(f))
    assert hw and all(r["source"] for r in hw)
    assert "flops_convention" in (data / "README.md").read_text()


def test_validate_without_a_file_reads_the_shipped_published_runs(capsys):
    assert main(["validate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ids = {r["id"] for r in doc["rows"]} | {s["id"] for s in doc["skipped"]}
    assert ids == {r["id"] for r in read_rows(shipped_runs())}
