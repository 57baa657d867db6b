"""Layout (parallel degrees and schedule) and Choices (memory decisions), with Megatron's rules.

The rules live here, in specs, because the cost models, the planner and the runtime must agree on
what a valid layout is: each rule has a name that appears in errors and in the planner's pruning
counts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from ..errors import LayoutError
from ..limits import MAX_GLOBAL_BATCH, MAX_GPUS
from .cluster import ClusterSpec
from .model import ModelSpec
from .training import TrainingSpec

Order = Literal["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]
Dispatcher = Literal["alltoall", "allgather", "flex"]
RecomputeModule = Literal[
    "core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "full"
]
OffloadModule = Literal[
    "attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"
]
RECOMPUTE_MODULES: tuple[str, ...] = RecomputeModule.__args__  # type: ignore[attr-defined]
OFFLOAD_MODULES: tuple[str, ...] = OffloadModule.__args__  # type: ignore[attr-defined]


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
    distributed_optimizer: bool = Field(True, description="Shard optimizer states over DP.")
    ep_overlap: bool = Field(False, description="Hide EP all-to-all by merged fwd/bwd (Megatron).")
    tp_comm_overlap: bool = Field(
        False, description="Overlap TP all-gather/reduce-scatter with the GEMMs beside them (TE "
        "userbuffers, Megatron --tp-comm-overlap); needs tp > 1. Off, TP comm is exposed.")
    cuda_graphs: bool = Field(
        False, description="Capture each layer's static-shape parts (attention, dense MLP, MoE "
        "router and preprocess) in CUDA graphs (Megatron --cuda-graph-impl transformer_engine), "
        "removing their kernel-launch overhead for graph memory.")

    @model_validator(mode="before")
    @classmethod
    def _derived_inputs(cls, data: object) -> object:
        """A dumped Layout carries its derived fields (SPEC lists `edp`); accept them back only
        when they agree with the axes, so a hand-edited plan cannot say two things at once."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        given = {k: data.pop(k) for k in ("world_size", "edp", "sequence_parallel") if k in data}
        if given:
            try:  # axes of the wrong type: field validation names them, not this check
                implied = {k: getattr(cls.model_construct(**data), k) for k in given}
            except (TypeError, ValueError, AttributeError, ZeroDivisionError):
                return data
            for k, v in given.items():
                if v != implied[k]:
                    raise ValueError(f"{k}: given {v} but the axes imply {implied[k]}; "
                                     f"drop `{k}` (it is derived) or fix the axes")
        return data

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
                self.num_microbatches, self.order, self.dispatcher, self.distributed_optimizer,
                self.ep_overlap, self.tp_comm_overlap, self.cuda_graphs)


class Choices(BaseModel):
    """Memory decisions per module and the pipeline stage layout, as the planner's ILP makes them.

    `recompute`/`offload` apply to every stage unless `stage_recompute`/`stage_offload` give one
    set per pipeline rank (the ILP may recompute more on the first stage, which holds the most
    in-flight micro-batches).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    recompute: list[RecomputeModule] = Field(default_factory=list, description="Recomputed modules.")
    offload: list[OffloadModule] = Field(default_factory=list, description="Offloaded activations.")
    stage_recompute: list[list[RecomputeModule]] | None = Field(
        None, description="Per pipeline rank recompute sets (overrides `recompute`)."
    )
    stage_offload: list[list[OffloadModule]] | None = Field(
        None, description="Per pipeline rank offload sets (overrides `offload`)."
    )
    optimizer_offload_fraction: float = Field(
        0.0, ge=0, le=1, description="Fraction of optimizer states kept and stepped on the host."
    )
    stage_layout: str | None = Field(
        None, description="Pipeline layout in Megatron's --pipeline-model-parallel-layout syntax."
    )
    stage_layers: list[int] | None = Field(
        None, description="Decoder layers per virtual stage, in virtual-stage order (pp·vpp)."
    )

    @model_validator(mode="after")
    def _check(self) -> Choices:
        for sets in [self.recompute, *(self.stage_recompute or [])]:
            if "full" in sets and len(sets) > 1:
                raise ValueError("recompute: 'full' recomputes the whole layer; do not combine it "
                                 "with per-module names")
        return self

    def recompute_for_stage(self, stage: int) -> list[str]:
        return list(self.stage_recompute[stage] if self.stage_recompute else self.recompute)

    def offload_for_stage(self, stage: int) -> list[str]:
        return list(self.stage_offload[stage] if self.stage_offload else self.offload)


def layout_violations(
    model: ModelSpec,
    training: TrainingSpec,
    layout: Layout,
    world: int | None = None,
    choices: Choices | None = None,
    cluster: ClusterSpec | None = None,
) -> list[tuple[str, str]]:
    """Every Megatron Core rule the layout breaks, as (rule name, how to fix it)."""
    v: list[tuple[str, str]] = []
    L = layout
    world = world or L.world_size
    if L.world_size != world:
        v.append(("world_size", f"tp·cp·dp·pp = {L.tp}·{L.cp}·{L.dp}·{L.pp} = {L.world_size} "
                  f"but the cluster has {world} GPUs; make the product equal the GPU count"))
    if world % (L.etp * L.ep * L.pp):
        v.append(("expert_world_size", f"etp·ep·pp = {L.etp}·{L.ep}·{L.pp} does not divide "
                  f"{world} GPUs, so edp is not whole; pick ep/etp dividing world/pp"))
    if model.is_moe:
        if model.num_experts % L.ep:
            v.append(("experts_divisible_by_ep", f"{model.num_experts} experts are not divisible "
                      f"by ep={L.ep}; use a divisor of the expert count"))
        if (model.moe_ffn_hidden_size or 0) % L.etp:
            v.append(("expert_ffn_divisible_by_etp", f"expert FFN size "
                      f"{model.moe_ffn_hidden_size} is not divisible by etp={L.etp}"))
    elif L.ep > 1 or L.etp > 1:
        v.append(("ep_needs_experts", "a dense model has no experts; set ep=1 and etp=1"))
    if model.num_attention_heads % L.tp:
        v.append(("heads_divisible_by_tp", f"{model.num_attention_heads} attention heads are not "
                  f"divisible by tp={L.tp}; use a divisor of the head count"))
    if model.attention == "gqa" and model.kv_heads % L.tp:
        v.append(("kv_heads_divisible_by_tp", f"{model.kv_heads} KV heads are not divisible by "
                  f"tp={L.tp}; use tp ≤ KV heads that divides them"))
    if model.ffn_hidden_size % L.tp:
        v.append(("ffn_divisible_by_tp", f"FFN size {model.ffn_hidden_size} is not divisible by "
                  f"tp={L.tp}"))
    gbs = training.global_batch_size
    if gbs % (L.mbs * L.dp):
        v.append(("gbs_divisible", f"global batch {gbs} is not divisible by mbs·dp = "
                  f"{L.mbs}·{L.dp}; change --gbs or --mbs"))
    elif gbs // (L.mbs * L.dp) != L.num_microbatches:
        v.append(("num_microbatches", f"num_microbatches must be gbs/(mbs·dp) = "
                  f"{gbs // (L.mbs * L.dp)}, not {L.num_microbatches}"))
    if training.seq_len % (2 * L.cp) and L.cp > 1:
        v.append(("seq_divisible_by_2cp", f"seq {training.seq_len} is not divisible by 2·cp = "
                  f"{2 * L.cp} (load-balanced causal CP splits each sequence in 2·cp chunks)"))
    if L.tp > 1 and (training.seq_len // L.cp) % L.tp:
        v.append(("seq_divisible_by_tp", f"seq/cp = {training.seq_len // L.cp} is not divisible "
                  f"by tp={L.tp}, which sequence parallelism needs"))
    if L.vpp > 1 and L.pp == 1:
        v.append(("vpp_needs_pp", "virtual pipeline stages need pp > 1; set vpp=1"))
    extra = 2 + model.mtp_layers  # embedding, loss, MTP count as about a layer each
    if L.pp * L.vpp > model.num_layers + extra:
        v.append(("too_many_stages", f"pp·vpp = {L.pp * L.vpp} virtual stages exceed the "
                  f"{model.num_layers} layers; lower pp or vpp"))
    if L.vpp > 1 and L.num_microbatches % L.pp:
        v.append(("interleaved_microbatches", f"the interleaved schedule needs the micro-batch "
                  f"count ({L.num_microbatches}) to be a multiple of pp={L.pp}"))
    if L.ep_overlap:
        if not model.is_moe or L.ep == 1:
            v.append(("ep_overlap_needs_ep", "EP overlap needs an MoE model with ep > 1"))
        if L.pp > 1 and L.vpp == 1:
            v.append(("ep_overlap_needs_vpp", "Megatron's --overlap-moe-expert-parallel-comm "
                      "needs virtual pipeline stages when pp > 1; set vpp ≥ 2 or turn it off"))
        if L.dispatcher == "allgather":
            v.append(("ep_overlap_dispatcher", "EP overlap needs the alltoall or flex dispatcher"))
        if choices is not None:
            sets = [choices.recompute, *(choices.stage_recompute or [])]
            if any("full" in s or "moe" in s for s in sets):
                v.append(("ep_overlap_recompute", "EP overlap excludes full or `moe` recompute"))
    if L.tp_comm_overlap and L.tp == 1:
        v.append(("tp_comm_overlap_needs_tp", "TP communication overlap needs tp > 1; turn "
                  "tp_comm_overlap off"))
    if choices is not None:
        if choices.stage_recompute is not None and len(choices.stage_recompute) != L.pp:
            v.append(("stage_recompute_len", f"stage_recompute needs one set per pp rank ({L.pp})"))
        if choices.stage_offload is not None and len(choices.stage_offload) != L.pp:
            v.append(("stage_offload_len", f"stage_offload needs one set per pp rank ({L.pp})"))
        if choices.stage_layers is not None:
            if len(choices.stage_layers) != L.pp * L.vpp:
                v.append(("stage_layers_len", f"stage_layers needs pp·vpp = {L.pp * L.vpp} "
                          "entries"))
            elif sum(choices.stage_layers) != model.num_layers:
                v.append(("stage_layers_sum", f"stage_layers add up to "
                          f"{sum(choices.stage_layers)}, not the {model.num_layers} layers"))
        if "mla_up_proj" in choices.recompute and model.attention != "mla":
            v.append(("mla_up_proj_needs_mla", "mla_up_proj recompute needs MLA attention"))
    if cluster is not None and not cluster.supports(training.precision):
        v.append(("precision_supported", f"{cluster.gpu} ({cluster.architecture}) cannot run "
                  f"{training.precision}; use bf16" + (" or an fp8 recipe" if cluster.fp8_tflops
                                                       else "")))
    return v


def check_layout(
    model: ModelSpec,
    training: TrainingSpec,
    layout: Layout,
    world: int | None = None,
    choices: Choices | None = None,
    cluster: ClusterSpec | None = None,
) -> None:
    """Raise LayoutError listing every broken rule, or return quietly."""
    v = layout_violations(model, training, layout, world, choices, cluster)
    if v:
        raise LayoutError(v)
