"""Megatron's indexed dataset: `PREFIX.bin` (token ids) and `PREFIX.idx` (its index).

The format is megatron-core's (`megatron/core/datasets/indexed_dataset.py`, version 1), which
Megatron-LM's `tools/preprocess_data.py` writes and `IndexedDataset` reads; tested both ways
against megatron-core itself (`tests/test_data.py`):

    .idx  b"MMIDIDX\\x00\\x00"   9-byte magic
          <Q 1                  version
          <B code               token dtype: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                6 float64, 7 float32, 8 uint16
          <Q S                  sequence count
          <Q D                  document-index count (documents + 1)
          int32[S]              tokens per sequence
          int64[S]              byte offset of each sequence in the .bin
          int64[D]              document boundaries, as sequence indices: 0, ..., S
          [int8[S]]             per-sequence modes (multimodal datasets only; not read here)
    .bin  the sequences' token ids, back to back, in the .idx dtype

Reading is numpy only (no torch): the launcher checks a dataset before any worker starts and
`moeplan data prepare` writes one on a machine without torch. Nothing is read whole; the index
arrays and the tokens are memory-mapped. Every count, offset and size is checked against the
files' sizes before anything is indexed (`read_index`), so a truncated or forged pair is
refused by name instead of reading past the end or allocating what its header claims.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SpecError
from ..fsio import FileRefused, open_regular

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
# megatron.core.datasets.indexed_dataset.DType: code ↔ numpy dtype
DTYPE_CODES: dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.int8),
                                    3: np.dtype(np.int16), 4: np.dtype(np.int32),
                                    5: np.dtype(np.int64), 6: np.dtype(np.float64),
                                    7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
TOKEN_DTYPES = ("uint8", "uint16", "int16", "int32", "int64")  # float codes hold no token ids
CHECK_CHUNK = 1 << 22  # index entries checked per numpy pass (bounded memory on huge indexes)


def token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's preprocessing picks (`DType.optimal_dtype`): uint16 below
    65,500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def paths(prefix: str | Path) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx), as Megatron's `get_bin_path` / `get_idx_path`."""
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


@dataclass(frozen=True)
class Index:
    """A checked .idx, its arrays memory-mapped."""

    prefix: str
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 (S,)
    sequence_pointers: np.ndarray  # int64 (S,), bytes into the .bin
    document_indices: np.ndarray  # int64 (D,), sequence boundaries of documents: 0 ... S
    num_tokens: int

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.shape[0]) - 1

    def token_offset(self, sequence: int) -> int:
        """Tokens before `sequence` in the .bin (sequences are contiguous, `read_index`)."""
        if sequence >= self.num_sequences:
            return self.num_tokens
        return int(self.sequence_pointers[sequence]) // self.dtype.itemsize


def _refuse(prefix: str | Path, why: str) -> SpecError:
    return SpecError(f"--data {prefix}: {why}. It is not a Megatron indexed dataset this "
                     "moeplan can read; rewrite it with `moeplan data prepare` (or Megatron's "
                     "tools/preprocess_data.py).")


def _dtype_blame(prefix: str | Path, idx_path: Path, dtype: np.dtype, pointer: int,
                 tokens: int) -> None:
    """Refuse, naming the dtype, an index whose pointers step by another token size than its
    dtype code says: `pointer` is where a sequence starts, after `tokens` tokens, so a pointer
    of `tokens` × k bytes for another token size k is a wrong dtype code, not a layout moeplan
    cannot read."""
    if tokens <= 0:
        return
    for name in TOKEN_DTYPES:
        other = np.dtype(name)
        if other.itemsize != dtype.itemsize and pointer == tokens * other.itemsize:
            raise _refuse(prefix, f"{idx_path}'s dtype code says {dtype.name} tokens "
                                  f"({dtype.itemsize} bytes), but its sequence pointers step "
                                  f"by {other.itemsize} bytes a token, as {other.name} would; "
                                  "the index's dtype code does not match its .bin")


def read_index(prefix: str | Path) -> Index:
    """The checked index of PREFIX.idx / PREFIX.bin.

    Checked before any array is used: magic and version; an integer token dtype; the .idx size
    is exactly what its counts imply (with or without the multimodal modes); document
    boundaries start at 0, never decrease and end at the sequence count; lengths are
    non-negative and each sequence starts where the previous one ended (so a split is one
    contiguous token range); and the .bin holds exactly the tokens the index describes.
    """
    bin_path, idx_path = paths(prefix)
    try:  # regular files only, checked without blocking (a named pipe is refused, not waited on)
        fd = open_regular(bin_path)
        bin_size = os.fstat(fd).st_size
        os.close(fd)
        fd = open_regular(idx_path)
        try:
            idx_size, head = os.fstat(fd).st_size, os.read(fd, HEADER_BYTES)
        finally:
            os.close(fd)
    except FileRefused as err:
        raise SpecError(f"--data {prefix}: {err.path} {err.reason}.") from None
    except OSError as err:
        raise SpecError(f"--data {prefix}: cannot read {err.filename}: {err.strerror}.") from None
    if len(head) < HEADER_BYTES or head[:9] != MAGIC:
        raise _refuse(prefix, f"{idx_path} does not start with Megatron's index magic "
                              f"{MAGIC!r}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != VERSION:
        raise _refuse(prefix, f"{idx_path} is index version {version}, not {VERSION}")
    dtype = DTYPE_CODES.get(code)
    if dtype is None or dtype.name not in TOKEN_DTYPES:
        raise _refuse(prefix, f"{idx_path} names token dtype code {code} "
                              f"({dtype.name if dtype is not None else 'unknown'}); token ids "
                              f"are stored as one of {', '.join(TOKEN_DTYPES)}")
    plain = HEADER_BYTES + 12 * n_seq + 8 * n_doc
    if idx_size not in (plain, plain + n_seq):  # + int8 modes when multimodal
        raise _refuse(prefix, f"{idx_path} is {idx_size:,} bytes but its header promises "
                              f"{n_seq:,} sequences and {n_doc:,} document boundaries "
                              f"({plain:,} bytes); it is truncated or not an index")
    if n_doc < 1:
        raise _refuse(prefix, f"{idx_path} has no document boundaries")
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = raw[HEADER_BYTES: HEADER_BYTES + 4 * n_seq].view(np.int32)
    pointers = raw[HEADER_BYTES + 4 * n_seq: HEADER_BYTES + 12 * n_seq].view(np.int64)
    docs = raw[HEADER_BYTES + 12 * n_seq: plain].view(np.int64)
    if int(docs[0]) != 0 or int(docs[-1]) != n_seq:
        raise _refuse(prefix, f"{idx_path}'s document boundaries run from {int(docs[0])} to "
                              f"{int(docs[-1])}, not from 0 to the {n_seq:,} sequences")
    item, total = dtype.itemsize, 0
    for lo in range(0, max(n_doc - 1, 0), CHECK_CHUNK):  # document boundaries never decrease
        d = docs[lo: lo + CHECK_CHUNK + 1]
        if (np.diff(d) < 0).any():
            raise _refuse(prefix, f"{idx_path}'s document boundaries decrease near document "
                                  f"{lo + int(np.argmax(np.diff(d) < 0))}")
    for lo in range(0, n_seq, CHECK_CHUNK):  # contiguous: pointer = Σ earlier lengths · item
        ln = lengths[lo: lo + CHECK_CHUNK].astype(np.int64)
        if (ln < 0).any():
            raise _refuse(prefix, f"{idx_path} gives sequence {lo + int(np.argmax(ln < 0))} a "
                                  "negative length")
        expect = (total + np.concatenate(([0], np.cumsum(ln)[:-1]))) * item
        bad = pointers[lo: lo + CHECK_CHUNK] != expect
        if bad.any():
            i = lo + int(np.argmax(bad))
            if i:
                _dtype_blame(prefix, idx_path, dtype, int(pointers[i]), total + int(ln[: i - lo].sum()))
            where = f"where sequence {i - 1} ends" if i else "at byte 0"
            raise _refuse(prefix, f"{idx_path}: sequence {i} starts at byte "
                                  f"{int(pointers[i]):,}, not {where}; moeplan reads "
                                  "sequences stored back to back")
        total += int(ln.sum())
    if bin_size != total * item:
        raise SpecError(f"--data {prefix}: {bin_path} is {bin_size:,} bytes but its index "
                        f"describes {total:,} {dtype.name} tokens ({total * item:,} bytes); the "
                        ".bin is truncated or belongs to another index. Copy the pair again or "
                        "rerun `moeplan data prepare`.")
    return Index(str(prefix), dtype, lengths, pointers, docs, total)


def open_tokens(index: Index) -> np.ndarray:
    """The .bin as one flat memory-mapped token array (a zero-length file maps to nothing)."""
    if index.num_tokens == 0:
        return np.zeros(0, dtype=index.dtype)
    return np.memmap(paths(index.prefix)[0], dtype=index.dtype, mode="r")


# ------------------------------------------------------------------------------- writing
class IndexedWriter:
    """Write PREFIX.bin/.idx as Megatron's `IndexedDatasetBuilder` does, one document at a time,
    and appear atomically: both files go to temporary names in the target directory and are
    fsynced, then the .bin and last the .idx are renamed into place (a reader never sees a new
    index over an old .bin: `read_index` would refuse the size mismatch anyway)."""

    def __init__(self, prefix: str | Path, dtype: np.dtype | str):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        if self.dtype not in CODE_OF or self.dtype.name not in TOKEN_DTYPES:
            raise SpecError(f"token dtype {self.dtype.name} is not one Megatron stores token "
                            f"ids in ({', '.join(TOKEN_DTYPES)}).")
        self.bin_path, self.idx_path = paths(prefix)
        directory = self.bin_path.parent
        if not directory.is_dir():
            raise SpecError(f"-o {prefix}: the directory {directory} does not exist; create "
                            "it first.")
        tag = uuid.uuid4().hex[:8]
        self._tmp_bin = directory / f".{self.bin_path.name}.tmp-{tag}"
        self._tmp_idx = directory / f".{self.idx_path.name}.tmp-{tag}"
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 (closed in finish/abort)
        self.lengths: list[int] = []
        self.documents: list[int] = [0]
        self.num_tokens = 0

    def add_document(self, tokens: np.ndarray) -> None:
        """One document as one sequence (Megatron's `add_item` + `end_document`)."""
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < np.iinfo(self.dtype).min or arr.max() > np.iinfo(
                self.dtype).max):
            raise SpecError(f"token id {int(arr.max())} does not fit {self.dtype.name}.")
        if arr.size > np.iinfo(np.int32).max:
            raise SpecError(f"a document of {arr.size:,} tokens is longer than the index's "
                            "int32 sequence lengths allow; split it.")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self.lengths.append(int(arr.size))
        self.documents.append(len(self.lengths))
        self.num_tokens += int(arr.size)

    def _index_bytes(self) -> bytes:
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        return b"".join([MAGIC, struct.pack("<Q", VERSION),
                         struct.pack("<B", CODE_OF[self.dtype]),
                         struct.pack("<Q", len(lengths)), struct.pack("<Q", len(self.documents)),
                         lengths.tobytes(), pointers.tobytes(),
                         np.asarray(self.documents, dtype=np.int64).tobytes()])

    def finish(self) -> tuple[Path, Path]:
        """Seal: fsync both files, rename the .bin then the .idx into place."""
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            with open(self._tmp_idx, "wb") as f:
                f.write(self._index_bytes())
                f.flush()
                os.fsync(f.fileno())
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(self._tmp_idx, self.idx_path)
            with contextlib.suppress(OSError):
                fd = os.open(self.bin_path.parent, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as err:
            self.abort()
            raise SpecError(f"-o {self.prefix}: cannot write the dataset ({err.strerror}).") \
                from None
        return self.bin_path, self.idx_path

    def abort(self) -> None:
        """Drop the temporary files (a failed or interrupted write leaves nothing)."""
        with contextlib.suppress(OSError):
            self._bin.close()
        for tmp in (self._tmp_bin, self._tmp_idx):
            with contextlib.suppress(OSError):
                tmp.unlink()


def write_documents(prefix: str | Path, documents, dtype: np.dtype | str) -> tuple[Path, Path]:
    """Write `documents` (arrays of token ids) as one indexed dataset, atomically."""
    writer = IndexedWriter(prefix, dtype)
    try:
        for doc in documents:
            writer.add_document(doc)
    except BaseException:
        writer.abort()
        raise
    return writer.finish()
