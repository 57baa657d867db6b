"""Search speed: DeepSeek-V3 on 1,024 H100s and Mixtral-8x7B on 64 H100s (issue bars: ≤ 10 s and
≤ 1 s on a 2-core machine), with the layouts enumerated, pruned per rule, screened and MILPs
solved.

Each case runs in a fresh process and times its first `search` call, so the lazy imports it
pays for (PuLP/HiGHS) are in the figure; `--repeat N` adds warm runs
of the same search in that process. The search is single-threaded, so its process CPU time is
what the wall time would be on an idle core; both are printed with the load average.

    python bench/search_speed.py [--only mixtral|deepseek] [--repeat N]
                                 [--objective robust|expected|both]
                                 [--baseline CHECKOUT] [--rounds N]

`--baseline` names a checkout of another revision (a `git worktree` of the previous one): each
case then runs from both, alternately for `--rounds` rounds, every process importing its own
`moeplan`, and the medians of process CPU are printed side by side with their ratios, this
revision's robust search against both objectives of either revision.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CASES = {
    "deepseek": ("deepseek-v3", "h100", 1024, 4096, 8192, 10.0),
    "mixtral": ("mixtral-8x7b", "h100", 64, 4096, 1024, 1.0),
}


def run_case(name: str, repeat: int, objective: str = "robust") -> None:
    from moeplan import load_cluster, load_model, load_training
    from moeplan.planner.search import search

    model, cluster, gpus, seq, gbs, bar = CASES[name]
    m, c = load_model(model), load_cluster(cluster)
    tr = load_training(seq_len=seq, global_batch_size=gbs)
    walls, cpus = [], []
    for _ in range(1 + repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        res = search(m, c, tr, gpus, objective=objective)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    best = res.plans[0].estimate
    warm = f", warm {min(walls[1:]):.2f} s" if repeat else ""
    print(f"{model} on {gpus} × {cluster} (seq {seq}, gbs {gbs}, --objective {objective}): "
          f"{walls[0]:.2f} s cold{warm} "
          f"[process CPU {cpus[0]:.2f} s: the wall time on an idle core] "
          f"(bar {bar:g} s, {'met' if walls[0] <= bar else 'MISSED'}); "
          f"{res.layouts} layouts enumerated, {sum(res.pruned.values())} pruned, "
          f"{res.screened} screened, {res.solved} MILPs solved, {res.feasible} feasible; best "
          f"{best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {best.mfu:.1%} "
          f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    for rule, n in res.pruned.most_common():
        print(f"    pruned by {rule}: {n}")


def _cpu_of(root: Path, name: str, objective: str, repeat: int) -> float:
    """Process CPU of one cold search run from the checkout at `root` (its own moeplan)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, str(HERE / "search_speed.py"), "--only", name,
                          "--repeat", str(repeat), "--objective", objective],
                         env=env, check=True, capture_output=True, text=True, cwd=root).stdout
    print(f"  [{root.name}] {out.splitlines()[0]}", flush=True)
    m = re.search(r"process CPU ([0-9.]+) s", out)
    assert m, out
    return float(m.group(1))


def side_by_side(baseline: Path, names: list[str], rounds: int, repeat: int) -> None:
    """Both revisions, both objectives, alternately; medians and ratios."""
    here = HERE.parent
    for name in names:
        cpu: dict[tuple[str, str], list[float]] = {}
        for _ in range(rounds):
            for rev, root in (("previous", baseline), ("this", here)):
                for obj in ("expected", "robust"):
                    cpu.setdefault((rev, obj), []).append(_cpu_of(root, name, obj, repeat))
        med = {k: statistics.median(v) for k, v in cpu.items()}
        print(f"{CASES[name][0]}, process CPU medians over {rounds} rounds: "
              + ", ".join(f"{rev} {obj} {t:.2f} s" for (rev, obj), t in med.items()))
        r = med["this", "robust"]
        print(f"  this robust / this expected: {r / med['this', 'expected']:.2f}x; "
              f"/ previous robust: {r / med['previous', 'robust']:.2f}x; "
              f"/ previous expected: {r / med['previous', 'expected']:.2f}x; "
              f"this expected / previous expected: "
              f"{med['this', 'expected'] / med['previous', 'expected']:.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--repeat", type=int, default=0)
    ap.add_argument("--objective", choices=("robust", "expected", "both"), default="both")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a checkout of the revision to compare with, side by side")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.baseline is not None:
        side_by_side(args.baseline.resolve(), [args.only] if args.only else list(CASES),
                     args.rounds, args.repeat)
        return
    objectives = ("expected", "robust") if args.objective == "both" else (args.objective,)
    if args.only and len(objectives) == 1:
        run_case(args.only, args.repeat, objectives[0])
        return
    for name in [args.only] if args.only else CASES:
        for obj in objectives:
            subprocess.run([sys.executable, __file__, "--only", name, "--repeat",
                            str(args.repeat), "--objective", obj], check=True)


if __name__ == "__main__":
    main()
