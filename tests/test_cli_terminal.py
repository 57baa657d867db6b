"""Terminal output fits the terminal: rendered in pseudo-terminals of 80, 100 and 120 columns,
every line fits and every number of the `--json` document appears whole on the screen.

Piped output is wide, so a test that captures stdout through a pipe never sees a narrow
terminal; these tests give the child a real pty with its window size set (TIOCSWINSZ) and
COLUMNS, as a terminal emulator would.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len

from moeplan import load_cluster, load_model, load_training
from moeplan.planner.report import rows
from moeplan.planner.whatif import Point, WhatIf, pareto_front
from moeplan.specs import Choices, Layout, Plan
from moeplan.terminal import Column, Progress, fit_line, pairs_lines, table_lines

from .conftest import REPO, run_cli

WIDTHS = (80, 100, 120)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
SEARCH = ("search", "--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "64",
          "--gbs", "1024")
ESTIMATE = ("estimate", "--model", "deepseek-v3", "--cluster", "h100", "--gpus", "256",
            "--gbs", "1024", "--pp", "4", "--vpp", "4", "--ep", "64")
WHATIF = ("whatif", "--model", "mixtral-8x7b", "--cluster", "h100,h200", "--gpus", "64",
          "--tokens", "1e12", "--gpu-hour-price", "2.5,3.2", "--workers", "1")


def render_in_pty(args: tuple[str, ...], columns: int, timeout: float = 120) -> str:
    """Run `moeplan ARGS` with stdout and stderr on a pty `columns` wide; the screen text."""
    return screen_of(raw_in_pty(args, columns, timeout), columns)


@functools.lru_cache(maxsize=16)
def raw_in_pty(args: tuple[str, ...], columns: int, timeout: float = 120) -> str:
    """What `moeplan ARGS` writes to a pty `columns` wide, control characters included
    (each run once per module: several claims are checked on one screen)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 500, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "500", "TERM": "xterm-256color"}
    proc = subprocess.Popen([sys.executable, "-m", "moeplan", *args], stdin=slave,
                            stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        proc.wait(timeout=timeout)
    assert proc.returncode in (0, 3), b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode()


def screen_of(raw: str, columns: int) -> str:
    """What a terminal `columns` wide shows after `raw`: a carriage return moves back to the
    start of the line, which the text after it overwrites (all of it after `ESC [K`). Every
    piece written must fit the width: a wider one would have wrapped as it was written,
    even if later overwritten."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        cur = ""
        for seg in line.split("\r"):
            text = ANSI.sub("", seg)
            assert cell_len(text) <= columns, f"written wider than {columns}: {text!r}"
            cur = text if "\x1b[K" in seg else text + cur[len(text):]
        lines.append(cur)
    return "\n".join(lines)


def json_of(args: tuple[str, ...]) -> dict:
    proc = run_cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def assert_fits_and_whole(screen: str, columns: int, numbers: list) -> None:
    """No line wider than the terminal (the terminal would wrap it mid-number), and every
    number present with no digit, comma or decimal glued to either side (not cut short)."""
    wide = [line for line in screen.split("\n") if cell_len(line) > columns]
    assert not wide, f"lines wider than {columns}: {wide}"
    for n in numbers:  # a set: the JSON's rounding may land a display digit either way
        ways = sorted(n) if isinstance(n, set) else [n]
        pattern = "|".join(r"(?<![\d.,])" + re.escape(w) + r"(?![\d,]|\.\d)" for w in ways)
        assert re.search(pattern, screen), f"{n!r} is not whole on the {columns}-column screen:\n" \
            f"{screen}"


@pytest.fixture(scope="module")
def search_doc() -> dict:
    return json_of(SEARCH)


@pytest.fixture(scope="module")
def estimate_doc() -> dict:
    return json_of(ESTIMATE)


@pytest.fixture(scope="module")
def whatif_doc() -> dict:
    return json_of(WHATIF)


def _estimate_numbers(e: dict) -> list[str]:
    return [f"{e['tokens_per_s_per_gpu']:,.0f}", f"{e['tflops_per_gpu']:.0f}", f"{e['mfu']:.1%}", f"{e['memory']['peak_gb']:.1f}"]


@pytest.mark.parametrize("columns", WIDTHS)
def test_search_table_fits_and_shows_every_number_whole(search_doc, columns):
    screen = render_in_pty(SEARCH, columns)
    nums = []
    for p in search_doc["plans"]:
        e = p["estimate"]
        nums += [f"{e['step_time_s']:.3g}", *_estimate_numbers(e)]
    nums.append(str(search_doc["plans"][0]["layout"]["world_size"]))
    assert_fits_and_whole(screen, columns, nums)
    assert "dist-opt" in screen and "next: " in screen  # the choice shown, and what to do next
    assert "priced on the current software stack" in " ".join(screen.split())


@pytest.mark.parametrize("columns", WIDTHS)
def test_estimate_fits_and_shows_every_number_whole(estimate_doc, columns):
    e = estimate_doc
    m = e["memory"]
    nums = [f"{e['step_time_s']:.3f}", *_estimate_numbers(e), "256"]
    nums += [f"{m[k]:.1f}" for k in ("weights_gb", "grads_gb", "optimizer_gb",
                                     "activations_gb", "buffers_gb")]
    nums += [f"{v:.3f}" for v in e["time"].values() if v]
    screen = render_in_pty(ESTIMATE, columns)
    assert_fits_and_whole(screen, columns, nums)
    assert "software stack" in screen and "current: Megatron Core" in " ".join(screen.split())


def test_an_estimate_carrying_a_measured_residual_shows_it_as_a_term_and_a_warning():
    """gpt-oss-120b in BF16 carries its measured residual (tests/test_model_residual.py): the
    80-column screen shows the unmodelled seconds beside the other terms, whole, and the
    warning that names them."""
    args = ("estimate", "--model", "gpt-oss-120b", "--cluster", "gb200-nvl72", "--gpus", "64",
            "--gbs", "1280", "--ep", "64", "--mbs", "4")
    e = json_of(args)
    assert e["unmodelled_s"] > 0
    screen = render_in_pty(args, 80)
    assert_fits_and_whole(screen, 80, [f"{e['step_time_s']:.3f}", f"{e['unmodelled_s']:.3f}"])
    assert "unmodelled (measured)" in screen
    assert "unmodelled time" in " ".join(screen.split())


@pytest.mark.parametrize("columns", WIDTHS)
def test_whatif_fits_and_shows_every_number_whole(whatif_doc, columns):
    nums = []
    for p in whatif_doc["points"]:
        assert p["fits"]
        nums += [str(p["gpus"]), f"{p['tokens_per_s_per_gpu']:,.0f}", f"{p['mfu']:.1%}",
                 f"{p['step_time_s']:.3g}", f"{p['days_to_train']:,.1f}",
                 {f"{p['gpu_hours'] + d:,.0f}" for d in (-0.05, 0.05)},  # JSON: 0.1 h
                 {f"${p['cost_usd'] + d:,.0f}" for d in (-0.005, 0.005)}]
    screen = render_in_pty(WHATIF, columns)
    assert_fits_and_whole(screen, columns, nums)
    assert "priced on the current software stack" in " ".join(screen.split())


# ------------------------------------------------------------------- the layout, without a pty
CELL = st.text(alphabet="abc019.,%×★-=|", min_size=0, max_size=14)
WORDS = st.lists(st.text(alphabet="abcdef=,|", min_size=1, max_size=12), max_size=8).map(
    " ".join)


@settings(max_examples=150, deadline=None)
@given(width=st.integers(20, 160), n=st.integers(1, 6),
       data=st.data())
def test_table_lines_never_cut_a_cell_and_fit_the_width(width, n, data):
    cols = [Column("#")] + [Column(f"c{i}", right=i % 2 == 0, fold=i) for i in range(n)]
    cols.append(Column("words", fold=-1))
    body = [[str(r)] + [data.draw(CELL) for _ in range(n)] + [data.draw(WORDS)]
            for r in range(data.draw(st.integers(1, 4)))]
    lines = [x.text for x in table_lines("a title that wraps at spaces", cols, body, width)]
    text = "\n".join(lines)
    tokens = {w for r in body for c in r for w in c.split(" ") if w}
    for line in lines:  # a line is only too wide when one unbreakable token is
        assert cell_len(line) <= width or any(cell_len(w) > width - 8 for w in tokens), line
    for r in body:
        for c in r[:-1]:
            assert c in text or c == "-"  # a folded "-" (no value) is left out
        assert all(w in text.split() or w in text for w in r[-1].split())


def test_pairs_lines_wrap_values_under_a_long_label():
    lines = [x.text for x in pairs_lines(None, [("a label " * 4, "12,345 tok/s 57.5%")], 30)]
    assert all(cell_len(s) <= 30 for s in lines) and "12,345" in "\n".join(lines)


# ------------------------------------------------------------------------------- vocabulary
def _plan(**choices) -> Plan:
    model = load_model("mixtral-8x7b")
    training = load_training(seq_len=4096, global_batch_size=64)
    layout = Layout.build(16, 64, tp=2, pp=2, vpp=2, ep=8, distributed_optimizer=False,
                          ep_overlap=True)
    return Plan(model=model, cluster=load_cluster("h100", 16), training=training, layout=layout,
                choices=Choices(**choices))


def test_plan_summary_names_every_choice_in_one_vocabulary():
    p = _plan(recompute=[["core_attn", "moe_act"], []], offload=["expert_fc1"],
              optimizer_offload_fraction=0.5)
    assert p.layout_summary() == "tp2 cp1 dp4 pp2 vpp2 ep8 etp1 edp1 mbs1×16 bf16"
    assert p.choices_summary() == ("alltoall ep-overlap no-dist-opt "
                                   "recompute=core_attn,moe_act|- offload=expert_fc1 "
                                   "optimizer-offload=0.5")
    same = _plan(recompute=["core_attn"], stage_layout="Et*8|t*9|t*7|t*8L")
    assert "recompute=core_attn " in same.summary()  # one set for every rank: written once
    assert same.choice_tokens()[-1].startswith("stages=E")


def test_search_explanation_speaks_the_table_vocabulary(search_doc):
    plans = [Plan.model_validate(p) for p in search_doc["plans"]]
    first = plans[0].explanation
    assert first[0] == f"#1: {plans[0].summary()}"
    why = next(line for line in first if "runner-up" in line)
    assert plans[1].summary() in why  # the runner-up, named as the table names it
    step_gap = plans[1].estimate.step_time_s - plans[0].estimate.step_time_s
    assert f"{abs(step_gap):.3g} s per step" in why


# -------------------------------------------------------------------------- what-if report
def test_whatif_rows_say_why_for_every_point_off_the_front():
    def pt(cluster, gpus, tps, price, fits=True):
        return Point(cluster, gpus, 4096, 1024, "bf16", fits=fits, tokens=1e12,
                     gpu_hour_price=price, tokens_per_s_per_gpu=tps if fits else None,
                     why=None if fits else "peak 90.1 GB exceeds 78 GB")

    points = [pt("h100", 64, 7000, 2.5), pt("h100", 128, 7000, 2.5), pt("h200", 64, 7000, 9.0),
              pt("b200", 8, 0, 5.0, fits=False)]
    front = pareto_front(points)
    for i in front:
        points[i].pareto = True
    table = rows(WhatIf("m", 1e12, points, front, seconds=0.1, priced=True))
    for p, r in zip(points, table, strict=True):
        assert bool(r["why"]) == (not p.pareto), (p, r)
    assert "h100 × 128" in table[2]["why"] and "90.1 GB" in table[3]["why"]
    assert table[0]["cost"].startswith("$") and "," in table[0]["cost"]


# ------------------------------------------------------------------------------- progress
PROGRESS = re.compile(r"^(searching|whatif|validating|validated|\[\d+/\d+\])")


def progress_pieces(raw: str) -> list[str]:
    """Every text written between carriage returns (the states of a redrawn line)."""
    return [ANSI.sub("", seg) for line in raw.replace("\r\n", "\n").split("\n")
            for seg in line.split("\r") if PROGRESS.match(ANSI.sub("", seg))]


@pytest.mark.parametrize("columns", [80])
def test_search_progress_is_one_line_redrawn_that_ends_at_100_percent(columns):
    raw = raw_in_pty(SEARCH, columns)
    pieces = progress_pieces(raw)
    assert len(pieces) >= 2 and "\rsearching: " in raw  # redrawn in place
    screen = screen_of(raw, columns)
    left = [ln for ln in screen.split("\n") if ln.startswith("searching")]
    assert len(left) == 1 and left[0].startswith("searching: 100%"), left  # one line stays
    # the last line names the count the progress counted ("of the 258 layouts that may fit")
    # beside all the valid ones, not another count alone
    counted = {m for piece in pieces for m in re.findall(r"of the ([\d,]+) layouts", piece)}
    assert len(counted) == 1 and f"({counted.pop()} that may fit)" in left[0], (pieces, left)


def test_whatif_progress_at_80_columns_never_breaks_inside_a_number():
    raw = raw_in_pty(WHATIF, 80)
    pieces = progress_pieces(raw)  # screen_of already checked each fits in 80 columns
    assert any(p.startswith("[2/2]") for p in pieces)
    for p in pieces:
        # a piece is the whole message or one cut at a space and marked: never mid-number
        assert not re.search(r"[\d,.]…|…[\d,.]", p), p
    assert screen_of(raw, 80).count("whatif: 100%") == 1


def test_progress_piped_is_plain_lines_and_on_a_terminal_one_line():
    clock = iter([0.0, 1.0, 2.0, 6.0, 7.0, 13.0, 14.0]).__next__
    piped: list[str] = []
    bar = Progress(piped.append, False, 80, every_s=5.0, clock=clock)
    for i in range(5):
        bar.update(f"step {i}")
    bar.done("done")
    assert piped == ["step 2\n", "step 4\n", "done\n"] and not any("\r" in x for x in piped)
    shown: list[str] = []
    tty = Progress(shown.append, True, 20, clock=iter([0.0, 0.0, 0.5, 1.0]).__next__)
    tty.update("searching: 1% of 12,345 layouts")
    tty.update("searching: 50% of 12,345 layouts")
    tty.done("searching: 100%, 24,690 valid layouts")
    assert shown[-1] == "\n" and all(x.startswith("\r") for x in shown[:-1])
    assert all(cell_len(ANSI.sub("", x[1:])) < 20 for x in shown[:-1])
    assert fit_line("searching: 100%, 24,690 valid layouts", 20) == "searching: 100%, …"


def test_quick_piped_search_prints_no_progress():
    r = run_cli(*SEARCH, "--top", "1")
    assert r.returncode == 0 and "searching" not in r.stderr and "\r" not in r.stderr


@pytest.mark.skipif(not (REPO.parent / "shared").exists(), reason="shared/ data missing")
def test_validate_shows_progress_and_groups_the_skip_reasons():
    screen = screen_of(raw_in_pty(("validate", str(REPO.parent / "shared" / "data" /
                                                   "published_runs.csv")), 100), 100)
    assert re.search(r"^validated: 100% \(\d+ rows: \d+ predicted, \d+ skipped\)$", screen,
                     re.M)
    groups = screen.split("rows skipped, by reason", 1)[1].split("\n* ")[0]
    assert re.search(r"^\s+\d+  no model preset \(R\d+", groups, re.M)
    doc = json_of(("validate", str(REPO.parent / "shared" / "data" / "published_runs.csv")))
    counted = sum(int(m) for m in re.findall(r"^ *(\d+)  \S", groups, re.M))
    assert counted == len(doc["skipped"])  # every skipped row in one group


@pytest.mark.parametrize("columns", [80, 120])
def test_validate_tells_the_runs_no_fit_saw_from_the_fit_rows_on_screen(tmp_path, columns):
    """A user's CSV of new runs is judged as new runs (MAPE, groups off as a whole, coverage);
    a shipped run in it is named in sample, beside the cross-validated figures that are the
    evidence for such rows. Every figure whole at the width."""
    import csv

    from moeplan.validation import read_rows

    seen = dict(next(r for r in read_rows(None) if r["id"] == "R0001"))
    new = {**seen, "id": "NEW", "tokens_per_s_per_gpu": "5000"}
    path = tmp_path / "mine.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, list(seen))
        w.writeheader()
        w.writerows([seen, new])
    shown = screen_of(raw_in_pty(("validate", str(path)), columns), columns)
    assert not [ln for ln in shown.split("\n") if cell_len(ln) > columns]
    screen = " ".join(shown.split())
    doc = json_of(("validate", str(path)))
    un, lomo = doc["unseen"], doc["cross_validated"]["leave_one_model_out"]
    assert "Held-out rows (runs the shipped calibration was not fitted on): 1." in screen
    assert (f"MAPE tokens/s/GPU {100 * un['mape_tokens_per_s']:.1f}% over 1 row publishing "
            "it") in screen
    assert "Fit rows (runs the shipped calibration was fitted on): 1" in screen
    assert "in sample, not evidence" in screen
    assert f"leave one model out {100 * lomo['mape']:.1f}%" in screen


# ------------------------------------------------------------------------ the ranking key
@pytest.mark.parametrize("columns", [80, 120])
def test_search_table_names_the_ranking_key_and_why_1_beats_2(search_doc, columns):
    screen = screen_of(raw_in_pty(SEARCH, columns), columns)
    assert "ranked by low end: the 80% interval's low end of tokens/s/GPU" in " ".join(
        screen.split())
    header = next(ln for ln in screen.split("\n") if ln.startswith("#  "))
    assert header.split()[1:3] == ["low", "end"]  # the key, next to the rank
    for p in search_doc["plans"]:
        assert f"{p['estimate']['interval']['tokens_per_s_per_gpu'][0]:,.0f}" in screen
    why = " ".join(screen.split("#1 ranks above #2", 1)[1].split("\n\n")[0].split())
    assert why.startswith("by the low end of the 80% interval")


@pytest.mark.parametrize("columns", [80, 100])
def test_the_command_list_names_each_command_without_a_cut_sentence(columns):
    """Click shortens a docstring's first sentence to fit the list ("runs...", "per
    cluster..."): each command carries a short help that fits whole."""
    screen = render_in_pty(("--help",), columns)
    listed = screen.split("Commands:", 1)[1]
    assert "..." not in listed and "…" not in listed, listed
    for name in ("estimate", "validate", "search", "whatif", "run", "groups", "export",
                 "calibrate", "specs", "checkpoint", "data"):
        assert re.search(rf"^\s+{name}\s+\S", listed, re.M), name


@pytest.mark.slow
def test_a_piped_run_keeps_each_step_line_and_note_whole_and_a_terminal_wraps_them(tmp_path):
    """Piped to a log, rank 0's step lines and the notes wrapped at 80 columns ("0.279 GB" /
    "53.3 ms" on two lines), so a log line no longer was one record; on a terminal they
    still wrap at its width."""
    plan = tmp_path / "plan.json"
    r = run_cli("estimate", "--model", str(REPO / "tests/data/tiny_qwen3_moe.yaml"),
                "--cluster", "h100", "--gpus", "1", "--seq", "64", "--gbs", "4", "-o",
                str(plan))
    assert r.returncode == 0, r.stderr
    out = tmp_path / ("a-run-directory-with-a-name-long-enough-to-pass-80-columns" * 2)
    r = run_cli("run", str(plan), "--steps", "3", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.splitlines()
    steps = [line for line in lines if re.match(r"step +\d+/3 ", line)]
    assert len(steps) == 3 and all(line.endswith(" ms") for line in steps), lines
    assert any(line.startswith("moeplan run ") and line.endswith(f"→ {out}") for line in lines)
    notes = [line for line in lines if "not judged against the predicted interval" in line]
    assert len(notes) == 1 and notes[0].startswith("note: ") and notes[0].endswith("on cpu")
    raw = raw_in_pty(("run", str(plan), "--steps", "2", "--out", str(tmp_path / "tty")), 80,
                     timeout=300)
    screen = screen_of(raw, 80)  # every piece written fits: rich wraps at the terminal's width
    assert "step    2/2  loss" in screen and "note: the step time is not judged" in screen


def test_a_search_says_its_best_plans_estimate_warnings_once_under_the_table():
    """gpt-oss-120b in BF16 carries its measured residual: `estimate` of the searched plan
    warns of the unmodelled seconds, and the search that chose it said nothing. It says the
    best plan's warnings once, under the table and its notes, whole at 80 columns."""
    args = ("search", "--model", "gpt-oss-120b", "--cluster", "gb200-nvl72", "--gpus", "72",
            "--gbs", "512")
    best = json_of(args)["plans"][0]["estimate"]
    assert best["warnings"] and best["unmodelled_s"] > 0
    screen = render_in_pty(args, 80)
    assert screen.count("warning (#1): ") == len(best["warnings"])
    assert screen.index("warning (#1): ") > screen.index("#1 ranks above #2")
    flat = " ".join(screen.split())
    assert all(" ".join(w.split()) in flat for w in best["warnings"])
    assert_fits_and_whole(screen, 80, [f"{best['unmodelled_s']:.3f}"])
