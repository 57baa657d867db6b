"""Sharded, reshardable checkpoints of a `Trainer` with `torch.distributed.checkpoint` (DCP).

What is saved is plan-independent: every parameter, its fp32 master copy and both Adam moments
under the parameter's global name at full (logical) size, the router buffers, the optimizer's
step count, the routing totals and rank 0's RNG state; `meta.json` holds the step (the data
position: a step's global batch is a function of (seed, step)) and `plan.json` the plan that
saved it. Because the stored tensors are global, a checkpoint resumes under any plan: each rank
slices its tp/ep/etp shard out of the global tensor and its data-parallel shard out of the
family's flat buffer, exactly as `parallelize` and `DistributedOptimizer` laid them out.
The one per-rank part is the kernel backend's state (FP8 delayed-scaling amax histories), which
resumes only under the plan that wrote it (`_kernel_state`).

Pipeline stages need no renaming: `split_stage` keeps the full model's names (decoder layer i is
`layers.i` on whichever stage holds it; MTP depths, final norm and output layer sit on the last
stage under their own names), so each stage saves and loads only its own keys, and a plan with
another pp or stage layout reads the keys its stages hold. The last stage's copy of the embedding
(tied head or MTP) equals the first stage's, master and moments included, so DCP stores it once.

Each global tensor is assembled (collectively) on every rank; DCP deduplicates identical items
and spreads the writes over the ranks, so every rank writes its part of the files. The files are
written into a temporary directory that `storage.publish` seals (manifest, fsync, rename,
`latest`). Loading reads DCP's own format (tensor bytes, no arbitrary unpickling of objects).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .comm import Axis
from .layers import shard_info
from .parallelize import gather_full
from .storage import publish, step_dir
from .train import Trainer

FORMAT = "moeplan-ckpt-v1"
_STATES = ("master", "exp_avg", "exp_avg_sq")


def _family_full(flat_shard: torch.Tensor, axis: Axis, distributed: bool,
                 padded: int) -> torch.Tensor:
    """A family's whole flat buffer from this rank's data-parallel shard (collective)."""
    if not distributed or axis.trivial:
        return flat_shard
    full = flat_shard.new_empty(padded)
    dist.all_gather_into_tensor(full, flat_shard.contiguous(), group=axis.group)
    return full


def global_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every checkpointed tensor at full size, by global name (collective; same on all ranks)."""
    opt, model = trainer.optimizer, trainer.model
    local: dict[str, torch.Tensor] = {}
    for f in opt.families:
        padded = f.param_buf.numel()
        for state in _STATES:
            full = _family_full(getattr(f, state), f.axis, opt.distributed, padded)
            for name, p, off in zip(f.names, f.params, f.offsets, strict=True):
                local[f"{state}/{name}"] = full[off: off + p.numel()].view(p.shape)
    by_param = {n: p.detach() for n, p in model.named_parameters()}
    out = {f"model/{n}": t.clone() for n, t in gather_full(model, trainer.groups, by_param).items()}
    for state in _STATES:
        part = {n[len(state) + 1:]: t for n, t in local.items() if n.startswith(state + "/")}
        out.update({f"optim/{state}/{n}": t.clone()
                    for n, t in gather_full(model, trainer.groups, part).items()})
    for n, b in model.named_buffers():
        out[f"buffer/{n}"] = b.detach().clone()
    out["optim/step_count"] = torch.tensor(opt.step_count, dtype=torch.int64)
    for j, layer in enumerate(trainer.moe_layer_numbers):  # by global layer: stage-proof
        out[f"routing/{layer}"] = trainer.routing_totals[j].clone()
    rng = torch.get_rng_state()
    dist.broadcast(rng, src=0)  # rank 0's state: one value whatever the plan
    out["rng/torch"] = rng
    return {k: v.cpu() for k, v in out.items()}


def _local_slice(full: torch.Tensor, p: torch.Tensor, trainer: Trainer) -> torch.Tensor:
    """This rank's shard of a global parameter-shaped tensor under the trainer's plan."""
    g, info = trainer.groups, shard_info(p)
    cuts = []
    if info.expert:
        cuts.append((0, g.ep))
        if info.etp_dim is not None:
            cuts.append((info.etp_dim, g.etp))
    elif info.tp_dim is not None:
        cuts.append((info.tp_dim, g.tp))
    for dim, axis in cuts:
        n = full.shape[dim] // axis.size
        full = full.narrow(dim, axis.rank * n, n)
    if full.shape != p.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(full.shape)} does not shard to "
                         f"{tuple(p.shape)}")
    return full


@torch.no_grad()
def load_global_state(trainer: Trainer, state: dict[str, torch.Tensor]) -> None:
    """Put global tensors (as from `global_state`) into this rank's shards, any plan."""
    opt, model = trainer.optimizer, trainer.model
    params = dict(model.named_parameters())
    for name, p in params.items():
        p.data.copy_(_local_slice(state[f"model/{name}"], p, trainer).to(p.dtype))
    for f in opt.families:
        for s in _STATES:
            flat = torch.zeros(f.param_buf.numel(), dtype=torch.float32, device=f.param_buf.device)
            for name, p, off in zip(f.names, f.params, f.offsets, strict=True):
                flat[off: off + p.numel()] = _local_slice(
                    state[f"optim/{s}/{name}"], p, trainer).reshape(-1)
            dst = getattr(f, s)
            dst.copy_(flat[f.shard].to(dst.dtype))
    for n, b in model.named_buffers():
        b.copy_(state[f"buffer/{n}"].to(b.dtype))
    opt.step_count = int(state["optim/step_count"])
    for j, layer in enumerate(trainer.moe_layer_numbers):
        trainer.routing_totals[j] = state[f"routing/{layer}"]
    torch.set_rng_state(state["rng/torch"])


def _template(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Empty global-size tensors with the names and shapes `global_state` writes (no comms)."""
    g = trainer.groups
    out: dict[str, torch.Tensor] = {}
    for name, p in trainer.model.named_parameters():
        info, shape = shard_info(p), list(p.shape)
        if info.expert:
            shape[0] *= g.ep.size
            if info.etp_dim is not None:
                shape[info.etp_dim] *= g.etp.size
        elif info.tp_dim is not None:
            shape[info.tp_dim] *= g.tp.size
        out[f"model/{name}"] = torch.empty(shape, dtype=p.dtype)
        for s in _STATES:
            dtype = trainer.optimizer.families[0].exp_avg.dtype if s != "master" else torch.float32
            out[f"optim/{s}/{name}"] = torch.empty(shape, dtype=dtype)
    for n, b in trainer.model.named_buffers():
        out[f"buffer/{n}"] = torch.empty_like(b, device="cpu")
    out["optim/step_count"] = torch.zeros((), dtype=torch.int64)
    for j, layer in enumerate(trainer.moe_layer_numbers):
        out[f"routing/{layer}"] = torch.empty_like(trainer.routing_totals[j])
    out["rng/torch"] = torch.empty_like(torch.get_rng_state())
    return out


def _kernel_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's kernel-backend state (FP8 delayed-scaling amax histories) under per-rank keys.

    Unlike everything above it is not global: a history belongs to this rank's weight shard and
    the micro-batches this rank saw, so it is stored per rank and restored only under the plan
    that wrote it (a resharded resume restarts the histories, as a fresh TE model would).
    """
    params = dict(trainer.model.named_parameters())
    state = trainer.kernels.backend.extra_state(params)
    rank = dist.get_rank()
    return {f"kernels/rank{rank}/{k}": v.detach().cpu() for k, v in state.items()}


def _same_plan(trainer: Trainer, path: Path) -> bool:
    """Whether the checkpoint at `path` was written under this trainer's layout, choices and
    precision (what fixes each rank's shards and data)."""
    saved = json.loads((path / "plan.json").read_text())
    mine = json.loads(trainer.plan.model_dump_json())
    return all(saved.get(k) == mine.get(k) for k in ("layout", "choices")) and \
        saved["training"].get("precision") == mine["training"].get("precision")


def _kernel_template(path: Path) -> dict[str, torch.Tensor]:
    """Empty tensors for the kernel-state keys this rank wrote to the checkpoint at `path`."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = f"kernels/rank{dist.get_rank()}/"
    return {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in meta.items() if k.startswith(prefix)}


def save(trainer: Trainer, ckpt_dir: str | Path, step: int, keep: int = 3,
         extra: dict | None = None) -> Path:
    """Write the checkpoint of `step` (steps done) into CKPT/step_N (collective).

    Never overwrites: if CKPT/step_N is already sealed the new copy is dropped.
    """
    ckpt_dir = Path(ckpt_dir)
    final = step_dir(ckpt_dir, step)
    name = [f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"]
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.broadcast_object_list(name, src=0)  # one temporary name for every rank
    tmp = ckpt_dir / name[0]
    state = global_state(trainer)
    state.update(_kernel_state(trainer))
    dcp.save(state, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        (tmp / "plan.json").write_text(trainer.plan.model_dump_json(indent=1))
        (tmp / "meta.json").write_text(json.dumps({
            "format": FORMAT, "step": step, "seed": trainer.seed, "time": time.time(),
            "world_size": dist.get_world_size(), **(extra or {})}, indent=1))
        publish(tmp, final, keep)
    dist.barrier()
    return final


def load(trainer: Trainer, path: str | Path) -> int:
    """Restore `trainer` from a sealed step directory under its own plan; return the step."""
    path = Path(path)
    state = _template(trainer)
    kernels = _kernel_template(path) if _same_plan(trainer, path) else {}
    state.update(kernels)
    dcp.load(state, checkpoint_id=path)
    load_global_state(trainer, state)
    if kernels:
        prefix = f"kernels/rank{dist.get_rank()}/"
        trainer.kernels.backend.load_extra_state(
            dict(trainer.model.named_parameters()),
            {k[len(prefix):]: v for k, v in kernels.items()})
    return int(json.loads((path / "meta.json").read_text())["step"])
