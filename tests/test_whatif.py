"""`moeplan whatif`: sweep document per SPEC §4, Pareto front, inverse questions, reports.

Sweeps here are small (Mixtral-8x7B on 16–32 GPUs, a narrowed search space) so that the whole
module runs in seconds; the planner's own correctness is tested in test_planner_search.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeplan.errors import SpecError
from moeplan.planner.enumerate import SearchSpace
from moeplan.planner.report import html_report, markdown, write_report
from moeplan.planner.search import default_gbs, search
from moeplan.planner.whatif import (
    Point,
    Sweep,
    WhatIf,
    fastest_within,
    fewest_gpus,
    pareto_front,
    sweep_gbs,
    whatif,
)
from moeplan.specs import TrainingSpec, load_cluster, load_model

SMALL = SearchSpace(precisions=("bf16",), max_pp=1, max_mbs=1, max_vpp=1)
PRICES = {"h100": 2.0, "b200": 3.5}


@pytest.fixture(scope="module")
def sweep() -> WhatIf:
    return whatif("mixtral-8x7b", "h100,b200", [16, 32], tokens=1e12,
                  gpu_hour_price=[PRICES["h100"], PRICES["b200"]], days=40, budget_usd=1e5,
                  space=SMALL)


def test_sweep_document_has_spec_fields_and_consistent_arithmetic(sweep: WhatIf) -> None:
    doc = json.loads(json.dumps(sweep.to_json()))
    assert set(doc) >= {"points", "pareto"}
    assert [(p["cluster"], p["gpus"]) for p in doc["points"]] == [
        ("h100", 16), ("h100", 32), ("b200", 16), ("b200", 32)]
    for p in doc["points"]:
        assert set(p) >= {"cluster", "gpus", "seq", "fits", "plan", "tokens_per_s_per_gpu", "mfu",
                          "days_to_train", "cost_usd", "why"}
        assert p["fits"] and p["seq"] == 4096
        # a point of the front needs no why; one off it names the point that beats it
        assert (p["why"] is None) == p["pareto"] or p["why"].startswith("off the front")
        assert set(p["plan"]) >= {"model", "cluster", "training", "layout", "choices",
                                  "estimate"}
        assert p["plan"]["cluster"]["name"] == p["cluster"]  # the preset name
        assert p["plan"]["layout"]["tp"] * p["plan"]["layout"]["dp"] * \
            p["plan"]["layout"]["cp"] * p["plan"]["layout"]["pp"] == p["gpus"]
        tps = p["plan"]["estimate"]["tokens_per_s_per_gpu"]
        days = 1e12 / (tps * p["gpus"]) / 86400
        assert p["days_to_train"] == pytest.approx(days, rel=1e-4)
        assert p["cost_usd"] == pytest.approx(days * 24 * p["gpus"] * PRICES[p["cluster"]],
                                              rel=1e-4)
    # strong scaling against the smallest count of each kind
    smallest = [p for p in doc["points"] if p["gpus"] == 16]
    assert all(p["scaling_efficiency"] == 1.0 for p in smallest)
    assert doc["pareto"] and all(doc["points"][e["index"]]["pareto"] for e in doc["pareto"])


def _pt(name: str, days: float, cost: float, gpus: int = 1) -> Point:
    """A hand-made point whose days and cost come out as given (1e12 tokens)."""
    tps = 1e12 / (days * 86400 * gpus)
    return Point(name, gpus, 4096, 1024, "bf16", fits=True, tokens=1e12,
                 gpu_hour_price=cost / (days * 24 * gpus), tokens_per_s_per_gpu=tps)


def test_pareto_front_keeps_exactly_the_undominated_points_fastest_first() -> None:
    pts = [_pt("a", 10, 100), _pt("b", 20, 50), _pt("c", 15, 120),  # c: dominated by a
           _pt("d", 30, 50), _pt("e", 5, 400), _pt("f", 20, 50),   # d by b; f ties b
           Point("x", 1, 4096, 1024, "bf16", fits=False, why="too big")]
    assert pareto_front(pts) == [4, 0, 1, 5]
    assert pareto_front([]) == []


def test_budget_picks_the_fastest_option_it_can_afford() -> None:
    pts = [_pt("a", 10, 100), _pt("b", 20, 50), _pt("e", 5, 400)]
    assert fastest_within(pts, 150)["index"] == 0
    assert fastest_within(pts, 1000)["index"] == 2
    none = fastest_within(pts, 10)
    assert none["index"] is None and "cheapest option costs $50" in none["why"]


def test_days_answer_is_the_fewest_gpus_within_the_deadline(sweep: WhatIf) -> None:
    assert sweep.days is not None
    for a in sweep.days["answers"]:
        ok = [p.gpus for p in sweep.points if p.cluster == a["cluster"] and p.fits
              and p.days_to_train <= 40]  # type: ignore[operator]
        assert a["gpus"] == (min(ok) if ok else None)
        assert (a["why"] is None) == bool(ok)
    assert sweep.budget is not None and sweep.budget["index"] is not None
    best = sweep.points[sweep.budget["index"]]
    assert best.cost_usd <= 1e5  # type: ignore[operator]
    assert all(best.days_to_train <= p.days_to_train for p in sweep.points  # type: ignore
               if p.fits and p.cost_usd <= 1e5)  # type: ignore[operator]


def test_points_that_cannot_fit_say_why() -> None:
    res = whatif("deepseek-v3", ["h100", "b200"], [8], precisions=["mxfp8"], space=None)
    h100, b200 = res.points
    assert not h100.fits and "mxfp8" in (h100.why or "")  # Hopper has no MXFP8
    assert not b200.fits and "nothing fits" in (b200.why or "")
    assert not res.any_fits and res.pareto == []
    doc = res.to_json()
    assert all(p["fits"] is False and p["plan"] is None and p["why"] for p in doc["points"])


def test_inputs_are_checked_with_clear_messages() -> None:
    with pytest.raises(SpecError, match="gpu-hour-price"):
        whatif("mixtral-8x7b", "h100", [16], budget_usd=1e6)
    with pytest.raises(SpecError, match="one per cluster kind"):
        whatif("mixtral-8x7b", "h100,b200", [16], gpu_hour_price=[1.0, 2.0, 3.0])
    with pytest.raises(SpecError, match="--gpus"):
        whatif("mixtral-8x7b", "h100", None)


def test_a_cluster_file_saved_from_a_preset_beside_it_is_named_with_the_rename_fix(
        tmp_path: Path) -> None:
    mine = tmp_path / "my_h100.yaml"
    mine.write_text(json.dumps(load_cluster("h100").model_dump(mode="json")))
    with pytest.raises(SpecError) as e:
        whatif("mixtral-8x7b", f"{mine},h100", [64], tokens=1e12, space=SMALL)
    msg = str(e.value)
    assert f"the file '{mine}' carries `name: h100`" in msg and "`name: my_h100`" in msg
    with pytest.raises(SpecError, match="gives the kind 'h100' twice"):
        whatif("mixtral-8x7b", "h100,H100", [64], tokens=1e12, space=SMALL)


def test_markdown_report_has_the_table_front_and_answers(sweep: WhatIf, tmp_path: Path) -> None:
    md = markdown(sweep)
    assert "| cluster | GPUs |" in md and "★" in md
    assert "## Pareto front" in md and "Within 40 days on b200" in md
    assert "Fastest within $100,000" in md
    assert write_report(sweep, tmp_path / "r.md").read_text() == md
    with pytest.raises(SpecError, match=r"\.md"):
        write_report(sweep, tmp_path / "r.pdf")


def test_cli_json_is_one_document_and_nothing_fitting_exits_3(cli) -> None:
    r = cli("whatif", "--model", "deepseek-v3", "--cluster", "h100", "--gpus", "8", "--json")
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)
    assert doc["points"][0]["fits"] is False and "nothing fits" in doc["points"][0]["why"]
    table = cli("whatif", "--model", "deepseek-v3", "--cluster", "h100", "--gpus", "8")
    assert table.returncode == 3 and "nothing fits" in table.stdout  # the why, in the table
    bad = cli("whatif", "--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "8",
              "-o", "r.pdf")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_the_terminal_says_what_the_reports_say_and_the_json_why_is_the_tables(
        cli, tmp_path: Path) -> None:
    """A point off the front says why in the table and in --json alike; the reports' warning
    that unvalidated effects carry the best plans is printed on the terminal too; the
    token count reads as people say it."""
    args = ("whatif", "--model", "mixtral-8x7b", "--cluster", "h100,b200", "--gpus", "16",
            "--tokens", "1e12", "--gpu-hour-price", "2.5")
    table, doc = cli(*args), json.loads(cli(*args, "--json").stdout)
    assert table.returncode == 0, table.stderr
    assert "mixtral-8x7b: 1T tokens" in table.stdout
    whys = [p["why"] for p in doc["points"]]
    assert any(w and w.startswith("off the front") for w in whys)
    for w in whys:
        if w:
            assert w in table.stdout
    # both best plans rest on them: said as such, not as "some"
    assert ("warning: Unvalidated effects carry every plan. Both best plans rest on effects "
            "no published run backs") in " ".join(table.stdout.split())
    report = cli(*args, "--report", str(tmp_path / "w.md"))
    assert report.returncode == 0, report.stderr
    assert "| cluster | GPUs |" in (tmp_path / "w.md").read_text()  # --report is -o


def test_html_report_without_any_fitting_point_still_renders() -> None:
    res = WhatIf("m", 1e12, [Point("h100", 8, 4096, 1024, "bf16", fits=False, why="too big")],
                 [])
    assert "too big" in html_report(res) and "nothing fits" in markdown(res)


def test_default_batch_is_about_4m_tokens_and_divisible_by_partial_racks() -> None:
    assert sweep_gbs(4096, 64) == default_gbs(4096) == 1024
    assert sweep_gbs(4096, 72) == 1152 and 1152 % 72 == 0  # one NVL72 rack: dp 9, 18, 36, 72
    assert sweep_gbs(4096, 100) % 25 == 0
    for n in (48, 72, 100, 144, 216):
        assert 2.5e6 < sweep_gbs(4096, n) * 4096 < 6.5e6


def test_time_limit_is_shared_over_the_points_still_to_search() -> None:
    s = Sweep(load_model("mixtral-8x7b"), {}, 1e12, {}, time_limit_s=100.0, expected=4)
    s.start -= 20.0  # 80 s left for 4 points
    assert s._budget() == pytest.approx(20.0, rel=0.01)
    s.cache[("x",)] = Point("x", 1, 1, 1, "bf16", fits=False)  # one done: 80 s for 3
    assert s._budget() == pytest.approx(80 / 3, rel=0.01)


def test_worker_processes_find_the_same_plans_as_one_process(sweep: WhatIf) -> None:
    res = whatif("mixtral-8x7b", "h100", [16, 32], tokens=1e12, space=SMALL, workers=2)
    serial = [p for p in sweep.points if p.cluster == "h100"]
    assert [p.tokens_per_s_per_gpu for p in res.points] == [
        p.tokens_per_s_per_gpu for p in serial]


def test_layer_tables_shared_over_a_sweep_give_the_plans_of_independent_searches() -> None:
    # NVL72 counts put groups in different domains (72: one rack; 128: two racks of 64), so a
    # table shared by mistake across placements would show up here
    res = whatif("mixtral-8x7b", "h100,gb200-nvl72", [16, 72, 128], tokens=1e12, space=SMALL,
                 workers=1)
    model = load_model("mixtral-8x7b")
    for p in res.points:
        alone = search(model, load_cluster(p.cluster),
                       TrainingSpec(seq_len=p.seq, global_batch_size=p.gbs), p.gpus, top_k=1,
                       space=SMALL)
        assert p.plan is not None
        assert p.plan.layout == alone.plans[0].layout
        assert p.step_time_s == alone.plans[0].estimate.step_time_s  # type: ignore[union-attr]


def test_fewest_gpus_probes_few_counts_and_finds_the_smallest_within_the_deadline() -> None:
    probed: list[int] = []

    class Fake(Sweep):
        def point(self, cluster, gpus, seq, gbs, precision):  # type: ignore[no-untyped-def]
            probed.append(gpus)
            if gpus < 64:  # too small to fit; beyond, perfect scaling from 1,000 days on 64
                return Point(cluster, gpus, seq, 1024, precision, fits=False, why="too big")
            return _pt(cluster, 1000 * 64 / gpus, 1.0, gpus)

    s = Fake(load_model("mixtral-8x7b"), {}, 1e12, {})
    counts = [8 << i for i in range(11)]  # 8 … 8192
    ans = fewest_gpus(s, "h100", 100.0, counts, 4096, None, "bf16")
    assert ans["gpus"] == 1024 and ans["why"] is None  # 62.5 days; 512 GPUs take 125
    assert len(probed) <= 4
    none = fewest_gpus(s, "h100", 1.0, counts, 4096, None, "bf16")
    assert none["gpus"] is None and "8192 GPUs" in none["why"]


def test_a_one_day_deadline_reads_1_day(sweep: WhatIf) -> None:
    from dataclasses import replace

    from moeplan.planner.report import answers

    said = answers(replace(sweep, days={**sweep.days, "target_days": 1}))
    assert any(line.startswith("Within 1 day on") for line in said)
    assert not any("Within 1 days" in line for line in said)
