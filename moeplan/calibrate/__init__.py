"""`moeplan calibrate`: measure this machine (host.py, micro.py, collectives.py), fit the cost
models' constants to it (fit.py), or refit them from measured runs (refit.py).

Microbenchmarks live here, not in cost_models/, which stays torch-free and I/O-free; fit.py and
refit.py import no torch either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ..fsio import atomic_write_text

HEADER = ("# Written by `moeplan calibrate`{how}. Use as --cluster FILE, or overlay its\n"
          "# `calibration` constants onto a preset with --calibration FILE.\n")


def validate_cluster(doc: dict[str, Any]) -> None:
    """Raise SpecError (naming the field) unless `doc` is a valid ClusterSpec."""
    from ..specs.cluster import ClusterSpec
    from ..specs.loader import build

    build(ClusterSpec, doc, "cluster spec", "moeplan calibrate")


def write_cluster_yaml(doc: dict[str, Any], path: str | Path, how: str = "") -> None:
    """Write a ClusterSpec document as YAML, validated first (a bad file is never written)."""
    validate_cluster(doc)
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)
    atomic_write_text(path, HEADER.format(how=how) + text)


def calibrate_machine(mode: str, nproc: int, dtype: str | None = None, name: str = "local",
                      progress: Callable[[str], None] = lambda _: None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ClusterSpec document, measurement report) for this machine under grid `mode`
    (quick, full or tiny)."""
    from dataclasses import asdict

    from .host import GRIDS, build_cluster, measure

    t0 = time.perf_counter()
    m = measure(GRIDS[mode], nproc, dtype, progress=progress)
    doc = build_cluster(m, name)
    validate_cluster(doc)
    m.seconds["total"] = time.perf_counter() - t0
    return doc, {"mode": mode, **asdict(m)}
