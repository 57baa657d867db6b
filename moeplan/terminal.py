"""Tables that fit the terminal: whole columns fold onto a second line, nothing is ever cut.

Why: a truncated number reads as a wrong number ("9.1" for 9.18 s, "6" for 64 GPUs). Rich's
tables shrink no-wrap columns with an ellipsis when the terminal is narrow, so these renderers lay
out plain text themselves: each column is as wide as its widest cell; when the row does not fit,
the lowest-priority columns leave the row and become `name: value` pairs on indented lines under
it, until it does; at the narrowest every column but the key folds, which is a stacked record
view. Text is wrapped only at spaces, and a single word longer than the line is left whole.

Pure functions of strings and a width (no console, no I/O), so they are tested directly; the CLI
prints the lines they return. `Progress` is the one stateful piece: it writes through the
function it is given. `make_console` makes the rich consoles the CLI and the run's rank 0 print
through.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len

if TYPE_CHECKING:
    from rich.console import Console

PIPE_WIDTH = 200  # piped output (no terminal, no COLUMNS): wide, as before, for grep and logs
GAP = "  "
INDENT = "    "
GLUE = "\0"


@dataclass(frozen=True)
class Column:
    """One table column. `fold`: None never folds (the row key and the headline numbers);
    otherwise lower values fold first. `right`: right-align (numbers)."""

    name: str
    right: bool = False
    fold: int | None = None


@dataclass(frozen=True)
class Line:
    text: str
    style: str | None = None


def plural(n: int | float, noun: str, nouns: str | None = None) -> str:
    """`1 run`, `2 runs`, `1,024 runs`, `1.5 days`: a count and its noun, agreeing (`nouns`:
    a plural other than noun + s, `processes`)."""
    shown = f"{n:,}" if isinstance(n, int) else f"{n:g}"
    return f"{shown} {noun}" if n == 1 else f"{shown} {nouns or noun + 's'}"


def figure(x: float) -> str:
    """A rate as a table shows it: whole above 100 (`1,393`), else three significant digits, so
    that a CPU host's 0.0312 TFLOPS does not read as 0 beside its MFU."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def share(x: float) -> str:
    """A fraction as a percentage with one decimal (`6.4%`), or two significant digits below
    0.1% (`0.00013%`), never a bare 0.0% beside a figure that is not zero."""
    return f"{x:.1%}" if x >= 0.001 or x == 0 else f"{x * 100:.2g}%"


def screen_width(is_terminal: bool, console_width: int) -> int:
    """The width to lay out for: the terminal's, or COLUMNS, else wide for pipes."""
    if is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return max(20, console_width)
    return PIPE_WIDTH


def make_console(stderr: bool = False, **options: Any) -> Console:
    """A rich console for stdout or stderr. On a terminal it is rich's own: lines word-wrap at
    the terminal's width. Piped (a log file, CI), rich would hard-wrap every line at 80 columns,
    splitting one log record over two lines ("0.279 GB" / "53.3 ms") that grep and log readers
    then see apart; there each print is written whole (soft wrap) and tables are laid out as
    wide as `screen_width` lays out pipes."""
    from rich.console import Console

    console = Console(stderr=stderr, **options)
    if not console.is_terminal:
        console.soft_wrap = True
        if not os.environ.get("COLUMNS", "").isdigit():
            console.width = PIPE_WIDTH
    return console


def _pieces(word: str, room: int) -> list[str]:
    """A word too long for a line, split after `,` or `|` (list separators, never inside a
    number) into pieces of at most `room` cells where it can be; else the word whole."""
    if cell_len(word) <= room:
        return [word]
    parts = re.findall(r"[^,|]*[,|]|[^,|]+$", word)
    out, cur = [], ""
    for p in parts:
        if cur and cell_len(cur + p) > room:
            out.append(cur)
            cur = p
        else:
            cur += p
    pieces = [*out, cur] if cur else out
    return pieces[:1] + [GLUE + p for p in pieces[1:]]  # GLUE: joins without a space


def wrap(text: str, width: int, indent: str = "", first: str = "") -> list[str]:
    """Greedy word wrap at spaces (and inside an over-long list at its separators); `first`
    prefixes line one, `indent` the others."""
    lines, cur = [], first
    room = max(8, width - cell_len(indent))
    words = [p for w in text.split(" ") for p in _pieces(w, room)]
    for word in words:
        if not word:
            continue
        glued, word = word.startswith(GLUE), word.removeprefix(GLUE)
        bare = cur in (first, indent)
        cand = cur + word if bare or glued else f"{cur} {word}"
        if cell_len(cand) <= width or bare:
            cur = cand
        else:
            lines.append(cur)
            cur = indent + word
    if cur.strip() or not lines:
        lines.append(cur)
    return lines


def _widths(columns: list[Column], rows: list[list[str]]) -> list[int]:
    return [max([cell_len(c.name)] + [cell_len(r[i]) for r in rows])
            for i, c in enumerate(columns)]


def _cell(text: str, width: int, right: bool) -> str:
    pad = " " * (width - cell_len(text))
    return pad + text if right else text + pad


def table_lines(title: str | None, columns: list[Column], rows: list[list[str]], width: int,
                styles: list[str | None] | None = None) -> list[Line]:
    """The table laid out for `width` columns: inline columns, then folded `name: value` lines
    per row. Folding removes whole columns in `fold` order until the inline part fits."""
    styles = styles or [None] * len(rows)
    inline = list(range(len(columns)))
    order = sorted((i for i, c in enumerate(columns) if c.fold is not None),
                   key=lambda i: (columns[i].fold, -i))
    widths = _widths(columns, rows)

    def row_width(keep: list[int]) -> int:
        return sum(widths[i] for i in keep) + len(GAP) * (len(keep) - 1)

    folded: list[int] = []
    for i in order:
        if row_width(inline) <= width:
            break
        inline.remove(i)
        folded.append(i)
    folded.sort()
    out: list[Line] = []
    if title:
        out += [Line(s, "bold") for s in wrap(title, width, "  ")]
    header = GAP.join(_cell(columns[i].name, widths[i], columns[i].right) for i in inline)
    out.append(Line(header.rstrip(), "bold"))
    out.append(Line("─" * min(width, max(cell_len(header.rstrip()), 1)), "dim"))
    for r, style in zip(rows, styles, strict=True):
        out.append(Line(GAP.join(_cell(r[i], widths[i], columns[i].right)
                                 for i in inline).rstrip(), style))
        pairs = [f"{columns[i].name}: {r[i]}" for i in folded if r[i] not in ("", "-")]
        if pairs:
            out += [Line(s, style) for s in _pack(pairs, width)]
    return out


def _pack(pairs: list[str], width: int) -> list[str]:
    """`name: value` pairs on indented lines, several to a line where they fit, a long one
    wrapped on its own (continuation lines indented further)."""
    lines: list[str] = []
    cur = ""
    for p in pairs:
        cand = f"{cur}{GAP}{p}" if cur else INDENT + p
        if cell_len(cand) <= width:
            cur = cand
            continue
        if cur:
            lines.append(cur)
        if cell_len(INDENT + p) <= width:
            cur = INDENT + p
        else:
            lines += wrap(p, width, INDENT + "  ", INDENT)
            cur = ""
    if cur:
        lines.append(cur)
    return lines


def pairs_lines(title: str | None, pairs: list[tuple[str, str]], width: int) -> list[Line]:
    """A two-column label/value view: values wrap at spaces beside their label, or under it
    (indented) when the label leaves too little room."""
    out: list[Line] = [Line(s, "bold") for s in wrap(title, width, "  ")] if title else []
    label_w = max((cell_len(k) for k, _ in pairs), default=0)
    room = width - label_w - len(GAP)
    for k, v in pairs:
        if room >= 24:
            lines = wrap(v, width, " " * (label_w + len(GAP)), k + " " * (label_w - cell_len(k))
                         + GAP)
        else:
            lines = wrap(k, width, "  ") + wrap(v, width, INDENT, INDENT)
        out += [Line(s) for s in lines]
    return out


def fit_line(text: str, width: int) -> str:
    """`text` on one line of a `width`-column terminal: whole when it fits (one column kept
    free, so the cursor never wraps), else cut at a space and marked with `…`, so a number is
    never split across lines or cut short."""
    room = max(8, width - 1)
    if cell_len(text) <= room:
        return text
    words, out = text.split(" "), ""
    for w in words:
        cand = f"{out} {w}" if out else w
        if cell_len(cand + " …") > room:
            break
        out = cand
    return (out + " …") if out else text[: room - 1] + "…"


class Progress:
    """Progress of a long command on stderr.

    On a terminal: one line, rewritten in place (carriage return, then clear to the end of
    the line), clipped by `fit_line` so it never wraps, and left showing its last text when
    `done` is called. Piped (a log, CI): plain lines, at most one per `every_s` seconds except
    those `update` is told to keep (`force`), and the last one, so a log gets a heartbeat
    without a line per second. Why both: a terminal redraws, a log file only appends.
    """

    def __init__(self, write: Callable[[str], None], is_terminal: bool, width: int,
                 every_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.write, self.tty, self.width = write, is_terminal, width
        self.every_s, self.clock = every_s, clock
        self.last_shown = clock()
        self.shown = ""
        self.pending = ""
        self.printed = False

    REDRAW_S = 0.1  # a terminal redraws at most ten times a second (slow links stay calm)

    def update(self, text: str, force: bool = False) -> None:
        if self.tty:
            self.pending = text
            now = self.clock()
            if force or not self.shown or now - self.last_shown >= self.REDRAW_S:
                self._draw(text)
                self.last_shown = now
            return
        now = self.clock()
        if force or now - self.last_shown >= self.every_s:
            self.write(text + "\n")
            self.last_shown, self.pending, self.printed = now, "", True
        else:
            self.pending = text

    def _draw(self, text: str) -> None:
        line = fit_line(text, self.width)
        if line != self.shown:
            self.write("\r" + line + "\x1b[K")
            self.shown = line

    def done(self, text: str | None = None) -> None:
        """The final state: on a terminal the line stays (ended by a newline); piped, the
        last text is printed when any progress was, so a log ends with where it got to."""
        if self.tty:
            final = text if text is not None else self.pending
            if final:
                self._draw(final)
            if self.shown:
                self.write("\n")
            self.shown, self.pending = "", ""
            return
        final = text if text is not None else self.pending
        if final and self.printed:
            self.write(final + "\n")
