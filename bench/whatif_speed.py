"""What-if sweep speed: Qwen3-235B-A22B over 3 cluster kinds × 5 GPU counts (the issue's bar:
≤ 30 s on this machine).

Each point is a full planner search (top 1); the sweep loads specs once and searches each
distinct point once, cheapest first. The per-point times show where the sweep's time goes,
which is the planner's own speed (see "Planner search speed" in docs/BENCHMARKS.md).

    python bench/whatif_speed.py                       # the issue's 3 × 5 sweep, no time limit
    python bench/whatif_speed.py --workers 1           # the same in one process
    python bench/whatif_speed.py --time-limit 30       # the same under an overall 30 s limit
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from moeplan.planner.whatif import whatif


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-235b-a22b")
    ap.add_argument("--clusters", default="h100,h200,b200")
    ap.add_argument("--gpus", default="64,128,256,512,1024")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--workers", type=int, default=0,
                    help="processes searching points (0: one per core, the default)")
    args = ap.parse_args()
    counts = [int(x) for x in args.gpus.split(",")]
    t0 = time.perf_counter()
    res = whatif(args.model, args.clusters, counts, seqs=[args.seq], tokens=15e12,
                 time_limit_s=args.time_limit, workers=args.workers,
                 progress=lambda m: print(m, file=sys.stderr, flush=True))
    total = time.perf_counter() - t0
    print(f"{'cluster':10s} {'GPUs':>5s} {'search s':>9s} {'tok/s/GPU':>10s} {'days':>7s}  note")
    for p in res.points:
        note = "stopped at limit" if p.stopped_early else ("" if p.fits else "does not fit")
        print(f"{p.cluster:10s} {p.gpus:5d} {p.search_seconds:9.1f} "
              f"{p.tokens_per_s_per_gpu or 0:10,.0f} {p.days_to_train or 0:7.1f}  {note}")
    print(f"total {total:.1f} s for {len(res.points)} points "
          f"(load average {os.getloadavg()[0]:.1f})")
    print(json.dumps({"seconds": round(total, 2), "points": len(res.points),
                      "time_limit_s": args.time_limit, "workers": args.workers,
                      "per_point_s": [round(p.search_seconds, 2) for p in res.points],
                      "stopped_early": sum(p.stopped_early for p in res.points),
                      "fits": sum(p.fits for p in res.points)}))


if __name__ == "__main__":
    main()
