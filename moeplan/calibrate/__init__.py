"""`moeplan calibrate`: measure this machine (host.py, bench.py, micro.py, collectives.py), fit
the cost models' constants to it (fit.py), or refit them from measured runs (refit.py).

Microbenchmarks live here, not in cost_models/, which stays torch-free and I/O-free; fit.py and
refit.py import no torch either, nor does this module until a machine is measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .. import limits
from ..errors import SpecError, TorchMissing
from ..fsio import atomic_write_text
from ..terminal import plural

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


@dataclass(frozen=True)
class MachineOptions:
    """How `moeplan calibrate` measures this machine, its options resolved against the devices
    present."""

    mode: str   # the grid: quick, full or tiny
    nproc: int  # processes (devices) measured, and the collectives' world size
    gpu: bool

    @property
    def flag(self) -> str:
        """The option that picks this grid, as a user types it (the file's header names it):
        --quick and --full are flags of their own, the tiny grid only --grid tiny."""
        return "--grid tiny" if self.mode == "tiny" else f"--{self.mode}"


def machine_options(nproc: int | None = None, dtype: str | None = None,
                    quick: bool | None = None, grid: str | None = None) -> MachineOptions:
    """Resolve `--nproc`, `--dtype`, `--quick/--full` and `--grid` against this machine.

    Defaults: every GPU present, else min(4, CPU cores) processes; the quick grid on CPU (under
    two minutes), the full one on GPU. A count no host could have is refused before torch
    loads (SpecError); torch missing is TorchMissing, naming what to install.
    """
    if dtype not in (None, "fp32", "bf16"):
        raise SpecError(f"--dtype takes fp32 or bf16, got {limits.excerpt(dtype)}.")
    cpu_max = limits.max_cpu_procs()
    if nproc is not None:  # refused before torch loads when no host could have that many devices
        limits.check("--nproc", nproc, max(cpu_max, limits.MAX_DEVICES_PER_NODE),
                     "pass at most the devices present")
    try:
        import torch
    except ImportError:
        raise TorchMissing("moeplan calibrate") from None
    gpu = torch.cuda.is_available()
    n = nproc or (torch.cuda.device_count() if gpu else min(4, limits.usable_cpus()))
    if gpu and n > torch.cuda.device_count():
        raise SpecError(f"--nproc {n}: only {torch.cuda.device_count()} GPUs are present.")
    if not gpu:
        limits.check("--nproc", n, cpu_max, f"on CPU use at most {limits.PROCS_PER_CORE} "
                     f"processes per core ({limits.usable_cpus()} usable here)")
    if not gpu:
        _check_memory_per_process(n)
    mode = grid or ("quick" if quick or (quick is None and not gpu) else "full")
    if mode not in ("quick", "full", "tiny"):
        raise SpecError(f"--grid takes quick, full or tiny, got {limits.excerpt(mode)}.")
    return MachineOptions(mode, n, gpu)


def _check_memory_per_process(nproc: int) -> None:
    """A CPU host's device is its share of the machine's memory (`host.build_cluster`): a share
    no larger than the reserve and workspace every plan keeps free describes a device no plan
    fits, which the spec would refuse only after every benchmark had run. Refused first,
    naming --nproc."""
    import torch

    from ..cost_models.calibration import default_calibration
    from .host import total_memory_gb

    total = total_memory_gb(torch.device("cpu"))
    cal = default_calibration()
    kept = cal.reserve_gb + cal.workspace_gb
    if total / nproc <= kept:
        most = max(1, int(total / kept - 1e-9))
        raise SpecError(f"--nproc {nproc}: this host's {total:.1f} GB of memory gives each "
                        f"process {total / nproc:.1f} GB, no more than the {kept:g} GB every "
                        "plan keeps free (a reserve and a workspace), so no plan could fit its "
                        f"device; pass a smaller --nproc (at most {most}).")


def calibrate_machine(mode: str, nproc: int, dtype: str | None = None, name: str = "local",
                      progress: Callable[[str], None] = lambda _: None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ClusterSpec document, measurement report) for this machine under grid `mode`
    (quick, full or tiny)."""
    from dataclasses import asdict

    from .bench import GRIDS
    from .host import build_cluster, device_preset, measure

    t0 = time.perf_counter()
    m = measure(GRIDS[mode], nproc, dtype, progress=progress)
    doc = build_cluster(m, name)
    validate_cluster(doc)
    m.seconds["total"] = time.perf_counter() - t0
    preset = device_preset(m.device_name) if m.device == "cuda" else None
    return doc, {"mode": mode, "preset": preset, **asdict(m)}


def calibrate_from_runs(paths: Sequence[str], eval_paths: Sequence[str] = (),
                        prior_weight: float | None = None, fit: Sequence[str] = (),
                        output: str | Path | None = None) -> tuple[dict[str, Any], list[Path]]:
    """`moeplan calibrate --from-runs`: refit the constants on the runs under `paths` (those
    under `eval_paths` predicted, not fitted), and write each cluster's refit spec when `output`
    is given (`refit.output_paths` names the files).

    → (the `--json` document: refit's report with each cluster as {"name", "calibration"}, the
    paths written).
    """
    from .refit import (
        PARAMS,
        PRIOR_WEIGHT,
        cluster_document,
        distinct_runs,
        find_run_dirs,
        load_run,
        output_paths,
        refit,
    )

    fit_dirs = find_run_dirs(paths)
    eval_dirs = find_run_dirs(eval_paths, "--eval") if eval_paths else []
    distinct_runs(fit_dirs, eval_dirs)
    fit_runs = [load_run(d) for d in fit_dirs]
    held = [load_run(d, "--eval") for d in eval_dirs]
    res = refit(fit_runs, held, PRIOR_WEIGHT if prior_weight is None else prior_weight,
                fit or PARAMS)
    clusters = res.pop("clusters")
    res["clusters"] = [{"name": c["name"], "calibration": c["calibration"]} for c in clusters]
    written: list[Path] = []
    if output:
        for path, c in zip(output_paths(output, [c["name"] for c in clusters]), clusters,
                           strict=True):
            write_cluster_yaml(cluster_document(c["spec"], c["calibration"], path.stem), path,
                               f" --from-runs ({plural(len(fit_runs), 'run')})")
            written.append(path)
    return res, written
