"""`moeplan validate`: predict published runs and compare, row by row.

Reads a CSV shaped like `shared/data/published_runs.csv`. A row is predicted when its
`model_preset` and `cluster_preset` are known and its layout is complete; otherwise it is listed
under `skipped` with the reason. Rows that use Megatron-FSDP/FSDP/ZeRO-3 instead of the
distributed optimizer, and fine-tuning rows, are skipped: the cost models price Megatron's
distributed optimizer and pretraining only.

Tokens/s/GPU is compared where published (it needs no FLOP convention). TFLOPS are compared in
the row's own `flops_convention`: `causal_halved` is ours, `full` counts the causal attention
term twice, `full_with_recompute` adds one more forward (Narayanan et al. 2021's hardware FLOPs
with full recompute).

The fit/held-out split is fixed by `split_of(row)`: a row belongs to the fit set when the CRC32
of its configuration key (model, GPU, precision, layout, sequence, batch) is even. Keying on the
configuration rather than the id keeps re-publications of one configuration (Megatron-Bridge
releases) on the same side, so no held-out row has a fitted twin.
"""

from __future__ import annotations

import csv
import io
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .bridge_recipes import Recipe, contradicts, recipe_for
from .errors import LayoutError, MoeplanError, SpecError
from .limits import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_SEQ_LEN, excerpt
from .specs import Choices, Layout, TrainingSpec, list_presets, load_cluster, load_model
from .specs.model import ModelSpec

FSDP_PAT = re.compile(r"megatron-fsdp|fsdp2|fsdp only|zero-3|method=fsdp|fsdp degree", re.I)
FSDP_SIZE = re.compile(r"FSDP=(\d+)")
FINETUNE_PAT = re.compile(r"task=(sft|lora)", re.I)
RELEASE_PAT = re.compile(r"release (\d+)\.(\d+)")

# Megatron-Bridge's MXFP8 MoE recipes for Blackwell turn on the fused CuTe-DSL grouped MLP
# (GroupGEMM + SwiGLU + quantisation; Megatron-Bridge issue #2885, "delayed to 26.06", enabled
# in 26.06) together with EP communication overlap (`moe_a2a_overlap`) and the HybridEP flex
# dispatcher (scripts/performance/configs/*/_workload_base_configs.py, the `FP8_MX` variants).
# The published rows print neither setting, so rows of those releases are priced with them.
OVERLAP_RECIPE_FROM = (26, 6)

# NVIDIA's NeMo and Megatron-Bridge performance recipes turn on TP communication overlap (TE
# userbuffers: `tp_comm_overlap=True` in the performance configs' CommOverlapConfig) whenever
# TP > 1; the published tables print the sizes, not the overlap. Megatron-LM's own papers and
# READMEs, the folding paper, TorchTitan and MegaScale's baseline do not document it: priced
# without (the Layout default), so the fit learns the overlap only from runs that had it.
TP_OVERLAP_SOURCES = ("NVIDIA Megatron-Bridge performance summary",
                      "NVIDIA NeMo performance summary", "NVIDIA NeMo 2.0 performance summary",
                      "NVIDIA NeMo long-sequence performance doc")
_INT_LIMITS = {"seq_len": MAX_SEQ_LEN, "global_batch_seqs": MAX_GLOBAL_BATCH,
               "micro_batch": MAX_GLOBAL_BATCH}


@dataclass(frozen=True)
class RunCase:
    """One predictable row: the specs it maps to and what was published."""

    id: str
    model: ModelSpec
    cluster_name: str
    training: TrainingSpec
    layout: Layout
    published_tokens: float | None
    published_tflops: float | None
    published_memory: float | None
    convention: str
    gpu: str
    family: str
    row: dict[str, str]
    assumed: dict[str, Any] = field(default_factory=dict)  # unprinted settings from the recipe
    choices: Choices = field(default_factory=Choices)  # recompute as the row publishes it


def _cell(row: dict[str, str], col: str) -> str:
    """A cell's text, stripped (None where the row is short)."""
    return (row.get(col) or "").strip()


def _bad_cell(row: dict[str, str], col: str, want: str) -> SpecError:
    return SpecError(f"row {excerpt(row.get('id', '?'))}, column `{col}`: "
                     f"{excerpt(_cell(row, col))} is not {want}; fix the cell or leave it empty "
                     "(unpublished).")


def _float(row: dict[str, str], col: str) -> float | None:
    """A published measurement: empty (None) or a finite non-negative number, else SpecError."""
    v = _cell(row, col)
    if not v:
        return None
    try:
        x = float(v)
    except ValueError:
        raise _bad_cell(row, col, "a number") from None
    if not math.isfinite(x) or x < 0:
        raise _bad_cell(row, col, "a finite non-negative number")
    return x


def _int(row: dict[str, str], col: str, default: int | None = None) -> int | None:
    """A size (GPUs, seq, batch, parallel degree): empty (`default`) or a whole number in
    1..limit, else SpecError naming the row and column, before any spec is built."""
    v = _cell(row, col)
    if not v:
        return default
    try:
        x = float(v)
    except ValueError:
        raise _bad_cell(row, col, "a whole number") from None
    if not math.isfinite(x) or x != int(x) or x < 1:
        raise _bad_cell(row, col, "a positive whole number")
    n, limit = int(x), _INT_LIMITS.get(col, MAX_GPUS)
    if n > limit:
        raise _bad_cell(row, col, f"at most {limit:,} (moeplan's limit)")
    return n


def release_of(row: dict[str, str]) -> tuple[int, int] | None:
    """The (year, month) of the container release a row names in its source detail, if any."""
    m = RELEASE_PAT.search(row.get("source_detail", "") or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def recipe_settings(row: dict[str, str], model: ModelSpec, precision: str, architecture: str
                    ) -> dict[str, Any]:
    """Layout settings a row's source documents but the row does not print (see
    OVERLAP_RECIPE_FROM); empty when nothing is known beyond moeplan's defaults."""
    rel = release_of(row)
    if ("Megatron-Bridge" in (row.get("source", "") or "") and rel is not None
            and rel >= OVERLAP_RECIPE_FROM and precision == "mxfp8" and model.num_experts
            and architecture == "blackwell"):
        return {"ep_overlap": True, "dispatcher": "flex"}
    return {}


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
# Blackwell). Its current-scaling recipe ("FP8-CS") and Megatron-Bridge's MXFP8 recipe do not
# document one setting across releases, so those rows keep bf16 gathers.
FP8_PARAM_GATHER_SOURCES = ("NVIDIA NeMo 2.0 performance summary",)


def training_settings(row: dict[str, str]) -> dict[str, Any]:
    """Training numerics the row's source documents for its recipe family but does not print
    (bf16 gradient reduction, FP8 parameter all-gather)."""
    src = row.get("source", "") or ""
    out: dict[str, Any] = {}
    if src.startswith(BF16_GRAD_REDUCE_SOURCES):
        out["grad_reduce_dtype"] = "bf16"
    if src.startswith(FP8_PARAM_GATHER_SOURCES) and _cell(row, "precision") == "FP8":
        out["fp8_param_gather"] = True
    return out


def stack_settings(row: dict[str, str], tp: int) -> dict[str, Any]:
    """Stack settings (TP comm overlap) the row's source documents for its recipe family."""
    src = row.get("source", "") or ""
    if tp > 1 and src.startswith(TP_OVERLAP_SOURCES):
        return {"tp_comm_overlap": True}
    return {}


def config_key(row: dict[str, str]) -> str:
    cols = ("cluster_preset", "precision_preset", "seq_len", "global_batch_seqs",
            "micro_batch", "tp", "pp", "vpp", "cp", "ep", "etp", "num_gpus")
    return "|".join([model_preset_of(row)] + [(row.get(c) or "").strip() for c in cols])


def split_of(row: dict[str, str]) -> str:
    """'fit' or 'held-out', deterministic in the row's configuration."""
    return "fit" if zlib.crc32(config_key(row).encode()) % 2 == 0 else "held-out"


# Rows whose `model_preset` cell is empty but whose `model` names an architecture moeplan has a
# preset for (NeMo's performance-summary spellings; the shared CSV leaves the cell empty where no
# preset existed when it was written). Nemotron-8B/22B are left out: their sources do not give
# the architecture.
MODEL_NAME_PRESETS = {
    "LLAMA2-7B": "llama2-7b", "LLAMA2-13B": "llama2-13b", "LLAMA2-70B": "llama2-70b",
    "GPT3-5B": "gpt3-5b", "GPT3-20B": "gpt3-20b",
    "Nemotron-15B": "nemotron4-15b", "Nemotron-340B": "nemotron4-340b",
    "Nemotron-4 340B (96 layers, hidden 18432, 96 heads, 8 KV heads, squared-ReLU)":
        "nemotron4-340b",
}


def model_preset_of(row: dict[str, str]) -> str:
    """The row's model preset: its `model_preset` cell, else the preset its `model` names
    (MODEL_NAME_PRESETS), else empty."""
    mp = (row.get("model_preset") or "").strip()
    return mp or MODEL_NAME_PRESETS.get((row.get("model") or "").strip(), "")


def family_of(model_preset: str) -> str:
    return re.split(r"-\d|-v\d|-a\d|-\d+x", model_preset)[0].split("-")[0]


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """The CSV's rows as dicts; SpecError for a missing, oversized, non-UTF-8 or malformed file
    (cells are checked per row, in `case_of`)."""
    from .fsio import is_file
    from .specs.loader import read_text

    p = Path(path)
    if not is_file(p):
        raise SpecError(f"{excerpt(str(path))} is not a readable CSV file. Pass a file shaped "
                        "like published_runs.csv.")
    text = read_text(p, "CSV file")
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        header = reader.fieldnames or []
        twice = next((c for i, c in enumerate(header) if c in header[:i]), None)
        if twice is not None:  # DictReader would keep the last column's cells silently
            raise SpecError(f"{p}: the column `{excerpt(twice)}` appears twice in the header; "
                            "give each column once.")
        rows = list(reader)
    except csv.Error as err:
        raise SpecError(f"{p} is not a valid CSV file ({err}); fix the file.") from None
    if rows and "id" not in rows[0]:
        raise SpecError(f"{path}: no `id` column; the CSV must have the columns of "
                        "published_runs.csv (id, model_preset, cluster_preset, tp, pp, ...).")
    return rows


GPT_DIMS = re.compile(r"GPT[\w-]* ([\d.]+)B \(heads (\d+), hidden (\d+), layers (\d+)\)")
VOCAB = re.compile(r"vocab (\d+)")
# GPUs a row names only by class, and the preset that stands for them (recorded as assumed)
GPU_CLASS = {"Ampere A100-class": "a100-80g"}


def described_gpt(row: dict[str, str]) -> ModelSpec | None:
    """The GPT model a row spells out in its `model` column ("GPT 18.4B (heads 48, hidden 6144,
    layers 40)", the vocabulary in its notes): Megatron-LM's GPT (Narayanan et al. 2021, MegaScale)
    is GPT-3's architecture at those sizes — learned positions, LayerNorm, GeLU MLP of 4h, biases,
    tied embeddings. None when the row does not describe one."""
    m = GPT_DIMS.search(row.get("model", "") or "")
    if not m:
        return None
    size, heads, hidden, layers = m.group(1), *map(int, m.groups()[1:])
    v = VOCAB.search(row.get("other_notes", "") or "")
    vocab = int(v.group(1)) if v else 51200
    return ModelSpec(name=f"gpt-{size}b", num_layers=layers, hidden_size=hidden,
                     num_attention_heads=heads, ffn_hidden_size=4 * hidden, vocab_size=vocab,
                     activation="gelu", normalization="layernorm", position_embedding="learned",
                     max_position_embeddings=int(float(row.get("seq_len") or 2048)),
                     qkv_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True,
                     norm_eps=1e-5)


def published_recompute(row: dict[str, str]) -> Choices:
    """The recompute a row publishes: full recomputation (Megatron's `--recompute-granularity
    full`), or selective (Megatron's default selective module, core attention)."""
    text = (row.get("recompute") or "").lower()
    if "full" in text:
        return Choices(recompute=["full"])
    if "selective" in text:
        return Choices(recompute=["core_attn"])
    return Choices()


def case_of(row: dict[str, str], presets: dict[str, list[str]]) -> RunCase | str:
    """The RunCase for a row, or the reason it cannot be predicted."""
    notes = row.get("other_notes", "") or ""
    mp, cp_ = model_preset_of(row), (row.get("cluster_preset") or "").strip()
    described = described_gpt(row)
    assumed_cluster: dict[str, Any] = {}
    if "system=megascale" in notes.lower():
        return ("MegaScale's own system changes the model (parallel block, sliding-window "
                "attention, LAMB); not Megatron's architecture")
    if "precision not stated" in notes.lower():
        return "the source does not state the precision"
    if not described and (not mp or mp not in presets["models"]):
        return f"model preset {mp!r} unknown" if mp else "no model preset"
    if not cp_ and (row.get("gpu") or "").startswith(tuple(GPU_CLASS)):
        cp_ = next(v for k, v in GPU_CLASS.items() if row["gpu"].startswith(k))
        assumed_cluster = {"cluster": cp_}
    if not cp_ or cp_ not in presets["clusters"]:
        return f"cluster preset {cp_!r} unknown" if cp_ else "no cluster preset"
    if FINETUNE_PAT.search(notes):
        return "fine-tuning run (not pretraining)"
    size = FSDP_SIZE.search(notes)  # Megatron-Bridge tables: FSDP=0 means DDP + dist. optimizer
    if (int(size.group(1)) > 0) if size else bool(FSDP_PAT.search(notes)):
        return "uses (Megatron-)FSDP/ZeRO-3 instead of the distributed optimizer; not modelled"
    if "known issue" in notes.lower() or "regression" in notes.lower():
        return "source flags a known performance regression"
    gpus, seq, gbs = _int(row, "num_gpus"), _int(row, "seq_len"), _int(row, "global_batch_seqs")
    tp, pp = _int(row, "tp"), _int(row, "pp")
    if not gpus or not seq or not gbs:
        return "GPU count, sequence length or global batch not published"
    if tp is None or pp is None:
        return "tensor/pipeline parallel sizes not published"
    prec = (row.get("precision_preset") or "").strip() or "bf16"
    tokens, tflops = _float(row, "tokens_per_s_per_gpu"), _float(row, "tflops_per_gpu")
    mfu = _float(row, "mfu")
    if tokens is None and tflops is None and mfu is None:
        return "no throughput published"
    model = described or load_model(mp)
    if "w/o mtp" in notes.lower() and model.mtp_layers:
        model = model.model_copy(update={"mtp_layers": 0})
    cluster = load_cluster(cp_, gpus)
    if tflops is None and mfu is not None:
        tflops = mfu * cluster.bf16_tflops
    axes = {"tp": tp, "pp": pp, "cp": _int(row, "cp", 1), "ep": _int(row, "ep", 1),
            "vpp": _int(row, "vpp", 1), "mbs": _int(row, "micro_batch", 1)}
    etp = _int(row, "etp")
    try:
        numerics = training_settings(row)
        training = TrainingSpec(seq_len=seq, global_batch_size=gbs, precision=prec, **numerics)
    except Exception as err:  # pydantic ValidationError
        return f"training settings invalid: {err}"
    layout: Layout | None = None
    assumed: dict[str, Any] = {}
    why = ""
    from .specs import layout_violations

    cp, ep, vpp, mbs = axes["cp"], axes["ep"], axes["vpp"], axes["mbs"]
    where = (row.get("source", "") or "", release_of(row), mp, (row.get("gpu") or "").strip(),
             prec, (gpus, gbs, mbs, tp, pp, vpp, cp, ep))
    bridge = recipe_for(*where)
    # the release rule documents a later recipe revision than the table: it wins where both
    # speak, and is silent where the row's sizes contradict the table's recipe for that release
    rule = {} if contradicts(*where) else recipe_settings(row, model, prec, cluster.architecture)
    recipe = {**(bridge.settings if bridge else {}), **rule}
    choices = published_recompute(row)
    if bridge and bridge.recompute and not choices.recompute:
        choices = Choices(recompute=list(bridge.recompute))
    # a documented setting the published layout cannot take (Megatron's EP overlap needs
    # virtual pipeline stages when pp > 1) was not in that run's recipe
    # an unpublished etp is 1, or TP where the source's Megatron predates Parallel Folding (the
    # folding paper's "MCore" baseline: expert TP follows attention TP)
    unfolded = "method=mcore" in notes.lower() and "folding" not in notes.lower()
    etps = [etp] if etp else ([tp, 1] if unfolded else [1, tp])
    stack = stack_settings(row, tp)
    candidates = [(c, {**stack, **r}) for c in etps for r in ([recipe, {}] if recipe else [{}])]
    for cand, extra in candidates:
        try:
            lay = Layout.build(gpus, gbs, etp=cand, **axes, **extra)
        except (LayoutError, MoeplanError, ValueError) as err:  # ValueError: pydantic's
            why = str(err)
            continue
        v = layout_violations(model, training, lay, gpus, choices, cluster)
        if not v:
            layout, assumed = lay, extra
            break
        why = "; ".join(f"[{r}] {w}" for r, w in v)
    if layout is None:
        return f"layout as published breaks a rule: {why}"
    return RunCase(str(row.get("id") or "?"), model, cp_, training, layout, tokens, tflops,
                   _float(row, "memory_gb"),
                   (row.get("flops_convention") or "unknown").strip(), row.get("gpu", ""),
                   family_of(mp) if not described else "gpt-dense", row,
                   {**assumed, **numerics, **assumed_cluster, **_recipe_note(bridge, choices)},
                   choices)


def _recipe_note(bridge: Recipe | None, choices: Choices) -> dict[str, Any]:
    """What `assumed` records of a matched Megatron-Bridge recipe: its name and the recompute it
    set (the layout settings it set are recorded with the layout's)."""
    if bridge is None:
        return {}
    note: dict[str, Any] = {"recipe": bridge.name}
    if choices.recompute and list(bridge.recompute) == choices.recompute:
        note["recompute"] = list(choices.recompute)
    return note


def flops_per_token_in(model: ModelSpec, seq: int, convention: str) -> float | None:
    """Model FLOPs per token in a published convention (None when unknown)."""
    base = model.flops_per_token(seq)
    if convention == "causal_halved":
        return base
    m = model
    n_layers = m.num_layers + m.mtp_layers
    if m.attention == "mla":
        qk = (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0)
        attn_half = 6 * n_layers * seq * m.num_attention_heads * (qk + (m.v_head_dim or 0)) / 2
    else:
        attn_half = 12 * n_layers * m.num_attention_heads * m.head_dim_ * seq / 2
    full = base + attn_half
    if convention == "full":
        return full
    if convention == "full_with_recompute":
        return full * 4 / 3
    return None


def predict_case(case: RunCase, calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predict one case: the row dict `moeplan validate` prints (plus split and group)."""
    from .cost_models.estimate import estimate

    cluster = load_cluster(case.cluster_name, case.layout.world_size)
    est = estimate(case.model, cluster, case.training, case.layout, case.choices,
                   calibration=calibration)
    fpt_ours = case.model.flops_per_token(case.training.seq_len)
    fpt_conv = flops_per_token_in(case.model, case.training.seq_len, case.convention)
    pred_tflops_conv = (est.tflops_per_gpu * fpt_conv / fpt_ours) if fpt_conv else None
    pub_tokens = case.published_tokens
    derived = False
    if pub_tokens is None and case.published_tflops is not None and fpt_conv:
        pub_tokens = case.published_tflops * 1e12 / fpt_conv
        derived = True
    from .cost_models import uncertainty as U

    iv = est.interval
    return {
        "id": case.id,
        "predicted_tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
        "predicted_interval_tokens_per_s_per_gpu": list(iv.tokens_per_s_per_gpu) if iv else None,
        "pessimistic_tokens_per_s_per_gpu": iv.pessimistic_tokens_per_s_per_gpu if iv else None,
        "regimes": U.regime_keys(case.model, cluster, case.training.precision, case.layout),
        "assumption_keys": U.assumption_keys(case.model, cluster, case.training, case.layout,
                                             case.choices),
        "published_tokens_per_s_per_gpu": pub_tokens,
        "predicted_tflops_per_gpu": pred_tflops_conv,
        "published_tflops_per_gpu": case.published_tflops,
        "predicted_memory_gb": est.memory.peak_gb,
        "published_memory_gb": case.published_memory,
        "tokens_derived_from_tflops": derived,
        "split": split_of(case.row),
        "gpu": case.gpu,
        "family": case.family,
        "model": case.model.name,
        "precision": case.training.precision,
        "flops_convention": case.convention,
        "assumed": case.assumed,
    }


def ape(pred: float | None, pub: float | None) -> float | None:
    if pred is None or pub is None or pub == 0:
        return None
    return abs(pred - pub) / abs(pub)


def mape(rows: list[dict[str, Any]], key: str = "tokens_per_s_per_gpu") -> float | None:
    errs = [ape(r[f"predicted_{key}"], r[f"published_{key}"]) for r in rows]
    errs = [e for e in errs if e is not None]
    return sum(errs) / len(errs) if errs else None


def inside(r: dict[str, Any]) -> bool | None:
    """Whether the published tokens/s/GPU fell inside the row's predicted interval."""
    iv, pub = r.get("predicted_interval_tokens_per_s_per_gpu"), r["published_tokens_per_s_per_gpu"]
    if not iv or pub is None:
        return None
    return iv[0] <= pub <= iv[1]


def coverage(rows: list[dict[str, Any]]) -> float | None:
    """Share of rows whose published figure lies inside their 80 % interval."""
    hits = [h for h in map(inside, rows) if h is not None]
    return sum(hits) / len(hits) if hits else None


def median_width(rows: list[dict[str, Any]]) -> float | None:
    """Median of (hi − lo) / point over the rows' intervals."""
    w = sorted((r["predicted_interval_tokens_per_s_per_gpu"][1]
                - r["predicted_interval_tokens_per_s_per_gpu"][0])
               / r["predicted_tokens_per_s_per_gpu"]
               for r in rows if r.get("predicted_interval_tokens_per_s_per_gpu"))
    if not w:
        return None
    n = len(w)
    return w[n // 2] if n % 2 else (w[n // 2 - 1] + w[n // 2]) / 2


def release_group(case_row: dict[str, str], r: dict[str, Any]) -> tuple:
    """Rows whose order is a claim about layouts alone: one model, cluster, GPU count,
    precision, sequence length and software release (the source, and its release if named)."""
    rel = release_of(case_row)
    return (r["model"], case_row.get("cluster_preset") or case_row.get("gpu"),
            case_row.get("num_gpus"), r["precision"], case_row.get("seq_len"),
            case_row.get("source"), rel if rel else case_row.get("source_detail"))


def layout_pairs(rows: list[dict[str, Any]], raw: dict[str, dict[str, str]]) -> dict[str, Any]:
    """How many pairs of published layouts within one release group the model orders as
    measured (a planner lives by ranking); ties in the published figure are left out."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["published_tokens_per_s_per_gpu"]:
            groups.setdefault(release_group(raw[r["id"]], r), []).append(r)
    pairs, wrong, split = 0, [], {"fit": [0, 0], "held-out": [0, 0], "mixed": [0, 0]}
    for members in groups.values():
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                pa, pb = a["published_tokens_per_s_per_gpu"], b["published_tokens_per_s_per_gpu"]
                if pa == pb or config_key(raw[a["id"]]) == config_key(raw[b["id"]]):
                    continue  # a tie, or one layout published twice (no ordering claim)
                pairs += 1
                side = a.get("split") if a.get("split") == b.get("split") else "mixed"
                tally = split.get(side or "mixed", split["mixed"])
                tally[0] += 1
                qa, qb = a["predicted_tokens_per_s_per_gpu"], b["predicted_tokens_per_s_per_gpu"]
                if (qa - qb) * (pa - pb) <= 0:
                    wrong.append({"ids": [a["id"], b["id"]], "published": [pa, pb],
                                  "predicted": [qa, qb]})
                else:
                    tally[1] += 1
    # the fit's ranking term sees only pairs of fit rows: held-out and mixed pairs are evidence
    return {"pairs": pairs, "ordered": pairs - len(wrong),
            "share": (pairs - len(wrong)) / pairs if pairs else None, "misordered": wrong,
            "by_split": {k: {"pairs": n, "ordered": o} for k, (n, o) in split.items()}}


def skip_groups(skipped: list[dict[str, str]]) -> list[tuple[str, list[str]]]:
    """Skipped rows grouped by reason, most common first: the reason's head (before any
    `:` detail, quoted values as `…`) and the ids. `validate` prints these instead of a bare
    count, so what is not predicted, and why, reads at a glance."""
    groups: dict[str, list[str]] = {}
    for s in skipped:
        head = re.sub(r"(?<!\w)'[^']*'(?!\w)", "…", str(s["why"]).split(":", 1)[0]).strip()
        groups.setdefault(head, []).append(str(s["id"]))
    return sorted(groups.items(), key=lambda g: (-len(g[1]), g[0]))


def validate_rows(rows: list[dict[str, str]], calibration: dict[str, Any] | None = None,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Predict every predictable row; {"rows", "mape_tokens_per_s", "skipped", ...}.
    `progress(done, total)` is called before each row."""
    presets = list_presets()
    out, skipped = [], []
    for n, row in enumerate(rows):
        if progress:
            progress(n, len(rows))
        case = case_of(row, presets)
        if isinstance(case, str):
            skipped.append({"id": row.get("id") or "?", "why": case})
            continue
        try:
            out.append(predict_case(case, calibration))
        except MoeplanError as err:
            skipped.append({"id": case.id, "why": str(err)})
    held = [r for r in out if r["split"] == "held-out"]
    fit = [r for r in out if r["split"] == "fit"]
    from .cost_models.uncertainty import default_profile

    return {
        "rows": out,
        "ranking": layout_pairs(out, {r.get("id", "?"): r for r in rows}),
        "coverage": coverage(held),
        "median_interval_width": median_width(held),
        "coverage_fit": coverage(fit),
        "coverage_cross_validated": default_profile().cross_validated.get("coverage"),
        "mape_tokens_per_s": mape(out),
        "mape_tokens_per_s_held_out": mape(held),
        "mape_tokens_per_s_fit": mape(fit),
        "mape_tflops": mape(out, "tflops_per_gpu"),
        "mape_memory_gb": mape(out, "memory_gb"),
        "skipped": skipped,
    }


# DeepSeek-V3 per-GPU memory anatomy, Megatron Core MoE report: 256 GPUs, PP4 VPP4 EP64, TP1,
# ETP1, MBS1, s 4096, BF16, distributed optimizer, before memory optimisations (GB).
DEEPSEEK_V3_ANATOMY = {"weights+grads": 36.4, "optimizer": 32.1, "activations": 131.0,
                       "total": 199.5}


def anatomy_parts() -> dict[str, tuple[float, float]]:
    """{part: (moeplan GB, report GB)} for the DeepSeek-V3 anatomy, moeplan's peak GPU."""
    from .cost_models.estimate import estimate_breakdown
    from .specs import load_cluster

    m, c = load_model("deepseek-v3"), load_cluster("h100", 256)
    t = TrainingSpec(seq_len=4096, global_batch_size=1024)
    mem = estimate_breakdown(m, c, t, Layout.build(256, 1024, pp=4, vpp=4, ep=64),
                             with_interval=False).estimate.memory
    ours = {"weights+grads": mem.weights_gb + mem.grads_gb, "optimizer": mem.optimizer_gb,
            "activations": mem.activations_gb}
    ours["total"] = sum(ours.values())
    return {k: (ours[k], v) for k, v in DEEPSEEK_V3_ANATOMY.items()}
