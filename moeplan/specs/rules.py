"""What each executor accepts: one table of rules, each with its source.

A plan names its target executor (`Plan.target`): `megatron` (Megatron-LM's `pretrain_gpt.py`
on Megatron Core) or `moeplan` (`moeplan run`, this project's runtime). A rule states one thing
a target refuses or runs differently from how it would be priced, where the executor checks it
(a file and the check in Megatron-LM or Megatron Core, or the runtime's support table), and how
to fix a plan that breaks it. Everything that decides what is valid reads this table:

  the enumeration       prunes layouts by the layout rules (`RULES`, `axes` say when a rule
                        can be evaluated while the axes are bound one by one);
  `layout_violations`   every rule of the target, named, for `estimate`, `export` and `run`;
  the MILP              the module options a layout may take and the combinations it must not
                        pick (`option_rules`), and whether one set serves every pipeline rank
                        (`uniform_stage_choices`);
  the exports           the environment and the flags a launch needs (`launch_env`);
  the runtime           refuses, before any worker starts, what breaks a `moeplan` rule.

A rule's `ok` sees a `Facts`: the model, the training settings, the layout (a `Layout`, or the
enumeration's partly bound axes), and the choices and cluster when known. Rules are pure
functions of these: no torch, no I/O.

Megatron-LM sources are read at commit d98e8a6 (Megatron Core 0.20.0): `arguments.py` is
`megatron/training/arguments.py::validate_args`, `TransformerConfig` is
`megatron/core/transformer/transformer_config.py::TransformerConfig.__post_init__`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .grid import domain_span
from .modules import OFFLOAD_MODULES as OFFLOAD_NAMES
from .modules import RECOMPUTE_MODULES as RECOMPUTE_NAMES
from .training import STACKS

MEGATRON_LM_COMMIT = "d98e8a6"
MEGATRON_CORE_VERSION = "0.20.0"
TARGETS = ("megatron", "moeplan")
BOTH = frozenset(TARGETS)
MEGATRON = frozenset({"megatron"})
MOEPLAN = frozenset({"moeplan"})

_ARGS = "megatron/training/arguments.py::validate_args"
_TC = "megatron/core/transformer/transformer_config.py::TransformerConfig.__post_init__"
_MLA = "megatron/core/transformer/transformer_config.py::MLATransformerConfig.__post_init__"
_MPC = "megatron/core/model_parallel_config.py::ModelParallelConfig.__post_init__"
_LAYOUT = ("megatron/core/transformer/pipeline_parallel_layer_layout.py::"
           "PipelineParallelLayerLayout.validate_layer_layout")
_SCHED = ("megatron/core/pipeline_parallel/schedules.py::"
          "forward_backward_pipelining_with_interleaving")
_RUNTIME = "moeplan/runtime/support.py"

Option = tuple[str, str]  # (kind, module): planner.problem.Option is this NamedTuple


def rec(module: str) -> Option:
    return ("recompute", module)


def off(module: str) -> Option:
    return ("offload", module)


@dataclass(frozen=True)
class Combo:
    """A forbidden combination of module options: every option of `present` in one pipeline
    rank's set, together with none of `absent`."""

    present: tuple[Option, ...]
    absent: tuple[Option, ...] = ()

    def hit(self, chosen: set[Option]) -> bool:
        return all(o in chosen for o in self.present) and not any(o in chosen for o in self.absent)

    def words(self) -> str:
        text = " with ".join(_say(o) for o in self.present)
        return text + (" without " + ", ".join(_say(o) for o in self.absent) if self.absent else "")


def _say(o: Option) -> str:
    return f"{o[0]} {o[1]}"


@dataclass
class Facts:
    """What a rule may read. `layout` is a `Layout` or any object with its fields (the
    enumeration binds them one by one); `choices` and `cluster` are None when unknown."""

    model: Any
    training: Any
    layout: Any
    choices: Any = None
    cluster: Any = None
    world: int | None = None

    def sets(self) -> list[set[Option]]:
        """Each pipeline rank's module options (recompute and offload together)."""
        c = self.choices
        return [{rec(m) for m in r} | {off(m) for m in o}
                for r, o in (c.for_rank(i) for i in range(self.layout.pp))]


@dataclass(frozen=True)
class Rule:
    """One thing a target refuses, where the target checks it, and how to fix a plan.

    `axes`: the layout fields `ok` reads (the enumeration evaluates the rule once they are
    bound); `needs`: what else must be known ("choices", "cluster"), else the rule is skipped.
    `combos`: for rules on module options, the forbidden combinations under these facts (the
    MILP never picks them); `ok` then holds when no rank's set hits one."""

    name: str
    source: str
    ok: Callable[[Facts], bool]
    why: Callable[[Facts], str]
    targets: frozenset[str] = BOTH
    axes: frozenset[str] = frozenset()
    needs: frozenset[str] = frozenset()
    combos: Callable[[Facts], tuple[Combo, ...]] | None = None

    @property
    def where(self) -> str:
        """The file and check of the executor (`source` before its parenthesis)."""
        return self.source.split(" (", 1)[0]

    @property
    def what(self) -> str:
        """What the check demands (`source`'s parenthesis)."""
        head, _, rest = self.source.partition(" (")
        return rest[:-1] if rest.endswith(")") else rest

    def applies(self, f: Facts, target: str) -> bool:
        return target in self.targets and not (
            ("choices" in self.needs and f.choices is None)
            or ("cluster" in self.needs and f.cluster is None))


RULES: list[Rule] = []


def rule(name: str, source: str, why: Callable[[Facts], str], targets: frozenset[str] = BOTH,
         axes: Iterable[str] = (), needs: Iterable[str] = ()
         ) -> Callable[[Callable[[Facts], bool]], Callable[[Facts], bool]]:
    """Register `ok` (True when the plan keeps the rule) under `name` in RULES."""
    def register(ok: Callable[[Facts], bool]) -> Callable[[Facts], bool]:
        RULES.append(Rule(name, source, ok, why, frozenset(targets), frozenset(axes),
                          frozenset(needs)))
        return ok
    return register


def option_rule(name: str, source: str, combos: Callable[[Facts], tuple[Combo, ...]],
                fix: str, targets: frozenset[str] = BOTH, axes: Iterable[str] = ()) -> None:
    """A rule on module options: `combos(facts)` are forbidden in any one rank's set."""
    def hits(f: Facts) -> list[str]:
        return sorted({c.words() for s in f.sets() for c in combos(f) if c.hit(s)})

    RULES.append(Rule(
        name, source, ok=lambda f: not hits(f),
        why=lambda f: f"{'; '.join(hits(f))}: {fix}",
        targets=frozenset(targets), axes=frozenset(axes), needs=frozenset({"choices"}),
        combos=combos))


# ---------------------------------------------------------------------------- parallel sizes
@rule("world_size", _ARGS + " (world size divisible by tp·pp·cp)",
      lambda f: (f"tp·cp·dp·pp = {f.layout.tp}·{f.layout.cp}·{f.layout.dp}·{f.layout.pp} = "
                 f"{_world(f.layout)} but the cluster has {f.world} GPUs; make the product equal "
                 "the GPU count"),
      axes=("tp", "cp", "dp", "pp"))
def _world_size(f: Facts) -> bool:
    return f.world is None or _world(f.layout) == f.world


def _world(L: Any) -> int:
    return L.tp * L.cp * L.dp * L.pp


@rule("expert_world_size", "megatron/core/parallel_state.py::initialize_model_parallel "
      "(expert grid etp·ep·edp·pp over the same ranks)",
      lambda f: (f"etp·ep·pp = {f.layout.etp}·{f.layout.ep}·{f.layout.pp} does not divide "
                 f"{_world(f.layout)} GPUs, so edp is not whole; pick ep/etp dividing world/pp"),
      axes=("tp", "cp", "dp", "pp", "ep", "etp"))
def _expert_world(f: Facts) -> bool:
    L = f.layout
    return _world(L) % (L.etp * L.ep * L.pp) == 0


@rule("experts_divisible_by_ep", _ARGS + " (number of experts a multiple of expert parallel "
      "size)", lambda f: (f"{f.model.num_experts} experts are not divisible by ep={f.layout.ep}; "
                          "use a divisor of the expert count"), axes=("ep",))
def _experts_ep(f: Facts) -> bool:
    return not f.model.is_moe or f.model.num_experts % f.layout.ep == 0


@rule("expert_ffn_divisible_by_etp", "megatron/core/transformer/moe/experts.py (expert FFN "
      "split over expert tensor parallel ranks by divide())",
      lambda f: (f"expert FFN size {f.model.moe_ffn_hidden_size} is not divisible by "
                 f"etp={f.layout.etp}"), axes=("etp",))
def _expert_ffn_etp(f: Facts) -> bool:
    return not f.model.is_moe or (f.model.moe_ffn_hidden_size or 0) % f.layout.etp == 0


@rule("ep_needs_experts", _TC + " (num_moe_experts must be set to use expert parallelism)",
      lambda f: "a dense model has no experts; set ep=1 and etp=1", axes=("ep", "etp"))
def _ep_needs_experts(f: Facts) -> bool:
    return f.model.is_moe or (f.layout.ep == 1 and f.layout.etp == 1)


@rule("dispatcher_needs_experts", "moeplan/planner/export.py::_moe_args (a dense model's "
      "launch carries no MoE flag, so a token dispatcher would be dropped)",
      lambda f: (f"a dense model has no experts to dispatch tokens to, so dispatcher "
                 f"{f.layout.dispatcher} would be dropped: drop --dispatcher (dispatcher "
                 "alltoall, the default, in a plan file)"), axes=("dispatcher",))
def _dispatcher_experts(f: Facts) -> bool:
    return f.model.is_moe or f.layout.dispatcher == "alltoall"


@rule("heads_divisible_by_tp", _TC + " (num_attention_heads a multiple of tp)",
      lambda f: (f"{f.model.num_attention_heads} attention heads are not divisible by "
                 f"tp={f.layout.tp}; use a divisor of the head count"), axes=("tp",))
def _heads_tp(f: Facts) -> bool:
    return f.model.num_attention_heads % f.layout.tp == 0


@rule("kv_heads_divisible_by_tp", _TC + " (num_query_groups a multiple or divisor of tp: the "
      "runtime and the cost models shard KV heads, so both targets take the multiple)",
      lambda f: (f"{f.model.kv_heads} KV heads are not divisible by tp={f.layout.tp}; use "
                 "tp ≤ KV heads that divides them"), axes=("tp",))
def _kv_heads_tp(f: Facts) -> bool:
    return f.model.attention != "gqa" or f.model.kv_heads % f.layout.tp == 0


@rule("ffn_divisible_by_tp", "megatron/core/tensor_parallel/layers.py::ColumnParallelLinear "
      "(output size divided by tp)",
      lambda f: f"FFN size {f.model.ffn_hidden_size} is not divisible by tp={f.layout.tp}",
      axes=("tp",))
def _ffn_tp(f: Facts) -> bool:
    return f.model.ffn_hidden_size % f.layout.tp == 0


@rule("seq_divisible_by_2cp", _ARGS + " (seq-length a multiple of 2·context-parallel-size)",
      lambda f: (f"seq {f.training.seq_len} is not divisible by 2·cp = {2 * f.layout.cp} "
                 "(load-balanced causal CP splits each sequence in 2·cp chunks)"), axes=("cp",))
def _seq_cp(f: Facts) -> bool:
    return f.layout.cp == 1 or f.training.seq_len % (2 * f.layout.cp) == 0


@rule("seq_divisible_by_tp", "megatron/core/tensor_parallel/mappings.py::_split_along_first_dim "
      "(sequence parallelism splits seq/cp over tp)",
      lambda f: (f"seq/cp = {f.training.seq_len // f.layout.cp} is not divisible by "
                 f"tp={f.layout.tp}, which sequence parallelism needs"), axes=("tp", "cp"))
def _seq_tp(f: Facts) -> bool:
    L = f.layout
    return L.tp == 1 or (f.training.seq_len // L.cp) % L.tp == 0


@rule("gbs_divisible", "megatron/core/num_microbatches_calculator.py::"
      "ConstantNumMicroBatchesCalculator (global batch divisible by mbs·dp)",
      lambda f: (f"global batch {f.training.global_batch_size} is not divisible by mbs·dp = "
                 f"{f.layout.mbs}·{f.layout.dp}; change --gbs or --mbs"), axes=("mbs", "dp"))
def _gbs(f: Facts) -> bool:
    return f.training.global_batch_size % (f.layout.mbs * f.layout.dp) == 0


@rule("num_microbatches", "moeplan/specs/layout.py (the plan's micro-batch count is "
      "gbs/(mbs·dp), as Megatron's calculator derives it)",
      lambda f: (f"num_microbatches must be gbs/(mbs·dp) = "
                 f"{f.training.global_batch_size // (f.layout.mbs * f.layout.dp)}, not "
                 f"{f.layout.num_microbatches}"), axes=("mbs", "dp", "num_microbatches"))
def _nmb(f: Facts) -> bool:
    L, gbs = f.layout, f.training.global_batch_size
    return gbs % (L.mbs * L.dp) != 0 or gbs // (L.mbs * L.dp) == L.num_microbatches


@rule("vpp_needs_pp", _ARGS + " (virtual pipeline stages need pipeline parallelism)",
      lambda f: "virtual pipeline stages need pp > 1; set vpp=1", axes=("pp", "vpp"))
def _vpp_pp(f: Facts) -> bool:
    return f.layout.vpp == 1 or f.layout.pp > 1


@rule("too_many_stages", _LAYOUT + " (every virtual stage holds a layer, the embedding or the "
      "loss)",
      lambda f: (f"pp·vpp = {f.layout.pp * f.layout.vpp} virtual stages exceed the "
                 f"{f.model.num_layers} layers plus the embedding, loss and MTP; lower pp or "
                 "vpp"), axes=("pp", "vpp"))
def _stages(f: Facts) -> bool:
    return f.layout.pp * f.layout.vpp <= f.model.num_layers + 2 + f.model.mtp_layers


@rule("interleaved_microbatches", _SCHED + " (micro-batches in groups of pp per virtual "
      "stage: M ≥ pp and M mod pp = 0)",
      lambda f: (f"the interleaved schedule needs the micro-batch count "
                 f"({f.layout.num_microbatches}) to be a multiple of pp={f.layout.pp}"),
      axes=("pp", "vpp", "num_microbatches"))
def _interleaved(f: Facts) -> bool:
    L = f.layout
    return L.vpp == 1 or L.num_microbatches % L.pp == 0


@rule("tp_comm_overlap_needs_tp", _ARGS + " (TP communication overlap only with sequence "
      "parallelism, which needs tensor parallelism: " + _MPC.rsplit("::", 1)[1] + ")",
      lambda f: "TP communication overlap needs tp > 1 (sequence parallelism); turn "
                "tp_comm_overlap off", axes=("tp", "tp_comm_overlap"))
def _tp_overlap(f: Facts) -> bool:
    return not f.layout.tp_comm_overlap or f.layout.tp > 1


# ---------------------------------------------------------------------------- EP overlap
@rule("ep_overlap_needs_ep", _TC + " (overlap_moe_expert_parallel_comm only with expert "
      "model parallelism)", lambda f: "EP overlap needs an MoE model with ep > 1; turn it off",
      axes=("ep", "ep_overlap"))
def _ovl_ep(f: Facts) -> bool:
    return not f.layout.ep_overlap or (f.model.is_moe and f.layout.ep > 1)


@rule("ep_overlap_needs_vpp", _TC + " (EP A2A overlap needs virtual pipeline stages when "
      "pp > 1)", lambda f: ("Megatron's --overlap-moe-expert-parallel-comm needs virtual "
                            "pipeline stages when pp > 1; set vpp ≥ 2 or turn it off"),
      axes=("pp", "vpp", "ep_overlap"))
def _ovl_vpp(f: Facts) -> bool:
    L = f.layout
    return not L.ep_overlap or L.pp == 1 or L.vpp > 1


@rule("ep_overlap_dispatcher", _TC + " (EP overlap with the alltoall or flex dispatcher)",
      lambda f: "EP overlap needs the alltoall or flex dispatcher",
      axes=("dispatcher", "ep_overlap"))
def _ovl_disp(f: Facts) -> bool:
    return not f.layout.ep_overlap or f.layout.dispatcher != "allgather"


@rule("pad_to_capacity_dispatcher", _TC + " (moe_pad_expert_input_to_capacity: the flex "
      "dispatcher's deepep backend refuses it; the alltoall dispatcher and the hybridep backend "
      "pad)",
      lambda f: (f"padding expert inputs to capacity needs the alltoall dispatcher or the flex "
                 f"dispatcher's hybridep backend, not {_dispatch_name(f.layout)}: set "
                 "flex_backend hybridep, dispatcher alltoall, or "
                 "moe_pad_expert_input_to_capacity false"),
      targets=MEGATRON, axes=("dispatcher",))
def _pad_disp(f: Facts) -> bool:
    L = f.layout
    return (not f.model.is_moe or not f.training.moe_pad_expert_input_to_capacity
            or L.dispatcher == "alltoall"
            or (L.dispatcher == "flex" and L.flex_backend == "hybridep"))


def full_iteration(layout: Any) -> bool:
    """Whether a (possibly partly bound) layout captures the whole step in one CUDA graph."""
    return (bool(getattr(layout, "cuda_graphs", False))
            and getattr(layout, "cuda_graph_scope", "layer") == "full_iteration")


@rule("full_iteration_graphs_moe_buffers", "megatron/core/transformer/moe/token_dispatcher.py "
      "(a dropless MoE layer is capturable in a full-iteration graph only with static shapes: "
      "MoEAlltoAllTokenDispatcher copies its split sizes to the host at cuda_sync_point, and the "
      "flex dispatcher sizes its receive buffer per step unless moe_expert_rank_capacity_factor "
      "is set, which TransformerConfig allows only with the hybridep or ncclep backend)",
      lambda f: (f"a full-iteration CUDA graph of a dropless MoE needs HybridEP's per-rank "
                 f"token budget, not {_dispatch_name(f.layout)}: set dispatcher flex with "
                 "flex_backend hybridep, pad the experts to capacity "
                 "(moe_pad_expert_input_to_capacity), or capture per layer "
                 "(cuda_graph_scope layer)"),
      targets=MEGATRON, axes=("dispatcher", "cuda_graphs"))
def _full_iter_moe(f: Facts) -> bool:
    L = f.layout
    return (not full_iteration(L) or not f.model.is_moe or f.training.static_moe_shapes
            or (L.dispatcher == "flex" and L.flex_backend == "hybridep"))


FUSED_GROUPED_MLP_TE = (2, 14)
"""The Transformer Engine Megatron Core's fused grouped MLP needs (`_is_fused_impl_supported`:
`is_te_min_version("2.14.0")`): a launch concern (`te_too_old`), since the runs that
validate the pricing had it."""


def te_too_old(f: Facts, te_version: str) -> list[tuple[str, str]]:
    """(rule, what and fix) for each setting of the plan the Transformer Engine a launch is
    written for (`te_version`) cannot run."""
    if fused_mlp_on(f.layout) and te_tuple(te_version) < FUSED_GROUPED_MLP_TE:
        return [("fused_grouped_mlp_te_version",
                 f"the export is written for Transformer Engine {te_version}, and Megatron Core "
                 "runs the fused grouped MLP only with 2.14 or later (experts.py "
                 "_is_fused_impl_supported); set fused_grouped_mlp false")]
    return []


def te_tuple(te_version: str) -> tuple[int, ...]:
    """A Transformer Engine version as (major, minor), for comparisons."""
    return tuple(int(x) for x in te_version.split(".")[:2])


def fused_mlp_on(layout: Any) -> bool:
    """Whether a (possibly partly bound) layout runs the fused grouped MLP."""
    return bool(getattr(layout, "fused_grouped_mlp", False))


def _fused_mlp_blockers(f: Facts) -> list[str]:
    """Why Megatron Core would refuse this layout's fused grouped MLP
    (`megatron/core/transformer/moe/experts.py::TEGroupedMLP._is_fused_impl_supported`, which
    asserts "Fused GroupedMLP is not supported for this configuration"; Transformer Engine's
    `_GroupedMLP_CuTeGEMMBase.is_supported`: compute capability 10, block-scaled recipes)."""
    m, L, out = f.model, f.layout, []
    if not fused_mlp_on(L):
        return out
    if not m.is_moe:
        out.append("the model has no experts")
    elif m.activation != "swiglu":
        out.append(f"the experts' activation is {m.activation}, and the fused kernel takes "
                   "SwiGLU only")
    if L.etp > 1:
        out.append(f"etp is {L.etp}, and the fused kernel runs without expert tensor "
                   "parallelism")
    if f.training.precision not in ("mxfp8", "nvfp4"):
        out.append(f"the precision is {f.training.precision}, and the fused kernel runs the "
                   "block-scaled recipes (mxfp8, nvfp4)")
    if f.cluster is not None and f.cluster.architecture != "blackwell":
        out.append(f"{f.cluster.gpu} is {f.cluster.architecture}, and the fused kernel is "
                   "built for Blackwell (SM 10.x)")
    return out


@rule("fused_grouped_mlp_support", "megatron/core/transformer/moe/experts.py::"
      "TEGroupedMLP._is_fused_impl_supported (SwiGLU experts, no "
      "expert tensor parallelism; TE's CuTe-DSL kernel: Blackwell, mxfp8 or nvfp4)",
      lambda f: ("Megatron Core cannot run this plan's fused grouped MLP: "
                 + "; ".join(_fused_mlp_blockers(f)) + ". Set fused_grouped_mlp false"),
      targets=MEGATRON, axes=("fused_grouped_mlp",))
def _fused_mlp(f: Facts) -> bool:
    return not _fused_mlp_blockers(f)


option_rule(
    "fused_grouped_mlp_offload", "megatron/core/transformer/moe/experts.py::"
    "TEGroupedMLP._is_fused_impl_supported (no expert_fc1 or moe_act offload: \"Selective "
    "expert_fc1/moe_act offload is only supported unfused\")",
    lambda f: ((Combo((off("expert_fc1"),)), Combo((off("moe_act"),)))
               if fused_mlp_on(f.layout) else ()),
    "the fused grouped MLP keeps the experts' activations on the GPU; drop those offloads or "
    "set fused_grouped_mlp false", targets=MEGATRON, axes=("fused_grouped_mlp",))


def _dispatch_name(layout: Any) -> str:
    return (f"flex with {layout.flex_backend}" if layout.dispatcher == "flex"
            else layout.dispatcher)


@rule("ep_overlap_moe_graph", _TC + " (CUDA graph scope on moe and mlp is not supported with "
      "overlap_moe_expert_parallel_comm under --cuda-graph-impl transformer_engine)",
      lambda f: ("EP overlap cannot run beside per-layer CUDA graphs of the whole MoE layer, "
                 "which an MoE padded to capacity captures: turn EP overlap off, capture the "
                 "full iteration (cuda_graph_scope full_iteration), or drop the padding "
                 "(moe_pad_expert_input_to_capacity false)"),
      targets=MEGATRON, axes=("ep_overlap", "cuda_graphs"))
def _ovl_moe_graph(f: Facts) -> bool:
    L = f.layout
    return (not L.ep_overlap or not L.cuda_graphs or full_iteration(L)
            or not f.model.is_moe or not f.training.static_moe_shapes)


@rule("ep_overlap_mtp", _TC + " (MTP supports at most one layer with "
      "overlap_moe_expert_parallel_comm)",
      lambda f: (f"EP overlap takes at most one MTP layer; the model has {f.model.mtp_layers}: "
                 "turn EP overlap off"), axes=("ep_overlap",))
def _ovl_mtp(f: Facts) -> bool:
    return not f.layout.ep_overlap or f.model.mtp_layers <= 1


# ---------------------------------------------------------------------------- the device
def runs_cuda(cluster: Any) -> bool:
    """Whether the cluster's devices run CUDA kernels (None: not known, so not refused). A
    host measured by `moeplan calibrate` on CPUs (architecture cpu) has no kernel a CUDA graph
    could capture and no device memory for TE's userbuffers: the search never turns these
    settings on there, and `moeplan run` would drop them, so they are never priced."""
    return cluster is None or cluster.architecture != "cpu"


def _no_cuda_words(f: Facts, what: str, flags: str, field: str) -> str:
    return (f"{f.cluster.gpu} is a CPU host (architecture cpu) with no CUDA device, and "
            f"{what}: drop {flags} ({field} false in a plan file), or plan for a GPU cluster")


@rule("cuda_graphs_need_cuda", "megatron/core/transformer/cuda_graphs.py (a CUDA graph "
      "captures the kernels of a CUDA device: not on a CPU host)",
      lambda f: _no_cuda_words(f, "CUDA graphs capture the kernels of one",
                               "--cuda-graphs and --cuda-graph-scope", "cuda_graphs"),
      axes=("cuda_graphs",), needs=("cluster",))
def _graphs_cuda(f: Facts) -> bool:
    return not getattr(f.layout, "cuda_graphs", False) or runs_cuda(f.cluster)


@rule("tp_comm_overlap_needs_cuda", "transformer_engine/pytorch/module/base.py::initialize_ub "
      "(TP comm overlap runs on userbuffers in CUDA device memory: not on a CPU host)",
      lambda f: _no_cuda_words(f, "TP comm overlap runs on Transformer Engine's userbuffers "
                               "in CUDA device memory", "--tp-comm-overlap", "tp_comm_overlap"),
      axes=("tp_comm_overlap",), needs=("cluster",))
def _tp_overlap_cuda(f: Facts) -> bool:
    return not getattr(f.layout, "tp_comm_overlap", False) or runs_cuda(f.cluster)


# ---------------------------------------------------------------------------- precision
@rule("precision_supported", "megatron/core/fp8_utils.py (Transformer Engine recipes by GPU "
      "architecture)",
      lambda f: (f"{f.cluster.gpu} ({f.cluster.architecture}) cannot run "
                 f"{f.training.precision}; use bf16"
                 + (" or an fp8 recipe" if f.cluster.fp8_tflops else "")), needs=("cluster",))
def _precision(f: Facts) -> bool:
    return f.cluster.supports(f.training.precision)


@rule("fp8_param_gather_needs_dist_opt", _ARGS + " (--fp8-param-gather only with the "
      "distributed optimizer)", lambda f: "FP8 parameter all-gather needs the distributed "
      "optimizer; turn fp8_param_gather off or use dist-opt", axes=("distributed_optimizer",))
def _fp8_gather(f: Facts) -> bool:
    return not f.training.fp8_param_gather or f.layout.distributed_optimizer


@rule("precision_aware_optimizer_needs_dist_opt", "megatron/core/optimizer/__init__.py::"
      "get_megatron_optimizer (--use-precision-aware-optimizer, which optimizer CPU offload and "
      "bf16 Adam moments turn on, only with the distributed optimizer)",
      lambda f: "optimizer CPU offload and bf16 optimizer moments run in Megatron's "
      "precision-aware optimizer, which needs the distributed optimizer; use dist-opt, or set "
      "optimizer_offload_fraction 0 and optimizer_moments_dtype fp32",
      targets=MEGATRON, axes=("distributed_optimizer",))
def _precision_aware(f: Facts) -> bool:
    offload = f.choices is not None and f.choices.optimizer_offload_fraction > 0
    return f.layout.distributed_optimizer or not (
        offload or f.training.optimizer_moments_dtype == "bf16")


@rule("optimizer_offload_fp8_param_gather", _ARGS + " (optimizer CPU offload with "
      "--fp8-param-gather needs --fp8-recipe delayed)", lambda f: "optimizer offload with FP8 "
      "parameter all-gather needs the delayed FP8 recipe; set optimizer_offload_fraction 0 or "
      "fp8_param_gather false", targets=MEGATRON, needs=("choices",))
def _opt_offload_fp8(f: Facts) -> bool:
    return not (f.choices.optimizer_offload_fraction > 0 and f.training.fp8_param_gather
                and f.training.precision != "fp8-delayed")


# ---------------------------------------------------------------------------- software stack
STACK_AGE = tuple(reversed(STACKS))
"""The software stacks a plan can be priced on (`TrainingSpec.software_stack`), oldest first:
each runs everything the older ones run."""


@dataclass(frozen=True)
class StackFeature:
    """A plan feature an older software stack lacks: the oldest stack that has it, the
    Megatron-LM release that added it (the first release tag whose sources define its flag),
    and the Megatron Core config field that carries it (`TransformerConfig`)."""

    words: str
    since: str           # the oldest stack in STACK_AGE that runs it
    release: str         # the release that added it, with the flag
    fix: str             # how a plan does without it
    field: str | None    # the config field of its flag (None: an environment switch)
    config: str = "TransformerConfig"  # the Megatron Core config class holding `field`


_FP8_RECIPES = StackFeature("FP8 current-scaling, blockwise and MXFP8 recipes", "mcore-2024",
                            "Megatron Core 0.12 (--fp8-recipe)", "set precision bf16",
                            "fp8_recipe")
STACK_FEATURES: dict[str, StackFeature] = {
    "moe": StackFeature("MoE layers", "mcore-2024", "Megatron Core 0.4 (--num-experts; the "
                        "alltoall dispatcher from 0.6)", "plan a dense model", "num_moe_experts"),
    "cp": StackFeature("context parallelism", "mcore-2024",
                       "Megatron Core 0.4 (--context-parallel-size)", "set cp 1",
                       "context_parallel_size"),
    "tp_comm_overlap": StackFeature("TP comm overlap", "mcore-2024",
                                    "Megatron Core 0.4 (--tp-comm-overlap)",
                                    "set tp_comm_overlap false", "tp_comm_overlap"),
    "cuda_graphs": StackFeature("CUDA graphs", "mcore-2024", "Megatron Core 0.7 "
                                "(enable_cuda_graph)", "set cuda_graphs false",
                                "enable_cuda_graph"),
    "full_iteration": StackFeature("whole-step CUDA graphs", "current", "Megatron Core 0.14 "
                                   "(--cuda-graph-scope full_iteration)",
                                   "set cuda_graph_scope layer", "cuda_graph_scope"),
    "deepep": StackFeature("the flex dispatcher", "mcore-2024",
                           "Megatron Core 0.12 (--moe-enable-deepep)", "set dispatcher alltoall",
                           "moe_enable_deepep"),
    "hybridep": StackFeature("the flex dispatcher's HybridEP backend", "current",
                             "Megatron Core 0.16 (--moe-flex-dispatcher-backend hybridep)",
                             "set flex_backend deepep", "moe_flex_dispatcher_backend"),
    "ep_overlap": StackFeature("EP overlap", "current", "Megatron Core 0.14 "
                               "(--overlap-moe-expert-parallel-comm)", "set ep_overlap false",
                               "overlap_moe_expert_parallel_comm"),
    "fused_grouped_mlp": StackFeature("the fused grouped MLP", "current", "Megatron Core 0.18 "
                                      "with Transformer Engine 2.14 "
                                      "(NVTE_CUTEDSL_FUSED_GROUPED_MLP=1)",
                                      "set fused_grouped_mlp false", None),
    "fp8-delayed": StackFeature("FP8 (delayed scaling)", "megatron-2023", "Megatron-LM 23.04 "
                                "(--fp8-e4m3, Transformer Engine)", "set precision bf16", "fp8"),
    "fp8-tensorwise": _FP8_RECIPES, "fp8-blockwise": _FP8_RECIPES, "mxfp8": _FP8_RECIPES,
    "nvfp4": StackFeature("NVFP4", "current", "Megatron Core 0.15 (--fp4-format)",
                          "set precision mxfp8", "fp4"),
    "selective_recompute": StackFeature(
        "selective recompute", "megatron-2022", "Megatron-LM of May 2022 (--recompute-"
        "granularity selective, Korthikanti et al. 2022)", "recompute whole layers (full)",
        "recompute_granularity"),
    "recompute_modules": StackFeature(
        "per-module recompute beyond core attention", "mcore-2024", "Megatron Core 0.12 "
        "(--recompute-modules)", "recompute core_attn or whole layers (full)",
        "recompute_modules"),
    "distributed_optimizer": StackFeature(
        "the distributed optimizer", "megatron-2023", "Megatron-LM of June 2022 "
        "(--use-distributed-optimizer, merged on 2022-06-08; first tagged in 23.04)",
        "replicate the optimizer over data parallelism (a plan file's layout: "
        "distributed_optimizer false; `estimate --stack` builds it so)",
        "use_distributed_optimizer", "DistributedDataParallelConfig"),
    "optimizer_offload": StackFeature(
        "optimizer CPU offload", "mcore-2024", "Megatron Core 0.12 (--optimizer-cpu-offload)",
        "keep the optimizer on the GPU (optimizer_offload_fraction 0)", "optimizer_cpu_offload",
        "OptimizerConfig"),
    "activation_offload": StackFeature(
        "fine-grained activation offloading", "current", "Megatron Core 0.16 "
        "(--fine-grained-activation-offloading)", "recompute instead of offloading",
        "fine_grained_activation_offloading"),
}
"""What each software stack can run, checked against Megatron-LM's release tags: a plan priced
on an older stack uses none of what that stack's Megatron did not have yet."""


def stack_lacks(stack: str, feature: str) -> bool:
    """Whether the software stack `stack` predates `feature` (STACK_FEATURES)."""
    return STACK_AGE.index(stack) < STACK_AGE.index(STACK_FEATURES[feature].since)


def shards_optimizer(stack: str, target: str = "megatron") -> bool:
    """Whether a plan of `target` on `stack` may shard its optimizer states (the distributed
    optimizer): always for moeplan's runtime, for Megatron from June 2022 (STACK_FEATURES).
    What an older stack's layouts default to and its search enumerates."""
    return target != "megatron" or not stack_lacks(stack, "distributed_optimizer")


def _stack_words(training: Any, feature: str) -> str:
    f = STACK_FEATURES[feature]
    return (f"software_stack {training.software_stack} predates {f.words}, which "
            f"{f.release} added: {f.fix}, or price the plan on a stack that has it "
            f"(--stack {f.since}" + (" or newer)" if f.since != "current" else ")"))


def _stack_missing(f: Facts) -> list[str]:
    """The layout features (bound so far) the plan's software stack does not have."""
    L, t, out = f.layout, f.training, []
    if getattr(L, "dispatcher", "alltoall") == "flex" and f.model.is_moe:
        out.append("hybridep" if getattr(L, "flex_backend", "") == "hybridep" else "deepep")
    if getattr(L, "ep_overlap", False):
        out.append("ep_overlap")
    if getattr(L, "cuda_graphs", False):
        out.append("full_iteration" if full_iteration(L) else "cuda_graphs")
    if getattr(L, "tp_comm_overlap", False):
        out.append("tp_comm_overlap")
    if fused_mlp_on(L):
        out.append("fused_grouped_mlp")
    if getattr(L, "cp", 1) > 1:
        out.append("cp")
    if getattr(L, "distributed_optimizer", False):
        out.append("distributed_optimizer")
    # HybridEP and whole-step graphs are checked alone: a stack that has them has DeepEP and
    # per-layer graphs too (STACK_AGE)
    return [k for k in out if stack_lacks(t.software_stack, k)]


def _stack_spec_missing(f: Facts) -> list[str]:
    """The model and precision features the plan's software stack does not have."""
    out = ["moe"] if f.model.is_moe else []
    if f.training.precision in STACK_FEATURES:
        out.append(f.training.precision)
    return [k for k in out if stack_lacks(f.training.software_stack, k)]


@rule("stack_model", "Megatron-LM release tags (MoE layers or a precision recipe on a software "
      "stack that predates them)",
      lambda f: "; ".join(_stack_words(f.training, k) for k in _stack_spec_missing(f)),
      targets=MEGATRON)
def _stack_spec(f: Facts) -> bool:
    return not _stack_spec_missing(f)


def _stack_layout_rule(name: str, axes: tuple[str, ...], features: tuple[str, ...]) -> None:
    """A rule refusing the layout features of `features` the stack lacks, evaluated once `axes`
    are bound (the enumeration prunes by it where it binds them)."""
    def missing(f: Facts) -> list[str]:
        return [k for k in _stack_missing(f) if k in features]

    words = " or ".join(dict.fromkeys(STACK_FEATURES[k].words for k in features))
    source = f"Megatron-LM release tags ({words} on a software stack that predates it)"
    # today's stack has every feature: the enumeration's hot path returns at the first test
    RULES.append(Rule(name, source, ok=lambda f: f.training.software_stack == "current"
                      or not missing(f),
                      why=lambda f: "; ".join(_stack_words(f.training, k) for k in missing(f)),
                      targets=MEGATRON, axes=frozenset(axes)))


STACK_RULES: dict[str, tuple[str, ...]] = {
    "stack_cp": ("cp",), "stack_dispatcher": ("deepep", "hybridep"),
    "stack_ep_overlap": ("ep_overlap",), "stack_tp_comm_overlap": ("tp_comm_overlap",),
    "stack_cuda_graphs": ("cuda_graphs", "full_iteration"),
    "stack_fused_grouped_mlp": ("fused_grouped_mlp",),
    "stack_distributed_optimizer": ("distributed_optimizer",)}
"""The layout rules of the software stack, each with the STACK_FEATURES it refuses; a rule
reads the layout axis its name ends with, so the enumeration prunes by it where it binds that
axis."""
for _name, _features in STACK_RULES.items():
    _stack_layout_rule(_name, (_name.removeprefix("stack_"),), _features)


def _stack_feature_of(option: Option) -> str | None:
    """The STACK_FEATURES entry a module option needs: any offload, recompute of a module
    other than core attention (or the whole layer), selective recompute of core attention."""
    kind, module = option
    if kind == "offload":
        return "activation_offload"
    if module == "core_attn":
        return "selective_recompute"
    return None if module == "full" else "recompute_modules"


STACK_MODULE_OPTIONS = (*(off(m) for m in OFFLOAD_NAMES), *(rec(m) for m in RECOMPUTE_NAMES))


def _stack_module_combos(f: Facts) -> tuple[Combo, ...]:
    """The module options the plan's software stack does not run, each alone (the planner's
    menu drops them)."""
    stack = f.training.software_stack
    return tuple(Combo((o,)) for o in STACK_MODULE_OPTIONS
                 if (k := _stack_feature_of(o)) is not None and stack_lacks(stack, k))


def _stack_module_features(f: Facts) -> list[str]:
    """The STACK_FEATURES the plan's module choices use and its stack lacks."""
    used = {_stack_feature_of(o) for s in f.sets() for o in s} - {None}
    return [k for k in STACK_FEATURES if k in used
            and stack_lacks(f.training.software_stack, k)]


RULES.append(Rule(
    "stack_modules", "Megatron-LM release tags (recompute or offload modules on a software "
    "stack that predates them)",
    ok=lambda f: f.training.software_stack == "current" or not _stack_module_features(f),
    why=lambda f: "; ".join(_stack_words(f.training, k) for k in _stack_module_features(f)),
    targets=MEGATRON, needs=frozenset({"choices"}), combos=_stack_module_combos))


@rule("stack_optimizer_offload", "Megatron-LM release tags (optimizer CPU offload on a "
      "software stack that predates it)",
      lambda f: _stack_words(f.training, "optimizer_offload"), targets=MEGATRON,
      needs=("choices",))
def _stack_optimizer_offload(f: Facts) -> bool:
    return not (f.choices.optimizer_offload_fraction > 0
                and stack_lacks(f.training.software_stack, "optimizer_offload"))


# ---------------------------------------------------------------------------- the model
@rule("expert_bias_needs_sigmoid", _TC + " (expert bias for aux-loss-free routing only with "
      "sigmoid or sqrtsoftplus scores)", lambda f: "the router's expert bias needs sigmoid "
      "scores in Megatron; set router_score: sigmoid or router_expert_bias: false",
      targets=MEGATRON)
def _expert_bias(f: Facts) -> bool:
    return not (f.model.is_moe and f.model.router_expert_bias and f.model.router_score != "sigmoid")


@rule("top1_softmax_needs_pre_softmax", _TC + " (--moe-router-pre-softmax when top-k is 1)",
      lambda f: "top-1 softmax routing renormalised over one expert has no gradient; Megatron "
      "needs the softmax over all experts: set norm_topk_prob: false", targets=MEGATRON)
def _top1(f: Facts) -> bool:
    m = f.model
    return not (m.is_moe and m.moe_top_k == 1 and m.router_score == "softmax"
                and m.norm_topk_prob)


@rule("expert_bias_linear_needs_etp1", _TC + " (bias in MoE only with ETP == 1)",
      lambda f: (f"the model's linear biases are exported as --add-bias-linear, which Megatron "
                 f"takes with experts only at etp=1, not etp={f.layout.etp}"),
      targets=MEGATRON, axes=("etp",))
def _bias_etp(f: Facts) -> bool:
    m = f.model
    return not (m.is_moe and (m.attn_out_bias or m.mlp_bias)) or f.layout.etp == 1


@rule("vocab_divisible_by_tp", _RUNTIME + " (the vocabulary-parallel embedding and loss split "
      "the vocabulary evenly; Megatron pads instead)",
      lambda f: (f"vocab {f.model.vocab_size} is not divisible by tp={f.layout.tp}; re-plan with "
                 f"a tp dividing it, or pad vocab_size in the model spec to a multiple of "
                 f"{f.layout.tp}"), targets=MOEPLAN, axes=("tp",))
def _vocab(f: Facts) -> bool:
    return f.model.vocab_size % f.layout.tp == 0


MODEL_FIX = ("no flag avoids it: `moeplan export PLAN --format megatron` runs this model on "
             "Megatron-LM")


def model_features_not_executed(model: Any) -> list[str]:
    """Model features the runtime does not build yet."""
    out = []
    if any(model.sliding_layers()):
        out.append("sliding-window attention")
    if model.attention_sinks:
        out.append("attention sinks")
    if model.position_embedding != "rope":
        out.append("learned position embeddings")
    if model.is_moe and model.mlp_bias:
        out.append("biases on expert linears (mlp_bias with experts)")
    return out


@rule("model_features_executed", _RUNTIME + " (runtime/model.py builds GQA/MLA attention with "
      "RoPE, RMSNorm, SwiGLU/GELU MLPs, routed and shared experts without biases)",
      lambda f: f"{', '.join(model_features_not_executed(f.model))} ({MODEL_FIX})",
      targets=MOEPLAN)
def _model_features(f: Facts) -> bool:
    return not model_features_not_executed(f.model)


@rule("fp8_param_gather_executed", _RUNTIME + " (the runtime keeps bf16 weights and quantises "
      "them per GEMM)", lambda f: "FP8 parameter all-gather is not executed by `moeplan run`: "
      "set `fp8_param_gather: false` in the plan's training, or run it with Megatron "
      "(`moeplan export PLAN --format megatron` writes --fp8-param-gather)", targets=MOEPLAN)
def _fp8_gather_run(f: Facts) -> bool:
    return not f.training.fp8_param_gather


@rule("pad_to_capacity_executed", _RUNTIME + " (the runtime drops the copies over an expert's "
      "capacity but keeps its shapes dynamic)", lambda f: "padding expert inputs to capacity "
      "is not executed by `moeplan run` (it computes the same loss without padding, but not as "
      "priced): set `moe_pad_expert_input_to_capacity: false` in the plan's training, or run "
      "it with Megatron (`moeplan export PLAN --format megatron` writes "
      "--moe-pad-expert-input-to-capacity)", targets=MOEPLAN)
def _pad_run(f: Facts) -> bool:
    return not f.training.moe_pad_expert_input_to_capacity


# ---------------------------------------------------------------------------- module options
option_rule(
    "ep_overlap_recompute", _TC + " (no full recompute and no `moe` in recompute_modules with "
    "overlap_moe_expert_parallel_comm)",
    lambda f: (Combo((rec("full"),)), Combo((rec("moe"),))) if f.layout.ep_overlap else (),
    "EP overlap excludes full and `moe` recompute; drop them or turn EP overlap off",
    axes=("ep_overlap",))
option_rule(
    "mla_up_proj_needs_mla", _TC + " (mla_up_proj in recompute_modules only with "
    "multi_latent_attention)",
    lambda f: (Combo((rec("mla_up_proj"),)),) if f.model.attention != "mla" else (),
    "mla_up_proj recompute needs MLA attention; drop it")
MOE_MODULE_OPTIONS = (rec("moe_act"), rec("moe"), rec("shared_experts"), off("expert_fc1"),
                      off("moe_act"))
"""The module options that name parts of an MoE layer (its experts, their activation, its
shared experts): a dense model has none of them."""
option_rule(
    "moe_modules_need_moe", "moeplan/specs/modules.py (moe_act, moe, shared_experts and "
    "expert_fc1 are parts of MoE layers: a dense model has none to recompute or offload)",
    lambda f: () if f.model.is_moe else tuple(Combo((o,)) for o in MOE_MODULE_OPTIONS),
    "the model has no MoE layers, so nothing would be recomputed or offloaded as asked (and "
    "the export would pass the names on); drop them from --recompute and --offload (the "
    "plan's choices)")
option_rule(
    "offload_attn_proj_needs_core_attn", _TC + " (attn_proj cannot be in offload_modules "
    "without core_attn: its input is core_attn's output, needed in core_attn's backward)",
    lambda f: (Combo((off("attn_proj"),), (off("core_attn"),)),),
    "offload core_attn too, or drop attn_proj from the offloads", targets=MEGATRON)
option_rule(
    "moe_recompute_excludes_moe_offload", _TC + " (no expert_fc1 or moe_act offload while "
    "recomputing the whole MoE layer)",
    lambda f: (Combo((rec("moe"), off("expert_fc1"))), Combo((rec("moe"), off("moe_act")))),
    "drop `moe` from the recompute or expert_fc1/moe_act from the offloads", targets=MEGATRON)
option_rule(
    "fp8_delayed_recompute", _TC + " (delayed scaling does not support moe_act and layernorm "
    "recompute for fp8)",
    lambda f: ((Combo((rec("moe_act"),)), Combo((rec("layernorm"),)))
               if f.training.precision == "fp8-delayed" else ()),
    "the delayed FP8 recipe cannot recompute moe_act or layernorm; drop them or use another "
    "FP8 recipe", targets=MEGATRON)
option_rule(
    "cuda_graphs_recompute", _TC + " (full recompute only with full-iteration CUDA graphs; no "
    "`moe` recompute with the moe_router graph scope of --cuda-graph-impl transformer_engine)",
    lambda f: ((Combo((rec("full"),)),) + ((Combo((rec("moe"),)),) if f.model.is_moe else ())
               if f.layout.cuda_graphs and not full_iteration(f.layout) else ()),
    "per-layer CUDA graphs exclude full recompute (and `moe` recompute in MoE models); drop "
    "them, turn cuda_graphs off, or capture the full iteration (cuda_graph_scope "
    "full_iteration)", targets=MEGATRON, axes=("cuda_graphs",))
option_rule(
    "full_iteration_graphs_offload", _TC + " (fine-grained activation offloading under "
    "--cuda-graph-impl full_iteration needs fine_grained_offloading_max_inflight_offloads; "
    "with moe_paged_stash no expert_fc1 or moe_act offload)",
    lambda f: (tuple(Combo((off(m),)) for m in OFFLOAD_NAMES) if full_iteration(f.layout)
               else ()),
    "a full-iteration CUDA graph is exported without activation offloading; drop the offloads "
    "or capture per layer (cuda_graph_scope layer)", targets=MEGATRON, axes=("cuda_graphs",))


def _full_alone(f: Facts) -> tuple[Combo, ...]:
    return tuple(Combo((rec("full"), rec(m))) for m in
                 ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                  "shared_experts"))


option_rule("full_recompute_alone", _ARGS + " (--recompute-granularity full recomputes whole "
            "layers; --recompute-modules is read only with selective)", _full_alone,
            "full recomputes the whole layer; do not combine it with per-module names")


# ---------------------------------------------------------------------------- whole plans
@rule("uniform_stage_choices", _TC + " (recompute_modules and offload_modules are one setting "
      "for every layer of every pipeline stage)",
      lambda f: ("Megatron applies one recompute set and one offload set to every pipeline "
                 "stage, but the plan's differ by stage (" + f.choices.describe_per_rank()
                 + "); re-plan with `--target megatron` (one set for all stages, priced that "
                 "way), or run it with `moeplan run`"), targets=MEGATRON, needs=("choices",))
def _uniform(f: Facts) -> bool:
    return f.choices.uniform()


@rule("stage_choices_per_rank", "moeplan/specs/layout.py::Choices (one recompute and one "
      "offload set per pipeline rank)",
      lambda f: (f"recompute/offload list {len(f.choices.recompute)}/{len(f.choices.offload)} "
                 f"sets, but pp={f.layout.pp}: give one set per pipeline rank"),
      needs=("choices",))
def _per_rank(f: Facts) -> bool:
    c, pp = f.choices, f.layout.pp
    return all(len(sets) in (0, 1, pp) for sets in (c.recompute, c.offload))


def _stages_or_error(f: Facts) -> tuple[list[list[str]] | None, str]:
    from ..errors import SpecError
    from .stage_layout import plan_stages

    try:
        return plan_stages(f.model, f.layout, f.choices), ""
    except SpecError as e:  # a layout from the command line or from a plan file: name both
        return None, str(e).replace("--stage-layout", "--stage-layout (a plan file's "
                                    "`choices.stage_layout`)", 1)


@rule("stage_layout_valid", _LAYOUT + " (E first, L last, every decoder and MTP layer once, "
      "pp·vpp stages)", lambda f: _stages_or_error(f)[1], needs=("choices",))
def _stage_layout(f: Facts) -> bool:
    return _stages_or_error(f)[0] is not None


def _mtp_ok_megatron(stages: list[list[str]], pp: int, vpp: int) -> bool:
    """MTP layers after every decoder layer, all in one virtual stage that is the last chunk of
    its rank, never on pp rank 0 before its last chunk (Megatron's layout checks)."""
    where = [i for i, st in enumerate(stages) if "m" in st]
    if not where:
        return True
    flat = [k for st in stages for k in st]
    if "t" in flat[flat.index("m"):]:
        return False
    if len(where) > 1:
        return False
    s = where[0]
    return s // pp == vpp - 1  # virtual stage index v·pp + r: the rank's last chunk


@rule("mtp_placement", _LAYOUT + " (MTP after the decoder layers, all MTP layers in one "
      "virtual stage that is its rank's last chunk)",
      lambda f: ("the MTP layers must follow every decoder layer and sit together in the last "
                 "model chunk of one pipeline rank; give a --stage-layout that puts every m "
                 "next to the loss L"), targets=MEGATRON, needs=("choices",))
def _mtp_megatron(f: Facts) -> bool:
    stages, _ = _stages_or_error(f)
    return stages is None or _mtp_ok_megatron(stages, f.layout.pp, f.layout.vpp)


@rule("mtp_on_last_stage", _RUNTIME + " (runtime/pipeline.py runs MTP with the loss, on the "
      "last pipeline stage)",
      lambda f: ("MTP layers outside the last pipeline stage (put every m with the loss L: "
                 f"`moeplan estimate ... --stage-layout '{mtp_on_last_stage(f)}' -o "
                 "plan.json`)"), targets=MOEPLAN, needs=("choices",))
def _mtp_runtime(f: Facts) -> bool:
    stages, _ = _stages_or_error(f)
    return stages is None or f.layout.pp == 1 or not any("m" in st for st in stages[:-1])


def mtp_on_last_stage(f: Facts) -> str:
    """The plan's stage layout with every MTP layer moved to the last stage, before the loss."""
    from .stage_layout import format_stage_layout

    stages, _ = _stages_or_error(f)
    assert stages is not None
    moved = [[k for k in st if k != "m"] for st in stages]
    mtp = sum(st.count("m") for st in stages)
    last = moved[-1]
    at = last.index("L") if "L" in last else len(last)
    moved[-1] = last[:at] + ["m"] * mtp + last[at:]
    return format_stage_layout(moved)


# ---------------------------------------------------------------------------- reading the table
BY_NAME: dict[str, Rule] = {r.name: r for r in RULES}
assert len(BY_NAME) == len(RULES), "rule names are unique"


def rules_for(target: str) -> list[Rule]:
    check_target(target)
    return [r for r in RULES if target in r.targets]


def check_target(target: str) -> None:
    if target not in TARGETS:
        from ..errors import SpecError

        raise SpecError(f"target: {target!r} is not an executor moeplan plans for; use "
                        f"{' or '.join(TARGETS)}.")


def violations(f: Facts, target: str = "megatron") -> list[tuple[str, str]]:
    """Every rule of `target` the facts break, as (rule name, what is wrong and the fix)."""
    return [(r.name, r.why(f)) for r in rules_for(target) if r.applies(f, target) and not r.ok(f)]


def layout_rules(target: str, axes: Sequence[str]) -> list[list[Rule]]:
    """The layout rules of a target by the enumeration's binding order: entry i holds the rules
    evaluable once axes[:i+1] (each a field name or a group of names separated by '/') are
    bound and not before. Rules reading choices are left out; the cluster is known to the
    enumeration, so cluster rules come first."""
    out: list[list[Rule]] = [[] for _ in axes]
    bound: set[str] = set()
    first = [r for r in rules_for(target) if r.combos is None and "choices" not in r.needs]
    placed: set[str] = set()
    for i, group in enumerate(axes):
        bound |= set(group.split("/"))
        for r in first:
            if r.name not in placed and r.axes <= bound:
                out[i].append(r)
                placed.add(r.name)
    return out


def option_rules(f: Facts, target: str) -> tuple[Combo, ...]:
    """The module-option combinations a layout of `target` must not pick (any rank), from every
    option rule of the target under these facts (the choices need not be known)."""
    out: list[Combo] = []
    for r in rules_for(target):
        if r.combos is not None:
            out += r.combos(f)
    return tuple(dict.fromkeys(out))


def allowed(options: Iterable[Option], combos: Iterable[Combo]) -> tuple[list[Option], list[Combo]]:
    """(options that may be picked at all, combos of two or more options): a combo of one
    option with nothing absent removes that option."""
    combos = list(combos)
    banned = {c.present[0] for c in combos if len(c.present) == 1 and not c.absent}
    opts = [o for o in options if tuple(o) not in banned]
    return opts, [c for c in combos if not (len(c.present) == 1 and not c.absent)]


def uniform_stage_choices(target: str) -> bool:
    """Whether one module set must serve every pipeline rank (Megatron's one setting)."""
    return "uniform_stage_choices" in {r.name for r in rules_for(target)}


# ---------------------------------------------------------------------------- launches
TE_VERSION = "2.12"  # the Transformer Engine the exported launch is written for


@dataclass(frozen=True)
class Requirement:
    """Something a Megatron launch must carry for the plan to start as priced: an environment
    variable `pretrain_gpt.py` asserts, or a flag its config checks demand; when it applies
    (`when(facts, te_version)`), and its source."""

    kind: str  # "env" or "flag"
    name: str
    value: str | None  # the value, or what it is when `value_of` computes it from the plan
    source: str
    why: str
    when: Callable[[Facts, tuple[int, ...]], bool]
    value_of: Callable[[Facts], str] | None = None

    def value_for(self, f: Facts) -> str:
        """The value this plan's launch sets."""
        return self.value_of(f) if self.value_of is not None else str(self.value)


def _pre_blackwell(f: Facts) -> bool:
    return f.cluster is None or f.cluster.architecture in ("ampere", "hopper")


def _offloads(f: Facts) -> bool:
    return f.choices is not None and any(o for o in f.choices.offload)


def _hybridep(f: Facts) -> bool:
    L = f.layout
    return (f.cluster is not None and L.ep > 1 and L.dispatcher == "flex"
            and L.flex_backend == "hybridep")


def _ep_ranks_per_domain(f: Facts) -> str:
    """The EP group's ranks inside one NVLink domain (its worst-placed group's), on the
    domains the job fills (`ClusterSpec.usable_domain`)."""
    world = f.layout.world_size
    return str(domain_span(f.layout, "ep", f.cluster.usable_domain(world))[1])


def _mnnvl(f: Facts) -> str:
    c = f.cluster
    return "1" if c.nvlink_domain_gpus > c.gpus_per_node else "0"


_BRIDGE_TOPOLOGY = ("Megatron-Bridge scripts/performance/utils/utils.py::"
                    "apply_target_topology_environment (HybridEP's topology")


REQUIREMENTS: list[Requirement] = [
    Requirement("env", "CUDA_DEVICE_MAX_CONNECTIONS", "1", _ARGS + " (tensor or context "
                "parallelism before Blackwell, without EP overlap)", "one CUDA connection keeps "
                "the TP/CP communication kernels in order with the GEMMs that wait on them",
                lambda f, te: _pre_blackwell(f) and (f.layout.tp > 1 or f.layout.cp > 1)
                and not f.layout.ep_overlap),
    Requirement("env", "NVTE_CPU_OFFLOAD_V1", "1", _ARGS + " (fine-grained activation "
                "offloading with Transformer Engine ≥ 2.10)", "TE's v1 offload path moves "
                "activations only, never weights",
                lambda f, te: _offloads(f) and te >= (2, 10)),
    Requirement("env", "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "EP ranks per NVLink domain",
                _BRIDGE_TOPOLOGY + ", with the flex dispatcher's hybridep backend)",
                "HybridEP sizes its NVLink (TMA) and RDMA halves by the EP ranks that share "
                "one NVLink domain", lambda f, te: _hybridep(f), _ep_ranks_per_domain),
    Requirement("env", "NVLINK_DOMAIN_SIZE", "GPUs per NVLink domain", _BRIDGE_TOPOLOGY +
                ", with the flex dispatcher's hybridep backend)", "the NVLink domain HybridEP "
                "lays its ranks out in", lambda f, te: _hybridep(f),
                lambda f: str(f.cluster.nvlink_domain_gpus)),
    Requirement("env", "USE_MNNVL", "1 on multi-node NVLink (NVL72), else 0", _BRIDGE_TOPOLOGY +
                ", with the flex dispatcher's hybridep backend)", "HybridEP reaches the other "
                "trays of an NVL72 over multi-node NVLink", lambda f, te: _hybridep(f), _mnnvl),
    Requirement("env", "NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1", "transformer_engine/pytorch/ops/"
                "fused/grouped_mlp.py::_GroupedMLP_CuTeGEMMBase.is_supported (with "
                "fused_grouped_mlp)", "Transformer Engine takes the CuTe-DSL grouped MLP only "
                "when this variable is set; --use-transformer-engine-op-fuser alone runs the "
                "unfused ops", lambda f, te: fused_mlp_on(f.layout)),
    Requirement("flag", "--no-rope-fusion", None, _MLA + " (apply_rope_fusion for MLA only "
                "works with YaRN RoPE)", "the plan's MLA uses plain RoPE (--rope-type rope)",
                lambda f, te: f.model.attention == "mla"),
]


def requirements(f: Facts, kind: str, te_version: str = TE_VERSION) -> list[Requirement]:
    """The launch requirements of one kind ("env" or "flag") that apply to these facts."""
    te = te_tuple(te_version)
    return [r for r in REQUIREMENTS if r.kind == kind and r.when(f, te)]


# ---------------------------------------------------------------------------- documentation
def markdown() -> str:
    """The table as docs/EXPORT.md prints it (a test keeps the page equal to this)."""
    rows = ["| rule | targets | what the executor checks | source |", "|---|---|---|---|"]
    for r in RULES:
        rows.append(f"| `{r.name}` | {', '.join(t for t in TARGETS if t in r.targets)} | "
                    f"{r.what or '–'} | `{r.where}` |")
    rows += ["", "| feature (software stack rules) | oldest stack that runs it | added in |",
             "|---|---|---|"]
    rows += [f"| {f.words} ({k}) | `{f.since}` | {f.release} |"
             for k, f in STACK_FEATURES.items()]
    rows += ["", "| launch requirement | value | when | source |", "|---|---|---|---|"]
    for q in REQUIREMENTS:
        head, _, rest = q.source.partition(" (")
        rows.append(f"| `{q.name}` ({q.kind}) | {q.value if q.value is not None else '–'} | "
                    f"{rest[:-1] if rest.endswith(')') else rest} | `{head}` |")
    return "\n".join(rows)


if __name__ == "__main__":  # `python -m moeplan.specs.rules`: the table docs/EXPORT.md prints
    print(markdown())
