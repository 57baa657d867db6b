"""Sharded, reshardable checkpoints of a `Trainer` with `torch.distributed.checkpoint` (DCP).

What is saved is plan-independent: every parameter, its fp32 master copy and both Adam moments
under the parameter's global name at full (logical) size, the router buffers, the optimizer's
step count, the routing totals and rank 0's RNG state; `meta.json` holds the step (the data
position: a step's global batch is a function of (seed, step)) and `plan.json` the plan that
saved it. The one per-rank part is the kernel backend's state (FP8 delayed-scaling amax
histories), which resumes only under the plan that wrote it (`_kernel_state`).

No rank assembles a global tensor. Each rank writes the boxes it holds: a parameter's tp/ep/etp
shard, and for the optimizer states the part of that shard inside its data-parallel slice of the
family's flat buffer (a flat range, cut into at most a few boxes per dimension, `_boxes`). A box
held by several ranks (replicas over dp, cp or tp) is written by the lowest of them; the boxes
of a tensor cover it exactly once (checked). They go to DCP as ShardedTensors with the global
layout of every box. Loading asks DCP for this rank's parameter shards and the boxes of its
optimizer slice under *its* plan, and DCP reads whatever saved boxes overlap them, so a
checkpoint resumes under any plan: other tp, ep, etp, dp, pp or stage layout.

Pipeline stages need no renaming: `split_stage` keeps the full model's names (decoder layer i is
`layers.i` on whichever stage holds it; MTP depths, final norm and output layer sit on the last
stage under their own names), so each stage saves and loads only its own keys. The last stage's
copy of the embedding (tied head or MTP) equals the first stage's, master and moments included:
only the first stage writes it, and both read it.

The files are written into a temporary directory that `storage.publish` seals (manifest, fsync,
rename, `latest`). Loading reads DCP's own format (tensor bytes, no arbitrary unpickling of
objects).
"""

from __future__ import annotations

import json
import math
import time
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from .layers import shard_info
from .storage import CKPT_FORMAT, publish, step_dir
from .train import Trainer

_STATES = ("master", "exp_avg", "exp_avg_sq")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) inside a tensor


def _boxes(a: int, b: int, shape: tuple[int, ...]) -> list[Box]:
    """The elements [a, b) of a row-major tensor of `shape`, as boxes (first partial slice,
    whole slices, last partial slice, recursively)."""
    if a >= b:
        return []
    if len(shape) == 1:
        return [((a,), (b - a,))]
    inner = math.prod(shape[1:])
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)

    def sub(i: int, lo: int, hi: int) -> list[Box]:
        return [((i, *o), (1, *z)) for o, z in _boxes(lo, hi, shape[1:])]

    if i0 == i1:
        return sub(i0, r0, r1)
    out = []
    if r0:
        out += sub(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0, *[0] * (len(shape) - 1)), (i1 - i0, *shape[1:])))
    if r1:
        out += sub(i1, 0, r1)
    return out


def _complement(box: Box, shape: tuple[int, ...]) -> list[Box]:
    """Boxes covering the rest of a tensor of `shape` around one `box`."""
    off, size = box
    out: list[Box] = []
    lo, hi = [0] * len(shape), list(shape)
    for d in range(len(shape)):
        for start, stop in ((0, off[d]), (off[d] + size[d], shape[d])):
            if stop > start:
                o, z = list(lo), [h - b for h, b in zip(hi, lo, strict=True)]
                o[d], z[d] = start, stop - start
                out.append((tuple(o), tuple(z)))
        lo[d], hi[d] = off[d], off[d] + size[d]
    return out


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + z) for o, z in zip(*box, strict=True))


def _shifted(boxes: list[Box], off: tuple[int, ...]) -> list[Box]:
    return [(tuple(x + y for x, y in zip(o, off, strict=True)), z) for o, z in boxes]


def _split(flat: torch.Tensor, boxes: list[Box]) -> list[torch.Tensor]:
    """A flat range cut into the pieces `_boxes` gave for it: each box is a contiguous run of
    the range, in order, so the pieces are consecutive slices reshaped to the boxes."""
    sizes = [math.prod(z) for _, z in boxes]
    return [t.reshape(z) for t, (_, z) in zip(torch.split(flat, sizes), boxes, strict=True)]


def _placement(p: torch.Tensor, trainer: Trainer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets of this rank's shard of `p` in the global tensor, the global shape)."""
    g, info = trainer.groups, shard_info(p)
    cuts = []
    if info.expert:
        cuts.append((0, g.ep))
        if info.etp_dim is not None:
            cuts.append((info.etp_dim, g.etp))
    elif info.tp_dim is not None:
        cuts.append((info.tp_dim, g.tp))
    off, shape = [0] * p.dim(), list(p.shape)
    for dim, axis in cuts:
        off[dim], shape[dim] = axis.rank * p.shape[dim], p.shape[dim] * axis.size
    return tuple(off), tuple(shape)


def _saved_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Parameters this rank saves: all it holds but the last stage's copy of the embedding."""
    return {n: p for n, p in trainer.model.named_parameters()
            if not getattr(p, "moeplan_duplicate", False)}


def _flat_ranges(trainer: Trainer):
    """(family, name, param, [a, b) in the param's flattening, its offset in the shard) for
    every parameter part inside this rank's data-parallel slice of a family's buffer."""
    for f in trainer.optimizer.families:
        lo, hi = f.shard.start, f.shard.stop
        for name, p, base in zip(f.names, f.params, f.offsets, strict=True):
            a, b = max(lo, base) - base, min(hi, base + p.numel()) - base
            if a < b:
                yield f, name, p, (a, b), base + a - lo


def _local_pieces(trainer: Trainer) -> dict[str, tuple[tuple[int, ...], torch.dtype,
                                                         list[tuple[Box, torch.Tensor]]]]:
    """key → (global shape, dtype, [(global box, data)]) of what this rank holds."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[Box, torch.Tensor]]]] = {}
    saved = _saved_params(trainer)
    for name, p in saved.items():
        off, shape = _placement(p, trainer)
        out[f"model/{name}"] = (shape, p.dtype, [((off, tuple(p.shape)), p.detach().cpu())])
    joined = {(id(f), s): getattr(f, s).detach().cpu() for f in trainer.optimizer.families
              for s in _STATES}
    for f, name, p, (a, b), at in _flat_ranges(trainer):
        if name not in saved:
            continue
        off, shape = _placement(p, trainer)
        boxes = _boxes(a, b, tuple(p.shape))
        for s in _STATES:
            state = joined[(id(f), s)]
            pieces = _split(state[at: at + b - a].clone(), boxes)
            out[f"optim/{s}/{name}"] = (shape, state.dtype,
                                        list(zip(_shifted(boxes, off), pieces, strict=True)))
    return out


def _sharded(shape: tuple[int, ...], dtype: torch.dtype, boxes: list[tuple[Box, int]],
             local: list[tuple[Box, torch.Tensor]]) -> ShardedTensor:
    """A ShardedTensor over `boxes` ((box, owning rank), covering `shape` exactly once) whose
    local shards are `local`."""
    metas = {box: ShardMetadata(list(box[0]), list(box[1]), f"rank:{r}/cpu")
             for box, r in boxes}
    md = ShardedTensorMetadata(list(metas.values()), torch.Size(shape),
                               TensorProperties(dtype=dtype))
    shards = [Shard(t.contiguous(), metas[box]) for box, t in local]
    with warnings.catch_warnings():  # ShardedTensor is DCP's format for uneven boxes
        warnings.simplefilter("ignore")
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, md)


def sharded_state(trainer: Trainer) -> dict[str, object]:
    """What this rank writes (collective: one exchange of box lists to pick each box's writer)."""
    mine = _local_pieces(trainer)
    rank = dist.get_rank()
    listing = {k: (shape, [box for box, _ in pieces]) for k, (shape, _, pieces) in mine.items()}
    every: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, listing)
    owner: dict[str, dict[Box, int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for r, lst in enumerate(every):
        for k, (shape, boxes) in lst.items():
            shapes[k] = shape
            for box in boxes:
                owner.setdefault(k, {}).setdefault(box, r)
    out: dict[str, object] = {}
    for k, boxes in owner.items():
        covered = sum(math.prod(z) for _, z in boxes)
        if covered != math.prod(shapes[k]):
            raise RuntimeError(f"checkpoint: the boxes of {k} cover {covered} of "
                               f"{math.prod(shapes[k])} elements (overlapping shards?)")
        if k not in mine:
            continue
        _, dtype, pieces = mine[k]
        local = [(box, t) for box, t in pieces if boxes[box] == rank]
        if local:
            out[k] = _sharded(shapes[k], dtype, list(boxes.items()), local)
    for n, b in trainer.model.named_buffers():
        out[f"buffer/{n}"] = b.detach().cpu().clone()
    out["optim/step_count"] = torch.tensor(trainer.optimizer.step_count, dtype=torch.int64)
    for j, layer in enumerate(trainer.moe_layer_numbers):  # by global layer: stage-proof
        out[f"routing/{layer}"] = trainer.routing_totals[j].clone()
    rng = torch.get_rng_state().to(trainer.device)  # NCCL broadcasts device tensors only
    dist.broadcast(rng, src=0)  # rank 0's state: one value whatever the plan
    out["rng/torch"] = rng.cpu()
    return out


def _wanted(shape: tuple[int, ...], dtype: torch.dtype, mine: list[Box],
            rest: list[Box]) -> ShardedTensor:
    """An empty ShardedTensor for loading the boxes `mine` of a tensor of `shape` into this
    rank; `rest` covers the remainder, described as held elsewhere, as the format requires."""
    rank = dist.get_rank()
    other = (rank + 1) % dist.get_world_size()
    return _sharded(shape, dtype, [*((b, rank) for b in mine), *((b, other) for b in rest)],
                    [(b, torch.empty(b[1], dtype=dtype)) for b in mine])


def _template(trainer: Trainer) -> dict[str, object]:
    """What this rank reads: its shard of every parameter and of its optimizer states, under
    its own plan, plus the replicated items."""
    out: dict[str, object] = {}
    families = trainer.optimizer.families
    moments = families[0].parts[0].exp_avg.dtype if families else torch.float32
    for name, p in trainer.model.named_parameters():
        off, shape = _placement(p, trainer)
        box = (off, tuple(p.shape))
        out[f"model/{name}"] = _wanted(shape, p.dtype, [box], _complement(box, shape))
    for _, name, p, (a, b), _ in _flat_ranges(trainer):  # only this rank's optimizer slice
        off, shape = _placement(p, trainer)
        n, local = p.numel(), tuple(p.shape)
        mine = _shifted(_boxes(a, b, local), off)
        rest = (_complement((off, local), shape)
                + _shifted(_boxes(0, a, local) + _boxes(b, n, local), off))
        for s in _STATES:
            out[f"optim/{s}/{name}"] = _wanted(shape, moments if s != "master" else torch.float32,
                                               mine, rest)
    for n, b in trainer.model.named_buffers():
        out[f"buffer/{n}"] = torch.empty_like(b, device="cpu")
    out["optim/step_count"] = torch.zeros((), dtype=torch.int64)
    for j, layer in enumerate(trainer.moe_layer_numbers):
        out[f"routing/{layer}"] = torch.empty_like(trainer.routing_totals[j])
    out["rng/torch"] = torch.empty_like(torch.get_rng_state())
    return out


def _shard_of(t: object) -> torch.Tensor:
    return t.local_shards()[0].tensor if isinstance(t, ShardedTensor) else t  # type: ignore[return-value]


def _flat_of(t: ShardedTensor) -> torch.Tensor:
    """The local boxes of a `_wanted` optimizer state, back to its flat range (boxes in order
    of their offsets are the range's consecutive runs)."""
    shards = sorted(t.local_shards(), key=lambda sh: tuple(sh.metadata.shard_offsets))
    return torch.cat([sh.tensor.reshape(-1) for sh in shards])


@torch.no_grad()
def load_state(trainer: Trainer, state: dict[str, object]) -> None:
    """Put what `_template` read into this rank's parameters and optimizer shards."""
    opt, model = trainer.optimizer, trainer.model
    for name, p in model.named_parameters():
        p.data.copy_(_shard_of(state[f"model/{name}"]).to(p.dtype))
    dsts = {(id(f), s): getattr(f, s) for f in opt.families for s in _STATES}
    flats = {k: torch.zeros(d.numel(), dtype=d.dtype) for k, d in dsts.items()}
    for f, name, _, (a, b), at in _flat_ranges(trainer):
        for s in _STATES:
            flat, got = flats[(id(f), s)], state[f"optim/{s}/{name}"]
            flat[at: at + b - a] = _flat_of(got).to(flat.dtype)  # type: ignore[arg-type]
    for k, dst in dsts.items():
        dst.copy_(flats[k].to(dst.device))
    for n, b in model.named_buffers():
        b.copy_(_shard_of(state[f"buffer/{n}"]).to(b.dtype))
    opt.step_count = int(_shard_of(state["optim/step_count"]))
    for j, layer in enumerate(trainer.moe_layer_numbers):
        trainer.routing_totals[j] = _shard_of(state[f"routing/{layer}"])
    torch.set_rng_state(_shard_of(state["rng/torch"]))


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
    state = sharded_state(trainer)
    state.update(_kernel_state(trainer))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        (tmp / "plan.json").write_text(trainer.plan.model_dump_json(indent=1))
        (tmp / "meta.json").write_text(json.dumps({
            "format": CKPT_FORMAT, "step": step, "seed": trainer.seed, "time": time.time(),
            "world_size": dist.get_world_size(), **(extra or {})}, indent=1))
        publish(tmp, final, keep)
    dist.barrier()
    return final


def load(trainer: Trainer, path: str | Path) -> int:
    """Restore `trainer` from a sealed step directory under its own plan; return the step."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != CKPT_FORMAT:
        raise ValueError(f"{path} is a {meta.get('format')!r} checkpoint; this version reads "
                         f"{CKPT_FORMAT!r} (resume with the version that wrote it)")
    state = _template(trainer)
    kernels = _kernel_template(path) if _same_plan(trainer, path) else {}
    state.update(kernels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path)
    load_state(trainer, state)
    if kernels:
        prefix = f"kernels/rank{dist.get_rank()}/"
        trainer.kernels.backend.load_extra_state(
            dict(trainer.model.named_parameters()),
            {k[len(prefix):]: v for k, v in kernels.items()})
    return int(json.loads((path / "meta.json").read_text())["step"])
