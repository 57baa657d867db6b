"""Write docs/ACCURACY.md: cross-validated accuracy of the cost models on published runs.

    python bench/accuracy_report.py [CSV] [--crossval bench/data/crossval.json] [-o docs/ACCURACY.md]

The headline is leave-one-model-out: every row predicted by a calibration refitted without any
row of its model (bench/cross_validate.py, full refit). Leave-one-release-out and the
configuration split (fit rows against held-out rows) follow; the shipped profile's own errors
on the rows it was fitted on are shown last and are not evidence. Every figure is computed
here, from the rows, the cross-validation file and the shipped profiles.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from moeplan.cost_models import uncertainty as U
from moeplan.cost_models.calibration import default_calibration
from moeplan.fsio import atomic_write_text
from moeplan.validation import (
    RunCase,
    case_of,
    layout_pairs,
    read_rows,
    release_of,
    validate_rows,
)
from moeplan.validation.scoring import family_groups

CROSSVAL = Path(__file__).resolve().parent / "data" / "crossval.json"
GENERATION = {"ampere": "Ampere (A100)", "hopper": "Hopper (H100/H200)",
              "blackwell-hgx": "Blackwell HGX (B200/B300)",
              "blackwell-nvl72": "Blackwell NVL72 (GB200/GB300)"}
"""Display names of the GPU families `moeplan.cost_models.uncertainty.generation` groups by,
which every cross-validated row carries (`gpu_family`)."""
RAW: dict[str, dict[str, str]] = {}

# Figures of the previous revision (commit c048f21), for "What changed", as its own ACCURACY.md,
# bench/data/crossval.json, intervals.json and `bench/megatron_recipes.py --json` reported them
# (the same harness: bench/cross_validate.py, full refit per fold).
PREVIOUS = {"config": 6.7, "model": 9.6, "release": 7.3, "table5": 3.9, "objective": "0.0889",
            "recipes": 15.9, "recipes_coverage": 11, "cv_coverage": 80.9,
            "loro_coverage": 84.2, "lomo_coverage": 81.3, "quick": 10.3, "rows": 241,
            # Megatron-LM's DeepSeek-V3 GB200 optimisation steps (`moeplan validate`)
            "steps": 30.8}


def generation(row: dict[str, Any]) -> str:
    """A row's GPU family, by name."""
    return GENERATION.get(row["gpu_family"], row["gpu_family"])


def pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def mape(rows: list[dict[str, Any]]) -> float | None:
    return sum(abs(r["error"]) for r in rows) / len(rows) if rows else None


def bias(rows: list[dict[str, Any]]) -> float | None:
    return sum(r["error"] for r in rows) / len(rows) if rows else None


def grouped(rows: list[dict[str, Any]], key) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return dict(sorted(out.items()))


def release_name(rid: str) -> str:
    row = RAW[rid]
    rel = release_of(row)
    src = (row.get("source") or "")[:44]
    return f"{src} {rel[0]}.{rel[1]:02d}" if rel else src


def error_table(groups: dict[str, list[dict[str, Any]]], extra: dict[str, str] | None = None,
                extra_name: str = "") -> list[str]:
    head = "| group | rows | MAPE | mean error |" + (f" {extra_name} |" if extra else "")
    out = [head, "|---|---:|---:|---:|" + ("---:|" if extra else "")]
    for g, rs in groups.items():
        tail = f" {extra.get(g, '–')} |" if extra else ""
        out.append(f"| {g} | {len(rs)} | {pct(mape(rs))} | {pct(bias(rs), True)} |{tail}")
    return out


def as_scoring_rows(cv_rows: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """Cross-validated rows in `scoring.layout_pairs`'s shape."""
    return [{"id": r["id"], "model": r["model"], "precision": r["precision"], "split": split,
             "published_tokens_per_s_per_gpu": r["published"],
             "predicted_tokens_per_s_per_gpu": r["predicted"]} for r in cv_rows]


# ----------------------------------------------------------------------------- sections
def headline(cv: dict[str, Any], quick: dict[str, Any] | None, shipped: list[dict[str, Any]]
             ) -> list[str]:
    lo, lr, cs = cv["model"], cv["release"], cv["config"]
    rows = [("**leave one model out** (headline)", lo, PREVIOUS["model"]),
            ("leave one release out", lr, PREVIOUS["release"]),
            ("configuration split: fit rows → held-out rows", cs, PREVIOUS["config"])]
    out = ["| yardstick | rows | MAPE tokens/s/GPU | median | 90th percentile | previous "
           "revision |", "|---|---:|---:|---:|---:|---:|"]
    for name, r, prev in rows:
        out.append(f"| {name} | {r['count']} | **{pct(r['mape'])}** | {pct(r['median_ape'])} | "
                   f"{pct(r['p90_ape'])} | {'–' if prev is None else f'{prev:.1f}%'} |")
    if quick and "model" in quick:
        q = quick["model"]
        out.append(f"| leave one model out, quick refit (`moeplan validate --cv model`) | "
                   f"{q['count']} | {pct(q['mape'])} | {pct(q['median_ape'])} | "
                   f"{pct(q['p90_ape'])} | – |")
    ins = [{"error": r["predicted_tokens_per_s_per_gpu"] / r["published_tokens_per_s_per_gpu"]
            - 1} for r in shipped]
    out.append(f"| shipped profile on the rows it was fitted on (not evidence) | {len(ins)} | "
               f"{pct(mape(ins))} | – | – | – |")
    no_oss = [r for r in lo["rows"] if r["model"] != "gpt-oss-120b"]
    out += ["", f"Leave one model out without gpt-oss-120b: {pct(mape(no_oss))} over "
            f"{len(no_oss)} rows (gpt-oss-120b alone: "
            f"{pct(mape([r for r in lo['rows'] if r['model'] == 'gpt-oss-120b']))})."]
    return out


def model_gpu_bias(rows: list[dict[str, Any]], split: str = "leave-one-model-out"
                   ) -> list[str]:
    """Model × GPU-family groups of 2+ rows whose mean error passes ±30% (the issue's bar;
    `scoring.family_groups` decides which)."""
    groups = family_groups(rows, lambda r: r["error"])
    off = {(g["model"], g["gpu_family"]) for g in groups if g["off"]}
    big = grouped([r for r in rows if (r["model"], r["gpu_family"]) in off],
                  lambda r: f"{r['model']} on {generation(r)}")
    out = [f"Model × GPU-family groups with two or more rows: {len(groups)}; with a mean error "
           f"beyond ±30% under {split}: {len(big)}."]
    if big:
        out += ["", *error_table(big)]
    return out


def family_section(cv: dict[str, Any]) -> list[str]:
    lomo = prof_doc().get("leave_one_model_out", {}).get("by_family", {})
    cov = {k: f"{100 * v['coverage']:.0f}%" for k, v in lomo.items()}
    return ["Each family's rows predicted by refits without their model; coverage is the share "
            "inside the 80% interval built from the other models' rows only.", "",
            *error_table(grouped(cv["model"]["rows"], lambda r: r["family"]), cov,
                         "interval coverage")]


def prof_doc() -> dict[str, Any]:
    import moeplan.cost_models as cm

    return json.loads((Path(cm.__file__).parent / "intervals.json").read_text())


def ranking_section(cv_rows: list[dict[str, Any]]) -> list[str]:
    rk = layout_pairs(as_scoring_rows(cv_rows, "held-out"), RAW)
    out = ["Pairs of published layouts of one model, cluster, GPU count, precision, sequence",
           "length and software release, ordered by the leave-one-model-out predictions (each",
           "pair by one refit that saw neither row): "
           f"**{rk['ordered']} of {rk['pairs']}** ({100 * (rk['share'] or 0):.0f}%); "
           f"{rk['ordered_within_step_bar']} of them also priced within 20% of the measured "
           "ratio (told apart by as much as the hardware did).", "",
           "| rows | published tokens/s/GPU | predicted |", "|---|---|---|"]
    for w in rk["misordered"]:
        out.append(f"| {' vs '.join(w['ids'])} | {w['published'][0]:,.0f} vs "
                   f"{w['published'][1]:,.0f} | {w['predicted'][0]:,.0f} vs "
                   f"{w['predicted'][1]:,.0f} |")
    # the gaps a note quotes, from the pair itself: how much the first row out-measured the
    # second, and how far below it the first is priced
    notes = [MISORDERED[tuple(w["ids"])].format(
        measured=w["published"][0] / w["published"][1] - 1,
        priced=1 - w["predicted"][0] / w["predicted"][1])
        for w in rk["misordered"] if tuple(w["ids"]) in MISORDERED]
    return out + (["", *notes] if notes else [])


# Why a misordered pair is misordered, where the sources say: each note names what it read.
MISORDERED = {
    ("R0167", "R0203"): (
        "- R0167 (26.02.01) prints Llama-3-70B on 64 GB300 in MXFP8 as MBS 2, PP 4 without "
        "virtual stages: 8 micro-batches per pipeline, a 3/8 bubble, priced {priced:.0%} below "
        "the 26.02 run of MBS 1, PP 4, VPP 5 (R0203), which it out-measured by {measured:.0%}. "
        "Megatron-Bridge "
        "v0.3.0 and v0.3.1 (the 26.02 and 26.02.01 releases) configure that GPU and precision "
        "as PP 4, VPP 5, MBS 1 (`LLAMA3_70B_PRETRAIN_CONFIG_GB300_FP8_MX_V2`), which R0203 "
        "prints: the 26.02.01 table's sizes are not the recipe's. moeplan prices a row as "
        "printed, so the pair stays misordered."),
    ("R0176", "R0212"): (
        "- R0176 vs R0212 (Llama-3.1-405B on 256 GB300, TP 2 vs TP 4) measured {measured:.1%} "
        "apart and are priced {priced:.1%} apart the other way: inside either row's "
        "interval."),
}


def isolating_pairs(cv_rows: list[dict[str, Any]], axis: str, label: str) -> list[str]:
    """Rows of one release group that differ only in `axis` (and what follows from it): the
    measured and the leave-one-model-out predicted ratio between them."""
    by_id = {r["id"]: r for r in cv_rows}
    keys = ("cluster_preset", "num_gpus", "precision_preset", "seq_len", "source",
            "source_detail")
    groups: dict[tuple, list[dict[str, str]]] = defaultdict(list)
    for rid in by_id:
        row = RAW[rid]  # the model as priced: a preset cell or the preset its name maps to
        groups[(by_id[rid]["model"], *(row.get(k, "") for k in keys))].append(row)
    out = ["| rows | layouts (TP/PP/VPP/EP/MBS) | measured ratio | predicted ratio |",
           "|---|---|---:|---:|"]
    seen = set()
    for members in groups.values():
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if (a.get(axis) or "1") == (b.get(axis) or "1"):
                    continue
                pair = tuple(sorted((a["id"], b["id"])))
                cfg = (a.get(axis), b.get(axis), by_id[a["id"]]["model"], a["cluster_preset"])
                if pair in seen or cfg in seen:
                    continue
                seen |= {pair, cfg}
                ra, rb = by_id[a["id"]], by_id[b["id"]]
                out.append(f"| {a['id']} vs {b['id']} ({by_id[a['id']]['model']}, {a['gpu']}) | "
                           f"{_lay(a)} vs {_lay(b)} | "
                           f"{ra['published'] / rb['published']:.2f} | "
                           f"{ra['predicted'] / rb['predicted']:.2f} |")
    return out if len(out) > 2 else ["No release publishes such a pair."]


def _lay(row: dict[str, str]) -> str:
    return "/".join(row.get(k) or "1" for k in ("tp", "pp", "vpp", "ep", "micro_batch"))


def series(cv_rows: list[dict[str, Any]], ids: list[str], col: str, label: str) -> list[str]:
    by_id = {r["id"]: r for r in cv_rows}
    out = [f"| row | {label} | published | predicted | error |", "|---|---:|---:|---:|---:|"]
    for rid in ids:
        if rid in by_id:
            r = by_id[rid]
            out.append(f"| {rid} | {RAW[rid][col]} | {r['published']:,.0f} | "
                       f"{r['predicted']:,.0f} | {pct(r['error'], True)} |")
    return out


def folding_strong(cv_rows: list[dict[str, Any]]) -> list[str]:
    """Parallel Folding's strong-scaling rows (fixed batch, the tuned layout of its Table 3),
    per model and method, GPUs growing."""
    by_id = {r["id"]: r for r in cv_rows}

    def method(raw: dict[str, str]) -> str:
        return "MCore with Folding" if "w/ folding" in raw["other_notes"].lower() else "MCore"

    ids = sorted((i for i in by_id if RAW[i]["source"].startswith("MoE Parallel Folding")
                  and "strong scaling" in RAW[i]["other_notes"]),
                 key=lambda i: (by_id[i]["model"], method(RAW[i]), int(RAW[i]["num_gpus"])))
    out = ["| row | model | method | GPUs | published | predicted | error |",
           "|---|---|---|---:|---:|---:|---:|"]
    for i in ids:
        r = by_id[i]
        out.append(f"| {i} | {r['model']} | {method(RAW[i])} | {RAW[i]['num_gpus']} | "
                   f"{r['published']:,.0f} | {r['predicted']:,.0f} | {pct(r['error'], True)} |")
    return out


def scale_section(cv_rows: list[dict[str, Any]]) -> list[str]:
    ids = {r["id"] for r in cv_rows}

    def pick(pred) -> list[str]:
        return sorted((i for i in ids if pred(RAW[i])),
                      key=lambda i: (int(RAW[i]["seq_len"]), int(RAW[i]["num_gpus"]), i))

    longseq = pick(lambda r: r["source"].startswith("NVIDIA NeMo long-sequence")
                   and r["model_preset"] == "" and "LLAMA2-7B" in r["model"])
    longseq3 = pick(lambda r: r["source"].startswith("NVIDIA NeMo long-sequence")
                    and "LLAMA3-8B" in r["model"])
    folding = pick(lambda r: r["source"].startswith("MoE Parallel Folding")
                   and r["model_preset"] == "mixtral-8x22b")
    strong = pick(lambda r: r["source"].startswith("MegaScale") and "175B" in r["model"]
                  and "system=Megatron-LM" in r["other_notes"])
    return [
        "Each effect against the published rows that isolate it, every prediction from the",
        "leave-one-model-out refits (no fold saw the rows it predicts).", "",
        "### Pipeline depth (rows of one release differing in PP)", "",
        *isolating_pairs(cv_rows, "pp", "PP"), "",
        "### Tensor parallelism (rows of one release differing in TP)", "",
        *isolating_pairs(cv_rows, "tp", "TP"), "",
        "### Long context: NeMo long-sequence Llama-2-7B (H100), sequence and CP growing", "",
        *series(cv_rows, longseq, "seq_len", "sequence"), "",
        "### Long context: NeMo long-sequence Llama-3-8B (B200), sequence and CP growing", "",
        *series(cv_rows, longseq3, "seq_len", "sequence"), "",
        "### Long context: Parallel Folding Mixtral-8x22B", "",
        *series(cv_rows, folding, "seq_len", "sequence"), "",
        sequence_note(cv_rows), "",
        "### Strong scaling: MegaScale's Megatron-LM baseline, GPT-175B at a fixed batch", "",
        *series(cv_rows, strong, "num_gpus", "GPUs"), "",
        "### Strong scaling: Parallel Folding's MoE runs at a fixed batch of 1,024 sequences", "",
        "The paper fixes each model's layout at its tuned optimum and prints no virtual",
        "pipeline size; each profile prices such a row at the fastest size Megatron accepts",
        "that fits in memory as priced (`validation.cases.tuned_vpp`, `validation.scoring.",
        "fastest`). As the GPUs grow at a fixed batch, each pipeline",
        "gets fewer micro-batches and an uninterleaved schedule's bubble grows to (p − 1)/m: read",
        "as uninterleaved, Qwen2-57B-A14B at 1,024 GPUs (8 micro-batches over PP4) was priced 25%",
        "slow.", "",
        *folding_strong(cv_rows), "",
        "### CUDA graph scope: Megatron-LM's recipes, one layout with per-layer and whole-step "
        "graphs", "",
        *graph_scope_pairs(), "",
        "### Fused grouped MLP: NVIDIA's end-to-end gains", "",
        *fused_mlp_section(), "",
        "### The host's cost per launch these gains imply", "",
        *host_sensitivity(),
    ]


GRAPH_PAIRS = (("MLR07", "MLR08", "Qwen3-235B-A22B, 128 GB200, EP64"),
               ("MLR14", "MLR13", "Qwen3-30B-A3B, 16 GB200, EP16"))
"""Megatron-LM recipes (bench/data/megatron_lm_moe_recipes.csv) that differ only in the CUDA
graph scope: the whole step with the paged stash, and the attention and router per layer."""


@functools.cache
def unseen_runs() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Megatron-LM's recipes, the DeepSeek-V3 GB200 steps) priced once with the shipped
    profile (`bench/megatron_recipes.py`): every section that quotes them reads this."""
    from megatron_recipes import RECIPES, STEPS, priced

    return priced(RECIPES), priced(STEPS)


@functools.cache
def zoo_runs() -> list[dict[str, Any]]:
    """Megatron-MoE-ModelZoo's Qwen3-235B-A22B runs on 256 H100, priced once with the shipped
    profile (`bench/megatron_recipes.py`)."""
    from megatron_recipes import ZOO, ZOO_SKIPPED, priced

    return priced(ZOO, ZOO_SKIPPED)


def zoo_experts(rid: str) -> str:
    """A Model Zoo run's local experts per rank and the tokens each receives per micro-batch
    (the grouped GEMM's M, `uncertainty.dimensions`), from its case."""
    from megatron_recipes import ZOO

    from moeplan.cost_models.uncertainty import dimensions
    from moeplan.specs import list_presets
    from moeplan.validation import case_of

    case = case_of(next(r for r in read_rows(ZOO) if r["id"] == rid), list_presets())
    m = dimensions(case.model, case.training, case.layout)["tokens_per_expert"]
    return f"{case.model.num_experts // case.layout.ep} local experts at M = {m:,.0f} tokens"


def zoo_host_sensitivity(ids: tuple[str, ...] = ("MZQ04", "MZQ05")) -> str:
    """Each run's error priced with the launch time per host CPU at 0, 1 and 2 times the
    shipped profile's (`Calibration.launch_us`)."""
    from megatron_recipes import ZOO

    from moeplan.specs import list_presets
    from moeplan.validation import case_of
    from moeplan.validation.scoring import predict_case

    cal = json.loads((Path(__file__).resolve().parents[1] / "moeplan" / "cost_models"
                      / "calibration.json").read_text())
    rows = {r["id"]: r for r in read_rows(ZOO)}
    out = []
    for rid in ids:
        case = case_of(rows[rid], list_presets())
        errs = []
        for f in (0.0, 1.0, 2.0):
            p = predict_case(case, {**cal, "launch_us": {k: f * v for k, v in
                                                         cal["launch_us"].items()}})
            errs.append(f"{100 * (p['predicted_tokens_per_s_per_gpu'] / p['published_tokens_per_s_per_gpu'] - 1):+.0f}%")
        out.append(f"{rid} {', '.join(errs)}")
    return "; ".join(out)


def zoo_section() -> list[str]:
    """The Model Zoo's layouts and long-context runs: the table, the layouts' order and steps
    pair by pair, and what `moeplan validate` says of them."""
    runs = zoo_runs()
    by_id = {str(r["id"]): r for r in runs}
    out = ["", "Megatron-MoE-ModelZoo's Qwen3 page (`best_practice/qwen3/readme.md`, commits "
           "c1ad0b5c89 and 020b8136b3) publishes Qwen3-235B-A22B on 256 H100 in BF16: five "
           "layouts of one batch (GBS 2048, 4K tokens) with their step times, and four "
           "long-context runs (TP 4, PP 8, EP 8, GBS 256, CP growing with the sequence) in "
           "TFLOPS with the routing force-balanced; and on NVL72 racks a BF16 and an MXFP8 "
           "layout on 256 GB200 and a 128K-token run on 128 GB300, with their launch commands. "
           "Each row is read as its table and command document it: the dispatcher (DeepEP, "
           "HybridEP, or A2A for the all-to-all one), the 1F1B EP overlap (\"+1f1b "
           "overlap\", A2A_OVERLAP), the CUDA graph scope, the offloaded modules and the "
           "recompute modules in the table's words (\"norm, act\": layernorm and moe_act). "
           "Skipped: the layout with Megatron-FSDP (not modelled) and Qwen3-Next-80B-A3B (no "
           "preset); left out: the GB300 4K run, the run Megatron-Bridge publishes (R0192, "
           "R0229: same layout, same 974 TFLOPS), which the fit has:", "",
           "| id | run | published tokens/s/GPU | predicted | error |",
           "|---|---|---:|---:|---:|"]
    for r in runs:
        out.append(f"| {r['id']} | {r['run']} | {float(r['published']):,.0f} | "
                   f"{float(r['predicted']):,.0f} | {100 * float(r['error']):+.1f}% |")
    layouts = ("MZQ02", "MZQ01", "MZQ04", "MZQ05")
    measured = sorted(layouts, key=lambda i: -float(by_id[i]["published"]))
    predicted = sorted(layouts, key=lambda i: -float(by_id[i]["predicted"]))
    steps = []
    for a, b in zip(measured, measured[1:], strict=False):
        m = float(by_id[a]["published"]) / float(by_id[b]["published"])
        q = float(by_id[a]["predicted"]) / float(by_id[b]["predicted"])
        steps.append(f"{a}/{b} measured ×{m:.2f}, predicted ×{q:.2f}")
    spread = float(by_id[measured[0]]["published"]) / float(by_id[measured[-1]]["published"])
    pspread = float(by_id[measured[0]]["predicted"]) / float(by_id[measured[-1]]["predicted"])
    out += ["", f"The four priced layouts measured {100 * (spread - 1):.0f}% apart, fastest to "
            f"slowest, and are priced {100 * (pspread - 1):.0f}% apart, "
            + ("in the measured order" if measured == predicted else
               f"in the order {', '.join(predicted)} (measured: {', '.join(measured)})")
            + f"; each step down the measured order: {'; '.join(steps)}. The deep pipeline "
            f"(PP 32, one layer per virtual stage, {zoo_experts('MZQ04')}) and TP 4 with "
            f"intra-node EP ({zoo_experts('MZQ05')}) are the two priced fastest against their "
            "runs; what moves them is the host's time per launch (error at no "
            f"host floor, the fitted launch time, and twice it: {zoo_host_sensitivity()}). "
            "The fitted time is what the runs of 2025–26 the fit saw need; these runs, of "
            "Megatron-LM's 2025 development branches, ask for more (Known gaps). The "
            "long-context runs are within a few percent and gain TFLOPS with the sequence as "
            "measured.",
            "", held_out_groups("modelzoo_qwen3.csv")]
    return out


def sequence_note(cv_rows: list[dict[str, Any]]) -> str:
    """Every step of sequence length among the rows of one model, cluster, precision and
    release, leave-one-model-out, in TFLOPS/GPU (moeplan's count): whether it moves the way
    it was measured (`moeplan.validation.scoring.sequence_steps`, what `moeplan validate`
    reports of runs no fit saw)."""
    from moeplan.validation.scoring import sequence_steps

    rows = []
    for r in as_scoring_rows(cv_rows, "held-out"):
        case = CASES[r["id"]]
        fpt = case.model.flops_per_token(case.training.seq_len) / 1e12
        rows.append({**r, "published_tflops_per_gpu": r["published_tokens_per_s_per_gpu"] * fpt,
                     "predicted_tflops_per_gpu": r["predicted_tokens_per_s_per_gpu"] * fpt})
    st = sequence_steps(rows, RAW)
    against = "; ".join(
        f"{a['seq'][0]:,} → {a['seq'][1]:,}: measured ×{a['measured_ratio']:.3f}, predicted "
        f"×{a['predicted_ratio']:.3f}" for a in st["against"])
    return (f"Every step of sequence length among the scored rows (one model, cluster, "
            f"precision and release; TFLOPS/GPU, leave one model out): {st['steps']} steps, "
            f"{st['moves_as_measured']} moving the way they were measured, "
            f"{st['within_step_bar']} also within 20% of the measured ratio"
            + (f"; against: {against}" if against else "") + ".")


def held_out_groups(name: str) -> str:
    """What `moeplan validate` says of a CSV in bench/data as runs no fit saw: MAPE, interval
    coverage and width, and the model × GPU-family groups off by more than ±30% as a whole."""
    path = Path(__file__).resolve().parent / "data" / name
    un = validate_rows(read_rows(path))["unseen"]
    mapes = [f"{pct(m)} over the {n} that publish {what}" for m, n, what in (
        (un["mape_tokens_per_s"], un["tokens_rows"], "tokens/s"),
        (un["mape_tflops_only"], un["tflops_only_rows"], "only TFLOPS")) if n]
    off = ", ".join(f"{g['model']} on {g['gpu_family']} {100 * g['mean_error']:+.1f}% "
                    f"({g['rows']} rows)" for g in un["families_off"]) or "none"
    return (f"`moeplan validate bench/data/{name}` scores these {un['rows']} runs as runs the "
            f"shipped calibration was not fitted on: MAPE {'; '.join(mapes)}, 80% intervals "
            f"holding {pct(un['coverage'])} at a median width of "
            f"{pct(un['median_interval_width'])}; of {len(un['family_groups'])} model × "
            f"GPU-family group(s) of two or more rows, off by more than ±30% as a whole: {off}.")


def graph_scope_pairs() -> list[str]:
    """Measured and predicted ratio of each whole-step recipe to its per-layer twin (shipped
    profile: no fit saw these runs)."""
    by_id = {str(r["id"]): r for r in unseen_runs()[0]}
    out = ["| runs | layout | measured whole-step / per-layer | predicted |", "|---|---|---:|---:|"]
    measured, predicted = [], []
    for full, partial, what in GRAPH_PAIRS:
        f, p = by_id[full], by_id[partial]
        measured.append(float(f["published"]) / float(p["published"]))
        predicted.append(float(f["predicted"]) / float(p["predicted"]))
        out.append(f"| {full} vs {partial} | {what} | {measured[-1]:.2f} | "
                   f"{predicted[-1]:.2f} |")

    def gains(ratios: list[float]) -> str:
        lo, hi = (100 * (r - 1) for r in (min(ratios), max(ratios)))
        return f"{lo:.0f}–{hi:.0f}%"

    return out + ["", "The whole-step graph removes the host floor the per-layer graphs leave "
                  "(`layers.host_floor`); on these layouts moeplan's floor hardly binds, so it "
                  f"prices a {gains(predicted)} gain where the runs measured "
                  f"{gains(measured)}: the uncaptured expert part costs the host more than its "
                  "kernel count at the fitted launch time (Known gaps)."]


@functools.cache
def fused_gains() -> tuple[dict[str, Any], ...]:
    """`megatron_recipes.fused_mlp_gains`, priced once for the sections that quote it."""
    from megatron_recipes import fused_mlp_gains

    return tuple(fused_mlp_gains())


def fused_mlp_section() -> list[str]:
    """NVIDIA's measured end-to-end gains of the fused grouped MLP against moeplan's, priced
    on each model's published GB200 layout (`bench/megatron_recipes.py`; shipped profile, no
    fit saw the gains), and the gpt-oss gain priced where the host binds (one node, MBS 1)."""
    from moeplan.cost_models import estimate
    from moeplan.specs import Layout, TrainingSpec, load_cluster, load_model

    rows = fused_gains()
    out = ["| model | layout priced | measured | predicted | kernels only |",
           "|---|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['row']}: {r['gpus']} {r['gpu']}, EP{r['ep']}, "
                   f"MBS {r['mbs']} | {float(r['measured_gain']):.2f}× | "
                   f"{float(r['predicted_gain']):.2f}× | {float(r['predicted_kernel_gain']):.2f}× |")
    m, c = load_model("gpt-oss-120b"), load_cluster("gb200-nvl72", gpus=8)
    tr = TrainingSpec(seq_len=4096, global_batch_size=512, precision="mxfp8")

    def tokens(fused: bool, scope: str) -> float:
        lay = Layout.build(8, 512, ep=8, mbs=1, dispatcher="flex", cuda_graphs=True,
                           cuda_graph_scope=scope, fused_grouped_mlp=fused)
        return estimate(m, c, tr, lay, with_interval=False).tokens_per_s_per_gpu

    node = tokens(True, "full_iteration") / tokens(False, "layer")
    oss, dsv3 = (next(r for r in rows if r["model"] == m) for m in ("gpt-oss-120b", "DeepSeek-V3"))
    return out + [
        "",
        "NVIDIA's technical blog \"Boosting MoE Training Throughput with Advanced Fusion "
        "Kernels\" (2026-06-15) measures what Transformer Engine's fused grouped MLP adds end "
        "to end: the activation and the quantization in the GEMMs' epilogues, and the token "
        "counts kept on the device, so the MoE layer needs no host sync and a whole-step "
        "CUDA graph captures it. The blog names no layout; each gain is priced on the GB200 "
        "MXFP8 layout NVIDIA publishes for that model, with the fused MLP and the whole-step "
        "graph against the unfused experts under per-layer graphs of attention and router "
        "(\"kernels only\": both under per-layer graphs). DeepSeek-V3's gain is priced "
        f"{100 * (float(dsv3['predicted_gain']) - 1):.0f}% against "
        f"{100 * (float(dsv3['measured_gain']) - 1):.0f}% measured; gpt-oss-120b's "
        f"{100 * (float(oss['predicted_gain']) - 1):.0f}% against "
        f"{100 * (float(oss['measured_gain']) - 1):.0f}%. On that layout (2 experts per rank, "
        "MBS 4) moeplan's host floor does not bind, so the whole-step graph adds almost "
        "nothing to the kernels' gain; where it binds (8 GB200, EP 8, MBS 1: 16 experts per "
        f"rank) the same pricing gives {node:.2f}×. Either the blog's gpt-oss setup is "
        "host-bound where the published one is not, or gpt-oss's unfused expert path costs "
        "more than priced, which is what its BF16 rows run (section gpt-oss-120b)."]


def host_sensitivity() -> list[str]:
    """The four measured gains of capturing or fusing the eager expert part (the graph-scope
    pairs and NVIDIA's fused-MLP gains), priced at the fitted launch time and at twice it:
    which host cost per launch the runs no fit saw point to."""
    from megatron_recipes import RECIPES, fused_mlp_gains

    from moeplan.cost_models import estimate
    from moeplan.specs import list_presets
    from moeplan.validation.scoring import cluster_of

    fitted = default_calibration().launch_us
    doubled = {"launch_us": {k: 2 * v for k, v in fitted.items()}}
    recipes = {r["id"]: r for r in read_rows(RECIPES)}
    presets = list_presets()
    published = {str(r["id"]): float(r["published"]) for r in unseen_runs()[0]}

    def priced(row: dict[str, str]) -> list[float]:
        """A run priced as read at the fitted launch time and at twice it."""
        c = case_of(row, presets)
        return [estimate(c.model, cluster_of(c), c.training, c.layout, c.choices,
                         with_interval=False, calibration=cal).tokens_per_s_per_gpu
                for cal in (None, doubled)]

    rows = []
    for full, partial, what in GRAPH_PAIRS:
        f, p = priced(recipes[full]), priced(recipes[partial])
        rows.append((f"{full} / {partial} ({what})", published[full] / published[partial],
                     f[0] / p[0], f[1] / p[1]))
    for now, twice in zip(fused_gains(), fused_mlp_gains(doubled), strict=True):
        rows.append((f"fused grouped MLP, {now['model']} ({now['row']})",
                     float(now["measured_gain"]), float(now["predicted_gain"]),
                     float(twice["predicted_gain"])))
    # fit rows of the same kind: Qwen3-30B-A3B on 16 H100 at MBS 1 (x86, host-bound at the
    # fitted time) and on 8 GB200 at MBS 4 (Grace, as MLR13)
    h100, gb200 = priced(RAW["R0050"]), priced(RAW["R0188"])
    graphs = ("with per-layer graphs" if case_of(RAW["R0188"], presets).layout.cuda_graphs
              else "without CUDA graphs")
    us = "/".join(f"{v:g}" for v in sorted(set(fitted.values())))
    us2 = "/".join(f"{2 * v:g}" for v in sorted(set(fitted.values())))
    out = ["| gain | measured | priced at the fitted launch time "
           f"({us} µs) | at twice it ({us2} µs) |", "|---|---:|---:|---:|"]
    out += [f"| {w} | {m:.2f}× | {a:.2f}× | {b:.2f}× |" for w, m, a, b in rows]
    return out + [
        "",
        "Each gain removes host work of the eager expert part (its launches, the routing sync), "
        "so its size says what that work costs. At the fitted time per launch moeplan prices "
        "all four short; at twice it the graph-scope pairs and DeepSeek-V3 move toward what "
        "was measured (one of them past it), and gpt-oss's gain on its published layout "
        "hardly moves, its host floor binding at neither time. The fit's rows refute the "
        "doubled time: Megatron-Bridge's Qwen3-30B-A3B on 8 GB200 at MBS 4 "
        f"{graphs} (R0188: {float(RAW['R0188']['tokens_per_s_per_gpu']):,.0f} tokens/s/GPU "
        f"measured) is priced {gb200[0]:,.0f} at the fitted time and {gb200[1]:,.0f} at twice "
        "it, on 16 H100 at MBS 1 (R0050: "
        f"{float(RAW['R0050']['tokens_per_s_per_gpu']):,.0f}) {h100[0]:,.0f} and "
        f"{h100[1]:,.0f}. The Bridge run on 8 GB200 measured "
        f"{float(RAW['R0188']['tokens_per_s_per_gpu']) / published['MLR13']:.2f}× the "
        "tokens/s/GPU of Megatron-LM's partial-graph recipe on 16 (MLR13), with twice the "
        "experts per rank to launch: what costs Megatron-LM's recipe the difference is not "
        "the host's time per launch as moeplan counts launches; no fit has these runs, and "
        "moeplan prices at the fitted time."]


def dense_a100(cv_rows: list[dict[str, Any]]) -> list[str]:
    sel = [r for r in cv_rows if r["gpu_family"] == "ampere"]
    out = ["| id | model | GPUs | stack | predicted | published | error |",
           "|---|---|---:|---|---:|---:|---:|"]
    for r in sorted(sel, key=lambda r: r["id"]):
        stack = CASES[r["id"]].training.software_stack
        out.append(f"| {r['id']} | {RAW[r['id']]['model'][:28]} | {RAW[r['id']]['num_gpus']} | "
                   f"{stack} | {r['predicted']:,.1f} | {r['published']:,.1f} | "
                   f"{pct(r['error'], True)} |")
    out += ["", f"MAPE {pct(mape(sel))} over {len(sel)} rows (leave one model out)."]
    return out


CASES: dict[str, RunCase] = {}
"""The predictable rows' cases, by id (built once in `main`)."""


def table5_section() -> list[str]:
    from korthikanti_table5 import CALCULON_MAPE, table5_errors

    rows = table5_errors()
    out = ["GPT 22B/175B/530B/1T on A100-80GB, full and selective recomputation, iteration time "
           "as published, priced on the `megatron-2022` stack the paper ran (unfused attention "
           "with dropout, sequence parallelism, no DP overlap); the runs are in "
           "`bench/data/korthikanti_2022_table5.csv` and none is in any fit. "
           "`python bench/korthikanti_table5.py` prints the same.", "",
           "| run | published | predicted | error |", "|---|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['id']} | {r['published']:,.1f} | {r['predicted']:,.1f} | "
                   f"{100 * float(r['error']):+.1f}% |")
    m = 100 * sum(abs(float(r["error"])) for r in rows) / len(rows)
    out += ["", f"MAPE **{m:.1f}%** over the eight runs (previous revision "
            f"{PREVIOUS['table5']}%; Calculon on the same runs: {CALCULON_MAPE}%)."]
    return out


SHIPPED: list[dict[str, Any]] = []  # the shipped profile's predictions of the scored rows


def unseen_figures(recipes: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, str]:
    """The figures the runs-no-fit-saw text quotes, computed from those runs: error ranges of
    the recipe classes it names, how much slower each partial-graph twin measured than its
    full-graph recipe, and what the setting-changing optimisation steps gained."""
    err = {str(r["id"]): 100 * float(r["error"]) for r in recipes + steps}
    pub = {str(r["id"]): float(r["published"]) for r in recipes + steps}
    pred = {str(r["id"]): float(r["predicted"]) for r in steps}
    rec_pred = {str(r["id"]): float(r["predicted"]) for r in recipes}

    def span(values: list[float]) -> str:
        lo, hi = min(values), max(values)
        return f"{lo:.0f}–{hi:.0f}%" if round(lo) != round(hi) else f"{lo:.0f}%"

    def gain(after: str, before: str) -> str:
        return f"{100 * (pub[after] / pub[before] - 1):+.1f}%"

    return {
        "full": f"{max(abs(err[i]) for i in ('MLR07', 'MLR09', 'MLR14')):.0f}%",
        "twins_slower": span([100 * (1 - pub[p] / pub[q])
                              for p, q in (("MLR08", "MLR07"), ("MLR13", "MLR14"))]),
        "twins_priced": span([100 * (1 - rec_pred[p] / rec_pred[q])
                              for p, q in (("MLR08", "MLR07"), ("MLR13", "MLR14"))]),
        "partial": span([err["MLR08"], err["MLR13"]]),
        "tp2": span([err[i] for i in ("MLR04", "MLR05", "MLR06")]),
        "tp2_pess": ", ".join(f"{round(100 * (float(r['pessimistic']) / float(r['published']) - 1)):+d}%"
                              for r in recipes if r["id"] in ("MLR04", "MLR05", "MLR06")),
        "mlr04_pub": f"{pub['MLR04']:,.0f}",
        "r0265_pub": f"{float(RAW['R0265']['tokens_per_s_per_gpu']):,.0f}",
        "tp1_full": f"{max(abs(err[i]) for i in ('MLR07', 'MLR09')):.0f}%",
        "tp1_partial": f"{abs(err['MLR08']):.0f}%",
        "graphs_step": gain("DSG05", "DSG04"),
        "cpu_steps": f"{gain('DSG07', 'DSG06')}, {gain('DSG11', 'DSG10')}",
        "hybridep_measured": gain("DSG10", "DSG09"),
        "hybridep_predicted": f"{100 * (pred['DSG10'] / pred['DSG09'] - 1):+.1f}%",
        "deepep_steps": span([err[f"DSG{i:02d}"] for i in range(3, 10)]),
        "early_steps": span([err[f"DSG{i:02d}"] for i in range(0, 3)]),
    }


def unseen_section() -> list[str]:
    """Megatron-LM's MoE recipes and its DeepSeek-V3 GB200 optimisation steps
    (`bench/megatron_recipes.py`): runs in no fit and not in shared/data."""
    from megatron_recipes import mape as ext_mape

    recipes, steps = unseen_runs()

    def tflops(r: dict[str, Any], key: str) -> float:
        return float(r[key]) * float(r["published_tflops"]) / float(r["published"])

    out = ["Three sets of published measurements that neither `shared/data` nor any fit contains, "
           "each run priced with the settings its recipe documents "
           "(`python bench/megatron_recipes.py`; rows in `bench/data/`). Megatron-LM's "
           "`examples/moe_recipes` (commit 8a2ac1fdc7) publishes a median TFLOP/s/GPU per "
           "recipe, and its YAML the exact arguments:", "",
           "| id | recipe | published TFLOPS | predicted TFLOPS | error |",
           "|---|---|---:|---:|---:|"]
    for r in recipes:
        out.append(f"| {r['id']} | `{r['run']}` | {float(r['published_tflops']):,.1f} | "
                   f"{tflops(r, 'predicted'):,.1f} | {100 * float(r['error']):+.1f}% |")
    bias_ = 100 * sum(float(r["error"]) for r in recipes) / len(recipes)
    f = unseen_figures(recipes, steps)
    out += ["", f"MAPE **{ext_mape(recipes):.1f}%** over the {len(recipes)} recipes, mean error "
            f"{bias_:+.1f}% (tokens/s/GPU, the published TFLOPS converted with Megatron's FLOPs "
            "per token). The 80% interval holds "
            f"{sum(bool(r['in_interval']) for r in recipes)} of them (median width "
            f"{100 * sorted(float(r['interval_width']) for r in recipes)[len(recipes) // 2]:.0f}% "
            "of the point). Where they miss:", "",
            "- The three full-iteration CUDA graph recipes (MLR07, MLR09, MLR14), priced with "
            f"the whole-step graph, are within {f['full']}; their partial-graph twins (MLR08, "
            f"MLR13) measured {f['twins_slower']} slower, where moeplan prices them "
            f"{f['twins_priced']} slower. moeplan's host floor prices the uncaptured expert "
            "part as eager launches after the routing sync, run as a flow shop: here each "
            "starts behind a dispatch long enough to give the host its lead back, so the "
            "launches hide behind device work; these runs say the host costs more there than "
            "its kernel count at the fitted launch time.",

            f"- Qwen3-235B-A22B with TP 2 (MLR04–MLR06: H100, B200, B300) is priced "
            f"{f['tp2']} fast, the Qwen3-235B TP 1 recipes on NVL72 within {f['tp1_full']} (full "
            f"graphs) and {f['tp1_partial']} (partial). "
            "All three overlap the flex dispatcher's transfers beside TP collectives across "
            "HGX nodes, which no fit row does (Megatron-LM warns that on Hopper TP and EP "
            "overlap want different CUDA_DEVICE_MAX_CONNECTIONS), so their intervals price "
            "the plan without the overlap: priced so, they would be "
            f"{f['tp2_pess']} against their runs. On H100 the BF16 recipe with HybridEP "
            f"(MLR04) measured {f['mlr04_pub']} tokens/s/GPU, below Megatron-Bridge's FP8 run "
            "of the same layout and batch with the all-to-all dispatcher and the overlap "
            f"(R0265, {f['r0265_pub']}); HybridEP's own benchmark (DeepEP "
            "docs/README_Hybrid-EP.md, 32 H100 ranks) moves 47–51 GB/s per GPU of deduplicated "
            "traffic over the 50 GB/s NIC, so its kernel alone is not what these runs miss.",
            "", held_out_groups("megatron_lm_moe_recipes.csv"),
            "", "Megatron-LM's DeepSeek-V3 GB200 guide (commit eb0783b6d3) publishes thirteen "
            "optimisation steps of one layout (TP1 PP8 VPP4 EP32, MBS 1, GBS 2048, MXFP8, no "
            "MTP). A step that changes a setting moeplan names is priced with it (the "
            "dispatcher, recomputation, CUDA graphs); the others are kernel fusions and CPU-side "
            "work inside the `current` stack every estimate assumes:", "",
            "| step | change | published TFLOPS | predicted TFLOPS | error |",
            "|---:|---|---:|---:|---:|"]
    for r in steps:
        n, what = str(r["run"]).split(": ", 1)
        out.append(f"| {n} | {what} | {float(r['published_tflops']):,.1f} | "
                   f"{tflops(r, 'predicted'):,.1f} | {100 * float(r['error']):+.1f}% |")
    gain = float(steps[-1]["published"]) / float(steps[0]["published"])
    pgain = float(steps[-1]["predicted"]) / float(steps[0]["predicted"])
    out += ["", f"Measured {gain:.2f}× from the first step to the last, predicted {pgain:.2f}×. "
            "Steps 3–9 ran DeepEP across the NVL72's trays (a case Megatron Core supports only "
            "with HybridEP), where the guide measured it at 400 GB/s dispatch and 190 GB/s "
            "combine (§2.2.1); priced as that backend (`layout.flex_backend`), they are "
            f"{f['deepep_steps']} fast, and the switch to HybridEP (step 10) is priced "
            f"{f['hybridep_predicted']} against {f['hybridep_measured']} measured. Steps 0–2 "
            f"stay {f['early_steps']} fast: the guide names CPU overhead (host-bound layers) as "
            "the baseline's main problem, and moeplan's host floor does not bind on this layout "
            "at the fitted launch time, so neither the CUDA graphs (measured "
            f"{f['graphs_step']}) nor the CPU-side work ({f['cpu_steps']}) moves the "
            "prediction. The first CPU-side step (7) bound each rank to its GPU's NUMA node, "
            "as NVIDIA's Megatron-Bridge performance launches bind the ranks of the runs the "
            "launch time is fitted on; moeplan's launches (`moeplan run`, the `megatron` and "
            "`torchrun` exports) bind them so too, and `moeplan calibrate` measures the launch "
            "time bound (docs/RUNTIME.md, \"CPU binding\"). A user on an older stack can say so "
            "with `--stack` (the MoE fusions, attention kernels, DP overlap), `--flex-backend "
            "deepep` and a measured launch time (`moeplan calibrate`, `--calibration`), not yet "
            "with each of these steps.",
            "", held_out_groups("deepseek_v3_gb200_steps.csv"), *zoo_section()]
    return out


def shipped_width() -> float:
    """Median (high − low)/point of the shipped intervals over the scored rows."""
    w = sorted((r["predicted_interval_tokens_per_s_per_gpu"][1]
                - r["predicted_interval_tokens_per_s_per_gpu"][0])
               / r["predicted_tokens_per_s_per_gpu"] for r in SHIPPED
               if r.get("predicted_interval_tokens_per_s_per_gpu"))
    n = len(w)
    return float("nan") if not n else (w[n // 2] if n % 2 else (w[n // 2 - 1] + w[n // 2]) / 2)


def interval_section() -> list[str]:
    d = prof_doc()
    cv, lomo = d["cross_validated"], d["leave_one_model_out"]
    out = ["Every estimate carries an 80% interval of tokens/s/GPU. Its band starts from the",
           "conformal bounds of the configuration split's held-out rows in the estimate's",
           "regime (a new configuration of a model the fit knows) and widens with the",
           "distance from the fit evidence (`uncertainty.widen`, the reasons in the estimate's",
           "`interval.widened_by`): a model no fit row has takes the leave-one-model-out band,",
           "a family no fit row has the band of families left out, a GPU and precision with",
           f"fewer than {U.FEW_ROWS} fit rows the leave-one-model-out band, a model whose rows",
           "the fit misses as a whole, or whose miss it carries as a measured residual, its own",
           "held-out band (only such a model has one: the others' held-out rows are in their",
           "regime's band), and each doubling of micro-batch,",
           "tokens per",
           f"expert or sequence beyond the fit rows' range widens both ends by "
           f"{d.get('per_doubling', 0):g} (the least value covering 80% of the "
           f"{d.get('per_doubling_rows', 0)} leave-one-model-out rows beyond their fold's range). "
           "The low end is also priced with every effect no fit row backs disappointing. The",
           "robust search ranks plans by this low end.", "",
           f"- Configuration split, cross-conformal ({cv['folds']} folds, each fold's bands from "
           f"the others): coverage **{100 * cv['coverage']:.1f}%**, median width "
           f"{100 * cv['median_width']:.1f}% of the point, {cv['rows']} rows.",
           f"- Leave one model out, each model's band from the other models only: coverage "
           f"**{100 * lomo['coverage']:.1f}%**, median width {100 * lomo['median_width']:.1f}%, "
           f"{lomo['rows']} rows (per family in the table above).",
           *([f"- Leave one release out, each release's bands from the other releases' rows "
              f"(the nearest to runs of a release nobody fitted): coverage "
              f"**{100 * rel['coverage']:.1f}%**, median width "
              f"{100 * rel['median_width']:.1f}%, {rel['rows']} rows."]
             if (rel := d.get("leave_one_release_out")) else []),
           "- Shipped intervals on the scored rows (in-sample: the fit saw these rows): median "
           f"width {100 * shipped_width():.1f}%.",
           f"- Memory margin: {d['memory']['evidence']}.", "",
           "| regime | held-out band | model-unseen band |", "|---|---|---|"]
    for k in sorted(set(d["regimes"]) | set(d.get("unseen", {}))):
        a, b = d["regimes"].get(k), d.get("unseen", {}).get(k)

        def band(x: dict[str, Any] | None) -> str:
            return "–" if not x else (f"{100 * (math.exp(x['q_lo']) - 1):+.0f}% / "
                                      f"{100 * (math.exp(x['q_hi']) - 1):+.0f}% ({x['rows']})")
        out.append(f"| {k} | {band(a)} | {band(b)} |")
    fam = d.get("family_unseen")
    if fam:
        out += ["", f"Family unseen (rows whose family had no other model in their fold): "
                f"{100 * (math.exp(fam['q_lo']) - 1):+.0f}% / "
                f"{100 * (math.exp(fam['q_hi']) - 1):+.0f}% over {fam['rows']} rows."]
    if d.get("model_bands"):
        out += ["", "Bands of models missed as a whole (their held-out rows, of a fit that saw the model's others; a model the fit explains has none, its rows being in its regime's band): " +
                "; ".join(f"{m} {100 * (math.exp(v['q_lo']) - 1):+.0f}% / "
                          f"{100 * (math.exp(v['q_hi']) - 1):+.0f}% ({v['rows']})"
                          for m, v in d["model_bands"].items()) + "."]
    return out


def worst(cv_rows: list[dict[str, Any]]) -> list[str]:
    out = ["| id | model | GPU | precision | predicted | published | error |",
           "|---|---|---|---|---:|---:|---:|"]
    for r in sorted(cv_rows, key=lambda r: -abs(r["error"]))[:15]:
        out.append(f"| {r['id']} | {r['model']} | {r['gpu']} | {r['precision']} | "
                   f"{r['predicted']:,.0f} | {r['published']:,.0f} | {pct(r['error'], True)} |")
    return out


PHYSICS = {"model_residual": {}}
"""A calibration overlay without any model's measured residual: the cost models' physics."""


def gpt_oss_section(cv_rows: list[dict[str, Any]]) -> list[str]:
    from moeplan.cost_models import estimate
    from moeplan.specs import Layout, TrainingSpec, load_cluster, load_model

    oss = [r for r in cv_rows if r["model"] == "gpt-oss-120b"]
    bf16 = [r for r in oss if r["precision"] == "bf16"]
    mx = [r for r in oss if r["precision"] == "mxfp8"]
    m, c = load_model("gpt-oss-120b"), load_cluster("h100", 64)
    lay = Layout.build(64, 1280, pp=4, ep=8)

    def price(stack: str) -> tuple[float, bool]:
        tr = TrainingSpec(seq_len=4096, global_batch_size=1280, grad_reduce_dtype="bf16",
                          software_stack=stack)
        e = estimate(m, c, tr, lay, with_interval=False, calibration=PHYSICS)
        return e.tokens_per_s_per_gpu, e.fits

    # what the physics prices (no residual): the comparisons below are of what it explains
    auto = estimate(m, c, TrainingSpec(seq_len=4096, global_batch_size=512),
                    Layout.build(64, 512, ep=8, mbs=2), with_interval=False,
                    calibration=PHYSICS)
    b_pub = [float(RAW[i]["tokens_per_s_per_gpu"]) for i in ("R0096", "R0142", "R0186", "R0223")
             if i in RAW]
    a_pub = float(RAW["R0587"]["tokens_per_s_per_gpu"]) if "R0587" in RAW else float("nan")
    b200 = sorted((r["id"] for r in bf16 if r["gpu"] == "B200" and RAW[r["id"]]["ep"] == "8"
                   and RAW[r["id"]]["micro_batch"] == "4"),
                  key=lambda i: float(RAW[i]["tokens_per_s_per_gpu"]))
    (cur, _), (old, old_fits) = price("current"), price("mcore-2024")
    # R0257 (25.11, B200) prints EP 8; the release's recipe ran EP 64 (see the text below):
    # the row priced as read, at either EP
    from moeplan.specs import list_presets

    b200_25 = {}
    for ep in (8, 64):
        case = case_of({**RAW["R0257"], "ep": str(ep)}, list_presets())
        b200_25[ep] = estimate(case.model, case.cluster, case.training, case.layout,
                               case.choices, with_interval=False,
                               calibration=PHYSICS).tokens_per_s_per_gpu
    band = prof_doc().get("model_bands", {}).get("gpt-oss-120b")
    residual = default_calibration().model_residual.get("gpt-oss-120b/bf16")
    cover = prof_doc().get("leave_one_model_out", {}).get("by_family", {}).get("gpt-oss", {})
    oss_fused = float(next(r for r in fused_gains() if r["model"] == "gpt-oss-120b")[
        "predicted_gain"])
    return [
        "gpt-oss-120b stays in every fit. Its recipe is priced with what it runs, each a named",
        "feature:",
        "- **Attention sinks**: Transformer Engine runs learnable softmax offsets in cuDNN's fused",
        "  kernel from cuDNN 9.13.1 (TE PR 2148) and falls back to `UnfusedDotProductAttention`",
        "  before (TE issue 2318), which computes and keeps every query-key score. That is the",
        "  `software_stack` setting: on 64 H100 (PP4 EP8) the `current` stack prices "
        f"{cur:,.0f} tokens/s/GPU, `mcore-2024` {old:,.0f}"
        + ("." if old_fits else " (and the scores it keeps no longer fit)."),
        "- **Alternating 128-token sliding window**: cuDNN takes causal windows (cuDNN ≥ 9.2,",
        "  TE PR 992); a window's query tile iterates two key tiles, so the kernel runs at the",
        "  tile model's short-kernel efficiency (0.43× the 4K forward rate on Hopper) over the",
        "  256 keys per query it computes, not the 128 the FLOP count credits.",
        "- **Expert biases and the clamped SwiGLU**: Megatron-Bridge sets `bias_activation_fusion`,",
        "  and Megatron Core runs the fc1 bias, the clamp, the 1.702 gate and the +1 offset in",
        "  one fused kernel (`weighted_bias_quick_geglu_impl`). The fc2 bias is another matter:",
        "  it must be weighted by each copy's routing probability, and without",
        "  `moe_single_grouped_bias` (off by default) Megatron Core adds it expert by expert in",
        "  eager PyTorch (`TEGroupedMLP._apply_bias`: t + b·p in fp32, concatenated, cast back):",
        "  28 bytes per routed element forward, 36 backward, and 2 + 5 launches per local expert",
        "  (`layers._expert_bias`). The MXFP8 recipes of 26.06 on run the fused grouped MLP",
        "  (`Layout.fused_grouped_mlp`), which adds the weighted bias inside its GEMM.",
        "- **YaRN RoPE**: gpt-oss scales its RoPE by yarn (factor 32) without mscale settings, so",
        "  cos and sin carry get_mscale(32) = 1.347; Transformer Engine's fused RoPE takes no such",
        "  factor and Megatron Core falls back to RoPE in separate PyTorch kernels",
        "  (`rope_utils.apply_rotary_pos_emb`): 20 more bytes per query/key element forward, 14",
        "  backward, 23 more launches (`host.unfused_rope`).",
        "- **Its Megatron-Bridge recipes** (`moeplan/validation/recipes.py`) and the host floor of",
        "  16 experts per rank at EP8.",
        "- **The fused grouped MLP** of its MXFP8 recipes (26.06 on, Transformer Engine's",
        "  `ScaledClampedQGeGLU` with the probability-scaled fc2 bias, TE PR 2855 and 2864):",
        "  NVIDIA measured it at +93% end to end on gpt-oss, where moeplan prices "
        f"{100 * (oss_fused - 1):.0f}% on",
        "  the published GB200 layout (Layouts and scale, Fused grouped MLP).",
        "",
        f"What is still missing: leave one model out, BF16 {pct(mape(bf16))} "
        f"(mean {pct(bias(bf16), True)}, {len(bf16)} rows) and MXFP8 {pct(mape(mx))} "
        f"(mean {pct(bias(mx), True)}, {len(mx)} rows; the previous revision's report, commit",
        "bd223cd: BF16 35.8%, MXFP8 7.3%, the MXFP8 rows then priced with the eager bias their",
        "recipe did not run). The BF16 rows of one",
        "GPU scatter by release (B200 at EP8, MBS 4: " + ", ".join(
            f"{float(RAW[i]['tokens_per_s_per_gpu']):,.0f} in {i}, release "
            + "{}.{:02d}".format(*release_of(RAW[i])) for i in b200)
        + " tokens/s/GPU), more than their printed batch sizes explain. The 25.11 one (R0257)",
        "prints an EP its run did not use: Megatron-Bridge v0.2.0, the 25.11 release, configures",
        "B200 at EP 64, MBS 4, GBS 512 (`GPT_OSS_120B_B200_BF16_BASE_CONFIG` in",
        "scripts/performance/configs/gpt_oss/workload_base_configs.py), and its "
        f"{float(RAW['R0257']['tokens_per_s_per_gpu']):,.0f} tokens/s/GPU",
        f"matches the 26.02 EP 64 row of B200 (R0222, {float(RAW['R0222']['tokens_per_s_per_gpu']):,.0f}),"
        " not the EP 8 rows; the physics prices that",
        f"batch at EP 8 {b200_25[8]:,.0f} and at EP 64 {b200_25[64]:,.0f}. moeplan prices a row as "
        "printed, so it stays at EP 8 in every fit. The other NVIDIA stack",
        "comes close: on 64",
        "H100, NeMo Automodel (FSDP2,",
        f"TE + DeepEP + FlexAttention; R0587) publishes {a_pub:,.0f} tokens/s/GPU at GBS 512, MBS 2,",
        f"and moeplan prices that batch layout at EP8 {auto.tokens_per_s_per_gpu:,.0f} "
        f"({100 * (auto.tokens_per_s_per_gpu / a_pub - 1):+.0f}%, not scored: FSDP2, EP blank);",
        f"Megatron-Bridge's own H100 layout measured {min(b_pub):,.0f}–{max(b_pub):,.0f}, "
        f"priced {cur:,.0f} by the physics. The rest is Megatron-Bridge's gpt-oss software path, "
        "which no",
        "published row documents further. The fit keeps its rows; the shipped profile carries "
        "the shortfall as a measured residual"
        + (f" ({residual:.2f}x, `model_residual`: a model and precision whose fit rows are "
           f"off as a whole and slower, at least {U.MODEL_ROWS} rows with their median "
           f"published/priced ratio {U.MODEL_RATIO:g}x or more below, carry that median; a "
           f"precision with fewer rows, as its {len(mx)} MXFP8 ones, the median of all the "
           "model's rows)"
           if residual else "")
        + (", and its interval its own held-out band"
           f" ({100 * (math.exp(band['q_lo']) - 1):+.0f}% to "
           f"{100 * (math.exp(band['q_hi']) - 1):+.0f}%)" if band else "")
        + (f"; under leave-one-model-out, which has no residual for it, its rows are covered "
           f"{100 * cover['coverage']:.0f}% of the time" if cover else "") + ".",
    ]


def anatomy() -> list[str]:
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
    out = ["256 GPUs, PP4 VPP4 EP64, TP1 ETP1, MBS1, s 4096, BF16, distributed optimizer, no",
           "recompute, no FP8 (Megatron Core MoE report). moeplan's peak GPU is pp rank "
           f"{peak} (stage layout `{b.stage_layout}`); its peak with buffers and",
           f"fragmentation is {mem.peak_gb:.1f} GB. Checked by "
           "`tests/test_cost_estimate.py::test_deepseek_v3_memory_anatomy_within_15_percent`.",
           "", "| part | report GB | moeplan GB | error |", "|---|---:|---:|---:|"]
    for k, v in report.items():
        out.append(f"| {k} | {v:.1f} | {ours[k]:.1f} | {100 * (ours[k] / v - 1):+.1f}% |")
    return out


CHANGES = """## What changed

- **The rows of Megatron-LM 2021 and 2022 replicate the optimizer, as their Megatron did.** The
  distributed optimizer (`--use-distributed-optimizer`) was merged into Megatron-LM on
  2022-06-08 (`git log -S` of its sources; first tagged in 23.04), after Narayanan et al. 2021
  and Korthikanti et al. 2022 ran, yet moeplan priced their rows with it. The stack rule
  `stack_distributed_optimizer` now dates it, and validation prices those stacks' rows
  without it: {dist_rows} rows of the `megatron-2021` stack move, by at most {dist_moved_max}
  points of error, and their priced memory from {dist_mem_before} GB to {dist_mem_now} GB
  per GPU (Korthikanti's Table 5 runs are at data-parallel size 1, where it changes nothing);
  the refit's constants did not move (objective {objective_before} → {objective_now} over
  {rows} rows).
- Every figure below comes from refits on this change: leave one model out
  {lomo_before}% → {lomo_now}%, leave one release out {loro_before}% → {loro_now}%,
  configuration split {config_before}% → {config_now}%, the CLI's quick refit
  {quick_before}% → {quick_now}%; interval coverage: configuration split {cv_cov_before}% →
  {cv_cov_now}%, leave one model out {lomo_cov_before}% → {lomo_cov_now}%, leave one release
  out {loro_cov_before}% → {loro_cov_now}%. Runs no fit saw: Megatron-LM's recipes MAPE
  {recipes_before}% → {recipes_now}, interval coverage {recipes_cov_before}/14 →
  {recipes_cov_now}/14; the DeepSeek-V3 GB200 optimisation steps {steps_before}% →
  {steps_now}.
""".splitlines()


def skipped(res: dict[str, Any]) -> list[str]:
    counts: dict[str, int] = defaultdict(int)
    for s in res["skipped"]:
        counts[s["why"].split(":")[0][:90]] += 1
    return ["| reason | rows |", "|---|---:|",
            *[f"| {k} | {v} |" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])]]


UNSEEN_TITLE = "Runs no fit saw: Megatron-LM's recipes and steps, Megatron-MoE-ModelZoo's runs"
OWN_SECTIONS = ("Headline", "What changed", "By model family", "By model", "By software release",
                "By GPU generation", "Layout ranking within a release", "Layouts and scale",
                "Dense A100", "Korthikanti et al. 2022 Table 5",
                UNSEEN_TITLE, "Prediction intervals",
                "gpt-oss-120b", "Worst rows", "Memory: DeepSeek-V3 anatomy", "Known gaps",
                "Skipped rows")


FORMER_TITLES = ("By GPU generation", "Dense A100 rows", "Prediction intervals",
                 "Worst held-out rows", "Assumptions and known gaps",
                 "Runs no fit saw: Megatron-LM's MoE recipes and optimisation steps")
"""Titles this script wrote its own sections under before: a report that still has one is
regenerated whole, not kept as a foreign section."""


def foreign_tail(path: Path) -> list[str]:
    """Sections of an existing report this script does not write (e.g. the CPU calibration
    loop), from the first such `## ` heading to the end, kept when regenerating."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("## ") and line[3:].strip() not in OWN_SECTIONS + FORMER_TITLES:
            return ["", *lines[i:]]
    return []


GAPS = """- Megatron-FSDP/FSDP2 rows ({fsdp_rows}) are skipped: not modelled.
- Megatron-Bridge tables re-publish one configuration across releases, and the same
  configuration gets faster with each release (software, not hardware). Apart from the
  documented 26.06 MXFP8 recipe change and the Bridge recipe table, a release is not a setting,
  so such groups scatter around one prediction; leave one release out measures what that costs.
- MegaScale's Megatron-LM baseline runs slower than priced as its GPU count grows, even
  without DP overlap (its strong-scaling rows above, +2% at 256 GPUs to +14% at 12,288);
  moeplan prices no straggler or scale-dependent collective effect beyond the α–β rings.
- The host floor's kernel counts are read from Megatron Core's and Transformer Engine's module
  structure, not traced; the launch time per host CPU is fitted (bounded 2–40 µs, Grace at or
  above x86) because no `moeplan calibrate` run on a GPU host has measured it yet. Where a
  trace exists, the counts differ: moeplan counts six forward kernels for an MoE layer's router
  and EP preprocess, NVIDIA's Nsight Systems traces of DeepSeek-V3 (Megatron-LM's GB200 guide,
  §2.1.4 and §2.2.1) 31 with the all-to-all dispatcher and 17 with the flex one. Pricing the
  traced counts, with the host's lead carried from one layer's experts into the next layer's
  router, fit the published rows better but cross-validated worse, both by model and by
  release, so the counts stay as read and the fitted launch time stands in for the difference.
- Megatron-Bridge's MXFP8 MoE recipes from 26.06 also run FP8 attention, which moeplan does
  not price: their attention runs at the BF16 rate (their fused grouped MLP is priced:
  Qwen3-30B-A3B on 8 GB200, MBS 4, EP8, with the whole-step graph: {qwen30_now} in the shipped
  profile; DeepSeek-V3 on GB300, whose recipe also runs the output projection in FP8:
  {dsv3_gb300}, part of why DeepSeek's rows fall outside their leave-one-model-out interval
  more often than the other families).
- Runs no fit saw (Megatron-LM's recipes, above) are priced fast on average: partial-graph
  recipes of Qwen3 on NVL72 by {partial} where their full-graph twins are within {full} (the
  host cost of the uncaptured expert part is underpriced), and Qwen3-235B-A22B at TP 2 by
  {tp2}. The
  optimisation steps of one DeepSeek-V3 layout on GB200 show the same blind spot from the other
  side: the host-bound early steps are priced as if the host kept up. Megatron-MoE-ModelZoo's
  Qwen3-235B-A22B layouts on H100 with 16 local experts (PP 32; TP 4) are priced
  {zoo_fast} fast, in the order measured; their error moves with the host's time per launch.
- Megatron-Bridge's 25.09 token-drop runs with CUDA graphs are priced fast. Where the graphs
  matter, the capture delivered part of what moeplan prices: Qwen3-30B-A3B on 8 B200 at MBS 1
  (R0284) is priced {r0284_point} tokens/s/GPU with the MoE layer graphed, {r0284_eager}
  without graphs, and measured 18,066. Where they do not, something else in that path costs
  device time: the same model on 8 GB200 at MBS 4 (R0274, R0275) is device-bound, priced the
  same either way, and {r0274_err} fast; the sync the static shapes save is not
  repaid there, and the router's capacity top-k over the tokens
  (`apply_router_token_dropping`) is not priced. These rows stay in the fit; their
  intervals' low end is priced without the graphs: an MoE layer graphed whole is an
  effect its fit rows ({moe_graph_rows}) contradict, at {moe_graph_range}× their prediction
  ({moe_graph_median}× in the median; `uncertainty.assumption_keys`, `moe_layer_graphs`).
- NVFP4's gain is one share of the datasheet ratio per recipe (`lowp_gain`), but the runs do
  not scale with the datasheet: GB300 lists 1.5× GB200's FP4 rate and the same FP8 rate, yet
  Llama-3.1-405B's NVFP4 runs measure {fp4_gb200}× their MXFP8 twin on GB200 (R0038 over
  R0037, 26.06) and {fp4_gb300}× on GB300 (R0083 at TP 4 over R0082 at TP 2, 26.04). The FP4
  recipe's own work beyond its quantize traffic (where its 16-element scales and its amax
  pass are priced), the random Hadamard transforms and the layers it keeps in BF16, is not
  priced as such, so the fit splits the difference: the shipped profile prices
  those NVFP4 rows {fp4_gb200_err} on GB200 and {fp4_gb300_err} on GB300.
- Megatron-Bridge's 25.09 DeepSeek-V3 rows print PP·VP = 16, but that release's run script
  passed the 32-stage layout `Et|(tt|)*30mL` whatever PP and VP it set, which 16 stages cannot
  hold; what those rows ran is not known, so they are priced on their printed sizes and
  moeplan's split by count. Rows of one configuration also differ by release beyond what the
  recipes name: DeepSeek-V3 on 256 B200 at PP 16, EP 8, MXFP8 measured {r0256_pub} tokens/s/GPU
  at 25.11 (R0256) and {r0137_pub} at 26.04 (R0137), priced {r0256_err} and {r0137_err}.
""".splitlines()


def change_figures(cv: dict[str, Any], cal: dict[str, Any], quick: dict[str, Any] | None
                   ) -> dict[str, str]:
    """The figures "What changed" quotes, computed from the cross-validation, the shipped
    calibration, the published checks and the rows, against the previous revision's
    (PREVIOUS)."""
    from megatron_recipes import mape as ext_mape

    about = cal.get("_about", "")
    prof = prof_doc()
    recipes = unseen_runs()[0]
    gains = {r["model"]: f"{100 * (float(r['predicted_gain']) - 1):+.0f}%"
             for r in fused_gains()}
    return {
        "oss_gain": gains["gpt-oss-120b"], "dsv3_gain": gains["DeepSeek-V3"],
        "cv_cov_before": f"{PREVIOUS['cv_coverage']}",
        "lomo_cov_before": f"{PREVIOUS['lomo_coverage']}",
        "loro_cov_before": f"{PREVIOUS['loro_coverage']}",
        "cv_cov_now": f"{100 * prof['cross_validated']['coverage']:.1f}",
        "lomo_cov_now": f"{100 * prof['leave_one_model_out']['coverage']:.1f}",
        "loro_cov_now": f"{100 * prof['leave_one_release_out']['coverage']:.1f}",
        "recipes_before": f"{PREVIOUS['recipes']}",
        "recipes_now": f"{ext_mape(recipes):.1f}%",
        "recipes_cov_before": f"{PREVIOUS['recipes_coverage']}",
        "recipes_cov_now": f"{sum(bool(r['in_interval']) for r in recipes)}",
        "objective_before": f"{PREVIOUS['objective']}",
        "objective_now": (re.search(r"objective ([0-9.]+)", about) or [None, "?"])[1],
        "lomo_before": f"{PREVIOUS['model']}", "loro_before": f"{PREVIOUS['release']}",
        "config_before": f"{PREVIOUS['config']}", "quick_before": f"{PREVIOUS['quick']}",
        "lomo_now": f"{100 * cv['model']['mape']:.1f}",
        "loro_now": f"{100 * cv['release']['mape']:.1f}",
        "config_now": f"{100 * cv['config']['mape']:.1f}",
        "quick_now": f"{100 * quick['model']['mape']:.1f}" if quick else "–",
        **dist_opt_figures(),
        "steps_before": f"{PREVIOUS['steps']}", "steps_now": f"{ext_mape(unseen_runs()[1]):.1f}%",
    }


def dist_opt_figures() -> dict[str, str]:
    """The shipped rows whose software stack predates the distributed optimizer: how many, the
    most pricing one with it (as the previous revision did) moves its error, in points, and
    the range of their priced peak memory with it and without."""
    from moeplan.cost_models.estimate import estimate_breakdown
    from moeplan.specs import list_presets
    from moeplan.specs.rules import stack_lacks
    from moeplan.validation import case_of
    from moeplan.validation.scoring import cluster_of, priced_layout

    presets = list_presets()
    moved: list[float] = []
    before: list[float] = []
    now: list[float] = []
    for r in SHIPPED:
        case = case_of(RAW[r["id"]], presets)
        if isinstance(case, str) or not stack_lacks(case.training.software_stack,
                                                    "distributed_optimizer"):
            continue
        layout = priced_layout(case).model_copy(update={"distributed_optimizer": True})
        old = estimate_breakdown(case.model, cluster_of(case), case.training, layout,
                                 case.choices, check=False, with_interval=False).estimate
        pub = r["published_tokens_per_s_per_gpu"]
        moved.append(100 * abs(r["predicted_tokens_per_s_per_gpu"] - old.tokens_per_s_per_gpu)
                     / pub)
        before.append(old.memory.peak_gb)
        now.append(r["predicted_memory_gb"])
    moving = [m for m in moved if m >= 0.05]
    return {"dist_rows": f"{len(moving)}", "dist_moved_max": f"{max(moved, default=0):.1f}",
            "dist_mem_before": f"{min(before, default=0):.0f}–{max(before, default=0):.0f}",
            "dist_mem_now": f"{min(now, default=0):.0f}–{max(now, default=0):.0f}"}


def shipped_error(r: dict[str, Any]) -> float:
    """A shipped-profile row's error in percent: predicted over published tokens/s/GPU, − 1."""
    return 100 * (r["predicted_tokens_per_s_per_gpu"] / r["published_tokens_per_s_per_gpu"] - 1)


def gap_figures() -> dict[str, str]:
    """The figures Known gaps quotes, computed: the runs-no-fit-saw ranges, and how slow the
    shipped profile prices Qwen3-30B-A3B's 8-GB200 MXFP8 rows of the full-iteration-graph
    releases (26.06 on) and DeepSeek-V3's GB300 ones, whose FP8 attention moeplan does not
    price."""
    slow = [-shipped_error(r) for r in SHIPPED if r["model"] == "qwen3-30b-a3b" and r["gpu"] == "GB200"
            and r["precision"] == "mxfp8" and (release_of(RAW[r["id"]]) or (0, 0)) >= (26, 6)]
    figures = unseen_figures(*unseen_runs())
    zoo = {str(r["id"]): 100 * float(r["error"]) for r in zoo_runs()}
    figures["zoo_fast"] = f"{min(zoo['MZQ04'], zoo['MZQ05']):.0f}–{max(zoo['MZQ04'], zoo['MZQ05']):.0f}%"
    figures["qwen30_now"] = (f"{-max(slow):+.0f} to {-min(slow):+.0f}%" if slow else "n/a")
    ds = [shipped_error(r) for r in SHIPPED if r["model"] == "deepseek-v3" and r["gpu"] == "GB300"
          and r["precision"] == "mxfp8" and (release_of(RAW[r["id"]]) or (0, 0)) >= (26, 6)]
    figures["dsv3_gb300"] = (f"{min(ds):+.0f} to {max(ds):+.0f}%" if ds else "n/a")
    by_id = {r["id"]: r for r in SHIPPED}
    r84 = by_id.get("R0284", {})
    figures["r0284_point"] = f"{r84.get('predicted_tokens_per_s_per_gpu') or 0:,.0f}"
    figures["r0284_eager"] = f"{r84.get('pessimistic_tokens_per_s_per_gpu') or 0:,.0f}"
    err = [shipped_error(by_id[i]) for i in ("R0274", "R0275") if i in by_id]
    figures["r0274_err"] = f"{min(err):.0f}–{max(err):.0f}%" if err else "n/a"
    graphed = prof_doc().get("contradicted", {}).get("moe_layer_graphs",
                                                     {"rows": [], "median": float("nan")})
    ratios = [by_id[i]["published_tokens_per_s_per_gpu"] / by_id[i]["predicted_tokens_per_s_per_gpu"]
              for i in graphed["rows"] if i in by_id]
    figures["moe_graph_rows"] = ", ".join(graphed["rows"])
    figures["moe_graph_range"] = f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else "n/a"
    figures["moe_graph_median"] = f"{graphed['median']:.2f}"
    for i in ("R0256", "R0137"):
        r = by_id.get(i)
        figures[f"{i.lower()}_pub"] = f"{r['published_tokens_per_s_per_gpu']:,.0f}" if r else "n/a"
        figures[f"{i.lower()}_err"] = f"{shipped_error(r):+.0f}%" if r else "n/a"
    pub = {i: float(RAW[i]["tokens_per_s_per_gpu"]) for i in ("R0037", "R0038", "R0082", "R0083")
           if i in RAW}
    figures["fp4_gb200"] = (f"{pub['R0038'] / pub['R0037']:.2f}" if len(pub) == 4 else "n/a")
    figures["fp4_gb300"] = (f"{pub['R0083'] / pub['R0082']:.2f}" if len(pub) == 4 else "n/a")
    for gpu in ("GB200", "GB300"):
        e = [shipped_error(r) for r in SHIPPED if r["precision"] == "nvfp4" and r["gpu"] == gpu
             and r["model"] == "llama3-405b"]
        figures[f"fp4_{gpu.lower()}_err"] = f"{min(e):+.0f} to {max(e):+.0f}%" if e else "n/a"
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", nargs="?", default=None,
                    help="published-runs CSV (default: the shipped moeplan/validation/data copy)")
    ap.add_argument("--crossval", default=str(CROSSVAL))
    ap.add_argument("-o", "--out", default="docs/ACCURACY.md")
    args = ap.parse_args()
    raw = read_rows(args.csv)
    RAW.update({r["id"]: r for r in raw})
    from moeplan.specs import list_presets

    presets = list_presets()
    for r in raw:
        c = case_of(r, presets)
        if not isinstance(c, str):
            CASES[c.id] = c
    cv = json.loads(Path(args.crossval).read_text())
    quick_path = Path(args.crossval).with_name("crossval_quick.json")
    quick = json.loads(quick_path.read_text()) if quick_path.is_file() else None
    res = validate_rows(raw)
    shipped = [r for r in res["rows"] if r["published_tokens_per_s_per_gpu"]]
    SHIPPED[:] = shipped
    cal = json.loads((Path(U.__file__).parent / "calibration.json").read_text())
    about = cal.get("_about", "")
    figures = {"rows": (re.search(r"\((\d+) rows", about) or [None, "?"])[1],
               "objective": (re.search(r"objective ([0-9.]+)", about) or [None, "?"])[1],
               "launch_x86": f"{cal['launch_us'].get('x86', 0):g}",
               "launch_grace": f"{cal['launch_us'].get('grace', 0):g}",
               "sm_hopper": f"{cal['comm_sm_fraction'].get('hopper', 0):g}",
               "sm_blackwell": f"{cal['comm_sm_fraction'].get('blackwell', 0):g}",
               "realised_h": f"{cal.get('attn_realised', {}).get('hopper', 1.0):g}",
               "realised_b": f"{cal.get('attn_realised', {}).get('blackwell', 1.0):g}"}
    gaps = gap_figures()
    gaps["fsdp_rows"] = str(sum("FSDP" in s["why"] for s in res["skipped"]))
    figures.update(gaps)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lomo, loro = cv["model"]["rows"], cv["release"]["rows"]
    figures.update(change_figures(cv, cal, quick))
    lines = [
        "# Accuracy of the cost models", "",
        "Predicted against published tokens/s/GPU for every row of the shipped published runs",
        "(`moeplan/validation/data/published_runs.csv`, sources in its README) whose model and",
        "cluster presets exist. **Every figure that is evidence comes from a refit that never",
        "saw the rows it predicts**: leave one model out (the headline), leave one release out,",
        "and the configuration split. The shipped profile is fitted on every row; its own errors",
        "are shown only to expose over-fitting.", "",
        "Produced by (from the repository root):", "", "```",
        "python bench/fit_calibration.py        # moeplan/cost_models/calibration.json, every row",
        "python bench/cross_validate.py --jobs 2  # bench/data/crossval.json: model, release, "
        "config folds, full refit",
        "python bench/cross_validate.py --by model --refit quick --jobs 2  # the CLI's refit",
        "python bench/fit_intervals.py          # moeplan/cost_models/intervals.json",
        "python bench/accuracy_report.py        # this file",
        "moeplan validate --cv model --jobs 2 --json  # leave one model out, quick refit, per family",
        "moeplan validate RUNS.csv              # runs no fit saw, scored as new runs",
        "python bench/korthikanti_table5.py     # Table 5 runs (dense A100)", "```", "",
        f"Code at commit `{commit}` plus the working tree at the time of writing.", "",
        "## Headline", "", *headline(cv, quick, shipped), "",
        *model_gpu_bias(lomo), "",
        *model_gpu_bias(loro, "leave-one-release-out (a model's other releases fitted, as for "
                        "a new release of a model the fit knows)"), "",
        *[line.format(**figures) for line in CHANGES], "",
        "## By model family", "", *family_section(cv), "",
        "## By model", "", *error_table(grouped(lomo, lambda r: r["model"])), "",
        "## By software release", "", "Leave one release out: every row of a release predicted "
        "by a refit without that release.", "",
        *error_table(grouped(loro, lambda r: release_name(r["id"]))), "",
        "## By GPU generation", "", "Leave one model out.", "",
        *error_table(grouped(lomo, generation)), "",
        "## Layout ranking within a release", "", *ranking_section(lomo), "",
        "## Layouts and scale", "", *scale_section(lomo), "",
        "## Dense A100", "", "Narayanan et al. 2021 (`megatron-2021`), MegaScale's Megatron-LM "
        "baseline (`megatron-2023`); leave one model out.", "", *dense_a100(lomo), "",
        "## Korthikanti et al. 2022 Table 5", "", *table5_section(), "",
        f"## {UNSEEN_TITLE}", "",
        *unseen_section(), "",
        "## Prediction intervals", "", *interval_section(), "",
        "## gpt-oss-120b", "", *gpt_oss_section(lomo), "",
        "## Worst rows", "", "Leave one model out.", "", *worst(lomo), "",
        "## Memory: DeepSeek-V3 anatomy", "", *anatomy(), "",
        "## Known gaps", "", *[line.format(**gaps) for line in GAPS], "",
        "## Skipped rows", "", *skipped(res),
    ]
    lines += foreign_tail(Path(args.out))
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}: leave-one-model-out MAPE {pct(cv['model']['mape'])} over "
          f"{cv['model']['count']} rows")


if __name__ == "__main__":
    main()
