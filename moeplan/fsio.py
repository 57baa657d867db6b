"""Atomic file writes, bounded reads of regular files and strict JSON, for every file the CLI
reads or produces.

Why atomic: `-o plan.json` on a full disk, a crash or a Ctrl-C mid-write must leave either the
old file or the new one, never a truncated mix. The bytes go to a temporary name in the target's
directory (same filesystem, so the rename is atomic), are fsynced, renamed over the target with
`os.replace`, and the directory is fsynced so the rename itself survives a power cut.

Why strict JSON: Python's `json` writes `NaN`/`Infinity` by default, which no other JSON parser
accepts; a document we emit must load anywhere.

Why one reader (`read_regular`): a hostile path can name a named pipe (opening it waits for a
writer forever), `/dev/zero` (its size says 0 and it never ends) or a link to either. Every read
opens without blocking, checks on the open descriptor that it is a regular file (after the
links are resolved, or refusing links where they have no business), and reads at most the
limit plus one byte, whatever the file claims about its size.

No torch: the planner and the CLI import this.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from .errors import MoeplanError, SpecError
from .limits import clip


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


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class FileRefused(SpecError):
    """A file that cannot be read as asked: `reason` says why in a few words ("is a named
    pipe, not a regular file"), so callers can put it into their own paragraph; `kind` is
    "unreadable" (missing, no permission: `reason` is the OS's), "type" (not a regular file,
    or a link where none may be) or "size" (above the limit)."""

    def __init__(self, path: str | Path, reason: str, kind: str = "type"):
        self.path, self.reason, self.kind = Path(path), reason, kind
        said = f"cannot be read ({reason})" if kind == "unreadable" else reason
        super().__init__(f"{path} {said}; give a regular file.")


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def file_problem(path: str | Path) -> str | None:
    """Why `path` is not a regular file one could read, in a few words ("does not exist", "is
    a directory, not a regular file"), or None when it is one: a directory, a device or a pipe
    given for a file is said as such, not reported missing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except (OSError, ValueError) as err:
        return _reason(err) if isinstance(err, OSError) else "is not a usable file name"
    return None if stat.S_ISREG(mode) else f"is {_kind(mode)}, not a regular file"


def open_regular(path: str | Path, follow_links: bool = True) -> int:
    """A file descriptor open for reading on `path`, which must be a regular file.

    The open never blocks (O_NONBLOCK: a named pipe opens at once instead of waiting for a
    writer) and the type is checked on the descriptor itself, after any links are resolved, so
    nothing can be swapped in between the check and the read. `follow_links=False` refuses a
    link as the last path component (a checkpoint's files are never links). Raises FileRefused.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP and not follow_links:
            raise FileRefused(path, "is a symbolic link, not a regular file") from None
        raise FileRefused(path, _reason(err), "unreadable") from None
    except ValueError:  # an embedded NUL
        raise FileRefused(path, "is not a usable file name", "unreadable") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileRefused(path, f"is {_kind(mode)}, not a regular file")
    return fd


def read_regular(path: str | Path, limit: int, follow_links: bool = True) -> bytes:
    """The bytes of the regular file `path`, refused (FileRefused) above `limit` bytes.

    At most `limit` + 1 bytes are ever read, whatever the file's size says (a /proc file says
    0; a link to /dev/zero is refused as a device before any read)."""
    fd = open_regular(path, follow_links)
    try:
        chunks, size = [], 0
        while size <= limit:
            block = os.read(fd, min(1 << 20, limit + 1 - size))
            if not block:
                break
            chunks.append(block)
            size += len(block)
    except OSError as err:
        raise FileRefused(path, _reason(err), "unreadable") from None
    finally:
        os.close(fd)
    if size > limit:
        raise FileRefused(path, f"is larger than the limit of {limit:,} bytes for this kind "
                          "of file", "size")
    return b"".join(chunks)


def append_text(path: str | Path, text: str) -> None:
    """Append `text` to `path` (created if missing), never through a link and never into
    anything but a regular file: run outputs such as metrics.jsonl are appended to, and a link
    planted in their place would otherwise send the run's writes to a file outside --out."""
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise SpecError(f"{path} is a symbolic link; run outputs are never written through "
                            "a link. Remove it or choose another --out.") from None
        if err.errno == errno.ENXIO:  # a named pipe nobody reads
            raise SpecError(f"{path} is a named pipe, not a regular file; remove it or "
                            "choose another --out.") from None
        raise SpecError(f"cannot write {path}: {_reason(err)}. Free space or choose another "
                        "--out.") from None
    size = None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"{path} is {_kind(st.st_mode)}, not a regular file; remove it or "
                            "choose another --out.")
        size = st.st_size
        data = text.encode("utf-8")
        while data:
            data = data[os.write(fd, data):]
    except OSError as err:
        if size is not None:  # a record cut short (a full disk) would end the file mid-line
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
        raise SpecError(f"cannot write {path}: {_reason(err)}. Free space or choose another "
                        "--out.") from None
    finally:
        os.close(fd)


def check_writable(path: str | Path) -> Path:
    """Refuse (SpecError) a target that cannot be written: a directory, or a file in a missing
    directory. Called before long work so that `-o` mistakes surface at once."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        if not str(path).strip():
            raise SpecError("cannot write to an empty path. Give a file name (e.g. "
                            "out.json).")
        if target.is_dir():
            raise SpecError(f"cannot write {target}: it is a directory. Give a file name "
                            f"(e.g. {target / 'out.json'}).")
        mode = target.stat().st_mode if target.exists() else None
        if mode is not None and not stat.S_ISREG(mode):
            # the write renames a new file over the target: a device (/dev/null), a named
            # pipe or a socket would be replaced by a plain file
            raise SpecError(f"cannot write {target}: it is {_kind(mode)}, not a regular file, "
                            "and the write would replace it. Give the path of a regular file.")
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


def check_writable_dir(path: str | Path, flag: str) -> Path:
    """Refuse (SpecError naming `flag`) a directory a run could not write into: the directory,
    or the nearest of its parents that exists (it would be created there), must be a directory
    this process may write, on a file system mounted writable (access(2) says EROFS even to
    root). Nothing is created: a run's output directories are checked before any worker starts,
    not by the first write of rank 0 minutes later."""
    target = Path(path).absolute()
    existing = target
    try:
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            reason = f"{existing} is not a directory"
        elif not os.access(existing, os.W_OK | os.X_OK):
            reason = f"{existing} is not writable"
        else:
            return Path(path)
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    raise SpecError(f"{flag} {clip(str(path))}: cannot write there ({reason}). Choose a "
                    "writable directory. Nothing was run.")


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


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"a key appears twice in one object: `{clip(key)}`")
        seen.add(key)
    return dict(pairs)


def first_nonfinite(data: Any, where: str = "") -> str | None:
    """The dotted path of the first NaN/inf in a parsed document, or None."""
    stack: list[tuple[Any, str]] = [(data, where)]
    while stack:
        value, at = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return at or "(the document)"
        if isinstance(value, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))
    return None


class TooDeep(ValueError):
    """A JSON document nested past what the reader follows: a ValueError like every other
    refusal of `loads_json`, and a type of its own so a caller can say so in its own words
    without reading the message."""


def loads_json(text: str | bytes, allow_nonfinite: bool = False) -> Any:
    """JSON as every reader in moeplan parses it: an object with a repeated key is refused
    (Python's `json` keeps the last value silently), and so are NaN, Infinity and numbers
    that overflow to infinity (`1e999`), naming the field. Raises ValueError.

    `allow_nonfinite` leaves the non-finite values in, for a caller that names the field in
    its own words (the spec loader)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")  # UnicodeDecodeError is a ValueError
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise TooDeep("the document nests deeper than a JSON reader can follow; "
                         "flatten it") from None
    if not allow_nonfinite:
        bad = first_nonfinite(data)
        if bad is not None:
            raise ValueError(f"field `{bad}` is not a finite number (NaN or infinity)")
    return data


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
