"""Every example command in the README runs and exits 0 (STYLE: the README is executed)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from .conftest import REPO


def example_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("Examples:", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()
            if line.strip().startswith("moeplan ")]


def test_readme_has_examples():
    assert len(example_commands()) >= 8


def test_readme_examples_run_in_order(tmp_path):
    hf = REPO / "tests" / "data" / "hf" / "qwen3-30b-a3b.json"
    for cmd in example_commands():
        cmd = cmd.replace("path/to/config.json", str(hf))
        argv = [sys.executable, "-m", "moeplan", *shlex.split(cmd)[1:]]
        r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
