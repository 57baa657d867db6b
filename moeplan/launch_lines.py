"""The one builder of torchrun and SLURM command lines for `moeplan run`, and their quoting.

Two callers: `moeplan run` starting torchrun's agent on this node (`runtime.launch`, an argv
for subprocess, no shell), and `moeplan export --format torchrun|slurm` writing a launch line or
an sbatch script (`planner.export`, shell text). Both take the node split and the rendezvous
flags from here, so a plan launches the same way whichever way it is started.

Shell text: every token is single-quoted by shlex.quote except `ShellRef`s, which only this
package builds and which may hold nothing but `$NAME` references and plain characters, so no
input can reach the shell as code. No torch: the planner imports this.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

from .errors import SpecError


class ShellRef(str):
    """A token the generated script must expand (`$MASTER_ADDR:$MASTER_PORT`), written in
    double quotes. Only tokens built by moeplan are ShellRefs, and they may hold nothing but
    `$NAME` references and `[A-Za-z0-9_.:/-]`; every other token (plan paths, names, flag
    values) is single-quoted by shlex.quote, so no input can reach the shell as code."""

    # `${NAME:?}`: a placeholder the user must set (the shell stops, naming it, if unset)
    _SAFE = re.compile(r"(?:\$[A-Z_][A-Z0-9_]*|\$\{[A-Z_][A-Z0-9_]*:\?\}|[A-Za-z0-9_.:/-])+")

    def __new__(cls, text: str) -> ShellRef:
        if not cls._SAFE.fullmatch(text):
            raise ValueError(f"not a plain variable reference: {text!r}")
        return super().__new__(cls, text)


MASTER_ENDPOINT = ShellRef("$MASTER_ADDR:$MASTER_PORT")
SLURM_JOB_ID = ShellRef("$SLURM_JOB_ID")

NUMA_BINDING = ("--numa-binding", "node")
"""torchrun's flag (PyTorch ≥ 2.9) that starts each GPU worker under numactl, bound to the CPUs
of its GPU's NUMA node. NVIDIA's Megatron-Bridge performance launches bind every rank so
(`numactl --cpunodebind --membind` in scripts/performance/utils/executors.py since 2025-08), and
the published rows the host floor's launch time is fitted on ran there; Megatron-LM's DeepSeek-V3
GB200 guide measured the binding at +10% end to end on a host-bound layout (its section 2.4).
A GPU launch binds its ranks so, or it is not the job the estimate priced."""

NUMA_SETUP = (
    "# each rank bound to the CPUs of its GPU's NUMA node (torchrun --numa-binding, PyTorch "
    ">= 2.9, through numactl), as the published runs moeplan's host launch time is fitted on",
    f"NUMA_BINDING=({' '.join(NUMA_BINDING)})",
    'if ! command -v numactl >/dev/null 2>&1 || [[ "$(torchrun --help 2>&1)" != '
    f'*{NUMA_BINDING[0]}* ]]; then',
    '  echo "numactl, or a torchrun with --numa-binding (PyTorch >= 2.9), not found: the ranks '
    'run unbound, slower than priced wherever kernel launches bound the step" >&2',
    "  NUMA_BINDING=()",
    "fi",
)
"""Shell lines a GPU launch script runs before torchrun: the binding where numactl is present
(torch binds through it) and the torchrun on PATH takes the flag (it asks torchrun itself, so an
older PyTorch launches instead of refusing an unknown argument), else one line saying the run is
not the one priced. Literal text: no input reaches it."""

NUMA_ARG = '${NUMA_BINDING[@]+"${NUMA_BINDING[@]}"}'
"""The torchrun argument NUMA_SETUP leaves: the binding's two tokens, or none (the `+` form
expands an empty array under `set -u` on every bash)."""


def quote(token: str) -> str:
    """Shell-quote a token: ShellRefs in double quotes (expanded), all else literal."""
    if isinstance(token, ShellRef):
        return f'"{token}"'
    return shlex.quote(token)


def format_lines(argv: Sequence[str], indent: str = "") -> list[str]:
    """Group argv into one line per flag (flag plus its values), each value shell-quoted."""
    lines: list[list[str]] = []
    for tok in argv:
        if tok.startswith("--") or tok == "-m" or not lines:
            lines.append([tok])
        else:
            lines[-1].append(tok)
    return [indent + " ".join(quote(t) for t in line) for line in lines]


def split_procs(world: int, gpus_per_node: int, nnodes: int | None = None,
                nproc_per_node: int | None = None) -> tuple[int, int]:
    """(nnodes, nproc_per_node) covering `world` processes exactly; what is not given follows
    from the other (nothing given: full nodes of `gpus_per_node`)."""
    for name, v in (("--nnodes", nnodes), ("--nproc-per-node", nproc_per_node)):
        if v is not None and v <= 0:
            raise SpecError(f"{name} must be a positive whole number, got {v}.")
    if nnodes is None and nproc_per_node is None:
        nproc_per_node = min(world, gpus_per_node)
    if nproc_per_node is None:
        assert nnodes is not None
        if world % nnodes:
            raise SpecError(f"the plan needs {world} processes, which do not split evenly over "
                            f"--nnodes {nnodes}; pick a node count that divides {world}.")
        nproc_per_node = world // nnodes
    if nnodes is None:
        if world % nproc_per_node:
            raise SpecError(f"the plan needs {world} processes, not a multiple of "
                            f"--nproc-per-node {nproc_per_node}; pass --nnodes and "
                            "--nproc-per-node whose product is the world size.")
        nnodes = world // nproc_per_node
    if nnodes * nproc_per_node != world:
        raise SpecError(f"--nnodes {nnodes} × --nproc-per-node {nproc_per_node} = "
                        f"{nnodes * nproc_per_node} processes, but the plan's layout needs "
                        f"{world} (tp·cp·dp·pp); make the product equal {world}.")
    return nnodes, nproc_per_node


def torchrun_args(nnodes: int, nproc_per_node: int, rdzv_endpoint: str | None = None,
                  rdzv_backend: str = "c10d", rdzv_id: str = "moeplan",
                  node_rank: int | None = None, max_restarts: int = 0,
                  numa_binding: bool = False) -> list[str]:
    """torchrun's launcher flags (before `-m MODULE`): one node without an endpoint runs
    `--standalone`; otherwise every node meets at `rdzv_endpoint` (the same line on each).
    `numa_binding`: each worker bound to its GPU's NUMA node (NUMA_BINDING)."""
    args = [*NUMA_BINDING] if numa_binding else []
    args += ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)]
    if nnodes == 1 and rdzv_endpoint is None:
        args.append("--standalone")
    else:
        args += ["--rdzv-backend", rdzv_backend, "--rdzv-endpoint",
                 MASTER_ENDPOINT if rdzv_endpoint is None else rdzv_endpoint,
                 "--rdzv-id", rdzv_id]
        if node_rank is not None:
            args += ["--node-rank", str(node_rank)]
    if max_restarts:  # restarted workers resume from the newest checkpoint
        args += ["--max-restarts", str(max_restarts)]
    return args


def run_argv(plan_path: str, *run_args: str) -> list[str]:
    """`moeplan run PLAN ...`, as torchrun's `-m` module line or an srun task."""
    return ["moeplan", "run", plan_path, *run_args]


def slurm_task_argv(plan_path: str, nnodes: int, nproc_per_node: int) -> list[str]:
    """The one task per node of an sbatch script: a `moeplan run` launcher that starts the
    node's workers through torchrun's agent, meeting the others on the allocation's first
    node (MASTER_ADDR:MASTER_PORT) under the job's id."""
    return run_argv(plan_path, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
                    "--rdzv-endpoint", MASTER_ENDPOINT, "--rdzv-id", SLURM_JOB_ID)
