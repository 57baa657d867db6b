"""Search speed: DeepSeek-V3 on 1,024 H100s and Mixtral-8x7B on 64 H100s (issue bars: ≤ 10 s and
≤ 1 s on a 2-core machine), with the layouts enumerated, pruned per rule and MILPs solved.

    python bench/search_speed.py [--only mixtral|deepseek]
"""

from __future__ import annotations

import argparse
import time

from moeplan import load_cluster, load_model, load_training
from moeplan.planner.search import search

CASES = {
    "deepseek": ("deepseek-v3", "h100", 1024, 4096, 8192, 10.0),
    "mixtral": ("mixtral-8x7b", "h100", 64, 4096, 1024, 1.0),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=sorted(CASES))
    args = ap.parse_args()
    for name, (model, cluster, gpus, seq, gbs, bar) in CASES.items():
        if args.only and name != args.only:
            continue
        m, c = load_model(model), load_cluster(cluster)
        tr = load_training(seq_len=seq, global_batch_size=gbs)
        t0 = time.perf_counter()
        res = search(m, c, tr, gpus)
        wall = time.perf_counter() - t0
        best = res.plans[0].estimate
        print(f"{model} on {gpus} × {cluster} (seq {seq}, gbs {gbs}): {wall:.2f} s "
              f"(bar {bar:g} s, {'met' if wall <= bar else 'MISSED'}); "
              f"{res.layouts} layouts enumerated, {sum(res.pruned.values())} pruned, "
              f"{res.solved} MILPs solved, {res.feasible} feasible; best "
              f"{best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {best.mfu:.1%}")
        for rule, n in res.pruned.most_common():
            print(f"    pruned by {rule}: {n}")


if __name__ == "__main__":
    main()
