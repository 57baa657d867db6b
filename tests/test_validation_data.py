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


def _cases(ids):
    from moeplan.validation.crossval import cases_of

    return {c.id: c for c in cases_of([r for r in read_rows() if r["id"] in ids])}


def test_a_tuned_row_without_its_virtual_pipeline_size_is_priced_at_the_fastest_valid_one():
    """Parallel Folding's strong-scaling rows say their layout is the tuned optimum and print no
    VPP: each profile prices them at the fastest size Megatron accepts (a divisor of the layers
    per stage), which at 1,024 GPUs (8 micro-batches over PP4) is an interleaved one, and never
    slower than the uninterleaved layout the row would otherwise be read as."""
    from moeplan.cost_models.estimate import estimate
    from moeplan.validation.scoring import cluster_of, predict_case, priced_layout

    case = _cases({"R0485"})["R0485"]
    assert case.layout.vpp == 1 and [a.vpp for a in case.alternatives] == [7]
    assert "tuned" in case.assumed["vpp"]
    chosen = priced_layout(case)
    assert chosen.vpp == 7
    plain = estimate(case.model, cluster_of(case), case.training, case.layout, case.choices,
                     with_interval=False).tokens_per_s_per_gpu
    row = predict_case(case)
    assert row["vpp"] == 7 and row["predicted_tokens_per_s_per_gpu"] > 1.2 * plain


def test_a_row_that_prints_its_virtual_pipeline_size_or_tuned_nothing_has_no_alternatives():
    """A Bridge row publishes its VPP; a Parallel Folding long-context row does not say it was
    tuned: both are priced as published."""
    cases = _cases({"R0194", "R0526"})
    assert cases["R0194"].alternatives == () and cases["R0194"].layout.vpp == 4
    assert cases["R0526"].alternatives == ()
