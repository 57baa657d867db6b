"""Honest predictions: 80 % intervals, named assumptions and memory margins.

Intervals are split-conformal (Vovk et al. 2005; Lei et al. 2018, "Distribution-free predictive
inference for regression"): the held-out published runs, which never touched the fitted
constants, give log-residuals r = log(published / predicted) tokens/s/GPU; an 80 % interval is
[P·e^q_lo, P·e^q_hi] with q_lo, q_hi the finite-sample conformal quantiles of r at 10 % and 90 %
over the rows of the estimate's regime (GPU generation, dense/MoE, precision family, whether the
layout's TP/EP groups leave the NVLink domain), backing off to a broader regime while a group has
too few rows. The profile is written by `bench/fit_intervals.py` into `intervals.json`, with the
coverage it measured on rows it did not use for the quantiles.

Assumptions: the modelled effects an estimate leans on (EP overlap on its fabric, the flex
dispatcher across NVLink domains, host offload, CP at this length, the precision recipe on this
GPU, the GPU's calibration, TP overlap, balanced routing), each `validated` when fit rows that use
it exist, with their ids. An unvalidated effect with a pessimistic variant (the plan without it,
or its host links at half speed) pulls the interval's low end down to that variant's prediction:
a plan ranked by its low end wins only if it still wins when the effect disappoints.

Memory margin: the memory model's measured relative error (the DeepSeek-V3 anatomy of the
Megatron Core MoE report, worst part) times the peak, plus the HBM the runtime reserves.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from ..specs.cluster import ClusterSpec
from ..specs.layout import Choices, Layout
from ..specs.model import ModelSpec
from ..specs.plan import Assumption
from ..specs.training import STACKS, TrainingSpec
from . import comm as C
from .calibration import Calibration
from .memory import GB

LEVEL = 0.8
MIN_ROWS = 10  # a regime with fewer held-out rows backs off to a broader one


# ----------------------------------------------------------------------------- regimes
def generation(cluster: ClusterSpec) -> str:
    """GPU generation as the interval regimes group it: NVL72 racks apart from HGX boxes."""
    arch = cluster.architecture
    if arch == "blackwell":
        return "blackwell-nvl72" if cluster.nvlink_domain_gpus > cluster.gpus_per_node else (
            "blackwell-hgx")
    return arch


def precision_family(precision: str) -> str:
    return "bf16" if precision == "bf16" else ("fp4" if precision == "nvfp4" else "fp8")


def fabric(layout: Layout, cluster: ClusterSpec) -> str:
    """'scale-out' when a TP, CP or EP group leaves its NVLink domain, else 'nvlink'."""
    for axis, size in (("tp", layout.tp), ("cp", layout.cp), ("ep", layout.ep * layout.etp)):
        if size > 1 and not C.placement(layout, axis, cluster).inside_nvlink:
            return "scale-out"
    return "nvlink"


def regime_keys(model: ModelSpec, cluster: ClusterSpec, precision: str, layout: Layout
                ) -> list[str]:
    """Regime names from the most specific to the pooled one."""
    return regime_names(model, cluster, precision, fabric(layout, cluster))


def regime_names(model: ModelSpec, cluster: ClusterSpec, precision: str, fab: str
                 ) -> list[str]:
    gen, kind = generation(cluster), "moe" if model.is_moe else "dense"
    prec = precision_family(precision)
    return [f"{gen}/{kind}/{prec}/{fab}", f"{gen}/{kind}/{prec}", f"{gen}/{kind}", kind, "all"]


# ----------------------------------------------------------------------------- conformal
def conformal_bounds(residuals: Sequence[float], level: float = LEVEL
                     ) -> tuple[float, float] | None:
    """(q_lo, q_hi) of split conformal at `level`, equal tails: the ⌊(n+1)·α/2⌋-th and
    ⌈(n+1)·(1−α/2)⌉-th smallest residuals; None when n is too small for a finite interval."""
    r = sorted(residuals)
    n = len(r)
    a = (1 - level) / 2
    # ranks of exact products ((n + 1)·0.9 is 9 for n = 8, not 9.000000000000002)
    k_hi = math.ceil((n + 1) * (1 - a) - 1e-9)
    k_lo = math.floor((n + 1) * a + 1e-9)
    if n == 0 or k_hi > n or k_lo < 1:
        return None
    return r[k_lo - 1], r[k_hi - 1]


@dataclass(frozen=True)
class IntervalProfile:
    """What `bench/fit_intervals.py` measured: conformal bounds per regime, the memory model's
    error, and which fit rows exercise each modelled effect."""

    level: float
    regimes: dict[str, tuple[float, float, int]]  # name -> (q_lo, q_hi, held-out rows)
    memory_rel_error: float
    memory_evidence: str
    evidence: dict[str, list[str]]  # assumption key -> fit row ids
    cross_validated: dict[str, Any]  # coverage and width measured on rows unseen by the bounds
    # model preset -> (fit rows, median, lowest, highest published/predicted), for the models
    # whose fit rows are off as a whole (bench/fit_intervals.py::model_evidence)
    models: dict[str, tuple[int, float, float, float]] = field(default_factory=dict)
    # assumption key -> (fit row ids, median published/predicted) for the effects whose fit
    # rows are off as a whole: rows that use an effect but miss it do not validate it
    contradicted: dict[str, tuple[list[str], float]] = field(default_factory=dict)
    # the distance from the fit evidence (`distance`, `widen`): bands of rows whose whole model
    # was left out of the fit (leave-one-model-out), and of those whose family had no other
    # model in it; per model, the band of its own rows held out of a fit that saw its others
    unseen: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    family_unseen: tuple[float, float, int] | None = None
    model_bands: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    seen_models: tuple[str, ...] = ()
    seen_families: tuple[str, ...] = ()
    # the fit rows' range of each dimension (`DIMENSIONS`) and how much a log band widens per
    # doubling beyond it; fit rows per "GPU/precision"
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    per_doubling: float = 0.0
    gpu_precision_rows: dict[str, int] = field(default_factory=dict)
    # what cross-validation measured on the shipped runs, per yardstick (YARDSTICKS): rows,
    # MAPE of tokens/s/GPU, interval coverage and median width, every row predicted by a refit
    # that did not see it (what `moeplan validate` quotes for the rows the shipped fit saw)
    yardsticks: dict[str, dict[str, Any]] = field(default_factory=dict)

    def bounds(self, keys: Sequence[str]) -> tuple[float, float, str, int]:
        for k in keys:
            if k in self.regimes:
                lo, hi, n = self.regimes[k]
                return lo, hi, k, n
        return -0.35, 0.35, "none (no held-out rows)", 0

    def unseen_bounds(self, keys: Sequence[str]) -> tuple[float, float] | None:
        """The band of a model the fit never saw, in the most specific regime that has one."""
        for k in keys:
            if k in self.unseen:
                return self.unseen[k][:2]
        return None


YARDSTICKS = {"leave_one_model_out": "leave one model out",
              "leave_one_release_out": "leave one release out",
              "cross_validated": "configuration split"}
"""intervals.json's cross-validated yardsticks, headline first, with their names."""

MODEL_ROWS = 5
MODEL_RATIO = 1.2
"""A model is missed "as a whole" when at least MODEL_ROWS of its fit rows sit, in the median,
MODEL_RATIO or more off the prediction either way: a bias the constants could not take up
without hurting the other models (its software stack's, not the hardware's)."""


def off_as_a_whole(ratios: Sequence[float], min_rows: int = MODEL_ROWS) -> bool:
    """Whether published/predicted ratios (one model's fit rows, or the fit rows relying on one
    effect, which need only `min_rows` of them) are off as a whole."""
    if not ratios or len(ratios) < min_rows:
        return False
    med = sorted(ratios)[len(ratios) // 2]
    return abs(math.log(med)) >= math.log(MODEL_RATIO)


@lru_cache(maxsize=1)
def default_profile() -> IntervalProfile:
    text = (resources.files("moeplan.cost_models") / "intervals.json").read_text()
    return profile_from_dict(json.loads(text))


def profile_from_dict(d: dict[str, Any]) -> IntervalProfile:
    return IntervalProfile(
        level=float(d["level"]),
        regimes={k: (float(v["q_lo"]), float(v["q_hi"]), int(v["rows"]))
                 for k, v in d["regimes"].items()},
        memory_rel_error=float(d["memory"]["rel_error"]),
        memory_evidence=str(d["memory"]["evidence"]),
        evidence={k: list(v) for k, v in d["evidence"].items()},
        cross_validated=dict(d.get("cross_validated", {})),
        models={k: (int(v["rows"]), float(v["median"]), float(v["low"]), float(v["high"]))
                for k, v in d.get("models", {}).items()},
        contradicted={k: (list(v["rows"]), float(v["median"]))
                      for k, v in d.get("contradicted", {}).items()},
        unseen={k: (float(v["q_lo"]), float(v["q_hi"]), int(v["rows"]))
                for k, v in d.get("unseen", {}).items()},
        family_unseen=(None if not d.get("family_unseen") else (
            float(d["family_unseen"]["q_lo"]), float(d["family_unseen"]["q_hi"]),
            int(d["family_unseen"]["rows"]))),
        model_bands={k: (float(v["q_lo"]), float(v["q_hi"]), int(v["rows"]))
                     for k, v in d.get("model_bands", {}).items()},
        seen_models=tuple(d.get("seen_models", ())),
        seen_families=tuple(d.get("seen_families", ())),
        ranges={k: (float(v[0]), float(v[1])) for k, v in d.get("ranges", {}).items()},
        per_doubling=float(d.get("per_doubling", 0.0)),
        gpu_precision_rows={k: int(v) for k, v in d.get("gpu_precision_rows", {}).items()},
        yardsticks={k: dict(d[k]) for k in YARDSTICKS if isinstance(d.get(k), dict)})


def model_warning(model: ModelSpec, profile: IntervalProfile | None = None) -> str | None:
    """A warning for a model whose published runs the cost models miss as a whole (the fit
    could not take the bias up without hurting the other models), naming what was measured."""
    p = profile or default_profile()
    ev = p.models.get(model.name)
    if ev is None:
        return None
    rows, med, low, high = ev
    side, end = ("slower", "low") if med < 1 else ("faster", "high")
    return (f"published runs of {model.name} ran {side} than moeplan predicts: "
            f"{low:.2f}-{high:.2f}x the prediction on {rows} fit rows (median {med:.2f}x); "
            f"expect this plan near its interval's {end} end or beyond it (what is known of "
            "the cause: docs/ACCURACY.md)")


# ----------------------------------------------------------------------------- memory
def memory_margin_gb(peak_gb: float, cal: Calibration, profile: IntervalProfile | None = None
                     ) -> float:
    """HBM a plan must leave free: the memory model's error on this peak plus the reserve."""
    p = profile or default_profile()
    return p.memory_rel_error * peak_gb + cal.reserve_gb


def max_peak_gb(cluster: ClusterSpec, cal: Calibration,
                profile: IntervalProfile | None = None) -> float:
    """The largest predicted peak that still fits: HBM − peak ≥ margin(peak), solved for the
    peak. The one memory budget estimate, the search bounds and the MILP all use."""
    p = profile or default_profile()
    return gpu_room_gb(cluster, cal) / (1.0 + p.memory_rel_error)


def gpu_room_gb(cluster: ClusterSpec, cal: Calibration) -> float:
    """HBM less the reserve: the largest peak that runs at all, with no margin for the memory
    model's error. What a reading of a run that happened may assume (`validation.scoring.
    fastest`); a plan keeps `max_peak_gb`."""
    return cluster.hbm_gb - cal.reserve_gb


def static_activation_budget_bytes(cluster: ClusterSpec, cal: Calibration,
                                   fixed_bytes: float) -> float:
    """Most static + activation bytes a rank may hold and still fit (`max_peak_gb` less the
    fixed buffers, before fragmentation): the budget of the MILP and the search."""
    return (max_peak_gb(cluster, cal) * GB - fixed_bytes) / (1 + cal.frag_frac)


# ----------------------------------------------------------------------------- assumptions
Variant = Callable[[Layout, Choices, ClusterSpec], tuple[Layout, Choices, ClusterSpec]]


@dataclass(frozen=True)
class Term:
    """An assumption with, when unvalidated, the variant the interval's low end prices."""

    assumption: Assumption
    pessimistic: Variant | None = None


def _no_overlap(L: Layout, ch: Choices, c: ClusterSpec) -> tuple[Layout, Choices, ClusterSpec]:
    return L.model_copy(update={"ep_overlap": False}), ch, c


def _alltoall(L: Layout, ch: Choices, c: ClusterSpec) -> tuple[Layout, Choices, ClusterSpec]:
    return L.model_copy(update={"dispatcher": "alltoall"}), ch, c


def _no_tp_overlap(L: Layout, ch: Choices, c: ClusterSpec
                   ) -> tuple[Layout, Choices, ClusterSpec]:
    return L.model_copy(update={"tp_comm_overlap": False}), ch, c


def _no_graphs(L: Layout, ch: Choices, c: ClusterSpec) -> tuple[Layout, Choices, ClusterSpec]:
    return L.model_copy(update={"cuda_graphs": False}), ch, c


LAYOUT_VARIANTS = (_no_overlap, _alltoall, _no_tp_overlap, _no_graphs)
"""The pessimistic variants that change only the layout (a search bounds with them)."""


def _slow_host(L: Layout, ch: Choices, c: ClusterSpec) -> tuple[Layout, Choices, ClusterSpec]:
    return L, ch, c.model_copy(update={"host_link_gb_s": c.host_link_gb_s / 2,
                                       "host_memory_bw_gb_s": c.host_memory_bw_gb_s / 2})


def slow_host(cluster: ClusterSpec) -> ClusterSpec:
    """The cluster an interval's low end prices unvalidated host offload on (`_slow_host`)."""
    return _slow_host(Layout(), Choices(), cluster)[2]


VARIANT_WORDS: dict[Variant, str] = {
    _no_overlap: "without EP overlap", _alltoall: "with the alltoall dispatcher",
    _no_tp_overlap: "without TP comm overlap", _no_graphs: "without CUDA graphs",
    _slow_host: "on a host at half its link and memory bandwidth"}
"""Each pessimistic variant in words, for reports that say what failing was priced as."""


def failing(terms: Sequence[Term]) -> list[Term]:
    """The terms an interval's low end prices failing: unvalidated, with a slower variant."""
    return [t for t in terms if t.pessimistic is not None and not t.assumption.validated]


def slower_variants(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                    layout: Layout, choices: Choices) -> list[str]:
    """The unvalidated effects of an estimate that have a slower variant the interval's low end
    prices, each with that variant in words (`the effect, priced …`): what a low end equal to
    the point was priced at, where those effects wait on nothing here."""
    return [f"{t.assumption.term}, priced {VARIANT_WORDS[t.pessimistic]}"
            for t in failing(assumptions(model, cluster, training, layout, choices))]


def validated(key: str, profile: IntervalProfile | None = None) -> bool:
    """Whether fit rows back the effect of an evidence key (`assumption_keys`), as `_term`
    decides it."""
    return bool(evidence_for(key, profile or default_profile()))


def evidence_for(key: str, profile: IntervalProfile) -> list[str]:
    """The fit rows that back an evidence key. EP overlap shown beside TP or CP collectives
    (the harder case: the transfers share the GPU with them, `ep_overlap_key`) also backs the
    same overlap without them; the converse does not hold."""
    rows = profile.evidence.get(key, [])
    if not rows and key.startswith("ep_overlap/") and not key.endswith("/tp-cp"):
        rows = profile.evidence.get(key + "/tp-cp", [])
    return rows


def _ids(rows: list[str]) -> str:
    head = ", ".join(rows[:6])
    return head + (f" and {len(rows) - 6} more" if len(rows) > 6 else "")


def _term(key: str, term: str, profile: IntervalProfile, none_text: str,
          pessimistic: Variant | None = None) -> Term:
    rows = evidence_for(key, profile)
    if rows:
        return Term(Assumption(term=term, validated=True,
                               evidence=f"{len(rows)} fit rows: {_ids(rows)}"))
    if key in profile.contradicted:
        off, med = profile.contradicted[key]
        return Term(Assumption(term=term, validated=False, evidence=(
            f"{len(off)} fit rows use it ({_ids(off)}) but measured {med:.2f}× the prediction "
            "in the median: they do not validate it")), pessimistic)
    return Term(Assumption(term=term, validated=False, evidence=none_text), pessimistic)


def ep_overlap_key(gen: str, fabric: str, layout: Layout) -> str:
    """Evidence key of EP overlap: per GPU generation and fabric, and also where a published run
    of one configuration does not show another hiding:
    - across the scale-out fabric, per dispatcher family: DeepEP's and HybridEP's inter-node
      kernels drive RDMA from SMs they hold while they wait on their peers, where NCCL's
      all-to-all is one more NCCL kernel beside its proxy thread (over NVLink both are SM
      copies). The fit's flex rows that overlap across nodes all run at TP 1; those at TP 2 run
      without the overlap, as Megatron-Bridge's DeepSeek-V3 H100 recipe does
      (CUDA_DEVICE_MAX_CONNECTIONS=1);
    - per whether TP or CP collectives run in the layers it pairs transfers with: those want one
      CUDA connection on Hopper, the merged forward/backward several (Megatron-LM
      `validate_args`: "try not to use tensor model parallelism or context parallelism with
      overlap_moe_expert_parallel_comm", CUDA_DEVICE_MAX_CONNECTIONS 1 or 32 "depends on which
      parallelization you want to prioritize")."""
    key = f"ep_overlap/{gen}/{fabric}"
    if fabric == "scale-out":
        key += "/flex" if layout.dispatcher == "flex" else "/nccl"
    if layout.tp > 1 or layout.cp > 1:
        key += "/tp-cp"
    return key


def assumption_keys(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                    layout: Layout, choices: Choices) -> list[str]:
    """Evidence keys of the effects a layout relies on (also how fit rows are filed)."""
    gen, L = generation(cluster), layout
    keys = [f"calibration/{cluster.gpu}/{training.precision}/{'moe' if model.is_moe else 'dense'}",
            f"stack/{training.software_stack}"]
    if model.is_moe and L.ep > 1:
        ep_fab = "nvlink" if C.placement(L, "ep", cluster).inside_nvlink else "scale-out"
        if L.ep_overlap:
            keys.append(ep_overlap_key(gen, ep_fab, L))
        if L.dispatcher == "flex" and ep_fab == "scale-out":
            keys.append(f"flex/{gen}/scale-out")
    if L.tp > 1:
        keys.append(f"tp_overlap/{gen}" if L.tp_comm_overlap else f"tp/{gen}")
    if L.cuda_graphs:
        keys.append(f"cuda_graphs/{gen}")
        if model.is_moe and training.static_moe_shapes and not L.full_iteration_graphs:
            # the per-layer graphs then capture the whole MoE layer too: an effect of the
            # software, not the GPU generation, so its evidence is pooled over generations
            keys.append("moe_layer_graphs")
    if L.cp > 1:
        keys.append(f"cp/{gen}/{_seq_bucket(training.seq_len)}")
    if choices.optimizer_offload_fraction > 0:
        keys.append("optimizer_offload")
    if choices.offload:
        keys.append("activation_offload")
    if training.precision != "bf16":
        keys.append(f"precision/{cluster.architecture}/{training.precision}")
    return keys


def _seq_bucket(seq: int) -> str:
    """Sequence lengths grouped by powers of 4 from 4K (CP regimes: 4K, 16K, 64K, ...)."""
    return f"{4 ** max(0, round(math.log(max(seq, 1) / 4096, 4))) * 4}K"


def assumptions(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                choices: Choices, profile: IntervalProfile | None = None) -> list[Term]:
    """The modelled effects this estimate depends on, validated or not, in words."""
    p = profile or default_profile()
    gen = generation(cluster)
    out: list[Term] = []
    for key in assumption_keys(model, cluster, training, layout, choices):
        kind, _, rest = key.partition("/")
        if kind == "calibration":
            out.append(_term(key, f"{cluster.gpu} calibration for {training.precision} "
                             f"{'MoE' if model.is_moe else 'dense'} models", p,
                             "no fit rows validate this GPU, precision and model kind "
                             "(there are none, or only those of a model the fit misses as a "
                             "whole): the efficiencies are carried over from other GPUs or "
                             "precisions"))
        elif kind == "stack":
            out.append(_term(key, f"software stack {rest}: {STACKS[rest]}", p,
                             f"no published run the fit saw ran the {rest} stack: what it "
                             "lacks is priced as its description says, unchecked"))
        elif kind == "ep_overlap":
            parts = rest.split("/")
            what = ("the flex dispatcher's transfers" if "flex" in parts
                    else "the NCCL all-to-all" if "nccl" in parts else "the all-to-all")
            where = "over NVLink" if parts[1] == "nvlink" else "across the scale-out fabric"
            tp = " beside TP/CP collectives" if "tp-cp" in parts else ""
            out.append(_term(key, f"EP overlap (merged forward/backward) hiding {what} {where}"
                             f"{tp}", p, f"no published run on {gen} with EP overlap of "
                             f"{what} on this fabric{tp}", _no_overlap))
        elif kind == "flex":
            out.append(_term(key, "flex dispatcher (DeepEP/HybridEP) de-duplicating tokens "
                             "across NVLink domains", p,
                             f"no published run on {gen} with the flex dispatcher across "
                             "NVLink domains", _alltoall))
        elif kind == "tp":
            out.append(_term(key, "TP communication, exposed (no TP comm overlap)", p,
                             f"no published run on {gen} with tp > 1 and no TP comm overlap"))
        elif kind == "tp_overlap":
            out.append(_term(key, "TP comm overlap (TE userbuffers) hiding up to the fitted "
                             "share behind the GEMMs", p,
                             f"no published run on {gen} with TP comm overlap", _no_tp_overlap))
        elif kind == "cuda_graphs":
            out.append(_term(key, "CUDA graphs removing the captured kernels' launch overhead",
                             p, "no published run documents CUDA graphs", _no_graphs))
        elif kind == "moe_layer_graphs":
            out.append(_term(key, "CUDA graphs capturing the whole MoE layer, padded to "
                             "capacity: no routing sync and no launch left in it", p,
                             "no published run captures an MoE layer padded to capacity",
                             _no_graphs))
        elif kind == "cp":
            out.append(_term(key, f"context parallelism at {training.seq_len} tokens", p,
                             f"no published run on {gen} with cp > 1 near this length"))
        elif kind == "optimizer_offload":
            out.append(_term(key, "optimizer offload: host Adam and its PCIe/C2C copies", p,
                             "no published run offloads the optimizer; host memory bandwidth "
                             "and link speed are datasheet figures", _slow_host))
        elif kind == "activation_offload":
            out.append(_term(key, "activation offload copies hidden behind compute", p,
                             "no published run offloads activations", _slow_host))
        elif kind == "precision":
            out.append(_term(key, f"{training.precision} recipe speed-up on {gen}", p,
                             "no fit rows with this recipe on this architecture"))
    if model.is_moe:
        out.append(Term(Assumption(
            term="balanced routing", validated=True,
            evidence="as in NVIDIA's benchmarks, which force-balance tokens across experts; "
            "dropless routing runs at about 80–92 % of it (pass --imbalance to price it)")))
    return out


def pessimistic_layout(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                       layout: Layout, profile: IntervalProfile | None = None) -> Layout | None:
    """The layout an interval's low end prices when the layout's own effects (EP overlap,
    flex across domains) are unvalidated; None when none is. Choices (offload) aside: this
    is what a search can bound before it has chosen any."""
    L = layout
    for t in assumptions(model, cluster, training, layout, Choices(), profile):
        if t.pessimistic in LAYOUT_VARIANTS and not t.assumption.validated:
            L = t.pessimistic(L, Choices(), cluster)[0]
    return None if L is layout else L


def measured_bounds(cluster: ClusterSpec) -> tuple[float, float, str, int] | None:
    """(q_lo, q_hi, regime, runs) from `moeplan calibrate --from-runs` measurements on this
    cluster (calibration `interval_runs`), which replace the published rows' regime."""
    band = cluster.calibration.get("interval_runs")
    if not isinstance(band, dict) or band.get("runs", 0) < MIN_ROWS - 1:
        return None
    lo = math.log(max(1.0 - float(band["low"]), 1e-6))
    return lo, math.log1p(float(band["high"])), "runs measured on this cluster", int(band["runs"])


def tokens_interval(point: float, pessimistic: float, keys: Sequence[str],
                    profile: IntervalProfile | None = None,
                    measured: tuple[float, float, str, int] | None = None,
                    far: Distance | None = None) -> tuple[float, float, str, int]:
    """(lo, hi, regime, rows) of tokens/s/GPU: the conformal band around the point, its low end
    taken from the pessimistic prediction when unvalidated effects could disappoint, widened
    by the estimate's distance from the fit evidence (`widen`; never narrowed, so a search
    bounding by the regime's band alone stays a bound)."""
    p = profile or default_profile()
    q_lo, q_hi, regime, n = measured or p.bounds(keys)
    if far is not None and measured is None:
        q_lo, q_hi, _ = widen(q_lo, q_hi, keys, far, p)
    lo = min(point, pessimistic) * math.exp(min(q_lo, 0.0))
    hi = point * math.exp(max(q_hi, 0.0))
    return lo, hi, regime, n


# ----------------------------------------------------------------------------- distance
FEW_ROWS = 5
"""A GPU and precision with fewer fit rows than this is priced as if its calibration were
carried over (the band of a model the fit never saw)."""

DIMENSIONS = ("micro_batch", "tokens_per_expert", "seq_len")
"""The per-micro-batch sizes whose fit-row range an estimate can fall outside of."""


def model_family(name: str) -> str:
    """A model's family, from its preset name: the part before its size or version
    ("qwen3-30b-a3b" → "qwen3", "gpt-oss-120b" → "gpt-oss", "deepseek-v3" → "deepseek")."""
    return re.split(r"-\d|-v\d|-a\d", name)[0]


def dimensions(model: ModelSpec, training: TrainingSpec, layout: Layout) -> dict[str, float]:
    """The estimate's value of each of DIMENSIONS: sequences per micro-batch, routed token copies
    each local expert receives per micro-batch (the grouped GEMM's M; MoE only), sequence."""
    out = {"micro_batch": float(layout.mbs), "seq_len": float(training.seq_len)}
    if model.is_moe and model.num_experts:
        tokens = layout.mbs * training.seq_len / (layout.cp * layout.tp)
        out["tokens_per_expert"] = (tokens * model.moe_top_k * layout.etp
                                    / (model.num_experts // layout.ep))
    return out


@dataclass(frozen=True)
class Distance:
    """How far an estimate lies from the published runs its calibration was fitted on."""

    model: str
    model_seen: bool
    family_seen: bool
    doublings: dict[str, float]        # dimension → doublings outside the fit rows' range
    gpu_precision_rows: int


def distance(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
             profile: IntervalProfile | None = None) -> Distance:
    """The estimate's distance from the fit evidence (what `widen` widens by)."""
    p = profile or default_profile()
    out: dict[str, float] = {}
    for dim, x in dimensions(model, training, layout).items():
        if dim in p.ranges and x > 0:
            lo, hi = p.ranges[dim]
            beyond = max(lo / x, x / hi, 1.0)
            if beyond > 1.0:
                out[dim] = math.log2(beyond)
    return Distance(model.name, model.name in p.seen_models,
                    model_family(model.name) in p.seen_families, out,
                    p.gpu_precision_rows.get(f"{cluster.gpu}/{training.precision}", 0))


def least_low_end(model: ModelSpec, cluster: ClusterSpec, precision: str, fabric: str,
                  profile: IntervalProfile | None = None) -> float:
    """The least widening of the log band's low end any layout of this model, cluster,
    precision and EP fabric can have: the regime's band widened by the distance every such
    layout shares (the model, its family, the GPU and precision's rows) and by no doubling,
    since doublings only widen (`widen`). What a search may bound robust keys by."""
    p = profile or default_profile()
    near = Distance(model.name, model.name in p.seen_models,
                    model_family(model.name) in p.seen_families, {},
                    p.gpu_precision_rows.get(f"{cluster.gpu}/{precision}", 0))
    return _low_end(model, cluster, precision, fabric, near, p)


def _low_end(model: ModelSpec, cluster: ClusterSpec, precision: str, fabric: str,
             far: Distance, p: IntervalProfile) -> float:
    """The regime's log band's low end, widened by `far` (as `estimate` prices it)."""
    keys = regime_names(model, cluster, precision, fabric)
    return widen(*p.bounds(keys)[:2], keys, far, p)[0]


def key_factor(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
               profile: IntervalProfile | None = None) -> float:
    """The least ratio of a robust key (the interval's high end of step time) to the point
    step time any plan of this layout can have, whatever its choices: e^(−q_lo) of the band
    `estimate` prices it with (its regime, widened by its own distance from the fit
    evidence, doublings included), or of the cluster's measured band. The pessimistic
    variant only pulls the low end further down, so the point times this is a bound on the
    key; a search prunes a layout with it once its layout is known (`least_low_end` is the
    least of it over a search's layouts)."""
    return _key_factor(model, cluster, training, layout, (fabric(layout, cluster),), profile)


def least_key_factor_of(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec,
                        layout: Layout, profile: IntervalProfile | None = None) -> float:
    """`key_factor` at the EP fabric whose band is narrower: what the layout's sizes alone
    (micro-batch, tokens per expert) allow, wherever its groups sit."""
    return _key_factor(model, cluster, training, layout, ("nvlink", "scale-out"), profile)


def _key_factor(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, layout: Layout,
                fabrics: Sequence[str], profile: IntervalProfile | None) -> float:
    measured = measured_bounds(cluster)
    if measured is not None:
        return math.exp(-min(measured[0], 0.0))
    p = profile or default_profile()
    far = distance(model, cluster, training, layout, p)
    return min(math.exp(-min(_low_end(model, cluster, training.precision, fab, far, p), 0.0))
               for fab in fabrics)


def widen(q_lo: float, q_hi: float, keys: Sequence[str], far: Distance,
          profile: IntervalProfile) -> tuple[float, float, list[str]]:
    """The log band (q_lo, q_hi) widened by the distance from the fit evidence, with the
    reasons: a model no fit row has takes the band of models left out of the fit (of families
    left out, when its family has no fit row either); so does a GPU and precision with fewer
    than FEW_ROWS fit rows; a model the fit misses as a whole takes the band of its rows held
    out (only such a model has one: the others' held-out rows are in their regime's band);
    each doubling of a dimension beyond the fit rows' range widens both ends by
    `per_doubling`. Never narrower than the band it starts from."""
    p, why = profile, []
    bands: list[tuple[float, float]] = []
    unseen = p.unseen_bounds(keys)
    if not far.model_seen and p.seen_models:
        if not far.family_seen and p.family_unseen:
            bands.append(p.family_unseen[:2])
            why.append(f"no fit row has the {model_family(far.model)} family")
        elif unseen:
            bands.append(unseen)
            why.append(f"no fit row has {far.model}")
    if far.gpu_precision_rows < FEW_ROWS and p.gpu_precision_rows and unseen:
        bands.append(unseen)
        why.append(f"{far.gpu_precision_rows} fit rows on this GPU and precision")
    if far.model in p.model_bands:
        bands.append(p.model_bands[far.model][:2])
        why.append(f"{far.model}'s held-out rows measured this spread")
    for lo, hi in bands:
        q_lo, q_hi = min(q_lo, lo), max(q_hi, hi)
    steps = sum(far.doublings.values())
    if steps > 0 and p.per_doubling > 0:
        q_lo, q_hi = q_lo - p.per_doubling * steps, q_hi + p.per_doubling * steps
        why += [f"{d.replace('_', ' ')} {v:.1f} doublings outside the fit rows"
                for d, v in sorted(far.doublings.items())]
    return q_lo, q_hi, why
