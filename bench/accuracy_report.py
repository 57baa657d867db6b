"""Write docs/ACCURACY.md: predicted vs published tokens/s/GPU, fit and held-out rows apart.

    python bench/accuracy_report.py DATA/published_runs.csv [-o docs/ACCURACY.md]

Uses the shipped calibration profile (moeplan/cost_models/calibration.json) exactly as
`moeplan validate` does; errors are grouped by GPU generation and by model family, and the worst
held-out rows are listed.
"""

from __future__ import annotations

import argparse
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from moeplan.validation import ape, read_rows, validate_rows

GENERATION = {"A100": "Ampere (A100)", "H100": "Hopper (H100/H200)", "H200": "Hopper (H100/H200)",
              "B200": "Blackwell HGX (B200/B300)", "B300": "Blackwell HGX (B200/B300)",
              "GB200": "Blackwell NVL72 (GB200/GB300)", "GB300": "Blackwell NVL72 (GB200/GB300)"}


def generation(gpu: str) -> str:
    for k, v in GENERATION.items():
        if gpu.upper().startswith(k):
            return v
    return gpu


def err(r: dict[str, Any]) -> float:
    return r["predicted_tokens_per_s_per_gpu"] / r["published_tokens_per_s_per_gpu"] - 1


def table(rows: list[dict[str, Any]], key, previous: dict[str, float] | None = None
          ) -> list[str]:
    groups: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        e = ape(r["predicted_tokens_per_s_per_gpu"], r["published_tokens_per_s_per_gpu"])
        if e is not None:
            groups[key(r)][r["split"]].append(e)
    prev = previous is not None
    out = ["| group | held-out rows | held-out MAPE | fit rows | fit MAPE |"
           + (" held-out, previous revision |" if prev else ""),
           "|---|---:|---:|---:|---:|" + ("---:|" if prev else "")]
    for g in sorted(groups):
        h, f = groups[g]["held-out"], groups[g]["fit"]
        tail = ""
        if previous is not None:
            tail = f" {previous[g]:.1f}% |" if g in previous else " – |"
        out.append(f"| {g} | {len(h)} | {_pct(h)} | {len(f)} | {_pct(f)} |" + tail)
    return out


def _pct(v: list[float]) -> str:
    return f"{100 * sum(v) / len(v):.1f}%" if v else "–"


# MAPE of the previous revision (the cost models and profile of commit 3b41af7, as its report
# printed them), for the "What changed" comparison.
PREVIOUS = {"held-out": 16.3, "held-out, tokens/s published directly": 16.8,
            "held-out, gpt-oss-120b excluded (see gaps)": 12.8, "fit (not evidence)": 16.0,
            "all": 16.1}
PREVIOUS_FAMILY = {"deepseek-v3": 18.1, "gpt-oss-120b": 47.4, "gpt3-175b": 16.5, "kimi-k2": 2.9,
                   "llama3-405b": 7.7, "llama3-70b": 4.5, "llama3-8b": 11.0,
                   "mixtral-8x22b": 22.5, "mixtral-8x7b": 6.3, "qwen2-57b-a14b": 12.1,
                   "qwen3-235b-a22b": 11.4, "qwen3-30b-a3b": 19.8}

CHANGES = """## What changed

Against the previous revision (held-out MAPE in the last column of the tables above and below):

- **Attention time counts the work the kernel does.** FlashAttention-2/3 and cuDNN's fused
  attention compute whole 128-key tiles and skip only tiles the mask empties, so a causal query
  computes (s + 128)/2 keys and a sliding-window query ⌈(w − 1)/128⌉ + 1 tiles: 256 keys for
  gpt-oss-120b's w = 128, not 128 (`compute.attended_keys`). Reported TFLOPS keep Megatron's
  count (`ModelSpec.flops_per_token` is unchanged); only the time follows the tiles.
- **Attention efficiency depends on the head dim** (`compute.attention_head_dim_factor`):
  [d/(d + 64)] / [160/(160 + 64)] relative to the DeepSeek-V3 shapes the efficiencies were
  measured on, capped at 1; D = 64 reproduces FlashAttention-3's d = 64 vs 128 vs 256
  throughput and is a fixed prior, not fitted. d = 128 runs at 0.93 of the measured efficiency,
  gpt-oss's d = 64 at 0.70.
- **Context-parallel ring attention** adds the per-step fp32 merge of partial outputs and
  softmax statistics forward and the dQ/dK/dV accumulation backward (memory-bound, c steps per
  layer; Transformer Engine's P2P context parallelism).
- **Sliding-window activation memory is unchanged on purpose**: flash attention keeps q, k, v,
  the output and the softmax statistics, none of which depends on the window.
- **The fit** now sweeps until no constant moves, then tries each constant together with a
  ±0.05 shift of every peak GEMM efficiency (the previous three sweeps stopped in a worse local
  minimum: the current code with the previous profile scores better on the fit rows than three
  sweeps from the priors); `gemm_half_dim`'s grid goes past 512, where the previous fit
  stopped at its edge, and the peak GEMM efficiencies move in steps of 0.025 instead of 0.05.
  Same fit rows, same objective (mean |log error| per row), held-out rows unread. The refit
  moves the GEMM constants together (`gemm_half_dim` 384 → 768, a stronger shape penalty on
  thin GEMMs, with peak efficiencies re-balanced: H100 0.8 → 0.925, GB300 0.85 → 0.9, B200
  and GB200 0.7 → 0.65–0.675; FP8 gain 0.7 → 0.8, MXFP8 0.7 → 0.9).
- **Tried and not adopted:** weighting each configuration once in the fit objective (a
  configuration re-published in four releases counts four times otherwise). It fits its own
  objective to 0.148 and gives 16.2% held-out MAPE; it is not used because the MAPE above
  weighs rows, and a re-publication is also evidence that a figure was reproducible.
- **Assessed and left alone:** grouped-GEMM size (every published MoE row gives each expert
  ≥ 1,024 tokens per micro-batch; the shape curve already prices each expert's GEMM at its own
  m, n and k, with the fitted `gemm_half_dim`) and the per-layer launch overhead (fitted at 0.2 ms per layer pass). A launch-bound gpt-oss
  would need ≈ 28 ms of host time per layer and micro-batch on GB200 in BF16 (its whole
  measured time), while Qwen3-30B-A3B, a similar MoE layer over the same 16,384 tokens per
  micro-batch in the same releases, takes 12.9 ms in all.
""".splitlines()

ASSUMPTIONS = """## Assumptions and known gaps

- Published layouts are taken as printed; missing vpp/cp/mbs mean 1, a missing etp means 1
  (or tp when etp = 1 breaks a rule), dp is derived. Unpublished settings take moeplan's
  defaults: alltoall dispatcher, no EP overlap, no recompute, distributed optimizer.
- Rows whose notes say Megatron-FSDP (FSDP=N>0), FSDP2, ZeRO-3 or FSDP-only are skipped, as are
  fine-tuning rows and a row its source flags as a performance regression.
- Megatron-Bridge tables re-publish the same configuration across releases that got faster;
  moeplan has no notion of software release, so such groups scatter around one prediction. The
  spread is large for MoE models: Qwen3-30B-A3B on 8 GB200 at MXFP8 (one layout) is published
  at 26.1–26.4k tokens/s/GPU in releases 26.02–26.02.01 and at 39.9–41.0k in 26.06–26.08, on
  8 GB300 at 30.4–31.7k and 44.5k; DeepSeek-V3 on 256 GB300 (PP2 VPP8 EP32) at 4.6–5.0k
  (MBS 2, 26.02–26.04.01) and 6.3–6.4k (MBS 1, 26.06–26.08). The profile sits between them, so
  the latest-release MoE rows are under-predicted by about 30% and the oldest over-predicted.
- Long-context rows with context parallelism (Mixtral-8x22B at 16K–128K) are over-predicted,
  increasingly with sequence length. For the MoE Parallel Folding rows (tokens derived from
  MFU with the `full` convention recorded for them) the error grows like the ratio of the
  `full` to the `causal_halved` FLOP count at each length (+18% against 1.13 at 16K, +25–29%
  against 1.22 at 32K, +32% against 1.37 at 64K, +35–52% against 1.54 at 128K), which points
  at the convention: the one NeMo row of this kind that publishes both
  (R0324, Mixtral-8x22B at 64K, recorded `full`) has TFLOPS/tokens equal to the `causal_halved`
  count within 0.1%. The data file is left as published; R0324 itself is scored on its
  published tokens/s and is still over-predicted by about a third.
- gpt-oss-120b is over-predicted in BF16 by 13–73% while its MXFP8 rows are within about 15%.
  No per-row physics reconciles the two: on the same 64 GB200, EP64, MBS 4 layout BF16 runs at
  15.8–16.6k and MXFP8 at 28.7–28.9k tokens/s/GPU (1.75×), but a block-scaled recipe speeds up
  only the GEMMs and by at most the 2× peak ratio, so BF16 GEMMs would have to be ≥ 86% of the
  BF16 step, against ≈ 60% in the model, which prices attention, memory-bound work and the
  NVLink all-to-all from their measured rates. The BF16 rows are from releases 25.11–26.04.01,
  the MXFP8 rows from 26.06–26.08, which run the experts through cuDNN-frontend's fused
  block-scaled grouped GEMM + GLU kernels: in the one release where that kernel's backward
  regressed tenfold (26.06.01, cudnn-frontend issue 256; the row is skipped) MXFP8 gpt-oss ran
  at 20.3k tokens/s/GPU on GB300, next to BF16's 19.3k. Against the other MoE models of the same
  late releases (DeepSeek-V3 and Qwen3 on Blackwell under-predicted by 20–35%), gpt-oss's MXFP8
  rows are over-predicted by 10–14%, so gpt-oss runs ≈ 1.5× slower than the model in both
  precisions: a gpt-oss-specific cost (its biased, clamped SwiGLU experts and sink attention
  outside the fused kernels are the candidates) that the published data cannot separate from
  release effects. An unfused (s²-materialising) attention for the sinks is ruled out by
  memory: at MBS 4 the saved probabilities alone would take 8.6 GB per layer, 310 GB for 36.
  The sliding-window layers are priced at the tiles their kernels compute (see What changed).
- DeepSeek-V3 anatomy: the routing probabilities are applied inside the expert activation, so
  no copy of the expert output is kept; the first three dense layers and the embedding share
  pp rank 0 under the balanced layout, so the peak GPU is a middle rank.
""".splitlines()


def anatomy() -> list[str]:
    """DeepSeek-V3 memory anatomy against the Megatron Core MoE report (computed, not typed)."""
    from moeplan.cost_models import estimate_breakdown
    from moeplan.specs import Layout, TrainingSpec, load_cluster, load_model

    m, c = load_model("deepseek-v3"), load_cluster("h100", 256)
    t = TrainingSpec(seq_len=4096, global_batch_size=1024)
    b = estimate_breakdown(m, c, t, Layout.build(256, 1024, pp=4, vpp=4, ep=64))
    mem = b.estimate.memory
    peak = max(b.ranks, key=lambda r: r.peak_bytes).rank
    ours = {"weights + grads": mem.weights_gb + mem.grads_gb,
            "fp32 master + Adam": mem.optimizer_gb, "activations": mem.activations_gb}
    ours["total (the three above)"] = sum(ours.values())
    report = {"weights + grads": 36.4, "fp32 master + Adam": 32.1, "activations": 131.0,
              "total (the three above)": 199.5}
    out = ["## Memory: DeepSeek-V3 anatomy", "",
           "256 GPUs, PP4 VPP4 EP64, TP1 ETP1, MBS1, s 4096, BF16, distributed optimizer, no",
           "recompute, no FP8 (Megatron Core MoE report). moeplan's peak GPU is pp rank "
           f"{peak} (stage layout `{b.stage_layout}`); its peak with buffers and",
           f"fragmentation is {mem.peak_gb:.1f} GB. Checked by "
           "`tests/test_cost_estimate.py::test_deepseek_v3_memory_anatomy_within_15_percent`.",
           "", "| part | report GB | moeplan GB | error |", "|---|---:|---:|---:|"]
    for k, v in report.items():
        out.append(f"| {k} | {v:.1f} | {ours[k]:.1f} | {100 * (ours[k] / v - 1):+.1f}% |")
    return out


OWN_SECTIONS = ("Headline", "What changed", "By GPU generation", "By model family",
                "Worst held-out rows", "Memory: DeepSeek-V3 anatomy", "Assumptions and known gaps",
                "Skipped rows")


def foreign_tail(path: Path) -> list[str]:
    """The sections of an existing report that this script does not write (another section,
    e.g. CPU calibration, appended after the published-runs part), from the first such `## `
    heading to the end, so that regenerating the report keeps them."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## ") and line[3:].strip() not in OWN_SECTIONS:
            return ["", *lines[i:]]
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("-o", "--out", default="docs/ACCURACY.md")
    ap.add_argument("--csv-name", default="shared/data/published_runs.csv",
                    help="how the CSV is named in the document")
    args = ap.parse_args()
    res = validate_rows(read_rows(args.csv))
    rows = [r for r in res["rows"] if r["published_tokens_per_s_per_gpu"]]
    held = [r for r in rows if r["split"] == "held-out"]
    fit = [r for r in rows if r["split"] == "fit"]
    direct = [r for r in held if not r["tokens_derived_from_tflops"]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()

    def mape(rs: list[dict[str, Any]]) -> str:
        return _pct([abs(err(r)) for r in rs])

    lines = [
        "# Accuracy of the cost models",
        "",
        "Predicted against published tokens/s/GPU for every row of the published-runs CSV whose",
        "model and cluster presets exist. **Held-out rows were never seen by the fit**; fit rows",
        "are shown only to expose over-fitting and are not evidence. The split is by",
        "configuration (`moeplan.validation.split_of`: CRC32 of model, GPU, precision, layout,",
        "sequence and batch, even → fit), so re-publications of one configuration across",
        "software releases fall on the same side.",
        "",
        "Produced by (from the repository root, shipped calibration profile):",
        "",
        "```",
        f"python bench/fit_calibration.py {args.csv_name}   # writes moeplan/cost_models/"
        "calibration.json from fit rows",
        f"python bench/accuracy_report.py {args.csv_name}   # this file",
        f"moeplan validate {args.csv_name} --json           # the same numbers, per row",
        "```",
        "",
        f"Code at commit `{commit}` plus the working tree at the time of writing.",
        "",
        "## Headline",
        "",
        "| rows | count | MAPE tokens/s/GPU | previous revision |",
        "|---|---:|---:|---:|",
        *[f"| {name} | {len(rs)} | {'**' + mape(rs) + '**' if name == 'held-out' else mape(rs)} "
          f"| {PREVIOUS[name]:.1f}% |" for name, rs in (
              ("held-out", held), ("held-out, tokens/s published directly", direct),
              ("held-out, gpt-oss-120b excluded (see gaps)",
               [r for r in held if r["model"] != "gpt-oss-120b"]),
              ("fit (not evidence)", fit), ("all", rows))],
        "",
        f"TFLOPS MAPE in each row's own FLOP convention (all rows with a known convention): "
        f"{100 * (res['mape_tflops'] or 0):.1f}%.",
        "",
        "Where a row publishes only TFLOPS or MFU, its tokens/s is derived with the row's FLOP",
        "convention (`full` adds the causal half of the attention term back,",
        "`full_with_recompute` a further forward pass); rows with an `unknown` convention and no",
        "tokens/s are not scored.",
        "",
        f"Memory: {sum(1 for r in res['rows'] if r['published_memory_gb'])} predicted rows "
        "publish a memory figure (the rows that do ran on the 96 GB H100 variant, which has no",
        "preset, or use FSDP), so memory is checked",
        "against the DeepSeek-V3 anatomy below.",
        "",
        *CHANGES,
        "",
        "## By GPU generation",
        "",
        *table(rows, lambda r: generation(r["gpu"])),
        "",
        "## By model family",
        "",
        *table(rows, lambda r: r["model"], PREVIOUS_FAMILY),
        "",
        "## Worst held-out rows",
        "",
        "| id | model | GPU | precision | predicted | published | error |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in sorted(held, key=lambda r: -abs(err(r)))[:15]:
        lines.append(f"| {r['id']} | {r['model']} | {r['gpu']} | {r['precision']} | "
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f} | "
                     f"{r['published_tokens_per_s_per_gpu']:,.0f} | {100 * err(r):+.1f}% |")
    lines += ["", *anatomy(), "", *ASSUMPTIONS]
    skipped: dict[str, int] = defaultdict(int)
    for s in res["skipped"]:
        skipped[s["why"].split(":")[0][:90]] += 1
    lines += ["", "## Skipped rows", "", "| reason | rows |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(skipped.items(), key=lambda kv: -kv[1])]
    lines += foreign_tail(Path(args.out))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}: held-out MAPE {mape(held)} over {len(held)} rows")


if __name__ == "__main__":
    main()
