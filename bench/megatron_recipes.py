"""Runs no fit saw: Megatron-LM's MoE recipes and GB200 steps, and Megatron-MoE-ModelZoo's runs.

Three sets of published measurements that neither `shared/data` nor any fit contains, priced
with the settings each run documents (the dispatcher, EP overlap, CUDA graphs, recomputed and
offloaded modules, stage layout, FP8 parameter gather, bf16 Adam moments, read from its row
by `moeplan.validation`, as for every published row):

- `bench/data/megatron_lm_moe_recipes.csv`: the Recipe Index of Megatron-LM's
  `examples/moe_recipes/README.md` (commit 8a2ac1fdc7): fourteen DeepSeek-V3, Qwen3-235B-A22B
  and Qwen3-30B-A3B recipes on H100, B200, B300, GB200 and GB300 with their median
  TFLOP/s/GPU, each row's settings read from its recipe YAML. Three run full-iteration CUDA
  graphs with the paged stash (`Layout.cuda_graph_scope` "full_iteration"); their
  partial-graph twins show what that is worth.
- `bench/data/deepseek_v3_gb200_steps.csv`: the thirteen steps of Megatron-LM's "Optimizing
  DeepSeek-V3 Training Performance on NVIDIA GB200 NVL72" (commit eb0783b6d3), one layout from
  494 to 970 TFLOPS/GPU. A step that changes a setting moeplan names (dispatcher, recompute,
  CUDA graphs) is priced with it; the others (kernel fusions, CPU-side work) are inside the
  `current` software stack every estimate assumes, so their predictions do not move.
- `bench/data/modelzoo_qwen3.csv`: Megatron-MoE-ModelZoo's Qwen3-235B-A22B runs
  (`best_practice/qwen3/readme.md`, commits c1ad0b5c89 and 020b8136b3): on 256 H100, five
  layouts of one batch with their step times, and four long-context runs,
  16K to 128K tokens with CP 1 to 8; on 256 GB200 a BF16 and an MXFP8 layout; on 128 GB300 a
  128K-token run with CP 4. The Megatron-FSDP layout and Qwen3-Next-80B-A3B (no preset) are
  listed as skipped; the GB300 4K run is left out, being the run Megatron-Bridge publishes
  (R0192, R0229: same layout, same 974 TFLOPS), which the fit has.
- NVIDIA's technical blog "Boosting MoE Training Throughput with Advanced Fusion Kernels"
  (2026-06-15) measures what Transformer Engine's fused grouped MLP (the CuTe DSL kernels:
  activation and quantization in the GEMMs' epilogues, token counts kept on the device so the
  layer needs no host sync and a whole-step CUDA graph can capture it) adds end to end:
  +93% on NVIDIA's gpt-oss pre-training setup, +8% on its DeepSeek-V3 one. The blog names no
  layout; each is priced on the GB200 MXFP8 layout NVIDIA publishes for that model
  (Megatron-Bridge's gpt-oss-120b run R0006, the DeepSeek-V3 guide's last step) with the
  fused MLP and the whole-step graph, and without them (the per-layer graphs of attention
  and router). No fit saw these gains.

Published TFLOPS are converted to tokens/s/GPU with the model's FLOPs per token in Megatron's
convention (causal attention halved), as `moeplan validate` does for every TFLOPS-only row.

    python bench/megatron_recipes.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moeplan.cost_models.estimate import estimate
from moeplan.specs import list_presets
from moeplan.validation import RunCase, case_of, read_rows, validate_rows
from moeplan.validation.scoring import cluster_of, priced_layout

DATA = Path(__file__).parent / "data"
RECIPES = DATA / "megatron_lm_moe_recipes.csv"
STEPS = DATA / "deepseek_v3_gb200_steps.csv"
ZOO = DATA / "modelzoo_qwen3.csv"

ZOO_SKIPPED = ("MZQ03", "MZQ13")
"""The Model Zoo runs moeplan does not price: Megatron-FSDP instead of the distributed
optimizer; Qwen3-Next-80B-A3B, whose architecture (gated DeltaNet layers) has no preset."""

FUSED_MLP_GAINS = (
    ("gpt-oss-120b", 1.93, None, "R0006"),
    ("DeepSeek-V3", 1.08, STEPS, "DSG12"),
)
"""(model, end-to-end gain NVIDIA measured with the fused grouped MLP, file of the published
row whose layout prices it (None: the shipped published runs), that row's id)."""


def run_name(row: dict[str, str]) -> str:
    """What a run is, in its source's terms: the optimisation step, the recipe file, or the
    layout and sequence of a Model Zoo table row."""
    detail = row["source_detail"]
    if "; step " in detail:
        return detail.split("step ", 1)[1]
    if "recipe examples/moe_recipes/" in detail:
        return detail.split("recipe examples/moe_recipes/", 1)[1].split(";")[0]
    sizes = " ".join(f"{k.upper()}{row[k]}" for k in ("tp", "pp", "vpp", "ep", "cp")
                     if row[k] and row[k] != "1")
    notes = row["other_notes"].split(";")
    return (f"{row['num_gpus']} {row['gpu']} {row['precision']}: {sizes}, MBS "
            f"{row['micro_batch']}, {int(row['seq_len']) // 1024}K; " + "; ".join(
                n.strip() for n in notes if "dispatcher" in n or "overlap" in n))


def priced(path: Path, skips: tuple[str, ...] = ()) -> list[dict[str, object]]:
    """Per run: id, what it is, published and predicted tokens/s/GPU, the signed error.
    `skips`: the runs expected to be skipped (a setting moeplan does not model); any other
    skipped run stops the script."""
    rows = {r["id"]: r for r in read_rows(path)}
    out = validate_rows(list(rows.values()))
    if sorted(s["id"] for s in out["skipped"]) != sorted(skips):
        raise SystemExit(f"{path.name}: runs that cannot be priced: {out['skipped']}")
    res = []
    for r in out["rows"]:
        row = rows[r["id"]]
        what = run_name(row)
        pub, pred = r["published_tokens_per_s_per_gpu"], r["predicted_tokens_per_s_per_gpu"]
        lo, hi = r["predicted_interval_tokens_per_s_per_gpu"]
        res.append({"id": r["id"], "run": what, "published_tflops": float(row["tflops_per_gpu"]),
                    "published": pub, "predicted": pred, "error": pred / pub - 1,
                    # priced with every effect no fit row backs disappointing (its low end's
                    # start): what the run is if those effects fail
                    "pessimistic": r["pessimistic_tokens_per_s_per_gpu"],
                    "in_interval": lo <= pub <= hi, "interval_width": (hi - lo) / pred})
    return res


def _with_fused_mlp(case: RunCase, fused: bool, scope: str,
                    calibration: dict[str, Any] | None = None) -> float:
    """Tokens/s/GPU of a case's priced layout with the fused grouped MLP on or off, under CUDA
    graphs of the given scope (`calibration`: constants over the shipped profile's)."""
    lay = priced_layout(case).model_copy(update={"fused_grouped_mlp": fused, "cuda_graphs": True,
                                                 "cuda_graph_scope": scope})
    return estimate(case.model, cluster_of(case), case.training, lay, case.choices,
                    with_interval=False, calibration=calibration).tokens_per_s_per_gpu


def fused_mlp_gains(calibration: dict[str, Any] | None = None) -> list[dict[str, object]]:
    """Per model: the measured end-to-end gain of the fused grouped MLP and moeplan's, priced
    on the row's layout with the fused MLP and the whole-step graph it allows, against the
    unfused experts under per-layer graphs; and the kernels' share alone (both under per-layer
    graphs). `calibration`: constants over the shipped profile's."""
    presets = list_presets()
    out = []
    for model, measured, path, rid in FUSED_MLP_GAINS:
        case = case_of(next(r for r in read_rows(path) if r["id"] == rid), presets)
        if isinstance(case, str):
            raise SystemExit(f"{rid}: cannot be priced: {case}")
        base = priced_layout(case)
        unfused = _with_fused_mlp(case, False, "layer", calibration)
        out.append({"model": model, "row": rid, "gpus": base.world_size, "gpu": case.gpu,
                    "ep": base.ep, "mbs": base.mbs, "measured_gain": measured,
                    "predicted_gain": _with_fused_mlp(case, True, "full_iteration",
                                                      calibration) / unfused,
                    "predicted_kernel_gain": _with_fused_mlp(case, True, "layer",
                                                             calibration) / unfused})
    return out


def mape(rows: list[dict[str, object]]) -> float:
    return 100 * sum(abs(float(r["error"])) for r in rows) / len(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)
    recipes, steps, fused = priced(RECIPES), priced(STEPS), fused_mlp_gains()
    zoo = priced(ZOO, ZOO_SKIPPED)
    first, last = steps[0], steps[-1]
    summary = {
        "recipes_mape_percent": mape(recipes),
        "recipes_mean_error_percent": 100 * sum(float(r["error"]) for r in recipes) / len(recipes),
        "steps_measured_gain": float(last["published"]) / float(first["published"]),
        "steps_predicted_gain": float(last["predicted"]) / float(first["predicted"]),
        "steps_last_error_percent": 100 * float(last["error"]),
        "recipes_interval_coverage": sum(bool(r["in_interval"]) for r in recipes) / len(recipes),
        "zoo_mape_percent": mape(zoo),
    }
    if args.json:
        print(json.dumps({"recipes": recipes, "steps": steps, "model_zoo": zoo,
                          "fused_mlp_gains": fused, **summary}, indent=1))
        return 0
    for title, rows in (("Megatron-LM MoE recipes", recipes),
                        ("DeepSeek-V3 on 256 GB200, optimisation steps", steps),
                        ("Megatron-MoE-ModelZoo, Qwen3-235B-A22B", zoo)):
        print(title)
        print(f"{'id':<6} {'published':>10} {'predicted':>10} {'error':>8}  run")
        for r in rows:
            print(f"{r['id']:<6} {r['published']:>10.0f} {r['predicted']:>10.0f} "
                  f"{100 * float(r['error']):>+7.1f}%  {r['run']}")
        print()
    print("Fused grouped MLP, end to end (NVIDIA technical blog, 2026-06-15)")
    print(f"{'model':<14} {'layout':<22} {'measured':>9} {'predicted':>10} {'kernels only':>13}")
    for r in fused:
        where = f"{r['row']} {r['gpus']} {r['gpu']} EP{r['ep']}"
        print(f"{r['model']:<14} {where:<22} {r['measured_gain']:>8.2f}x "
              f"{r['predicted_gain']:>9.2f}x {r['predicted_kernel_gain']:>12.2f}x")
    print()
    print(f"recipes: MAPE {summary['recipes_mape_percent']:.1f}%, mean error "
          f"{summary['recipes_mean_error_percent']:+.1f}% over {len(recipes)} runs (tokens/s/GPU); "
          f"80% interval coverage {100 * summary['recipes_interval_coverage']:.0f}%")
    print(f"model zoo: MAPE {summary['zoo_mape_percent']:.1f}% over {len(zoo)} runs")
    print(f"steps: measured {summary['steps_measured_gain']:.2f}x from first to last, predicted "
          f"{summary['steps_predicted_gain']:.2f}x; last step {summary['steps_last_error_percent']:+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
