"""`moeplan whatif`: what to buy or reserve, and how long training will take.

A sweep is a grid of points (cluster kind × GPU count × sequence length × global batch ×
precision); each point gets the planner's best plan (a full `search`, top 1), and from its
estimate the time and cost to train a token budget:

    days   = tokens / (tokens_per_s_per_gpu · gpus) / 86 400
    gpu_h  = gpus · days · 24,            cost = gpu_h · price per GPU-hour
    strong-scaling efficiency(n) = tokens_per_s_per_gpu(n) / tokens_per_s_per_gpu(n₀)

with n₀ the smallest count of the same (cluster, seq, gbs, precision) that fits. The Pareto
front is over (days, cost), or (days, GPU-hours) when no price is given, since then GPU-hours
are what the cost is proportional to.

Why the structure: a search of a large model costs seconds to a minute, so this module does
each distinct search once (`Sweep.point` caches by (cluster, gpus, seq, gbs, precision)), shares
layer-cost tables and module sets between the searches (`SearchCache`: they do not depend on
the GPU count; worker processes share them over the points each one searches), loads specs once, runs the cheap points first (fewest GPUs: fewest layouts) so progress shows early,
and spreads an overall time limit over the points still to run. The inverse questions
(`--days`, `--budget`) reuse the same cache. Pure: no torch, no matplotlib, no I/O.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..errors import InfeasibleError, SpecError
from ..limits import MAX_BUDGET_USD, MAX_DAYS, MAX_GPU_HOUR_USD, MAX_TOKENS
from ..specs import ClusterSpec, ModelSpec, Plan, load_cluster, load_model, load_training
from ..specs.loader import check_stack
from .enumerate import SearchSpace
from .problem import Option
from .search import SearchCache, search

SECONDS_PER_DAY = 86_400.0
# GPU counts tried by `--days` when no --gpus list is given: whole 8-GPU nodes, doubling.
DEFAULT_DAYS_COUNTS = tuple(8 << i for i in range(11))  # 8 … 8192
AUTO_WORKERS_MAX = 8

Progress = Callable[[str], None]


def sweep_gbs(seq: int, gpus: int, tokens: int = 4 * 1024 * 1024) -> int:
    """About `tokens` per step, as the odd part of the GPU count times a power of two.

    `default_gbs` is a power of two, which no data-parallel width divides when the count is not
    one (72 GPUs of an NVL72 rack: dp 9 or 18). odd(gpus)·2^k is divisible by every dp that
    divides the count and has at most k factors of two, so e.g. 72 GPUs at seq 4096 get
    9·128 = 1152 sequences (4.7M tokens); powers of two get exactly `default_gbs`.
    """
    odd = gpus // (gpus & -gpus)
    two = 1 << max(0, round(math.log2(max(1.0, tokens / seq / odd))))
    return odd * two


@dataclass
class Point:
    """One sweep point and what the best plan on it costs; `why` says why it cannot fit."""

    cluster: str
    gpus: int
    seq: int
    gbs: int
    precision: str
    fits: bool
    plan: Plan | None = None
    why: str | None = None
    gpu_hour_price: float | None = None
    tokens: float = 0.0
    search_seconds: float = 0.0
    stopped_early: bool = False
    scaling_efficiency: float | None = None
    pareto: bool = False
    asked_gbs: int | None = None  # None: the default about 4M tokens, which varies with gpus
    # from the best plan's estimate (kept as fields so that points can be made by hand)
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None

    def take(self, plan: Plan) -> None:
        """Adopt a search's best plan and its estimate's figures."""
        assert plan.estimate is not None
        self.plan, self.fits = plan, True
        self.tokens_per_s_per_gpu = plan.estimate.tokens_per_s_per_gpu
        self.mfu, self.step_time_s = plan.estimate.mfu, plan.estimate.step_time_s

    @property
    def days_to_train(self) -> float | None:
        tps = self.tokens_per_s_per_gpu
        if not tps or not self.tokens:
            return None
        return self.tokens / (tps * self.gpus) / SECONDS_PER_DAY

    @property
    def gpu_hours(self) -> float | None:
        d = self.days_to_train
        return None if d is None else d * 24.0 * self.gpus

    @property
    def cost_usd(self) -> float | None:
        h = self.gpu_hours
        return None if h is None or self.gpu_hour_price is None else h * self.gpu_hour_price

    @property
    def price_axis(self) -> float | None:
        """What the Pareto front trades time against: dollars, else GPU-hours."""
        return self.cost_usd if self.gpu_hour_price is not None else self.gpu_hours

    @property
    def label(self) -> str:
        return f"{self.cluster} × {self.gpus}"

    @property
    def tokens_interval(self) -> tuple[float, float] | None:
        """The best plan's 80 % interval of tokens/s/GPU."""
        e = self.plan.estimate if self.plan is not None else None
        return None if e is None or e.interval is None else e.interval.tokens_per_s_per_gpu

    @property
    def days_interval(self) -> tuple[float, float] | None:
        """Days to train at the interval's high and low end of throughput."""
        iv = self.tokens_interval
        if iv is None or not self.tokens:
            return None
        return (self.tokens / (iv[1] * self.gpus) / SECONDS_PER_DAY,
                self.tokens / (iv[0] * self.gpus) / SECONDS_PER_DAY)

    @property
    def cost_interval(self) -> tuple[float, float] | None:
        d = self.days_interval
        if d is None or self.gpu_hour_price is None:
            return None
        return (d[0] * 24 * self.gpus * self.gpu_hour_price,
                d[1] * 24 * self.gpus * self.gpu_hour_price)

    def to_json(self, with_plan: bool = True) -> dict[str, Any]:
        """One entry of `points` in the `moeplan whatif --json` document (SPEC §4)."""

        def r(x: float | None, nd: int = 6) -> float | None:
            return None if x is None else round(x, nd)

        return {
            "cluster": self.cluster, "gpus": self.gpus, "seq": self.seq, "gbs": self.gbs,
            "precision": (self.plan.training.precision if self.plan else self.precision),
            "fits": self.fits,
            "plan": self.plan.model_dump(mode="json") if (self.plan and with_plan) else None,
            "tokens_per_s_per_gpu": r(self.tokens_per_s_per_gpu, 2), "mfu": r(self.mfu, 4),
            "step_time_s": r(self.step_time_s, 4), "days_to_train": r(self.days_to_train, 4),
            "gpu_hours": r(self.gpu_hours, 1), "gpu_hour_price": self.gpu_hour_price,
            "cost_usd": r(self.cost_usd, 2), "scaling_efficiency": r(self.scaling_efficiency, 4),
            "days_to_train_interval": (None if self.days_interval is None
                                       else [round(x, 4) for x in self.days_interval]),
            "cost_usd_interval": (None if self.cost_interval is None
                                  else [round(x, 2) for x in self.cost_interval]),
            "pareto": self.pareto, "why": self.why,
            "search_seconds": round(self.search_seconds, 3), "stopped_early": self.stopped_early,
        }


@dataclass
class WhatIf:
    """A finished sweep: points in grid order, the Pareto front, and the inverse answers."""

    model: str
    tokens: float
    points: list[Point]
    pareto: list[int]  # indices into points, fastest first
    days: dict[str, Any] | None = None
    budget: dict[str, Any] | None = None
    seconds: float = 0.0
    priced: bool = False
    stack: str = "current"  # the software stack every point was priced on

    @property
    def any_fits(self) -> bool:
        return any(p.fits for p in self.points)

    def why_not(self, p: Point) -> str:
        """Why a point is not a choice: what stopped it fitting, or which point of the front
        beats it ("" for a point of the front). The one sentence the table, the reports and
        the JSON's `why` print."""
        if not p.fits:
            return p.why or "no plan fits (the search found none)"
        if p.stopped_early:
            return "stopped at the time limit"
        if p.pareto or p.days_to_train is None or p.price_axis is None:
            return ""
        better = [q for q in (self.points[i] for i in self.pareto)
                  if q.days_to_train is not None and q.price_axis is not None
                  and q.days_to_train <= p.days_to_train and q.price_axis <= p.price_axis]
        if not better:
            return ""
        q = min(better, key=lambda q: q.days_to_train or 0.0)
        cheaper = "no dearer" if self.priced else "no more GPU-hours"
        return f"off the front: {q.label} GPUs is no slower and {cheaper}"

    def to_json(self, with_plans: bool = True) -> dict[str, Any]:
        """The `moeplan whatif --json` document (SPEC §4), plus the inverse answers."""
        doc: dict[str, Any] = {
            "model": self.model, "tokens": self.tokens, "software_stack": self.stack,
            "points": [{**p.to_json(with_plans), "why": self.why_not(p) or None}
                       for p in self.points],
            "pareto": [{"index": i, "cluster": self.points[i].cluster,
                        "gpus": self.points[i].gpus, "seq": self.points[i].seq,
                        "days_to_train": round(self.points[i].days_to_train or 0.0, 4),
                        "cost_usd": (None if self.points[i].cost_usd is None
                                     else round(self.points[i].cost_usd, 2)),
                        "gpu_hours": round(self.points[i].gpu_hours or 0.0, 1)}
                       for i in self.pareto],
            "pareto_axes": ["days_to_train", "cost_usd" if self.priced else "gpu_hours"],
            "seconds": round(self.seconds, 3),
        }
        if self.days is not None:
            doc["days"] = self.days
        if self.budget is not None:
            doc["budget"] = self.budget
        return doc


def pareto_front(points: Sequence[Point]) -> list[int]:
    """Indices of the fitting points no other point beats on both time and cost, fastest first.

    A point is dominated when another is no slower and no dearer, and strictly better on one;
    equal points are both kept. O(n log n): sort by (days, cost), keep each strictly cheaper one.
    """
    cand = [(p.days_to_train, p.price_axis, i) for i, p in enumerate(points)
            if p.fits and p.days_to_train is not None and p.price_axis is not None]
    cand.sort()
    front: list[int] = []
    best_cost, best_days = float("inf"), None
    for days, cost, i in cand:
        if cost < best_cost or (cost == best_cost and days == best_days):
            front.append(i)
            best_cost, best_days = cost, days
    return front


def scaling_efficiencies(points: Sequence[Point]) -> None:
    """Set each fitting point's strong-scaling efficiency against the smallest fitting count of
    its (cluster, seq, asked gbs, precision) series: per-GPU throughput relative to that count.
    With the default batch (about 4M tokens) the series keeps the tokens per step, not the exact
    sequence count, fixed."""
    base: dict[tuple, Point] = {}
    for p in sorted((p for p in points if p.fits), key=lambda p: p.gpus):
        base.setdefault((p.cluster, p.seq, p.asked_gbs, p.precision), p)
    for p in points:
        b = base.get((p.cluster, p.seq, p.asked_gbs, p.precision))
        if p.fits and b is not None and b.tokens_per_s_per_gpu:
            p.scaling_efficiency = (p.tokens_per_s_per_gpu or 0.0) / b.tokens_per_s_per_gpu


def _check_quantities(tokens: float, days: float | None, budget_usd: float | None) -> None:
    """Refuse a token count, a deadline or a budget outside what any run could be."""
    if not 0 < tokens <= MAX_TOKENS:
        raise SpecError(f"--tokens takes a positive number of tokens up to {MAX_TOKENS:g} "
                        f"(e.g. 15e12), got {tokens}.")
    if days is not None and not 0 < days <= MAX_DAYS:
        raise SpecError(f"--days takes a positive number of days up to {MAX_DAYS:g}, got "
                        f"{days}.")
    if budget_usd is not None and not 0 < budget_usd <= MAX_BUDGET_USD:
        raise SpecError(f"--budget takes a positive number of USD up to {MAX_BUDGET_USD:g}, got "
                        f"{budget_usd}.")


def _prices(clusters: Sequence[str], prices: float | Sequence[float] | None
            ) -> dict[str, float | None]:
    """One price per cluster kind: a single value for all, or a list in --cluster order."""
    if prices is None:
        return dict.fromkeys(clusters)
    if any(not 0 <= p <= MAX_GPU_HOUR_USD
           for p in ([prices] if isinstance(prices, (int, float)) else prices)):
        raise SpecError(f"--gpu-hour-price takes prices from zero to {MAX_GPU_HOUR_USD:g} USD "
                        "per GPU-hour.")
    if isinstance(prices, (int, float)):
        return dict.fromkeys(clusters, float(prices))
    prices = list(prices)
    if len(prices) == 1:
        return dict.fromkeys(clusters, float(prices[0]))
    if len(prices) != len(clusters):
        raise SpecError(f"--gpu-hour-price takes one price or one per cluster kind "
                        f"({len(clusters)}: {', '.join(clusters)}), got {len(prices)}.")
    return {c: float(p) for c, p in zip(clusters, prices, strict=True)}


@dataclass
class Sweep:
    """Specs loaded once and one cached search per (cluster, gpus, seq, gbs, precision).

    `time_limit_s` is an overall budget: each search gets the time still left divided by the
    searches still expected (`expected`), so early points cannot starve later ones.
    """

    model: ModelSpec
    clusters: dict[str, ClusterSpec]
    tokens: float
    prices: dict[str, float | None]
    top_k: int = 1
    time_limit_s: float | None = None
    space: SearchSpace | None = None
    options: tuple[Option, ...] | None = None
    progress: Progress | None = None
    expected: int = 1
    stack: str = "current"  # TrainingSpec.software_stack every point is priced on
    start: float = field(default_factory=time.perf_counter)
    cache: dict[tuple, Point] = field(default_factory=dict)
    shared: SearchCache = field(default_factory=SearchCache)  # layer tables across points

    def _budget(self) -> float | None:
        if self.time_limit_s is None:
            return None
        left = self.time_limit_s - (time.perf_counter() - self.start)
        todo = max(1, self.expected - len(self.cache))
        return max(0.05, left / todo)

    def _start(self, cluster: str, gpus: int, seq: int, gbs: int | None, precision: str
               ) -> tuple[tuple, Point] | tuple[tuple, None]:
        """The cache key of a point, and a fresh Point when it has not been searched yet."""
        asked = gbs
        gbs = gbs or sweep_gbs(seq, gpus)
        key = (cluster, gpus, seq, gbs, precision)
        if key in self.cache:
            return key, None
        return key, Point(cluster, gpus, seq, gbs, precision, fits=False, asked_gbs=asked,
                          gpu_hour_price=self.prices.get(cluster), tokens=self.tokens)

    def _finish(self, key: tuple, pt: Point, found: tuple[Plan | None, str | None, bool, float]
                ) -> Point:
        pt.plan, pt.why, pt.stopped_early, pt.search_seconds = found
        if pt.plan is not None:
            pt.take(pt.plan)
        self.cache[key] = pt
        if self.progress:
            n = len(self.cache)
            what = (f"{pt.tokens_per_s_per_gpu:,.0f} tok/s/GPU, {pt.days_to_train:.1f} days"
                    if pt.fits and pt.days_to_train is not None else
                    f"{pt.tokens_per_s_per_gpu:,.0f} tok/s/GPU" if pt.fits else "does not fit")
            self.progress(f"[{n}/{max(n, self.expected)}] {pt.cluster} × {pt.gpus}, seq "
                          f"{pt.seq}, gbs {pt.gbs}, {pt.precision}: {what} "
                          f"({pt.search_seconds:.1f} s)")
        return pt

    def point(self, cluster: str, gpus: int, seq: int, gbs: int | None, precision: str) -> Point:
        """The best plan at one point (searched once; later calls hit the cache)."""
        key, pt = self._start(cluster, gpus, seq, gbs, precision)
        if pt is None:
            return self.cache[key]
        if self.progress:
            n = len(self.cache) + 1
            self.progress(f"[{n}/{max(n, self.expected)}] {cluster} × {gpus}, seq {seq}, "
                          f"gbs {pt.gbs}, {precision}: searching")
        found = search_point(self.model, self.clusters[cluster], pt.gpus, pt.seq, pt.gbs,
                             pt.precision, self.top_k, self._budget(), self.space, self.options,
                             self.shared, self.stack)
        return self._finish(key, pt, found)

    def prefetch(self, keys: Sequence[tuple], workers: int) -> None:
        """Search many points at once in `workers` processes (points are independent).

        Each search gets the time left × workers / points left, since `workers` run at once.
        `workers` 0 is one per CPU core (at most AUTO_WORKERS_MAX) when there are four points
        or more: a worker costs about a second to start (imports), a point seconds to search.
        """
        todo = []
        for k in keys:
            key, pt = self._start(*k)
            if pt is not None and key not in {t[0] for t in todo}:
                todo.append((key, pt))
        if workers <= 0:  # auto: one process per core once there are enough points to share
            workers = min(AUTO_WORKERS_MAX, os.cpu_count() or 1) if len(todo) >= 4 else 1
        if workers <= 1 or len(todo) <= 1:
            for _key, pt in todo:
                self.point(*k_of(pt))
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        share = None
        if self.time_limit_s is not None:
            left = self.time_limit_s - (time.perf_counter() - self.start)
            share = max(0.05, left * workers / max(len(todo), self.expected - len(self.cache)))
        if self.progress:
            self.progress(f"searching {len(todo)} points in {min(workers, len(todo))} processes")
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding HiGHS state
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx) as pool:
            futures = [(key, pt, pool.submit(
                search_point, self.model, self.clusters[pt.cluster], pt.gpus, pt.seq, pt.gbs,
                pt.precision, self.top_k, share, self.space, self.options, None, self.stack))
                for key, pt in todo]
            for key, pt, fut in futures:
                self._finish(key, pt, fut.result())


def search_cost(model: ModelSpec, cluster: ClusterSpec, gpus: int, seq: int) -> tuple:
    """A sort key that puts the cheap searches first: memory pressure, then sequence length.

    Where weights, gradients and Adam state (~18 bytes a parameter) take a small share of the
    cluster's HBM, the time bound prunes almost every layout; where memory binds, most layouts
    need a recompute/offload MILP (Qwen3-235B: 5–13 s per point at 1,024 GPUs, 12–70 s at
    64–256; docs/BENCHMARKS.md). Cheap points first show progress early and, under a time
    limit, hand the time they do not use on to the expensive ones.
    """
    return (model.total_params() * 18 / (gpus * cluster.hbm_gb * 1e9), seq)


@lru_cache(maxsize=1)
def _process_cache() -> SearchCache:
    """The cache a worker process shares over its points (the pool lives for one sweep)."""
    return SearchCache()


def k_of(pt: Point) -> tuple:
    """The point() arguments that reach `pt` (its asked batch, so the cache key matches)."""
    return (pt.cluster, pt.gpus, pt.seq, pt.asked_gbs, pt.precision)


def search_point(model: ModelSpec, cluster: ClusterSpec, gpus: int, seq: int, gbs: int,
                 precision: str, top_k: int, share: float | None, space: SearchSpace | None,
                 options: tuple[Option, ...] | None, cache: SearchCache | None = None,
                 stack: str = "current") -> tuple[Plan | None, str | None, bool, float]:
    """One search: (best plan or None, why not, stopped at the time limit, seconds).

    Module-level and picklable so that worker processes can run it; a worker passes no cache
    and shares its process's own (`_process_cache`) over the points it searches.
    """
    cache = cache if cache is not None else _process_cache()
    t0 = time.perf_counter()
    spec = cluster.with_gpus(gpus)
    if precision != "auto" and not spec.supports(precision):
        return None, f"{spec.gpu} ({spec.architecture}) has no {precision} support.", False, 0.0
    tr = load_training(seq_len=seq, global_batch_size=gbs,
                       precision="bf16" if precision == "auto" else precision,
                       software_stack=stack)
    try:
        res = search(model, spec, tr, gpus, top_k=top_k, precision=precision,
                     time_limit_s=share, space=space, options=options, cache=cache,
                     grad_reduce_flag=False)  # whatif has no --grad-reduce to suggest
        return res.plans[0], None, res.stopped_early, time.perf_counter() - t0
    except InfeasibleError as e:
        why = " ".join(str(e).split())
        if share is not None and time.perf_counter() - t0 >= share:
            why = (f"the search reached this point's {share:.1f} s share of --time-limit before "
                   "it found any plan (not a sign that nothing fits); raise --time-limit")
        return None, why, False, time.perf_counter() - t0
    except SpecError as e:  # e.g. a precision the search space refuses: a point-level reason
        return None, " ".join(str(e).split()), False, time.perf_counter() - t0


def fewest_gpus(sweep: Sweep, cluster: str, days: float, counts: Sequence[int], seq: int,
                gbs: int | None, precision: str) -> dict[str, Any]:
    """The fewest GPUs of one kind (from `counts`) that train the tokens within `days`.

    Binary search over the sorted counts, assuming that more GPUs never train slower (true of
    the best plan up to the noise of a time-limited search); each probe is a cached point.
    """
    counts = sorted(set(counts))
    lo, hi, best = 0, len(counts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        p = sweep.point(cluster, counts[mid], seq, gbs, precision)
        if p.fits and p.days_to_train is not None and p.days_to_train <= days:
            best, hi = p, mid - 1
        else:
            lo = mid + 1
    if best is None:
        top = sweep.point(cluster, counts[-1], seq, gbs, precision)
        why = (f"{counts[-1]} GPUs (the most tried) take {top.days_to_train:.1f} days"
               if top.fits and top.days_to_train is not None else
               f"{counts[-1]} GPUs (the most tried) do not fit: {top.why}")
        return {"cluster": cluster, "gpus": None, "gbs": gbs, "days_to_train": None,
                "cost_usd": None, "why": why}
    return {"cluster": cluster, "gpus": best.gpus, "gbs": best.gbs,
            "days_to_train": round(best.days_to_train, 4),
            "cost_usd": None if best.cost_usd is None else round(best.cost_usd, 2),
            "gpu_hours": round(best.gpu_hours or 0.0, 1), "why": None}


def fastest_within(points: Sequence[Point], budget_usd: float) -> dict[str, Any]:
    """The fitting point that trains fastest for at most `budget_usd` (ties: the cheaper)."""
    ok = [(p.days_to_train, p.cost_usd, i) for i, p in enumerate(points)
          if p.fits and p.cost_usd is not None and p.days_to_train is not None
          and p.cost_usd <= budget_usd]
    if not ok:
        costs = [p.cost_usd for p in points if p.fits and p.cost_usd is not None]
        why = (f"the cheapest option costs ${min(costs):,.0f}" if costs
               else "no point fits")
        return {"budget_usd": budget_usd, "index": None, "why": why}
    days, cost, i = min(ok)
    p = points[i]
    return {"budget_usd": budget_usd, "index": i, "cluster": p.cluster, "gpus": p.gpus,
            "seq": p.seq, "days_to_train": round(days, 4), "cost_usd": round(cost, 2),
            "why": None}


def _distinct_kinds(entries: Sequence[str], names: Sequence[str]) -> None:
    """Refuse two --cluster entries of one name: points, prices and the table are keyed by it.
    A spec file saved from a preset (`moeplan specs show h100 --json`) keeps the preset's
    name, so the message says which file carries the clashing name and how to rename it."""
    from pathlib import Path

    from ..limits import clip, excerpt

    def shown(entry: str) -> str:  # a path, whole up to any real one's length
        return excerpt(entry, 240)

    for name in dict.fromkeys(names):
        given = [e for e, n in zip(entries, names, strict=True) if n == name]
        if len(given) < 2:
            continue
        files = [e for e in given if Path(e).is_file()]
        if not files:
            raise SpecError(f"--cluster gives the kind {excerpt(name)} twice "
                            f"({', '.join(map(shown, given))}); give each cluster once.")
        stem = Path(files[-1]).stem
        rename = stem if stem != name else f"{name}-mine"
        raise SpecError(f"--cluster: {' and '.join(map(shown, given))} are both named "
                        f"{excerpt(name)} (the file {shown(files[-1])} carries `name: "
                        f"{clip(name)}`); the sweep tells kinds apart by name, so change the "
                        f"`name:` in that file (say to `name: {clip(rename)}`) or drop one of "
                        "them.")


def whatif(
    model: ModelSpec | str,
    clusters: Sequence[ClusterSpec | str] | str,
    gpus: Sequence[int] | None = None,
    *,
    seqs: Sequence[int] = (4096,),
    gbs: Sequence[int] | None = None,
    precisions: Sequence[str] = ("bf16",),
    tokens: float = 15e12,
    gpu_hour_price: float | Sequence[float] | None = None,
    days: float | None = None,
    budget_usd: float | None = None,
    top_k: int = 1,
    time_limit_s: float | None = None,
    progress: Progress | None = None,
    space: SearchSpace | None = None,
    options: tuple[Option, ...] | None = None,
    workers: int = 0,
    stack: str = "current",
) -> WhatIf:
    """Sweep clusters × GPU counts × seqs × batches × precisions (SPEC §4 `moeplan whatif`).

    Returns every point (infeasible ones with `fits=False` and `why`), the Pareto front and,
    when asked, the fewest GPUs per kind within `days` and the fastest option within
    `budget_usd`. Never raises for an infeasible point: the caller decides what "nothing fits"
    means (the CLI exits 3). `gbs` None means about 4M tokens per step for each seq and count
    (`sweep_gbs`). `workers` > 1 searches the grid's points in that many processes; 0 (the
    default) uses one per CPU core for grids of four points or more. `stack` is the software
    stack every point is priced on (`TrainingSpec.software_stack`).
    """
    start = time.perf_counter()
    if isinstance(clusters, str):
        clusters = [c.strip() for c in clusters.split(",") if c.strip()]
    if not clusters:
        raise SpecError("--cluster needs at least one cluster preset or file.")
    _check_quantities(tokens, days, budget_usd)
    if budget_usd is not None and gpu_hour_price is None:
        raise SpecError("--budget needs --gpu-hour-price to turn GPU-hours into dollars.")
    if not gpus and days is None:
        raise SpecError("whatif needs --gpus N1,N2,... (or --days D to find the counts).")
    stack = check_stack(stack)  # once, not as each point's reason
    m = load_model(model)
    specs = [load_cluster(c) for c in clusters]
    names = [c.name for c in specs]
    _distinct_kinds(clusters, names)
    sweep = Sweep(m, dict(zip(names, specs, strict=True)), tokens,
                  _prices(names, gpu_hour_price), top_k=top_k, time_limit_s=time_limit_s,
                  space=space, options=options, progress=progress, stack=stack)
    batches = list(gbs) if gbs else [None]
    grid = [(c, n, s, b, p) for c in names for n in sorted(set(gpus or ())) for s in seqs
            for b in batches for p in precisions]
    inverse = (len(names) * len(seqs) * len(batches) * len(precisions)
               * (4 if days is not None and not gpus else 0))
    sweep.expected = len(grid) + inverse
    sweep.prefetch(sorted(grid, key=lambda k: search_cost(m, sweep.clusters[k[0]], k[1], k[2])),
                   workers)
    answer_days = None
    if days is not None:
        counts = sorted(set(gpus)) if gpus else list(DEFAULT_DAYS_COUNTS)
        answer_days = {"target_days": days, "answers": [
            {**fewest_gpus(sweep, c, days, counts, s, b, p), "seq": s, "precision": p}
            for c in names for s in seqs for b in batches for p in precisions]}
    points = [sweep.point(*k) for k in grid]
    if not gpus:  # --days alone: report the points it probed
        points = sorted(sweep.cache.values(), key=lambda p: (names.index(p.cluster), p.gpus))
    scaling_efficiencies(points)
    front = pareto_front(points)
    for i in front:
        points[i].pareto = True
    answer_budget = fastest_within(points, budget_usd) if budget_usd is not None else None
    return WhatIf(m.name, tokens, points, front, answer_days, answer_budget,
                  time.perf_counter() - start, priced=gpu_hour_price is not None, stack=stack)
