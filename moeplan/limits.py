"""Upper bounds on every size a user can give, checked before any work starts.

Why: each planner step is polynomial in these sizes, but a typo (`--gpus 1000000000000`,
`num_layers: 1000000000`) or a crafted file (a YAML alias bomb) would otherwise run for minutes
and eat gigabytes before failing. Each bound sits one to two orders of magnitude above the
largest published model or cluster, so no real input is refused; the README's "Limits" table
lists them. Model sizes are enforced as pydantic field bounds in `specs/`, the rest by the
loader and the CLI through `check`.

No torch, and no I/O beyond reading this process's CPU quota: importable from the planner.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import SpecError

# ---------------------------------------------------------------- cluster and batch
MAX_GPUS = 131_072  # 2^17; the largest published training run used ~100k GPUs
MAX_SEQ_LEN = 16_777_216  # 16M tokens per sequence
MAX_GLOBAL_BATCH = 16_777_216  # sequences per step
MAX_SWEEP_POINTS = 1024  # whatif: clusters × GPU counts × seqs × batches × precisions

MAX_TOP_PLANS = 1000  # search/whatif --top
MAX_JOBS = 256  # validate --cv --jobs: worker processes one command starts at once
MIN_TIME_LIMIT_S = 0.1  # search/whatif --time-limit: less leaves the solver no time for a plan
MAX_TRAIN_ITERS = 10**9  # any iteration count: --train-iters, --lr-decay-iters, --eval-iters, ...

# ---------------------------------------------------------------- model shape (specs/model.py)
MAX_LAYERS = 1024  # largest published decoder: 126 layers (Llama 3 405B)
MAX_HIDDEN = 131_072  # model width, head dims and LoRA ranks
MAX_FFN = 1_048_576  # dense and expert intermediate sizes
MAX_HEADS = 4096
MAX_EXPERTS = 16_384  # routed experts per MoE layer (Kimi K2: 384)
MAX_VOCAB = 4_194_304  # largest published vocabulary: 262k (Gemma 3)
MAX_MTP_LAYERS = 64
MAX_LAYOUT_CHARS = 4 * (MAX_LAYERS + MAX_MTP_LAYERS + 2)
"""Characters a --stage-layout may unroll to: every layer, the embedding and the loss, each
with a stage separator, twice over. A longer one cannot match any model; refusing it before
it unrolls keeps `t*99999999999` from filling the memory."""
MAX_TOKENS = 1e18  # whatif --tokens: a quintillion, 50,000x today's largest pretraining runs
MAX_GPU_HOUR_USD = 1e6  # whatif --gpu-hour-price, per GPU-hour
MAX_BUDGET_USD = 1e15  # whatif --budget
MAX_DAYS = 1e6  # whatif --days
MIN_RATE = 1e-6
"""The least peak, bandwidth or memory size a cluster figure may state (a millionth of a
TFLOPS, GB/s or GB): a CPU host measured by `moeplan calibrate` is far above it, and a figure
below it (1e-308) would overflow the step time to infinity."""
MAX_TFLOPS = 1e5           # 100 PFLOPS per GPU: 20x today's densest FP4 part
MAX_MEMORY_GB = 1e5        # 100 TB per GPU, HBM or host
MAX_BANDWIDTH_GB_S = 1e6   # 1 PB/s per GPU, any link or memory
MAX_LATENCY_US = 1e6       # one second per message
MIN_MEASURE, MAX_MEASURE = 1e-6, 1e12
"""The range of a published measurement in a CSV of runs (tokens/s/GPU, TFLOPS, MFU, GB): any
real one is inside it by orders of magnitude, and 1e-308 would overflow every ratio."""
MAX_PRIOR_WEIGHT = 1e3
"""`calibrate --prior-weight`: at 1,000, moving a constant by 0.1% costs as much as an e-fold
step-time error on one run, so every constant stays at its starting value; a larger weight only
overflows the least squares (1e308 did, silently returning the starting constants)."""
MAX_IMBALANCE = 1024.0  # --imbalance: the busiest EP rank's tokens over the mean (measured: <3)
MAX_CAPACITY_FACTOR = float(MAX_EXPERTS)  # beyond E/k every expert can take every token
MAX_POSITIONS = MAX_SEQ_LEN

# ---------------------------------------------------------------- files and processes
MAX_FILE_BYTES = 8 * 1024 * 1024  # spec, plan, calibration, routing and CSV files
MAX_CSV_ROWS = 20_000
"""Rows a CSV of runs may hold (`validate`, with or without --cv): each row is priced at
every layout it may have run, about 7 ms a row, so 150,000 short rows (inside MAX_FILE_BYTES)
would run for a quarter of an hour. The shipped CSV holds about 430."""
MAX_DOCUMENT_NODES = 200_000  # YAML/JSON values after alias expansion
MAX_NESTING = 64  # mapping/list depth of a spec document
PROCS_PER_CORE = 4  # calibrate --nproc on CPU: oversubscription beyond this measures nothing
MAX_DEVICES_PER_NODE = 64  # calibrate --nproc before torch tells whether GPUs are present
EXCERPT_CHARS = 60  # longest piece of user input an error message quotes
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"

# ---------------------------------------------------------------- runs
# `run --seed`: the data stream and the weights are drawn from generators seeded by
# seed × 1,000,003 + step; below 2^32 that stays far inside torch's 64-bit seeds. A checkpoint's
# meta.json is held to the same rule (storage.check_meta calls `check_seed`).
MAX_SEED = 2**32 - 1
MAX_STEPS = 10**12  # `run --steps`: the step to reach
MAX_DIST_TIMEOUT_MINUTES = 7 * 24 * 60  # `run --distributed-timeout-minutes`: a week
MAX_LR = 100.0  # `lr`, `min_lr`: far above any Adam run, far below an fp32 overflow


def check_seed(seed: object, field: str = "--seed") -> int:
    """Refuse a seed outside 0..MAX_SEED: the one rule for `run --seed` and checkpoints."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise SpecError(f"{field} must be a whole number from 0 to {MAX_SEED:,}, got "
                        f"{excerpt(seed)}; the same seed gives the same data and weights, so "
                        "any number in that range will do.")
    return seed


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota
    (a container given 1.5 CPUs of time runs 2 processes at most usefully).
    `os.cpu_count()` counts the host's CPUs and ignores both."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max" and int(period) > 0:
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def max_cpu_procs() -> int:
    """Most processes `calibrate --nproc` / `whatif --workers` may start on this host."""
    return PROCS_PER_CORE * usable_cpus()


def clip(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` cut to `limit` characters (an ellipsis marks the cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """`repr(value)`, cut to `limit` characters, so an error never echoes a huge input back."""
    return clip(repr(value), limit)


def check(field: str, value: int, limit: int, fix: str) -> None:
    """Refuse `value` above `limit` with a message naming the field, the limit and the fix."""
    if value > limit:
        shown = f"{value:,}" if len(str(value)) <= 24 else f"{str(value)[:3]}… ({len(str(value))} digits)"
        raise SpecError(f"{field} {shown} is above the limit of {limit:,}; {fix}.")


def check_imbalance(value: float, field: str = "--imbalance") -> float:
    """Refuse an EP load imbalance outside 1..MAX_IMBALANCE, NaN included: the busiest rank
    gets at least the mean, and a factor beyond the limit (1e200) is no routing anyone ran."""
    if not 1.0 <= value <= MAX_IMBALANCE:  # NaN compares false
        raise SpecError(f"{field} {value!r}: the busiest EP rank's tokens over the mean must be "
                        f"a number from 1.0 (forced balance) to {MAX_IMBALANCE:g}; measured "
                        "dropless routing is below 3.")
    return value
