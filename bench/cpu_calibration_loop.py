"""Closing the predicted-vs-measured loop on this machine's CPUs (docs/ACCURACY.md, "CPU loop").

1. `moeplan calibrate --quick --nproc W -o OUT/local-W.yaml` for W = 1, 2, 4: a device of the
   spec is what one of W ranks gets on this host (OMP_NUM_THREADS threads, its peers computing
   at the same time), as `moeplan run` gives each of W ranks; timed.
2. Estimate ten small plans (three model shapes; world 1, 2 and 4; dp, tp, ep, pp) on the
   spec of their world size with `moeplan estimate ... -o plan.json` and run each with
   `moeplan run` (synthetic data, fp32): (a) measured vs predicted
   step time under the constants `calibrate` wrote.
3. `moeplan calibrate --from-runs FIT --eval HELD`: refit on five runs, and (b) report the
   error on the five held-out ones, never on the fitted ones alone.

    python bench/cpu_calibration_loop.py --out cpu-loop          # 5-10 minutes on 2 cores
    python bench/cpu_calibration_loop.py --out cpu-loop --reuse  # re-read, re-run nothing

Prints the markdown table of docs/ACCURACY.md and writes OUT/loop.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from moeplan.fsio import atomic_write_text

MODELS: dict[str, dict[str, Any]] = {
    "moe-s": dict(num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  head_dim=32, ffn_hidden_size=256, vocab_size=1024, num_experts=8, moe_top_k=2,
                  moe_ffn_hidden_size=128),
    "moe-m": dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=4,
                  head_dim=32, ffn_hidden_size=512, vocab_size=2048, num_experts=8, moe_top_k=2,
                  moe_ffn_hidden_size=256, first_k_dense=1),
    "dense-m": dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=8,
                    head_dim=32, ffn_hidden_size=1024, vocab_size=2048),
}
# (name, model, world, seq, gbs, axes, split): fit and held-out runs cover every world size
PLANS: list[tuple[str, str, int, int, int, dict[str, int], str]] = [
    ("w1-moe-s", "moe-s", 1, 128, 8, {}, "fit"),
    ("w1-moe-m", "moe-m", 1, 256, 4, {}, "held-out"),
    ("w1-dense-m", "dense-m", 1, 256, 4, {}, "fit"),
    ("w2-moe-m-ep2", "moe-m", 2, 256, 4, {"ep": 2}, "fit"),
    ("w2-moe-m-tp2", "moe-m", 2, 256, 4, {"tp": 2}, "held-out"),
    ("w2-dense-m-pp2", "dense-m", 2, 256, 4, {"pp": 2}, "fit"),
    ("w2-moe-s-dp2", "moe-s", 2, 128, 8, {}, "held-out"),
    ("w4-moe-m-tp2ep2", "moe-m", 4, 256, 4, {"tp": 2, "ep": 2}, "held-out"),
    ("w4-dense-m-dp2pp2", "dense-m", 4, 256, 4, {"pp": 2}, "fit"),
    ("w4-moe-s-ep4", "moe-s", 4, 128, 8, {"ep": 4}, "held-out"),
]


def sh(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `moeplan ARGS`, echoing the command; stop on failure with its stderr."""
    print("$ moeplan " + " ".join(args), file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, "-m", "moeplan", *args], capture_output=True, text=True,
                       env=env)
    if r.returncode:
        sys.exit(f"failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="Working directory for specs, plans and runs.")
    ap.add_argument("--steps", type=int, default=6, help="Steps per run (median after step 1).")
    ap.add_argument("--reuse", action="store_true", help="Reuse calibration and runs in --out.")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # one thread per rank everywhere (calibrate and run read OMP_NUM_THREADS alike): on a small
    # shared host, several OpenMP threads per rank stall each other whenever a core is taken
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {"load_average_start": os.getloadavg()[0], "calibrate_wall_s": {},
                              "omp_num_threads": os.environ["OMP_NUM_THREADS"]}
    for world in sorted({p[2] for p in PLANS}):
        local = out / f"local-{world}.yaml"
        if not (a.reuse and local.is_file()):
            t0 = time.perf_counter()
            sh(["calibrate", "--quick", "--nproc", str(world), "-o", str(local)])
            result["calibrate_wall_s"][world] = time.perf_counter() - t0
    for name, spec in MODELS.items():
        atomic_write_text(out / f"{name}.yaml", yaml.safe_dump({"name": name, **spec}))
    rows = []
    for name, model, world, seq, gbs, axes, split in PLANS:
        plan, run = out / "plans" / f"{name}.json", out / "runs" / split / name
        plan.parent.mkdir(parents=True, exist_ok=True)
        flags = [f"--{k}={v}" for k, v in axes.items()]
        if not (a.reuse and (run / "summary.json").is_file()):
            sh(["estimate", "--model", str(out / f"{model}.yaml"),
                "--cluster", str(out / f"local-{world}.yaml"),
                "--gpus", str(world), "--seq", str(seq), "--gbs", str(gbs), *flags,
                "-o", str(plan), "--json"])
            sh(["run", str(plan), "--steps", str(a.steps), "--out", str(run), "--seed", "0"])
        s = json.loads((run / "summary.json").read_text())
        rows.append({"run": name, "split": split, "world": world,
                     "measured_s": s["measured"]["step_time_s"],
                     "predicted_s": s["predicted"]["step_time_s"]})
    fit = [str(out / "runs" / "fit")]
    held = [str(out / "runs" / "held-out")]
    r = sh(["calibrate", "--from-runs", *fit, "--eval", *held, "-o", str(out / "refit.yaml"),
            "--json"])
    refit = json.loads(r.stdout)
    after = {Path(x["path"]).name: x for x in refit["runs"]}
    for row in rows:
        row["refit_s"] = after[row["run"]]["after_s"]
    result.update(rows=rows, fitted=refit["fitted"],
                  load_average_end=os.getloadavg()[0])
    atomic_write_text(out / "loop.json", json.dumps(result, indent=2))

    def err(p: float, m: float) -> str:
        return f"{p / m - 1:+.0%}"

    print("| run | split | world | measured s | (a) calibrate | error | (b) refit | error |")
    print("|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['run']} | {x['split']} | {x['world']} | {x['measured_s']:.3f} | "
              f"{x['predicted_s']:.3f} | {err(x['predicted_s'], x['measured_s'])} | "
              f"{x['refit_s']:.3f} | {err(x['refit_s'], x['measured_s'])} |")
    for split in ("fit", "held-out"):
        sel = [x for x in rows if x["split"] == split]
        for key, label in (("predicted_s", "(a)"), ("refit_s", "(b)")):
            e = sum(abs(math.log(x[key] / x["measured_s"])) for x in sel) / len(sel)
            print(f"mean |log error| {split} {label}: {e:.3f}")
    f = refit["fitted"]
    print(f"fitted: compute_scale {f['compute_scale']:.3g}, comm_scale {f['comm_scale']:.3g}, "
          f"layer_overhead_s "
          f"{f['layer_overhead_s']:.3g}, step_overhead_s {f['step_overhead_s']:.3g}")
    for world, wall in result["calibrate_wall_s"].items():
        print(f"calibrate --quick --nproc {world} wall time: {wall:.1f} s")


if __name__ == "__main__":
    main()
