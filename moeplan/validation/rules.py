"""Documented settings a published row does not print, by the rule of its source.

NVIDIA's performance tables print a run's sizes; the recipe that produced the run sets more
(TP comm overlap, bf16 gradient reduction, FP8 parameter gathers, the 26.06 MXFP8 MoE change).
Each rule here names the documentation it follows; `cases.case_of` applies them, and
`recipes` holds the per-recipe settings matched on every printed size.
"""

from __future__ import annotations

import re
from typing import Any

from ..specs.loader import check_stack
from ..specs.model import ModelSpec
from .recipes import SOURCE as BRIDGE_SOURCE
from .rows import cell, release_of

# Megatron-Bridge's MXFP8 MoE recipes for Blackwell turn on the fused CuTe-DSL grouped MLP
# (GroupGEMM + SwiGLU + quantisation; Megatron-Bridge issue #2885, "delayed to 26.06", enabled
# in 26.06) together with EP communication overlap (`moe_a2a_overlap`), the HybridEP flex
# dispatcher and CUDA graphs (scripts/performance/configs/*/_workload_base_configs.py, the
# `FP8_MX` variants; `perf_recipes/*/common.py::_enable_*_full_iteration_mxfp8`). The published
# rows print none of them, so rows of those releases are priced with the overlap, the
# dispatcher and CUDA graphs: over the whole iteration where the recipe says so
# (FULL_ITERATION_RECIPES), per layer otherwise. The fused MLP (`Layout.fused_grouped_mlp`)
# goes with the full-iteration recipes: Megatron-Bridge v0.5.0 (26.06) sets
# `cutedsl_fused_grouped_mlp=True` on exactly their `FP8_MX` workload configs (and
# `perf_plugins.py` exports NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 for it), v0.6.0 (26.08) sets
# `use_transformer_engine_op_fuser` in the `_enable_*_full_iteration_mxfp8` helpers that turn
# the full-iteration graph on.
OVERLAP_RECIPE_FROM = (26, 6)

# Of those MXFP8 MoE recipes, the ones whose CUDA graph captures the whole iteration
# (`cuda_graph_impl="full_iteration"`, `cuda_graph_scope=[]`, with HybridEP's rank capacity 1.5
# and the paged stash: `set_full_iter_cg_configs`), by (model preset, GPU), as the June 2026
# commits before the 26.06 release set them in
# scripts/performance/configs/*/*_workload_base_configs.py: Qwen3 GB200/GB300 (both sizes) and
# Qwen3-30B-A3B B300 (Megatron-Bridge 55443cbfb, #4211), DeepSeek-V3 GB200 (afb5dd47c, #4226)
# and GB300 (8af195c0a, #3983), gpt-oss-120b GB200/GB300 (5f98743d5, #4173). The other MXFP8
# MoE recipes of those releases keep per-layer graphs.
FULL_ITERATION_RECIPES = frozenset({
    ("qwen3-30b-a3b", "GB200"), ("qwen3-30b-a3b", "GB300"), ("qwen3-30b-a3b", "B300"),
    ("qwen3-235b-a22b", "GB200"), ("qwen3-235b-a22b", "GB300"),
    ("deepseek-v3", "GB200"), ("deepseek-v3", "GB300"),
    ("gpt-oss-120b", "GB200"), ("gpt-oss-120b", "GB300"),
})

# NVIDIA's NeMo and Megatron-Bridge performance recipes turn on TP communication overlap (TE
# userbuffers: `tp_comm_overlap=True` in the performance configs' CommOverlapConfig) whenever
# TP > 1; the published tables print the sizes, not the overlap. Megatron-LM's own papers and
# READMEs, the folding paper, TorchTitan and MegaScale's baseline do not document it: priced
# without (the Layout default), so the fit learns the overlap only from runs that had it.
TP_OVERLAP_SOURCES = ("NVIDIA Megatron-Bridge performance summary",
                      "NVIDIA NeMo performance summary", "NVIDIA NeMo 2.0 performance summary",
                      "NVIDIA NeMo long-sequence performance doc")

# NVIDIA's performance recipes (TP_OVERLAP_SOURCES) also reduce data-parallel gradients in bf16:
# Megatron-Bridge's performance configs (`cfg.ddp.grad_reduce_in_fp32 = False` in their
# common settings), NeMo 2.0's performance
# scripts and recipes' performance mode (`recipe.trainer.plugins.grad_reduce_in_fp32 = False`),
# NeMo 1's launcher configs (`optim.grad_sync_dtype=bf16`). Megatron-LM reduces in fp32 unless
# told (`--grad-reduce-in-bf16`), as the TrainingSpec default does.
BF16_GRAD_REDUCE_SOURCES = TP_OVERLAP_SOURCES

# NeMo 2.0's FP8 mixed-precision recipes gather FP8 parameters: `bf16_with_fp8_mixed` (the
# unnamed "FP8" of its performance tables, delayed scaling) sets `fp8_params=True` /
# `fp8_param_gather=True`, and so does its `bf16_with_mxfp8_mixed` (what that "FP8" is on
# Blackwell). Its current-scaling recipe ("FP8-CS") does not document one setting across
# releases, so those rows keep bf16 gathers.
FP8_PARAM_GATHER_SOURCES = ("NVIDIA NeMo 2.0 performance summary",)

# Megatron-Bridge's performance scripts take their precision from `get_precision_config`
# (scripts/performance/utils/helpers.py in v0.1.0, utils/precision.py from v0.3.0): "fp8_cs"
# is `bf16_with_fp8_current_scaling_mixed()` and "fp8_mx" `bf16_with_mxfp8_mixed()`, both with
# `fp8_param_gather = True` (MXFP8 with `reuse_grad_buf_for_mxfp8_param_ag`) in every release
# from v0.1.0 (25.09) to v0.6.0 (26.08), src/megatron/bridge/training/mixed_precision.py; the
# blockwise recipe ("fp8_sc") sets it False, NVFP4 gathers FP4 parameters (not priced as
# such: those rows keep bf16 gathers). The one performance config that turns it off for the
# rows here: Kimi-K2 from v0.4.0 (26.04), whose default optimizer became Muon
# ("MXFP8's fp8_param_gather ... incompatible with Muon's LayerWiseDistributedOptimizer",
# scripts/performance/configs/kimi/kimi_llm_pretrain.py).
BRIDGE_FP8_PARAM_GATHER = ("fp8-tensorwise", "mxfp8")
BRIDGE_FP8_PARAM_GATHER_OFF: dict[str, tuple[int, int]] = {"kimi-k2": (26, 4)}


def bridge_fp8_param_gather(row: dict[str, str], model_preset: str, precision: str) -> bool:
    """Whether a Megatron-Bridge row's recipe gathers FP8 parameters (BRIDGE_FP8_PARAM_GATHER)."""
    if (not (row.get("source", "") or "").startswith(BRIDGE_SOURCE)
            or precision not in BRIDGE_FP8_PARAM_GATHER):
        return False
    off_from, rel = BRIDGE_FP8_PARAM_GATHER_OFF.get(model_preset), release_of(row)
    return off_from is None or (rel is not None and rel < off_from)


def recipe_settings(row: dict[str, str], model: ModelSpec, precision: str, architecture: str
                    ) -> dict[str, Any]:
    """Layout settings a row's source documents but the row does not print (see
    OVERLAP_RECIPE_FROM); empty when nothing is known beyond moeplan's defaults."""
    rel = release_of(row)
    if ("Megatron-Bridge" in (row.get("source", "") or "") and rel is not None
            and rel >= OVERLAP_RECIPE_FROM and precision == "mxfp8" and model.num_experts
            and architecture == "blackwell"):
        out: dict[str, Any] = {"ep_overlap": True, "dispatcher": "flex", "cuda_graphs": True}
        if (row.get("model_preset", ""), (row.get("gpu") or "").strip()) in FULL_ITERATION_RECIPES:
            out["cuda_graph_scope"] = "full_iteration"
            out["fused_grouped_mlp"] = True
        return out
    return {}


# Megatron-LM as the 2021–22 papers ran it (Narayanan et al. 2021, arXiv 2104.04473 §5;
# Korthikanti et al. 2022, arXiv 2205.05198): attention as batched GEMMs around a fused softmax
# (the s² scores selective recomputation drops), dropout 0.1, and a DistributedDataParallel
# that all-reduced the
# gradients once the backward had finished (`allreduce_gradients` after the backward; the
# overlapped reduction, `--overlap-grad-reduce`, came with Megatron Core's DDP in 2023).
MEGATRON_2021_SOURCES = ("Narayanan et al. 2021",)
# Korthikanti et al. 2022 added sequence parallelism and selective recomputation to it
MEGATRON_2022_SOURCES = ("Korthikanti et al. 2022",)
# MegaScale's Megatron-LM baseline (Jiang et al. 2024, NSDI): its data-parallel all-gather and
# reduce-scatter are not overlapped with compute — overlapping them is one of the
# optimizations MegaScale adds (§3.2) — so the baseline loses efficiency as DP grows (53% MFU
# at 256 GPUs, 41% at 12,288, Table 2).
MEGATRON_2023_SOURCES = ("MegaScale (ByteDance, NSDI 2024)",)
# Megatron Core before 0.13 (2024 to mid-2025): before the fused MoE router
# (`--moe-router-fusion`, Megatron Core 0.13) and the cuDNN attention kernels of the late-2025
# recipes. The NeMo 24.07 tables, the NeMo 2.0 tables of the 25.02 and 25.04 containers, the
# long-sequence doc (NeMo 24.x and 25.0x containers), the Megatron-LM READMEs of Megatron Core
# r0.8–0.9 and the Parallel Folding paper's runs (Megatron Core of early 2025, arXiv
# 2504.14960) all predate them; NeMo 25.07 (Megatron Core 0.13) and Megatron-Bridge do not.
MCORE_2024_SOURCES = ("NVIDIA NeMo performance summary (NeMo 24",
                      "NVIDIA NeMo 2.0 performance summary (NeMo 25.02)",
                      "NVIDIA NeMo 2.0 performance summary (NeMo 25.04)",
                      "NVIDIA NeMo long-sequence", "MoE Parallel Folding",
                      "Megatron-LM MoE README", "Megatron-LM README")


# Megatron-Bridge's token-drop runs (the `variant=tokendrop` rows of its 25.09 tables) apply
# `megatron.bridge.training.utils.moe_token_drop.apply_moe_token_drop` with its defaults: a
# capacity factor of 1 and every expert's input padded to capacity, which needs the alltoall
# dispatcher (the function asserts it). Their CUDA graphs are the 25.09 performance matrix's
# `cuda_graphs` (scripts/performance/configs/{qwen3,deepseek}/*_llm_pretrain.yaml at
# Megatron-Bridge cac49dcd7, "Malay/qwen3 2509"): Megatron Core's local graphs of whole layers,
# which a padded MoE layer allows. Keyed by (model preset, GPU), a precision set where the
# matrix splits by it.
TOKEN_DROP_GRAPHS: dict[tuple[str, str], tuple[str, ...]] = {
    ("qwen3-30b-a3b", "GB200"): ("bf16", "fp8-tensorwise", "mxfp8"),
    ("qwen3-30b-a3b", "B200"): ("bf16", "fp8-tensorwise", "mxfp8"),
    ("qwen3-30b-a3b", "H100-SXM"): (),
    ("qwen3-235b-a22b", "GB200"): ("bf16", "fp8-tensorwise", "mxfp8"),
    ("qwen3-235b-a22b", "B200"): (),
    ("qwen3-235b-a22b", "H100-SXM"): (),
    ("deepseek-v3", "GB200"): (),
    ("deepseek-v3", "B200"): ("fp8-tensorwise", "mxfp8"),
}


def token_drop(row: dict[str, str]) -> bool:
    """Whether a row is one of Megatron-Bridge's token-drop runs."""
    return ((row.get("source", "") or "").startswith(BRIDGE_SOURCE)
            and "variant=tokendrop" in (row.get("other_notes", "") or "").lower())


def token_drop_settings(row: dict[str, str], model_preset: str, precision: str
                        ) -> dict[str, Any]:
    """The layout settings of a token-drop run (`TOKEN_DROP_GRAPHS`): the alltoall dispatcher,
    and CUDA graphs where its performance matrix ran them; empty for any other row."""
    if not token_drop(row):
        return {}
    graphed = TOKEN_DROP_GRAPHS.get((model_preset, (row.get("gpu") or "").strip()), ())
    return {"dispatcher": "alltoall", "cuda_graphs": precision in graphed}


def training_settings(row: dict[str, str]) -> dict[str, Any]:
    """Training numerics and stack the row's source documents for its recipe family but does
    not print (bf16 gradient reduction, FP8 parameter all-gather, the Megatron generation,
    token dropping padded to capacity). A `software_stack` cell (a CSV of one's own runs on an
    older stack) names the stack outright, over the source's."""
    src = row.get("source", "") or ""
    out: dict[str, Any] = {}
    if token_drop(row):
        out.update(moe_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    if src.startswith(MEGATRON_2021_SOURCES):
        out["software_stack"] = "megatron-2021"
    elif src.startswith(MEGATRON_2022_SOURCES):
        out["software_stack"] = "megatron-2022"
    elif src.startswith(MEGATRON_2023_SOURCES):
        out["software_stack"] = "megatron-2023"
    elif src.startswith(MCORE_2024_SOURCES):
        out["software_stack"] = "mcore-2024"
    if src.startswith(BF16_GRAD_REDUCE_SOURCES):
        out["grad_reduce_dtype"] = "bf16"
    if (src.startswith(FP8_PARAM_GATHER_SOURCES) and cell(row, "precision") == "FP8"
            or bridge_fp8_param_gather(row, cell(row, "model_preset"),
                                       cell(row, "precision_preset"))):
        out["fp8_param_gather"] = True
    # and what the row's own notes document, in TrainingSpec's terms
    notes = (row.get("other_notes") or "").lower()
    if stack := (row.get("software_stack") or "").strip():
        out["software_stack"] = check_stack(stack, "software_stack")
    if "fp8 parameter gather" in notes:
        out["fp8_param_gather"] = True
    if "bf16 adam moments" in notes:
        out["optimizer_moments_dtype"] = "bf16"
    return out


# Megatron-Bridge recipes that keep TP communication overlap off at TP > 1, in every release
# that has them from 25.11 (v0.2.0) to 26.06 (v0.5.0): DeepSeek-V3's and Kimi-K2's (from 26.02)
# base recipes (`CommOverlapConfig(tp_comm_overlap=False)` in recipes/deepseek/deepseek_v3.py
# and recipes/kimi/kimi_k2.py, which their performance configs do not override),
# Qwen3-235B-A22B's H100 performance config (scripts/performance/configs/qwen/
# qwen3_llm_pretrain.py, the one Qwen3 config that runs TP 2 beside EP overlap), and every
# NVFP4 variant of the Llama configs and, from 26.04, the gpt-oss ones (`tp_comm_overlap =
# False if precision == "nvfp4"`). Keyed by model preset, with the GPU where only one GPU's
# recipe does.
NO_TP_OVERLAP_RECIPES: dict[str, str | None] = {
    "deepseek-v3": None, "kimi-k2": None, "qwen3-235b-a22b": "H100-SXM"}


def keeps_tp_overlap_off(row: dict[str, str], model_preset: str, precision: str) -> bool:
    """Whether the row's Megatron-Bridge recipe sets TP communication overlap off
    (NO_TP_OVERLAP_RECIPES, and every NVFP4 recipe)."""
    if not (row.get("source", "") or "").startswith(BRIDGE_SOURCE):
        return False
    if precision == "nvfp4":
        return True
    if model_preset not in NO_TP_OVERLAP_RECIPES:
        return False
    gpu = NO_TP_OVERLAP_RECIPES[model_preset]
    return gpu is None or gpu == (row.get("gpu") or "").strip()


def stack_settings(row: dict[str, str], tp: int, model_preset: str, precision: str
                   ) -> dict[str, Any]:
    """Stack settings (TP comm overlap) the row's source documents for its recipe family."""
    src = row.get("source", "") or ""
    if (tp > 1 and src.startswith(TP_OVERLAP_SOURCES)
            and not keeps_tp_overlap_off(row, model_preset, precision)):
        return {"tp_comm_overlap": True}
    return {}


# Settings a row's own text documents (its notes and source detail), in the words sources use:
# the DeepEP / HybridEP dispatchers (Megatron's `flex` token dispatcher and its backend; a row
# naming neither runs the HybridEP default NVIDIA's recipes set), Megatron's all-to-all
# and all-gather dispatchers, EP communication overlap (`--overlap-moe-expert-parallel-comm`,
# Megatron-Bridge's `moe_a2a_overlap`, "EP/A2A overlap"), TP communication overlap
# ("TP overlap", "DP/TP/PP/CP overlap enabled"), CUDA graphs and the full-iteration scope of
# them, Transformer Engine's fused grouped MLP. A phrase preceded in its clause
# by a negation ("no", "w/o", "without", "not", "disabled"), or followed by "disabled"
# or "off", documents the setting off.
NOTE_SETTINGS: tuple[tuple[str, str, Any], ...] = (
    (r"deep-?ep|hybrid-?ep|flex (?:token )?dispatcher", "dispatcher", "flex"),
    (r"deep-?ep", "flex_backend", "deepep"),
    (r"hybrid-?ep", "flex_backend", "hybridep"),
    (r"(?:all-?to-?all|\ba2a) (?:token )?dispatcher|dispatcher(?: type)?\s*[:=]?\s*"
     r"(?:a2a|all-?to-?all)\b", "dispatcher", "alltoall"),
    (r"all-?gather (?:token )?dispatcher", "dispatcher", "allgather"),
    # Megatron-MoE-ModelZoo's launch switch for it (A2A_OVERLAP=1 or 0)
    (r"\ba2a_overlap\s*=\s*(?:1|true)\b", "ep_overlap", True),
    (r"\ba2a_overlap\s*=\s*(?:0|false)\b", "ep_overlap", False),
    (r"\b(?:ep|a2a|all-?to-?all|expert[- ]parallel(?:ism)?|moe)(?: comm(?:unication)?)? "
     r"overlap|overlap-moe-expert-parallel-comm|moe_a2a_overlap"
     # Megatron-MoE-ModelZoo's name for the same schedule ("+1f1b overlap")
     r"|\b1f1b overlap", "ep_overlap", True),
    (r"\btp(?:/[a-z]{2})*(?: comm(?:unication)?)? overlap|(?:[a-z]{2}/)+tp(?:/[a-z]{2})* "
     r"overlap|tp_comm_overlap", "tp_comm_overlap", True),
    (r"cuda[- ]?graphs?", "cuda_graphs", True),
    (r"full[- ]iteration cuda[- ]?graphs?", "cuda_graph_scope", "full_iteration"),
    (r"fused grouped mlp|cutedsl_fused_grouped_mlp|transformer[- ]engine op fuser",
     "fused_grouped_mlp", True),
)
NEGATION = re.compile(r"(?:\bno|w/o|without|\bnot|disabled?)\s+(?:\S+\s+){0,2}$")


def documented_settings(row: dict[str, str]) -> dict[str, Any]:
    """Layout settings the row's own notes and source detail name (NOTE_SETTINGS): what a
    source documents about its run is read, not assumed."""
    text = f"{row.get('other_notes') or ''}; {row.get('source_detail') or ''}".lower()
    out: dict[str, Any] = {}
    for pattern, key, value in NOTE_SETTINGS:
        for m in re.finditer(pattern, text):
            clause = re.split(r"[,;|.()]", text[max(0, m.start() - 30):m.start()])[-1]
            after = re.split(r"[,;|.()]", text[m.end():m.end() + 20])[0]
            negated = (NEGATION.search(clause) is not None
                       or re.match(r"\s*(?:(?:is|are|was|were)\s+)?(?:disabled|off\b|not\b)",
                                   after) is not None)
            if negated and isinstance(value, bool):
                out.setdefault(key, False)
            elif not negated:
                out.setdefault(key, value)
    return out
