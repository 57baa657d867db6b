"""Build megatron-core's own TransformerConfig from an exported Megatron-LM command line.

What Megatron-LM's `core_transformer_config_from_args` does (megatron/training/argument_utils.py
at the commit the export targets): every dataclass field whose name is an argparse destination
is passed through, plus its fixed translations (`num_experts` → `num_moe_experts`, `--swiglu` →
SiLU with a gated linear unit, `--fp8-param-gather` → `fp8_param`, ...); MLA models get
`MLATransformerConfig`. Its `__post_init__` then runs megatron-core's validation, the real code.

Stood in, and only these: the Transformer Engine present (its version, and the fused
permutation and RoPE kernels, which a CPU machine without TE lacks) and the GPU-only parts of
`megatron.training.arguments.validate_args` (which is not on the package index; its rules are
in moeplan's rules table, each with a test). The installed megatron-core may be older than the
commit the export targets: fields it does not have yet are dropped, and the one renamed field
(`cuda_graph_modules`, formerly `cuda_graph_scope`) is passed under the name it has, with the
whole-step graph (`--cuda-graph-impl full_iteration`, formerly the `local` implementation's
`full_iteration` scope) as it was then spelled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moeplan.planner.export import MEGATRON_FLAGS
from moeplan.specs import Plan, load_plan


def _eval_pattern(x: str) -> list[int]:
    """arguments.py::_eval_pattern: only digits and `,[]()+*`, then a Python list expression."""
    if re.search(r"[^,\d\[\]\(\)\+\*]", x):
        raise argparse.ArgumentTypeError(f"invalid pattern {x!r}")
    return eval(x)  # noqa: S307 (the same evaluation Megatron performs)


def freq_type(x: str) -> int | list[int]:
    """arguments.py::moe_freq_type."""
    return _eval_pattern(x) if "[" in x else int(x)


def tuple_type(x: str) -> tuple[int, ...]:
    """arguments.py::tuple_type."""
    return tuple(int(i) for i in x.strip("()").split(","))


CUSTOM_TYPES = {"--moe-layer-freq": freq_type, "--window-attn-skip-freq": freq_type,
                "--window-size": tuple_type}
DESTS = {"--disable-bias-linear": "add_bias_linear", "--no-rope-fusion": "apply_rope_fusion",
         "--fp8-format": "fp8", "--fp4-format": "fp4", "--norm-epsilon": "layernorm_epsilon",
         "--no-yarn-correction-range-round-to-int": "yarn_correction_range_round_to_int"}
STORE_FALSE = {"--disable-bias-linear", "--no-rope-fusion",
               "--no-yarn-correction-range-round-to-int"}
DEFAULTS = {"add_bias_linear": True, "apply_rope_fusion": True,  # Megatron's argparse defaults
            "yarn_correction_range_round_to_int": None}


def parser() -> argparse.ArgumentParser:
    """argparse with exactly the export's flag table (arities, types, choices), allow_abbrev off
    as in Megatron's parse_args, and Megatron's destinations for the renamed flags."""
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for name, f in MEGATRON_FLAGS.items():
        dest = DESTS.get(name, name[2:].replace("-", "_"))
        if f.nargs == 0:
            p.add_argument(name, dest=dest, action="store_false" if name in STORE_FALSE
                           else "store_true", default=DEFAULTS.get(dest, False))
            continue
        kw: dict = {"type": CUSTOM_TYPES.get(name, f.type or str), "dest": dest}
        if f.choices:
            kw["choices"] = list(f.choices)
        if f.nargs == "+":
            kw["nargs"] = "+"
        p.add_argument(name, **kw)
    return p


def stand_in_te_kernels() -> None:
    """The Transformer Engine the export is written for, marked present: its version
    (`rules.TE_VERSION`) and the fused kernels megatron-core looks for in it (the validation
    asks only whether they exist and how new TE is)."""
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import moe_utils
    from packaging.version import Version

    from moeplan.specs.rules import TE_VERSION

    utils._te_version = Version(TE_VERSION)

    def kernel(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a stand-in for a Transformer Engine kernel was called")

    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        setattr(moe_utils, name, kernel)
    rope_utils.fused_apply_rotary_pos_emb = kernel


def config_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """`core_transformer_config_from_args`: every field with an argparse destination of its
    name, then Megatron's fixed translations."""
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {n: getattr(args, n) for n in names if hasattr(args, n) and getattr(args, n) is not None}
    kw["num_moe_experts"] = args.num_experts
    kw["params_dtype"] = torch.bfloat16 if args.bf16 else torch.float32
    kw["pipeline_dtype"] = kw["params_dtype"]
    kw["bf16"] = args.bf16
    kw["fp8_param"] = args.fp8_param_gather
    if args.swiglu:
        kw["activation_func"], kw["gated_linear_unit"] = F.silu, True
    if args.squared_relu:
        from megatron.core.activations import squared_relu

        kw["activation_func"] = squared_relu
    kw["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    if args.multi_latent_attention:
        kw.pop("kv_channels", None)
    if args.num_virtual_stages_per_pipeline_rank:
        kw["virtual_pipeline_model_parallel_size"] = args.num_virtual_stages_per_pipeline_rank
    if args.cuda_graph_modules:  # the field's name in megatron-core before the rename
        key = "cuda_graph_modules" if "cuda_graph_modules" in names else "cuda_graph_scope"
        kw[key] = list(args.cuda_graph_modules)
    if args.cuda_graph_impl == "full_iteration" and "cuda_graph_modules" not in names:
        # before the rename, the whole-step graph was the local implementation's scope
        kw["cuda_graph_impl"], kw["cuda_graph_scope"] = "local", ["full_iteration"]
    for key in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):  # as validate_args
        if isinstance(kw.get(key), list) and len(kw[key]) == 1:
            kw[key] = kw[key][0]
    return {k: v for k, v in kw.items() if k in names}


def transformer_config(argv: Sequence[str]) -> Any:
    """megatron-core's TransformerConfig (MLATransformerConfig for MLA) of an exported command
    line; raises whatever megatron-core's validation raises."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    args = parser().parse_args(list(argv))
    cls = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    stand_in_te_kernels()
    return cls(**config_kwargs(args, cls))


def filled(argv: Sequence[str]) -> list[str]:
    """The export's argv with its placeholders filled, as the user fills them."""
    values = {"${DATA_PATH:?}": "/data/corpus_text_document", "${TOKENIZER_MODEL:?}": "/tok",
              "${CHECKPOINT_DIR:?}": "/ckpt", "${CHECKPOINT_DIR:?}/tensorboard": "/ckpt/tb"}
    return [values.get(str(a), str(a)) for a in argv]


# ------------------------------------------------------------------------ the acceptance set
EXPORT_DOC = Path(__file__).resolve().parents[1] / "docs" / "EXPORT.md"


def acceptance_commands(marker: str) -> list[list[str]]:
    """The `moeplan ...` command lines of the fenced block after `<!-- marker -->` in
    docs/EXPORT.md (the page is the one list the test and the benchmark read)."""
    text = EXPORT_DOC.read_text()
    block = text.split(f"<!-- {marker} -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line)[1:] for line in block.strip().splitlines()]


def acceptance_plans(tmp: Path) -> list[tuple[str, Plan]]:
    """(label, plan) for the top three plans of every acceptance search and every hand layout,
    made by the `moeplan` command as a user runs it."""
    out: list[tuple[str, Plan]] = []
    for argv in acceptance_commands("acceptance-searches"):
        doc = _moeplan(*argv, "--json")
        label = " ".join(argv[1:9])
        out += [(f"{label} #{i + 1}", Plan.model_validate(p))
                for i, p in enumerate(doc["plans"][:3])]
    for k, argv in enumerate(acceptance_commands("acceptance-layouts")):
        path = tmp / f"layout{k}.json"
        _moeplan(*argv, "-o", str(path), "--json")
        out.append((" ".join(argv[1:]), load_plan(path)))
    return out


def _moeplan(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "moeplan", *args], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (args, proc.stderr[-3000:])
    return json.loads(proc.stdout)


def parsed_values(plan: Plan) -> dict[str, object]:
    """What Megatron must parse back from the plan's export, by the names the checks use."""
    L, m = plan.layout, plan.model
    recompute, offload = plan.choices.for_rank(0)
    return {"tp": L.tp, "pp": L.pp, "cp": L.cp, "ep": L.ep if m.is_moe else 1,
            "etp": L.etp if m.is_moe else None, "vpp": L.vpp, "dp": L.dp, "mbs": L.mbs,
            "gbs": plan.training.global_batch_size, "num_microbatches": L.num_microbatches,
            "num_layers": m.num_layers, "mtp_num_layers": m.mtp_layers or None,
            "recompute_granularity": ("full" if recompute == ["full"] else
                                      "selective" if recompute else None),
            "recompute_modules": sorted(recompute) if recompute and recompute != ["full"]
            else None,
            "offload_modules": sorted(offload) or None}
