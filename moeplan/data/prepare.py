"""`moeplan data prepare`: text or JSONL → a Megatron indexed dataset (PREFIX.bin + .idx).

What Megatron-LM's `tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer
--append-eod` does, for one key, with the tokenizer run by the `tokenizers` library itself:

- inputs: `.jsonl` / `.json` files hold one JSON object per line and the document is its
  `--json-key` (default `text`); any other file is UTF-8 text, one document per file, per
  line or per paragraph (`--document-per`);
- each document becomes one sequence of its token ids followed by the end-of-document token
  (`--no-append-eod` leaves it off); empty documents are skipped;
- the token dtype is Megatron's: uint16 for vocabularies below 65,500, int32 above.

Work is spread over `--workers` processes (each loads the tokenizer once; `spawn`, so no
tokenizer thread pool is forked): the reader cuts the input into batches of whole documents of
about BATCH_BYTES, the workers encode them, and the writer appends their ids in input order, so
the output does not depend on the number of workers and each document's ids are exactly what
the tokenizer gives for it (a document is never cut: where a cut falls would change the ids).
A document is at most MAX_DOCUMENT_BYTES; a larger text file is split with `--document-per
paragraph` or `line`. The two files appear atomically (`indexed.IndexedWriter`). No torch.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import limits
from ..errors import SpecError
from ..fsio import file_problem, loads_json
from .indexed import IndexedWriter, token_dtype
from .tokenizer import load_tokenizer

BATCH_BYTES = 4 << 20  # text handed to a worker at once
BATCH_ITEMS = 512
MAX_DOCUMENT_BYTES = 256 << 20  # one document (a JSONL line, a text file) at most
DOCUMENT_PER = ("file", "line", "paragraph")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")

Progress = Callable[[int, int, int, int], None]  # bytes done, bytes total, documents, tokens


@dataclass(frozen=True)
class PrepareResult:
    prefix: str
    documents: int
    tokens: int
    dtype: str
    vocab_size: int
    eod_token: str | None
    seconds: float

    def record(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ----------------------------------------------------------------------------- reading
MAGIC = {b"\x1f\x8b": ".gz", b"\x28\xb5\x2f\xfd": ".zst", b"PAR1": ".parquet",
         b"\x93NUMPY": ".npy", b"ARROW1": ".arrow"}
"""The first bytes of the packed formats PACKED_SUFFIXES names, whatever the file is called."""


def _packed(path: Path) -> str | None:
    """Why `path` is a compressed or binary format rather than text (by its name or its first
    bytes), with what to do instead; None for anything else."""
    from .corpus import PACKED_SUFFIXES

    kind = next((k for k in PACKED_SUFFIXES if path.name.lower().endswith(k)), None)
    if kind is None:
        try:
            with open(path, "rb") as f:
                head = f.read(8)
        except OSError:
            return None
        kind = next((k for magic, k in MAGIC.items() if head.startswith(magic)), None)
    return None if kind is None else f"is a {kind} file, not text: {PACKED_SUFFIXES[kind]}"
def _documents(path: Path, json_key: str, document_per: str) -> Iterator[tuple[str, int]]:
    """(document text, bytes of input consumed so far) of one input file."""
    is_json = path.suffix.lower() in JSON_SUFFIXES
    done = 0
    try:
        with open(path, "rb") as f:
            if not is_json and document_per == "file":
                size = path.stat().st_size
                if size > MAX_DOCUMENT_BYTES:
                    raise SpecError(f"{path}: {size:,} bytes is more than one document may be "
                                    f"({MAX_DOCUMENT_BYTES:,}); split it with --document-per "
                                    "paragraph or line.")
                raw = f.read()
                yield _decode(raw, path, None), len(raw)
                return
            paragraph: list[str] = []
            number = 0
            # each line read to at most the bound plus one byte: a file with no newline in its
            # gigabytes is refused without holding them
            while raw := f.readline(MAX_DOCUMENT_BYTES + 1):
                number += 1
                done += len(raw)
                if len(raw) > MAX_DOCUMENT_BYTES:
                    raise SpecError(f"{path}:{number}: a line of more than "
                                    f"{MAX_DOCUMENT_BYTES:,} bytes, more than a document may "
                                    "have; split it into lines of one document each.")
                line = _decode(raw, path, number)
                if is_json:
                    if line.strip():
                        yield _json_text(line, path, number, json_key), done
                elif document_per == "line":
                    yield line.rstrip("\r\n"), done
                elif line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "".join(paragraph).rstrip("\r\n"), done
                    paragraph = []
            if paragraph:
                yield "".join(paragraph).rstrip("\r\n"), done
    except OSError as err:
        raise SpecError(f"cannot read {path}: {err.strerror}.") from None


def _decode(raw: bytes, path: Path, line: int | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        where = f"{path}:{line}" if line else f"{path} (byte {err.start:,})"
        raise SpecError(f"{where} is not UTF-8 text; convert it (e.g. iconv -t UTF-8) or "
                        "check the path.") from None


def _json_text(line: str, path: Path, number: int, key: str) -> str:
    try:
        record = loads_json(line)  # a key given twice, NaN or nesting past the parser: refused
    except ValueError as err:
        raise SpecError(f"{path}:{number} is not a JSON object ({limits.clip(str(err), 80)}); "
                        "a .jsonl input holds one object per line.") from None
    if not isinstance(record, dict) or key not in record:
        keys = ", ".join(map(str, list(record)[:5])) if isinstance(record, dict) else "none"
        raise SpecError(f"{path}:{number} has no {key!r} field (its keys: {keys}); name the "
                        "text field with --json-key.")
    text = record[key]
    if not isinstance(text, str):
        raise SpecError(f"{path}:{number}: {key!r} is {type(text).__name__}, not text.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate escape ("\ud800") decodes, but no
        # tokenizer takes it
        raise SpecError(f"{path}:{number}: {key!r} holds {err.object[err.start]!r} at character "
                        f"{err.start:,}, a lone surrogate escape that is not Unicode text; "
                        "repair or drop that line.") from None
    return text


def _batches(inputs: list[Path], json_key: str, document_per: str
             ) -> Iterator[tuple[list[str], int]]:
    """Batches of documents for the workers, with the input bytes read when each was cut."""
    before, batch, size = 0, [], 0
    for path in inputs:
        for text, done in _documents(path, json_key, document_per):
            if not text:
                continue  # an empty document is skipped; one whose text encodes to no token
                # too (below), as Megatron's preprocess_data.py keeps any with a token
            batch.append(text)
            size += len(text)
            if size >= BATCH_BYTES or len(batch) >= BATCH_ITEMS:
                yield batch, before + done
                batch, size = [], 0
        before += path.stat().st_size
    if batch:
        yield batch, before


# ----------------------------------------------------------------------------- encoding
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: str, eod_token: str | None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _WORKER["tok"] = load_tokenizer(tokenizer, eod_token=eod_token)[0]


def _encode(batch: list[str]) -> list[np.ndarray]:
    encodings = _WORKER["tok"].encode_batch(batch, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


def prepare(inputs: list[str | Path], tokenizer: str | Path, out: str | Path,
            json_key: str = "text", workers: int = 1, append_eod: bool = True,
            eod_token: str | None = None, document_per: str = "file",
            progress: Progress | None = None) -> PrepareResult:
    """Tokenize `inputs` into OUT.bin / OUT.idx (see the module docstring)."""
    start = time.perf_counter()
    if not inputs:
        raise SpecError("give at least one input file (text or JSONL).")
    if document_per not in DOCUMENT_PER:
        raise SpecError(f"--document-per {limits.excerpt(document_per)}: one of "
                        f"{', '.join(DOCUMENT_PER)}.")
    if not 1 <= workers <= limits.max_cpu_procs():
        raise SpecError(f"--workers {workers}: between 1 and {limits.max_cpu_procs()} on this "
                        "machine.")
    paths = [Path(p) for p in inputs]
    for p in paths:
        problem = file_problem(p) or _packed(p)
        if problem is not None:
            raise SpecError(f"input {limits.clip(str(p))} {problem}; give text or JSONL files.")
    prefix = str(out)
    for suffix in (".bin", ".idx"):
        prefix = prefix.removesuffix(suffix)
    if not Path(prefix).name or prefix.endswith(("/", os.sep)) or Path(prefix).is_dir():
        raise SpecError(f"-o {limits.clip(str(out))}: give a prefix, not a directory "
                        f"(PREFIX.bin and PREFIX.idx are written; e.g. "
                        f"{limits.clip(str(Path(prefix) / 'corpus'))}).")
    _, info = load_tokenizer(tokenizer, eod_token=eod_token)
    if append_eod and info.eod_id is None:
        raise SpecError(f"--tokenizer-model {info.file}: no end-of-document token found (none "
                        "of its tokenizer_config.json eos_token or the usual names); name it "
                        "with --eod-token TOKEN, or pass --no-append-eod.")
    dtype = token_dtype(info.vocab_size)
    total = sum(p.stat().st_size for p in paths)
    writer = IndexedWriter(prefix, dtype)
    eod = np.array([info.eod_id] if append_eod else [], dtype=np.int64)
    docs, tokens = 0, 0
    pool = None
    try:
        batches = _batches(paths, json_key, document_per)
        if workers > 1:
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_init_worker,
                                       initargs=(str(tokenizer), eod_token))
        else:
            _init_worker(str(tokenizer), eod_token)
        for _, ids, at in _encoded(batches, pool, 2 * workers):
            for doc in ids:
                if doc.size:
                    doc = np.concatenate([doc, eod])
                    writer.add_document(doc)
                    docs += 1
                    tokens += doc.size
            if progress:
                progress(at, total, docs, tokens)
        if docs == 0:
            raise SpecError("the inputs hold no document with text; nothing to write.")
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    writer.finish()
    if progress:
        progress(total, total, docs, tokens)
    return PrepareResult(prefix, docs, tokens, dtype.name, info.vocab_size, info.eod_token
                         if append_eod else None, time.perf_counter() - start)


def _encoded(batches: Iterator[tuple[list[str], int]], pool: Any, ahead: int
             ) -> Iterator[tuple[list[str], list[np.ndarray], int]]:
    """(batch, its ids, bytes read) in input order; with a pool, at most `ahead` batches are
    in flight, so memory stays bounded whatever the input size."""
    if pool is None:
        for batch, at in batches:
            yield batch, _encode(batch), at
        return
    flight: collections.deque = collections.deque()
    for batch, at in batches:
        flight.append((batch, pool.submit(_encode, batch), at))
        if len(flight) >= ahead:
            done, result, read = flight.popleft()
            yield done, _result(result), read
    while flight:
        done, result, read = flight.popleft()
        yield done, _result(result), read


def _result(future: Any) -> list[np.ndarray]:
    """A worker's ids; a pool whose process died is an error, never a hang."""
    try:
        return future.result()
    except BrokenProcessPool:
        raise SpecError("a tokenizer worker process died (out of memory, or killed); rerun "
                        "with fewer --workers.") from None


# ----------------------------------------------------------------------------- progress
class ProgressLine:
    """Progress on stderr: one updating bar on a terminal (rich), plain lines every few
    seconds (and at the end) when stderr is a file or a pipe."""

    def __init__(self, label: str, every_s: float = 5.0):
        self.label, self.every_s, self.last = label, every_s, 0.0
        self.said_final: tuple[int, int] | None = None  # the 100% line's counts, once said
        self.live = None
        if sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.live = Progress(TextColumn(label), BarColumn(), DownloadColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                 transient=False)
            self.task = self.live.add_task(label, total=None, info="")
            self.live.start()

    def __call__(self, done: int, total: int, docs: int, tokens: int) -> None:
        info = f"{docs:,} documents, {tokens:,} tokens"
        if self.live is not None:
            self.live.update(self.task, completed=done, total=total, info=info)
            return
        now = time.monotonic()
        final = done >= total
        if final and self.said_final == (docs, tokens):
            return  # the last batch reached the end; the end itself is said once
        if final or now - self.last >= self.every_s:
            self.last = now
            if final:
                self.said_final = (docs, tokens)
            pct = 100.0 * done / total if total else 100.0
            print(f"{self.label}: {pct:.0f}% ({done / 1e6:,.1f} of {total / 1e6:,.1f} MB), "
                  f"{info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
