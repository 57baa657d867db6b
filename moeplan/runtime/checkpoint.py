"""Sharded, reshardable checkpoints of a `Trainer`, in safetensors and JSON (format v3).

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
of a tensor cover it exactly once (checked). Each writing rank puts its boxes into its own
`rank_RRRRR.safetensors`; rank 0 writes `index.json` (for every tensor: global shape, dtype and
each box's file, stored name, offsets and sizes). Loading asks, for each box this rank needs
under *its* plan, every saved box that overlaps it, and reads just the overlap by slicing the
file (`safe_open(...).get_slice`), so a checkpoint resumes under any plan: other tp, ep, etp,
dp, pp or stage layout; the overlaps must cover each needed box exactly.

DCP's own safetensors writer (`HuggingFaceStorageWriter`) keeps one offset per tensor name per
file, so it cannot hold the several boxes of one optimizer state a rank writes; hence the files
here. Nothing is pickled on either side: tensors are safetensors, everything else strict JSON,
and the ranks exchange their box lists as JSON bytes in tensors (`all_gather_json`).

Pipeline stages need no renaming: `split_stage` keeps the full model's names (decoder layer i is
`layers.i` on whichever stage holds it; MTP depths, final norm and output layer sit on the last
stage under their own names), so each stage saves and loads only its own keys. The last stage's
copy of the embedding (tied head or MTP) equals the first stage's, master and moments included:
only the first stage writes it, and both read it.

The files are written into a temporary directory that `storage.publish` seals (manifest last,
fsync, rename, `latest`); `load` reads only a step that `storage.verify` accepted.
`read_checkpoint` loads a step whole into one process (`moeplan checkpoint export --to hf`, which
writes it with `hf_io.write_hf`); `moeplan checkpoint list` reads only the JSON of each step
(`storage.list_checkpoints`), so it starts without torch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import SpecError
from .hf_io import MAX_SHARD_BYTES, checkpoint_tokenizer, write_hf
from .jsonwire import all_gather_json, broadcast_json
from .layers import shard_info
from .storage import (
    CKPT_FORMAT,
    INDEX,
    META,
    PLAN,
    SMALL_JSON_BYTES,
    Verified,
    checkpoint_directory,
    complete_steps,
    held_steps,
    publish,
    rank_file,
    read_json,
    step_dir,
    verify,
    verify_step,
    write_atomic,
)
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
            if not shard_info(p).duplicate}


def _flat_ranges(trainer: Trainer):
    """(family, name, param, [a, b) in the param's flattening, its offset in the shard) for
    every parameter part inside this rank's data-parallel slice of a family's buffer."""
    for f in trainer.optimizer.families:
        lo, hi = f.shard.start, f.shard.stop
        for name, p, base in zip(f.names, f.params, f.offsets, strict=True):
            a, b = max(lo, base) - base, min(hi, base + p.numel()) - base
            if a < b:
                yield f, name, p, (a, b), base + a - lo


Pieces = dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[Box, torch.Tensor]]]]


def _whole(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, list[tuple[Box, torch.Tensor]]]:
    """A tensor every holder has in full (buffers, counters, RNG), as one box."""
    t = t.detach().cpu().clone()
    return tuple(t.shape), t.dtype, [(((0,) * t.dim(), tuple(t.shape)), t)]


def _local_pieces(trainer: Trainer) -> Pieces:
    """key → (global shape, dtype, [(global box, data)]) of what this rank holds."""
    out: Pieces = {}
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
            pieces = [t.clone() for t in _split(state[at: at + b - a], boxes)]
            out[f"optim/{s}/{name}"] = (shape, state.dtype,
                                        list(zip(_shifted(boxes, off), pieces, strict=True)))
    for n, b in trainer.model.named_buffers():
        out[f"buffer/{n}"] = _whole(b)
    out["optim/step_count"] = _whole(torch.tensor(trainer.optimizer.step_count,
                                                  dtype=torch.int64))
    for j, layer in enumerate(trainer.moe_layer_numbers):  # by global layer: stage-proof
        out[f"routing/{layer}"] = _whole(trainer.routing_totals[j])
    if dist.get_rank() == 0:  # rank 0's state: one value whatever the plan
        out["rng/torch"] = _whole(torch.get_rng_state())
    return out




# safetensors' names for the dtypes a checkpoint holds (storage.ST_ITEMSIZE lists the same)
_ST = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
       torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
       torch.float8_e5m2: "F8_E5M2"}
_TORCH = {v: k for k, v in _ST.items()}


def _owned(every: list[dict]) -> list[dict[str, list[list]]]:
    """For each rank, key → the boxes of it that rank writes: each box by its lowest holder.
    The boxes of every key must cover its tensor exactly once."""
    owner: dict[str, dict[tuple, int]] = {}
    shapes: dict[str, list[int]] = {}
    for r, lst in enumerate(every):
        for k, (shape, _, boxes) in lst.items():
            shapes[k] = shape
            for box in boxes:
                owner.setdefault(k, {}).setdefault((tuple(box[0]), tuple(box[1])), r)
    for k, boxes in owner.items():
        covered = sum(math.prod(z) for _, z in boxes)
        if covered != math.prod(shapes[k]):
            raise RuntimeError(f"checkpoint: the boxes of {k} cover {covered} of "
                               f"{math.prod(shapes[k])} elements (overlapping shards?)")
    out: list[dict[str, list[list]]] = []
    for r, lst in enumerate(every):
        out.append({k: [b for b in boxes if owner[k][(tuple(b[0]), tuple(b[1]))] == r]
                    for k, (_, _, boxes) in lst.items()})
    return out


def _stored_name(key: str, j: int) -> str:
    return f"{key}#{j}"


def _index_doc(every: list[dict], owned: list[dict[str, list[list]]]) -> dict:
    """index.json: for every key its global shape, dtype and boxes [file, name, offsets,
    sizes]; a rank's file exists only if it writes some box."""
    writers = [r for r, o in enumerate(owned) if any(o.values())]
    files = {r: i for i, r in enumerate(writers)}
    tensors: dict[str, dict] = {}
    for r, lst in enumerate(every):
        for k, (shape, dtype, _) in lst.items():
            t = tensors.setdefault(k, {"shape": shape, "dtype": dtype, "boxes": []})
            t["boxes"] += [[files[r], _stored_name(k, j), list(off), list(size)]
                           for j, (off, size) in enumerate(owned[r][k])]
    return {"format": CKPT_FORMAT, "files": [rank_file(r) for r in writers],
            "tensors": tensors}


def _write_rank_file(path: Path, pieces: Pieces, owned: dict[str, list[list]]) -> None:
    """This rank's boxes into its safetensors file (fsynced before the step is sealed)."""
    tensors: dict[str, torch.Tensor] = {}
    for k, boxes in owned.items():
        held = {(tuple(b), tuple(z)): t for (b, z), t in pieces[k][2]}
        for j, (off, size) in enumerate(boxes):
            tensors[_stored_name(k, j)] = held[(tuple(off), tuple(size))].contiguous()
    if tensors:
        try:
            save_file(tensors, str(path))
        except Exception as e:  # safetensors' own error type, also for a full disk
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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




class Agreed(SpecError):
    """A refusal every rank raises together, from one decision shared by a collective: rank 0
    alone prints it (the other ranks would repeat the same paragraph)."""


class SaveFailed(Agreed):
    """A checkpoint could not be written (a full disk, a read-only file system): every rank
    raises it together, rank 0 says it in one paragraph, the run exits 2. The steps sealed
    before stay as they were; the half-written temporary step is removed."""


def _save_error(err: OSError, rank: int) -> str:
    return f"{err.strerror or type(err).__name__} (rank {rank}, {err.filename or 'a file'})"


def _agree(error: str | None, device: torch.device) -> str | None:
    """The first rank's error of a step every rank took part in (None when all succeeded), the
    same on every rank: one exchange, so no rank waits alone at a barrier for a failed peer."""
    return next((e for e in all_gather_json(error, device) if e), None)


def save(trainer: Trainer, ckpt_dir: str | Path, step: int, keep: int = 3,
         extra: dict | None = None) -> Path:
    """Write the checkpoint of `step` (steps done) into CKPT/step_N (collective).

    One exchange of box lists (JSON) decides who writes each box; each rank writes its own
    safetensors file into a temporary directory; rank 0 adds index.json, meta.json and
    plan.json, and `publish` seals it (manifest last). A sealed CKPT/step_N is never
    overwritten: the new copy is dropped. A write that fails on any rank (ENOSPC, EROFS, ...)
    fails the save on every rank alike (`SaveFailed`), after its temporary step is removed.
    """
    ckpt_dir, device = Path(ckpt_dir), trainer.device
    final = step_dir(ckpt_dir, step)
    rank = dist.get_rank()
    tmp = ckpt_dir / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    error = None
    if rank == 0:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as e:
            error = _save_error(e, rank)
    tmp = ckpt_dir / str(broadcast_json(tmp.name, device))
    error = _agree(error, device)  # the directory exists, or nobody writes
    if error is None:
        pieces = _local_pieces(trainer)
        pieces.update({k: _whole(t) for k, t in _kernel_state(trainer).items()})
        listing = {k: [list(shape), _ST[dtype], [[list(b), list(z)] for (b, z), _ in got]]
                   for k, (shape, dtype, got) in pieces.items()}
        every = all_gather_json(listing, device)
        owned = _owned(every)
        try:
            _write_rank_file(tmp / rank_file(rank), pieces, owned[rank])
        except OSError as e:
            error = _save_error(e, rank)
        error = _agree(error, device)  # every rank's file is written
    if error is None and rank == 0:
        try:
            write_atomic(tmp / INDEX, json.dumps(_index_doc(every, owned)).encode())
            write_atomic(tmp / PLAN, trainer.plan.model_dump_json(indent=1).encode())
            write_atomic(tmp / META, json.dumps({
                "format": CKPT_FORMAT, "step": step, "seed": trainer.seed, "time": time.time(),
                "world_size": dist.get_world_size(), **(extra or {})}, indent=1,
                allow_nan=False).encode())
            publish(tmp, final, keep)
        except OSError as e:
            error = _save_error(e, rank)
    if rank == 0 and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    error = broadcast_json(error, device)  # type: ignore[assignment]
    if error is not None:
        sealed = complete_steps(ckpt_dir)
        raise SaveFailed(
            f"cannot save the checkpoint of step {step} into {ckpt_dir}: {error}. The run "
            f"stopped after step {step}; "
            + (f"the sealed checkpoints (steps {', '.join(map(str, sealed[-5:]))}) are unchanged "
               f"and the half-written step was removed. Free space or make {ckpt_dir} "
               "writable, then continue with --resume." if sealed else
               "no checkpoint was sealed before it. Free space or make the directory writable "
               "and run again."))
    return final


def _targets(trainer: Trainer, kernels: dict[str, dict]) -> dict[str, list[tuple[Box, torch.Tensor]]]:
    """key → the boxes this rank reads, under its own plan, each with the tensor it is read
    into: its shard of every parameter, the boxes of its optimizer slice, the replicated items,
    and the kernel state `kernels` (index entries) names."""
    out: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    families = trainer.optimizer.families
    moments = families[0].parts[0].exp_avg.dtype if families else torch.float32
    for name, p in trainer.model.named_parameters():
        off, _ = _placement(p, trainer)
        out[f"model/{name}"] = [((off, tuple(p.shape)), torch.empty(p.shape, dtype=p.dtype))]
    for _, name, p, (a, b), _ in _flat_ranges(trainer):  # only this rank's optimizer slice
        off, _ = _placement(p, trainer)
        mine = _shifted(_boxes(a, b, tuple(p.shape)), off)
        for s in _STATES:
            dtype = moments if s != "master" else torch.float32
            out[f"optim/{s}/{name}"] = [(box, torch.empty(box[1], dtype=dtype)) for box in mine]
    whole = {f"buffer/{n}": b for n, b in trainer.model.named_buffers()}
    whole["optim/step_count"] = torch.zeros((), dtype=torch.int64)
    whole |= {f"routing/{layer}": trainer.routing_totals[j]
              for j, layer in enumerate(trainer.moe_layer_numbers)}
    whole["rng/torch"] = torch.get_rng_state()
    for k, t in whole.items():
        out[k] = [(((0,) * t.dim(), tuple(t.shape)), torch.empty_like(t, device="cpu"))]
    for k, entry in kernels.items():
        shape = tuple(entry["shape"])
        out[k] = [(((0,) * len(shape), shape), torch.empty(shape, dtype=_TORCH[entry["dtype"]]))]
    return out


def _overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of one tensor, or None if it is empty (a 0-dim tensor's
    only box meets itself)."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def _within(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """`box` as slices of a box that starts at `origin`."""
    return tuple(slice(o - z, o - z + n) for o, n, z in zip(*box, origin, strict=True))


def _read(v: Verified, targets: dict[str, list[tuple[Box, torch.Tensor]]]) -> None:
    """Fill every target box from the saved boxes overlapping it, reading only the overlaps;
    they must cover each target exactly once (a hostile index cannot double- or under-fill)."""
    tensors, files = v.index["tensors"], v.index["files"]
    with contextlib.ExitStack() as stack:
        opened: dict[int, object] = {}
        for key, wanted in targets.items():
            entry = tensors.get(key)
            if entry is None:
                raise SpecError(f"checkpoint {v.path} has no {key}; it was saved by another "
                                "model. Resume under a plan of the model that saved it.")
            saved = [(fi, name, (tuple(o), tuple(z))) for fi, name, o, z in entry["boxes"]]
            for box, dst in wanted:
                if math.prod(box[1]) == 0:
                    continue
                if not _overlap(box, ((0,) * len(box[0]), tuple(entry["shape"]))) == box:
                    raise SpecError(f"checkpoint {v.path}: {key} has shape {entry['shape']}, "
                                    "which this plan's shards do not fit.")
                covered = 0
                for fi, name, sbox in saved:
                    part = _overlap(box, sbox)
                    if part is None:
                        continue
                    if fi not in opened:
                        opened[fi] = stack.enter_context(
                            safe_open(str(v.path / files[fi]), framework="pt"))
                    f = opened[fi]
                    src = (f.get_tensor(name) if sbox == box  # type: ignore[attr-defined]
                           else f.get_slice(name)[_within(part, sbox[0])])  # type: ignore[attr-defined]
                    dst[_within(part, box[0])].copy_(src)
                    covered += math.prod(part[1])
                if covered != math.prod(box[1]):
                    raise SpecError(f"checkpoint {v.path}: the saved boxes of {key} cover "
                                    f"{covered} of the {math.prod(box[1])} elements this rank "
                                    f"reads; its {INDEX} is inconsistent.")


def _flat_of(boxes: list[tuple[Box, torch.Tensor]]) -> torch.Tensor:
    """The boxes of an optimizer state read for this rank, back to its flat range (boxes in
    order of their offsets are the range's consecutive runs)."""
    return torch.cat([t.reshape(-1) for _, t in sorted(boxes, key=lambda bt: bt[0][0])])


@torch.no_grad()
def load_state(trainer: Trainer, state: dict[str, list[tuple[Box, torch.Tensor]]]) -> None:
    """Put what `_read` filled into this rank's parameters and optimizer shards."""
    opt, model = trainer.optimizer, trainer.model

    def one(key: str) -> torch.Tensor:
        return state[key][0][1]

    for name, p in model.named_parameters():
        p.data.copy_(one(f"model/{name}").to(p.dtype))
    dsts = {(id(f), s): getattr(f, s) for f in opt.families for s in _STATES}
    flats = {k: torch.zeros(d.numel(), dtype=d.dtype) for k, d in dsts.items()}
    for f, name, _, (a, b), at in _flat_ranges(trainer):
        for s in _STATES:
            flat = flats[(id(f), s)]
            flat[at: at + b - a] = _flat_of(state[f"optim/{s}/{name}"]).to(flat.dtype)
    for k, dst in dsts.items():
        dst.copy_(flats[k].to(dst.device))
    for n, b in model.named_buffers():
        b.copy_(one(f"buffer/{n}").to(b.dtype))
    opt.step_count = int(one("optim/step_count"))
    for j, layer in enumerate(trainer.moe_layer_numbers):
        trainer.routing_totals[j] = one(f"routing/{layer}").to(trainer.routing_totals.dtype)
    torch.set_rng_state(one("rng/torch"))


def _same_plan(trainer: Trainer, path: Path) -> bool:
    """Whether the checkpoint at `path` was written under this trainer's layout, choices and
    precision (what fixes each rank's shards and data)."""
    saved = read_json(path / PLAN, SMALL_JSON_BYTES, path)
    assert isinstance(saved, dict)
    mine = json.loads(trainer.plan.model_dump_json())
    return all(saved.get(k) == mine.get(k) for k in ("layout", "choices")) and \
        saved["training"].get("precision") == mine["training"].get("precision")


def load(trainer: Trainer, path: str | Path, manifest_sha256: str | None = None) -> int:
    """Restore `trainer` from a sealed step directory under its own plan; return the step.

    The step is re-checked here without re-hashing its tensor files (`verify(full=False)`:
    manifest, file list and sizes, JSON files hashed, index and meta checked); given the
    manifest digest the launcher verified, a step rewritten since is refused.
    """
    v = verify(path, full=False)
    if manifest_sha256 is not None and v.manifest_sha256 != manifest_sha256:
        raise SpecError(f"checkpoint {v.path} changed after the launcher verified it (its "
                        "manifest differs); run `moeplan run ... --resume` again.")
    prefix = f"kernels/rank{dist.get_rank()}/"
    kernels = ({k: e for k, e in v.index["tensors"].items() if k.startswith(prefix)}
               if _same_plan(trainer, v.path) else {})
    state = _targets(trainer, kernels)
    _read(v, state)
    load_state(trainer, state)
    if kernels:
        trainer.kernels.backend.load_extra_state(
            dict(trainer.model.named_parameters()),
            {k[len(prefix):]: state[k][0][1] for k in kernels})
    return v.step


# ------------------------------------------------------------ reading a checkpoint whole
def read_checkpoint(path: Path):
    """(plan, every parameter and router buffer at full size) of a sealed step directory, read
    by a single-process Trainer through the checkpoint module's own reshardable load (so the
    model is gathered on this one process)."""
    from ..specs import Choices, Layout, load_plan
    from .groups import local_groups

    plan = load_plan(path / "plan.json")
    plan = plan.model_copy(update={
        "layout": Layout.build(1, plan.training.global_batch_size), "choices": Choices(),
        "cluster": plan.cluster.model_copy(update={"num_gpus": 1})})
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer = Trainer(plan, local_groups(), seed=0)
    load(trainer, path)
    state = {n: p.detach() for n, p in trainer.model.named_parameters()}
    for name, b in trainer.model.named_buffers():
        if name.endswith("expert_bias") and b is not None:
            state[name] = b.detach()
    return plan, state


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, step: int | None = None,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> tuple[Path, int]:
    """`moeplan checkpoint export CKPT_DIR --to hf -o OUT_DIR [--step N]` → (OUT_DIR, the step
    exported): the newest step that claims to be a checkpoint, or `step`, by the same rule as
    `--resume` (`verify_step`): a damaged one is refused by name (with the newest usable step
    to give instead), never passed over in silence."""
    d = checkpoint_directory(ckpt_dir, "export")
    held = held_steps(d)
    if not held:
        raise SpecError(f"{ckpt_dir}: no complete checkpoint to export.")
    if step is not None and step not in held:
        raise SpecError(f"{ckpt_dir}: no checkpoint of step {step}; its checkpoints: "
                        f"{', '.join(map(str, held[-10:]))}.")
    v = verify_step(d, step if step is not None else held[-1], "export")
    plan, state = read_checkpoint(v.path)
    return write_hf(plan.model, state, out_dir, max_shard_bytes,
                    tokenizer=checkpoint_tokenizer(ckpt_dir)), v.step
