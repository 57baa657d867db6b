"""The per-layout MILP: recompute and offload per module per pipeline rank, layers per virtual
stage, optimizer offload fraction — minimising step time under each rank's memory budget.

Formulation (written like Alpa's auto-sharding ILP: names follow the math, constraint groups are
labelled as below, building / solving / decoding are separate functions):

  Sets      s ∈ S virtual stages (rank r(s) = s mod p), k ∈ K layer kinds, o ∈ O_k options
            (a recompute or an offload of one module of a kind-k layer).
  Data      t_k      time of one kind-k layer per micro-batch (forward + backward), s
            a_k      activation bytes of one kind-k layer per in-flight micro-batch
            w_k      static bytes (weights, grads, optimizer) of one kind-k layer on its rank
            τ_ko     time option o adds per layer per micro-batch (recompute forward, exposed copy)
            σ_ko     activation bytes option o frees per layer per in-flight micro-batch
            φ_s      in-flight micro-batches whose activations virtual stage s holds at its peak
            e_s, ε_s, ω_r  extra time / activation bytes of stage s, extra static bytes of rank r
                     (embedding, logits and loss, MTP, buffers)
            m micro-batches, B memory budget per GPU, P optimizer bytes per rank (offloadable)
  Variables x_s ∈ ℤ≥0 layers in virtual stage s; b_rko ∈ {0,1} option o for kind k on rank r;
            y_sko = n_sk · b_r(s)ko (linearised product), n_sk = layers of kind k in stage s;
            f ∈ [0, 1] optimizer offload fraction; T_r rank time per micro-batch; M ≥ T_r.
  Objective min  α·M + β·Σ_r T_r + γ·f            (schedule model; α, β from the pipeline)
  (layers)  Σ_s x_s = L;  the first D layers (dense) sit in stage 0: x_0 ≥ D
  (time)    T_r = Σ_{s∈r} (Σ_k t_k n_sk + Σ_ko τ_ko y_sko + e_s)
  (memory)  Σ_{s∈r} (Σ_k w_k n_sk + φ_s (Σ_k a_k n_sk − Σ_ko σ_ko y_sko + ε_s)) + ω_r − f P_r ≤ B
  (excl)    b_rko + b_rko' ≤ 1 for options that cannot combine (full vs the rest, ...)
  (product) y ≤ n, y ≤ U b, y ≥ n − U (1 − b), y ≥ 0
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pulp


@dataclass(frozen=True)
class Option:
    """One memory-saving choice for one module of a layer kind."""

    name: str  # module name as in SPEC §3 (`core_attn`, `expert_fc1`, `full`, ...)
    kind: str  # "recompute" or "offload"
    time_s: float  # τ: added time per layer per micro-batch
    saved_bytes: float  # σ: activation bytes freed per layer per in-flight micro-batch


@dataclass(frozen=True)
class LayerKind:
    name: str
    time_s: float  # t
    act_bytes: float  # a
    static_bytes: float  # w
    options: tuple[Option, ...] = ()


@dataclass(frozen=True)
class StageProblem:
    """Everything the MILP needs for one layout; built from the cost models by the planner."""

    kinds: tuple[LayerKind, ...]
    num_layers: int
    dense_first: int  # D: layers of kinds[0] that must sit in stage 0 (0 when one kind)
    pp: int
    vpp: int
    inflight: tuple[float, ...]  # φ_s per virtual stage
    stage_time_s: tuple[float, ...]  # e_s
    stage_act_bytes: tuple[float, ...]  # ε_s
    rank_static_bytes: tuple[float, ...]  # ω_r
    optimizer_bytes: tuple[float, ...]  # P_r, offloadable optimizer state per rank
    optimizer_offload_time_s: float  # γ: step time added at f = 1
    budget_bytes: float
    alpha: float  # weight of the slowest rank's time
    beta: float  # weight of the sum of rank times
    exclusive: tuple[tuple[str, str], ...] = ()  # option-name pairs that cannot combine
    fixed_layers: tuple[int, ...] | None = None  # stage layout given by the user
    allow_offload_optimizer: bool = True

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, s: int) -> int:
        return s % self.pp


@dataclass
class StageSolution:
    step_time_s: float
    layers: list[int]
    options: list[dict[str, list[str]]]  # per rank: kind → chosen option names
    optimizer_offload_fraction: float
    rank_memory_bytes: list[float] = field(default_factory=list)


class InfeasibleStages(Exception):
    """No choice of options and stage layers fits the budget for this layout."""


def _n(problem: StageProblem, x: Sequence, s: int, k: int):  # noqa: ANN202 - affine expression
    """Layers of kind k in stage s: dense layers all in stage 0, the rest are kind 1."""
    if len(problem.kinds) == 1:
        return x[s]
    D = problem.dense_first
    if k == 0:
        return D if s == 0 else 0
    return x[s] - D if s == 0 else x[s]


def build(problem: StageProblem) -> tuple[pulp.LpProblem, dict]:
    """The MILP of the module docstring, returned with its variables for decoding."""
    P = problem
    S, R, K = P.stages, P.pp, len(P.kinds)
    L = P.num_layers
    lp = pulp.LpProblem("stage_choices", pulp.LpMinimize)
    if P.fixed_layers is not None:
        x = list(P.fixed_layers)
    else:
        x = [lp.add_variable(f"x_{s}", 0, L, cat="Integer") for s in range(S)]
        lp += pulp.lpSum(x) == L, "layers_total"
        if K > 1 and P.dense_first:
            lp += x[0] >= P.dense_first, "layers_dense_first"
    b = {(r, k, o.name): lp.add_variable(f"b_{r}_{k}_{o.name}", cat="Binary")
         for r in range(R) for k in range(K) for o in P.kinds[k].options}
    y = {}
    for s in range(S):
        r = P.rank_of(s)
        for k in range(K):
            n = _n(P, x, s, k)
            for o in P.kinds[k].options:
                v = lp.add_variable(f"y_{s}_{k}_{o.name}", 0, L)
                bb = b[r, k, o.name]
                lp += v <= n, f"product_le_n_{s}_{k}_{o.name}"
                lp += v <= L * bb, f"product_le_b_{s}_{k}_{o.name}"
                lp += v >= n - L * (1 - bb), f"product_ge_{s}_{k}_{o.name}"
                y[s, k, o.name] = v
    f = (lp.add_variable("f", 0, 1) if P.allow_offload_optimizer and any(P.optimizer_bytes)
         else 0)
    T = [lp.add_variable(f"T_{r}", 0) for r in range(R)]
    M = lp.add_variable("M", 0)
    for r in range(R):
        time_terms, mem_terms = [], []
        for s in range(r, S, R):
            for k, kind in enumerate(P.kinds):
                n = _n(P, x, s, k)
                time_terms.append(kind.time_s * n)
                mem_terms.append((kind.static_bytes + P.inflight[s] * kind.act_bytes) * n)
                for o in kind.options:
                    time_terms.append(o.time_s * y[s, k, o.name])
                    mem_terms.append(-P.inflight[s] * o.saved_bytes * y[s, k, o.name])
            time_terms.append(P.stage_time_s[s])
            mem_terms.append(P.inflight[s] * P.stage_act_bytes[s])
        lp += T[r] == pulp.lpSum(time_terms), f"time_rank_{r}"
        lp += M >= T[r], f"time_max_{r}"
        lp += (pulp.lpSum(mem_terms) + P.rank_static_bytes[r] - P.optimizer_bytes[r] * f
               <= P.budget_bytes), f"memory_rank_{r}"
        for k, kind in enumerate(P.kinds):
            names = {o.name for o in kind.options}
            for a, c in P.exclusive:
                if a in names and c in names:
                    lp += b[r, k, a] + b[r, k, c] <= 1, f"excl_{r}_{k}_{a}_{c}"
    lp += P.alpha * M + P.beta * pulp.lpSum(T) + P.optimizer_offload_time_s * f, "step_time"
    return lp, {"x": x, "b": b, "f": f, "T": T}


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """HiGHS prints a banner on stdout; `--json` promises stdout holds only the document."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def solver() -> pulp.LpSolver:
    """HiGHS in-process when highspy is installed (fast: no subprocess per solve), else CBC."""
    highs = pulp.HiGHS(msg=False)
    return highs if highs.available() else pulp.PULP_CBC_CMD(msg=False)


def solve(problem: StageProblem) -> StageSolution:
    """Build, solve and decode; raises InfeasibleStages when nothing fits."""
    lp, v = build(problem)
    with _stdout_to_stderr():
        lp.solve(solver())
    if pulp.LpStatus[lp.status] != "Optimal":
        raise InfeasibleStages(pulp.LpStatus[lp.status])
    sol = decode(problem, lp, v)
    _, sol.rank_memory_bytes = evaluate(problem, sol.layers, sol.options,
                                        sol.optimizer_offload_fraction)
    return sol


def _val(e: object) -> float:
    return float(pulp.value(e)) if not isinstance(e, (int, float)) else float(e)


def decode(problem: StageProblem, lp: pulp.LpProblem, v: dict) -> StageSolution:
    layers = [round(_val(x)) for x in v["x"]]
    options: list[dict[str, list[str]]] = []
    for r in range(problem.pp):
        chosen: dict[str, list[str]] = {}
        for k, kind in enumerate(problem.kinds):
            names = [o.name for o in kind.options if _val(v["b"][r, k, o.name]) > 0.5]
            if names:
                chosen[kind.name] = names
        options.append(chosen)
    return StageSolution(
        step_time_s=_val(lp.objective),
        layers=layers,
        options=options,
        optimizer_offload_fraction=round(_val(v["f"]), 6),
    )


def evaluate(problem: StageProblem, layers: Sequence[int],
             options: Sequence[dict[str, Sequence[str]]], f: float = 0.0
             ) -> tuple[float, list[float]]:
    """Step time and per-rank memory of given choices, by the same formulas as the MILP.

    The brute-force reference search uses this to check the MILP's optimum.
    """
    P = problem
    T = [0.0] * P.pp
    mem = [0.0] * P.pp
    for s in range(P.stages):
        r = P.rank_of(s)
        for k, kind in enumerate(P.kinds):
            n = _n(P, layers, s, k)
            T[r] += kind.time_s * n
            mem[r] += (kind.static_bytes + P.inflight[s] * kind.act_bytes) * n
            chosen = set(options[r].get(kind.name, ()))
            for o in kind.options:
                if o.name in chosen:
                    T[r] += o.time_s * n
                    mem[r] -= P.inflight[s] * o.saved_bytes * n
        T[r] += P.stage_time_s[s]
        mem[r] += P.inflight[s] * P.stage_act_bytes[s]
    for r in range(P.pp):
        mem[r] += P.rank_static_bytes[r] - P.optimizer_bytes[r] * f
    step = P.alpha * max(T) + P.beta * sum(T) + P.optimizer_offload_time_s * f
    return step, mem
