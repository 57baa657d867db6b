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
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import LayoutError, MoeplanError, SpecError
from .specs import Layout, TrainingSpec, list_presets, load_cluster, load_model
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


def _num(v: str | None) -> float | None:
    v = (v or "").strip()
    if not v:
        return None
    try:
        return float(v)
    except ValueError:
        return None


def _int(row: dict[str, str], col: str, default: int | None = None) -> int | None:
    v = _num(row.get(col))
    return default if v is None else int(v)


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


def config_key(row: dict[str, str]) -> str:
    cols = ("model_preset", "cluster_preset", "precision_preset", "seq_len", "global_batch_seqs",
            "micro_batch", "tp", "pp", "vpp", "cp", "ep", "etp", "num_gpus")
    return "|".join((row.get(c) or "").strip() for c in cols)


def split_of(row: dict[str, str]) -> str:
    """'fit' or 'held-out', deterministic in the row's configuration."""
    return "fit" if zlib.crc32(config_key(row).encode()) % 2 == 0 else "held-out"


def family_of(model_preset: str) -> str:
    return re.split(r"-\d|-v\d|-a\d|-\d+x", model_preset)[0].split("-")[0]


def read_rows(path: str | Path) -> list[dict[str, str]]:
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"{path} is not a readable CSV file. Pass a file shaped like "
                        "published_runs.csv.")
    with p.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and "id" not in rows[0]:
        raise SpecError(f"{path}: no `id` column; the CSV must have the columns of "
                        "published_runs.csv (id, model_preset, cluster_preset, tp, pp, ...).")
    return rows


def case_of(row: dict[str, str], presets: dict[str, list[str]]) -> RunCase | str:
    """The RunCase for a row, or the reason it cannot be predicted."""
    notes = row.get("other_notes", "") or ""
    mp, cp_ = (row.get("model_preset") or "").strip(), (row.get("cluster_preset") or "").strip()
    if not mp or mp not in presets["models"]:
        return f"model preset {mp!r} unknown" if mp else "no model preset"
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
    tokens, tflops = _num(row.get("tokens_per_s_per_gpu")), _num(row.get("tflops_per_gpu"))
    mfu = _num(row.get("mfu"))
    if tokens is None and tflops is None and mfu is None:
        return "no throughput published"
    model = load_model(mp)
    if "w/o mtp" in notes.lower() and model.mtp_layers:
        model = model.model_copy(update={"mtp_layers": 0})
    cluster = load_cluster(cp_, gpus)
    if tflops is None and mfu is not None:
        tflops = mfu * cluster.bf16_tflops
    axes = {"tp": tp, "pp": pp, "cp": _int(row, "cp", 1), "ep": _int(row, "ep", 1),
            "vpp": _int(row, "vpp", 1), "mbs": _int(row, "micro_batch", 1)}
    etp = _int(row, "etp")
    try:
        training = TrainingSpec(seq_len=seq, global_batch_size=gbs, precision=prec)
    except Exception as err:  # pydantic ValidationError
        return f"training settings invalid: {err}"
    layout: Layout | None = None
    assumed: dict[str, Any] = {}
    why = ""
    from .specs import layout_violations

    recipe = recipe_settings(row, model, prec, cluster.architecture)
    # a documented setting the published layout cannot take (Megatron's EP overlap needs
    # virtual pipeline stages when pp > 1) was not in that run's recipe
    candidates = [(c, r) for c in ([etp] if etp else [1, tp]) for r in ([recipe, {}] if recipe
                                                                          else [{}])]
    for cand, extra in candidates:
        try:
            lay = Layout.build(gpus, gbs, etp=cand, **axes, **extra)
        except (LayoutError, MoeplanError) as err:
            why = str(err)
            continue
        v = layout_violations(model, training, lay, gpus, None, cluster)
        if not v:
            layout, assumed = lay, extra
            break
        why = "; ".join(f"[{r}] {w}" for r, w in v)
    if layout is None:
        return f"layout as published breaks a rule: {why}"
    return RunCase(row["id"], model, cp_, training, layout, tokens, tflops,
                   _num(row.get("memory_gb")),
                   (row.get("flops_convention") or "unknown").strip(), row.get("gpu", ""),
                   family_of(mp), row, assumed)


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
    est = estimate(case.model, cluster, case.training, case.layout, calibration=calibration)
    fpt_ours = case.model.flops_per_token(case.training.seq_len)
    fpt_conv = flops_per_token_in(case.model, case.training.seq_len, case.convention)
    pred_tflops_conv = (est.tflops_per_gpu * fpt_conv / fpt_ours) if fpt_conv else None
    pub_tokens = case.published_tokens
    derived = False
    if pub_tokens is None and case.published_tflops is not None and fpt_conv:
        pub_tokens = case.published_tflops * 1e12 / fpt_conv
        derived = True
    from .cost_models import uncertainty as U
    from .specs import Choices

    iv = est.interval
    return {
        "id": case.id,
        "predicted_tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
        "predicted_interval_tokens_per_s_per_gpu": list(iv.tokens_per_s_per_gpu) if iv else None,
        "pessimistic_tokens_per_s_per_gpu": iv.pessimistic_tokens_per_s_per_gpu if iv else None,
        "regimes": U.regime_keys(case.model, cluster, case.training.precision, case.layout),
        "assumption_keys": U.assumption_keys(case.model, cluster, case.training, case.layout,
                                             Choices()),
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


def validate_rows(rows: list[dict[str, str]], calibration: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """Predict every predictable row; {"rows", "mape_tokens_per_s", "skipped", ...}."""
    presets = list_presets()
    out, skipped = [], []
    for row in rows:
        case = case_of(row, presets)
        if isinstance(case, str):
            skipped.append({"id": row.get("id", "?"), "why": case})
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
