"""Our search against published NVIDIA configurations: is the published layout feasible in our
model (with the MILP choosing its recompute/offload), and does our best plan predict at least its
throughput? Writes the Markdown table for docs/PLANS.md on stdout.

    python bench/published_plans.py [--time-limit SEC]
"""

from __future__ import annotations

import argparse
import csv
import time
from collections import Counter
from pathlib import Path

from moeplan import load_cluster
from moeplan.cost_models.calibration import calibration_for
from moeplan.planner.explain import describe
from moeplan.planner.problem import layer_table
from moeplan.planner.search import SearchResult, _options, _solve_layout, search
from moeplan.specs import list_presets
from moeplan.validation import case_of, predict_case

ROWS = ("R0106", "R0026", "R0089", "R0291")
CSV = Path(__file__).resolve().parents[2] / "shared" / "data" / "published_runs.csv"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--csv", default=str(CSV))
    args = ap.parse_args()
    with open(args.csv) as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    presets = list_presets()
    print("| row | model | GPUs | precision | published layout | ours: published layout | "
          "our best | ours vs published layout | search s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rid in ROWS:
        r = rows[rid]
        # the layout `moeplan validate` prices: as published, plus what the row's recipe
        # documents (EP overlap in the 26.06 MXFP8 MoE recipes)
        case = case_of(r, presets)
        if isinstance(case, str):
            raise SystemExit(f"{rid}: {case}")
        model, tr, lay, gpus = case.model, case.training, case.layout, case.layout.world_size
        cluster = load_cluster(r["cluster_preset"]).with_gpus(gpus)
        cal = calibration_for(cluster.calibration)
        table = layer_table(model, cluster, tr, lay, cal)
        key = (lay.tp, lay.cp, lay.ep, lay.etp, lay.mbs, lay.dispatcher, lay.ep_overlap,
               tr.precision)
        dummy = SearchResult([], 0, 0, 0, 0.0, Counter())
        theirs, _ = _solve_layout(model, cluster, tr, lay, cal, table, _options("megatron"), key,
                                  {}, dummy)
        t0 = time.perf_counter()
        res = search(model, cluster, tr, gpus, precision=tr.precision,
                     time_limit_s=args.time_limit)
        wall = time.perf_counter() - t0
        best = res.plans[0]
        seen = predict_case(case)
        how = "derived from published TFLOPS" if seen["tokens_derived_from_tflops"] else "published"
        pub = (f"tp{lay.tp} pp{lay.pp} vpp{lay.vpp} ep{lay.ep} mbs{lay.mbs} "
               f"({seen['published_tokens_per_s_per_gpu']:,.0f} tok/s/GPU {how})")
        if theirs is None:
            ours_pub = "does not fit"
            ratio = "—"
        else:
            e = theirs.estimate
            ours_pub = f"fits, {e.tokens_per_s_per_gpu:,.0f} tok/s/GPU ({describe(theirs)})"
            ratio = f"{best.estimate.tokens_per_s_per_gpu / e.tokens_per_s_per_gpu:.2f}×"
        ourb = f"{best.estimate.tokens_per_s_per_gpu:,.0f} tok/s/GPU ({describe(best)})"
        stop = " (time limit)" if res.stopped_early else ""
        print(f"| {rid} | {model.name} | {gpus} × {r['cluster_preset']} | {tr.precision} | {pub} "
              f"| {ours_pub} | {ourb} | {ratio} | {wall:.0f}{stop} |", flush=True)


if __name__ == "__main__":
    main()
