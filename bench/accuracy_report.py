"""Write docs/ACCURACY.md: predicted vs published tokens/s/GPU, fit and held-out rows apart.

    python bench/accuracy_report.py DATA/published_runs.csv [-o docs/ACCURACY.md]

Uses the shipped calibration profile (moeplan/cost_models/calibration.json) exactly as
`moeplan validate` does; errors are grouped by GPU generation and by model family, and the worst
held-out rows are listed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from moeplan.cost_models import uncertainty as U
from moeplan.validation import ape, case_of, read_rows, validate_rows

GENERATION = {"A100": "Ampere (A100)", "AMPERE": "Ampere (A100)", "H100": "Hopper (H100/H200)", "H200": "Hopper (H100/H200)",
              "B200": "Blackwell HGX (B200/B300)", "B300": "Blackwell HGX (B200/B300)",
              "GB200": "Blackwell NVL72 (GB200/GB300)", "GB300": "Blackwell NVL72 (GB200/GB300)"}


RAW: dict[str, dict[str, str]] = {}
CSV_NAME = ""


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
PREVIOUS = {"held-out": 14.3, "held-out, tokens/s published directly": 15.1,
            "held-out, gpt-oss-120b excluded (see gaps)": 10.9, "fit (not evidence)": 14.0,
            "all": 14.2}
PREVIOUS_FAMILY = {"deepseek-v3": 13.7, "gpt-oss-120b": 50.4, "gpt3-175b": 14.8, "gpt3-20b": 29.4,
                   "gpt3-5b": 2.8, "kimi-k2": 12.9, "llama2-7b": 20.7, "llama3-405b": 9.1,
                   "llama3-70b": 5.0, "llama3-8b": 8.3, "mixtral-8x22b": 19.3,
                   "mixtral-8x7b": 7.0, "qwen2-57b-a14b": 10.4, "qwen3-235b-a22b": 10.2,
                   "qwen3-30b-a3b": 11.0}
# The held-out rows the previous revision scored (its held-out set): this revision scores the
# same rows, so the headline is already the same-rows comparison.
PREVIOUS_HELD_OUT_ROWS = 102

CHANGES = """## What changed

Against the previous revision (held-out MAPE in the last column of the tables above and below;
both revisions score the same 102 held-out rows):

- **Megatron-Bridge's recipes price the rows that ran them.** The performance summary prints a
  run's sizes, not its dispatcher, EP overlap, CUDA graphs or recompute; those live in the
  workload configs (`scripts/performance/configs/<family>/*_workload_base_configs.py`).
  `moeplan/validation/recipes.py` holds {recipes} of them for DeepSeek-V3, Kimi-K2,
  Qwen3-235B-A22B, Qwen3-30B-A3B and gpt-oss-120b, reduced to what moeplan prices. A row is
  priced with a recipe only when its model, GPU, precision and every printed size (GPUs,
  global batch, micro-batch, TP, PP, VPP, CP, EP) equal the recipe's, and, where the recipe
  kept the sizes of an earlier revision with other settings (the 26.06 MXFP8 change), only
  from that release on. The 26.06 rule still wins where both speak, and is silent where a
  row's sizes contradict the table's recipe for its release: Kimi-K2 on 256 GB300 at 26.06
  (R0053) printed MBS 2, the sizes of the recipe without EP overlap, not the MBS 1 of the
  MXFP8 recipe with it ({r0053_rule} with the overlap, {r0053} without). {matched} scored rows
  match ({matched_held} held-out, {matched_fit} fit). DeepSeek-V3 on 256 B200 (R0091, PP8
  VPP2 EP32), priced with moeplan's defaults (all-to-all, no overlap, no recompute) at
  {r0091_plain}, ran DeepEP with EP overlap and recomputed `mla_up_proj` and `mlp`:
  {r0091}, and its {r0091_gb} GB fits the B200 where the defaults' {r0091_plain_gb} GB did
  not. Qwen3-235B on 256 H100 (R0265 and its re-publications) ran EP overlap (R0265:
  {r0265_plain} without, {r0265} with); DeepSeek-V3 on 1,024 H100 (R0291) ran HybridEP and
  recomputed `mla_up_proj` and `mlp` ({r0291_plain} without, {r0291} with). Every figure
  here is this profile's. An earlier round applied these configs on the layout alone,
  without the batch, GPU count and release gate, and lost accuracy (15.3%); this one does
  not.
- **Each EP transfer hides behind its own partner.** Merged 1F1B runs forward dispatch beside
  the MLP backward, backward dispatch beside the MLP forward, and the combines beside the
  attention passes (the DeepSeek-V3 report's pairing). Exposure is now summed over those four
  pairs instead of the whole layer's compute, so a layer with short attention exposes its
  combines even when its MLP has time to spare. Where communication exceeds every partner
  (the H100 rows above) the two rules agree.
- **A training step's attention is slower than the kernel's microbenchmark.** The cuDNN
  efficiencies (REFERENCE: DeepSeek-V3 shapes) were used as they are measured; a step also
  runs TE's layout changes, RoPE and softmax-statistics traffic around the kernel and, under
  CP, one kernel per ring step. `Calibration.attn_realised` (≤ 1, per architecture) is the
  share a step realises, fitted: Hopper {attn_h}, Blackwell {attn_b}. This is where the
  long-context rows' error was: NeMo's Llama-2-7B runs (4K to 1M, CP up to 32) go from
  20.7% to {llama2}, the Parallel Folding Mixtral-8x22B rows from 19.3% to {mixtral} (family
  MAPE, held-out).
- **No GEMM runs faster than the GPU was measured to go.** The shape curve's asymptote is
  fitted; nothing stopped it from promising large GEMMs more than any GEMM reaches (the fit
  had moved H100's to 0.95 of the datasheet). `ClusterSpec.mamf_tflops` holds the measured
  maximum achievable matmul rate per input format (ml-engineering's MAMF table: H100 794.5
  BF16 / 1,402.6 FP8 TFLOPS, B200 1,745 / 3,432.5, GB200 1,822 / 3,615.6, A100 271.2; GB300
  takes GB200's, the table having no GB300 row and its B300 matching its B200), and every
  GEMM is priced at most at it; `moeplan calibrate` writes its own best GEMM there. The
  ceiling costs accuracy: on one fit pass, the same refit without it scored 12.1% held-out
  against 12.7% with it.
- **H100 communication kernels' SM share is fitted** (`comm_sm_fraction.hopper`, a fixed 0.15
  prior before): the documented EP overlap of the H100 rows above now tells it: {sm_h}.
- **Fit rows that use an effect but miss it no longer validate it.** An effect (EP overlap
  or the flex dispatcher on a fabric, CUDA graphs, CP at a length, a GPU's calibration) was
  validated by any fit row that relied on it. Now its fit rows must sit within the 1.2×
  "off as a whole" ratio in the median (`bench/fit_intervals.py::split_evidence`); otherwise
  the effect keeps its pessimistic low end and the estimate says what its rows measured. The
  flex dispatcher across H100 nodes is one such effect: its two fit rows (Qwen3-30B-A3B on 16
  H100) measured {flex_h100}× the prediction. So is gpt-oss's BF16 calibration on every Blackwell
  GPU.
- **A model the fit misses as a whole no longer calibrates the hardware.** The fit runs
  twice. The first pass, on every fit row, still misses gpt-oss-120b on every GPU and in
  both precisions (median {oss_first}× the prediction): the `estimate` warning's rule
  (`uncertainty.off_as_a_whole`: at least 5 fit rows, a median 1.2× off). That bias is its
  software stack's: NeMo Automodel runs the same model on the same 64 H100 at the predicted
  speed, Megatron-Bridge's recipe 1.3× slower (below). Fitted to it, the per-GPU GEMM
  efficiencies absorbed part of it, B300's most (0.575 with those rows, {b300} without), and
  priced the other models on that GPU too slow. The second pass, from the same start, leaves
  those rows out (`bench/fit_calibration.py::models_off`). They stay in every score here and
  in the model warning, and gpt-oss's BF16 calibrations count as unvalidated. On the
  previous revision's physics the same exclusion, made by hand, had cost the ranking (14 of
  22 pairs); on this revision's it keeps 20 of 22.
- **Refit** on the fit rows only ({fit_rows} of them, the first pass on 127): objective
  {objective} (previous revision 0.1489 on 127). Ranking within a release: 20 of 22 pairs
  (19 before).
- **Tried and not adopted** (earlier rounds): a capped loss (13.6% held-out, 14 of 22 pairs
  ordered); recompute-until-fits; an MoE-only per-layer overhead; fitting `scaleout_eff`,
  which drove it to the 1.0 ceiling and pulled Korthikanti Table 5 past its 8% bar. This
  round: one GEMM efficiency per architecture instead of per GPU model (13.7% held-out at its
  best value, one pass, before a refit).
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
            "oss_mx": _span([err(r) for r in oss if r["precision"] == "mxfp8"]),
            "r0324": f"{100 * next(err(r) for r in rows if r['id'] == 'R0324'):+.0f}%"}


def change_figures(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The fitted constants and family errors "What changed" quotes, read from the shipped
    profile and the rows (so the text cannot go stale)."""
    import moeplan.cost_models as cm
    from moeplan.cost_models.calibration import default_calibration

    cal = default_calibration()
    shipped = json.loads((Path(cm.__file__).parent / "calibration.json").read_text())
    about = re.search(r"objective ([0-9.]+)", shipped.get("_about", ""))

    def fam(name: str) -> str:
        return _pct([abs(err(r)) for r in rows
                     if r["model"] == name and r["split"] == "held-out"])

    from moeplan.validation.recipes import RECIPES

    matched = [r for r in rows if "recipe" in r["assumed"]]
    first = re.search(r"\(([0-9.]+)x the prediction in the median\)", shipped.get("_about", ""))
    flex = U.default_profile().contradicted.get("flex/hopper/scale-out")
    by_id = {r["id"]: r for r in rows}

    def pct(e: float) -> str:
        return f"{100 * e:+.0f}%"

    def priced(rid: str, recompute: bool = True, **layout: Any) -> tuple[str, str]:
        """A row's error and peak GB under this profile with its layout settings changed."""
        from moeplan.cost_models.estimate import estimate
        from moeplan.specs import Choices, list_presets, load_cluster

        case = case_of(RAW[rid], list_presets())
        lay = case.layout.model_copy(update=layout)
        est = estimate(case.model, load_cluster(case.cluster_name, lay.world_size),
                       case.training, lay, case.choices if recompute else Choices())
        pub = by_id[rid]["published_tokens_per_s_per_gpu"]  # tokens derived where only TFLOPS
        return (pct(est.tokens_per_s_per_gpu / pub - 1),
                f"{est.memory.peak_gb:.0f}")

    plain = {"dispatcher": "alltoall", "ep_overlap": False, "cuda_graphs": False}
    r0091_plain, r0091_plain_gb = priced("R0091", False, **plain)
    fit_rows = re.search(r"\(([0-9]+) rows", shipped.get("_about", ""))
    return {"r0091": pct(err(by_id["R0091"])), "r0091_gb": priced("R0091")[1],
            "r0091_plain": r0091_plain, "r0091_plain_gb": r0091_plain_gb,
            "r0265": pct(err(by_id["R0265"])),
            "r0265_plain": priced("R0265", ep_overlap=False)[0],
            "r0291": pct(err(by_id["R0291"])),
            "r0291_plain": priced("R0291", False, dispatcher="alltoall")[0],
            "r0053": pct(err(by_id["R0053"])),
            "r0053_rule": priced("R0053", ep_overlap=True, dispatcher="flex")[0],
            "flex_h100": f"{flex[1]:.2f}" if flex else "?",
            "oss_first": first.group(1) if first else "?",
            "b300": f"{cal.gemm_eff_max['B300']:.3f}",
            "recipes": str(len(RECIPES)), "matched": str(len(matched)),
            "fit_rows": fit_rows.group(1) if fit_rows else "?",
            "matched_held": str(sum(r["split"] == "held-out" for r in matched)),
            "matched_fit": str(sum(r["split"] == "fit" for r in matched)),
            "attn_h": f"{cal.attn_realised.get('hopper', 1.0):.2f}",
            "attn_b": f"{cal.attn_realised.get('blackwell', 1.0):.2f}",
            "llama2": fam("llama2-7b"), "mixtral": fam("mixtral-8x22b"),
            "sm_h": f"{cal.sm_fraction('hopper'):.2f}",
            "objective": about.group(1) if about else "?"}


def same_rows_mape(held: list[dict[str, Any]]) -> str:
    """MAPE over the held-out rows the previous revision could score (all of this revision's:
    it adds no scored rows)."""
    old = held  # the previous revision scored every row this one does
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
  where a Megatron-Bridge recipe's sizes match the row (`moeplan/validation/recipes.py`, above),
  the documented 26.06 MXFP8 MoE recipe rule, the NeMo/Megatron-Bridge TP comm overlap and
  bf16 gradient reduction rules, and NeMo 2.0's FP8 parameter gather rule.
- The recipe table was read at one revision of each workload-config file. A release that ran
  the same sizes with other settings is priced with that revision's settings unless the change
  is documented (the 26.06 MXFP8 one). Where the table may be wrong for an early release it
  shows: Qwen3-30B-A3B on 16 H100 (R0050, R0147, fit), whose recipe dispatches through
  HybridEP across the two nodes, is over-predicted by a quarter with it (−9% under the
  all-to-all default): either those releases dispatched all-to-all or HybridEP's scale-out
  deduplication buys less on H100 than its NVL72 measurements say.
- Rows whose notes say Megatron-FSDP (FSDP=N>0), FSDP2, ZeRO-3 or FSDP-only are skipped, as are
  fine-tuning rows and a row its source flags as a performance regression.
- Megatron-Bridge tables re-publish the same configuration across releases. Apart from the
  26.06 MoE recipe change above, moeplan has no notion of software release, so such groups
  scatter around one prediction. The scatter reaches ±10% for some groups: Qwen3-235B-A22B on
  256 B300 (PP8 EP8, MBS 2) is published at 4.9k tokens/s/GPU in 26.04 and at 5.9k in
  26.04.01, with the same layout.
- Long-context rows: NeMo's Llama-2-7B runs on H100 ({llama2_long}, CP up to 32; tokens derived
  from TFLOPS with the `full` convention their source records, the physically possible one
  here: under `causal_halved` the 1M run's attention would run faster than any H100 attention
  kernel) and the Parallel Folding Mixtral-8x22B rows ({folding_long}, the error against the
  ratio of the `full` to the `causal_halved` FLOP count at each length) are now priced with
  the attention a training step realises (`attn_realised`, above) instead of the kernel
  microbenchmark, which they had exceeded by a third at the longest lengths. The one NeMo row
  of this kind that publishes both TFLOPS and tokens/s (R0324, Mixtral-8x22B at 64K on B200,
  recorded `full`) has TFLOPS/tokens equal to the `causal_halved` count within 0.1%; it is
  scored on its published tokens/s and is still over-predicted by {r0324}.
- gpt-oss-120b is over-predicted in every precision and on every GPU: BF16 by {oss_bf16} (H100
  included) and MXFP8 by {oss_mx}, with its recipes' settings priced (the GB200 BF16 recipe's EP
  overlap makes those two rows the worst); across MBS 1 and 4, PP 1 and 4, EP 8 and 64 the
  BF16 rows sit at 1.25–1.9×, so what is missing scales with the layer's compute, not with a
  layout. The MXFP8-to-BF16
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
    ap.add_argument("csv", nargs="?", default=None,
                    help="published-runs CSV (default: the shipped moeplan/validation/data copy)")
    ap.add_argument("-o", "--out", default="docs/ACCURACY.md")
    ap.add_argument("--csv-name", default="",
                    help="how the CSV is named in the document (empty: the shipped copy, the default)")
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
    changes = change_figures(rows)  # computed once, quoted by "What changed"
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
        *[line.format(**changes) for line in CHANGES],
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
