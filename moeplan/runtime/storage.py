"""Files a run reads and writes, checked without torch so `moeplan run` refuses them at once.

Token files: a flat `.bin` of uint16/uint32 ids with a `.json` sidecar (docs/DATA.md).

Checkpoint directories (docs/RUNTIME.md, "Checkpoints"): `CKPT/step_00000042/` holds the
`torch.distributed.checkpoint` files, `plan.json`, `meta.json` and, written last, `manifest.json`
(size and SHA-256 of every other file). A step directory is written under a temporary name,
fsynced and renamed, so a crash leaves either nothing or a temporary directory, never a
half-written `step_*`; `latest` names the newest step and is replaced last. A `step_*` without
a manifest is incomplete and skipped; one whose files disagree with its manifest is corrupt and
refused by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np

from ..errors import SpecError

TOKEN_FORMAT = "moeplan-tokens-v1"
CKPT_FORMAT = "moeplan-ckpt-v2"  # v2: each rank writes its own boxes (runtime/checkpoint.py)
TOKEN_DTYPES = ("uint16", "uint32")
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP = re.compile(r"^step_(\d{8})$")


# ------------------------------------------------------------------------------- token files
def sidecar_path(path: str | Path) -> Path:
    """`corpus.bin` → `corpus.json`: the sidecar naming dtype, token count and vocabulary."""
    return Path(path).with_suffix(".json")


def check_token_file(path: str | Path, vocab_size: int, seq_len: int) -> dict:
    """Validate a token file against the model before any worker starts; return its sidecar.

    Checked: the sidecar exists and names a known format and dtype, the `.bin` holds exactly
    `num_tokens` tokens of that dtype (a truncated copy is caught), the corpus has room for one
    sequence, and every token id is below the model's vocabulary (scanned in chunks, so a
    corpus tokenized for a larger vocabulary is refused instead of indexing out of range).
    """
    path = Path(path)
    side = sidecar_path(path)
    if not path.is_file():
        raise SpecError(f"--data {path}: no such token file (give a .bin written by "
                        "`python -m moeplan.runtime.data`, or 'synthetic').")
    if not side.is_file():
        raise SpecError(f"--data {path}: the sidecar {side} is missing (it names the dtype, "
                        "token count and vocabulary).")
    try:
        meta = json.loads(side.read_text())
        dtype, n = meta["dtype"], int(meta["num_tokens"])
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError(f"--data {path}: the sidecar {side} is not valid ({e}).") from None
    if meta.get("format") != TOKEN_FORMAT or dtype not in TOKEN_DTYPES:
        raise SpecError(f"--data {path}: the sidecar {side} says format {meta.get('format')!r}, "
                        f"dtype {dtype!r}; expected {TOKEN_FORMAT} with dtype uint16 or uint32.")
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size != n * item:
        raise SpecError(f"--data {path}: the file has {size} bytes but the sidecar promises "
                        f"{n} {dtype} tokens ({n * item} bytes); it is truncated or does not "
                        "match its sidecar.")
    if n < seq_len + 1:
        raise SpecError(f"--data {path}: {n} tokens cannot fill one sequence of "
                        f"seq_len + 1 = {seq_len + 1}.")
    if int(meta.get("vocab_size", 0)) > vocab_size:
        raise SpecError(f"--data {path}: tokenized for a vocabulary of {meta['vocab_size']}, "
                        f"larger than the model's {vocab_size}.")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, n, 1 << 24):
        top = int(tokens[start: start + (1 << 24)].max())
        if top >= vocab_size:
            raise SpecError(f"--data {path}: token id {top} (near token {start}) is outside "
                            f"the model's vocabulary of {vocab_size}.")
    return meta


# ------------------------------------------------------------------------ checkpoint folders
def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:08d}"


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


def publish(tmp: Path, final: Path, keep: int) -> None:
    """Seal a fully written temporary step directory: manifest, fsync, rename, `latest`, prune.

    Called by one process once every rank's files are in `tmp`. An existing `final` is never
    replaced (the temporary one is dropped instead).
    """
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                for p in files}
    for p in files:
        _fsync(p)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(tmp)
        return
    os.rename(tmp, final)
    _fsync(final.parent)
    pointer = final.parent / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    _fsync(pointer)
    os.replace(pointer, final.parent / LATEST)
    _fsync(final.parent)
    if keep > 0:
        for old in complete_steps(final.parent)[:-keep]:
            shutil.rmtree(step_dir(final.parent, old), ignore_errors=True)


def complete_steps(ckpt_dir: str | Path) -> list[int]:
    """Steps with a sealed (manifest-bearing) directory, oldest first; others are skipped."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP.match(p.name))]
    return sorted(s for s in steps if (step_dir(root, s) / MANIFEST).is_file())


def verify(path: Path) -> None:
    """Check every file of a sealed step directory against its manifest; name the bad one."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except ValueError:
        raise SpecError(f"checkpoint {path}: {path / MANIFEST} is corrupt.") from None
    for rel, want in manifest.items():
        f = path / rel
        if not f.is_file():
            raise SpecError(f"checkpoint {path}: {f} is missing.")
        if f.stat().st_size != want["bytes"]:
            raise SpecError(f"checkpoint {path}: {f} has {f.stat().st_size} bytes, the manifest "
                            f"says {want['bytes']} (truncated).")
        if _sha256(f) != want["sha256"]:
            raise SpecError(f"checkpoint {path}: {f} does not match its checksum (corrupt).")
    check_index(path / ".metadata")


class _Inert:
    """Stands in for every class an index names: accepts any arguments and state, runs nothing."""

    def __new__(cls, *_args: object, **_kw: object) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *_args: object, **_kw: object) -> None:
        pass

    def __setstate__(self, _state: object) -> None:
        pass


class _IndexUnpickler(pickle.Unpickler):
    """Reads DCP's `.metadata` (a pickle) without importing or calling anything: each global
    must be one of the names a DCP index is made of, and is replaced by an inert stand-in."""

    def find_class(self, module: str, name: str) -> type:
        if module in _INDEX_MODULES or (module, name) in _INDEX_NAMES or (
                module == "torch" and name in _DTYPES):
            return _Inert
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


_INDEX_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_INDEX_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}
_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
           "uint8", "bool", "float8_e4m3fn", "float8_e5m2"}


def check_index(path: Path) -> None:
    """Refuse a DCP index holding anything but DCP metadata, before DCP unpickles it (DCP
    reads `.metadata` with plain pickle; this check keeps loading from running code)."""
    try:
        with open(path, "rb") as f:
            _IndexUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as e:
        raise SpecError(f"checkpoint {path.parent}: {path} is not a plain checkpoint index "
                        f"({e}); refusing to load it.") from None


def newest_checkpoint(ckpt_dir: str | Path, check: bool = True) -> Path | None:
    """The newest complete step directory (verified against its manifest), or None."""
    steps = complete_steps(ckpt_dir)
    if not steps:
        return None
    path = step_dir(ckpt_dir, steps[-1])
    if check:
        verify(path)
    return path
