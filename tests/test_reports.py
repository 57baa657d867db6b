"""The reports: readable at a glance, true to the estimate, and drawn without a plotting
library.

Claims: every chart number comes from the cost model's own figures (the step terms add up to
the step time, the memory chart's red line is the line `fits` is judged by, the schedule is the
order the runtime runs); the page puts "does not fit" and "unvalidated effects" first, shows the
ranking key, and prints no Python object; and in Chromium at 1,400 and 800 px (and at the width
of an A4-landscape page) the body never scrolls sideways and no chart label overlaps another or
leaves its figure.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moeplan import load_cluster, load_model, search, whatif
from moeplan.api import estimate
from moeplan.planner import anatomy, svg
from moeplan.planner.report import (
    html_report,
    plan_markdown,
    plan_report,
    write_plan_report,
    write_report,
)
from moeplan.specs import Layout, Plan, TrainingSpec
from moeplan.specs.schedule import merged_schedule, schedule

from .browser import CHROMIUM, measure, print_pdf
from .conftest import run_cli

RAW = re.compile(r"Assumption\(|Interval\(|level=|\(\d+\.\d+, \d+\.\d+\)|\bTrue\b|\bFalse\b|"
                 r"\bNone\b")


def planned(model: str, gpus: int, gbs: int, cluster: str = "h100", **axes) -> Plan:
    plan = Plan(model=load_model(model), cluster=load_cluster(cluster, gpus),
                training=TrainingSpec(seq_len=4096, global_batch_size=gbs),
                layout=Layout.build(gpus, gbs, **axes))
    return plan.model_copy(update={"estimate": estimate(plan)})


@pytest.fixture(scope="module")
def searched():
    """The README's main command: DeepSeek-V3 on 1,024 H100 (EP overlap, interleaving,
    unvalidated flex)."""
    return search("deepseek-v3", "h100", 1024, seq=4096, gbs=8192)


@pytest.fixture(scope="module")
def not_fitting() -> Plan:
    """The Megatron Core MoE report's DeepSeek-V3 anatomy layout: 208.9 GB of 80 GB."""
    return planned("deepseek-v3", 256, 1024, pp=4, vpp=4, ep=64)


@pytest.fixture(scope="module")
def sweep():
    return whatif("mixtral-8x7b", ["h100", "h200"], [64, 128], tokens=1e12,
                  gpu_hour_price=[2.5, 3.2], workers=1)


@pytest.fixture(scope="module")
def pages(tmp_path_factory, searched, not_fitting, sweep) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("reports")
    best = searched.plans[0]
    return {
        "search": write_plan_report(searched.plans, f"{best.headline()}: best plans",
                                    d / "search.html", searched.objective),
        "estimate": write_plan_report([not_fitting], "estimate", d / "estimate.html", None),
        "whatif": write_report(sweep, d / "whatif.html"),
    }


# ------------------------------------------------------------------ the numbers drawn
@pytest.mark.parametrize("axes", [dict(pp=4), dict(pp=2, vpp=2, ep=4, ep_overlap=True),
                                  dict(ep=8, ep_overlap=True), dict(tp=2, pp=2, ep=2)])
def test_step_terms_add_up_to_the_step_time(axes):
    plan = planned("qwen3-30b-a3b", 8, 64, **axes)
    parts = anatomy.step_parts(plan)
    assert sum(parts.values()) == pytest.approx(plan.estimate.step_time_s, rel=1e-9)
    assert parts["compute"] > 0 and all(v > 0 for v in parts.values())
    if plan.layout.ep_overlap:
        assert parts["exposed EP comm"] > 0
    if plan.layout.pp > 1:
        assert parts["pipeline bubble"] == pytest.approx(plan.estimate.time.pp_bubble_s)


def test_step_terms_fall_back_to_the_estimates_own_when_the_breakdown_differs():
    plan = planned("mixtral-8x7b", 8, 64, ep=8)
    priced = estimate(plan, imbalance=1.5)
    skewed = plan.model_copy(update={"estimate": priced})
    assert anatomy.breakdown(skewed) is not None  # the estimate records its imbalance
    # an estimate the plan's own fields cannot reproduce (here, its imbalance lost)
    skewed = plan.model_copy(update={"estimate": priced.model_copy(update={"imbalance": 1.0})})
    assert anatomy.breakdown(skewed) is None
    parts = anatomy.step_parts(skewed)
    assert "exposed comm (all classes)" in parts
    assert sum(parts.values()) == pytest.approx(skewed.estimate.step_time_s, rel=1e-9)


def test_the_fit_line_is_the_line_fits_is_judged_by(not_fitting):
    fitting = planned("qwen3-30b-a3b", 16, 64, pp=2, ep=8)
    for plan in (fitting, not_fitting):
        line = anatomy.fit_line_gb(plan)
        assert plan.estimate.fits == (plan.estimate.memory.peak_gb <= line)
        # HBM − reserve − margin: the margin is measured at the peak, so at the line
        # headroom equals margin
        assert line < plan.cluster.hbm_gb - 2.0
    assert fitting.estimate.fits and not not_fitting.estimate.fits
    ranks = anatomy.rank_memory(not_fitting)
    assert len(ranks) == 4
    assert max(sum(r.values()) for r in ranks) == pytest.approx(
        not_fitting.estimate.memory.peak_gb, rel=1e-9)


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (4, 2, 8), (2, 4, 4), (1, 1, 4), (4, 1, 2)])
def test_the_schedule_drawn_is_megatrons_order_with_the_textbook_step(pp, vpp, m):
    """Equal stages, forward 1 and backward 2 per stage: 1F1B takes (m + p − 1)·3, the
    interleaved schedule m·3 + (p − 1)·3/v (Narayanan et al. 2021); every pass starts after
    the pass it needs."""
    fwd = [[1 / vpp] * vpp for _ in range(pp)]
    bwd = [[2 / vpp] * vpp for _ in range(pp)]
    blocks = anatomy.play(pp, vpp, m, fwd, bwd, paired=False)
    assert blocks is not None
    end = max(b.end for b in blocks)
    assert end == pytest.approx((m + pp - 1) * 3 if vpp == 1 else m * 3 + (pp - 1) * 3 / vpp)
    for r in range(pp):
        mine = sorted((b for b in blocks if b.rank == r), key=lambda b: b.start)
        assert [(b.kind, b.chunk, b.mb) for b in mine] == schedule(pp, vpp, r, m)
    at = {(b.kind, b.chunk * pp + b.rank, b.mb): b for b in blocks}
    for (kind, stage, mb), b in at.items():
        prev = at.get(("F", stage - 1, mb)) if kind == "F" else at.get(("B", stage + 1, mb))
        assert prev is None or prev.end <= b.start + 1e-12


def test_ep_overlap_is_drawn_as_the_merged_pairs():
    plan = planned("qwen3-30b-a3b", 8, 64, pp=2, vpp=2, ep=4, ep_overlap=True)
    tl = anatomy.timeline(plan)
    assert tl is not None and tl.paired
    for r in range(2):
        steps = merged_schedule(2, 2, r, tl.microbatches)
        pairs = sum(1 for f, b in steps if f and b)
        assert sum(1 for b in tl.blocks if b.rank == r and b.paired) == 2 * pairs > 0


# ------------------------------------------------------------------ the page's content
def test_the_plan_report_puts_notices_first_and_shows_the_ranking_key(searched, not_fitting):
    page = plan_report([not_fitting], "estimate", None)
    body = page.split("<body>", 1)[1]
    assert body.index("Does not fit.") < body.index("<table")
    assert "208.9 GB" in body and "fit line of 72.3 GB" in body
    assert "low end tok/s/GPU" in body
    text = plan_report(searched.plans, "search", searched.objective)
    first = text.index('class="notice')
    assert text.index("Unvalidated effects carry this plan.", first) < text.index("<table")
    assert text.count('<td class="num key"') == len(searched.plans)  # the key, every row
    for ref in ('src="http', "href=\"http", "url(http", "@import", "<script", "<link"):
        assert ref not in text  # one file, offline
    plain = re.sub(r"<[^>]+>", " ", text)
    assert not RAW.search(plain), RAW.search(plain)
    assert "<svg" in text and text.count('id="schedule"') == 1


def test_markdown_plan_report_is_supported_and_names_the_key(searched, cli, tmp_path):
    md = plan_markdown(searched.plans, "t", searched.objective)
    assert "Ranked by the low end of the 80% interval" in md and "| #1 |" in md
    assert not RAW.search(md)
    r = cli("search", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "8",
            "--gbs", "64", "--top", "2", "--report", str(tmp_path / "plan.md"))
    assert r.returncode == 0, r.stderr
    assert "| plan | layout |" in (tmp_path / "plan.md").read_text()


def test_whatif_cost_axis_spans_the_data_and_every_point_is_labelled(sweep):
    costs = [p.cost_usd for p in sweep.points if p.fits]
    chart = html_report(sweep).split('id="pareto"', 1)[1].split("</figure>", 1)[0]
    ticks = [float(t.replace(",", "")) for t in re.findall(r">\$([\d,]+)</text>", chart)]
    assert ticks and ticks[0] > 0.5 * min(costs) and ticks[-1] < 1.5 * max(costs)
    for p in sweep.points:
        assert f"{p.cluster} × {p.gpus}</text>" in chart


def test_scatter_labels_never_overlap_and_crowded_ones_are_listed():
    dots = [svg.Dot(100 + i * 1e-3, 10, f"h100 × {2 ** i}", "h100") for i in range(10)]
    dots += [svg.Dot(50, 5, "h100 × 1024", "h100"), svg.Dot(150, 15, "h100 × 2048", "h100")]
    text, unlabelled = svg.scatter_chart("t", dots, "cost", "days")
    boxes = [svg.text_box(float(x), float(y), t, float(s), a) for x, y, s, a, t in re.findall(
        r'<text x="([\d.]+)" y="([\d.]+)" font-size="([\d.]+)" text-anchor="(\w+)"[^>]*>'
        r"([^<]*)</text>", text)]
    for i, a in enumerate(boxes):
        assert all(not a.overlaps(b) for b in boxes[i + 1:])
    assert unlabelled and len(unlabelled) + sum(
        f">h100 × {2 ** i}<" in text for i in range(12)) == 12


def test_scatter_axes_of_days_and_dollars_never_go_below_zero():
    dots = [svg.Dot(87_000, 3.6, "a", "h100"), svg.Dot(117_000, 52.2, "b", "h200")]
    text, _ = svg.scatter_chart("t", dots, "cost", "days", x_fmt=lambda x: f"${x:,.0f}")
    ticks = re.findall(r'text-anchor="(?:end|middle)" fill="#666">(-?[\d,$]+)</text>', text)
    assert ticks and not any(t.startswith("-") for t in ticks), ticks
    dollars = [int(t[1:].replace(",", "")) for t in ticks if t.startswith("$")]
    assert dollars and min(dollars) >= 80_000 and "0" in ticks  # cost spans the data; days
    # start at zero


def test_reports_need_no_plotting_library(tmp_path):
    """The plain install has no matplotlib: every report is written with it hidden."""
    hide = ("import sys\nclass Gone:\n    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'matplotlib':\n"
            "            raise ModuleNotFoundError(name, name=name)\n"
            "sys.meta_path.insert(0, Gone())\nfrom moeplan.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    import subprocess
    import sys

    for args in (["estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "8",
                  "--gbs", "64", "--ep", "8", "--report", "e.html"],
                 ["whatif", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "8",
                  "--gbs", "64", "--tokens", "1e9", "--workers", "1", "-o", "w.html"]):
        r = subprocess.run([sys.executable, "-c", hide, *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "e.html").stat().st_size > 10_000 and "<svg" in (
        tmp_path / "w.html").read_text()


# ------------------------------------------------------------------ what a reader sees
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no headless browser: install Debian's chromium (apt-get install "
    "-y chromium) to check the HTML reports as rendered")


@needs_chromium
@pytest.mark.parametrize("kind", ["search", "estimate", "whatif"])
@pytest.mark.parametrize("width", [1400, 1040, 800])  # 1040: an A4-landscape page's width
def test_report_renders_without_sideways_scroll_or_overlapping_labels(pages, kind, width,
                                                                      tmp_path):
    m = measure(pages[kind], width, tmp_path)
    assert m["scrollWidth"] <= m["viewport"], m["overflowing"]
    assert not m["overflowing"], m["overflowing"]
    assert m["svgs"] >= 3 and m["labels"] > 20
    assert not m["overlaps"], m["overlaps"][:10]
    assert not m["outside"], m["outside"][:10]
    assert not RAW.search(m["text"]), RAW.search(m["text"])
    assert m["keys"] and all(visible and "low end" in label for label, _, visible in m["keys"])
    if width == 1400:
        assert all(w >= 140 for w in m["words"]), m["words"]  # sentences, not a word a line
    if kind == "estimate":
        assert m["text"].lstrip().split("\n")[1].startswith("Does not fit.")


@needs_chromium
def test_reports_print_to_pdf(pages, tmp_path):
    pdf = print_pdf(pages["search"], tmp_path)
    assert pdf.startswith(b"%PDF") and len(pdf) > 20_000
    assert 1 <= len(re.findall(rb"/Type\s*/Page[^s]", pdf)) <= 8


def test_cli_writes_the_search_report_with_the_objective(tmp_path):
    r = run_cli("search", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "8",
                "--gbs", "64", "--top", "2", "--objective", "expected", "--report",
                str(tmp_path / "p.html"))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "p.html").read_text()
    assert "point estimate of tokens/s/GPU (--objective expected)" in text
    assert '<th class="num key">tok/s/GPU</th>' in text


def test_the_unvalidated_banner_says_what_failing_costs_only_where_it_costs_something():
    """The banner said the low end "prices them failing" where failing priced the same as the
    point (a calibration no run validates has no slower variant)."""
    from moeplan.planner.report import plan_notices
    from moeplan.specs import Choices

    def banner(plan: Plan) -> str:
        return next(n.text for n in plan_notices([plan]) if n.head.startswith("Unvalidated"))

    # B200 bf16: a calibration no run validates, which has no slower variant to price
    assert "moves nothing here" in banner(planned("gpt-oss-120b", 64, 512, "b200", ep=8))
    # activation offload, priced failing on a slow host: the plan makes less
    plan = planned("qwen3-30b-a3b", 16, 256, ep=8)
    offload = plan.model_copy(update={"choices": Choices(offload=["expert_fc1"])})
    offload = offload.model_copy(update={"estimate": estimate(offload)})
    worse = offload.estimate.interval.pessimistic_tokens_per_s_per_gpu
    assert worse < offload.estimate.tokens_per_s_per_gpu
    assert f"makes {worse:,.0f} tokens/s/GPU" in banner(offload)


def test_the_banner_of_offload_hidden_even_on_a_slow_host_says_it_was_priced_so():
    """Activation offload has a slower variant (a host at half its bandwidths): where its copies
    stay hidden even there, the banner said "none has a slower variant to price", beside a
    search that sets plans aside once their offload is priced on a slow host."""
    from moeplan.planner.report import plan_notices
    from moeplan.specs import Choices

    plan = planned("qwen3-30b-a3b", 16, 256, ep=8)
    plan = plan.model_copy(update={"choices": Choices(offload=["attn_norm"])})
    plan = plan.model_copy(update={"estimate": estimate(plan)})
    e = plan.estimate
    assert e.interval.pessimistic_tokens_per_s_per_gpu == e.tokens_per_s_per_gpu
    text = next(n.text for n in plan_notices([plan]) if n.head.startswith("Unvalidated"))
    assert "none has a slower variant" not in text
    assert "activation offload copies hidden behind compute, priced on a host at half its " \
           "link and memory bandwidth" in text
    assert f"still makes {e.tokens_per_s_per_gpu:,.0f} tokens/s/GPU" in text
