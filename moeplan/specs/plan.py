"""Estimate (predicted time and memory) and Plan (a self-contained, runnable decision)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..limits import MAX_IMBALANCE
from .cluster import ClusterSpec
from .layout import Choices, Layout
from .model import ModelSpec
from .training import TrainingSpec


class MemoryBreakdown(BaseModel):
    """Peak memory of the most loaded GPU, GB of 10^9 bytes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    peak_gb: float
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    buffers_gb: float
    margin_gb: float = Field(0.0, description="Safety margin the peak must leave free: the "
                             "memory model's measured error on this peak plus the HBM the "
                             "runtime reserves (CUDA context, allocator).")
    headroom_gb: float = Field(0.0, description="HBM − peak. The plan fits when headroom ≥ "
                               "margin.")
    host_gb: float = Field(0.0, description="Host memory the most loaded GPU's process holds "
                           "for what it offloads: the optimizer's offloaded share (fp32 "
                           "parameter and gradient copies, Adam moments) and the offloaded "
                           "activations of its in-flight micro-batches. The plan fits only "
                           "while it is within the share of the host memory per GPU a process "
                           "may fill (`cost_models.memory.HOST_USABLE`).")


class TimeBreakdown(BaseModel):
    """Per-step time components in seconds (exposed_comm_s is what overlap did not hide)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    compute_s: float
    tp_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    ep_comm_s: float = 0.0
    dp_comm_s: float = 0.0
    pp_bubble_s: float = 0.0
    recompute_s: float = 0.0
    offload_s: float = 0.0
    exposed_comm_s: float = 0.0


class Interval(BaseModel):
    """A prediction interval, calibrated out of sample (cost_models.uncertainty)."""

    model_config = ConfigDict(extra="forbid")

    level: float = Field(description="Share of real runs the interval should cover (0.8).")
    step_time_s: tuple[float, float]
    tokens_per_s_per_gpu: tuple[float, float]
    pessimistic_tokens_per_s_per_gpu: float | None = Field(
        None, description="The prediction with every unvalidated effect disappointing (the "
        "plan without EP overlap or flex, host links at half speed); the low end starts here.")
    regime: str = Field("", description="The group of held-out published runs whose errors set "
                        "the interval's width.")
    rows: int = Field(0, description="How many held-out rows that group has.")
    widened_by: list[str] = Field(default_factory=list, description="Why the interval is wider "
                                  "than its regime's: how far the estimate lies from the "
                                  "published runs the calibration was fitted on (a model or "
                                  "family no fit row has, a micro-batch, tokens per expert or "
                                  "sequence outside the fit rows' range, a GPU and precision "
                                  "with few rows, a model whose rows the fit misses).")


class Assumption(BaseModel):
    """One modelled effect the estimate depends on, and whether published runs support it."""

    model_config = ConfigDict(extra="forbid")

    term: str
    validated: bool
    evidence: str


class Confidence(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    label: Literal["calibrated", "extrapolated"]
    reason: str


def token_words(x: float) -> str:
    """A token count as people say it: `15T`, `300B`, `4.19M`, `40,000`; rounded before the
    unit is picked (999.9e9 is `1T`), and past a thousand trillion in thousands of T."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        v = float(f"{x / scale:.3g}")
        if v >= 1:
            return (f"{v:,.0f}" if v >= 1000 else f"{v:g}") + unit
    return f"{x:,.0f}"


class Estimate(BaseModel):
    """What the cost models predict for one plan (SPEC §4 `moeplan estimate`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    step_time_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float = Field(description="Model TFLOPS by Megatron-LM's FLOP count.")
    mfu: float = Field(description="Model FLOPs utilisation against the dense BF16 peak.")
    memory: MemoryBreakdown
    time: TimeBreakdown
    bottleneck: str
    fits: bool
    warnings: list[str] = Field(default_factory=list)
    confidence: Confidence | None = None
    interval: Interval | None = None
    assumptions: list[Assumption] = Field(default_factory=list)
    unmodelled_s: float = Field(
        0.0, ge=0.0, description="Seconds of step_time_s the physics does not explain: the "
        "model's measured residual at this precision (Calibration.model_residual), beside the "
        "time terms rather than among them.")
    imbalance: float | None = Field(
        None, ge=1.0, le=MAX_IMBALANCE, description="Routed tokens on the busiest EP rank over "
        "the mean this estimate was priced at (search/estimate --imbalance; 1: balanced): "
        "`estimate PLAN.json` prices the plan at it again unless given another. None: not "
        "recorded (a plan file written before it was, or priced from a routing histogram).")


PLAN_FORMAT = 2
"""The plan file format this version writes. 1: choices said per-rank sets in `stage_recompute`/
`stage_offload` beside flat `recompute`/`offload`, and a stage split as `stage_layers`; no
target. 2: one form per fact (Choices), and `target`."""


class Plan(BaseModel):
    """A self-contained plan: the specs it was made for, the executor it was made for, the
    layout, the choices, the forecast."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    format_version: int = Field(PLAN_FORMAT, description="The plan file format (PLAN_FORMAT); "
                                "older files are migrated, newer ones refused.")
    target: Literal["megatron", "moeplan"] = Field(
        "megatron", description="The executor the plan was made for and priced as: Megatron-LM "
        "(`moeplan export --format megatron`) or `moeplan run`. What each accepts: rules.py.")
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    layout: Layout
    choices: Choices = Field(default_factory=Choices)
    estimate: Estimate | None = None
    explanation: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: object) -> object:
        """Read a plan of an older format as this one; refuse a newer one by name."""
        if not isinstance(data, dict):
            return data
        version = data.get("format_version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            return data  # field validation names it
        if version > PLAN_FORMAT:
            raise ValueError(f"format_version: this plan was written in format {version} by a "
                             f"newer moeplan; this version reads formats 1 to {PLAN_FORMAT}: "
                             "upgrade moeplan or re-plan with this version")
        if version == 1:
            data = dict(data, format_version=PLAN_FORMAT)
            choices = data.get("choices")
            if isinstance(choices, dict) and "stage_layers" in choices:
                choices = dict(choices)
                layers = choices.pop("stage_layers")
                if layers is not None and not choices.get("stage_layout"):
                    choices["stage_layout"] = _layers_text(data.get("model"), layers)
                data["choices"] = choices
        return data

    def stages(self) -> list[list[str]]:
        """The virtual pipeline stages the plan runs, in virtual-stage order (`E`, `t`, `m`,
        `L` per stage): its explicit layout or the default split."""
        from .stage_layout import plan_stages

        return plan_stages(self.model, self.layout, self.choices)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def headline(self) -> str:
        """What trains where, the title the tables and exports put before `summary`:
        `deepseek-v3 on 256 × H100`."""
        return f"{self.model.name} on {self.world_size} × {self.cluster.gpu}"

    def batch_words(self) -> str:
        """The step's batch, which a layout line does not show: `seq 4,096, gbs 1,024
        (4.2M tokens per step)`."""
        t = self.training
        return (f"seq {t.seq_len:,}, gbs {t.global_batch_size:,} "
                f"({token_words(t.seq_len * t.global_batch_size)} tokens per step)")

    def layout_summary(self) -> str:
        """The parallel layout in one line: `tp2 cp1 dp8 pp4 vpp2 ep16 etp1 edp2 mbs1×64 bf16`.

        `mbs1×64` reads "micro-batches of 1 sequence, 64 of them per step per data-parallel
        replica" (gbs = mbs · micro-batches · dp). vpp is shown only when interleaving is on;
        the expert axes only for MoE models.
        """
        L = self.layout
        parts = [f"tp{L.tp}", f"cp{L.cp}", f"dp{L.dp}", f"pp{L.pp}"]
        if L.vpp > 1:
            parts.append(f"vpp{L.vpp}")
        if self.model.is_moe:
            parts += [f"ep{L.ep}", f"etp{L.etp}", f"edp{L.edp}"]
        parts += [f"mbs{L.mbs}×{L.num_microbatches}", self.training.precision]
        return " ".join(parts)

    def choice_tokens(self) -> list[str]:
        """Every choice beyond the parallel degrees, one token each, in the one vocabulary the
        tables, explanations, exports and README share:

        `alltoall|allgather|flex` (MoE token dispatcher; `flex=deepep` when the flex dispatcher
        runs DeepEP instead of its HybridEP default), `ep-overlap`, `tp-comm-overlap`,
        `cuda-graphs` (`cuda-graphs=full_iteration` when the whole step is one graph),
        `dist-opt|no-dist-opt`
        (optimizer states sharded over data parallel or replicated),
        `recompute=core_attn,moe_act` (per pipeline rank when they differ:
        `recompute=core_attn|-|-|-`), `offload=expert_fc1`, `optimizer-offload=0.5` (fraction
        of optimizer states kept and stepped on the host) and `stages=Et*3|(t*4|)*14,ttmL`
        (an explicit or uneven pipeline stage layout, Megatron's syntax).
        """
        L, c = self.layout, self.choices
        disp = ("flex=deepep" if L.dispatcher == "flex" and L.flex_backend == "deepep"
                else L.dispatcher)
        tokens = [disp] if self.model.is_moe else []
        for flag, word in (("ep_overlap", "ep-overlap"), ("tp_comm_overlap", "tp-comm-overlap")):
            if getattr(L, flag, False) or getattr(c, flag, False):
                tokens.append(word)
        graphs = getattr(L, "cuda_graphs", None) or getattr(c, "cuda_graphs", None)
        if graphs is True and getattr(L, "full_iteration_graphs", False):
            graphs = "full_iteration"
        if graphs:
            tokens.append("cuda-graphs" if graphs is True else f"cuda-graphs={graphs}")
        tokens.append("dist-opt" if L.distributed_optimizer else "no-dist-opt")
        if c.recompute:
            tokens.append("recompute=" + _per_stage(c.recompute))
        if c.offload:
            tokens.append("offload=" + _per_stage(c.offload))
        if c.optimizer_offload_fraction:
            tokens.append(f"optimizer-offload={c.optimizer_offload_fraction:g}")
        if c.stage_layout:
            tokens.append(f"stages={c.stage_layout}")
        return tokens

    def choices_summary(self) -> str:
        return " ".join(self.choice_tokens())

    def summary(self) -> str:
        """The whole plan in one line: layout, then choices (see the two functions above)."""
        return f"{self.layout_summary()} {self.choices_summary()}"


def _per_stage(sets: list[list[str]]) -> str:
    """One set for all pipeline ranks (`core_attn,moe_act`), or one per rank (`a|-|b`)."""
    texts = [",".join(s) or "-" for s in sets]
    return texts[0] if len(set(texts)) == 1 else "|".join(texts)


def _layers_text(model: object, layers: object) -> object:
    """A format-1 `stage_layers` list as a layout string (its MTP layers from the model)."""
    from .stage_layout import layers_layout_text

    mtp = (model.get("mtp_layers", 0) if isinstance(model, dict)
           else getattr(model, "mtp_layers", 0))
    if not (isinstance(layers, list) and all(isinstance(x, int) for x in layers)
            and isinstance(mtp, int) and layers):
        return layers  # the stage_layout field's validation names what is wrong
    return layers_layout_text(layers, mtp)
