"""`moeplan whatif -o report.md|report.html`: the sweep as Markdown tables or one HTML file.

The HTML report must open anywhere, offline, years later (it gets attached to purchase
requests), so it is a single self-contained file: plots are matplotlib figures inlined as SVG,
styles inline, no scripts, no fonts or images fetched from the network. matplotlib is imported
only here and only when HTML is asked for, so `whatif` itself stays light.
"""

from __future__ import annotations

import html
import io
import re
from collections.abc import Sequence
from pathlib import Path

from ..errors import SpecError
from ..fsio import atomic_write_text
from ..specs import Plan
from .whatif import Point, WhatIf

MEMORY_PARTS = ("weights_gb", "grads_gb", "optimizer_gb", "activations_gb", "buffers_gb")


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _layout(p: Point) -> str:
    """The best plan in the shared vocabulary (`Plan.summary`), or '-' without one."""
    return p.plan.summary() if p.plan else "-"


def money(x: float | None) -> str:
    """US dollars with thousands separators: `$1,234,567`."""
    return "-" if x is None else f"${x:,.0f}"


def _why(p: Point, res: WhatIf) -> str:
    """Why a point is not a choice: what stopped it fitting, or which point beats it."""
    if not p.fits:
        return p.why or "no plan fits (the search found none)"
    if p.stopped_early:
        return "stopped at the time limit"
    if p.pareto or p.days_to_train is None or p.price_axis is None:
        return ""
    better = [q for q in (res.points[i] for i in res.pareto)
              if q.days_to_train is not None and q.price_axis is not None
              and q.days_to_train <= p.days_to_train and q.price_axis <= p.price_axis]
    if not better:
        return ""
    q = min(better, key=lambda q: q.days_to_train or 0.0)
    cheaper = "no dearer" if res.priced else "no more GPU-hours"
    return f"off the front: {q.label} GPUs is no slower and {cheaper}"


def rows(res: WhatIf) -> list[dict[str, str]]:
    """One display row per point (shared by the terminal, Markdown and HTML tables)."""
    out = []
    for p in res.points:
        out.append({
            "cluster": p.cluster, "GPUs": str(p.gpus), "seq": str(p.seq), "gbs": str(p.gbs),
            "layout": _layout(p),
            "tok/s/GPU": _num(p.tokens_per_s_per_gpu, ",.0f"),
            "MFU": _num(p.mfu, ".1%"), "step s": _num(p.step_time_s, ".3g"),
            "days": _num(p.days_to_train, ",.1f"), "GPU-hours": _num(p.gpu_hours, ",.0f"),
            "cost": money(p.cost_usd), "scaling": _num(p.scaling_efficiency, ".0%"),
            "pareto": "★" if p.pareto else "",
            "why": _why(p, res),
        })
    return out


def answers(res: WhatIf) -> list[str]:
    """The inverse questions' answers as sentences."""
    lines = []
    if res.days is not None:
        for a in res.days["answers"]:
            if a["gpus"] is None:
                lines.append(f"Within {res.days['target_days']:g} days on {a['cluster']}: "
                             f"no count tried is enough ({a['why']}).")
            else:
                cost = "" if a["cost_usd"] is None else f", ${a['cost_usd']:,.0f}"
                lines.append(f"Within {res.days['target_days']:g} days on {a['cluster']}: "
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
    return f"What-if: {res.model}, {res.tokens:.3g} tokens"


def markdown(res: WhatIf) -> str:
    """The report as Markdown: the sweep table, the Pareto front and the inverse answers."""
    table = rows(res)
    cols = list(table[0]) if table else []
    lines = [f"# {_title(res)}", "",
             f"{len(res.points)} points, {sum(p.fits for p in res.points)} fit; searched in "
             f"{res.seconds:.1f} s. ★ marks the Pareto front of time to train against "
             f"{'cost' if res.priced else 'GPU-hours (no --gpu-hour-price given)'}.", "",
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


# ---------------------------------------------------------------------------------------- HTML
def _svg(fig: object) -> str:
    """A matplotlib figure as an inline <svg> element (no XML prolog, no external refs)."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    return re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)  # Dublin Core links


def _series(points: Sequence[Point]) -> dict[str, list[Point]]:
    """Fitting points grouped by what varies along a throughput curve: one line per series."""
    series: dict[str, list[Point]] = {}
    multi_seq = len({p.seq for p in points}) > 1
    multi_prec = len({p.precision for p in points}) > 1
    multi_gbs = len({p.gbs for p in points}) > 1
    for p in points:
        if not p.fits:
            continue
        name = p.cluster + (f" seq{p.seq}" if multi_seq else "") + (
            f" gbs{p.gbs}" if multi_gbs else "") + (f" {p.precision}" if multi_prec else "")
        series.setdefault(name, []).append(p)
    return {k: sorted(v, key=lambda p: p.gpus) for k, v in series.items()}


# Labels are plain text: a cluster or model name holding `$…$` must not turn into matplotlib
# mathtext (where `$\\frac{$` is a parse error that would crash the report).
PLAIN_TEXT = {"svg.fonttype": "path", "font.size": 9, "text.parse_math": False}


def require_matplotlib() -> None:
    """Fail before a long sweep, not after it, when the HTML report cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SpecError("the HTML report draws its plots with matplotlib, which is not "
                        "installed: pip install 'moeplan[report]' (or write -o report.md)."
                        ) from None


def plots(res: WhatIf) -> dict[str, str]:
    """The three plots as inline SVG: throughput vs GPUs, time vs cost, memory per best plan."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plt.rcParams.update(PLAIN_TEXT)
    thousands = FuncFormatter(lambda x, _: f"{x:,.0f}" if abs(x) >= 10 else f"{x:g}")
    dollars = FuncFormatter(lambda x, _: f"${x:,.0f}")
    out: dict[str, str] = {}
    series = _series(res.points)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, pts in series.items():
        g = [p.gpus for p in pts]
        ax1.plot(g, [(p.tokens_per_s_per_gpu or 0) * p.gpus / 1e6 for p in pts], "o-",
                 label=name)
        ax2.plot(g, [p.tokens_per_s_per_gpu for p in pts], "o-", label=name)
        band = [(p.gpus, *p.tokens_interval) for p in pts if p.tokens_interval]
        if band:  # the best plan's 80 % interval (cost_models.uncertainty)
            ax2.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band],
                             alpha=0.15, label=f"{name} 80% interval")
    for ax, ylabel in ((ax1, "cluster throughput (M tokens/s)"), (ax2, "tokens/s per GPU")):
        ax.set_xscale("log", base=2)
        counts = sorted({p.gpus for pts in series.values() for p in pts})
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.minorticks_off()
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)  # a ratio is read off these axes: a 1 % drop must look like 1 %
        ax.yaxis.set_major_formatter(thousands)
        ax.grid(alpha=0.3)
        if series:
            ax.legend()
    fig.suptitle("Throughput against GPU count")
    out["throughput"] = _svg(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    fit = [p for p in res.points if p.fits and p.days_to_train is not None]
    by_cluster: dict[str, list[Point]] = {}
    for p in fit:
        by_cluster.setdefault(p.cluster, []).append(p)
    for name, pts in by_cluster.items():
        ax.scatter([p.price_axis for p in pts], [p.days_to_train for p in pts], label=name,
                   alpha=0.8)
        bars = [p for p in pts if p.days_interval]
        if bars:  # days at the interval's ends of throughput (cost moves with them)
            ax.errorbar([p.price_axis for p in bars], [p.days_to_train for p in bars],
                        yerr=[[p.days_to_train - p.days_interval[0] for p in bars],  # type: ignore
                              [p.days_interval[1] - p.days_to_train for p in bars]],  # type: ignore
                        fmt="none", ecolor="grey", alpha=0.6, capsize=2)
        for p in pts:
            ax.annotate(f"{p.cluster} × {p.gpus} GPUs", (p.price_axis, p.days_to_train),
                        fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    front = [res.points[i] for i in res.pareto]
    if front:
        front = sorted(front, key=lambda p: p.price_axis or 0.0)
        ax.plot([p.price_axis for p in front], [p.days_to_train for p in front], "k--",
                lw=1)
        ax.scatter([p.price_axis for p in front], [p.days_to_train for p in front], s=140,
                   facecolors="none", edgecolors="red", linewidths=1.5, label="Pareto front")
    ax.set_xlabel("cost (USD)" if res.priced else "GPU-hours")
    ax.xaxis.set_major_formatter(dollars if res.priced else thousands)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("days to train")
    ax.set_title(f"Time to train {res.tokens:.3g} tokens against "
                 f"{'cost' if res.priced else 'GPU-hours'}")
    ax.grid(alpha=0.3)
    if fit:
        ax.legend()
    out["pareto"] = _svg(fig)

    fig, ax = plt.subplots(figsize=(8, 0.45 * max(3, len(fit)) + 1.2))
    labels = [f"{p.cluster} × {p.gpus}" + (f" seq{p.seq}" if len(
        {q.seq for q in fit}) > 1 else "") for p in fit]
    left = [0.0] * len(fit)
    for part in MEMORY_PARTS:
        vals = [getattr(p.plan.estimate.memory, part) for p in fit]  # type: ignore[union-attr]
        ax.barh(labels, vals, left=left, label=part.removesuffix("_gb"))
        left = [a + b for a, b in zip(left, vals, strict=True)]
    for y, p in enumerate(fit):
        ax.plot([p.plan.cluster.hbm_gb] * 2, [y - 0.4, y + 0.4], "k-", lw=2,  # type: ignore
                label="HBM" if y == 0 else None)
    ax.set_xlabel("GB per GPU (most loaded GPU; black tick: HBM)")
    ax.set_title("Memory of each best plan")
    ax.invert_yaxis()
    if fit:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    out["memory"] = _svg(fig)
    return out


CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;background:#fff}
table{border-collapse:collapse;font-size:12px;margin:12px 0}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}
td:first-child,th{text-align:left}tr.pareto{background:#fff3c4}tr.nofit{color:#888}
figure{margin:16px 0}svg{max-width:100%;height:auto}"""


def html_report(res: WhatIf) -> str:
    """One self-contained HTML page: tables, answers, and the plots inlined as SVG."""
    table = rows(res)
    cols = list(table[0]) if table else []
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for p, r in zip(res.points, table, strict=True):
        cls = "pareto" if p.pareto else ("nofit" if not p.fits else "")
        cells = "".join(f"<td>{html.escape(v)}</td>" for v in r.values())
        body.append(f'<tr class="{cls}">{cells}</tr>')
    said = "".join(f"<li>{html.escape(a)}</li>" for a in answers(res))
    figs = plots(res)
    captions = {"throughput": "Throughput against GPUs, per cluster kind",
                "pareto": "Time to train against cost; the Pareto front circled",
                "memory": "Memory breakdown of each best plan"}
    fig_html = "".join(f'<figure id="{k}">{v}<figcaption>{html.escape(captions[k])}'
                       "</figcaption></figure>" for k, v in figs.items())
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>"
            f"{html.escape(_title(res))}</title><style>{CSS}</style></head><body>"
            f"<h1>{html.escape(_title(res))}</h1>"
            f"<p>{len(res.points)} points, {sum(p.fits for p in res.points)} fit; searched in "
            f"{res.seconds:.1f} s. Highlighted rows are on the Pareto front.</p>"
            f"<table><tr>{head}</tr>{''.join(body)}</table>"
            + (f"<h2>Answers</h2><ul>{said}</ul>" if said else "")
            + f"<h2>Plots</h2>{fig_html}</body></html>\n")


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
TIME_BARS = (("compute_s", "compute"), ("recompute_s", "recompute"), ("offload_s", "offload"),
             ("pp_bubble_s", "pipeline bubble"), ("exposed_comm_s", "exposed communication"))
COMM_BARS = (("tp_comm_s", "TP"), ("cp_comm_s", "CP"), ("ep_comm_s", "EP"), ("dp_comm_s", "DP"))


def rank_memory(plan: Plan) -> list[dict[str, float]]:
    """Per pipeline rank: weights, grads, optimizer, activations, buffers (GB), from the cost
    model's own per-rank accounting (the peak in the Estimate is the largest of these)."""
    from ..cost_models.estimate import estimate_breakdown
    from ..cost_models.memory import GB

    b = estimate_breakdown(plan.model, plan.cluster, plan.training, plan.layout, plan.choices,
                           check=False)
    return [{"weights": r.static.weights / GB, "grads": r.static.grads / GB,
             "optimizer": r.static.optimizer / GB, "activations": r.activation_bytes / GB,
             "buffers": r.buffer_bytes / GB} for r in b.ranks]


def plan_plots(plan: Plan) -> dict[str, str]:
    """The chosen plan's memory per pipeline rank and step-time breakdown, as inline SVG."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(PLAIN_TEXT)
    est = plan.estimate
    assert est is not None
    out: dict[str, str] = {}
    ranks = rank_memory(plan)
    fig, ax = plt.subplots(figsize=(8, 0.5 * max(3, len(ranks)) + 1.4))
    labels = [f"pp rank {i}" for i in range(len(ranks))]
    left = [0.0] * len(ranks)
    for part in ("weights", "grads", "optimizer", "activations", "buffers"):
        vals = [r[part] for r in ranks]
        ax.barh(labels, vals, left=left, label=part)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.axvline(plan.cluster.hbm_gb, color="k", lw=2, label=f"HBM {plan.cluster.hbm_gb:g} GB")
    from ..cost_models.calibration import calibration_for

    reserve = calibration_for(dict(plan.cluster.calibration or {})).reserve_gb
    if reserve > 0:
        ax.axvline(plan.cluster.hbm_gb - reserve, color="k", ls="--", lw=1,
                   label=f"budget (HBM − {reserve:g} GB reserve)")
    ax.set_xlim(left=0)
    ax.set_xlabel("GB per GPU")
    ax.set_title("Memory per pipeline rank")
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    out["memory"] = _svg(fig)

    fig, ax = plt.subplots(figsize=(8, 3.6))
    t = est.time
    names = [n for _, n in TIME_BARS] + [f"{n} comm (alone)" for _, n in COMM_BARS]
    vals = [getattr(t, k) for k, _ in TIME_BARS] + [getattr(t, k) for k, _ in COMM_BARS]
    colors = ["C0"] * len(TIME_BARS) + ["C7"] * len(COMM_BARS)
    ax.barh(names, vals, color=colors)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.axvline(est.step_time_s, color="k", lw=1.5)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds per step")
    ax.set_title("Step time breakdown")
    ax.invert_yaxis()
    ax.legend(handles=[Patch(color="C0", label="in the step (exposed parts)"),
                       Patch(color="C7", label="communication alone (partly hidden)"),
                       Line2D([], [], color="k", label=f"step {est.step_time_s:.3g} s")],
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    out["time"] = _svg(fig)
    return out


def _plan_cells(i: int, p: Plan) -> list[str]:
    e = p.estimate
    assert e is not None
    return [f"#{i + 1}", p.layout_summary(), p.choices_summary(), f"{e.step_time_s:.3g} s",
            f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.tflops_per_gpu:.0f}", f"{e.mfu:.1%}",
            f"{e.memory.peak_gb:.1f} / {p.cluster.hbm_gb:g} GB", e.bottleneck]


PLAN_ROWS = ("plan", "layout", "choices", "step time", "tokens/s/GPU", "TFLOPS/GPU", "MFU",
             "peak memory", "bottleneck")


def plan_report(plans: Sequence[Plan], title: str) -> str:
    """One self-contained HTML page: the plans side by side (one column each), then the chosen
    (first) plan's memory per pipeline rank and step-time breakdown, its explanation, and its
    assumptions and interval where the estimate carries them."""
    cells = [_plan_cells(i, p) for i, p in enumerate(plans)]
    rows_html = "".join(
        f"<tr><th>{html.escape(name)}</th>"
        + "".join(f"<td>{html.escape(c[j])}</td>" for c in cells) + "</tr>"
        for j, name in enumerate(PLAN_ROWS))
    best = plans[0]
    figs = plan_plots(best)
    captions = {"memory": "Memory of the chosen plan per pipeline rank, against HBM",
                "time": "Where the chosen plan's step time goes"}
    fig_html = "".join(f'<figure id="{k}">{v}<figcaption>{html.escape(captions[k])}'
                       "</figcaption></figure>" for k, v in figs.items())
    notes = list(best.explanation)
    est = best.estimate
    for extra in ("interval", "assumptions"):  # shown once estimates carry them
        value = getattr(est, extra, None)
        if value:
            notes.append(f"{extra}: {value}")
    notes += [f"warning: {w}" for w in (est.warnings if est else [])]
    said = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
            f"</title><style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<h2>Plans</h2><table>{rows_html}</table>"
            f"<h2>The chosen plan: {html.escape(best.summary())}</h2>{fig_html}"
            + (f"<ul>{said}</ul>" if said else "") + "</body></html>\n")


def write_plan_report(plans: Sequence[Plan], title: str, path: str | Path) -> Path:
    """`search|estimate --report PATH.html`."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise SpecError(f"--report {path}: the plan report is an .html file.")
    atomic_write_text(path, plan_report(plans, title))
    return path
