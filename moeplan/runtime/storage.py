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

import hashlib
import json
import math
import os
import re
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecError

CKPT_FORMAT = "moeplan-ckpt-v3"  # v3: per-rank safetensors, JSON index, required manifest
LEGACY_FORMATS = ("moeplan-ckpt-v1", "moeplan-ckpt-v2")  # DCP files with a pickled index
MANIFEST = "manifest.json"
INDEX = "index.json"
META = "meta.json"
PLAN = "plan.json"
LATEST = "latest"
_STEP = re.compile(r"^step_(\d{8})$")


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
    with open(path, "rb") as f:
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


def _refuse(path: Path, why: str) -> SpecError:
    return SpecError(f"checkpoint {path}: {why} Refusing to load it: restore the step from a "
                     "copy, remove it to resume from an earlier step, or start a fresh run in "
                     "another --ckpt-dir. Nothing was run.")


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("a key appears twice")
    return dict(pairs)


def read_json(path: Path, limit: int, step: Path) -> object:
    """Strict JSON (no NaN/Infinity, no repeated keys, UTF-8) of at most `limit` bytes."""
    return parse_json(_read_bounded(path, limit, step), path.name, step)


def _read_bounded(path: Path, limit: int, step: Path) -> bytes:
    if path.is_symlink() or not path.is_file():
        raise _refuse(step, f"{path.name} is missing or not a plain file.")
    if path.stat().st_size > limit:
        raise _refuse(step, f"{path.name} has {path.stat().st_size} bytes, more than the "
                      f"{limit} a checkpoint's {path.name} may have.")
    return path.read_bytes()


def parse_json(data: bytes, name: str, step: Path) -> object:
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant,
                          object_pairs_hook=_unique_keys)
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
        m = path / META
        small = m.is_file() and m.stat().st_size <= SMALL_JSON_BYTES
        meta = json.loads(m.read_bytes().decode("utf-8")) if small else None
        if isinstance(meta, dict) and meta.get("format") in LEGACY_FORMATS:
            fmt = meta["format"]
    except (OSError, ValueError, RecursionError):
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
    steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP.match(p.name)))
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
    for key in ("step", "seed", "world_size"):
        if not _whole(meta.get(key)) or meta[key] < (1 if key == "world_size" else 0):
            raise _refuse(path, f'{META}: "{key}" must be a whole number'
                          + (" of at least 1" if key == "world_size" else "")
                          + f", got {str(meta.get(key))[:40]!r}.")
    m = _STEP.match(path.name)
    if m and int(m.group(1)) != meta["step"]:
        raise _refuse(path, f'{META} says step {meta["step"]} but the directory is '
                      f"{path.name}.")
    return meta


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


def read_safetensors_header(path: Path, step: Path) -> dict[str, tuple[str, list[int]]]:
    """name → (dtype, shape) from a safetensors file's header, checked without torch: the
    header is bounded strict JSON, and each tensor's byte range lies inside the file and
    matches its dtype and shape. Anything else (a pickle, say) is refused by name."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= min(HEADER_BYTES, size - 8):
            raise _refuse(step, f"{path.name} is not a safetensors file (its first 8 bytes "
                          "do not give a header length inside the file).")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant,
                            object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):
        raise _refuse(step, f"{path.name} is not a safetensors file (its header is not strict "
                      "JSON).") from None
    if not isinstance(header, dict):
        raise _refuse(step, f"{path.name} is not a safetensors file.")
    data = size - 8 - n
    out: dict[str, tuple[str, list[int]]] = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(e, dict) and e.get("dtype") in ST_ITEMSIZE
              and isinstance(e.get("shape"), list) and all(map(_whole, e["shape"]))
              and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
              and all(map(_whole, e["data_offsets"])))
        if ok:
            a, b = e["data_offsets"]
            ok = (0 <= a <= b <= data and all(d >= 0 for d in e["shape"])
                  and b - a == math.prod(e["shape"]) * ST_ITEMSIZE[e["dtype"]])
        if not ok:
            raise _refuse(step, f"{path.name}: the header entry of {name[:80]!r} is not a "
                          "tensor inside the file.")
        out[name] = (e["dtype"], e["shape"])
    return out


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
        raise SpecError(
            f"checkpoint {path} is a {legacy} checkpoint (torch.distributed.checkpoint files "
            "with a pickled .metadata index), which this version does not read: loading it "
            f"would mean unpickling that index. This version reads {CKPT_FORMAT} (safetensors "
            "and JSON). Resume with the moeplan version that wrote it, or start a fresh run in "
            "another --ckpt-dir. Nothing was run.")
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
    read_json(path / PLAN, SMALL_JSON_BYTES, path)
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
    """Every box the index names is a tensor of that name, dtype and shape in its file."""
    headers = [read_safetensors_header(path / f, path) for f in index["files"]]
    for key, t in index["tensors"].items():
        for fi, name, _, size in t["boxes"]:
            got = headers[fi].get(name)
            if got != (t["dtype"], size):
                raise _refuse(path, f"{index['files'][fi]} does not hold {name[:80]!r} as "
                              f"{INDEX} describes it ({t['dtype']} {size[:8]}, for {key[:80]}); "
                              f"it holds {got and (got[0], got[1][:8])}.")


def manifest_sha256(path: str | Path) -> str:
    """SHA-256 of a step's manifest: the worker's check that it loads the step the launcher
    verified, not one rewritten since."""
    path = Path(path)
    return hashlib.sha256(_read_bounded(path / MANIFEST, SMALL_JSON_BYTES, path)).hexdigest()


def newest_checkpoint(ckpt_dir: str | Path, check: bool = True) -> Path | None:
    """The newest sealed step directory (verified completely when `check`), or None."""
    path, _ = resume_point(ckpt_dir)
    if path is None:
        return None
    if check:
        verify(path)
    return path
