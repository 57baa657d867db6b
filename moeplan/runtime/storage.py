"""Files a run reads and writes, checked without torch so `moeplan run` refuses them at once.

Checkpoint directories (docs/RUNTIME.md, "Checkpoints"), format `moeplan-ckpt-v3`:
`CKPT/step_00000042/` holds one `rank_RRRRR.safetensors` per writing rank (tensor bytes and a
JSON header, nothing executable), `index.json` (where each box of each tensor lives),
`meta.json`, `plan.json` and, written last, `manifest.json` (size and SHA-256 of every other
file). Every file is strict JSON or safetensors: nothing in a checkpoint is ever unpickled, so
a crafted one can at worst hold wrong numbers, and the manifest catches those unless it was
rewritten to match.

A step directory is written under a temporary name, fsynced and renamed, so a crash leaves
either nothing or a temporary directory, never a half-written `step_*`; `latest` names the
newest step and is replaced last. A `step_*` without a manifest is not a checkpoint (never
loaded, never counted as saved, removed at the next save); one whose manifest, files, index or
metadata disagree is refused by name. Everything here is torch-free, so the launcher checks a
checkpoint completely before any worker starts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import limits
from ..errors import SpecError
from ..fsio import FileRefused, loads_json, open_regular, read_regular

CKPT_FORMAT = "moeplan-ckpt-v3"  # v3: per-rank safetensors, JSON index, required manifest
LEGACY_FORMATS = ("moeplan-ckpt-v1", "moeplan-ckpt-v2")  # DCP files with a pickled index
MANIFEST = "manifest.json"
INDEX = "index.json"
META = "meta.json"
PLAN = "plan.json"
LATEST = "latest"
LOCK = ".moeplan.lock"  # held (flock) by the run writing into the directory; names it
_STEP = re.compile(r"^step_(\d{8,13})$")  # 8 digits, more past step 99,999,999 (MAX_STEPS)


def step_of(name: str) -> int | None:
    """The step a `step_*` directory name stands for, or None. Names are `step_{N:08d}`: eight
    digits up to step 99,999,999 and as many as needed past it; a name with extra leading zeros
    (`step_000000003`) is not the name of any step, so it cannot shadow `step_00000003`."""
    m = _STEP.match(name)
    return int(m.group(1)) if m and name == step_dir("", int(m.group(1))).name else None


# ------------------------------------------------------------------------ checkpoint folders
# safetensors' dtype names and item sizes (the only dtypes a checkpoint may hold)
ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# bounds on what a checkpoint's files may make the launcher read (hostile input is normal input)
SMALL_JSON_BYTES = 16 << 20  # manifest.json, meta.json, plan.json
INDEX_BYTES = 1 << 30  # index.json: a few hundred bytes per box
HEADER_BYTES = 100_000_000  # a safetensors header (the safetensors library's own limit)
MAX_FILES = 1 << 16  # tensor files (one per writing rank)
MAX_NDIM = 8
_RANK_FILE = re.compile(r"^rank_\d{5}\.safetensors$")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with os.fdopen(open_regular(path, follow_links=False), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` as a whole or not at all: a temporary name in the same directory, fsync,
    rename, fsync of the directory (a crash leaves the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


RESUME_ADVICE = ("Refusing to load it: restore the step from a copy, remove it to resume from "
                 "an earlier step, or start a fresh run in another --ckpt-dir. Nothing was run.")


class CheckpointRefused(SpecError):
    """A step directory that is not a usable checkpoint: `why` says what is wrong with it, in
    one sentence naming the file; the message adds what to do (`--resume`'s advice unless the
    caller gives its own, as `checkpoint export` does)."""

    def __init__(self, path: Path, why: str, advice: str = RESUME_ADVICE, legacy: bool = False):
        self.path, self.why, self.advice, self.legacy = Path(path), why, advice, legacy
        super().__init__(f"checkpoint {path}: {why} {advice}")


def _refuse(path: Path, why: str) -> CheckpointRefused:
    return CheckpointRefused(path, why)


def read_json(path: Path, limit: int, step: Path) -> object:
    """Strict JSON (no NaN/Infinity, no repeated keys, UTF-8) of at most `limit` bytes."""
    return parse_json(_read_bounded(path, limit, step), path.name, step)


def _read_bounded(path: Path, limit: int, step: Path) -> bytes:
    """A checkpoint file's bytes: a regular file (never a link), at most `limit` bytes."""
    try:
        return read_regular(path, limit, follow_links=False)
    except FileRefused as e:
        if e.kind == "size":
            raise _refuse(step, f"{path.name} has more than the {limit} bytes a checkpoint's "
                          f"{path.name} may have.") from None
        raise _refuse(step, f"{path.name} is missing or not a plain file ({e.reason}).") from None


def parse_json(data: bytes, name: str, step: Path) -> object:
    try:
        return loads_json(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError included
        raise _refuse(step, f"{name} is not strict JSON ({str(e)[:120]}).") from None


def _whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------ manifest and sealing
def _manifest_files(path: Path, doc: object) -> dict[str, dict]:
    """The `files` of a manifest, each entry checked (names plain, sizes whole, hex digests)."""
    if not isinstance(doc, dict) or not doc:
        raise _refuse(path, f"{MANIFEST} is empty; a checkpoint's manifest must list every "
                      "file with its size and SHA-256 (an empty one would turn the checks off).")
    files = doc.get("files")
    if doc.get("format") != CKPT_FORMAT or not isinstance(files, dict) or not files:
        raise _refuse(path, f"{MANIFEST} does not have the {CKPT_FORMAT} form "
                      '{"format": ..., "files": {NAME: {"bytes": N, "sha256": HEX}}} with at '
                      "least one file.")
    if len(files) > MAX_FILES + 3:
        raise _refuse(path, f"{MANIFEST} lists {len(files)} files, more than {MAX_FILES + 3}.")
    for name, want in files.items():
        if not _PLAIN_NAME.fullmatch(name) or name == MANIFEST:
            raise _refuse(path, f"{MANIFEST} lists {name[:80]!r}, which is not a file name a "
                          "checkpoint holds.")
        if not (isinstance(want, dict) and set(want) == {"bytes", "sha256"}
                and _whole(want["bytes"]) and want["bytes"] >= 0
                and isinstance(want["sha256"], str) and _HEX64.fullmatch(want["sha256"])):
            raise _refuse(path, f"{MANIFEST}: the entry of {name} is not "
                          '{"bytes": N, "sha256": 64 hex digits}.')
    return files


def _legacy_format(path: Path) -> str | None:
    """The format of a pre-v3 checkpoint (DCP `.distcp` files and a pickled `.metadata`
    index), named from its meta.json where that says, else None for anything else."""
    dcp_files = (path / ".metadata").exists() or any(path.glob("*.distcp"))
    fmt = None
    try:
        meta = loads_json(read_regular(path / META, SMALL_JSON_BYTES, follow_links=False))
        if isinstance(meta, dict) and meta.get("format") in LEGACY_FORMATS:
            fmt = meta["format"]
    except (SpecError, ValueError, RecursionError):
        pass
    return fmt or ("moeplan-ckpt-v2" if dcp_files else None)


def _listed(path: Path, files: dict[str, dict]) -> None:
    """The directory holds exactly the manifest's files (plus the manifest), each a plain file
    of the listed size: an added file (say, a pickle) or a missing one is refused by name."""
    present = {p.name for p in path.iterdir()} - {MANIFEST}
    extra = sorted(present - files.keys())
    if extra:
        raise _refuse(path, f"{extra[0]} is not listed in {MANIFEST}"
                      + (f" (nor {len(extra) - 1} more)" if len(extra) > 1 else "")
                      + "; a sealed checkpoint holds only the files its manifest lists.")
    for name, want in files.items():
        f = path / name
        if f.is_symlink() or not f.is_file():
            raise _refuse(path, f"{name} is missing (listed in {MANIFEST}).")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise _refuse(path, f"{name} has {size} bytes, the manifest says {want['bytes']} "
                          "(truncated or replaced).")


def publish(tmp: Path, final: Path, keep: int) -> None:
    """Seal a fully written temporary step directory: manifest (last, atomically), fsync,
    rename, `latest`, prune.

    Called by one process once every rank's files are in `tmp`. A sealed `final` is never
    replaced (the temporary one is dropped instead); a `final` that is not a sealed checkpoint
    (its manifest deleted, say) is not one, so it is removed and the new step takes its place.
    """
    files = sorted(tmp.iterdir())
    manifest = {"format": CKPT_FORMAT,
                "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                          for p in files}}
    for p in files:
        _fsync(p)
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync(tmp)
    if final.exists():
        if step_state(final) == "sealed":
            shutil.rmtree(tmp)
            return
        _remove(final)
    os.rename(tmp, final)
    _fsync(final.parent)
    write_atomic(final.parent / LATEST, (final.name + "\n").encode())
    prune(final.parent, keep)


def _remove(path: Path) -> None:
    """Delete a directory by first renaming it out of the `step_*` names, so a crash midway
    never leaves a half-deleted step that looks like a checkpoint."""
    gone = path.with_name(f".{path.name}.removing-{uuid.uuid4().hex[:8]}")
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def prune(ckpt_dir: Path, keep: int) -> None:
    """Keep the newest `keep` sealed steps (0: all); remove every `step_*` that is not a
    checkpoint (no manifest) and leftovers of interrupted writes. Refused (damaged or older
    format) steps are left for the user to look at."""
    states = scan(ckpt_dir)
    sealed = [s for s, st in states if st == "sealed"]
    old = sealed[:-keep] if keep > 0 else []
    for s, st in states:
        if st == "unsealed" or s in old:
            _remove(step_dir(ckpt_dir, s))
    for p in ckpt_dir.iterdir():
        if p.name.startswith(".step_") and (".tmp-" in p.name or ".removing-" in p.name):
            shutil.rmtree(p, ignore_errors=True)


def step_state(path: Path) -> str:
    """What a `step_*` directory is, cheaply (sizes, not checksums): "sealed" (a v3 manifest
    whose files are all there), "unsealed" (no manifest: not a checkpoint), "legacy" (an
    older format) or "damaged" (a manifest that does not hold; `verify` says why)."""
    if not (path / MANIFEST).exists():
        return "legacy" if _legacy_format(path) else "unsealed"
    if _legacy_format(path):
        return "legacy"
    try:
        files = _manifest_files(path, read_json(path / MANIFEST, SMALL_JSON_BYTES, path))
        _listed(path, files)
    except SpecError:
        return "damaged"
    return "sealed"


def scan(ckpt_dir: str | Path) -> list[tuple[int, str]]:
    """(step, `step_state`) of every `step_*` directory, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    steps = sorted(s for p in root.iterdir() if (s := step_of(p.name)) is not None)
    return [(s, step_state(step_dir(root, s))) for s in steps]


def complete_steps(ckpt_dir: str | Path) -> list[int]:
    """Steps with a sealed checkpoint, oldest first; a step without a manifest is none."""
    return [s for s, st in scan(ckpt_dir) if st == "sealed"]


def held_steps(ckpt_dir: str | Path) -> list[int]:
    """Steps that claim to be a checkpoint (a manifest, or an older format's files)."""
    return [s for s, st in scan(ckpt_dir) if st != "unsealed"]


def resume_point(ckpt_dir: str | Path) -> tuple[Path | None, list[Path]]:
    """(the newest step directory that claims to be a checkpoint, for `verify` to accept or
    refuse; the newer `step_*` directories without a manifest, which are not checkpoints and
    are passed over, to be named to the user)."""
    states = scan(ckpt_dir)
    held = [s for s, st in states if st != "unsealed"]
    newest = held[-1] if held else -1
    skipped = [step_dir(ckpt_dir, s) for s, st in states if st == "unsealed" and s > newest]
    return (step_dir(ckpt_dir, newest) if held else None), skipped


# --------------------------------------------------------------------------- index and meta
def check_meta(path: Path, meta: object) -> dict:
    """meta.json: format, step (equal to the directory's), seed and world size, each checked."""
    if not isinstance(meta, dict):
        raise _refuse(path, f"{META} is not a JSON object.")
    if meta.get("format") != CKPT_FORMAT:
        raise _refuse(path, f"{META} names format {str(meta.get('format'))[:40]!r}, not "
                      f"{CKPT_FORMAT}.")
    for key in ("step", "world_size"):
        if not _whole(meta.get(key)) or meta[key] < (1 if key == "world_size" else 0):
            raise _refuse(path, f'{META}: "{key}" must be a whole number'
                          + (" of at least 1" if key == "world_size" else "")
                          + f", got {str(meta.get(key))[:40]!r}.")
    try:
        limits.check_seed(meta.get("seed"), f'{META}: "seed"')  # the rule `run --seed` obeys
    except SpecError as e:
        raise _refuse(path, str(e).split(";")[0] + ".") from None
    m = step_of(path.name)
    if m is not None and m != meta["step"]:
        raise _refuse(path, f'{META} says step {meta["step"]} but the directory is '
                      f"{path.name}.")
    return meta


def check_plan(path: Path, doc: object) -> None:
    """plan.json: a plan this version reads (the resuming run compares its model; export
    builds the model from it)."""
    from ..specs import Plan
    from ..specs.validated import build

    try:
        build(Plan, doc, "plan", str(path / PLAN))
    except SpecError as e:
        raise _refuse(path, f"{PLAN} is not a plan this version reads "
                      f"({limits.clip(' '.join(str(e).split()), 200)}).") from None


def check_index(path: Path, index: object) -> dict:
    """index.json: every tensor's global shape, dtype and boxes (file, name, offsets, sizes),
    each box inside the tensor and the boxes' volumes adding up to the tensor's (with the
    loader's exact-cover check, no element is read twice or left out)."""
    if not isinstance(index, dict) or index.get("format") != CKPT_FORMAT:
        raise _refuse(path, f"{INDEX} is not a {CKPT_FORMAT} index.")
    files, tensors = index.get("files"), index.get("tensors")
    if not (isinstance(files, list) and len(files) <= MAX_FILES
            and all(isinstance(f, str) and _RANK_FILE.fullmatch(f) for f in files)
            and len(set(files)) == len(files)):
        raise _refuse(path, f'{INDEX}: "files" must be distinct rank_NNNNN.safetensors names '
                      f"(at most {MAX_FILES}).")
    if not isinstance(tensors, dict):
        raise _refuse(path, f'{INDEX}: "tensors" must be an object.')
    names: set[tuple[int, str]] = set()
    for key, t in tensors.items():
        bad = _bad_tensor(t, len(files), names)
        if bad:
            raise _refuse(path, f"{INDEX}: tensor {key[:80]!r}: {bad}.")
    return index


def _bad_tensor(t: object, n_files: int, names: set[tuple[int, str]]) -> str | None:
    """Why one index entry is malformed, or None."""
    if not (isinstance(t, dict) and set(t) == {"shape", "dtype", "boxes"}):
        return 'it must have exactly "shape", "dtype" and "boxes"'
    shape, boxes = t["shape"], t["boxes"]
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
            and all(_whole(d) and 0 <= d < 1 << 40 for d in shape)):
        return f"the shape must be at most {MAX_NDIM} whole sizes"
    if t["dtype"] not in ST_ITEMSIZE:
        return f"dtype {str(t['dtype'])[:20]!r} is not one of {', '.join(ST_ITEMSIZE)}"
    if not isinstance(boxes, list) or not boxes:
        return "it has no boxes"
    volume = 0
    for box in boxes:
        if not (isinstance(box, list) and len(box) == 4 and _whole(box[0])
                and 0 <= box[0] < n_files and isinstance(box[1], str) and len(box[1]) <= 1000
                and all(isinstance(v, list) and len(v) == len(shape) and all(map(_whole, v))
                        for v in box[2:])):
            return "each box must be [file number, tensor name, offsets, sizes]"
        _, _, off, size = box
        if any(o < 0 or z < 0 or o + z > d for o, z, d in zip(off, size, shape, strict=True)):
            return f"box at {off[:8]} of sizes {size[:8]} leaves the shape {shape[:8]}"
        if (box[0], box[1]) in names:
            return f"the stored tensor {box[1][:80]!r} is named twice"
        names.add((box[0], box[1]))
        volume += math.prod(size)
    if volume != math.prod(shape):
        return f"its boxes hold {volume} elements, the shape {math.prod(shape)}"
    return None


@dataclass(frozen=True)
class StEntry:
    """One tensor of a safetensors header: dtype, shape and its byte range in the data section
    (which starts at `data_start` in the file)."""

    dtype: str
    shape: list[int]
    begin: int
    end: int
    data_start: int


def read_safetensors_header(path: Path, step: Path) -> dict[str, StEntry]:
    """name → entry of a safetensors file's header, checked without torch by the rules the
    safetensors library applies when it opens the file (`Metadata::validate`), so that nothing
    passes here that `safe_open` then refuses inside a worker:

    - 8 bytes of little-endian header length n ≤ 100 MB, the header inside the file, a JSON
      object (UTF-8, strict, no repeated key) starting with `{`;
    - `__metadata__`, when present, maps strings to strings;
    - each tensor has exactly dtype, shape and data_offsets; its byte count is its shape's
      product times the dtype's size;
    - sorted by offset, the tensors' ranges are contiguous and non-overlapping, start at 0 and
      end exactly at the end of the file (no trailing bytes).
    Anything else (a pickle, say) is refused by name."""
    try:
        fd = open_regular(path, follow_links=False)
    except FileRefused as e:
        raise _refuse(step, f"{path.name} is not a regular file ({e.reason}).") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= min(HEADER_BYTES, size - 8):
            raise _refuse(step, f"{path.name} is not a safetensors file (its first 8 bytes "
                          "do not give a header length inside the file).")
        raw = f.read(n)
    try:
        header = loads_json(raw) if raw[:1] == b"{" else None
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise _refuse(step, f"{path.name} is not a safetensors file (its header is not a "
                      "strict JSON object).")
    meta = header.pop("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _refuse(step, f"{path.name}: its __metadata__ is not a mapping of strings to "
                      "strings, which safetensors refuses.")
    out: dict[str, StEntry] = {}
    for name, e in header.items():
        ok = (isinstance(e, dict) and set(e) == {"dtype", "shape", "data_offsets"}
              and e["dtype"] in ST_ITEMSIZE and isinstance(e["shape"], list)
              and len(e["shape"]) <= MAX_NDIM
              and all(_whole(d) and 0 <= d < 1 << 40 for d in e["shape"])
              and isinstance(e["data_offsets"], list) and len(e["data_offsets"]) == 2
              and all(_whole(o) and o >= 0 for o in e["data_offsets"]))
        if ok:
            a, b = e["data_offsets"]
            ok = b - a == math.prod(e["shape"]) * ST_ITEMSIZE[e["dtype"]]
        if not ok:
            raise _refuse(step, f"{path.name}: the header entry of {name[:80]!r} is not a "
                          "tensor of its dtype and shape.")
        out[name] = StEntry(e["dtype"], e["shape"], *e["data_offsets"], 8 + n)
    end = 0
    for name, e in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != end:
            raise _refuse(step, f"{path.name}: the bytes of {name[:80]!r} start at {e.begin}, "
                          f"not where the previous tensor ends ({end}); safetensors refuses "
                          "overlapping or gapped offsets.")
        end = e.end
    if 8 + n + end != size:
        raise _refuse(step, f"{path.name} has {size - 8 - n - end} bytes after its last "
                      "tensor (or lacks them); safetensors refuses a data section that its "
                      "tensors do not cover exactly.")
    return out


# torch's CPU generator state (at::CPUGeneratorImplState, 5056 bytes on 64-bit platforms):
# seed u64, left i32, seeded i32, next u64, 624 state words, ... `torch.set_rng_state`
# refuses another size, and an engine unless seeded, 1 ≤ left ≤ 624 and (uint32) next ≤ 624
# ("Invalid mt19937 state"); tests/test_checkpoint.py checks this against torch itself.
RNG_KEY = "rng/torch"
RNG_BYTES = (5056,)
MT_N = 624


def rng_state_problem(state: bytes) -> str | None:
    """Why torch would refuse `state` as a CPU RNG state (None: it accepts it)."""
    if len(state) not in RNG_BYTES:
        return f"it has {len(state)} bytes, not the {RNG_BYTES[0]} of a torch CPU RNG state"
    left, seeded = struct.unpack_from("<ii", state, 8)
    (nxt,) = struct.unpack_from("<Q", state, 16)
    if not seeded or not 1 <= left <= MT_N or nxt & 0xFFFFFFFF > MT_N:
        return "it is not a valid Mersenne-Twister state (torch refuses it)"
    return None


def _rng_problem(path: Path, index: dict, headers: list[dict[str, StEntry]]) -> str | None:
    """Why the saved RNG state would make `torch.set_rng_state` fail in a worker, or None:
    read from its boxes (a 1-D byte tensor) without torch."""
    entry = index["tensors"].get(RNG_KEY)
    if entry is None:
        return f"{INDEX} holds no {RNG_KEY}, which every checkpoint saves"
    if entry["dtype"] != "U8" or len(entry["shape"]) != 1:
        return f"{RNG_KEY} is not a 1-D U8 tensor"
    data = bytearray(entry["shape"][0])
    for fi, name, (off,), (count,) in entry["boxes"]:
        e = headers[fi][name]
        with os.fdopen(open_regular(path / index["files"][fi], follow_links=False), "rb") as f:
            f.seek(e.data_start + e.begin)
            data[off: off + count] = f.read(count)
    return rng_state_problem(bytes(data))


# ------------------------------------------------------------------------------ verification
@dataclass(frozen=True)
class Verified:
    """A checkpoint step that passed `verify`: what the launcher tells the workers to load."""

    path: Path
    step: int
    meta: dict
    index: dict
    manifest_sha256: str  # the manifest the checks were made against


def verify(path: str | Path, full: bool = True) -> Verified:
    """Check a step directory completely before anything reads its tensors; name what is wrong.

    A pre-v3 checkpoint is refused by its format (its index is a pickle, never read). Then:
    the manifest (a v3 one, non-empty), the directory holding exactly its files, each file's
    size and SHA-256, meta.json and index.json strictly, the files being exactly the index's
    tensor files and the three JSON files, and each tensor file's header against the index.
    `full=False` (a worker re-reading what the launcher verified) hashes only the JSON files.
    """
    path = Path(path)
    legacy = _legacy_format(path)
    if legacy:
        raise CheckpointRefused(
            path, f"it is a {legacy} checkpoint (torch.distributed.checkpoint files with a "
            "pickled .metadata index), which this version does not read: loading it would "
            f"mean unpickling that index. This version reads {CKPT_FORMAT} (safetensors and "
            "JSON).", "Resume with the moeplan version that wrote it, or start a fresh run in "
            "another --ckpt-dir. Nothing was run.", legacy=True)
    if not (path / MANIFEST).is_file():
        raise _refuse(path, f"it has no {MANIFEST}, so it is not a complete checkpoint.")
    raw = _read_bounded(path / MANIFEST, SMALL_JSON_BYTES, path)  # one read: checked and hashed
    files = _manifest_files(path, parse_json(raw, MANIFEST, path))
    _listed(path, files)
    for name, want in files.items():
        if (full or name.endswith(".json")) and _sha256(path / name) != want["sha256"]:
            raise _refuse(path, f"{name} does not match its SHA-256 in {MANIFEST} (corrupt "
                          "or changed after it was written).")
    meta = check_meta(path, read_json(path / META, SMALL_JSON_BYTES, path))
    check_plan(path, read_json(path / PLAN, SMALL_JSON_BYTES, path))
    index = check_index(path, read_json(path / INDEX, INDEX_BYTES, path))
    want_files = {META, PLAN, INDEX, *index["files"]}
    if set(files) != want_files:
        odd = sorted(set(files) ^ want_files)[0]
        raise _refuse(path, f"{odd} is " + ("not part of a checkpoint (neither JSON metadata nor "
                      f"a tensor file its {INDEX} names)." if odd in files else
                      f"named by {INDEX} but not listed in {MANIFEST}."))
    if full:
        _headers_match(path, index)
    return Verified(path, meta["step"], meta, index, hashlib.sha256(raw).hexdigest())


def _headers_match(path: Path, index: dict) -> None:
    """Every box the index names is a tensor of that name, dtype and shape in its file, and
    the saved RNG state is one torch accepts."""
    headers = [read_safetensors_header(path / f, path) for f in index["files"]]
    for key, t in index["tensors"].items():
        for fi, name, _, size in t["boxes"]:
            e = headers[fi].get(name)
            got = e and (e.dtype, e.shape)
            if got != (t["dtype"], size):
                raise _refuse(path, f"{index['files'][fi]} does not hold {name[:80]!r} as "
                              f"{INDEX} describes it ({t['dtype']} {size[:8]}, for {key[:80]}); "
                              f"it holds {got and (got[0], got[1][:8])}.")
    bad = _rng_problem(path, index, headers)
    if bad:
        raise _refuse(path, f"its saved RNG state ({RNG_KEY}) cannot be restored: {bad}.")


def manifest_sha256(path: str | Path) -> str:
    """SHA-256 of a step's manifest: the worker's check that it loads the step the launcher
    verified, not one rewritten since."""
    path = Path(path)
    return hashlib.sha256(_read_bounded(path / MANIFEST, SMALL_JSON_BYTES, path)).hexdigest()


def newest_checkpoint(ckpt_dir: str | Path, check: bool = True) -> Path | None:
    """The newest step directory that claims to be a checkpoint (verified completely, by
    `verify_step`'s rule, when `check`), or None."""
    path, _ = resume_point(ckpt_dir)
    if path is None:
        return None
    if check:
        verify_step(path.parent, step_of(path.name) or 0)
    return path


# ------------------------------------------------------------ usable steps: one rule for all
# A `step_*` directory with a manifest (or an older format's files) claims to be a checkpoint;
# it is usable exactly when `verify` accepts it completely. `--resume` (and a torchrun restart)
# and `checkpoint export` take the newest claimed step, or the one `--step` names, and refuse
# it by name when it is not usable: they never fall back to an older step in silence.
# `checkpoint list` shows every step directory with the same verdict. A `step_*` without a
# manifest is not a checkpoint: passed over by name, removed at the next save.
@dataclass(frozen=True)
class StepStatus:
    """What one `step_*` directory is, by the one rule (`verify`, completely)."""

    step: int
    path: Path
    state: str  # "usable" | "damaged" | "older format" | "not a checkpoint"
    problem: str | None  # why it is not usable (None when it is)
    verified: Verified | None

    @property
    def usable(self) -> bool:
        return self.verified is not None


NOT_SEALED = (f"it has no {MANIFEST}, so it is not a checkpoint (never sealed, or its manifest "
              "was removed); --resume and export pass over it, and the next save removes it")


def step_status(path: Path, step: int) -> StepStatus:
    """The verdict on one step directory: usable (verified completely) or why not."""
    if not (path / MANIFEST).exists() and not _legacy_format(path):
        return StepStatus(step, path, "not a checkpoint", NOT_SEALED, None)
    try:
        return StepStatus(step, path, "usable", None, verify(path))
    except CheckpointRefused as e:
        state = "older format" if _legacy_format(path) else "damaged"
        return StepStatus(step, path, state, e.why, None)


def survey(ckpt_dir: str | Path) -> list[StepStatus]:
    """Every `step_*` directory of `ckpt_dir`, oldest first, each with its verdict."""
    return [step_status(step_dir(ckpt_dir, s), s) for s, _ in scan(ckpt_dir)]


def newest_claimed(ckpt_dir: str | Path) -> int | None:
    """The step `--resume` and `checkpoint export` take by default: the newest step directory
    that claims to be a checkpoint (usable or not), or None."""
    held = held_steps(ckpt_dir)
    return held[-1] if held else None


def checkpoint_directory(ckpt_dir: str | Path, command: str) -> Path:
    """`ckpt_dir` as `checkpoint list|export` take it: the --ckpt-dir of a run, not one of its
    step directories (which is refused saying what to give instead)."""
    d = Path(ckpt_dir)
    step = step_of(d.name)
    if step is not None or (d / MANIFEST).exists():
        parent = d.parent if str(d.parent) else Path(".")
        example = (f"`moeplan checkpoint export {parent} --step {step} --to hf -o OUT`"
                   if command == "export" else f"`moeplan checkpoint list {parent}`")
        raise SpecError(f"{ckpt_dir} is one step of a checkpoint directory, not the directory: "
                        f"give the directory{' and the step' if command == 'export' else ''}, "
                        f"{example}.")
    if not d.is_dir():
        raise SpecError(f"{ckpt_dir}: not a directory; pass a --ckpt-dir of `moeplan run`.")
    return d


def list_checkpoints(ckpt_dir: str | Path) -> list[dict[str, Any]]:
    """Every step directory of `ckpt_dir` with the one verdict `--resume` and `checkpoint
    export` use (`storage.survey`): its state ("usable", "damaged", "older format", "not a
    checkpoint") and what is wrong, the model and the layout in the plan vocabulary
    (`Plan.summary()`); `newest` marks the step `--resume` and export take by default."""
    from ..specs import load_plan

    d = checkpoint_directory(ckpt_dir, "list")
    newest = newest_claimed(d)
    rows = []
    for st in survey(d):
        row: dict[str, Any] = {"step": st.step, "path": str(st.path), "state": st.state,
                               "usable": st.usable, "verified": st.usable,
                               "problem": st.problem, "newest": st.step == newest,
                               "model": "?", "layout": "?"}
        if st.usable:
            plan = load_plan(st.path / PLAN)
            row.update(model=plan.model.name, layout=plan.summary())
        rows.append(row)
    return rows


def newest_usable_before(ckpt_dir: str | Path, step: int) -> int | None:
    """The newest usable step older than `step` (each candidate verified completely)."""
    for s in reversed(held_steps(ckpt_dir)):
        if s < step and step_status(step_dir(ckpt_dir, s), s).usable:
            return s
    return None


def verify_step(ckpt_dir: str | Path, step: int, purpose: str = "resume") -> Verified:
    """`verify` of `ckpt_dir`'s step `step`, refused by the one rule's words: what is wrong,
    and which older step is usable instead (`purpose`: "resume" or "export")."""
    path = step_dir(ckpt_dir, step)
    try:
        return verify(path)
    except CheckpointRefused as e:
        older = newest_usable_before(ckpt_dir, step)
        if purpose == "export":
            this = ("export it with the moeplan version that wrote it" if e.legacy
                    else "restore this one from a copy")
            advice = (f"Export the newest usable step with --step {older}, or {this}." if older
                      else f"No older step is usable either; {this}.")
        else:
            advice = e.advice + (f" The newest usable step is {older}." if older
                                 else " No older step is usable either.")
        raise CheckpointRefused(e.path, e.why, advice, e.legacy) from None


# ------------------------------------------------------------- the directory a run writes into
LOCKED_ENV = "MOEPLAN_CKPT_LOCKED"  # set by a launcher holding the lock, for its workers


def check_ckpt_dir(ckpt_dir: str | Path) -> Path:
    """Refuse, before anything starts, a --ckpt-dir the run could not save into: a file (or
    a path under one), one that cannot be created, or one that cannot be written (read-only
    file system, no permission). It is created when missing."""
    d = Path(ckpt_dir)
    for p in (d, *d.parents):
        if p.exists() and not p.is_dir():
            raise SpecError(f"--ckpt-dir {limits.clip(str(d))}: {p} is a file, not a directory. "
                            "Give a directory (it is created if missing). Nothing was run.")
        if p.exists():
            break
    probe = d / f".moeplan-probe-{uuid.uuid4().hex[:8]}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe.mkdir()
        os.close(os.open(probe / "x", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        raise SpecError(f"--ckpt-dir {limits.clip(str(d))}: cannot write into it "
                        f"({e.strerror or type(e).__name__}); checkpoints could not be saved. "
                        "Give a writable directory. Nothing was run.") from None
    finally:
        with contextlib.suppress(OSError):
            (probe / "x").unlink()
        with contextlib.suppress(OSError):
            probe.rmdir()
    return d


class CkptLock:
    """An exclusive lock on a checkpoint directory for the life of a run.

    Two runs saving into one directory prune each other's temporary steps and mix their
    checkpoints. The run holds `flock` on DIR/.moeplan.lock (released by the kernel when the
    holder exits, however it exits, so a killed run leaves no stale lock) and writes who it is
    into the file; a second run finds the lock taken and is refused, naming the holder.
    `flock` works across processes of one host and, on Linux NFS, across hosts."""

    def __init__(self, ckpt_dir: str | Path, command: str, flag: str = "--ckpt-dir",
                 clash: str = "two runs saving into one checkpoint directory would prune each "
                 "other's steps", checked: bool = True):
        """`flag` and `clash`: the directory's option and what two runs sharing it would do
        (the run's --out is locked the same way: its workers read OUT/run.json); `checked`:
        probe it as a checkpoint directory first (`check_ckpt_dir`)."""
        self.dir, self.command, self.fd = Path(ckpt_dir), command, None
        self.flag, self.clash, self.checked = flag, clash, checked

    def acquire(self) -> CkptLock:
        if self.checked:
            check_ckpt_dir(self.dir)
        path = self.dir / LOCK
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise SpecError(f"{self.flag} {self.dir}: cannot open its lock file {LOCK} "
                            f"({e.strerror}); remove it if it is not a regular file. Nothing "
                            "was run.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SpecError(f"{self.flag} {self.dir}: cannot lock it ({e.strerror}). "
                                "Nothing was run.") from None
            raise SpecError(f"{self.flag} {self.dir} is in use by another run ({holder}); "
                            f"{self.clash}. Wait for it to end (or stop it), or give another "
                            f"{self.flag}. Nothing was run.") from None
        doc = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
               "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(doc).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> CkptLock:
        return self.acquire()

    def __exit__(self, *_exc: object) -> None:
        self.release()


def _holder(fd: int) -> str:
    """Who holds a checkpoint lock, from what it wrote into the lock file."""
    try:
        doc = loads_json(os.pread(fd, 4096, 0))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc["since"])))
        return (f"pid {int(doc['pid'])} on {limits.clip(str(doc['host']), 40)} since {since}: "
                f"{limits.clip(str(doc['command']), 200)}")
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder did not say who it is"
