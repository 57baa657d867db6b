"""Published rows as cases: the specs, layout and settings each row maps to, or why not.

A row is predicted when its `model_preset` and `cluster_preset` are known (or its `model`
names a preset, or spells out a GPT's dimensions) and its layout is complete; otherwise it is
listed under `skipped` with the reason. Rows that use Megatron-FSDP/FSDP/ZeRO-3 instead of the
distributed optimizer, and fine-tuning rows, are skipped: the cost models price Megatron's
distributed optimizer and pretraining only. Settings a row does not print come from its
source's documented rules (`rules`) and from the Megatron-Bridge recipe whose sizes it matches
(`recipes`).

The fit/held-out split is fixed by `split_of(row)`: a row belongs to the fit set when the CRC32
of its configuration key (model, GPU, precision, layout, sequence, batch) is even. Keying on the
configuration rather than the id keeps re-publications of one configuration (Megatron-Bridge
releases) on the same side, so no held-out row has a fitted twin. Cross-validation
(`crossval`) groups rows by model or by release instead.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ..cost_models.uncertainty import model_family
from ..errors import LayoutError, MoeplanError, SpecError
from ..specs import (
    OFFLOAD_MODULES,
    RECOMPUTE_MODULES,
    Choices,
    Layout,
    TrainingSpec,
    load_cluster,
    load_model,
)
from ..specs.cluster import ClusterSpec
from ..specs.model import ModelSpec
from ..specs.rules import shards_optimizer
from ..specs.validated import format_validation_error
from .recipes import Recipe, contradicts, recipe_for, recipe_stage_layout
from .rows import number, release_of, size
from .rules import (
    documented_settings,
    recipe_settings,
    stack_settings,
    token_drop_settings,
    training_settings,
)

FSDP_PAT = re.compile(r"megatron-fsdp|fsdp2|fsdp only|zero-3|method=fsdp|fsdp degree", re.I)
FSDP_SIZE = re.compile(r"FSDP=(\d+)")
FINETUNE_PAT = re.compile(r"task=(sft|lora)", re.I)
# a row whose layout its source tuned ("optimal config per method", a config "fixed to the
# Table 3 optimum"): a size it leaves unpublished is the one that tuning found
TUNED_PAT = re.compile(r"optimal config|\boptimum\b", re.I)


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
    cluster: ClusterSpec | None = None  # the cluster at the row's GPU count, loaded once
    # the other layouts the row may have run (`tuned_vpp`): a tuned row that leaves its virtual
    # pipeline size unpublished ran the fastest of these and `layout` that fits, whichever profile
    # prices it
    alternatives: tuple[Layout, ...] = ()

    def layouts(self) -> tuple[Layout, ...]:
        """The published layout first, then the alternatives."""
        return (self.layout, *self.alternatives)


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
    "Mixtral-8x22B-G8T8": "mixtral-8x22b-g8t8",  # its notes: 64 experts, top-8
    "Llama3-8x70B": "llama3-8x70b",  # its notes: Llama3-70B upcycled to 8 experts
}


def model_preset_of(row: dict[str, str]) -> str:
    """The row's model preset: its `model_preset` cell, else the preset its `model` names
    (MODEL_NAME_PRESETS), else empty."""
    mp = (row.get("model_preset") or "").strip()
    return mp or MODEL_NAME_PRESETS.get((row.get("model") or "").strip(), "")


def family_of(model_preset: str) -> str:
    """A preset's model family (`uncertainty.model_family`: "qwen3", "gpt-oss", ...)."""
    return model_family(model_preset)


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


STAGE_LAYOUT_PAT = re.compile(r"\blayout ([Etm|L()*0-9,]*\|[Etm|L()*0-9,]*)")
OFFLOAD_PAT = re.compile(r"activation offload: ([a-z0-9_ ]+)")


RECOMPUTE_WORDS = {"norm": "layernorm", "act": "moe_act", "shared_expert": "shared_experts"}
"""Selective-recompute modules as Megatron-MoE-ModelZoo's tables name them (its recompute
column "norm, act" is `--recompute-modules layernorm moe_act`): a recompute cell that names
modules, in these words or Megatron's own, documents selective recompute of those modules."""


def published_recompute(row: dict[str, str]) -> Choices:
    """The recompute, activation offload and stage layout a row documents: full recomputation
    (Megatron's `--recompute-granularity full`); the selective modules it names in Megatron's
    words (`selective: mla_up_proj mlp`) or in RECOMPUTE_WORDS (`norm, act`), or selective
    alone (Megatron's default module, core attention); the modules its notes offload
    (`activation offload: expert_fc1`); the `--pipeline-model-parallel-layout` its notes print
    (`layout Et*4|(tttt|)*14tmL`)."""
    text = (row.get("recompute") or "").lower()
    notes = row.get("other_notes") or ""
    picked: dict[str, Any] = {}
    named = [m for m in RECOMPUTE_MODULES if m != "full" and re.search(rf"\b{m}\b", text)]
    named += [m for word, m in RECOMPUTE_WORDS.items()
              if re.search(rf"\b{word}\b", text) and m not in named]
    if "full" in text:
        picked["recompute"] = ["full"]
    elif "selective" in text or named:
        picked["recompute"] = named or ["core_attn"]
    off = OFFLOAD_PAT.search(notes.lower())
    if off:
        picked["offload"] = [m for m in OFFLOAD_MODULES if m in off.group(1).split()]
    layout = STAGE_LAYOUT_PAT.search(notes)
    if layout:
        picked["stage_layout"] = layout.group(1)
    return Choices(**picked)


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
    fsdp = FSDP_SIZE.search(notes)  # Megatron-Bridge tables: FSDP=0 means DDP + dist. optimizer
    if (int(fsdp.group(1)) > 0) if fsdp else bool(FSDP_PAT.search(notes)):
        return "uses (Megatron-)FSDP/ZeRO-3 instead of the distributed optimizer; not modelled"
    if "known issue" in notes.lower() or "regression" in notes.lower():
        return "source flags a known performance regression"
    gpus, seq, gbs = size(row, "num_gpus"), size(row, "seq_len"), size(row, "global_batch_seqs")
    tp, pp = size(row, "tp"), size(row, "pp")
    if not gpus or not seq or not gbs:
        return "GPU count, sequence length or global batch not published"
    if tp is None or pp is None:
        return "tensor/pipeline parallel sizes not published"
    prec = (row.get("precision_preset") or "").strip() or "bf16"
    tokens, tflops = number(row, "tokens_per_s_per_gpu"), number(row, "tflops_per_gpu")
    mfu = number(row, "mfu")
    if tokens is None and tflops is None and mfu is None:
        return "no throughput published"
    model = described or load_model(mp)
    if "w/o mtp" in notes.lower() and model.mtp_layers:
        model = model.model_copy(update={"mtp_layers": 0})
    cluster = load_cluster(cp_, gpus)
    if tflops is None and mfu is not None:
        tflops = mfu * cluster.bf16_tflops
    axes = {"tp": tp, "pp": pp, "cp": size(row, "cp", 1), "ep": size(row, "ep", 1),
            "vpp": size(row, "vpp", 1), "mbs": size(row, "micro_batch", 1)}
    etp = size(row, "etp")
    try:
        numerics = training_settings(row)
        training = TrainingSpec(seq_len=seq, global_batch_size=gbs, precision=prec, **numerics)
    except ValidationError as err:  # one line per field, as every spec error reads
        return format_validation_error(err, "training settings", f"row {row.get('id', '?')}",
                                       file_hint=False)
    except SpecError as err:
        return f"training settings invalid: {err}"
    layout: Layout | None = None
    assumed: dict[str, Any] = {}
    why = ""
    from ..specs import layout_violations

    cp, ep, vpp, mbs = axes["cp"], axes["ep"], axes["vpp"], axes["mbs"]
    where = (row.get("source", "") or "", release_of(row), mp, (row.get("gpu") or "").strip(),
             prec, (gpus, gbs, mbs, tp, pp, vpp, cp, ep))
    bridge = recipe_for(*where)
    # the release rule documents a later recipe revision than the table: it wins where both
    # speak, and is silent where the row's sizes contradict the table's recipe for that release
    rule = {} if contradicts(*where) else recipe_settings(row, model, prec, cluster.architecture)
    # and what the row's own text documents wins over both
    recipe = {**(bridge.settings if bridge else {}), **rule,
              **token_drop_settings(row, mp, prec), **documented_settings(row)}
    choices = published_recompute(row)
    if bridge and bridge.recompute and not choices.recompute:
        choices = Choices(recompute=list(bridge.recompute))
    staged = recipe_stage_layout(where[0], where[1], mp, pp, vpp, model.mtp_layers)
    if staged and not choices.stage_layout:
        choices = choices.model_copy(update={"stage_layout": staged})
    # a documented setting the published layout cannot take (Megatron's EP overlap needs
    # virtual pipeline stages when pp > 1) was not in that run's recipe
    # an unpublished etp is 1, or TP where the source's Megatron predates Parallel Folding (the
    # folding paper's "MCore" baseline: expert TP follows attention TP)
    unfolded = "method=mcore" in notes.lower() and "folding" not in notes.lower()
    etps = [etp] if etp else ([tp, 1] if unfolded else [1, tp])
    stack = stack_settings(row, tp, mp, prec)
    if not shards_optimizer(training.software_stack):  # Megatron-LM before June 2022
        stack["distributed_optimizer"] = False
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
    alternatives = tuned_vpp(row, model, training, layout, gpus, choices, cluster)
    if alternatives:
        assumed = {**assumed, "vpp": "unpublished in a tuned layout: the fastest of "
                   + ", ".join(str(v.vpp) for v in (layout, *alternatives))}
    return RunCase(str(row.get("id") or "?"), model, cp_, training, layout, tokens, tflops,
                   number(row, "memory_gb"),
                   (row.get("flops_convention") or "unknown").strip(), row.get("gpu", ""),
                   family_of(mp) if not described else "gpt-dense", row,
                   {**assumed, **numerics, **assumed_cluster, **_recipe_note(bridge, choices),
                    **({"stage_layout": staged} if staged and choices.stage_layout == staged
                       else {})},
                   choices, cluster, alternatives)


def tuned_vpp(row: dict[str, str], model: ModelSpec, training: TrainingSpec, layout: Layout,
              gpus: int, choices: Choices, cluster: ClusterSpec) -> tuple[Layout, ...]:
    """The interleaved layouts a tuned row may have run: where the row's source says it tuned
    the layout (TUNED_PAT) and prints no virtual pipeline size for a pipeline of two or more
    stages, every other size Megatron accepts (a divisor of the layers per stage; Megatron Core's
    MoE guide: "Enable Virtual Pipeline Parallelism to reduce pipeline bubbles when PP ≥ 2").

    The row ran the fastest of them that fits in memory, and which is fastest depends on the
    profile pricing it, so each prediction takes the fastest under its own profile
    (`scoring.priced_layout`): a cross-validation fold never picks a size with a profile that
    saw the row. Empty otherwise.
    """
    from ..specs import layout_violations

    if (size(row, "vpp") is not None or layout.pp < 2
            or not TUNED_PAT.search(row.get("other_notes", "") or "")):
        return ()
    per_stage = model.num_layers // layout.pp
    out = []
    for v in range(2, per_stage + 1):
        if per_stage % v:
            continue
        try:
            alt = Layout.model_validate({**layout.model_dump(exclude=set(
                Layout.model_computed_fields)), "vpp": v})
        except (LayoutError, MoeplanError, ValueError):
            continue
        if not layout_violations(model, training, alt, gpus, choices, cluster):
            out.append(alt)
    return tuple(out)


def _recipe_note(bridge: Recipe | None, choices: Choices) -> dict[str, Any]:
    """What `assumed` records of a matched Megatron-Bridge recipe: its name and the recompute it
    set (the layout settings it set are recorded with the layout's)."""
    if bridge is None:
        return {}
    note: dict[str, Any] = {"recipe": bridge.name}
    recompute = choices.for_rank(0)[0]
    if recompute and list(bridge.recompute) == recompute:
        note["recompute"] = recompute
    return note


