"""`moeplan calibrate --from-runs`: refit a few constants from measured `moeplan run` step times.

Each run directory holds `plan.json` (the plan as launched), `run.json` (the plan as it ran,
when that differs) and `summary.json` (measured against predicted). The refit re-predicts what
the run's own prediction priced (the plan as launched, on its cluster; a scaled-down run's plan
as it ran, on the cluster of the machine it ran on: summary.json's `predicted_cluster`), so its
"before" is the run's printed prediction. A run measured on another kind of device than that
cluster describes (a CPU step of a plan priced for H100s) is refused: fitted to it, a GPU's
constants would describe the CPU. It re-predicts those plans under candidate constants and
minimises Σ (log predicted − log measured)² over the fitted runs with Levenberg–Marquardt on
the logs of four constants, or those `--fit` names (with a weak pull toward their starting
values, see `refit`; fewer fitted runs than constants is warned of):

  compute_scale    multiplies every GEMM and attention efficiency (gemm_eff_max, attn_*_eff)
  comm_scale       multiplies every link efficiency (nvlink_eff, scaleout_eff, a2a_*_eff)
  layer_overhead_s fixed seconds per layer per micro-batch, forward and backward each
  step_overhead_s  fixed seconds per step

Runs given with `--eval` are predicted with the fitted constants but never fitted: their error
is the honest one. No torch here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..cost_models.calibration import calibration_for
from ..errors import SpecError
from ..fsio import loads_json, read_regular
from ..limits import MAX_FILE_BYTES
from ..specs import ClusterSpec, Plan, load_plan
from ..terminal import plural

PARAMS = ("compute_scale", "comm_scale", "layer_overhead_s", "step_overhead_s")
BOUNDS = {"compute_scale": (1e-3, 1e3), "comm_scale": (1e-3, 1e3),
          "layer_overhead_s": (1e-7, 10.0), "step_overhead_s": (1e-7, 100.0)}
PRIOR_WEIGHT = 0.05
LINK_EFFS = ("nvlink_eff", "scaleout_eff", "a2a_nvlink_eff", "a2a_scaleout_eff")


@dataclass(frozen=True)
class RunRecord:
    """One measured run: the plan that ran and its median steady step time."""

    path: str
    plan: Plan
    measured_step_s: float


def find_run_dirs(paths: Sequence[str], flag: str = "--from-runs") -> list[Path]:
    """Run directories under each path: the path itself when it holds summary.json, else every
    directory below it that does (`flag`: the option the paths came from, for messages)."""
    dirs: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise SpecError(f"{flag} {p}: no such directory. Pass run directories written "
                            "by `moeplan run --out DIR` (each holds summary.json and plan.json).")
        if (p / "summary.json").is_file():
            dirs.append(p)
            continue
        found = _summaries_below(p, flag) if p.is_dir() else []
        if not found:
            raise SpecError(f"{flag} {p}: no summary.json in it or below it. Pass run "
                            "directories written by `moeplan run --out DIR` after the run "
                            "finished.")
        dirs += found
    return dirs


def distinct_runs(fit_dirs: Sequence[Path], eval_dirs: Sequence[Path]) -> None:
    """Refuse a run directory found twice, compared by resolved path: one run given twice to
    --from-runs (`a a ./a`, or a folder and a run inside it) would weigh three measurements
    where there is one, and a run in both --from-runs and --eval would report an error on a
    run the constants were fitted to as held-out evidence."""
    first: dict[Path, tuple[str, Path]] = {}
    for flag, dirs in (("--from-runs", fit_dirs), ("--eval", eval_dirs)):
        for d in dirs:
            key = d.resolve()
            if key not in first:
                first[key] = (flag, d)
                continue
            was, shown = first[key]
            if was != flag:
                raise SpecError(f"the run {shown} is given to both --from-runs and --eval (as "
                                f"{d}): a run the constants are fitted on says nothing of how "
                                "they predict runs they were not; pass it to one of them.")
            raise SpecError(f"{flag} gives the run {shown} twice (again as {d}): it would count "
                            "as two measurements; pass each run directory once.")


MAX_WALK_DEPTH = 8  # directories below a --from-runs path searched for run directories
MAX_WALK_ENTRIES = 200_000  # names looked at before the search is refused as too wide


def _summaries_below(root: Path, flag: str = "--from-runs") -> list[Path]:
    """The run directories (holding summary.json) below `root`, found by a bounded walk: at
    most MAX_WALK_DEPTH levels, MAX_WALK_ENTRIES names, no symbolic link followed, so
    `--from-runs /` is refused at once instead of reading the whole file system."""
    found, seen = [], 0
    for top, dirs, files in os.walk(root, followlinks=False):
        seen += len(dirs) + len(files)
        if seen > MAX_WALK_ENTRIES:
            raise SpecError(f"{flag} {root}: more than {MAX_WALK_ENTRIES:,} files and "
                            "directories below it; point it at the directory holding the run "
                            "directories (or list them).")
        if "summary.json" in files:
            found.append(Path(top))
        if len(Path(top).relative_to(root).parts) >= MAX_WALK_DEPTH:
            dirs[:] = []  # deeper than any run directory is kept
    return sorted(found)


def _read_json(path: Path) -> Any:
    try:  # a regular file, bounded, strict (fsio's one reader and parser)
        return loads_json(read_regular(path, MAX_FILE_BYTES))
    except (SpecError, ValueError) as err:
        raise SpecError(f"{path}: not readable JSON ({err}). Rerun `moeplan run --out "
                        f"{path.parent}` or remove the directory from --from-runs.") from None


def load_run(run_dir: Path, flag: str = "--from-runs") -> RunRecord:
    """The plan the run's prediction priced, on the cluster it priced it on, and the run's
    measured step time, with errors naming the file (`flag`: the option the run came from)."""
    summary_path, plan_path = run_dir / "summary.json", run_dir / "plan.json"
    summary = _read_json(summary_path)
    step = summary.get("measured", {}).get("step_time_s") if isinstance(summary, dict) else None
    if isinstance(summary, dict) and summary.get("measured") == {} and isinstance(
            summary.get("steps"), int) and summary.get("resumed_from") == summary["steps"]:
        raise SpecError(f"{run_dir}: this run measured nothing (a restart resumed it at its "
                        f"last step, so no step was timed); leave it out of {flag}.")
    if not isinstance(step, (int, float)) or isinstance(step, bool) or not step > 0:
        raise SpecError(f"{summary_path}: field `measured.step_time_s` is missing or not a "
                        "positive number. Rerun `moeplan run --out "
                        f"{run_dir}` to rewrite it, or leave this run out.")
    if not plan_path.is_file():
        raise SpecError(f"{run_dir}: no plan.json next to summary.json (runs launched before "
                        "plans were saved with them). Copy the plan JSON the run used there as "
                        "plan.json, or rerun it.")
    plan = load_plan(plan_path)
    if summary.get("scaled_down"):
        plan = _scaled_plan(run_dir, plan)
    cluster = _priced_on(run_dir, summary, plan, flag)
    _check_device(run_dir, summary, cluster, flag)
    return RunRecord(str(run_dir), plan.model_copy(update={"cluster": cluster}), float(step))


def _scaled_plan(run_dir: Path, given: Plan) -> Plan:
    """The plan a scaled-down run trained: OUT/run.json's, as the launcher prepared it (with the
    options it ran under); a run written before run.json, `given` scaled down again."""
    if (run_dir / "run.json").is_file():
        from ..runtime.options import PreparedRun

        return PreparedRun.read(run_dir).running
    from ..runtime.launch import RunOptions, prepare_plan

    return prepare_plan(given, RunOptions(scale_down=True))[1]


def _priced_on(run_dir: Path, summary: dict[str, Any], plan: Plan, flag: str) -> ClusterSpec:
    """The cluster the run's predicted step time was priced on (summary.json's
    `predicted_cluster`: under --scale-down the machine's, not the plan's); a summary written
    before it was recorded, the plan's."""
    doc = summary.get("predicted_cluster")
    if doc is not None:
        from ..specs.validated import build

        return build(ClusterSpec, doc, "cluster", f"{run_dir / 'summary.json'} "
                     "predicted_cluster")
    if "predicted_cluster" in summary and summary.get("scaled_down"):
        raise SpecError(f"{run_dir}: this scaled-down run predicted no step time (no cluster "
                        "described the machine it ran on), so there is nothing to refit. "
                        "Rerun it with `moeplan run --scale-down --cluster FILE` (on a CPU, the "
                        f"file `moeplan calibrate -o local.yaml` writes), or leave it out of "
                        f"{flag}.")
    return plan.cluster


DEVICE_WORDS = {"cpu": "a CPU", "cuda": "a GPU"}


def _check_device(run_dir: Path, summary: dict[str, Any], cluster: ClusterSpec,
                  flag: str) -> None:
    """Refuse a run measured on another kind of device than `cluster` describes (a CPU run of
    a plan priced for H100s, or a GPU run of one priced on a CPU): constants fitted to its step
    would be written as the cluster's and describe neither. A summary without `device` (written
    by hand) is taken as measured where it was priced."""
    device = summary.get("device")
    if not isinstance(device, str) or device == cluster.device_kind:
        return
    here = "on a CPU, the file `moeplan calibrate -o local.yaml` writes; on a GPU, its preset"
    how = (f"run the plan with `moeplan run PLAN --scale-down --cluster FILE`, FILE a cluster "
           f"of the machine it runs on ({here})" if summary.get("scaled_down") else
           f"estimate the plan on a cluster of the machine it runs on ({here}: `moeplan "
           "estimate ... --cluster local.yaml -o plan.json`), then run that plan")
    raise SpecError(f"{run_dir}: this run was measured on {DEVICE_WORDS.get(device, device)}, "
                    f"but its step time was priced for {DEVICE_WORDS[cluster.device_kind]} "
                    f"({cluster.gpu}, cluster {cluster.name}); constants fitted to it would "
                    f"describe neither. For a run to refit from, {how}; or leave this run out "
                    f"of {flag}.")


def overrides_for(theta: dict[str, float], base: dict[str, Any], cluster: Any
                  ) -> dict[str, Any]:
    """Calibration overrides: `base` (the cluster's own) with the fitted constants applied."""
    cal = calibration_for(base)
    s = theta["compute_scale"]
    arch, gpu = cluster.architecture, cluster.gpu
    out = dict(base)
    out["gemm_eff_max"] = {**base.get("gemm_eff_max", {}),
                           **{k: cal.gemm_eff_max[k] * s
                              for k in sorted({arch, gpu} & cal.gemm_eff_max.keys())}}
    for key in ("attn_fwd_eff", "attn_bwd_eff"):
        out[key] = {**base.get(key, {}), arch: getattr(cal, key)[arch] * s}
    for key in LINK_EFFS:
        out[key] = getattr(cal, key) * theta["comm_scale"]
    out["layer_overhead_s"] = theta["layer_overhead_s"]
    out["step_overhead_s"] = theta["step_overhead_s"]
    return out


def predict(run: RunRecord, overrides: dict[str, Any] | None = None) -> float:
    """Predicted step seconds of the plan that ran, under `overrides` (None: its cluster's)."""
    from ..cost_models.estimate import estimate

    p = run.plan
    cluster = p.cluster.model_copy(update={"calibration": overrides}) if overrides is not None \
        else p.cluster
    return estimate(p.model, cluster, p.training, p.layout, p.choices,
                    target="moeplan").step_time_s  # it ran on this runtime


def levenberg_marquardt(residuals: Callable[[np.ndarray], np.ndarray], x0: np.ndarray,
                        lower: np.ndarray, upper: np.ndarray, iters: int = 100,
                        tol: float = 1e-12) -> np.ndarray:
    """Minimise ½‖r(x)‖² over the box [lower, upper] (Marquardt 1963, each step projected onto
    the box), forward-difference Jacobian. A direction the residuals barely see (a constant no
    run exercises) gets damped, not thrown to infinity."""
    x, lam = np.clip(x0.astype(float), lower, upper), 1e-2
    r = residuals(x)
    cost = float(r @ r)
    for _ in range(iters):
        J = np.empty((r.size, x.size))
        for j in range(x.size):
            dx = np.zeros_like(x)
            dx[j] = 1e-5
            J[:, j] = (residuals(x + dx) - r) / 1e-5
        A, g = J.T @ J, J.T @ r
        floor = 1e-6 * max(float(np.max(np.diag(A))), 1e-12)
        while True:
            step = np.linalg.solve(A + lam * np.diag(np.maximum(np.diag(A), floor)), -g)
            x_new = np.clip(x + step, lower, upper)
            r_new = residuals(x_new)
            c_new = float(r_new @ r_new)
            if c_new < cost:
                x, r, lam = x_new, r_new, max(lam / 3, 1e-9)
                improved = cost - c_new
                cost = c_new
                break
            lam *= 4
            if lam > 1e9:
                return x
        if improved < tol:
            break
    return x


def _start(clusters: Sequence[Any]) -> dict[str, float]:
    """Starting constants: scales 1, overheads the geometric mean of the clusters' own."""
    cals = [calibration_for(c.calibration) for c in clusters]

    def gmean(key: str) -> float:
        return float(math.exp(np.mean([math.log(max(getattr(c, key), 1e-6)) for c in cals])))
    return {"compute_scale": 1.0, "comm_scale": 1.0,
            "layer_overhead_s": gmean("layer_overhead_s"),
            "step_overhead_s": gmean("step_overhead_s")}


def _cluster_key(cluster: Any) -> str:
    return cluster.model_dump_json(exclude={"num_gpus"})


def measured_interval(rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """The 80 % band of log(measured / predicted) after the refit, split conformal over the
    held-out runs when there are enough of them (else every run, which is in sample and so
    optimistic), as the non-negative shares a ClusterSpec's calibration holds: `low` below the
    point, `high` above, `runs` behind them (uncertainty.measured_bounds reads it). None while
    too few runs make a finite 80 % band."""
    from ..cost_models.uncertainty import conformal_bounds

    held = [r for r in rows if r["split"] == "held-out"]
    use = held if conformal_bounds([0.0] * len(held)) is not None else list(rows)
    b = conformal_bounds([math.log(r["measured_s"] / r["after_s"]) for r in use])
    if b is None:
        return None
    # step time measured above the prediction is throughput below it
    return {"low": 1.0 - math.exp(-max(b[1], 0.0)), "high": math.exp(-min(b[0], 0.0)) - 1.0,
            "runs": float(len(use))}


def output_paths(output: str | Path, cluster_names: Sequence[str]) -> list[Path]:
    """Where the refit specs go: one cluster to OUTPUT itself; several (one per world size, say)
    each to OUTPUT-STEM-<cluster name>.yaml beside it, so no refit overwrites another."""
    base = Path(output)
    if len(cluster_names) == 1:
        return [base]
    return [base.with_name(f"{base.stem}-{name}{base.suffix or '.yaml'}")
            for name in cluster_names]


def cluster_document(spec: Any, calibration: dict[str, Any], name: str) -> dict[str, Any]:
    """The ClusterSpec document of a refit: the cluster the runs were predicted for with the
    refit constants as its calibration, named after its file and without a GPU count (a spec
    of the machine, usable for any number of its GPUs)."""
    doc = spec.model_dump(mode="json")
    doc.update(name=name, num_gpus=None, calibration=calibration)
    return doc


def refit(fit_runs: Sequence[RunRecord], eval_runs: Sequence[RunRecord] = (),
          prior_weight: float = PRIOR_WEIGHT, params: Sequence[str] = PARAMS) -> dict[str, Any]:
    """Fit `params` (a subset of PARAMS; the others keep their starting values) on `fit_runs`;
    report per-run error before and after, fit and held-out apart.

    Runs may predict for different clusters (e.g. one `moeplan calibrate --nproc W` spec per
    world size W): the scales multiply each cluster's own efficiencies, the overheads are shared.
    `prior_weight` w adds w·(log θ − log θ₀) per constant to the residuals (ridge toward the
    starting constants): a constant the runs barely constrain stays near its measured value
    instead of running to a bound. w = 0.05: moving a constant e-fold costs as much as a 5 %
    step-time error on one run.

    → {"fitted": {param: value}, "clusters": [{"name", "spec", "calibration"}], "calibration":
    the one cluster's overrides (None when several), "runs": [{"path", "split", "measured_s",
    "before_s", "after_s", "before_error", "after_error"}], "mean_abs_log_error": {"fit":
    {"before", "after"}, "held-out": {...}}, "warnings": [str]}
    """
    if not fit_runs:
        raise SpecError("--from-runs: no runs to fit. Pass at least one run directory.")
    specs: dict[str, Any] = {}
    for r in [*fit_runs, *eval_runs]:
        specs.setdefault(_cluster_key(r.plan.cluster), r.plan.cluster)
    start = _start(list(specs.values()))
    unknown = [k for k in params if k not in PARAMS]
    if unknown or not params:
        raise SpecError(f"--fit {','.join(params)}: fit one or more of {', '.join(PARAMS)}.")
    params = [k for k in PARAMS if k in params]
    x0 = np.log([start[k] for k in params])
    y = np.log([r.measured_step_s for r in fit_runs])

    def theta_of(x: np.ndarray) -> dict[str, float]:
        return {**start, **{k: float(math.exp(v)) for k, v in zip(params, x, strict=True)}}

    def overrides(theta: dict[str, float]) -> dict[str, dict[str, Any]]:
        return {k: overrides_for(theta, dict(c.calibration), c) for k, c in specs.items()}

    def residuals(x: np.ndarray) -> np.ndarray:
        ov = overrides(theta_of(x))
        pred = [predict(r, ov[_cluster_key(r.plan.cluster)]) for r in fit_runs]
        return np.concatenate([np.log(pred) - y, prior_weight * (x - x0)])

    lower = np.log([BOUNDS[k][0] for k in params])
    upper = np.log([BOUNDS[k][1] for k in params])
    x = levenberg_marquardt(residuals, x0, lower, upper)
    theta = theta_of(x)
    fitted_all = overrides(theta)
    rows = []
    for split, runs in (("fit", fit_runs), ("held-out", eval_runs)):
        for r in runs:
            before = predict(r)
            after = predict(r, fitted_all[_cluster_key(r.plan.cluster)])
            rows.append({"path": r.path, "split": split, "measured_s": r.measured_step_s,
                         "before_s": before, "after_s": after,
                         "before_error": before / r.measured_step_s - 1,
                         "after_error": after / r.measured_step_s - 1})

    def mean_abs_log(split: str, key: str) -> float | None:
        errs = [abs(math.log(row[key] / row["measured_s"])) for row in rows
                if row["split"] == split]
        return float(np.mean(errs)) if errs else None

    band = measured_interval(rows)
    if band is not None:  # these runs narrow the interval of plans priced on this cluster
        for cal in fitted_all.values():
            cal["interval_runs"] = band
    clusters = [{"name": c.name, "spec": c, "calibration": fitted_all[k]}
                for k, c in specs.items()]
    return {
        "fitted": theta,
        "clusters": clusters,
        "calibration": clusters[0]["calibration"] if len(clusters) == 1 else None,
        "runs": rows,
        "mean_abs_log_error": {s: {"before": mean_abs_log(s, "before_s"),
                                   "after": mean_abs_log(s, "after_s")}
                               for s in ("fit", "held-out")},
        "warnings": [w for w in [underdetermined(len(fit_runs), params)] if w],
    }


def underdetermined(runs: int, params: Sequence[str]) -> str | None:
    """The warning for fewer fitted runs than constants: the runs cannot tell the constants
    apart, so their fit is the prior's (--prior-weight) as much as the runs'. Not an error: a
    fit of one run still moves the constants toward it."""
    if runs >= len(params):
        return None
    return (f"{plural(runs, 'run')} fitted for {len(params)} constants "
            f"({', '.join(params)}): too few to pin them all down (the pull of --prior-weight "
            "holds the rest near their starting values); fit at least as many runs, of "
            "different layouts and sizes, or fewer constants with --fit.")
