"""The calibration fit: the cost models' efficiency constants from published runs.

The objective is the mean absolute log error of tokens/s/GPU over the rows given, plus a hinge
on pairs of those rows that one release published as different layouts (a planner lives by
ranking). The search is a deterministic coordinate descent over a fixed grid per constant (each
constant tried at every grid value with the others held), swept until a whole sweep improves
nothing (at most `sweeps`); at that point each constant is also tried together with a ±0.05
shift of every peak GEMM efficiency (a polish step along the directions one-at-a-time moves
cannot follow). The same rows always give the same profile.

Which rows it sees is the caller's choice, and the only thing that makes a score honest: the
shipped profile (`bench/fit_calibration.py`) sees every row it can score, so no score of it on
those rows is evidence; each cross-validation fold (`crossval`) sees every row but one model's,
or one release's, or (the configuration split) only that split's fit rows.
A trial moves one constant, so only the rows that constant touches (a GPU's efficiency, an
architecture's attention, a precision's gain) are re-predicted.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cost_models.calibration import Calibration, residual_key
from ..cost_models.uncertainty import MODEL_ROWS, off_as_a_whole
from .cases import RunCase, config_key
from .scoring import cluster_of, fastest, published_tokens, release_group

# The starting profile: measured or physically motivated priors for every constant. The fit
# starts here (never from the shipped file, so re-running it reproduces the shipped profile) and
# moves only the constants in GRID and EFF_GRID.
START: dict[str, Any] = {
    # the fitted constants start from the optimum of an earlier physics revision (the fit is
    # a local search; a warm start reaches a better optimum than the flat priors did, which
    # were 0.75 GEMM efficiency everywhere, half-dim 96, recipe gains 0.5 / 0.3)
    "gemm_eff_max": {"ampere": 0.725, "hopper": 0.925, "blackwell": 0.725, "GB300": 0.95,
                     "GB200": 0.725, "B300": 0.575, "H100-SXM": 0.925, "B200": 0.675,
                     "A100-80GB SXM": 0.725},
    "gemm_half_dim": 192.0,
    "gemm_half_dim_arch": {"ampere": 64.0, "hopper": 256.0, "blackwell": 512.0},
    "lowp_gain": {"fp8-delayed": 0.7, "fp8-tensorwise": 0.7, "fp8-blockwise": 0.7,
                  "mxfp8": 0.8, "nvfp4": 0.4},
    # cuDNN attention, DeepSeek-V3 shapes at s = 4096 (REFERENCE): Hopper 553/422 TFLOPS of 989,
    # Blackwell 1324/1083 of 2250; Ampere assumed
    "attn_fwd_eff": {"ampere": 0.55, "hopper": 0.559, "blackwell": 0.588},
    "attn_bwd_eff": {"ampere": 0.45, "hopper": 0.427, "blackwell": 0.481},
    # head-dim dependence of flash attention: FlashAttention-3 (Shah et al. 2024) H100 BF16
    # d = 64 at ≈ 0.7–0.75 and d = 256 at ≈ 1.15–1.2 of d = 128 (compute.attention_head_dim_factor)
    "attn_head_dim_half": 64.0,
    "hbm_eff": 0.8, "membound_scale": 1.0,  # membound_scale, a2a_*: the previous optimum
    "nvlink_eff": 0.75, "scaleout_eff": 0.8,
    # NCCL EP64 dispatch (REFERENCE): H100 9.16 ms for 411 MB cross-node → ≈ 0.9 of 50 GB/s
    "a2a_nvlink_eff": 0.55, "a2a_scaleout_eff": 1.0,
    # TE userbuffers overlap of TP comm (only rows whose recipe documents it use it)
    "tp_overlap_hidden": 0.7,
    "ep_overlap_hidden": 0.93,  # Megatron Core MoE report: merged fwd/bwd hid ≈ 93 %
    # share of the GPU's compute that communication kernels take while they overlap it; at
    # least the SMs the dispatcher reserves (Megatron Core: DeepEP's default 20 SMs, of 132 on
    # H100 and 148 on Blackwell; HybridEP 32 in Megatron-LM's MoE recipes), more where they also
    # contend for memory bandwidth: the fit moves it only upward (GRID)
    "comm_sm_fraction": {"ampere": 0.15, "hopper": 0.15, "blackwell": 0.135},
    "host_mem_eff": 0.7,
    "pp_boundary_s": 0.0008,
    "step_overhead_s": 0.05,
    # the host floor replaces a fitted per-layer constant (cost_models.host): no fixed
    # overhead, and a host time per kernel launch per host CPU, NVIDIA's Nsight Systems guide
    # measuring ≈ 20 µs for one PyTorch element-wise kernel on a V100-era host, 4–6 µs of it
    # the CUDA launch; Grace's cores are slower per thread than the x86 hosts'
    "layer_overhead_s": 0.0, "launch_us": {"x86": 10.0, "grace": 15.0},
    "frag_frac": 0.05, "workspace_gb": 1.5, "reserve_gb": 2.0,
    # share of those microbenchmark attention efficiencies a training step realises
    "attn_realised": {"hopper": 1.0, "blackwell": 1.0},
    "calibrated": [],
}

# peak GEMM efficiency, one constant per GPU model present in the fit rows
EFF_GRID = [round(0.5 + 0.025 * i, 3) for i in range(19)]  # 0.5 … 0.95
GRID: list[tuple[str, list[float]]] = [
    ("gemm_half_dim", [8.0, 16.0, 32.0, 64.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0,
                       1024.0]),
    ("lowp_gain.fp8-tensorwise", [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]),
    ("lowp_gain.mxfp8", [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]),
    ("lowp_gain.nvfp4", [0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6]),
    ("tp_overlap_hidden", [0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]),
    ("gemm_half_dim_arch.ampere", [64.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0]),
    ("gemm_half_dim_arch.hopper", [64.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0]),
    ("gemm_half_dim_arch.blackwell", [64.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0]),
    ("comm_sm_fraction.blackwell", [0.135, 0.2, 0.25, 0.3]),
    ("comm_sm_fraction.hopper", [0.15, 0.2, 0.3, 0.4, 0.5]),
    ("pp_boundary_s", [0.0, 5e-5, 1e-4, 2e-4, 4e-4, 8e-4, 1.2e-3]),
    ("a2a_nvlink_eff", [0.4, 0.55, 0.7, 0.85, 1.0]),
    ("a2a_scaleout_eff", [0.5, 0.7, 0.9, 1.0]),
    ("membound_scale", [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]),
    ("launch_us.x86", [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0]),
    ("launch_us.grace", [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0]),
    ("attn_realised.hopper", [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0]),
    ("attn_realised.blackwell", [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0]),
]
TIED = {"lowp_gain.fp8-tensorwise": ["lowp_gain.fp8-delayed", "lowp_gain.fp8-blockwise"]}
ORDERED = [("launch_us.x86", "launch_us.grace")]
"""Pairs (a, b) the fit keeps a ≤ b, physics it may not trade away: a Grace host takes longer
per kernel launch than an x86 one (Vellaisamy et al. 2025, arXiv 2504.11750: GH200 stays
CPU-bound up to 4× larger batches than PCIe H100 hosts, the Grace CPU's launch and queuing time
the cause), so no fit may let the Grace launch time stand in for work a recipe's CUDA graphs
removed."""


def keep_order(over: dict[str, Any], key: str) -> bool:
    """After `key` moved: drag the other member of each ORDERED pair along to its value where
    the pair fell out of order (a joint move, so the descent never sticks at the bound).
    True when another constant moved too."""
    v = get_key(over, key)
    dragged = False
    for a, b in ORDERED:
        other = b if key == a else a if key == b else None
        if other is None or v is None:
            continue
        w = get_key(over, other)
        if w is not None and (v > w if key == a else v < w):
            set_key(over, other, v)
            dragged = True
    return dragged


RANK_WEIGHT = 1.0
"""Weight of the layout-ranking term (`rank_penalty`) against the mean |log error|."""


def set_key(over: dict[str, Any], key: str, value: float) -> None:
    """Set a dotted constant (and the constants TIED to it) in a profile dict."""
    for k in [key, *TIED.get(key, [])]:
        if "." in k:
            top, sub = k.split(".", 1)
            over.setdefault(top, {})[sub] = value
        else:
            over[k] = value


def get_key(over: dict[str, Any], key: str) -> float | None:
    """The constant's current value (None: a per-GPU entry not set yet)."""
    if "." in key:
        top, sub = key.split(".", 1)
        return over[top].get(sub)
    return float(over[key])


def touches(key: str, case: RunCase) -> bool:
    """Whether moving the constant `key` can change the prediction of `case`: a GPU's entry
    touches that GPU's rows, an architecture's that architecture's, a precision's gain the rows
    of the precisions tied to it; any other constant every row."""
    top, _, sub = key.partition(".")
    if not sub:
        return True
    cl = cluster_of(case)
    if top == "gemm_eff_max":
        return sub in (cl.gpu, cl.architecture)
    if top == "lowp_gain":
        return case.training.precision in [sub] + [k.partition(".")[2]
                                                   for k in TIED.get(key, [])]
    if top in ("gemm_half_dim_arch", "attn_realised", "comm_sm_fraction", "attn_fwd_eff",
               "attn_bwd_eff"):
        return sub == cl.architecture
    if top == "launch_us":
        from ..cost_models.host import host_kind

        return sub == host_kind(cl)
    return True


def point(case: RunCase, over: dict[str, Any]) -> float | None:
    """Predicted tokens/s/GPU of a case under the profile `over` (None where the layout cannot
    be priced), without an interval: what the fit needs and no more."""
    return fastest(case, over)[1]  # a tuned row ran the fastest of its layouts that fits


def scored(cases: Sequence[RunCase]) -> list[RunCase]:
    """The cases with a published (or derivable) tokens/s/GPU: the ones a fit can use."""
    return [c for c in cases if published_tokens(c)[0]]


def rank_penalty(preds: Sequence[float | None], cases: Sequence[RunCase]) -> float:
    """Mean hinge over pairs of rows in one release group (`scoring.layout_pairs`'s pairs): a
    pair costs what its predicted log-gap falls short of half its published log-gap, in the
    published direction."""
    groups: dict[tuple, list[tuple[float, float, dict[str, str]]]] = {}
    for pred, c in zip(preds, cases, strict=True):
        pub = published_tokens(c)[0]
        if pub and pred:
            key = release_group(c.row, {"model": c.model.name,
                                        "precision": c.training.precision})
            groups.setdefault(key, []).append((pub, pred, c.row))
    hinge = []
    for members in groups.values():
        for i, (pa, qa, ra) in enumerate(members):
            for pb, qb, rb in members[i + 1:]:
                if pa == pb or config_key(ra) == config_key(rb):
                    continue
                gap = math.log(pa / pb)
                hinge.append(max(0.0, 0.5 * abs(gap) - math.copysign(1.0, gap)
                                 * math.log(qa / qb)))
    return sum(hinge) / len(hinge) if hinge else 0.0


def score(preds: Sequence[float | None], cases: Sequence[RunCase]) -> float:
    """Mean |log(predicted / published)| of tokens/s/GPU (symmetric in over- and
    under-prediction, so a few far-off rows pull the constants less than under MAPE), plus
    RANK_WEIGHT times the ranking hinge."""
    errs = [abs(math.log(q / published_tokens(c)[0]))  # type: ignore[operator]
            for q, c in zip(preds, cases, strict=True) if q]
    if not errs:
        return float("inf")
    return sum(errs) / len(errs) + RANK_WEIGHT * rank_penalty(preds, cases)


def objective(cases: Sequence[RunCase], over: dict[str, Any]) -> float:
    """`score` of the profile `over` on `cases`."""
    return score([point(c, over) for c in cases], cases)


@dataclass(frozen=True)
class FitResult:
    profile: dict[str, Any]   # START with the fitted constants (Calibration's fields)
    objective: float
    rows: int


def _copy(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d))


def fit(cases: Sequence[RunCase], sweeps: int = 12, polish: bool = True,
        start: dict[str, Any] | None = None,
        log: Callable[[str], None] | None = None) -> FitResult:
    """Coordinate descent from `start` (START) over GRID and one EFF_GRID entry per GPU on the
    scored `cases`; `polish` adds the joint moves with every GPU's efficiency shifted."""
    cases = scored(cases)
    over = _copy(start or START)
    # the constants are fitted to the physics alone: no residual during their descent (a start
    # profile's included); `model_residuals` measures it after
    over["model_residual"] = {}
    gpus = sorted({cluster_of(c).gpu for c in cases})
    grid = [(f"gemm_eff_max.{g}", EFF_GRID) for g in gpus] + GRID
    for c in cases:  # every fitted GPU gets its own entry, starting from its architecture's
        cl = cluster_of(c)
        if cl.gpu not in over["gemm_eff_max"]:
            set_key(over, f"gemm_eff_max.{cl.gpu}", Calibration(**over).gemm_eff_max_for(cl))
    preds = [point(c, over) for c in cases]
    best = score(preds, cases)

    def trial_preds(trial: dict[str, Any], key: str | None) -> list[float | None]:
        return [point(c, trial) if key is None or touches(key, c) else p
                for c, p in zip(cases, preds, strict=True)]

    def shifted(trial: dict[str, Any], delta: float) -> dict[str, Any]:
        """`trial` with every GPU's peak GEMM efficiency moved by `delta` (within EFF_GRID)."""
        out = _copy(trial)
        for g in gpus:
            v = round(out["gemm_eff_max"][g] + delta, 3)
            out["gemm_eff_max"][g] = min(max(v, EFF_GRID[0]), EFF_GRID[-1])
        return out

    for sweep in range(sweeps):
        start_best = best
        for key, values in grid:
            cur = get_key(over, key)
            for v in values:
                if v == cur:
                    continue
                trial = _copy(over)
                set_key(trial, key, v)
                tp = trial_preds(trial, None if keep_order(trial, key) else key)
                s = score(tp, cases)
                if s < best - 1e-9:
                    best, over, cur, preds = s, trial, v, tp
        if polish and best >= start_best - 1e-9:
            for key, values in GRID:
                cur = get_key(over, key)
                for v in values:
                    if v == cur:
                        continue
                    for delta in (-0.05, 0.05):
                        trial = _copy(over)
                        set_key(trial, key, v)
                        keep_order(trial, key)
                        trial = shifted(trial, delta)
                        tp = trial_preds(trial, None)
                        s = score(tp, cases)
                        if s < best - 1e-9:
                            best, over, cur, preds = s, trial, v, tp
        if log:
            log(f"sweep {sweep + 1}: objective (mean |log error| + rank hinge) on {len(cases)} "
                f"rows = {best:.4f}")
        if best >= start_best - 1e-9:  # converged: no move, single or joint, helped in a sweep
            break
    over["model_residual"] = model_residuals(cases, preds)
    return FitResult(over, best, len(cases))


def model_residuals(cases: Sequence[RunCase], preds: Sequence[float | None]
                    ) -> dict[str, float]:
    """Calibration.model_residual of fitted constants: per model and precision whose fit rows
    are off as a whole (`uncertainty.off_as_a_whole`: at least MODEL_ROWS rows, their median
    published/predicted ratio MODEL_RATIO or more off), that median, if it is a slowdown.

    The cost models price what a layer's kernels must do on the hardware; a model whose
    published runs all ran well below that on every GPU (gpt-oss-120b in BF16 under
    Megatron-Bridge: docs/ACCURACY.md) has a software path the physics does not see, and the
    shared constants cannot take it up without hurting every other model. Its point estimate
    then carries the measured slowdown as unmodelled time instead of sitting outside its own
    interval; a model no fit row has gets none, so leaving a model out measures the physics
    alone. A precision with too few rows of its own to tell (fewer than MODEL_ROWS) takes the
    median of all the model's rows when those are off as a whole: the shortfall is the
    model's software path, which its few rows at that precision share (gpt-oss-120b's four
    MXFP8 rows, once their experts' biases are priced fused as their recipe ran them, sit
    where its BF16 rows do)."""
    ratios: dict[str, list[float]] = {}
    pooled: dict[str, list[float]] = {}
    for c, q in zip(cases, preds, strict=True):
        pub = published_tokens(c)[0]
        if pub and q:
            ratios.setdefault(residual_key(c.model.name, c.training.precision), []).append(
                pub / q)
            pooled.setdefault(c.model.name, []).append(pub / q)
    out = {}
    for key, rs in sorted(ratios.items()):
        if len(rs) < MODEL_ROWS:
            rs = pooled[key.split("/", 1)[0]]
        med = sorted(rs)[len(rs) // 2]
        if med < 1.0 and off_as_a_whole(rs):
            out[key] = round(med, 4)
    return out


def shipped_profile(result: FitResult, cases: Sequence[RunCase], about: str) -> dict[str, Any]:
    """The calibration.json document of a fit: the profile, an architecture entry for GPUs the
    fit never saw (the median of that architecture's fitted GPUs), and the (GPU, precision,
    kind) triples it covered."""
    cal = Calibration(**result.profile).to_dict()
    by_arch: dict[str, list[float]] = {}
    for c in scored(cases):
        cl = cluster_of(c)
        by_arch.setdefault(cl.architecture, []).append(cal["gemm_eff_max"][cl.gpu])
    fitted = {cluster_of(c).gpu for c in scored(cases)}
    for arch, vals in by_arch.items():
        cal["gemm_eff_max"][arch] = sorted(vals)[len(vals) // 2]
    # a GPU the rows never showed takes its architecture's median, not a start value
    for gpu, arch in preset_gpus().items():
        if gpu not in fitted and arch in by_arch:
            cal["gemm_eff_max"][gpu] = cal["gemm_eff_max"][arch]
    cal["calibrated"] = sorted({f"{cluster_of(c).gpu}/{c.training.precision}/"
                                f"{'moe' if c.model.is_moe else 'dense'}" for c in scored(cases)})
    return {"_about": about, **cal}


def preset_gpus() -> dict[str, str]:
    """GPU model → architecture of every cluster preset."""
    from ..specs import list_presets, load_cluster

    return {c.gpu: c.architecture for c in map(load_cluster, list_presets()["clusters"])}


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr)
