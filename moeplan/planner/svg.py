"""Charts as inline SVG, written in plain Python: the reports' only drawing code.

Why no plotting library: the reports must work right after the plain install
(`pip install moeplan` has no plotting dependency), open offline as one file, print, and keep
every label plain text (an SVG `<text>`: no mathtext, so `$1,234` is a price, not a formula).
Drawing the few chart kinds the reports need here also lets the layout know the extent of every
label before it places it: `text_width` uses the advance widths of DejaVu Sans, the font the
charts ask for first (Verdana, the fallback, has about the same), times a small safety factor,
so a label goes only where it overlaps no other label or marker and stays inside its figure.
The browser test (tests/test_reports.py) measures the real extents in Chromium.

Pure functions of numbers and strings returning SVG text; no I/O.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

FONT = "'DejaVu Sans', Verdana, sans-serif"
# DejaVu Sans advance widths of ASCII 32..126, in thousandths of an em (from DejaVuSans.ttf)
_ASCII = (318, 401, 460, 838, 636, 950, 780, 275, 390, 390, 500, 838, 318, 361, 318, 337, 636,
          636, 636, 636, 636, 636, 636, 636, 636, 636, 337, 337, 838, 838, 838, 531, 1000, 684,
          686, 698, 770, 632, 575, 775, 752, 295, 295, 656, 557, 863, 748, 787, 603, 787, 695,
          635, 611, 732, 684, 989, 685, 611, 685, 390, 337, 390, 838, 500, 500, 613, 635, 550,
          635, 615, 352, 635, 634, 278, 278, 579, 278, 974, 634, 612, 635, 635, 411, 521, 392,
          634, 592, 818, 592, 592, 525, 636, 337, 636, 838)
_OTHER = {"×": 838, "−": 838, "–": 500, "—": 1000, "★": 896, "…": 1000, "≥": 838, "≤": 838,
          "·": 318, "µ": 636, "→": 838, "%": 950}
SAFETY = 1.08  # fonts the browser may substitute run a few per cent wider
ASCENT, DESCENT = 0.93, 0.24  # of the font size, DejaVu Sans

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")
INK, GRID, MUTED = "#222", "#e3e3e3", "#666"


def text_width(text: str, size: float) -> float:
    """Rendered width of `text` at font size `size` (same units), slightly overestimated."""
    em = sum(_ASCII[o - 32] if 32 <= (o := ord(c)) < 127 else _OTHER.get(c, 1000)
             for c in text)
    return em * size * SAFETY / 1000


def esc(text: str) -> str:
    return html.escape(text, quote=True)


def fmt_num(x: float) -> str:
    """A tick value: thousands separators, no needless decimals."""
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:,.3g}"


@dataclass(frozen=True)
class Box:
    """An axis-aligned rectangle (x0 < x1, y0 < y1), in SVG user units."""

    x0: float
    y0: float
    x1: float
    y1: float

    def overlaps(self, other: Box, pad: float = 0.0) -> bool:
        return (self.x0 < other.x1 + pad and other.x0 < self.x1 + pad
                and self.y0 < other.y1 + pad and other.y0 < self.y1 + pad)

    def inside(self, other: Box) -> bool:
        return (self.x0 >= other.x0 and self.x1 <= other.x1 and self.y0 >= other.y0
                and self.y1 <= other.y1)


def text_box(x: float, y: float, text: str, size: float, anchor: str = "start") -> Box:
    """The box `<text x y>` covers: y is the baseline; anchor as SVG's text-anchor."""
    w = text_width(text, size)
    x0 = x - w if anchor == "end" else x - w / 2 if anchor == "middle" else x
    return Box(x0, y - ASCENT * size, x0 + w, y + DESCENT * size)


@dataclass
class Canvas:
    """An SVG being drawn: elements in order, and the boxes labels must keep clear of."""

    width: float
    height: float
    title: str
    parts: list[str] = field(default_factory=list)
    labels: list[Box] = field(default_factory=list)
    marks: list[Box] = field(default_factory=list)

    @property
    def frame(self) -> Box:
        return Box(0, 0, self.width, self.height)

    def rect(self, x: float, y: float, w: float, h: float, fill: str, stroke: str | None = None,
             tip: str | None = None, opacity: float | None = None, dash: bool = False) -> None:
        attrs = f'x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{max(h, 0):.2f}" ' \
                f'fill="{fill}"'
        if stroke:
            attrs += f' stroke="{stroke}" stroke-width="1"'
        if dash:
            attrs += ' stroke-dasharray="3 2"'
        if opacity is not None:
            attrs += f' fill-opacity="{opacity}"'
        self.parts.append(f"<rect {attrs}><title>{esc(tip)}</title></rect>" if tip
                          else f"<rect {attrs}/>")

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = INK,
             width: float = 1.0, dash: str | None = None) -> None:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" '
                          f'stroke="{stroke}" stroke-width="{width}"{d}/>')

    def polyline(self, pts: Sequence[tuple[float, float]], stroke: str, width: float = 1.5,
                 dash: str | None = None) -> None:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        path = " ".join(f"{x:.2f},{y:.2f}" for x, y in pts)
        self.parts.append(f'<polyline points="{path}" fill="none" stroke="{stroke}" '
                          f'stroke-width="{width}"{d}/>')

    def polygon(self, pts: Sequence[tuple[float, float]], fill: str, opacity: float) -> None:
        path = " ".join(f"{x:.2f},{y:.2f}" for x, y in pts)
        self.parts.append(f'<polygon points="{path}" fill="{fill}" fill-opacity="{opacity}" '
                          'stroke="none"/>')

    def circle(self, x: float, y: float, r: float, fill: str, stroke: str | None = None,
               tip: str | None = None) -> None:
        s = f' stroke="{stroke}" stroke-width="1.5"' if stroke else ""
        el = f'<circle cx="{x:.2f}" cy="{y:.2f}" r="{r}" fill="{fill}"{s}'
        self.parts.append(f"{el}><title>{esc(tip)}</title></circle>" if tip else el + "/>")
        self.marks.append(Box(x - r, y - r, x + r, y + r))

    def text(self, x: float, y: float, text: str, size: float = 12, anchor: str = "start",
             fill: str = INK, bold: bool = False) -> Box:
        """Draw a plain-text label (never markup or math) and remember where it is."""
        box = text_box(x, y, text, size * (1.12 if bold else 1.0), anchor)
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(f'<text x="{x:.2f}" y="{y:.2f}" font-size="{size}" '
                          f'text-anchor="{anchor}" fill="{fill}"{weight}>{esc(text)}</text>')
        self.labels.append(box)
        return box

    def free(self, box: Box, pad: float = 1.0, marks: bool = True) -> bool:
        """Whether a label may go at `box`: inside the figure, clear of labels (and marks)."""
        return box.inside(self.frame) and not any(
            box.overlaps(b, pad) for b in self.labels + (self.marks if marks else []))

    def svg(self) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {self.width:.0f} '
                f'{self.height:.0f}" width="{self.width:.0f}" height="{self.height:.0f}" '
                f'role="img" aria-label="{esc(self.title)}" font-family="{FONT}">'
                f"<title>{esc(self.title)}</title>" + "".join(self.parts) + "</svg>")


# ------------------------------------------------------------------------------- scales
def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2, 2.5 or 5 × 10^k."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    ticks, t = [], first
    while t < hi + step * 0.999:
        ticks.append(round(t, 10))
        t += step
    return ticks


@dataclass(frozen=True)
class Scale:
    """Data [d0, d1] onto pixels [p0, p1], linear or base-2 logarithmic."""

    d0: float
    d1: float
    p0: float
    p1: float
    log2: bool = False

    def __call__(self, v: float) -> float:
        f = math.log2 if self.log2 else (lambda x: x)
        a, b = f(self.d0), f(self.d1)
        return self.p0 + (f(v) - a) / ((b - a) or 1.0) * (self.p1 - self.p0)


def padded(lo: float, hi: float, share: float = 0.08) -> tuple[float, float]:
    """A data range with room at both ends, so no mark sits on the frame."""
    if hi <= lo:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * share
    return lo - pad, hi + pad


def _not_below_zero(span: tuple[float, float], lowest: float) -> tuple[float, float]:
    """Days and dollars are never negative: padding stops at zero for such data."""
    return (max(0.0, span[0]) if lowest >= 0 else span[0]), span[1]


# ------------------------------------------------------------------------------- legend
@dataclass(frozen=True)
class Key:
    """A legend entry: a swatch (`box`), a line sample (`line`, dashed with `dash`), or a
    ring (`ring`), then its text."""

    text: str
    color: str
    kind: str = "box"
    dash: str | None = None


def legend_height(keys: Sequence[Key], width: float, size: float = 11) -> float:
    return _legend(None, keys, 0, width, size)


def _legend(c: Canvas | None, keys: Sequence[Key], y: float, width: float, size: float = 11
            ) -> float:
    """Lay the keys out in rows that wrap at `width`; draw them when given a canvas. Returns
    the height used."""
    x, row, line_h = 8.0, 0, size * 1.6
    for k in keys:
        w = 22 + text_width(k.text, size) + 14
        if x + w > width - 4 and x > 8:
            x, row = 8.0, row + 1
        if c is not None:
            cy = y + row * line_h + line_h / 2
            if k.kind == "line":
                c.line(x, cy, x + 16, cy, k.color, 2, k.dash)
            elif k.kind == "ring":
                c.parts.append(f'<circle cx="{x + 8:.2f}" cy="{cy:.2f}" r="6" fill="none" '
                               f'stroke="{k.color}" stroke-width="1.5"/>')
            else:
                c.rect(x, cy - 6, 16, 12, k.color)
            c.text(x + 22, cy + size * 0.36, k.text, size)
        x += w
    return (row + 1) * line_h if keys else 0.0


# ------------------------------------------------------------------------------- charts
@dataclass(frozen=True)
class Ref:
    """A vertical reference line across a bar chart (a memory limit, the step time)."""

    value: float
    text: str
    color: str = INK
    dash: str | None = None


def hbar_chart(title: str, rows: Sequence[tuple[str, Sequence[float]]],
               parts: Sequence[tuple[str, str]], x_label: str, *, refs: Sequence[Ref] = (),
               total_fmt: Callable[[float], str] = fmt_num, width: float = 680,
               row_h: float = 24, tips: Sequence[str] | None = None,
               ref_marks: Sequence[Sequence[float]] | None = None) -> str:
    """Horizontal stacked bars, one per row, `parts` = (name, colour) per segment; each bar's
    total printed at its end; reference lines (`refs`, across every row, or `ref_marks`: one
    tick per row for limits that differ by row) named in the legend."""
    size = 12
    label_w = max((text_width(r[0], size) for r in rows), default=0) + 12
    totals = [sum(v for v in vals if v > 0) for _, vals in rows]
    ends = [max([t, *(ref_marks[i] if ref_marks else ())]) for i, t in enumerate(totals)]
    total_w = max((text_width(total_fmt(t), 11) for t in totals), default=0) + 10
    top = 8.0
    x0, x1 = label_w, width - total_w - 6
    hi = max([*totals, *(r.value for r in refs),
              *(v for m in (ref_marks or []) for v in m), 1e-12])
    ticks = [t for t in nice_ticks(0, hi) if t >= 0]
    sx = Scale(0, ticks[-1], x0, x1)
    plot_h = row_h * len(rows)
    keys = [Key(n, c) for n, c in parts] + [Key(r.text, r.color, "line", r.dash) for r in refs]
    axis_h = 40
    leg_h = legend_height(keys, width)
    c = Canvas(width, top + plot_h + axis_h + leg_h + 6, title)
    for t in ticks:
        c.line(sx(t), top, sx(t), top + plot_h, GRID)
    for i, (name, vals) in enumerate(rows):
        y = top + i * row_h
        c.text(x0 - 8, y + row_h / 2 + 4, name, size, "end")
        left = 0.0
        for (part, color), v in zip(parts, vals, strict=True):
            if v <= 0:
                continue
            c.rect(sx(left), y + 4, sx(left + v) - sx(left), row_h - 8, color,
                   tip=f"{name}: {part} {total_fmt(v)}")
            left += v
        c.text(sx(ends[i]) + 5, y + row_h / 2 + 4, total_fmt(totals[i]), 11, fill=MUTED)
        for j, m in enumerate(ref_marks[i] if ref_marks else []):
            r = refs[j] if j < len(refs) else Ref(m, "")
            c.line(sx(m), y + 1, sx(m), y + row_h - 1, r.color, 2, r.dash)
    if not ref_marks:
        for r in refs:
            c.line(sx(r.value), top - 4, sx(r.value), top + plot_h + 2, r.color, 1.5, r.dash)
    _x_axis(c, sx, ticks, top + plot_h, x_label, fmt_num)
    _legend(c, keys, top + plot_h + axis_h, width)
    return c.svg()


def _x_axis(c: Canvas, sx: Scale, ticks: Sequence[float], y: float, label: str,
            fmt: Callable[[float], str]) -> None:
    """Axis line, tick labels that fit (a label that would touch the previous one is left
    out), and the axis title centred below."""
    c.line(sx.p0, y, sx.p1, y, MUTED)
    for t in ticks:
        x = sx(t)
        c.line(x, y, x, y + 4, MUTED)
        text = fmt(t)
        box = text_box(x, y + 16, text, 11, "middle")
        if c.free(box, 3, marks=False):
            c.text(x, y + 16, text, 11, "middle", MUTED)
    mid = (sx.p0 + sx.p1) / 2
    c.text(mid, y + 32, label, 11, "middle")


def _y_axis(c: Canvas, sy: Scale, ticks: Sequence[float], x: float, x_right: float, label: str,
            fmt: Callable[[float], str]) -> None:
    for t in ticks:
        y = sy(t)
        c.line(x, y, x_right, y, GRID)
        c.text(x - 6, y + 4, fmt(t), 11, "end", MUTED)
    c.line(x, sy.p0, x, sy.p1, MUTED)
    c.text(4, 14, label, 11)


@dataclass(frozen=True)
class Series:
    """A line of (x, y) points with an optional band of (x, lo, hi)."""

    name: str
    points: Sequence[tuple[float, float]]
    band: Sequence[tuple[float, float, float]] = ()


def line_chart(title: str, series: Sequence[Series], x_label: str, y_label: str, *,
               x_log2: bool = True, width: float = 620, height: float = 300,
               band_label: str = "80% interval") -> str:
    """Lines over a base-2 GPU-count axis (ticks at the counts themselves), y from zero so a
    ratio reads true; bands drawn under their line."""
    xs = sorted({x for s in series for x, _ in s.points})
    ys = [y for s in series for _, y in s.points] + [h for s in series for _, _, h in s.band]
    y_ticks = nice_ticks(0, max(ys, default=1.0) * 1.05)
    left = max((text_width(fmt_num(t), 11) for t in y_ticks), default=20) + 16
    keys = [Key(s.name, PALETTE[i % len(PALETTE)], "line") for i, s in enumerate(series)]
    if any(s.band for s in series):
        keys.append(Key(band_label, "#999"))
    leg_h = legend_height(keys, width)
    top, plot_h = 26.0, height - 26.0 - 40
    c = Canvas(width, height + leg_h, title)
    lo, hi = (xs[0], xs[-1]) if xs else (1, 2)
    if lo == hi:
        lo, hi = (lo / 2, hi * 2) if x_log2 else padded(lo, hi)
    span = (math.log2(hi) - math.log2(lo)) if x_log2 else (hi - lo)
    pad = span * 0.06
    d0, d1 = ((2 ** (math.log2(lo) - pad), 2 ** (math.log2(hi) + pad)) if x_log2
              else (lo - pad, hi + pad))
    sx = Scale(d0, d1, left, width - 16, x_log2)
    sy = Scale(0, y_ticks[-1], top + plot_h, top)
    _y_axis(c, sy, y_ticks, left, width - 16, y_label, fmt_num)
    for i, s in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        if len(s.band) > 1:
            band = sorted(s.band)
            c.polygon([(sx(x), sy(h)) for x, _, h in band]
                      + [(sx(x), sy(lo_)) for x, lo_, _ in reversed(band)], color, 0.15)
        elif len(s.band) == 1:
            x, lo_, h = s.band[0]
            c.rect(sx(x) - 4, sy(h), 8, sy(lo_) - sy(h), color, opacity=0.2)
        pts = sorted(s.points)
        c.polyline([(sx(x), sy(y)) for x, y in pts], color)
        for x, y in pts:
            c.circle(sx(x), sy(y), 3.5, color, tip=f"{s.name}: {x:g} GPUs, {fmt_num(y)}")
    _x_axis(c, sx, xs, top + plot_h, x_label, lambda v: f"{v:g}")
    _legend(c, keys, height, width)
    return c.svg()


@dataclass(frozen=True)
class Dot:
    """A scatter point: position, error bar on y, label, and the series it belongs to."""

    x: float
    y: float
    label: str
    series: str
    y_err: tuple[float, float] | None = None
    ring: bool = False  # drawn circled (the Pareto front)


def scatter_chart(title: str, dots: Sequence[Dot], x_label: str, y_label: str, *,
                  x_fmt: Callable[[float], str] = fmt_num, width: float = 620,
                  height: float = 360, front_label: str = "Pareto front") -> tuple[str, list[str]]:
    """Labelled points on axes that span the data (not from zero: the points spread across the
    plot instead of crowding an edge). Each label goes at the first of eight places around its
    point that overlaps nothing; a label with no free place is left off and returned, so the
    caller can list it under the figure. Returns (svg, unlabelled)."""
    names = list(dict.fromkeys(d.series for d in dots))
    color = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}
    keys = [Key(n, color[n], "box") for n in names]
    if any(d.ring for d in dots):
        keys.append(Key(front_label, "#c0392b", "ring"))
    leg_h = legend_height(keys, width)
    xs = [d.x for d in dots] or [0.0, 1.0]
    ys = [v for d in dots for v in ((d.y, *d.y_err) if d.y_err else (d.y,))] or [0.0, 1.0]
    x_ticks = nice_ticks(*_not_below_zero(padded(min(xs), max(xs), 0.12), min(xs)), 5)
    y_ticks = nice_ticks(*_not_below_zero(padded(min(ys), max(ys), 0.1), min(ys)), 5)
    left = max(text_width(fmt_num(t), 11) for t in y_ticks) + 16
    top, plot_h = 26.0, height - 26.0 - 40
    c = Canvas(width, height + leg_h, title)
    sx = Scale(x_ticks[0], x_ticks[-1], left, width - 16)
    sy = Scale(y_ticks[0], y_ticks[-1], top + plot_h, top)
    _y_axis(c, sy, y_ticks, left, width - 16, y_label, fmt_num)
    _x_axis(c, sx, x_ticks, top + plot_h, x_label, x_fmt)
    front = sorted((d for d in dots if d.ring), key=lambda d: d.x)
    if len(front) > 1:
        c.polyline([(sx(d.x), sy(d.y)) for d in front], INK, 1, "5 3")
    for d in dots:
        px, py = sx(d.x), sy(d.y)
        if d.y_err:
            c.line(px, sy(d.y_err[0]), px, sy(d.y_err[1]), "#999", 1.2)
            c.marks.append(Box(px - 1, sy(d.y_err[1]), px + 1, sy(d.y_err[0])))
        c.circle(px, py, 4.5, color[d.series], tip=f"{d.label}: {x_fmt(d.x)}, {fmt_num(d.y)}")
        if d.ring:
            c.circle(px, py, 8, "none", "#c0392b")
    plot = Box(left + 1, top, width - 16, top + plot_h)
    unlabelled = []
    for d in sorted(dots, key=lambda d: (d.x, d.y)):
        px, py = sx(d.x), sy(d.y)
        for dx, dy, anchor in ((11, -6, "start"), (11, 14, "start"), (-11, -6, "end"),
                               (-11, 14, "end"), (0, -13, "middle"), (0, 24, "middle"),
                               (14, 4, "start"), (-14, 4, "end")):
            box = text_box(px + dx, py + dy, d.label, 11, anchor)
            if box.inside(plot) and c.free(box, 2):
                c.text(px + dx, py + dy, d.label, 11, anchor)
                break
        else:
            unlabelled.append(d.label)
    _legend(c, keys, height, width)
    return c.svg(), unlabelled


def interval_strip(lo: float, point: float, hi: float, d0: float, d1: float,
                   tip: str, width: float = 150, height: float = 18) -> str:
    """A plan's 80 % interval as a bar on a scale shared by the table's rows: the bar from the
    low end to the high end, a tick at the low end (the robust ranking key), a dot at the
    point estimate."""
    s = Scale(d0, d1, 4, width - 4)
    c = Canvas(width, height, tip)
    c.line(4, height / 2, width - 4, height / 2, GRID, 1)
    c.rect(s(lo), height / 2 - 3, s(hi) - s(lo), 6, "#9ecae1", tip=tip)
    c.line(s(lo), 2, s(lo), height - 2, "#08519c", 2.5)
    c.circle(s(point), height / 2, 3.5, INK)
    return c.svg().replace("<svg ", '<svg class="strip" ', 1)


@dataclass(frozen=True)
class Block:
    """One forward or backward pass of a chunk on a pipeline rank, in seconds; `paired`
    blocks share their time with the other half of an EP-overlap pair."""

    rank: int
    start: float
    end: float
    kind: str  # "F" or "B"
    chunk: int
    mb: int
    paired: bool = False


def shade(dark: str, light: str, i: int, n: int) -> str:
    """The i-th of n colours from `dark` to `light` (model chunk i of n: darker is earlier)."""
    f = i / (n - 1) if n > 1 else 0.0
    a = [int(dark[k:k + 2], 16) for k in (1, 3, 5)]
    b = [int(light[k:k + 2], 16) for k in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b, strict=True))


F_SHADES, B_SHADES = ("#24507f", "#a9c8e8"), ("#a6510a", "#fbc58f")


def schedule_chart(title: str, blocks: Sequence[Block], pp: int, vpp: int, width: float = 1000
                   ) -> str:
    """Each pipeline rank's passes along time: forwards blue, backwards orange (one shade per
    model chunk), the micro-batch number inside where it fits, idle time (the bubble) blank.
    An EP-overlap pair is one slot: the forward on its top half, the backward on its bottom
    half, outlined together."""
    size = 12
    label_w = text_width(f"pp rank {pp - 1}", size) + 12
    row_h, top = 26.0, 8.0
    end = max((b.end for b in blocks), default=1.0)
    chunks = f", chunks 0–{vpp - 1} dark to light" if vpp > 1 else ""
    keys = [Key(f"forward{chunks}", shade(*F_SHADES, 0, 1)),
            Key(f"backward{chunks}", shade(*B_SHADES, 0, 1))]
    if any(b.paired for b in blocks):
        keys.append(Key("EP-overlap pair: one micro-batch's forward beside another's backward",
                        INK, "line"))
    plot_h = row_h * pp
    leg_h = legend_height(keys, width)
    c = Canvas(width, top + plot_h + 40 + leg_h + 6, title)
    ticks = nice_ticks(0, end)
    sx = Scale(0, ticks[-1], label_w, width - 12)
    for r in range(pp):
        y = top + r * row_h
        c.rect(label_w, y + 2, sx(end) - label_w, row_h - 4, "#f4f4f4")
        c.text(label_w - 8, y + row_h / 2 + 4, f"pp rank {r}", size, "end")
    pairs: dict[tuple[int, float], list[Block]] = {}
    for b in blocks:
        y = top + b.rank * row_h + 2
        h = row_h - 4
        if b.paired:
            pairs.setdefault((b.rank, b.start), []).append(b)
            h /= 2
            y += h if b.kind == "B" else 0
        fill = shade(*(F_SHADES if b.kind == "F" else B_SHADES), b.chunk, vpp)
        x0, x1 = sx(b.start), sx(b.end)
        c.rect(x0, y, x1 - x0, h, fill, "#fff",
               tip=f"pp rank {b.rank}: {'forward' if b.kind == 'F' else 'backward'} of "
                   f"micro-batch {b.mb}" + (f", chunk {b.chunk}" if vpp > 1 else ""))
        text, fs = str(b.mb), 9 if b.paired else 10
        if text_width(text, fs) <= x1 - x0 - 2:
            c.text((x0 + x1) / 2, y + h / 2 + fs * 0.35, text, fs, "middle",
                   "#fff" if b.chunk < max(1, vpp / 2) else INK)
    for (r, _), pair in pairs.items():
        b = pair[0]
        c.rect(sx(b.start), top + r * row_h + 2, sx(b.end) - sx(b.start), row_h - 4, "none",
               INK)
    _x_axis(c, sx, ticks, top + plot_h, "seconds from the start of the step", fmt_num)
    _legend(c, keys, top + plot_h + 40, width)
    return c.svg()
