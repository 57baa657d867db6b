"""Megatron-Bridge performance recipes: the settings behind the rows NVIDIA publishes.

Megatron-Bridge's performance summary prints each run's sizes (GPUs, global batch, micro-batch,
TP/PP/VPP/EP) but not its stack settings: the token dispatcher, EP communication overlap, CUDA
graphs, recomputed modules. Those live in the recipe that produced the row,
`scripts/performance/configs/<family>/<family>_workload_base_configs.py` (a `WorkloadBaseConfig`
per model, GPU, precision and variant). A row whose printed sizes equal one of those recipes'
ran it, so `validation` prices that row with the recipe's settings instead of moeplan's defaults.

Only what moeplan prices is carried over, named as in `Layout` and `Choices`:
  dispatcher   "flex" where the recipe sets `moe_flex_dispatcher_backend` (HybridEP or DeepEP,
               which the flex token dispatcher runs), else Megatron's "alltoall"
  ep_overlap   `moe_a2a_overlap`
  cuda_graphs  `cuda_graph_impl` "full_iteration", or "transformer_engine" with a scope that
               captures the attention block (`Layout.cuda_graphs` prices that scope); a scope of
               the router alone is left uncaptured, as moeplan prices no such partial scope
  recompute    `recompute_modules` (Megatron's names are moeplan's)
  stage_layout the pipeline layout DeepSeek-V3's and Kimi-K2's recipes set (`PIPELINE_LAYOUTS`),
               which holds for every row of a release that ran it, matched to a table recipe
               or not
The sizes are the recipe's after its `replace(...)` chain is resolved; an unset `num_gpus`,
`micro_batch_size` or parallel size is the `WorkloadBaseConfig` default the recipe inherits
(TP/PP/VPP 1). Precision names: BF16 "bf16", FP8_CS "fp8-tensorwise", FP8_SC (sub-channel)
"fp8-blockwise", FP8_MX "mxfp8", NVFP4 "nvfp4".

One revision of each file was read; a recipe whose sizes changed between releases matches only
the rows of the releases that ran those sizes, which is why the match is on every printed size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SOURCE = "NVIDIA Megatron-Bridge performance summary"


@dataclass(frozen=True)
class Recipe:
    """One Megatron-Bridge workload base config, reduced to what a published row can be matched
    on (`sizes`) and what moeplan prices (`settings`, `recompute`)."""

    name: str                       # the config constant's name in the recipe file
    model: str                      # moeplan model preset
    gpu: str                        # the published row's `gpu` cell
    precisions: tuple[str, ...]     # moeplan precision presets the recipe name covers
    gpus: int
    gbs: int
    mbs: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    settings: dict[str, Any] = field(default_factory=dict)
    recompute: tuple[str, ...] = ()
    since: tuple[int, int] | None = None  # first release (year, month) whose rows ran it

    def sizes(self) -> tuple[int, ...]:
        return (self.gpus, self.gbs, self.mbs, self.tp, self.pp, self.vpp, self.cp, self.ep)


_FLEX = {"dispatcher": "flex"}
_FLEX_GRAPHS = {"dispatcher": "flex", "cuda_graphs": True}
_FLEX_OVERLAP_GRAPHS = {"dispatcher": "flex", "ep_overlap": True, "cuda_graphs": True}
_FP8 = ("fp8-tensorwise", "fp8-blockwise")

# Megatron-Bridge's MXFP8 MoE recipes took EP overlap, full-iteration CUDA graphs and the fused
# CuTe-DSL grouped MLP in the 26.06 release (Megatron-Bridge issue #2885, "delayed to 26.06"); where
# such a recipe kept the sizes of its earlier revision, only rows from that release on ran it.
MXFP8_OVERLAP_FROM = (26, 6)

DEEPSEEK = "scripts/performance/configs/deepseek/deepseek_workload_base_configs.py"
QWEN3 = "scripts/performance/configs/qwen/qwen3_workload_base_configs.py"
GPT_OSS = "scripts/performance/configs/gpt_oss/gpt_oss_workload_base_configs.py"
KIMI = "scripts/performance/configs/kimi/kimi_workload_base_configs.py"

RECIPES: tuple[Recipe, ...] = (
    # DeepSeek-V3 (DEEPSEEK): every variant dispatches through HybridEP or DeepEP
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_GB300_FP8_MX_V2", "deepseek-v3", "GB300", ("mxfp8",),
           256, 4096, 1, pp=2, vpp=8, ep=32, settings=_FLEX_OVERLAP_GRAPHS),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_GB300_FP8_MX_GBS15360", "deepseek-v3", "GB300",
           ("mxfp8",), 256, 15360, 1, pp=2, vpp=8, ep=32, settings=_FLEX_OVERLAP_GRAPHS),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_GB300_FP8_CS_V2", "deepseek-v3", "GB300", _FP8,
           256, 4096, 2, pp=2, vpp=8, ep=32, settings=_FLEX, recompute=("mla_up_proj",)),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_GB300_BF16_V2", "deepseek-v3", "GB300", ("bf16",),
           256, 4096, 1, pp=4, vpp=4, ep=64, settings=_FLEX_GRAPHS, recompute=("moe_act",)),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_FP8_MX_V2", "deepseek-v3", "GB200", ("mxfp8",),
           256, 4096, 1, pp=4, vpp=4, ep=64, settings=_FLEX_OVERLAP_GRAPHS,
           recompute=("mla_up_proj",), since=MXFP8_OVERLAP_FROM),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_FP8_CS_V2", "deepseek-v3", "GB200", _FP8,
           256, 4096, 1, pp=4, vpp=4, ep=64, settings=_FLEX_GRAPHS, recompute=("mlp",)),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_BF16_V2", "deepseek-v3", "GB200", ("bf16",),
           256, 4096, 1, pp=4, vpp=4, ep=64, settings=_FLEX_GRAPHS,
           recompute=("mla_up_proj",)),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_B300_FP8_MX_V2", "deepseek-v3", "B300", ("mxfp8",),
           256, 4096, 1, pp=8, vpp=2, ep=8, settings=_FLEX_OVERLAP_GRAPHS,
           recompute=("mla_up_proj",)),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_B200_V2", "deepseek-v3", "B200", ("bf16",) + _FP8,
           256, 4096, 1, pp=16, ep=8, settings=_FLEX, recompute=("mla_up_proj",)),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_B200_FP8_MX_V2", "deepseek-v3", "B200", ("mxfp8",),
           256, 4096, 1, pp=8, vpp=2, ep=32, settings=_FLEX_OVERLAP_GRAPHS,
           recompute=("mla_up_proj", "mlp")),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_H100_V1", "deepseek-v3", "H100-SXM", ("bf16",) + _FP8,
           1024, 8192, 1, tp=2, pp=8, vpp=4, ep=64, settings=_FLEX,
           recompute=("mla_up_proj", "mlp")),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_H100_V2", "deepseek-v3", "H100-SXM",
           ("bf16", "fp8-tensorwise"), 1024, 16384, 1, tp=2, pp=8, vpp=4, ep=64, settings=_FLEX,
           recompute=("mla_up_proj", "mlp")),
    Recipe("DEEPSEEK_V3_PRETRAIN_CONFIG_H100_FP8_SC_V2", "deepseek-v3", "H100-SXM",
           ("fp8-blockwise",), 1024, 16384, 1, tp=2, pp=8, vpp=2, ep=64, settings=_FLEX,
           recompute=("mla_up_proj", "mlp")),
    # Qwen3-235B-A22B (QWEN3)
    Recipe("QWEN3_235B_A22B_PRETRAIN_CONFIG_GB300_FP8_MX_V2", "qwen3-235b-a22b", "GB300",
           ("mxfp8",), 256, 8192, 2, pp=4, vpp=12, ep=32, settings=_FLEX_GRAPHS),
    Recipe("QWEN3_235B_A22B_PRETRAIN_CONFIG_GB300_BF16_V2", "qwen3-235b-a22b", "GB300",
           ("bf16",) + _FP8, 256, 8192, 2, pp=4, ep=32, settings=_FLEX_GRAPHS),
    Recipe("QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_FP8_MX_V2", "qwen3-235b-a22b", "GB200",
           ("mxfp8",), 256, 8192, 1, pp=8, vpp=3, ep=32, settings=_FLEX_GRAPHS),
    Recipe("QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_FP8_CS_V2", "qwen3-235b-a22b", "GB200", _FP8,
           256, 8192, 1, pp=8, ep=32, settings=_FLEX_GRAPHS),
    Recipe("QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_BF16_V2", "qwen3-235b-a22b", "GB200",
           ("bf16",), 256, 8192, 1, pp=8, ep=8, settings=_FLEX_GRAPHS),
    Recipe("QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_V1", "qwen3-235b-a22b", "H100-SXM",
           ("bf16",) + _FP8, 256, 2048, 1, tp=2, pp=8, vpp=4, ep=32,
           settings={"ep_overlap": True}),
    Recipe("QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_V2", "qwen3-235b-a22b", "H100-SXM",
           ("bf16",) + _FP8, 256, 8192, 1, tp=2, pp=8, vpp=4, ep=32,
           settings={"ep_overlap": True}),
    # Qwen3-30B-A3B (QWEN3): single-node recipes, the router-only graph scope left uncaptured
    Recipe("QWEN3_30B_A3B_PRETRAIN_CONFIG_GB200_BF16_V1", "qwen3-30b-a3b", "GB200",
           ("bf16",) + _FP8, 8, 512, 4, ep=8, settings=_FLEX_GRAPHS),
    Recipe("QWEN3_30B_A3B_PRETRAIN_CONFIG_B200_V1", "qwen3-30b-a3b", "B200",
           ("bf16", "mxfp8") + _FP8, 8, 512, 4, ep=8, settings=_FLEX_GRAPHS),
    Recipe("QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_V1", "qwen3-30b-a3b", "H100-SXM",
           ("bf16",) + _FP8, 16, 1024, 1, ep=16, settings=_FLEX),
    # gpt-oss-120b (GPT_OSS; base: 64 GPUs, EP 8, micro-batch 1)
    Recipe("GPT_OSS_120B_PRETRAIN_CONFIG_GB300_BF16_V2", "gpt-oss-120b", "GB300", ("bf16",),
           64, 1280, 4, ep=64, settings={"cuda_graphs": True}),
    Recipe("GPT_OSS_120B_PRETRAIN_CONFIG_GB200_BF16_V2", "gpt-oss-120b", "GB200", ("bf16",),
           64, 1280, 4, ep=64, settings={"ep_overlap": True},
           recompute=("layernorm", "moe_act")),
    Recipe("GPT_OSS_120B_PRETRAIN_CONFIG_B300_BF16_V2", "gpt-oss-120b", "B300", ("bf16",),
           64, 1280, 4, ep=8, settings=_FLEX_GRAPHS),
    Recipe("GPT_OSS_120B_PRETRAIN_CONFIG_B200_BF16_V2", "gpt-oss-120b", "B200",
           ("bf16", "mxfp8"), 64, 1280, 4, ep=8, recompute=("layernorm", "moe_act")),
    Recipe("GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2", "gpt-oss-120b", "H100-SXM",
           ("bf16",) + _FP8, 64, 1280, 1, pp=4, ep=8, recompute=("layernorm", "moe_act")),
    Recipe("GPT_OSS_120B_PRETRAIN_CONFIG_GB300_FP8_MX_V2", "gpt-oss-120b", "GB300", ("mxfp8",),
           64, 1280, 4, ep=16, settings=_FLEX_OVERLAP_GRAPHS),
    Recipe("GPT_OSS_120B_PRETRAIN_CONFIG_GB200_FP8_MX_V2", "gpt-oss-120b", "GB200", ("mxfp8",),
           64, 1280, 4, ep=64, settings=_FLEX_OVERLAP_GRAPHS),
    # Kimi-K2 (KIMI): the MXFP8 variant moved to MBS 1 with EP overlap and full-iteration
    # graphs; the others keep MBS 2 (GB300) and HybridEP without overlap
    Recipe("KIMI_K2_PRETRAIN_CONFIG_GB300_FP8_MX", "kimi-k2", "GB300", ("mxfp8",),
           256, 4096, 1, pp=4, vpp=4, ep=64, settings=_FLEX_OVERLAP_GRAPHS,
           since=MXFP8_OVERLAP_FROM),
    Recipe("KIMI_K2_PRETRAIN_CONFIG_GB300", "kimi-k2", "GB300", ("bf16", "nvfp4") + _FP8,
           256, 4096, 2, pp=4, vpp=4, ep=64, settings=_FLEX, recompute=("mla_up_proj",)),
    Recipe("KIMI_K2_PRETRAIN_CONFIG_GB200", "kimi-k2", "GB200", ("bf16", "mxfp8") + _FP8,
           256, 2048, 1, pp=4, vpp=4, ep=64, settings=_FLEX, recompute=("mla_up_proj",)),
    Recipe("KIMI_K2_PRETRAIN_CONFIG_B300", "kimi-k2", "B300", ("bf16", "mxfp8") + _FP8,
           256, 4096, 2, pp=16, ep=16, recompute=("mla_up_proj",)),
    Recipe("KIMI_K2_PRETRAIN_CONFIG_B200", "kimi-k2", "B200", ("bf16", "mxfp8") + _FP8,
           256, 2048, 1, pp=16, ep=16, recompute=("mla_up_proj",)),
    Recipe("KIMI_K2_PRETRAIN_CONFIG_H100", "kimi-k2", "H100-SXM", ("bf16",) + _FP8,
           1024, 8192, 1, tp=8, pp=16, vpp=2, ep=64, recompute=("mla_up_proj", "mlp")),
)
"""Each family's recipes, read from the file its comment names (Megatron-Bridge repository)."""

# DeepSeek-V3's and Kimi-K2's pipeline layouts by (PP, VPP), in moeplan's stage-layout syntax
# with the MTP layers left as "{m}" (Kimi-K2 has none): Megatron-Bridge's
# `set_deepseek_v3_pipeline_model_parallel_layout` (src/megatron/bridge/recipes/deepseek/
# deepseek_v3.py, the same map from v0.2.0, release 25.11, through v0.6.0) and Kimi-K2's
# `_get_kimi_k2_pipeline_layout` (recipes/kimi/kimi_k2.py, from v0.3.0, 26.02), whose last stage
# holds one decoder layer, the MTP layers and the loss (no MTP where a row ran without it); the
# DeepSeek-V3 GB300 base config's `pp_layout` and Kimi-K2's map for PP 2 × VPP 8
# (scripts/performance/configs/deepseek/deepseek_workload_base_configs.py, from v0.3.0, 26.02).
# The H100 base config's for PP 8 × VPP 4 (one decoder layer beside the embedding, the MTP with
# the loss alone) is moeplan's own default split and needs no entry. The 25.09 rows are left
# out: that release's run script passed a 32-stage layout whatever PP and VPP it printed, so
# what its 16-stage rows ran is not known.
PIPELINE_LAYOUTS: dict[tuple[int, int], str] = {
    (4, 1): "Et*16|t*16|t*16|t*13{m}L",
    (8, 1): "Et*8|(t*8|)*6,t*5{m}L",
    (4, 2): "Et*8|(t*8|)*6,t*5{m}L",
    (16, 1): "Et*4|(t*4|)*14,t{m}L",
    (8, 2): "Et*4|(t*4|)*14,t{m}L",
    (4, 4): "Et*4|(t*4|)*14,t{m}L",
    (2, 8): "Et*4|(t*4|)*14,t{m}L",
}
LAYOUTS_FROM = {"deepseek-v3": (25, 11), "kimi-k2": (26, 2)}  # first release that ran the map
PP2_VPP8_FROM = (26, 2)


RECIPE_FILES = {"deepseek-v3": DEEPSEEK, "qwen3-235b-a22b": QWEN3, "qwen3-30b-a3b": QWEN3,
                "gpt-oss-120b": GPT_OSS, "kimi-k2": KIMI}


def _known(release: tuple[int, int] | None, model: str, gpu: str, precision: str
           ) -> list[Recipe]:
    """The table's recipes for a model, GPU and precision that a release had reached."""
    return [r for r in RECIPES if r.model == model and r.gpu == gpu
            and precision in r.precisions
            and (r.since is None or (release is not None and release >= r.since))]


def recipe_for(source: str, release: tuple[int, int] | None, model: str, gpu: str,
               precision: str, sizes: tuple[int, ...]) -> Recipe | None:
    """The recipe a Megatron-Bridge row ran: same model, GPU and precision, every printed size
    (GPUs, global batch, micro-batch, TP, PP, VPP, CP, EP) equal, and a release the recipe had
    reached. None for any other row."""
    if not source.startswith(SOURCE):
        return None
    return next((r for r in _known(release, model, gpu, precision) if r.sizes() == sizes), None)


def contradicts(source: str, release: tuple[int, int] | None, model: str, gpu: str,
                precision: str, sizes: tuple[int, ...]) -> bool:
    """Whether a Megatron-Bridge row's printed sizes contradict the recipe the table has for its
    model, GPU and precision at its release: that row ran another revision of the recipe, so
    no revision's unprinted settings may be assumed for it."""
    known = _known(release, model, gpu, precision) if source.startswith(SOURCE) else []
    return bool(known) and all(r.sizes() != sizes for r in known)


def recipe_stage_layout(source: str, release: tuple[int, int] | None, model: str, pp: int,
                        vpp: int, mtp_layers: int) -> str | None:
    """The pipeline layout a Megatron-Bridge DeepSeek-V3 or Kimi-K2 row ran (`PIPELINE_LAYOUTS`),
    as moeplan's `--stage-layout` text; None where the recipe left Megatron's default split or
    the release is not known to have run the map. Its stage weights move the step time by up to
    a fifth at PP 16, where one stage sets the pace."""
    since = LAYOUTS_FROM.get(model)
    if (not source.startswith(SOURCE) or since is None or release is None or release < since
            or ((pp, vpp) == (2, 8) and release < PP2_VPP8_FROM)):
        return None
    text = PIPELINE_LAYOUTS.get((pp, vpp))
    return text.replace("{m}", "m" * mtp_layers) if text else None
