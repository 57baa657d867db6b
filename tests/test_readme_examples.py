"""Every example command in the README runs, as written, after the README's own install.

The README installs the planner alone (`pip install -e .`); `moeplan run` needs the runtime
(`pip install "moeplan[run]"`), and its example says so. Each example runs in a fresh
interpreter in which every package only an extra brings (matplotlib, torch, transformers, ...)
cannot be imported, as on a machine with the plain install; a `moeplan run` example gets the
runtime's packages back. An `estimate` example whose plan does not fit must say so, both in
its README comment and in its output (it is never silent).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from .conftest import REPO

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

IMPORT_NAMES = {"megatron-core": "megatron", "transformer_engine": "transformer_engine",
                "PyYAML": "yaml", "PuLP": "pulp"}
# a minimal `python -m moeplan` in which the named top-level packages are not installed
PLAIN = """
import sys
hidden = set(sys.argv[1].split(','))
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in hidden:
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, NotInstalled())
from moeplan.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _names(reqs: list[str]) -> set[str]:
    out = set()
    for r in reqs:
        name = re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0]
        out.add(IMPORT_NAMES.get(name, name.replace("-", "_")))
    return out


def extras_only() -> tuple[set[str], set[str]]:
    """(packages only the extras bring, those `[run]` brings): the import names to hide."""
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs Python 3.11's tomllib")
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plain = _names(meta["dependencies"])
    extra = set().union(*(_names(v) for v in meta["optional-dependencies"].values()))
    return extra - plain, _names(meta["optional-dependencies"]["run"]) - plain


def examples() -> list[tuple[str, str]]:
    """(command, its README comment) for each line of the Examples block."""
    text = (REPO / "README.md").read_text()
    block = text.split("Examples:", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        if line.strip().startswith("moeplan "):
            cmd, _, comment = line.partition("  #")
            out.append((cmd.strip(), comment.strip()))
    return out


def test_readme_has_examples():
    assert len(examples()) >= 8


def test_the_plain_install_hides_what_the_extras_add():
    hidden, run = extras_only()
    assert {"torch", "transformers", "megatron", "safetensors"} <= hidden
    assert "torch" in run and not {"pydantic", "pulp", "yaml", "numpy"} & hidden
    assert "matplotlib" not in hidden  # no extra brings a plotting library any more


def test_readme_examples_run_in_order_on_the_plain_install(tmp_path):
    hidden, run_extra = extras_only()
    hidden |= {"matplotlib"}  # reports draw their own charts: no plotting library either
    hf = REPO / "tests" / "data" / "hf" / "qwen3-30b-a3b.json"
    for cmd, comment in examples():
        cmd = cmd.replace("path/to/config.json", str(hf))
        argv = shlex.split(cmd)[1:]
        needs_run = "moeplan[run]" in comment
        assert needs_run == (argv[0] == "run"), f"say which install `{cmd}` needs"
        hide = hidden - run_extra if needs_run else hidden
        r = subprocess.run([sys.executable, "-c", PLAIN, ",".join(sorted(hide)), *argv],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
        if argv[0] == "estimate" and "--json" not in argv:
            loud = "DOES NOT FIT" in r.stdout
            assert loud == ("does not fit" in comment), (cmd, comment, r.stdout[:300])
    assert "<svg" in (tmp_path / "plan.html").read_text()
    assert "<svg" in (tmp_path / "report.html").read_text()
