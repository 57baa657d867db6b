"""`pip install moeplan` is the planner without torch; `moeplan[run]` adds the runtime.

The planner commands are run in a fresh interpreter in which `import torch` fails (a
`sys.meta_path` finder refuses it, as on a machine where torch was never installed), so any
import of torch on their path, however indirect, fails the test; `moeplan run` there must exit 2
and say what to install.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from .conftest import REPO

NO_TORCH = textwrap.dedent("""
    import contextlib, io, json, sys

    class NoTorch:
        '''Refuse torch as an interpreter without it would.'''
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTorch())
    from moeplan.cli import main

    results = []
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        results.append({"argv": argv, "code": code, "out": out.getvalue(),
                        "err": err.getvalue()})
    results.append({"torch_loaded": any(m == "torch" or m.startswith("torch.")
                                        for m in sys.modules)})
    sys.__stdout__.write(json.dumps(results))
""")


def run_without_torch(commands: list[list[str]], cwd) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps(commands)], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                               "COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_plain_install_does_not_pull_torch_and_run_adds_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in meta["dependencies"] if d.lower().startswith("torch")]
    extras = meta["optional-dependencies"]
    assert "torch>=2.4" in extras["run"] and "torch>=2.4" in extras["test"]


def test_planner_commands_work_without_torch_and_run_says_what_to_install(tmp_path):
    plan = str(tmp_path / "plan.json")
    commands = [
        ["specs", "list"],
        ["specs", "show", "deepseek-v3", "--json"],
        ["search", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "8",
         "--gbs", "64", "--top", "2", "-o", plan],
        ["estimate", plan, "--json"],
        ["specs", "validate", plan],
        ["whatif", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "8",
         "--gbs", "64", "--tokens", "1e9", "--workers", "1"],
        ["export", plan, "--format", "megatron"],
        ["export", plan, "--format", "slurm"],
        ["groups", "--gpus", "8", "--tp", "2", "--ep", "4", "--json"],
        ["run", plan, "--steps", "1"],
        ["calibrate", "--quick"],
    ]
    *results, last = run_without_torch(commands, tmp_path)
    assert last == {"torch_loaded": False}
    for r in results[:-2]:
        assert r["code"] == 0, r
        assert "Traceback" not in r["err"]
    assert json.loads(results[3]["out"])["step_time_s"] > 0
    assert "--tensor-model-parallel-size" in results[6]["out"]
    assert "#SBATCH --nodes=1" in results[7]["out"]
    for r in results[-2:]:  # run and calibrate
        assert r["code"] == 2 and "Traceback" not in r["err"], r
        said = " ".join(r["err"].split())
        assert "PyTorch, which is not installed" in said and "pip install 'moeplan[run]'" in said
