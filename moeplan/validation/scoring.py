"""Scoring: predict each case and compare with what was published.

Tokens/s/GPU is compared where published (it needs no FLOP convention). TFLOPS are compared in
the row's own `flops_convention`: `causal_halved` is ours, `full` counts the causal attention
term twice, `full_with_recompute` adds one more forward (Narayanan et al. 2021's hardware FLOPs
with full recompute). Besides the per-row error: MAPE, interval coverage and width, and
whether pairs of published layouts of one release are ordered as measured.

A row's error means something only if no fit saw it. The shipped calibration is fitted on
every run of the shipped CSV it can score (`bench/fit_calibration.py`), so a row is `fit` when
it is one of those runs (its configuration and published figures, whatever its id) and
`held-out` otherwise: a run nobody fitted. The summary of the held-out rows (`unseen_summary`)
is the measure of a prediction on new runs; the fit rows' error is in sample, and the honest
figures on them are the cross-validated ones (`crossval`, `bench/cross_validate.py`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from ..errors import MoeplanError
from ..specs import Layout, TrainingSpec, list_presets, load_cluster, load_model
from ..specs.cluster import ClusterSpec
from ..specs.model import ModelSpec
from ..terminal import plural
from .cases import RunCase, case_of, config_key
from .rows import cell, read_rows, release_of

PUBLISHED_FIGURES = ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu")
"""The cells a fit reads a run's measurement from."""

FAMILY_BAR = 0.30
"""A model × GPU-family group of two or more rows whose mean error passes this is off as a
whole (the bar on runs no fit saw)."""

STEP_BAR = 0.20
"""A pair of layouts is priced right when its predicted ratio is within this of the measured."""


def run_fingerprint(row: dict[str, str]) -> str:
    """A published run as a fit sees it: its configuration and its published figures, not its
    id (a run copied under another id is the same run; a layout published again with another
    figure is another measurement)."""
    return "|".join([config_key(row), *(cell(row, c) for c in PUBLISHED_FIGURES)])


@lru_cache(maxsize=1)
def _fitted_runs() -> frozenset[str]:
    # every row of the shipped CSV: the fit scores all it can, and a row it cannot score
    # cannot be scored by `validate` either
    return frozenset(run_fingerprint(r) for r in read_rows(None))


def seen_by_fit(row: dict[str, str]) -> bool:
    """Whether the shipped calibration was fitted on this run (its error is then in sample)."""
    return run_fingerprint(row) in _fitted_runs()


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


def published_tokens(case: RunCase) -> tuple[float | None, bool]:
    """(tokens/s/GPU, derived): as published, else derived from the published TFLOPS in the
    row's own FLOP convention (None when neither is known)."""
    if case.published_tokens is not None:
        return case.published_tokens, False
    fpt_conv = flops_per_token_in(case.model, case.training.seq_len, case.convention)
    if case.published_tflops is not None and fpt_conv:
        return case.published_tflops * 1e12 / fpt_conv, True
    return None, False


def cluster_of(case: RunCase) -> ClusterSpec:
    """The case's cluster at its GPU count (loaded once, by `case_of`)."""
    return case.cluster or load_cluster(case.cluster_name, case.layout.world_size)


def fastest(case: RunCase, calibration: dict[str, Any] | None = None
            ) -> tuple[Layout, float | None]:
    """The fastest of a case's layouts (`RunCase.layouts`) that fits in the GPU's memory as
    priced, under `calibration`, and its tokens/s/GPU without an interval (None where no
    layout can be priced): a row that left a size its source tuned unpublished ran the fastest
    one it could run, and a layout whose priced peak is over the memory a GPU holds (HBM less
    the reserve) could not have run. That is what could have run, not what a plan may use: a
    search also keeps the memory model's margin (`uncertainty.max_peak_gb`), a reading of a
    run that happened does not. Where none of them fits as priced, the fastest of all (the
    memory model's error, not the run's)."""
    from ..cost_models.calibration import calibration_on
    from ..cost_models.estimate import estimate
    from ..cost_models.uncertainty import gpu_room_gb

    cluster, best, rank = cluster_of(case), case.layout, None
    room = gpu_room_gb(cluster, calibration_on(cluster, calibration))
    for lay in case.layouts():
        try:
            est = estimate(case.model, cluster, case.training, lay, case.choices,
                           calibration=calibration, with_interval=False)
        except MoeplanError:
            continue
        key = (est.memory.peak_gb <= room, est.tokens_per_s_per_gpu)
        if rank is None or key > rank:
            best, rank = lay, key
    return best, (rank[1] if rank else None)


def priced_layout(case: RunCase, calibration: dict[str, Any] | None = None) -> Layout:
    """The layout a case is priced at: its published one, or the fastest of its alternatives
    (`fastest`)."""
    return fastest(case, calibration)[0] if case.alternatives else case.layout


def predict_case(case: RunCase, calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predict one case: the row dict `moeplan validate` prints (plus split and group). `split`
    is "fit" for a run the shipped calibration was fitted on, "held-out" for one no fit saw."""
    from ..cost_models.estimate import estimate

    cluster = cluster_of(case)
    layout = priced_layout(case, calibration)
    est = estimate(case.model, cluster, case.training, layout, case.choices,
                   calibration=calibration)
    fpt_ours = case.model.flops_per_token(case.training.seq_len)
    fpt_conv = flops_per_token_in(case.model, case.training.seq_len, case.convention)
    pred_tflops_conv = (est.tflops_per_gpu * fpt_conv / fpt_ours) if fpt_conv else None
    pub_tokens, derived = published_tokens(case)
    from ..cost_models import uncertainty as U

    iv = est.interval
    return {
        "id": case.id,
        "predicted_tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
        "predicted_interval_tokens_per_s_per_gpu": list(iv.tokens_per_s_per_gpu) if iv else None,
        "pessimistic_tokens_per_s_per_gpu": iv.pessimistic_tokens_per_s_per_gpu if iv else None,
        "regimes": U.regime_keys(case.model, cluster, case.training.precision, layout),
        "assumption_keys": U.assumption_keys(case.model, cluster, case.training, layout,
                                             case.choices),
        "published_tokens_per_s_per_gpu": pub_tokens,
        "predicted_tflops_per_gpu": pred_tflops_conv,
        "published_tflops_per_gpu": case.published_tflops,
        # seconds per step the physics does not explain (Calibration.model_residual)
        "unmodelled_s": est.unmodelled_s,
        "predicted_memory_gb": est.memory.peak_gb,
        "published_memory_gb": case.published_memory,
        "tokens_derived_from_tflops": derived,
        # a run without a published throughput gave the fit nothing to fit
        "split": "fit" if pub_tokens and seen_by_fit(case.row) else "held-out",
        "gpu": case.gpu,
        "gpu_family": U.generation(cluster),
        "family": case.family,
        "model": case.model.name,
        "precision": case.training.precision,
        "flops_convention": case.convention,
        "assumed": case.assumed,
        "vpp": layout.vpp,
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


def release_group(case_row: dict[str, str], r: dict[str, Any]) -> tuple:
    """Rows whose order is a claim about layouts alone: one model, cluster, GPU count,
    precision, sequence length and software release (the source, and its release if named)."""
    rel = release_of(case_row)
    return (r["model"], case_row.get("cluster_preset") or case_row.get("gpu"),
            case_row.get("num_gpus"), r["precision"], case_row.get("seq_len"),
            case_row.get("source"), rel if rel else case_row.get("source_detail"))


def layout_pairs(rows: list[dict[str, Any]], raw: dict[str, dict[str, str]]) -> dict[str, Any]:
    """How many pairs of published layouts within one release group the model orders as
    measured (a planner lives by ranking), and how many it also prices within STEP_BAR of the
    measured ratio (telling them apart by as much as the hardware did); ties in the published
    figure are left out. `by_split`: the same counts for pairs of fit rows, of held-out rows,
    and mixed."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r["published_tokens_per_s_per_gpu"]:
            groups.setdefault(release_group(raw[r["id"]], r), []).append(r)
    pairs, wrong, near = 0, [], 0
    split = {k: [0, 0, 0] for k in ("fit", "held-out", "mixed")}
    for members in groups.values():
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                pa, pb = a["published_tokens_per_s_per_gpu"], b["published_tokens_per_s_per_gpu"]
                if pa == pb or config_key(raw[a["id"]]) == config_key(raw[b["id"]]):
                    continue  # a tie, or one layout published twice (no ordering claim)
                pairs += 1
                side = a.get("split") if a.get("split") == b.get("split") else "mixed"
                tally = split.get(side or "mixed", split["mixed"])
                tally[0] += 1
                qa, qb = a["predicted_tokens_per_s_per_gpu"], b["predicted_tokens_per_s_per_gpu"]
                if (qa - qb) * (pa - pb) <= 0:
                    wrong.append({"ids": [a["id"], b["id"]], "published": [pa, pb],
                                  "predicted": [qa, qb]})
                    continue
                tally[1] += 1
                if abs((qa / qb) / (pa / pb) - 1.0) <= STEP_BAR:
                    near += 1
                    tally[2] += 1
    # the fit's ranking term sees only pairs of fit rows: held-out and mixed pairs are evidence
    return {"pairs": pairs, "ordered": pairs - len(wrong),
            "share": (pairs - len(wrong)) / pairs if pairs else None, "misordered": wrong,
            "ordered_within_step_bar": near,
            "by_split": {k: {"pairs": n, "ordered": o, "ordered_within_step_bar": w}
                         for k, (n, o, w) in split.items()}}


def sequence_steps(rows: list[dict[str, Any]], raw: dict[str, dict[str, str]]
                   ) -> dict[str, Any]:
    """Whether throughput moves with sequence length as measured: rows of one model, cluster,
    precision and release (their GPU count and layout may grow with the sequence, CP above
    all: `release_group` with neither), taken in order of sequence, each step from one length
    to the next compared in TFLOPS/GPU where both publish it (attention's share grows with the
    sequence, so tokens/s always falls and TFLOPS may rise), else in tokens/s. Several rows at one length count as their mean. A step `moves`
    when its predicted change has the measured sign (or both are within 1%), and is `near`
    when its predicted ratio is also within STEP_BAR of the measured one."""
    series: dict[tuple, dict[int, list[tuple[float, float]]]] = {}
    for r in rows:
        row = raw[r["id"]]
        seq = int(row.get("seq_len") or 0)
        key = release_group({**row, "num_gpus": "", "seq_len": ""}, r)
        pub, pred = r.get("published_tflops_per_gpu"), r.get("predicted_tflops_per_gpu")
        if not (pub and pred):
            pub, pred = r["published_tokens_per_s_per_gpu"], r["predicted_tokens_per_s_per_gpu"]
        if seq and pub and pred:
            series.setdefault(key, {}).setdefault(seq, []).append((pub, pred))
    steps, moves, near, worst = 0, 0, 0, []
    for by_seq in series.values():
        points = [(s, sum(p for p, _ in v) / len(v), sum(q for _, q in v) / len(v))
                  for s, v in sorted(by_seq.items())]
        for (s0, p0, q0), (s1, p1, q1) in zip(points, points[1:], strict=False):
            steps += 1
            measured, predicted = p1 / p0, q1 / q0
            same = ((measured - 1) * (predicted - 1) > 0
                    or (abs(measured - 1) < 0.01 and abs(predicted - 1) < 0.01))
            moves += same
            near += same and abs(predicted / measured - 1) <= STEP_BAR
            if not same:
                worst.append({"seq": [s0, s1], "measured_ratio": measured,
                              "predicted_ratio": predicted})
    return {"steps": steps, "moves_as_measured": moves, "within_step_bar": near,
            "against": worst}


def signed_error(r: dict[str, Any]) -> float | None:
    """Predicted over published tokens/s/GPU, less one (None without a published figure)."""
    pub, pred = r["published_tokens_per_s_per_gpu"], r["predicted_tokens_per_s_per_gpu"]
    return pred / pub - 1.0 if pub and pred is not None else None


def family_groups(rows: Sequence[dict[str, Any]],
                  error_of: Callable[[dict[str, Any]], float | None] = signed_error
                  ) -> list[dict[str, Any]]:
    """Model × GPU-family groups of two or more rows with their mean signed error, the ones
    off as a whole (beyond ±FAMILY_BAR) marked: a class of runs predicted wrong the same way
    on every row, which a low MAPE over many other rows hides. `error_of`: a row's signed
    error (a cross-validated row carries its own)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        e = error_of(r)
        if e is not None and r.get("gpu_family"):
            groups.setdefault((r["model"], r["gpu_family"]), []).append(e)
    return [{"model": m, "gpu_family": g, "rows": len(es), "mean_error": sum(es) / len(es),
             "off": abs(sum(es) / len(es)) > FAMILY_BAR}
            for (m, g), es in sorted(groups.items()) if len(es) >= 2]


def unseen_summary(rows: list[dict[str, Any]], ranking: dict[str, Any],
                   raw: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """What the rows no fit saw, and that publish a throughput, say of a prediction on new
    runs: MAPE apart for rows that publish tokens/s and rows that publish only TFLOPS (their
    tokens/s derived in the row's FLOP convention), the model × GPU-family groups off as a
    whole, interval coverage and width, the layout pairs among them, and how their throughput
    moves with sequence length (`sequence_steps`; `raw`: the CSV rows by id)."""
    held = [r for r in rows if r["split"] == "held-out" and r["published_tokens_per_s_per_gpu"]]
    measured = [r for r in held if not r.get("tokens_derived_from_tflops")]
    derived = [r for r in held if r.get("tokens_derived_from_tflops")]
    groups = family_groups(held)
    pairs = ranking["by_split"]["held-out"]
    return {"rows": len(held), "tokens_rows": len(measured),
            "mape_tokens_per_s": mape(measured),
            "tflops_only_rows": len(derived), "mape_tflops_only": mape(derived),
            "family_groups": groups, "families_off": [g for g in groups if g["off"]],
            "coverage": coverage(held), "median_interval_width": median_width(held),
            "layout_pairs": pairs,
            "sequence_steps": sequence_steps(held, raw) if raw is not None else None}


FEW_SKIPPED = 3
"""A reason shared by at most this many rows is printed in full for each of them: grouping
only pays when it saves lines, and the full reason is what a user fixes a cell by."""


def skip_groups(skipped: list[dict[str, str]]) -> list[tuple[str, list[str]]]:
    """Skipped rows grouped by reason, most common first, as (reason, ids): `validate` prints
    these instead of a bare count, so what is not predicted, and why, reads at a glance. Rows
    whose reasons differ only in their detail (after a `:`, quoted values) share the reason's
    head, with quoted values as `…`; the full reason is kept where every row of a group gives
    the same one, and each row gets its own where the group holds FEW_SKIPPED rows or fewer
    (the cell a user mistyped, and the fix, are in the detail)."""
    groups: dict[str, list[dict[str, str]]] = {}
    for s in skipped:
        head = re.sub(r"(?<!\w)'[^']*'(?!\w)", "…", str(s["why"]).split(":", 1)[0]).strip()
        groups.setdefault(head, []).append(s)
    out: list[tuple[str, list[str]]] = []
    for head, members in groups.items():
        whys = {str(s["why"]) for s in members}
        if len(whys) == 1:
            out.append((whys.pop(), [str(s["id"]) for s in members]))
        elif len(members) <= FEW_SKIPPED:
            out += [(str(s["why"]), [str(s["id"])]) for s in members]
        else:
            out.append((head, [str(s["id"]) for s in members]))
    return sorted(out, key=lambda g: (-len(g[1]), g[0]))


def first_ids(ids: list[str]) -> str:
    """The first three ids of a group of rows, and `…` when there are more."""
    return ", ".join(ids[:3]) + (", …" if len(ids) > 3 else "")


def common_skip_reasons(skipped: list[dict[str, str]], top: int = 3) -> str:
    """The `top` commonest reasons rows were skipped for, each with its row count and first
    ids, as one sentence: what `validate` says when it could predict no row at all."""
    from ..limits import clip

    parts = []
    for why, ids in skip_groups(skipped)[:top]:
        parts.append(f"{clip(why.rstrip('.'), 400)} ({plural(len(ids), 'row')}: "
                     f"{first_ids(ids)})")
    return "; ".join(parts)


def validate_rows(rows: list[dict[str, str]], calibration: dict[str, Any] | None = None,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Predict every predictable row; {"rows", "mape_tokens_per_s", "skipped", ...}.
    `progress(done, total)` is called before each row."""
    presets = list_presets()
    out, skipped = [], []
    for n, row in enumerate(rows):
        if progress:
            progress(n, len(rows))
        case = case_of(row, presets)
        if isinstance(case, str):
            skipped.append({"id": row.get("id") or "?", "why": case})
            continue
        try:
            out.append(predict_case(case, calibration))
        except MoeplanError as err:
            skipped.append({"id": case.id, "why": str(err)})
    held = [r for r in out if r["split"] == "held-out"]
    fit = [r for r in out if r["split"] == "fit"]
    from ..cost_models.uncertainty import default_profile

    raw = {r.get("id", "?"): r for r in rows}
    ranking = layout_pairs(out, raw)
    return {
        "rows": out,
        "ranking": ranking,
        "coverage": coverage(held),
        "median_interval_width": median_width(held),
        "coverage_fit": coverage(fit),
        "coverage_cross_validated": default_profile().cross_validated.get("coverage"),
        "cross_validated": default_profile().yardsticks,
        "mape_tokens_per_s": mape(out),
        "mape_tokens_per_s_held_out": mape(held),
        "mape_tokens_per_s_fit": mape(fit),
        "mape_tflops": mape(out, "tflops_per_gpu"),
        "mape_memory_gb": mape(out, "memory_gb"),
        "unseen": unseen_summary(out, ranking, raw),
        "skipped": skipped,
    }


# DeepSeek-V3 per-GPU memory anatomy, Megatron Core MoE report: 256 GPUs, PP4 VPP4 EP64, TP1,
# ETP1, MBS1, s 4096, BF16, distributed optimizer, before memory optimisations (GB).
DEEPSEEK_V3_ANATOMY = {"weights+grads": 36.4, "optimizer": 32.1, "activations": 131.0,
                       "total": 199.5}


def anatomy_parts() -> dict[str, tuple[float, float]]:
    """{part: (moeplan GB, report GB)} for the DeepSeek-V3 anatomy, moeplan's peak GPU."""
    from ..cost_models.estimate import estimate_breakdown

    m, c = load_model("deepseek-v3"), load_cluster("h100", 256)
    t = TrainingSpec(seq_len=4096, global_batch_size=1024)
    mem = estimate_breakdown(m, c, t, Layout.build(256, 1024, pp=4, vpp=4, ep=64),
                             with_interval=False).estimate.memory
    ours = {"weights+grads": mem.weights_gb + mem.grads_gb, "optimizer": mem.optimizer_gb,
            "activations": mem.activations_gb}
    ours["total"] = sum(ours.values())
    return {k: (ours[k], v) for k, v in DEEPSEEK_V3_ANATOMY.items()}
