"""Atomic file writes and strict JSON, for every file and document the CLI produces.

Why atomic: `-o plan.json` on a full disk, a crash or a Ctrl-C mid-write must leave either the
old file or the new one, never a truncated mix. The bytes go to a temporary name in the target's
directory (same filesystem, so the rename is atomic), are fsynced, renamed over the target with
`os.replace`, and the directory is fsynced so the rename itself survives a power cut.

Why strict JSON: Python's `json` writes `NaN`/`Infinity` by default, which no other JSON parser
accepts; a document we emit must load anywhere.

No torch: the planner and the CLI import this.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import MoeplanError, SpecError


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


def _fsync_dir(directory: Path) -> None:
    """Persist a rename; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_file_mode(target: Path) -> int:
    """The mode `open(target, "w")` would give: the existing file's, else 0o666 minus umask."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def is_file(path: str | Path) -> bool:
    """`Path.is_file`, but False (not an exception) for names the OS refuses outright
    (too long, embedded NUL), so a hostile argument is "not a file", never a traceback."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def check_writable(path: str | Path) -> Path:
    """Refuse (SpecError) a target that cannot be written: a directory, or a file in a missing
    directory. Called before long work so that `-o` mistakes surface at once."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        if target.is_dir():
            raise SpecError(f"cannot write {target}: it is a directory. Give a file name "
                            f"(e.g. {target / 'out.json'}).")
        if not directory.is_dir():
            raise SpecError(f"cannot write {target}: the directory {directory} does not exist "
                            "(or is not a directory). Create it first or choose another path.")
        if target.exists() and not os.access(target, os.W_OK):
            raise SpecError(f"cannot write {target}: the file is read-only. Make it writable "
                            "or choose another path.")
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise SpecError(f"cannot write {target}: {reason}. Choose another path.") from None
    return target


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically; raise SpecError (exit 2) naming the path and reason.

    On any failure the previous file at `path` is untouched and no temporary file remains.
    """
    target = check_writable(path)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as err:
        raise SpecError(f"cannot write {target}: {_reason(err)} (in {directory}). Choose a "
                        "writable location.") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _new_file_mode(target))
        os.replace(tmp, target)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise SpecError(f"cannot write {target}: {_reason(err)}. The previous file, if any, is "
                        "unchanged; free space or choose another path.") from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(directory)
    return target


def atomic_write_text(path: str | Path, text: str) -> Path:
    """`atomic_write_bytes` for UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def strict_dumps(data: Any, indent: int | None = 2) -> str:
    """JSON text with NaN and infinities refused, so any JSON parser reads what we write.

    Inputs are checked for non-finite numbers at the door (specs, flags, CSV cells); one that
    still turns up here is a bug, reported as an error rather than written as `NaN`.
    """
    try:
        return json.dumps(data, indent=indent, allow_nan=False)
    except ValueError as err:
        raise MoeplanError(f"the result holds a non-finite number (NaN or infinity) and cannot "
                           f"be written as JSON ({err}); please report this with the command "
                           "line.") from None


def finite_or_null(data: Any) -> Any:
    """`data` with every NaN/inf float replaced by None, for measurements that can legitimately
    be non-finite (the loss of a skipped step): JSON has no NaN, so it is recorded as null."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: finite_or_null(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_or_null(v) for v in data]
    return data


def write_json(path: str | Path, data: Any, indent: int | None = 2) -> Path:
    """Strict JSON, written atomically."""
    return atomic_write_text(path, strict_dumps(data, indent) + "\n")
