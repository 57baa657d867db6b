"""Reports: `whatif -o report.md|report.html` and `search|estimate --report plan.html|plan.md`.

An HTML report must open anywhere, offline, years later (it gets attached to purchase
requests) and print: it is one self-contained file, with styles inline, the charts as inline
SVG drawn by `planner.svg` (no plotting library, so the plain install writes reports), no
scripts, and nothing fetched from the network. The page reflows from 1,400 px to a phone:
tables become one card per row below 1,100 px (and on paper), so the page body never
scrolls sideways. What a reader must see first stands first: a plan that does not fit, and a
plan carried by effects no published run has validated. Every value is shown in the project's
one vocabulary (`Plan.summary`) and plain words; no Python object is ever printed.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..cost_models import uncertainty
from ..errors import SpecError
from ..fsio import atomic_write_text
from ..specs import Plan
from ..specs.plan import token_words
from ..specs.training import priced_on
from ..terminal import figure as rate_figure
from ..terminal import plural, share
from . import anatomy as A
from . import svg
from .whatif import Point, WhatIf


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _layout(p: Point) -> str:
    """The best plan in the shared vocabulary (`Plan.summary`), or '-' without one."""
    return p.plan.summary() if p.plan else "-"


def money(x: float | None) -> str:
    """US dollars with thousands separators: `$1,234,567`."""
    return "-" if x is None else f"${x:,.0f}"


def low_end(p: Point) -> float | None:
    """The best plan's ranking key under the default (robust) objective: the low end of its
    80 % interval of tokens/s/GPU."""
    iv = p.tokens_interval
    return None if iv is None else iv[0]


def rows(res: WhatIf) -> list[dict[str, str]]:
    """One display row per point (shared by the terminal, Markdown and HTML tables)."""
    out = []
    for p in res.points:
        out.append({
            "cluster": p.cluster, "GPUs": str(p.gpus), "seq": str(p.seq), "gbs": str(p.gbs),
            "layout": _layout(p),
            "low end": _num(low_end(p), ",.0f"),
            "tok/s/GPU": _num(p.tokens_per_s_per_gpu, ",.0f"),
            "MFU": _num(p.mfu, ".1%"), "step s": _num(p.step_time_s, ".3g"),
            "days": _num(p.days_to_train, ",.1f"), "GPU-hours": _num(p.gpu_hours, ",.0f"),
            "cost": money(p.cost_usd), "scaling": _num(p.scaling_efficiency, ".0%"),
            "pareto": "★" if p.pareto else "",
            "why": res.why_not(p),
        })
    return out


def answers(res: WhatIf) -> list[str]:
    """The inverse questions' answers as sentences."""
    lines = []
    if res.days is not None:
        target = res.days["target_days"]
        within = f"Within {plural(float(target), 'day')}"
        for a in res.days["answers"]:
            if a["gpus"] is None:
                lines.append(f"{within} on {a['cluster']}: "
                             f"no count tried is enough ({a['why']}).")
            else:
                cost = "" if a["cost_usd"] is None else f", ${a['cost_usd']:,.0f}"
                lines.append(f"{within} on {a['cluster']}: "
                             f"{a['gpus']} GPUs ({a['days_to_train']:.1f} days{cost}).")
    if res.budget is not None:
        b = res.budget
        if b["index"] is None:
            lines.append(f"Within ${b['budget_usd']:,.0f}: nothing ({b['why']}).")
        else:
            lines.append(f"Fastest within ${b['budget_usd']:,.0f}: {b['cluster']} × {b['gpus']} "
                         f"GPUs, {b['days_to_train']:.1f} days, ${b['cost_usd']:,.0f}.")
    return lines


def _title(res: WhatIf) -> str:
    return f"What-if: {res.model}, {token_words(res.tokens)} tokens"


KEY_WORDS = ("low end: the low end of the best plan's 80% interval of tokens/s/GPU, which "
             "the search ranks plans by (--objective robust)")


def markdown(res: WhatIf) -> str:
    """The report as Markdown: the sweep table, the Pareto front and the inverse answers."""
    table = rows(res)
    cols = list(table[0]) if table else []
    lines = [f"# {_title(res)}", ""]
    lines += [f"> **{n.head}** {n.text}" for n in whatif_notices(res)]
    lines += ["" if lines[-1] else "",
              f"{plural(len(res.points), 'point')}, {sum(p.fits for p in res.points)} fit; "
              "searched in "
              f"{res.seconds:.1f} s. ★ marks the Pareto front of time to train against "
              f"{'cost' if res.priced else 'GPU-hours (no --gpu-hour-price given)'}; "
              f"{KEY_WORDS}. {_capital(priced_on(res.stack))}.",
              "",
              "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in table:
        lines.append("| " + " | ".join(v.replace("|", "\\|") for v in r.values()) + " |")
    lines += ["", "## Pareto front (fastest first)", ""]
    for i in res.pareto:
        p = res.points[i]
        cost = f"${p.cost_usd:,.0f}" if p.cost_usd is not None else f"{p.gpu_hours:,.0f} GPU-h"
        lines.append(f"- {p.cluster} × {p.gpus} GPUs, seq {p.seq}: {p.days_to_train:.1f} days, "
                     f"{cost}")
    if not res.pareto:
        lines.append("- nothing fits")
    said = answers(res)
    if said:
        lines += ["", "## Answers", ""] + [f"- {a}" for a in said]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ page parts
CSS = """*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,'Segoe UI','DejaVu Sans',sans-serif;margin:0 auto;
padding:16px 20px;max-width:1400px;color:#222;background:#fff;line-height:1.4;font-size:14px}
h1{font-size:22px;margin:4px 0 10px;overflow-wrap:anywhere}
h2{font-size:17px;margin:22px 0 8px;overflow-wrap:anywhere}
p,li,figcaption{overflow-wrap:anywhere}
code{font-family:'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:12.5px;
overflow-wrap:anywhere}
.notice{border-left:6px solid #888;background:#f4f4f4;padding:8px 12px;margin:8px 0}
.notice b{margin-right:6px}
.notice.bad{border-color:#c0392b;background:#fdecea}
.notice.warn{border-color:#d68910;background:#fef5e7}
.notice.info{border-color:#2e86c1;background:#eaf2f8}
table{border-collapse:collapse;font-size:13px;margin:8px 0;width:100%}
th,td{border:1px solid #ccc;padding:4px 6px;text-align:left;vertical-align:top}
th{background:#f2f2f2}
td.num,th.num{text-align:right;white-space:nowrap;font-variant-numeric:tabular-nums}
td.code{font-family:'DejaVu Sans Mono',Menlo,Consolas,monospace;font-size:12px;
overflow-wrap:anywhere;min-width:11em}
td.words{min-width:14em}
.key{background:#e8f1fb}
th.key{background:#d6e6f7}
tr.pareto td{background:#fff3c4}tr.nofit td{color:#777}tr.weak td{background:#fef5e7}
svg{display:block;max-width:100%;height:auto}
svg.strip{display:inline-block;vertical-align:middle;width:130px;height:auto}
figure{margin:14px 0;break-inside:avoid;min-width:0}
figcaption{font-size:13px;color:#444;margin-top:4px}
.figs{display:flex;flex-wrap:wrap;gap:8px 24px}
.figs figure{flex:1 1 520px}
.muted{color:#666}
@media (max-width:1100px){
table.cards,table.cards tbody,table.cards tr,table.cards td{display:block;width:auto}
table.cards tr.head{display:none}
table.cards tr{border:1px solid #ccc;margin:0 0 10px;padding:4px 6px}
table.cards td{display:inline-block;border:none;padding:2px 16px 2px 0;text-align:left;
white-space:normal;min-width:0;max-width:100%}
table.cards td.code,table.cards td.words{display:block}
table.cards td:empty{display:none}
table.cards td::before{content:attr(data-label) ": ";font-weight:600;color:#555;
font-family:system-ui,'DejaVu Sans',sans-serif}
}
@media print{
body{max-width:none;padding:0;font-size:11px}
.notice,tr.pareto td,.key{-webkit-print-color-adjust:exact;print-color-adjust:exact}
tr,figure,.notice{break-inside:avoid}h2{break-after:avoid}
}
@page{size:A4 landscape;margin:12mm}"""


def page(title: str, body: str) -> str:
    """A whole self-contained HTML document."""
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{body}</body></html>\n")


@dataclass(frozen=True)
class Notice:
    """A line at the top of a report: `level` bad (does not fit), warn or info."""

    level: str
    head: str
    text: str

    def html(self) -> str:
        return (f'<div class="notice {self.level}"><b>{html.escape(self.head)}</b>'
                f"{html.escape(self.text)}</div>")


@dataclass(frozen=True)
class Col:
    """A table column: `kind` num (right-aligned figures), code (plan words, wrapped
    anywhere), words (sentences) or text; `key` marks the ranking key."""

    name: str
    kind: str = "text"
    key: bool = False


def table_html(cols: Sequence[Col], body: Sequence[Sequence[str]],
               row_classes: Sequence[str] | None = None, raw: set[int] | None = None) -> str:
    """A table that is a grid on wide screens and one card per row on narrow ones and on
    paper (each cell then labelled with its column). Cells are escaped except the columns in
    `raw` (inline SVG made here)."""
    raw = raw or set()

    def cls(c: Col) -> str:
        names = ([c.kind] if c.kind != "text" else []) + (["key"] if c.key else [])
        return f' class="{" ".join(names)}"' if names else ""

    head = "".join(f"<th{cls(c)}>{html.escape(c.name)}</th>" for c in cols)
    out = [f'<table class="cards"><tr class="head">{head}</tr>']
    for i, r in enumerate(body):
        rc = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        cells = "".join(
            f'<td{cls(c)} data-label="{html.escape(c.name)}">'
            f"{v if j in raw else html.escape(v)}</td>"
            for j, (c, v) in enumerate(zip(cols, r, strict=True)))
        out.append(f"<tr{rc}>{cells}</tr>")
    return "".join(out) + "</table>"


def figure(fig_id: str, svg_text: str, caption: str) -> str:
    return (f'<figure id="{fig_id}">{svg_text}<figcaption>{html.escape(caption)}'
            "</figcaption></figure>")


def _strip_domain(intervals: Sequence[tuple[float, float] | None]) -> tuple[float, float]:
    vals = [v for iv in intervals if iv for v in iv]
    return svg.padded(min(vals), max(vals), 0.05) if vals else (0.0, 1.0)


def _strip(iv: tuple[float, float] | None, point: float | None, dom: tuple[float, float]
           ) -> str:
    if iv is None or point is None:
        return "-"
    tip = f"80% interval {iv[0]:,.0f} to {iv[1]:,.0f} tokens/s/GPU, point {point:,.0f}"
    return (svg.interval_strip(iv[0], point, iv[1], *dom, tip=tip)
            + f'<br><span class="muted">{iv[0]:,.0f}–{iv[1]:,.0f}</span>')


# ------------------------------------------------------------------------- what-if (HTML)
def _series(points: Sequence[Point]) -> dict[str, list[Point]]:
    """Fitting points grouped by what varies along a throughput curve: one line per series."""
    series: dict[str, list[Point]] = {}
    multi_seq = len({p.seq for p in points}) > 1
    multi_prec = len({p.precision for p in points}) > 1
    multi_gbs = len({p.asked_gbs for p in points}) > 1
    for p in points:
        if not p.fits:
            continue
        name = p.cluster + (f" seq{p.seq}" if multi_seq else "") + (
            f" gbs{p.gbs}" if multi_gbs else "") + (f" {p.precision}" if multi_prec else "")
        series.setdefault(name, []).append(p)
    return {k: sorted(v, key=lambda p: p.gpus) for k, v in series.items()}


def _point_name(p: Point, fit: Sequence[Point]) -> str:
    return f"{p.cluster} × {p.gpus}" + (
        f" seq{p.seq}" if len({q.seq for q in fit}) > 1 else "") + (
        f" {p.precision}" if len({q.precision for q in fit}) > 1 else "")


def plots(res: WhatIf) -> dict[str, tuple[str, str]]:
    """The what-if charts as inline SVG with their captions: throughput against GPU count
    (cluster and per GPU, with the 80 % band), days against cost, and each best plan's memory
    against its fit line."""
    out: dict[str, tuple[str, str]] = {}
    series = _series(res.points)
    total = [svg.Series(n, [(p.gpus, (p.tokens_per_s_per_gpu or 0) * p.gpus / 1e6) for p in pts])
             for n, pts in series.items()]
    per_gpu = [svg.Series(n, [(p.gpus, p.tokens_per_s_per_gpu or 0.0) for p in pts],
                          [(p.gpus, *p.tokens_interval) for p in pts if p.tokens_interval])
               for n, pts in series.items()]
    out["throughput"] = (svg.line_chart("Cluster throughput against GPU count", total, "GPUs",
                                        "M tokens/s, whole cluster"),
                         "Cluster throughput against GPU count, one line per cluster kind")
    out["per-gpu"] = (svg.line_chart("Tokens/s per GPU against GPU count", per_gpu, "GPUs",
                                     "tokens/s per GPU"),
                      "Tokens/s per GPU of each best plan; the band is its 80% interval, whose "
                      "low end is the ranking key")
    fit = [p for p in res.points if p.fits and p.days_to_train is not None]
    unit = "cost (USD)" if res.priced else "GPU-hours"
    dots = [svg.Dot(p.price_axis or 0.0, p.days_to_train or 0.0, _point_name(p, fit),
                    p.cluster, p.days_interval, p.pareto) for p in fit]
    chart, unlabelled = svg.scatter_chart(
        f"Days to train {res.tokens:.3g} tokens against {unit}", dots, unit, "days to train",
        x_fmt=(lambda x: f"${x:,.0f}") if res.priced else svg.fmt_num)
    caption = (f"Days to train against {unit}; grey bars: days at the ends of the 80% interval; "
               "circled: the Pareto front (nothing is both faster and cheaper)")
    if unlabelled:
        caption += f". Not labelled for lack of room: {', '.join(unlabelled)}"
    out["pareto"] = (chart, caption)
    if fit:
        rows_ = [(_point_name(p, fit), [p.plan.estimate.memory.model_dump()[f"{k}_gb"]  # type: ignore[union-attr]
                                        for k, _ in A.MEMORY_PARTS]) for p in fit]
        marks = [(A.fit_line_gb(p.plan), p.plan.cluster.hbm_gb) for p in fit]  # type: ignore[arg-type,union-attr]
        refs = [svg.Ref(0, "fit line (HBM − reserve − margin)", "#c0392b", "4 2"),
                svg.Ref(0, "HBM", svg.INK)]
        out["memory"] = (svg.hbar_chart("Memory of each best plan", rows_, A.MEMORY_PARTS,
                                        "GB per GPU (most loaded GPU)", refs=refs,
                                        ref_marks=marks, total_fmt=lambda x: f"{x:.1f} GB"),
                         "Memory of each best plan's most loaded GPU; the red tick is the line "
                         "a plan must stay under to fit (HBM − reserve − margin, the rule "
                         "`fits` uses), the black tick the HBM")
    return out


def whatif_notices(res: WhatIf) -> list[Notice]:
    """What must be read first: nothing fits; best plans that rest on unvalidated effects."""
    out = []
    if not res.any_fits:
        out.append(Notice("bad", "Nothing fits.", "No point of the sweep has a plan that fits; "
                          "each row's why says what came closest."))
    weak = sorted({a.term for p in res.points if p.plan and p.plan.estimate
                   for a in p.plan.estimate.assumptions if not a.validated})
    if weak:
        n = sum(1 for p in res.points if p.plan and p.plan.estimate and any(
            not a.validated for a in p.plan.estimate.assumptions))
        planned = sum(1 for p in res.points if p.plan and p.plan.estimate)
        head = ("Unvalidated effects carry every plan." if n == planned else
                "Unvalidated effects carry some plans.")
        every = {1: "the one best plan rests", 2: "both best plans rest"}
        whose = (every.get(n, f"all {n} best plans rest")
                 if n == planned else f"{n} of the best plans {'rests' if n == 1 else 'rest'}")
        out.append(Notice("warn", head,
                          f"{_capital(whose)} on effects "
                          f"no published run backs: {'; '.join(weak)}. Each plan's own report "
                          "says what it makes with them failing; the low end of its interval "
                          "is the ranking key."))
    stopped = [p.label for p in res.points if p.stopped_early]
    if stopped:
        out.append(Notice("info", "Stopped early.", f"{', '.join(stopped)}: the search hit its "
                          "time limit; the plan is the best found so far."))
    return out


WHATIF_KINDS = {"cluster": "text", "layout": "code", "why": "words", "pareto": "text"}


def html_report(res: WhatIf) -> str:
    """One self-contained HTML page: notices, the points table (ranking key and interval
    drawn), answers, and the charts."""
    table = rows(res)
    names = list(table[0]) if table else []
    if len({p.seq for p in res.points}) == 1:
        names.remove("seq")  # the same for every point: said in the sentence above the table
    at = names.index("low end") + 1 if names else 0
    cols = [Col(n, WHATIF_KINDS.get(n, "num"), key=n == "low end") for n in names]
    cols.insert(at, Col("80% interval"))
    dom = _strip_domain([p.tokens_interval for p in res.points])
    body = []
    for p, r in zip(res.points, table, strict=True):
        cells = [r[n] for n in names]
        cells.insert(at, _strip(p.tokens_interval, p.tokens_per_s_per_gpu, dom))
        body.append(cells)
    classes = ["pareto" if p.pareto else ("nofit" if not p.fits else "") for p in res.points]
    said = "".join(f"<li>{html.escape(a)}</li>" for a in answers(res))
    figs = plots(res)
    seqs = sorted({p.seq for p in res.points})
    intro = (f"{plural(len(res.points), 'point')}, {sum(p.fits for p in res.points)} fit"
             + (f", all at sequence length {seqs[0]}" if len(seqs) == 1 else "")
             + f"; searched in {res.seconds:.1f} s. Highlighted rows (★) are on the Pareto front "
             f"of days against {'cost' if res.priced else 'GPU-hours'}. {KEY_WORDS[0].upper()}"
             f"{KEY_WORDS[1:]}; the bar shows the interval, the dot the point estimate. "
             f"{_capital(priced_on(res.stack))}.")
    charts = "".join(figure(k, s, c) for k, (s, c) in figs.items() if k in ("throughput",
                                                                           "per-gpu"))
    rest = "".join(figure(k, s, c) for k, (s, c) in figs.items() if k in ("pareto", "memory"))
    body_html = ("".join(n.html() for n in whatif_notices(res))
                 + f"<p>{html.escape(intro)}</p>"
                 + table_html(cols, body, classes, raw={at})
                 + (f"<h2>Answers</h2><ul>{said}</ul>" if said else "")
                 + f'<h2>Throughput</h2><div class="figs">{charts}</div>'
                 + f'<h2>Time, cost and memory</h2><div class="figs">{rest}</div>')
    return page(_title(res), body_html)


def write_report(res: WhatIf, path: str | Path) -> Path:
    """Write Markdown (.md) or self-contained HTML (.html/.htm), chosen by the suffix."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".md":
        atomic_write_text(path, markdown(res))
    elif suffix in (".html", ".htm"):
        atomic_write_text(path, html_report(res))
    else:
        raise SpecError(f"-o {path}: the report is .md (Markdown) or .html (self-contained "
                        "HTML with plots).")
    return path


# ------------------------------------------------------------------------ plan report (search)
OBJECTIVE_KEYS = {
    "robust": ("low end", "the low end of the 80% interval of tokens/s/GPU, priced with every "
               "unvalidated effect failing (--objective robust)"),
    "expected": ("tok/s/GPU", "the point estimate of tokens/s/GPU (--objective expected)"),
}


def _failing_moves_nothing(plan: Plan) -> str:
    """Why pricing the plan's unvalidated effects failing leaves its speed where it was: none
    has a slower variant (a calibration no run validates), or those that have one were priced
    so and the step waits on none of them here (offload copies still hidden on a slow host)."""
    slowed = uncertainty.slower_variants(plan.model, plan.cluster, plan.training, plan.layout,
                                         plan.choices)
    if not slowed:
        return " Pricing them failing moves nothing here (none has a slower variant to price)"
    assert plan.estimate is not None
    return (f" With them failing ({'; '.join(slowed)}) the plan still makes "
            f"{plan.estimate.tokens_per_s_per_gpu:,.0f} tokens/s/GPU: its step waits on none "
            "of them here")


def plan_notices(plans: Sequence[Plan], stopped_early: bool = False) -> list[Notice]:
    """Does not fit, then unvalidated effects, then the estimate's other warnings."""
    best = plans[0]
    est = best.estimate
    assert est is not None
    out = []
    for i, p in enumerate(plans):
        e = p.estimate
        if e is not None and not e.fits:
            who = "This plan" if len(plans) == 1 else f"Plan #{i + 1}"
            out.append(Notice("bad", "Does not fit.", (
                f"{who} does not fit: {A.fit_failure(p)}. Spread it over more GPUs or "
                "pipeline stages, or recompute or offload activations; `moeplan search` finds a "
                "layout that fits.")))
    weak = [a.term for a in est.assumptions if not a.validated]
    if weak:
        iv = est.interval
        low = ""
        if iv is not None:
            worse = iv.pessimistic_tokens_per_s_per_gpu
            low = (f" With them failing the plan makes {worse:,.0f} tokens/s/GPU against "
                   f"{est.tokens_per_s_per_gpu:,.0f}; the interval's low end, "
                   f"{iv.tokens_per_s_per_gpu[0]:,.0f}, is priced from there."
                   if worse is not None and worse < est.tokens_per_s_per_gpu * (1 - 1e-9) else
                   _failing_moves_nothing(best) + f"; the interval's low end is "
                   f"{iv.tokens_per_s_per_gpu[0]:,.0f} tokens/s/GPU.")
        out.append(Notice("warn", "Unvalidated effects carry this plan.",
                          f"It rests on effects no published run backs: {'; '.join(weak)}."
                          + low))
    if stopped_early:
        out.append(Notice("info", "Stopped early.", "The search hit its time limit; these are "
                          "the best plans found so far."))
    for w in est.warnings:
        if not est.fits and w.startswith("peak "):
            continue  # said by the first notice
        out.append(Notice("warn", "Note.", w))
    if est.confidence is not None and est.confidence.label == "extrapolated":
        out.append(Notice("info", "Extrapolated.", est.confidence.reason))
    return out


def _plan_row(i: int, p: Plan, dom: tuple[float, float]) -> list[str]:
    e = p.estimate
    assert e is not None
    iv = e.interval.tokens_per_s_per_gpu if e.interval else None
    return [f"#{i + 1}", p.layout_summary(), p.choices_summary(),
            _num(iv[0] if iv else None, ",.0f"), _strip(iv, e.tokens_per_s_per_gpu, dom),
            rate_figure(e.tokens_per_s_per_gpu), f"{e.step_time_s:.3g}",
            rate_figure(e.tflops_per_gpu),
            share(e.mfu), f"{e.memory.peak_gb:.1f} / {A.fit_line_gb(p):.1f}",
            "yes" if e.fits else "NO", e.bottleneck]


def _plan_cols(objective: str | None) -> list[Col]:
    key = OBJECTIVE_KEYS.get(objective or "", ("", ""))[0]
    return [Col("plan"), Col("layout", "code"), Col("choices", "code"),
            Col("low end tok/s/GPU", "num", key == "low end"), Col("80% interval"),
            Col("tok/s/GPU", "num", key == "tok/s/GPU"), Col("step s", "num"),
            Col("TFLOPS/GPU", "num"), Col("MFU", "num"), Col("peak / fit line GB", "num"),
            Col("fits"), Col("bottleneck")]


def _schedule_words(plan: Plan, tl: A.Timeline) -> str:
    L = plan.layout
    kind = "1F1B" if L.vpp == 1 else f"interleaved 1F1B with {L.vpp} model chunks per rank"
    if tl.paired:
        kind += (", EP overlap: each steady-state forward is paired with another micro-batch's "
                 "backward so that one's expert all-to-all hides under the other's compute")
    shown = (f"all {tl.of} micro-batches" if tl.microbatches == tl.of else
             f"{tl.microbatches} of the plan's {tl.of} micro-batches (warm-up and cool-down as "
             "in the step, a shorter steady state)")
    return (f"Pipeline schedule of the chosen plan, {kind}; {shown}. Numbers are micro-batches; "
            "blank time on a rank is its bubble. Durations from the cost model's per-chunk "
            "forward and backward times; point-to-point latency not drawn.")


def plan_plots(plans: Sequence[Plan]) -> dict[str, tuple[str, str]]:
    """Per plan: the step time by term. For the chosen (first) plan: its pipeline schedule and
    its memory per pipeline rank against the fit line."""
    best = plans[0]
    est = best.estimate
    assert est is not None
    b = A.breakdown(best)
    parts = [A.step_parts(p, b if p is best else None) for p in plans]
    used = [(n, c) for n, c in A.STEP_PARTS if any(n in d for d in parts)]
    rows_ = [(f"#{i + 1}", [d.get(n, 0.0) for n, _ in used]) for i, d in enumerate(parts)]
    out = {"time": (svg.hbar_chart("Step time by term, per plan", rows_, used,
                                   "seconds per step", total_fmt=lambda x: f"{x:.3g} s",
                                   row_h=26),
                    "Where each plan's step time goes: compute, the optimizer step, recompute, "
                    "exposed offload copies, the pipeline bubble, communication left exposed "
                    "by overlap (TP/CP inside the layers, EP, DP with the pipeline's sends) and "
                    "the fixed per-step overhead; the terms add up to the step time")}
    tl = A.timeline(best, b)
    if tl is not None:
        out["schedule"] = (svg.schedule_chart("Pipeline schedule of the chosen plan", tl.blocks,
                                              best.layout.pp, best.layout.vpp),
                           _schedule_words(best, tl))
    ranks = A.rank_memory(best, b)
    fit = A.fit_line_gb(best)
    rows_m = [(f"pp rank {i}", [r[k] for k, _ in A.MEMORY_PARTS]) for i, r in enumerate(ranks)]
    refs = [svg.Ref(fit, f"fit line {fit:.1f} GB (HBM − reserve − margin)", "#c0392b", "4 2"),
            svg.Ref(best.cluster.hbm_gb, f"HBM {best.cluster.hbm_gb:g} GB")]
    out["memory"] = (svg.hbar_chart("Memory per pipeline rank of the chosen plan", rows_m,
                                    A.MEMORY_PARTS, "GB per GPU", refs=refs,
                                    total_fmt=lambda x: f"{x:.1f} GB"),
                     f"Memory of the chosen plan per pipeline rank, against the fit line "
                     f"{fit:.1f} GB: {A.fit_rule_words(best)}, the rule `fits` uses; a rank "
                     "past the red line does not fit")
    return out


def _assumptions_table(plan: Plan) -> str:
    est = plan.estimate
    assert est is not None
    if not est.assumptions:
        return '<p class="muted">The estimate names no modelled effect beyond the basics.</p>'
    cols = [Col("effect the estimate relies on", "words"), Col("validated"),
            Col("evidence", "words")]
    rows_ = [[a.term, "yes" if a.validated else "NO: not backed by a published run", a.evidence]
             for a in sorted(est.assumptions, key=lambda a: a.validated)]
    return table_html(cols, rows_, ["" if a.validated else "weak" for a in
                                    sorted(est.assumptions, key=lambda a: a.validated)])


def _prediction_table(plan: Plan) -> str:
    est = plan.estimate
    assert est is not None
    iv = est.interval
    cols = [Col("figure"), Col("point", "num"), Col("80% interval", "num"), Col("drawn")]
    body = [["tokens/s/GPU", f"{est.tokens_per_s_per_gpu:,.0f}",
             f"{iv.tokens_per_s_per_gpu[0]:,.0f} – {iv.tokens_per_s_per_gpu[1]:,.0f}" if iv
             else "-",
             _strip(iv.tokens_per_s_per_gpu if iv else None, est.tokens_per_s_per_gpu,
                    _strip_domain([iv.tokens_per_s_per_gpu if iv else None]))],
            ["step time (s)", f"{est.step_time_s:.3g}",
             f"{iv.step_time_s[0]:.3g} – {iv.step_time_s[1]:.3g}" if iv else "-",
             _strip(iv.step_time_s if iv else None, est.step_time_s,
                    _strip_domain([iv.step_time_s if iv else None])).replace(
                 "tokens/s/GPU", "s")],
            ["peak memory (GB)", f"{est.memory.peak_gb:.1f}",
             f"fits under {A.fit_line_gb(plan):.1f}" if est.fits
             else f"does NOT fit under {A.fit_line_gb(plan):.1f}", "-"]]
    extra = ""
    if iv is not None:
        extra = (f'<p class="muted">The interval comes from {iv.rows} held-out published runs '
                 f"({html.escape(iv.regime)})"
                 + (f"; with every unvalidated effect failing the plan makes "
                    f"{iv.pessimistic_tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
                    if iv.pessimistic_tokens_per_s_per_gpu is not None else "") + ".</p>")
    return table_html(cols, body, raw={3}) + extra


def _capital(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def _stack_words(plan: Plan) -> str:
    return _capital(priced_on(plan.training.software_stack))


def plan_report(plans: Sequence[Plan], title: str, objective: str | None = "robust",
                stopped_early: bool = False) -> str:
    """One self-contained HTML page: notices first, the plans as rows with the ranking key
    and the interval drawn, each plan's step time by term, then the chosen plan: its
    schedule, memory per pipeline rank against the fit line, prediction, assumptions and why
    it was chosen. `objective` None: an estimate (no ranking)."""
    best = plans[0]
    ivs = [p.estimate.interval.tokens_per_s_per_gpu if p.estimate and p.estimate.interval
           else None for p in plans]
    dom = _strip_domain(ivs)
    key_words = OBJECTIVE_KEYS.get(objective or "", ("", ""))[1]
    if objective is None:
        intro = ("One layout estimated. `moeplan search` would rank it by the low end of its "
                 "80% interval of tokens/s/GPU (--objective robust), shown highlighted; the "
                 "bar shows the interval, the dot the point estimate.")
    else:
        intro = (f"{len(plans)} plans, best first, ranked by {key_words}: the highlighted "
                 "column. The bar shows each plan's 80% interval of tokens/s/GPU, the thick "
                 "tick its low end, the dot its point estimate.")
    cols = _plan_cols(objective or "robust")
    figs = plan_plots(plans)
    body = ("".join(n.html() for n in plan_notices(plans, stopped_early))
            + f"<p>{html.escape(intro)}</p>"
            + table_html(cols, [_plan_row(i, p, dom) for i, p in enumerate(plans)],
                         ["" if p.estimate and p.estimate.fits else "nofit" for p in plans],
                         raw={4})
            + "<h2>Step time by term</h2>" + figure("time", *figs["time"])
            + f"<h2>The chosen plan{' (#1)' if len(plans) > 1 else ''}</h2>"
            + f'<p><code>{html.escape(best.summary())}</code></p>'
            + f"<p>{html.escape(_stack_words(best))}</p>"
            + _prediction_table(best)
            + (figure("schedule", *figs["schedule"]) if "schedule" in figs else "")
            + figure("memory", *figs["memory"])
            + "<h2>What the estimate assumes</h2>" + _assumptions_table(best)
            + (("<h2>Why this plan</h2><ul>"
                + "".join(f"<li>{html.escape(x)}</li>" for x in best.explanation)
                + "</ul>") if best.explanation else ""))
    return page(title, body)


def plan_markdown(plans: Sequence[Plan], title: str, objective: str | None = "robust",
                  stopped_early: bool = False) -> str:
    """The plan report as Markdown (no charts): notices, the plans with the ranking key, the
    chosen plan's step terms, memory per pipeline rank, assumptions and explanation."""
    best = plans[0]
    key_words = OBJECTIVE_KEYS.get(objective or "", ("", ""))[1]
    lines = [f"# {title}", ""]
    lines += [f"> **{n.head}** {n.text}" for n in plan_notices(plans, stopped_early)]
    lines += ["", f"Ranked by {key_words}." if objective else
              "One layout estimated; search would rank it by the low end of its 80% interval.",
              "", "| plan | layout | choices | low end tok/s/GPU | 80% interval | tok/s/GPU | "
              "step s | MFU | peak / fit line GB | fits |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(plans):
        e = p.estimate
        assert e is not None
        iv = e.interval.tokens_per_s_per_gpu if e.interval else None
        cells = [f"#{i + 1}", p.layout_summary(), p.choices_summary(),
                 _num(iv[0] if iv else None, ",.0f"),
                 f"{iv[0]:,.0f}–{iv[1]:,.0f}" if iv else "-",
                 rate_figure(e.tokens_per_s_per_gpu), f"{e.step_time_s:.3g}", share(e.mfu),
                 f"{e.memory.peak_gb:.1f} / {A.fit_line_gb(p):.1f}", "yes" if e.fits else "NO"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    parts = A.step_parts(best)
    lines += ["", f"## The chosen plan: `{best.summary()}`", "", _stack_words(best) + ".", "",
              "| step term | seconds | share |", "|---|---|---|"]
    total = sum(parts.values())
    lines += [f"| {k} | {v:.3g} | {v / total:.1%} |" for k, v in parts.items()]
    lines += ["", f"Memory per pipeline rank (fit line {A.fit_line_gb(best):.1f} GB: "
              f"{A.fit_rule_words(best)}):", "",
              "| rank | " + " | ".join(k for k, _ in A.MEMORY_PARTS) + " | total GB |",
              "|---" * (len(A.MEMORY_PARTS) + 2) + "|"]
    for i, r in enumerate(A.rank_memory(best)):
        lines.append(f"| pp rank {i} | " + " | ".join(f"{r[k]:.1f}" for k, _ in A.MEMORY_PARTS)
                     + f" | {sum(r.values()):.1f} |")
    est = best.estimate
    assert est is not None
    if est.assumptions:
        lines += ["", "| effect the estimate relies on | validated | evidence |", "|---|---|---|"]
        lines += [f"| {a.term} | {'yes' if a.validated else 'NO'} | {a.evidence} |"
                  for a in sorted(est.assumptions, key=lambda a: a.validated)]
    if best.explanation:
        lines += ["", "## Why this plan", ""] + [f"- {x}" for x in best.explanation]
    return "\n".join(lines) + "\n"


PLAN_REPORT_SUFFIXES = (".html", ".htm", ".md")


def check_plan_report_path(path: str | Path) -> None:
    """Refuse a --report path before any work: an .html page or a .md file."""
    if Path(path).suffix.lower() not in PLAN_REPORT_SUFFIXES:
        raise SpecError(f"--report {path}: the plan report is an .html file (self-contained, "
                        "with charts) or an .md file (Markdown tables).")


def write_plan_report(plans: Sequence[Plan], title: str, path: str | Path,
                      objective: str | None = "robust", stopped_early: bool = False) -> Path:
    """`search|estimate --report PATH.html|PATH.md`."""
    path = Path(path)
    check_plan_report_path(path)
    if path.suffix.lower() == ".md":
        atomic_write_text(path, plan_markdown(plans, title, objective, stopped_early))
    else:
        atomic_write_text(path, plan_report(plans, title, objective, stopped_early))
    return path
