"""Dense A100 check on Korthikanti et al. 2022 Table 5, the set Calculon validates against.

"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198) Table 5
publishes the measured iteration time of four GPT models (22B, 175B, 530B, 1T) on A100-80GB
(Megatron-LM, 16-bit, sequence 2048), with full recomputation and with selective
recomputation plus sequence parallelism. `bench/data/korthikanti_2022_table5.csv` holds the
eight runs in the published-runs schema: the layouts of the paper's Table 3 (TP 8, PP 1/8/35/64,
one sequence per GPU per iteration), micro-batch and interleaving as in the execution files
Calculon validates with (calculon-ai/calculon, validation/seqsel/tab5), tokens/s/GPU =
global batch × 2048 / (GPUs × iteration time). The fit never reads this file, so every row is
held out (`moeplan validate` labels rows by its configuration hash only).

    python bench/korthikanti_table5.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moeplan.validation import read_rows, validate_rows

TABLE5 = Path(__file__).parent / "data" / "korthikanti_2022_table5.csv"
CALCULON_MAPE = 3.65  # Calculon's figure on the same eight runs (its `llm-validation` command)


def table5_errors() -> list[dict[str, float | str]]:
    """Per run: published and predicted tokens/s/GPU and the signed relative error."""
    out = validate_rows(read_rows(TABLE5))
    if out["skipped"]:
        raise SystemExit(f"Table 5 runs that cannot be priced: {out['skipped']}")
    return [{"id": r["id"], "published": r["published_tokens_per_s_per_gpu"],
             "predicted": r["predicted_tokens_per_s_per_gpu"],
             "error": r["predicted_tokens_per_s_per_gpu"] / r["published_tokens_per_s_per_gpu"] - 1}
            for r in out["rows"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)
    rows = table5_errors()
    mape = 100 * sum(abs(float(r["error"])) for r in rows) / len(rows)
    if args.json:
        print(json.dumps({"rows": rows, "mape_percent": mape,
                          "calculon_mape_percent": CALCULON_MAPE}, indent=1))
        return 0
    print(f"{'run':<22} {'published':>10} {'predicted':>10} {'error':>8}")
    for r in rows:
        print(f"{r['id']:<22} {r['published']:>10.1f} {r['predicted']:>10.1f} "
              f"{100 * float(r['error']):>+7.1f}%")
    print(f"MAPE {mape:.1f}% (Calculon on the same runs: {CALCULON_MAPE}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
