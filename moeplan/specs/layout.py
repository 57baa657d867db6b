"""Layout (parallel degrees and schedule) and Choices (memory decisions).

What each executor accepts is one table, `rules.py`, in specs because the cost models, the
planner and the runtime must agree on what a valid plan is: each rule has a name that appears in
errors and in the planner's pruning counts, and its source.
"""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    computed_field,
    model_validator,
)

from ..errors import LayoutError
from ..limits import MAX_GLOBAL_BATCH, MAX_GPUS, excerpt
from .cluster import ClusterSpec
from .model import ModelSpec
from .modules import OffloadModule, RecomputeModule
from .training import TrainingSpec

Order = Literal["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]
Dispatcher = Literal["alltoall", "allgather", "flex"]
FlexBackend = Literal["hybridep", "deepep"]
CudaGraphScope = Literal["layer", "full_iteration"]


class Layout(BaseModel):
    """How the GPUs are split: attention grid tp×cp×dp×pp, expert grid etp×ep×edp×pp.

    Megatron Core's Parallel Folding: both grids cover the same ranks, so ep may exceed dp and
    etp may differ from tp. Sequence parallelism is on whenever tp > 1 (required with MoE).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    tp: int = Field(1, gt=0, description="Tensor parallel size (attention and dense MLP).")
    cp: int = Field(1, gt=0, description="Context parallel size (attention only).")
    dp: int = Field(1, gt=0, description="Data parallel size of the attention grid.")
    pp: int = Field(1, gt=0, description="Pipeline parallel size (shared by both grids).")
    vpp: int = Field(1, gt=0, description="Virtual pipeline stages per pp rank (interleaving).")
    ep: int = Field(1, gt=0, description="Expert parallel size.")
    etp: int = Field(1, gt=0, description="Expert tensor parallel size.")
    mbs: int = Field(1, gt=0, description="Micro-batch size in sequences.")
    num_microbatches: int = Field(1, gt=0, description="Micro-batches per step per DP replica.")
    order: Order = Field("tp-cp-ep-dp-pp", description="Rank order, fastest-varying first.")
    dispatcher: Dispatcher = Field("alltoall", description="MoE token dispatcher.")
    flex_backend: FlexBackend = Field(
        "hybridep", description="The communication library the flex dispatcher runs (Megatron "
        "--moe-flex-dispatcher-backend): 'hybridep' (NVIDIA's, the backend Megatron Core "
        "supports across multi-node NVLink such as NVL72, and the one NVIDIA's recipes run) "
        "or 'deepep' (DeepSeek's; across a multi-node NVLink domain only through a community "
        "patch, at about half HybridEP's bandwidth). Read only with dispatcher 'flex'.")
    distributed_optimizer: bool = Field(True, description="Shard optimizer states over DP.")
    ep_overlap: bool = Field(False, description="Hide EP all-to-all by merged fwd/bwd (Megatron).")
    tp_comm_overlap: bool = Field(
        False, description="Overlap TP all-gather/reduce-scatter with the GEMMs beside them (TE "
        "userbuffers, Megatron --tp-comm-overlap); needs tp > 1. Off, TP comm is exposed.")
    cuda_graphs: bool = Field(
        False, description="Capture each layer's static-shape parts (attention, dense MLP, MoE "
        "router and preprocess) in CUDA graphs (Megatron --cuda-graph-impl transformer_engine), "
        "removing their kernel-launch overhead for graph memory.")
    cuda_graph_scope: CudaGraphScope = Field(
        "layer", description="What the CUDA graphs capture (read only with cuda_graphs): "
        "'layer', each layer's static-shape parts (Megatron --cuda-graph-impl "
        "transformer_engine); 'full_iteration', the whole forward-backward step as one graph "
        "(--cuda-graph-impl full_iteration), no host launch left in it. A dropless MoE layer "
        "is capturable whole only with static buffers: HybridEP's per-rank token budget "
        "(--moe-expert-rank-capacity-factor, tokens over it dropped) and the paged stash of "
        "the experts' activations (--moe-paged-stash), which the export sets.")
    fused_grouped_mlp: bool = Field(
        False, description="Run each MoE layer's experts as Transformer Engine's fused grouped "
        "MLP (Megatron --use-transformer-engine-op-fuser with NVTE_CUTEDSL_FUSED_GROUPED_MLP=1, "
        "as NVIDIA's MXFP8 full-iteration recipes from Megatron-Bridge 26.06 run it): one "
        "CuTe-DSL grouped GEMM whose epilogue applies the gated activation, the routing "
        "probabilities and the MXFP8 quantisation, instead of a GEMM, a quantize kernel per "
        "expert and an activation kernel between. Needs a block-scaled recipe (mxfp8, nvfp4) "
        "on Blackwell, a gated MoE MLP, etp 1 and Transformer Engine ≥ 2.14.")

    @model_validator(mode="wrap")
    @classmethod
    def _derived_inputs(cls, data: object, handler: ModelWrapValidatorHandler[Layout]
                        ) -> Layout:
        """A dumped Layout carries its derived fields (SPEC lists `edp`); accept them back only
        when they agree with the axes, so a hand-edited plan cannot say two things at once.
        They are compared with the axes as validated, not as written: an axis that is no
        positive whole number (`tp: 0`, `2.5`) is refused by name first, where comparing would
        blame the derived field for it."""
        if not isinstance(data, dict):
            return handler(data)
        data = dict(data)
        given = {k: data.pop(k) for k in ("world_size", "edp", "sequence_parallel") if k in data}
        layout = handler(data)
        for k, v in given.items():
            implied = getattr(layout, k)
            if v != implied:
                raise ValueError(f"{k}: given {excerpt(v)} but the axes imply {implied}; "
                                 f"drop `{k}` (it is derived) or fix the axes")
        return layout

    @model_validator(mode="after")
    def _bounded(self) -> Layout:
        """Sizes stay within moeplan.limits, so group building and pricing stay bounded."""
        if self.world_size > MAX_GPUS:
            raise ValueError(f"world_size: tp·cp·dp·pp = {self.world_size:,} is above the limit "
                             f"of {MAX_GPUS:,} GPUs; plan a smaller cluster")
        for k in ("ep", "etp", "vpp"):
            if getattr(self, k) > MAX_GPUS:
                raise ValueError(f"{k}: {getattr(self, k):,} is above the limit of "
                                 f"{MAX_GPUS:,}; use a smaller size")
        if self.mbs * self.num_microbatches > MAX_GLOBAL_BATCH:
            raise ValueError(f"mbs: mbs × num_microbatches is above the limit of "
                             f"{MAX_GLOBAL_BATCH:,} sequences per replica; use a smaller batch")
        return self

    @computed_field  # type: ignore[prop-decorator]
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @computed_field  # type: ignore[prop-decorator]
    @property
    def edp(self) -> int:
        """Expert data parallel size: world / (etp·ep·pp); 0 when it does not divide."""
        n = self.etp * self.ep * self.pp
        return self.world_size // n if self.world_size % n == 0 else 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def sequence_parallel(self) -> bool:
        return self.tp > 1

    @property
    def full_iteration_graphs(self) -> bool:
        """The whole step is one CUDA graph (`cuda_graph_scope` 'full_iteration' with graphs
        on): no host launch, no host sync inside it."""
        return self.cuda_graphs and self.cuda_graph_scope == "full_iteration"

    @classmethod
    def build(cls, world: int, global_batch_size: int, **axes: object) -> Layout:
        """A layout for `world` GPUs with dp and the micro-batch count derived.

        Raises LayoutError naming the rule when the sizes do not divide.
        """
        tp, cp, pp = (int(axes.get(k, 1) or 1) for k in ("tp", "cp", "pp"))  # type: ignore[call-overload]
        mbs = int(axes.get("mbs", 1) or 1)  # type: ignore[call-overload]
        if world % (tp * cp * pp):
            raise LayoutError([("world_size", f"{world} GPUs are not divisible by tp·cp·pp = "
                                f"{tp}·{cp}·{pp}; pick sizes whose product divides the GPU count")])
        dp = world // (tp * cp * pp)
        if global_batch_size % (mbs * dp):
            raise LayoutError([("gbs_divisible", f"global batch {global_batch_size} is not "
                                f"divisible by mbs·dp = {mbs}·{dp}; change --gbs or --mbs")])
        fields = {k: v for k, v in axes.items() if k not in ("dp", "edp") and v is not None}
        fields["num_microbatches"] = global_batch_size // (mbs * dp)
        return cls(dp=dp, **fields)  # type: ignore[arg-type]

    def key(self) -> tuple:
        """A hashable tuple, for caches and deterministic ordering."""
        return (self.tp, self.cp, self.dp, self.pp, self.vpp, self.ep, self.etp, self.mbs,
                self.num_microbatches, self.order, self.dispatcher, self.flex_backend,
                self.distributed_optimizer, self.ep_overlap, self.tp_comm_overlap,
                self.cuda_graphs, self.cuda_graph_scope, self.fused_grouped_mlp)


class Choices(BaseModel):
    """Memory decisions per module per pipeline rank and the pipeline stage layout, as the
    planner's MILP makes them.

    `recompute` and `offload` hold one module set per pipeline rank, in one canonical form:
    `[]` when no rank uses any, `[[...]]` when every rank uses the same set, else exactly pp
    sets (the ILP may recompute more on the first rank, which holds the most in-flight
    micro-batches; Megatron's target takes one set for all). `for_rank(r)` reads them; a flat
    list of names is read as one set for every rank. `stage_layout` is the pipeline layout in
    Megatron's syntax, None for the balanced split (`stage_layout.plan_stages`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    recompute: list[list[RecomputeModule]] = Field(
        default_factory=list, description="Recomputed modules: one set for every pipeline rank, "
        "or one set per rank.")
    offload: list[list[OffloadModule]] = Field(
        default_factory=list, description="Modules whose saved activations go to host memory: "
        "one set for every pipeline rank, or one set per rank.")
    optimizer_offload_fraction: float = Field(
        0.0, ge=0, le=1, description="Fraction of optimizer states kept and stepped on the host."
    )
    stage_layout: str | None = Field(
        None, description="Pipeline layout in Megatron's --pipeline-model-parallel-layout "
        "syntax; None: the balanced split.")

    @model_validator(mode="before")
    @classmethod
    def _one_form(cls, data: object) -> object:
        """Plans of format 1 spelt per-rank sets as `stage_recompute`/`stage_offload` beside a
        flat `recompute`/`offload`; a flat list of names is one set for every rank."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in ("recompute", "offload"):
            per_rank = data.pop(f"stage_{key}", None)
            flat = data.get(key)
            if per_rank is not None:
                data[key] = per_rank
            elif isinstance(flat, list) and flat and all(isinstance(x, str) for x in flat):
                data[key] = [flat]
        return data

    @model_validator(mode="after")
    def _check(self) -> Choices:
        for sets in self.recompute:
            if "full" in sets and len(sets) > 1:
                raise ValueError("recompute: 'full' recomputes the whole layer; do not combine it "
                                 "with per-module names")
        for key in ("recompute", "offload"):  # the canonical form: [] / [one] / one per rank
            sets = [sorted(set(s), key=s.index) for s in getattr(self, key)]
            if not any(sets):
                sets = []
            elif all(s == sets[0] for s in sets):
                sets = sets[:1]
            if sets != getattr(self, key):
                object.__setattr__(self, key, sets)
        return self

    def for_rank(self, rank: int) -> tuple[list[str], list[str]]:
        """(recomputed modules, offloaded modules) on pipeline rank `rank`."""
        return _at(self.recompute, rank), _at(self.offload, rank)

    def recompute_for_stage(self, rank: int) -> list[str]:
        return _at(self.recompute, rank)

    def offload_for_stage(self, rank: int) -> list[str]:
        return _at(self.offload, rank)

    def uniform(self) -> bool:
        """Whether every pipeline rank uses the same recompute set and offload set."""
        return len(self.recompute) <= 1 and len(self.offload) <= 1

    def describe_per_rank(self) -> str:
        """`rank 0: recompute core_attn, offload -; rank 1: …` for messages."""
        n = max(len(self.recompute), len(self.offload), 1)
        return "; ".join(
            f"rank {r}: recompute {', '.join(rc) or '-'}, offload {', '.join(of) or '-'}"
            for r, (rc, of) in ((r, self.for_rank(r)) for r in range(n)))

    @classmethod
    def per_rank(cls, recompute: list[list[str]], offload: list[list[str]], **kw: object
                 ) -> Choices:
        """Choices from one recompute and one offload set per rank (collapsed when equal)."""
        return cls(recompute=recompute, offload=offload, **kw)  # type: ignore[arg-type]


def _at(sets: list[list[str]], rank: int) -> list[str]:
    if not sets:
        return []
    return list(sets[rank] if len(sets) > 1 else sets[0])


def layout_violations(
    model: ModelSpec,
    training: TrainingSpec,
    layout: Layout,
    world: int | None = None,
    choices: Choices | None = None,
    cluster: ClusterSpec | None = None,
    target: str = "megatron",
) -> list[tuple[str, str]]:
    """Every rule of the target executor the layout (and its choices) breaks, as (rule name,
    what is wrong and how to fix it): the one table in `rules.py`."""
    from .rules import Facts, violations

    return violations(Facts(model, training, layout, choices, cluster, world), target)


def check_layout(
    model: ModelSpec,
    training: TrainingSpec,
    layout: Layout,
    world: int | None = None,
    choices: Choices | None = None,
    cluster: ClusterSpec | None = None,
    target: str = "megatron",
) -> None:
    """Raise LayoutError listing every broken rule, or return quietly."""
    v = layout_violations(model, training, layout, world, choices, cluster, target)
    if v:
        raise LayoutError(v, target)
