"""Shared test fixtures: paths and a CLI runner that goes through the real entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
DATA = TESTS / "data"
REPO = TESTS.parent
SHARED = REPO.parent / "shared"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `moeplan ARGS` as a user would (a fresh process), capturing both streams."""
    return subprocess.run([sys.executable, "-m", "moeplan", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli
