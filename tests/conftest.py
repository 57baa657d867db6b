"""Shared test fixtures: paths, a CLI runner that goes through the real entry point, and the
runner of the spawned-world worker scripts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
DATA = TESTS / "data"
REPO = TESTS.parent


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `moeplan ARGS` as a user would (a fresh process), capturing both streams."""
    return subprocess.run([sys.executable, "-m", "moeplan", *args], capture_output=True,
                          text=True, timeout=timeout)


_TORCH_FREE = ("import json, sys\n"
               "from moeplan.cli import main\n"
               "code = main(json.loads(sys.argv[1]))\n"
               "assert 'torch' not in sys.modules, 'this command imported torch'\n"
               "sys.exit(code)\n")


def run_cli_without_torch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`run_cli`, failing (exit 1, an AssertionError on stderr) if the command imported torch
    into its own process: the planner's commands and the launcher need none of it."""
    return subprocess.run([sys.executable, "-c", _TORCH_FREE, json.dumps(list(args))],
                          capture_output=True, text=True, timeout=timeout)


def run_world(script: str, arg: Path) -> None:
    """Run a spawned-world worker (`python tests/SCRIPT ARG`), failing with its stderr."""
    proc = subprocess.run([sys.executable, str(TESTS / script), str(arg)], capture_output=True,
                          text=True, timeout=600, cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture
def cli():
    return run_cli


# Fixtures that spawn a process world or train (tens of seconds on two cores): every test that
# uses one is slow, so `-m "not slow"` is the quick loop; .ci/run runs them all.
SPAWNING_FIXTURES = frozenset({"results", "runs", "ranks", "launch", "local_yaml", "saved"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SPAWNING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
