"""The memory guard: price the run about to start on the devices present, refuse what cannot fit.

Without it a plan that says 77.7 GB per GPU, started on a laptop, meets the out-of-memory killer
a minute later. Before any worker starts, the launcher prices every local rank with the cost
model (`estimate_breakdown`, per pipeline rank) at the dtype the run will use, and compares:
- on CPU, the sum over this node's ranks with the host's MemAvailable (/proc/meminfo): all local
  ranks share it, and so do their "host" copies (activation and optimizer offload land in the
  same RAM, so they are priced as kept);
- on GPU, each local rank with the free memory of its own GPU (nvidia-smi).
The cost model prices bf16 weights and activations; an fp32 run keeps both at twice that. Each
process also costs a fixed base (interpreter, torch, communicator) that the model does not see.

No torch here (it runs in the launcher, within a second or two); `nvidia-smi` is asked for GPUs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..cost_models.calibration import calibration_for
from ..cost_models.estimate import estimate_breakdown
from ..errors import SpecError
from ..launch_lines import NUMA_BINDING
from ..specs import ClusterSpec, Plan, load_cluster
from ..specs.grid import RankGrid

GB = 1e9
CPU_PROCESS_BASE_GB = 0.4  # measured peak RSS of a tiny gloo worker (python, torch, gloo): 0.33 GB
CUDA_CONTEXT_GB = 0.6  # CUDA context and allocator pools outside the tensors
# a preset per data-center GPU `nvidia-smi` may name (longest names first: GB200 before B200)
GPU_PRESETS = (("GB300", "gb300-nvl72"), ("GB200", "gb200-nvl72"), ("B300", "b300"),
               ("B200", "b200"), ("H200", "h200"), ("H800", "h800"), ("H100", "h100"),
               ("A100", "a100-80g"))


@dataclass(frozen=True)
class Devices:
    """What this node offers: CPU RAM shared by every rank, or one free-memory figure per GPU."""

    kind: str  # "cpu" | "cuda"
    free_gb: tuple[float, ...]  # cpu: (MemAvailable,); cuda: per visible GPU, in index order
    names: tuple[str, ...] = ()
    buses: tuple[str, ...] = ()  # cuda: each visible GPU's PCI address as sysfs names it


@dataclass(frozen=True)
class RankNeed:
    """One local rank's priced bytes, split as the error message names them."""

    rank: int
    pp_rank: int
    static_gb: float  # weights, gradients, optimizer states
    activations_gb: float
    other_gb: float  # dispatcher and TP buffers, workspace, fragmentation, process base

    @property
    def total_gb(self) -> float:
        return self.static_gb + self.activations_gb + self.other_gb


def mem_available_gb(meminfo: str | Path = "/proc/meminfo") -> float | None:
    """MemAvailable (the kernel's estimate of what can be allocated without swapping), GB."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _visible(index: str, uuid: str, mask: str) -> bool:
    wanted = [w.strip() for w in mask.split(",") if w.strip()]
    return any(w == index or (w.startswith("GPU-") and uuid.startswith(w)) for w in wanted)


def detect_devices() -> Devices:
    """GPUs when nvidia-smi lists some that CUDA_VISIBLE_DEVICES leaves visible, else the CPU."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    if smi and mask not in ("", "-1"):
        try:
            out = subprocess.run([smi, "--query-gpu=index,uuid,name,memory.free,pci.bus_id",
                                  "--format=csv,noheader,nounits"], capture_output=True,
                                 text=True, timeout=15, check=True).stdout
            rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line]
            rows = [r for r in rows if len(r) == 5 and (mask is None or _visible(r[0], r[1], mask))]
            if rows:
                return Devices("cuda", tuple(float(r[3]) * 2**20 / GB for r in rows),
                               tuple(r[2] for r in rows), tuple(sysfs_bus(r[4]) for r in rows))
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    avail = mem_available_gb()
    return Devices("cpu", (avail,) if avail is not None else ())


def sysfs_bus(smi_bus_id: str) -> str:
    """nvidia-smi's PCI address ("00000000:1B:00.0", an 8-digit domain) as sysfs names the
    device ("0000:1b:00.0")."""
    domain, _, rest = smi_bus_id.strip().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest.lower()}"
    except ValueError:
        return smi_bus_id.strip().lower()


def pci_address(props: object) -> str | None:
    """A CUDA device's PCI address as sysfs names it ("0000:1b:00.0"), from torch's device
    properties (its domain, bus and device ids, as torch's own NUMA binding reads them); None
    where this torch does not report them."""
    try:
        return (f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:"  # type: ignore[attr-defined]
                f"{props.pci_device_id:02x}.0")  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return None


def cpu_list(text: str) -> set[int]:
    """CPUs of a sysfs cpulist ("0-71,144-215"); an empty text, none."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_cpus(pci_bus_id: str, sysfs: str | Path = "/sys",
              allowed: set[int] | None = None) -> set[int]:
    """The CPUs of the NUMA node a PCI device (a GPU, "0000:1b:00.0") hangs off that this
    process may run on (`allowed`, default its affinity), read from sysfs: what torchrun's
    `--numa-binding node` binds that GPU's worker to (a machine of one node reports -1, read as
    node 0, as torch reads it). No such device, or none of its CPUs allowed: an empty set."""
    if allowed is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    root = Path(sysfs)
    try:
        node = int((root / "bus/pci/devices" / pci_bus_id.lower() / "numa_node").read_text())
        cpus = cpu_list((root / f"devices/system/node/node{max(node, 0)}/cpulist").read_text())
        return cpus & allowed
    except (OSError, ValueError):
        return set()


def torchrun_binds_numa() -> bool:
    """Whether the installed torch's torchrun takes `--numa-binding` (PyTorch 2.9 on), read from
    its argument parser's own source (torch/distributed/run.py, the first MiB) without importing
    torch, so the launcher stays instant; an older torch would refuse the flag."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    try:
        with open(Path(spec.origin).parent / "distributed" / "run.py", "rb") as f:
            return NUMA_BINDING[0].encode() in f.read(1 << 20)
    except OSError:
        return False


def run_dtype(opts_dtype: str | None, devices: Devices) -> str:
    """The dtype the workers will train in (worker.py: bf16 on GPU, fp32 on CPU by default)."""
    return opts_dtype or ("bf16" if devices.kind == "cuda" else "fp32")


def price_ranks(plan: Plan, ranks: list[int], dtype: str, kind: str) -> list[RankNeed]:
    """The cost model's bytes for each of `ranks` (global ranks) of `plan`, at `dtype`."""
    choices = plan.choices
    if kind == "cpu":  # "host" copies live in the same RAM as everything else
        choices = choices.model_copy(update={"offload": [],
                                             "optimizer_offload_fraction": 0.0})
    bd = estimate_breakdown(plan.model, plan.cluster, plan.training, plan.layout, choices,
                            (plan.estimate.imbalance or 1.0) if plan.estimate is not None
                            else 1.0,
                            check=False)
    cal = calibration_for(plan.cluster.calibration)
    wide = 2.0 if dtype == "fp32" else 1.0  # bf16 weights/activations in the model
    grid = RankGrid.from_layout(plan.layout)
    out = []
    for rank in ranks:
        pp = grid.coord("pp", rank) if plan.layout.pp > 1 else 0
        r = bd.ranks[pp]
        static = r.static.total + (wide - 1.0) * r.static.weights
        other = r.buffer_bytes
        if kind == "cpu":
            other += (CPU_PROCESS_BASE_GB - cal.workspace_gb) * GB  # no GPU workspace on CPU
        else:
            other += CUDA_CONTEXT_GB * GB
        out.append(RankNeed(rank, pp, static / GB, wide * r.activation_bytes / GB,
                            max(0.0, other) / GB))
    return out


def node_ranks(world: int, nnodes: int, node_rank: int | None, nproc: int) -> list[list[int]]:
    """Global ranks of each node this one may be (torchrun numbers a node's ranks
    contiguously). With an elastic rendezvous and no --node-rank the node's place is known only
    later, so every node's ranks are candidates and the busiest is priced."""
    nodes = [list(range(k * nproc, min(world, (k + 1) * nproc))) for k in range(nnodes)]
    return [nodes[node_rank]] if node_rank is not None and node_rank < nnodes else nodes


def shortfall(needs: list[RankNeed], devices: Devices) -> str | None:
    """Why the ranks cannot fit on `devices` (None when they fit, or nothing is known)."""
    if not devices.free_gb:
        return None
    if devices.kind == "cpu":
        total = sum(n.total_gb for n in needs)
        if total <= devices.free_gb[0]:
            return None
        busiest = max(needs, key=lambda n: n.total_gb)
        each = (f"{len(needs)} ranks, up to {busiest.total_gb:.1f} GB each"
                if len(needs) > 1 else "1 rank")
        return (f"it needs about {total:.1f} GB of host memory ({each}: "
                f"{busiest.static_gb:.1f} GB weights, gradients and optimizer states, "
                f"{busiest.activations_gb:.1f} GB activations, {busiest.other_gb:.1f} GB "
                f"buffers and process) but {devices.free_gb[0]:.1f} GB is available "
                "(MemAvailable)")
    if len(needs) > len(devices.free_gb):
        return (f"it starts {len(needs)} ranks on this node but only {len(devices.free_gb)} "
                "GPUs are visible (one GPU per rank)")
    for local, n in enumerate(needs):
        if n.total_gb > devices.free_gb[local]:
            return (f"rank {n.rank} (pipeline rank {n.pp_rank}) needs about {n.total_gb:.1f} GB "
                    f"({n.static_gb:.1f} GB weights, gradients and optimizer states, "
                    f"{n.activations_gb:.1f} GB activations, {n.other_gb:.1f} GB buffers) but "
                    f"GPU {local} ({devices.names[local]}) has {devices.free_gb[local]:.1f} GB "
                    "free")
    return None


def one_rank_fits(needs: list[RankNeed], devices: Devices) -> bool:
    """Whether the busiest rank alone fits (on the host, or on any one GPU here): only then can
    spreading the ranks over more nodes make the run fit."""
    if not devices.free_gb or not needs:
        return True
    busiest = max(n.total_gb for n in needs)
    return busiest <= max(devices.free_gb)


def why_more_nodes_cannot_help(needs: list[RankNeed], devices: Devices) -> str:
    """The sentence saying why more nodes are not offered: one rank does not fit alone."""
    busiest = max(needs, key=lambda n: n.total_gb)
    where = ("the host's MemAvailable" if devices.kind == "cpu"
             else "the free memory of the largest GPU here")
    return (f"More nodes cannot help: one rank alone (rank {busiest.rank}) needs about "
            f"{busiest.total_gb:.1f} GB, more than the {max(devices.free_gb):.1f} GB of {where}, "
            "and a rank never spans nodes.")


def machine_cluster(plan: Plan, device_kind: str, gpu_name: str | None,
                    cluster: str | None) -> ClusterSpec | None:
    """The ClusterSpec predictions for this machine use: `--cluster` when given, else the
    preset of the GPU present, else None (a CPU is described only by `moeplan calibrate`)."""
    world = plan.layout.world_size
    if cluster:
        return load_cluster(cluster, gpus=world)
    if device_kind == "cuda" and gpu_name:
        for token, preset in GPU_PRESETS:
            if token in gpu_name.upper():
                return load_cluster(preset, gpus=world)
    return None


def check_cluster_ref(cluster: str | None) -> None:
    """Refuse a --cluster that does not load, before anything starts."""
    if cluster:
        try:
            load_cluster(cluster)
        except SpecError as e:
            raise SpecError(f"--cluster {cluster}: {e}") from None
