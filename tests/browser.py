"""Render an HTML report in headless Chromium and measure what a reader would see.

A copy of the page gets a script (the report itself has none) that runs after layout and
writes its measurements into the DOM, which `--dump-dom` prints: the page's scroll width
against the viewport, elements that end past the viewport's right edge, every SVG label's
real extent (overlapping another label, or leaving its figure), the visible text, the ranking
key cells and the width of the sentence columns. Debian's `chromium` is what CI installs
(README, test-command).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

MEASURE = r"""
(function () {
  const r = {}, de = document.documentElement;
  r.viewport = de.clientWidth;
  r.scrollWidth = Math.max(de.scrollWidth, document.body.scrollWidth);
  r.overflowing = [];
  for (const el of document.querySelectorAll('body *')) {
    if (el.closest('svg') && el.tagName.toLowerCase() !== 'svg') continue;
    const b = el.getBoundingClientRect();
    if (b.width > 0 && b.right > de.clientWidth + 0.5)
      r.overflowing.push(el.tagName + ' ' + (el.getAttribute('class') || '') + ' ' + Math.round(b.right));
  }
  r.overlaps = []; r.outside = []; r.labels = 0; r.svgs = 0;
  document.querySelectorAll('svg').forEach((s, si) => {
    r.svgs++;
    const sb = s.getBoundingClientRect();
    const ts = [...s.querySelectorAll('text')].map(t => [t.textContent, t.getBoundingClientRect()]);
    r.labels += ts.length;
    for (const [t, b] of ts)
      if (b.left < sb.left - 0.5 || b.right > sb.right + 0.5 || b.top < sb.top - 0.5 || b.bottom > sb.bottom + 0.5)
        r.outside.push(t);
    for (let i = 0; i < ts.length; i++) for (let j = i + 1; j < ts.length; j++) {
      const a = ts[i][1], b = ts[j][1];
      if (a.left < b.right - 0.5 && b.left < a.right - 0.5 && a.top < b.bottom - 0.5 && b.top < a.bottom - 0.5)
        r.overlaps.push([ts[i][0], ts[j][0], si]);
    }
  });
  r.keys = [...document.querySelectorAll('td.key')].map(e => [e.dataset.label, e.textContent,
    e.getBoundingClientRect().width > 0 && getComputedStyle(e).display !== 'none']);
  r.words = [...document.querySelectorAll('td.words')].filter(e => e.textContent.length > 40)
    .map(e => Math.round(e.getBoundingClientRect().width));
  r.text = document.body.innerText;
  const pre = document.createElement('pre');
  pre.id = '__measured'; pre.textContent = JSON.stringify(r);
  document.body.appendChild(pre);
})();
"""


def measure(page: Path, width: int, workdir: Path) -> dict:
    """Chromium's layout of `page` in a window `width` px wide, measured by MEASURE."""
    assert CHROMIUM is not None
    copy = workdir / f"measured-{width}-{page.name}"
    copy.write_text(page.read_text().replace("</body>", f"<script>{MEASURE}</script></body>"))
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={workdir / 'profile'}", f"--window-size={width},1000",
         "--virtual-time-budget=5000", "--dump-dom", copy.resolve().as_uri()],
        capture_output=True, text=True, timeout=120, check=False)
    found = re.search(r'<pre id="__measured">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"chromium printed no measurements: {proc.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def print_pdf(page: Path, workdir: Path) -> bytes:
    """The page printed to PDF by Chromium (its print styles, A4 landscape)."""
    assert CHROMIUM is not None
    pdf = workdir / (page.stem + ".pdf")
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--disable-background-networking", f"--user-data-dir={workdir / 'profile'}",
                    "--no-pdf-header-footer", f"--print-to-pdf={pdf}",
                    page.resolve().as_uri()], capture_output=True, timeout=120, check=False)
    assert pdf.is_file(), "chromium printed no PDF"
    return pdf.read_bytes()
