"""Write docs/ACCURACY.md: predicted vs published tokens/s/GPU, fit and held-out rows apart.

    python bench/accuracy_report.py DATA/published_runs.csv [-o docs/ACCURACY.md]

Uses the shipped calibration profile (moeplan/cost_models/calibration.json) exactly as
`moeplan validate` does; errors are grouped by GPU generation and by model family, and the worst
held-out rows are listed.
"""

from __future__ import annotations

import argparse
import math
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from moeplan.validation import ape, read_rows, validate_rows

GENERATION = {"A100": "Ampere (A100)", "AMPERE": "Ampere (A100)", "H100": "Hopper (H100/H200)", "H200": "Hopper (H100/H200)",
              "B200": "Blackwell HGX (B200/B300)", "B300": "Blackwell HGX (B200/B300)",
              "GB200": "Blackwell NVL72 (GB200/GB300)", "GB300": "Blackwell NVL72 (GB200/GB300)"}


RAW: dict[str, dict[str, str]] = {}
CSV_NAME = "shared/data/published_runs.csv"


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


def release_name(r: dict[str, Any]) -> str:
    from moeplan.validation import release_of

    row = RAW[r["id"]]
    rel = release_of(row)
    src = (row.get("source") or "")[:40]
    return f"{src} {rel[0]}.{rel[1]:02d}" if rel else src


def dense_a100(rows: list[dict[str, Any]]) -> list[str]:
    sel = [r for r in rows if generation(r["gpu"]) == "Ampere (A100)"
           or r["gpu"].startswith("Ampere")]
    out = ["| id | model | GPUs | split | predicted | published | error |",
           "|---|---|---:|---|---:|---:|---:|"]
    for r in sorted(sel, key=lambda r: r["id"]):
        out.append(f"| {r['id']} | {r['model']} | {RAW[r['id']]['num_gpus']} | {r['split']} | "
                   f"{r['predicted_tokens_per_s_per_gpu']:,.1f} | "
                   f"{r['published_tokens_per_s_per_gpu']:,.1f} | {100 * err(r):+.1f}% |")
    held = [abs(err(r)) for r in sel if r["split"] == "held-out"]
    out += ["", f"MAPE: all {_pct([abs(err(r)) for r in sel])} ({len(sel)} rows), held-out "
            f"{_pct(held)} ({len(held)} rows)."]
    return out


def table5_section() -> list[str]:
    """Korthikanti et al. 2022 Table 5 (Calculon's validation set), never seen by the fit."""
    from korthikanti_table5 import CALCULON_MAPE, table5_errors

    rows = table5_errors()
    out = ["### Korthikanti et al. 2022 Table 5 (Calculon's validation set)", "",
           "GPT 22B/175B/530B/1T on A100-80GB, full and selective recomputation, iteration time "
           "as published; the runs are in `bench/data/korthikanti_2022_table5.csv` (layouts and "
           "sources there) and none is in the fit. `python bench/korthikanti_table5.py` prints "
           "the same.", "",
           "| run | published | predicted | error |", "|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['id']} | {r['published']:,.1f} | {r['predicted']:,.1f} | "
                   f"{100 * float(r['error']):+.1f}% |")
    mape = 100 * sum(abs(float(r["error"])) for r in rows) / len(rows)
    out += ["", f"MAPE {mape:.1f}% over the eight runs (Calculon on the same runs: "
            f"{CALCULON_MAPE}%)."]
    return out


def ranking_section(res: dict[str, Any]) -> list[str]:
    rk = res["ranking"]
    out = ["## Layout ranking within a release", "",
           "Pairs of published layouts of one model, cluster, GPU count, precision, sequence",
           "length and software release (one layout published twice is not a pair), and whether",
           f"moeplan orders them as measured: **{rk['ordered']} of {rk['pairs']}** "
           f"({100 * (rk['share'] or 0):.0f}%). The fit's ranking term",
           "(`bench/fit_calibration.py::rank_penalty`) sees only pairs of two fit rows; by split:",
           "", "| pairs of | pairs | ordered as measured |", "|---|---:|---:|",
           *[f"| {k} rows | {v['pairs']} | {v['ordered']} |" for k, v in
             rk.get("by_split", {}).items()],
           "", "Every misordered pair:", "",
           "| rows | published tokens/s/GPU | predicted |", "|---|---|---|"]
    for w in rk["misordered"]:
        out.append(f"| {' vs '.join(w['ids'])} | {w['published'][0]:,.0f} vs "
                   f"{w['published'][1]:,.0f} | {w['predicted'][0]:,.0f} vs "
                   f"{w['predicted'][1]:,.0f} |")
    return out


def interval_section(res: dict[str, Any]) -> list[str]:
    from moeplan.cost_models.uncertainty import default_profile

    prof = default_profile()
    cv = prof.cross_validated
    out = ["## Prediction intervals", "",
           "Every estimate carries an 80 % interval of tokens/s/GPU (split conformal on the",
           "held-out rows' log errors, per regime, backing off to a broader regime below "
           f"{10} rows; `python bench/fit_intervals.py {CSV_NAME}` writes",
           "`moeplan/cost_models/intervals.json`). Its low end is also priced with every effect",
           "no fit row backs (EP overlap on this fabric, flex across domains, host offload)",
           "disappointing.", "",
           f"- Cross-validated (5 folds of held-out rows; each fold's intervals built from the "
           f"other folds only): coverage **{100 * cv['coverage']:.1f}%**, median width "
           f"**{100 * cv['median_width']:.1f}%** of the point, over {cv['rows']} rows.",
           f"- With the shipped bounds: held-out coverage {100 * (res['coverage'] or 0):.1f}%, "
           f"fit rows {100 * (res['coverage_fit'] or 0):.1f}%, median width "
           f"{100 * (res['median_interval_width'] or 0):.1f}%.",
           f"- Memory margin: {prof.memory_evidence}; margin = that share of the peak plus the "
           "reserve.", "",
           "| regime (cross-validated) | held-out rows | coverage |", "|---|---:|---:|"]
    for k, v in cv["by_regime"].items():
        out.append(f"| {k} | {v['rows']} | {100 * v['coverage']:.0f}% |")
    out += ["", "| regime (shipped bounds) | rows | low end | high end |", "|---|---:|---:|---:|"]
    for k, (lo, hi, n) in prof.regimes.items():
        out.append(f"| {k} | {n} | {100 * (math.exp(lo) - 1):+.1f}% | "
                   f"{100 * (math.exp(hi) - 1):+.1f}% |")
    return out


def _pct(v: list[float]) -> str:
    return f"{100 * sum(v) / len(v):.1f}%" if v else "–"


# MAPE of the previous revision (cost models and profile of commit 8685c69, measured with
# `moeplan validate --json` at that commit), for the "What changed" comparison.
PREVIOUS = {"held-out": 14.0, "held-out, tokens/s published directly": 14.8,
            "held-out, gpt-oss-120b excluded (see gaps)": 10.6, "fit (not evidence)": 13.7,
            "all": 13.8}
PREVIOUS_FAMILY = {"deepseek-v3": 14.1, "gpt-oss-120b": 46.3, "gpt3-175b": 17.3, "kimi-k2": 12.9,
                   "llama3-405b": 9.1, "llama3-70b": 4.5, "llama3-8b": 8.8,
                   "mixtral-8x22b": 20.8, "mixtral-8x7b": 8.0, "qwen2-57b-a14b": 11.3,
                   "qwen3-235b-a22b": 10.5, "qwen3-30b-a3b": 11.1}
# The held-out rows the previous revision scored (its held-out set): this revision scores more
# rows, so the headline also gives its MAPE on exactly these.
PREVIOUS_HELD_OUT_ROWS = 96

CHANGES = """## What changed

Against the previous revision (held-out MAPE in the last column of the tables above and below):

- **Seven more architectures, nineteen more scored rows.** The shared CSV leaves
  `model_preset` empty where no preset existed; rows whose `model` names an architecture
  moeplan now has a preset for are scored with it (`validation.MODEL_NAME_PRESETS`): Llama-2
  7B/13B/70B, NeMo's GPT-3 5B/20B, Nemotron-4 15B/340B (presets from their HF configs and
  technical reports, parameter counts tested). That adds NeMo's H100/B200/GB200 dense FP8
  rows and the NeMo long-sequence Llama-2-7B runs (4K to 1M tokens, CP up to 32): 6 held-out
  and 14 fit rows. Nemotron-8B/22B stay skipped: their sources do not give the architecture.
- **Gradient reduction dtype is a training setting with its cost.**
  `TrainingSpec.grad_reduce_dtype` (`fp32`, Megatron's default, or `bf16`:
  `--grad-reduce-in-bf16`) halves the data-parallel reduce-scatter (or all-reduce) bytes and
  the main-gradient buffer (memory: 2 instead of 4 bytes per parameter), is exported as the
  Megatron flag, and the runtime accumulates and reduces in bf16 when it is set (tested
  against the fp32 run on tp·cp·ep layouts). NVIDIA's performance recipes set it
  (Megatron-Bridge's common performance settings `cfg.ddp.grad_reduce_in_fp32 = False`, NeMo
  2.0's performance scripts and recipes' performance mode, NeMo 1's launcher
  `optim.grad_sync_dtype=bf16`), so their rows are priced with it; papers keep fp32. Rows whose
  data-parallel traffic crosses InfiniBand were the most under-predicted (with fp32 reduction
  and the previous profile: Nemotron-4 15B on 64 B200 −60%, Mixtral-8x7B on B200 −28%,
  Nemotron-4 340B on B200 −25%); with bf16 reduction, NeMo 2.0's FP8 parameter gather (next)
  and the refit they are at −36%, +6% and −2%. gpt-oss-120b's B200 rows, whose expert
  gradients cross InfiniBand at EP8, move the other way (held-out R0141 and R0185 from +25% and
  +19% to +44% and +37%): their deficit
  (below) was partly hidden by the overpriced reduction.
- **FP8 parameter all-gather is a training setting with its cost.**
  `TrainingSpec.fp8_param_gather` (Megatron `--fp8-param-gather`, FP8 recipes only) gathers the
  GEMM weights in one byte each; the embedding and output layer stay bf16. NeMo 2.0's FP8
  recipes set it (`bf16_with_fp8_mixed`: `fp8_params=True`; its MXFP8 recipe likewise), so its
  rows published as "FP8" are priced with it; "FP8-CS" rows and Megatron-Bridge's MXFP8 rows,
  whose recipes do not document one setting across releases, are not. Nemotron-4 15B on 64
  B200 needs it to be possible at all: its bf16 parameter bytes over the NICs alone take longer
  than the published step. The runtime refuses such a plan with the fix (it keeps bf16
  weights); export writes the flag. Memory is still priced with bf16 weights (conservative).
- **Context-parallel attention runs the kernels TE's ring runs.** Load-balanced causal CP
  gives each rank two chunks of c = s/(2·cp) tokens and one kernel per ring step; the steps
  whose K/V come from an earlier rank attend over one chunk (c keys), the others over two, so
  (cp − 1)/(2·cp) of the work runs on kernels half as long as before
  (`layers.cp_kernel_lengths`, at the measured length fall-off). Llama3-405B on 256 GB300 at
  TP4 against TP2·CP2 (measured 1,024 against 960–968 tokens/s/GPU), a tie the previous
  revision broke by 0.25%, is now 1.1% apart in the measured order.
- **Estimates name a model the cost models miss as a whole.** Where a model's fit rows sit
  more than 20% off in the median (at least 5 rows), `bench/fit_intervals.py` records the
  measured range and every estimate of that model warns with it: gpt-oss-120b (13 rows,
  0.58–0.76× the prediction) and Llama-2-7B (6 rows, its long-sequence runs). The interval is
  per regime and cannot hold such a model's bias; the warning says so instead of hiding it.
- **Refit** on the fit rows only (127 now), warm-started from the previous optimum: objective
  0.1489 (the previous revision: 0.1457 on its 113 rows). On the held-out rows both
  revisions score, everything but gpt-oss-120b improves (10.6% → 10.3%) and gpt-oss-120b
  worsens (46.3% → 50.4%, its B200 rows above), so the same-rows headline moves 14.0% →
  14.1%.
- **Tried and not adopted** (earlier rounds): Megatron-Bridge's workload configs applied to
  every row whose layout matches (the configs carry no release stamp; held-out 15.3%); a
  capped loss (13.6% held-out, 14 of 22 pairs ordered); recompute-until-fits; an MoE-only
  per-layer overhead. This round: leaving gpt-oss-120b out of the fit (tried on the previous
  revision's rows and physics) gave 13.6% held-out but ordered only 14 of 22 pairs; fitting `scaleout_eff` (the NIC-rate fraction of
  ring collectives, a fixed 0.8) drove it to the 1.0 ceiling, standing in for the FP8
  parameter all-gather the Nemotron-4 15B row needs, and pulled the A100 GEMM efficiency
  down until Korthikanti Table 5 missed its 8% bar (8.3%), so it stays a fixed prior.
""".splitlines()


def _span(errors: list[float]) -> str:
    """A list of errors as "+23%" or "+26–31%"."""
    lo, hi = round(100 * min(errors)), round(100 * max(errors))
    return f"{lo:+d}%" if lo == hi else f"{lo:+d}–{hi}%"


def long_context_figures(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The measured errors ASSUMPTIONS quotes (long-context rows, gpt-oss-120b), per length."""
    from moeplan.specs import load_model
    from moeplan.validation import flops_per_token_in

    def seq(r: dict[str, Any]) -> int:
        return int(RAW[r["id"]]["seq_len"])

    llama = [r for r in rows if r["model"] == "llama2-7b"
             and RAW[r["id"]]["source"].startswith("NVIDIA NeMo long-sequence")]
    parts = [f"{_span([err(r) for r in llama if seq(r) == s])} at {s // 1024}K"
             for s in (4096, 8192, 32768)]
    longest = [err(r) for r in llama if seq(r) >= 131072]
    llama_long = (", ".join(parts) + f" and {_span(longest)} from 128K to "
                  f"{max(seq(r) for r in llama) // 1048576}M")
    fold = [r for r in rows if r["model"] == "mixtral-8x22b" and seq(r) > 4096
            and RAW[r["id"]]["source"].startswith("MoE Parallel Folding")]
    mix = load_model("mixtral-8x22b")
    folding = ", ".join(
        f"{_span([err(r) for r in fold if seq(r) == s])} against "
        f"{flops_per_token_in(mix, s, 'full') / flops_per_token_in(mix, s, 'causal_halved'):.2f}"
        f" at {s // 1024}K" for s in sorted({seq(r) for r in fold}))
    oss = [r for r in rows if r["model"] == "gpt-oss-120b"]
    return {"llama2_long": llama_long, "folding_long": folding,
            "oss_bf16": _span([err(r) for r in oss if r["precision"] == "bf16"]),
            "oss_mx": _span([err(r) for r in oss if r["precision"] == "mxfp8"])}


def same_rows_mape(held: list[dict[str, Any]]) -> str:
    """MAPE over the held-out rows the previous revision could score: those whose CSV names a
    preset in `model_preset` or spells out a GPT's dimensions (not the rows this revision
    adds through `validation.MODEL_NAME_PRESETS`)."""
    old = [r for r in held if (RAW[r["id"]].get("model_preset") or "").strip()
           or r["family"] == "gpt-dense"]
    assert len(old) == PREVIOUS_HELD_OUT_ROWS, len(old)
    return _pct([abs(err(r)) for r in old])


def gpt_oss_cross_stack() -> list[str]:
    """gpt-oss-120b on 64 H100 in the two NVIDIA stacks that publish it, priced side by side:
    Megatron-Bridge's layout and NeMo Automodel's batch layout (FSDP2, not scored: priced here
    with the distributed optimizer at EP8, the source leaving EP blank)."""
    from moeplan.cost_models import estimate
    from moeplan.specs import Layout, TrainingSpec, load_cluster, load_model

    m, c = load_model("gpt-oss-120b"), load_cluster("h100", 64)
    bridge = estimate(m, c, TrainingSpec(seq_len=4096, global_batch_size=1280,
                                         grad_reduce_dtype="bf16"),
                      Layout.build(64, 1280, pp=4, ep=8), with_interval=False)
    auto = estimate(m, c, TrainingSpec(seq_len=4096, global_batch_size=512),
                    Layout.build(64, 512, ep=8, mbs=2), with_interval=False)
    b_pub = [float(RAW[i]["tokens_per_s_per_gpu"]) for i in ("R0096", "R0142", "R0186", "R0223")
             if i in RAW]
    a_pub = float(RAW["R0587"]["tokens_per_s_per_gpu"]) if "R0587" in RAW else float("nan")
    return [
        "  - **The other NVIDIA stack comes much closer.** On 64 H100, NeMo Automodel",
        f"    (FSDP2, TE + DeepEP + FlexAttention; R0587) publishes {a_pub:,.0f} tokens/s/GPU "
        "at GBS 512,",
        f"    MBS 2; moeplan prices that batch layout at EP8 {auto.tokens_per_s_per_gpu:,.0f} "
        f"({100 * (auto.tokens_per_s_per_gpu / a_pub - 1):+.0f}%; the source leaves EP",
        "    blank and the row is FSDP2, so it is not scored). Megatron-Bridge's own H100 layout",
        f"    (PP4 EP8 MBS 1, GBS 1280), which moeplan prices faster "
        f"({bridge.tokens_per_s_per_gpu:,.0f}), measured",
        f"    {min(b_pub):,.0f}–{max(b_pub):,.0f} "
        f"({100 * (bridge.tokens_per_s_per_gpu / max(b_pub) - 1):+.0f} to "
        f"{100 * (bridge.tokens_per_s_per_gpu / min(b_pub) - 1):+.0f}%): the same model on the "
        f"same GPUs ran {a_pub / max(b_pub):.2f}×",
        "    faster in the other stack, at a quarter of the error. Most of what the",
        "    Megatron-Bridge recipe loses is in its software, not in the hardware physics these",
        "    rows are fitted for (`bench/accuracy_report.py::gpt_oss_cross_stack`).",
    ]


ASSUMPTIONS = """## Assumptions and known gaps

- Published layouts are taken as printed; missing vpp/cp/mbs mean 1, a missing etp means 1
  (or tp when etp = 1 breaks a rule, and tp first for the Parallel Folding paper's unfolded
  "MCore" baseline), dp is derived. Unpublished settings take moeplan's
  defaults (alltoall dispatcher, no EP overlap, no TP comm overlap, no CUDA graphs, no
  recompute, distributed optimizer, fp32 gradient reduction, bf16 parameter gathers), except
  the documented 26.06 MXFP8 MoE recipe rule, the NeMo/Megatron-Bridge TP comm overlap and bf16
  gradient reduction rules, and NeMo 2.0's FP8 parameter gather rule above.
- Rows whose notes say Megatron-FSDP (FSDP=N>0), FSDP2, ZeRO-3 or FSDP-only are skipped, as are
  fine-tuning rows and a row its source flags as a performance regression.
- Megatron-Bridge tables re-publish the same configuration across releases. Apart from the
  26.06 MoE recipe change above, moeplan has no notion of software release, so such groups
  scatter around one prediction. The scatter reaches ±10% for some groups: Qwen3-235B-A22B on
  256 B300 (PP8 EP8, MBS 2) is published at 4.9k tokens/s/GPU in 26.04 and at 5.9k in
  26.04.01, with the same layout.
- Long-context rows are over-predicted, increasingly with sequence length: Mixtral-8x22B at
  16K–128K and NeMo's Llama-2-7B runs on H100 ({llama2_long}, CP up to 32; tokens derived
  from TFLOPS with the `full` convention their source records, which is the physically possible one here: under `causal_halved` the 1M
  run's attention would run faster than any H100 attention kernel). What is missing grows with
  the attention share of the step, so the attention kernels and the CP ring at these lengths
  run slower than the 4K-calibrated efficiency. For the MoE Parallel Folding rows (tokens derived from
  MFU with the `full` convention recorded for them) the error grows with the ratio of the
  `full` to the `causal_halved` FLOP count at each length ({folding_long}), which points
  at the convention: the one NeMo row of this kind that publishes both
  (R0324, Mixtral-8x22B at 64K, recorded `full`) has TFLOPS/tokens equal to the `causal_halved`
  count within 0.1%. The data file is left as published; R0324 itself is scored on its
  published tokens/s and is still over-predicted by about a third.
- gpt-oss-120b is over-predicted in every precision and on every GPU: BF16 by {oss_bf16} (H100
  included) and MXFP8 by {oss_mx} now that its 26.06 recipe's EP overlap is priced; on H100, GB200
  and GB300 the BF16 rows sit at one ratio (1.5–1.7×) across MBS 1 and 4, PP 1 and 4, EP 8 and
  64, so what is missing scales with the layer's compute, not with a layout. The MXFP8-to-BF16
  speed ratio (1.75× on 64 GB200, EP64, MBS 4) is not a GEMM-only ratio: the workload configs
  give the MXFP8 recipe the fused CuTe-DSL grouped MLP, full-iteration CUDA graphs, HybridEP,
  EP overlap and FP8 attention, and the BF16 one recomputes `layernorm` and `moe_act`. The
  expert MLP kernel is where gpt-oss's time goes: the 26.06.01 regression the source flags
  (cudnn-frontend issue 256) was a 10× slower fused grouped GEMM + dGeGLU kernel for GPT-OSS.
  No row documents the BF16 expert path's kernels, so nothing is fitted to it.
  - **Same work rate as a thinner model.** At MXFP8 on GB200, gpt-oss's measured work rate by
    moeplan's FLOP count is 985 TFLOPS. Qwen3-30B-A3B's on 8 GB200 in the same releases is 936
    TFLOPS, though its expert GEMMs are 3.75× thinner (ffn 768 against 2,880) and its experts
    receive 4× fewer tokens. The shape curve prices gpt-oss's fat GEMMs 1.2× more efficient,
    so something gpt-oss-specific eats the advantage. Its biased, clamped SwiGLU experts and its
    sink attention outside the fused kernels are the candidates.
  - **Unfused attention is ruled out** by memory: at MBS 4 the saved probabilities alone would
    take 8.6 GB per layer, 310 GB for 36.
  - **The published FLOP count for gpt-oss changed between releases.** Its TFLOPS/tokens ratio
    is 27.2 GFLOP/token in the BF16 releases, 32.6 in the MXFP8 ones (30.8 in 25.11 at s 8192).
    moeplan counts 34.3. For DeepSeek-V3 and Qwen3 the same ratio equals moeplan's count
    within 1% (DeepSeek-V3's 25.11 rows: 4% lower).
  - **Scoring is unaffected:** rows are scored on published tokens/s, which needs no FLOP
    convention. But gpt-oss's published TFLOPS and MFU understate the work its steps do.
""".splitlines() + ["<<CROSS_STACK>>"] + """
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
                "By software release", "Dense A100 rows", "Layout ranking within a release",
                "Prediction intervals", "Worst held-out rows", "Memory: DeepSeek-V3 anatomy", "Assumptions and known gaps",
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
    global RAW, CSV_NAME
    raw = read_rows(args.csv)
    RAW = {r["id"]: r for r in raw}
    CSV_NAME = args.csv_name
    res = validate_rows(raw)
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
        f"python bench/fit_intervals.py {args.csv_name}     # writes moeplan/cost_models/"
        "intervals.json (80% intervals, memory margin)",
        f"python bench/accuracy_report.py {args.csv_name}   # this file",
        f"moeplan validate {args.csv_name} --json           # the same numbers, per row",
        "python bench/korthikanti_table5.py                              # Table 5 runs (dense A100)",
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
        f"On the {PREVIOUS_HELD_OUT_ROWS} held-out rows the previous revision scored: "
        f"{same_rows_mape(held)} (previous revision {PREVIOUS['held-out']:.1f}%).",
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
        *table(rows, lambda r: r["model"] if r["family"] != "gpt-dense"
              else "GPT at the row's own dimensions", PREVIOUS_FAMILY),
        "",
        "## By software release",
        "",
        *table(rows, lambda r: release_name(r)),
        "",
        "## Dense A100 rows",
        "",
        "Narayanan et al. 2021 (Table 1, full recomputation) and MegaScale's Megatron-LM runs.",
        "",
        *dense_a100(rows),
        "",
        *table5_section(),
        "",
        *ranking_section(res),
        "",
        *interval_section(res),
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
    assumptions = []
    figures = long_context_figures(rows)
    for line in ASSUMPTIONS:
        assumptions += (gpt_oss_cross_stack() if line == "<<CROSS_STACK>>"
                        else [line.format(**figures)])
    lines += ["", *anatomy(), "", *assumptions]
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
