"""`--data` and `--split`: Megatron blends of indexed datasets, cut into training windows.

What a user writes is Megatron's: `--data "0.7 a 0.3 b"` is `--data-path`'s flattened list of
weights and prefixes (`megatron.core.datasets.utils.get_blend_from_list`; without weights, the
prefixes alone), and `--split 969,30,1` is `--split` (`parse_and_normalize_split`). Each dataset
is split by sequence as Megatron's GPT datasets are (`round(fraction × sequences)` bounds), so a
split holds the same sequences in both.

How samples are drawn is ours, chosen so a step's batch is a pure function of (seed, step), the
same under every plan and after any restart, with O(1) memory at any corpus size:

- a dataset's split is one contiguous token range (sequences are stored back to back), cut into
  windows of seq + 1 tokens at stride seq (every token is a target once per epoch; documents
  stay in file order and windows cross their end-of-document tokens, as Megatron's do);
- sample k of a dataset is window `perm(k mod W)` of epoch `k div W`, where `perm` is a
  seeded Feistel permutation of the W windows drawn anew per epoch (a bijection computed per
  index: nothing of size W is ever held, unlike a stored shuffle);
- global sample g is assigned to a dataset, and to its sample index there, by splitting the
  sample stream at each node of a balanced binary tree of the datasets in the ratio of its two
  sides' weights, Bresenham's way (the left side's share of the first n samples is
  round(r · n), exact integer arithmetic): a closed form per sample, as evenly interleaved as
  Megatron's rule (each sample to the dataset furthest below weight × samples so far), whose
  counts it matches within one sample per tree level, for every weight down to 2^-32 of its
  node, with no block to repeat and no state.

Global sample g of the training split is row g mod gbs of step g div gbs; the validation split
is read the same way from its own windows (evaluation batch i is samples i·gbs … i·gbs + gbs − 1).
numpy only: the launcher opens (and so checks) the corpus before any worker starts.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import limits
from ..errors import SpecError
from ..fsio import file_problem
from .indexed import Index, open_tokens, paths, read_index

SPLITS = ("train", "valid", "test")
DEFAULT_SPLIT = "969,30,1"  # Megatron-LM's default --split
RATIO_BITS = 32  # a tree node's weight ratio as an integer over 2^32 (a weight's resolution)
SAMPLER = "blend-tree/1"
"""How samples are drawn from a blend (module docstring), saved with each checkpoint: a resume
under another order would read other samples than the run it continues."""
MAX_DATASETS = 1024
SCAN_TOKENS = 1 << 28  # token ids checked per dataset before workers start (all: per sample)
TEXT_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".csv", ".tsv")
PACKED_SUFFIXES = {".gz": "decompress it (gunzip)", ".zst": "decompress it (zstd -d)",
                   ".parquet": "export its text column to JSONL (e.g. with pandas or duckdb)",
                   ".npy": "write its token ids as an indexed dataset "
                           "(moeplan.data.indexed.write_documents)",
                   ".arrow": "export its text column to JSONL (datasets' to_json)"}
"""Inputs `data prepare` cannot read, with what to do instead."""
HF_SAVED = ("dataset_info.json", "state.json", "dataset_dict.json")
"""The files `datasets`' `save_to_disk` writes beside its Arrow shards (a DatasetDict writes
dataset_dict.json and one such directory per split)."""
_MASK64 = (1 << 64) - 1


# ------------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and their weights (None: in proportion to their sizes)."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None


def _prefix(token: str) -> str:
    """A path as Megatron's prefix: `corpus`, `corpus.bin` and `corpus.idx` all name `corpus`."""
    for suffix in (".bin", ".idx"):
        if token.endswith(suffix):
            return token[: -len(suffix)]
    return token


def _is_dataset(prefix: str) -> bool:
    """Whether PREFIX.bin and PREFIX.idx are both files (a long blend is no path at all)."""
    try:
        return all(p.is_file() for p in paths(prefix))
    except (OSError, ValueError):
        return False


def parse_blend(text: str) -> Blend:
    """`--data "PREFIX"`, `"P1 P2 ..."` or `"W1 P1 W2 P2 ..."` (Megatron's --data-path). A
    value that names one dataset as a whole is that dataset, spaces in its path included
    (Megatron's shell-quoted --data-path word)."""
    whole = _prefix(str(text).strip())
    if any(c.isspace() for c in whole) and _is_dataset(whole):
        return Blend((whole,), None)
    tokens = str(text).split()
    if not tokens:
        raise SpecError("--data is empty; give a dataset prefix (PREFIX.bin + PREFIX.idx), a "
                        "blend \"0.7 PREFIX_A 0.3 PREFIX_B\", or 'synthetic'.")
    if len(tokens) > 2 * MAX_DATASETS:
        raise SpecError(f"--data names {len(tokens) // 2:,}+ datasets; at most {MAX_DATASETS:,} "
                        "can be blended.")

    def number(tok: str) -> float | None:
        try:
            return float(tok)
        except ValueError:
            return None

    pairs = len(tokens) % 2 == 0 and all(number(t) is not None for t in tokens[::2])
    if not pairs:
        if any(number(t) is not None and not Path(t).exists() for t in tokens):
            raise SpecError(f"--data {limits.clip(text)}: a blend is weight, prefix pairs "
                            "(\"0.7 PREFIX_A 0.3 PREFIX_B\"); this one has a weight without its "
                            "prefix, or a prefix where a weight belongs.")
        return Blend(tuple(_prefix(t) for t in tokens), None)
    weights = tuple(number(t) for t in tokens[::2])
    for w in weights:
        if w is None or not math.isfinite(w) or w < 0:
            raise SpecError(f"--data {limits.clip(text)}: blend weights must be finite and not "
                            f"negative, got {w}.")
    if sum(weights) <= 0:  # type: ignore[arg-type]
        raise SpecError(f"--data {limits.clip(text)}: the blend weights add up to 0; give at "
                        "least one positive weight.")
    return Blend(tuple(_prefix(t) for t in tokens[1::2]), weights)  # type: ignore[arg-type]


def data_key(data: str, split: str | None) -> tuple:
    """--data and --split as the samples they name: prefixes as absolute paths (relative to
    where the run is launched), weights and split normalised, so `969,30,1` and the default,
    `a.bin` and `./a`, `0.7 a 0.3 b` and `7 a 3 b` compare equal."""
    if str(data).strip() == "synthetic":  # takes no --split (settings.check_run_inputs)
        return "synthetic", None if split is None else parse_split(split)
    blend = parse_blend(data)
    where = tuple(os.path.normpath(os.path.abspath(p)) for p in blend.prefixes)
    weights = None if blend.weights is None else tuple(
        round(w / sum(blend.weights), 12) for w in blend.weights)
    return where, weights, tuple(round(f, 12) for f in parse_split(split or DEFAULT_SPLIT))


def parse_split(text: str) -> tuple[float, float, float]:
    """`--split 969,30,1` → normalised (train, valid, test) fractions, as Megatron's
    `parse_and_normalize_split` (missing parts are 0)."""
    parts = re.findall(r"[^,/\s]+", str(text))
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not math.isfinite(v) or v < 0 for v in values) \
            or sum(values) <= 0:
        raise SpecError(f"--split {limits.clip(str(text))}: give up to three non-negative "
                        "weights for train, validation and test, e.g. 969,30,1 (Megatron's "
                        "--split).")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return values[0] / total, values[1] / total, values[2] / total


def split_bounds(num_sequences: int, split: tuple[float, float, float]
                 ) -> list[tuple[int, int]]:
    """Sequence ranges [begin, end) of train, valid, test: Megatron's bounds
    (`BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`)."""
    edges = [0.0, split[0], split[0] + split[1], 1.0]
    return [(int(round(edges[i] * num_sequences)), int(round(edges[i + 1] * num_sequences)))
            for i in range(3)]


# ---------------------------------------------------------------------- opening, checking
def _missing(prefix: str) -> SpecError:
    """Why PREFIX is no dataset, and how to make one (a text file is the common mistake)."""
    bin_path, idx_path = paths(prefix)
    given = Path(prefix)
    packed = next((k for k in PACKED_SUFFIXES if given.name.lower().endswith(k)), None)
    if packed is not None:  # data prepare reads UTF-8 text and JSONL, not these
        return SpecError(f"--data {prefix}: a {packed} file is not a tokenized dataset, and "
                         "`moeplan data prepare` reads UTF-8 text and JSONL only: "
                         f"{PACKED_SUFFIXES[packed]}, then `moeplan data prepare FILE "
                         "--tokenizer-model TOKENIZER -o PREFIX` (docs/DATA.md) and pass --data "
                         "PREFIX.")
    if given.is_dir() and any((given / f).is_file() for f in HF_SAVED):
        return SpecError(f"--data {prefix}: this is a Hugging Face datasets directory "
                         "(`save_to_disk`), not a tokenized dataset, and `moeplan data "
                         "prepare` reads UTF-8 text and JSONL only: export its text column with "
                         "`datasets.load_from_disk(DIR).to_json('FILE.jsonl')`, then `moeplan "
                         "data prepare FILE.jsonl --tokenizer-model TOKENIZER -o PREFIX` "
                         "(docs/DATA.md) and pass --data PREFIX.")
    if given.is_file() or given.suffix.lower() in TEXT_SUFFIXES:
        return SpecError(f"--data {prefix}: this is not a tokenized dataset. `moeplan run` "
                         "trains on Megatron's indexed format, a PREFIX.bin + PREFIX.idx pair "
                         "given by its PREFIX; make one with `moeplan data prepare "
                         f"{given} --tokenizer-model TOKENIZER -o {given.with_suffix('')}` "
                         "(text or JSONL; docs/DATA.md), then pass --data "
                         f"{given.with_suffix('')}.")
    how = (f"`moeplan data prepare TEXT_OR_JSONL --tokenizer-model TOKENIZER -o {given}` "
           "writes one (docs/DATA.md)")
    for part in (bin_path, idx_path):  # there, but a directory, a device or a pipe
        if part.is_symlink() and not part.exists():
            return SpecError(f"--data {prefix}: {part} is a symbolic link that leads to no "
                             "file (its target is missing, or the links form a loop). Point it "
                             f"at the dataset's file, or rebuild the pair: {how}.")
        problem = file_problem(part)
        if problem is not None and problem.startswith("is "):
            return SpecError(f"--data {prefix}: {part} {problem}; a dataset is a pair of "
                             f"regular files. Replace it, or rebuild the pair: {how}.")
    if bin_path.is_file() != idx_path.is_file():
        have, lack = (bin_path, idx_path) if bin_path.is_file() else (idx_path, bin_path)
        return SpecError(f"--data {prefix}: {have} is there but {lack} is missing; a dataset is "
                         f"the pair. Copy both, or rebuild it: {how}.")
    return SpecError(f"--data {prefix}: no such dataset (neither {bin_path} nor {idx_path} "
                     f"exists). Give a dataset prefix, 'synthetic', or {how}.")


def scan_ids(index: Index, vocab_size: int, limit: int = SCAN_TOKENS) -> int:
    """The largest token id in the first `limit` tokens; refuses one outside the vocabulary."""
    tokens, top = open_tokens(index), -1
    for start in range(0, min(index.num_tokens, limit), 1 << 24):
        chunk = tokens[start: min(start + (1 << 24), limit)]
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise SpecError(f"--data {index.prefix}: token id {bad} (near token {start:,}) is "
                            f"outside the model's vocabulary of {vocab_size:,}; the dataset was "
                            "tokenized for another vocabulary. Prepare it with the model's "
                            "tokenizer, or plan a model whose vocabulary holds it.")
        top = max(top, hi)
    return top


@dataclass(frozen=True)
class Part:
    """One dataset's split: the token range [begin, end) of its .bin and its windows."""

    index: Index
    begin: int
    end: int
    windows: int


@dataclass(frozen=True)
class BlendTree:
    """The datasets of positive weight as a balanced binary tree. Node j splits its samples
    between its children in the ratio of their weights, `ratio[j]` = round(2^32 · W_left /
    W_node), strictly between 0 and 2^32 (`of` refuses a weight too small for it);
    `child[j]` holds (left, right), a child ≥ 0 a node and −1 − d dataset d."""

    ratio: np.ndarray  # uint64, per node
    child: np.ndarray  # int64, (nodes, 2)
    root: int          # a node, or −1 − d when one dataset has all the weight

    @classmethod
    def of(cls, weights: np.ndarray, names: Sequence[str] = ()) -> BlendTree:
        """The tree of `weights` (normalised); a weight too small beside its neighbours for a
        node's 32-bit ratio (below 2^-32 of their sum) is refused, naming it (`names`), rather
        than drawn more often than given."""
        ratios: list[int] = []
        children: list[list[int]] = []

        def build(ds: list[int]) -> int:
            if len(ds) == 1:
                return -1 - ds[0]
            left, right = ds[: len(ds) // 2], ds[len(ds) // 2:]
            wl, wr = float(weights[left].sum()), float(weights[right].sum())
            ratio = round(wl / (wl + wr) * (1 << RATIO_BITS))
            if not 0 < ratio < 1 << RATIO_BITS:
                small = (left if ratio == 0 else right)[0]
                name = names[small] if small < len(names) else f"dataset {small + 1}"
                raise SpecError(f"--data: the weight of {name} is below 2^-32 of the blend "
                                "beside it, so it cannot be drawn at its weight; raise it or "
                                "drop the dataset.")
            j = len(ratios)
            ratios.append(ratio)
            children.append([0, 0])
            children[j] = [build(left), build(right)]
            return j

        root = build([int(d) for d in np.flatnonzero(weights > 0)])
        return cls(np.array(ratios, dtype=np.uint64),
                   np.array(children, dtype=np.int64).reshape(-1, 2), root)

    def assign(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample index within it) of global samples `g` (int64 ≥ 0)."""
        node = np.full(g.shape, self.root, dtype=np.int64)
        k = g.astype(np.uint64)
        inner = node >= 0
        while inner.any():
            at, n = node[inner], k[inner]
            before, after = _left_count(self.ratio[at], n), _left_count(self.ratio[at], n + 1)
            left = after > before
            k[inner] = np.where(left, before, n - before)
            node[inner] = np.where(left, self.child[at, 0], self.child[at, 1])
            inner = node >= 0
        return -1 - node, k.astype(np.int64)


def _left_count(ratio: np.ndarray, n: np.ndarray) -> np.ndarray:
    """round(ratio · n / 2^32), exactly, in uint64: how many of a node's first n samples go to
    its left side. ratio < 2^32, so it grows by 0 or 1 from n to n + 1."""
    low = np.uint64((1 << RATIO_BITS) - 1)
    hi, lo = n >> np.uint64(RATIO_BITS), n & low
    half = np.uint64(1 << (RATIO_BITS - 1))
    return ratio * hi + ((ratio * lo + half) >> np.uint64(RATIO_BITS))


class Corpus:
    """One split of a blend, as windows of seq + 1 tokens addressed by global sample index."""

    def __init__(self, data: str, split: str | None, which: str, seq_len: int, seed: int,
                 vocab_size: int, scan: bool = True):
        blend, fractions = parse_blend(data), parse_split(split or DEFAULT_SPLIT)
        self.which, self.seq_len, self.seed, self.vocab_size = which, seq_len, seed, vocab_size
        k = SPLITS.index(which)
        parts = []
        for prefix in blend.prefixes:
            bin_path, idx_path = paths(prefix)
            if not (bin_path.is_file() and idx_path.is_file()):
                raise _missing(prefix)
            index = read_index(prefix)
            if scan:
                scan_ids(index, vocab_size)
            lo, hi = split_bounds(index.num_sequences, fractions)[k]
            begin, end = index.token_offset(lo), index.token_offset(hi)
            parts.append(Part(index, begin, end, max(0, (end - begin - 1) // seq_len)))
        weights = (np.array(blend.weights, dtype=np.float64) if blend.weights is not None
                   else np.array([p.windows for p in parts], dtype=np.float64))
        keep = weights > 0
        empty = [p.index.prefix for p, w in zip(parts, weights, strict=True)
                 if (w > 0 or not keep.any()) and p.windows == 0]
        if empty:
            few = min((p.index.num_sequences for p in parts if p.index.prefix in empty),
                      default=0)
            cut = (f" It is split by sequence (document), and it holds {few:,}: prepare its "
                   "text with `moeplan data prepare --document-per paragraph` (or line) for "
                   "more of them." if few < 20 else "")
            raise SpecError(f"--data: the {which} split of {', '.join(empty[:3])} holds fewer "
                            f"than seq_len + 1 = {seq_len + 1} tokens (--split "
                            f"{split or DEFAULT_SPLIT}); give it a larger share, a larger "
                            f"dataset, or a weight of 0.{cut}")
        self.parts = parts
        self.weights = weights / weights.sum()
        self.tree = BlendTree.of(self.weights, [p.index.prefix for p in parts])
        self._tokens: dict[int, np.ndarray] = {}

    @property
    def num_windows(self) -> int:
        return sum(p.windows for p in self.parts)

    def describe(self) -> str:
        """One line: datasets, weights and windows of this split."""
        shown = ", ".join(f"{Path(p.index.prefix).name} {w:.3g}" for p, w in
                          zip(self.parts[:4], self.weights, strict=False))
        more = f" and {len(self.parts) - 4} more" if len(self.parts) > 4 else ""
        return (f"{self.which}: {len(self.parts)} dataset(s) ({shown}{more}), "
                f"{self.num_windows:,} windows of {self.seq_len + 1} tokens")

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, window) of global samples `g` (int64 array)."""
        d, k = self.tree.assign(np.asarray(g, dtype=np.int64))  # sample k of dataset d
        window = np.empty_like(k)
        for j, part in enumerate(self.parts):
            mine = d == j
            if mine.any():
                epoch, at = np.divmod(k[mine], part.windows)
                window[mine] = feistel(at, part.windows, self._key(j, epoch))
        return d, window

    def _key(self, dataset: int, epoch: np.ndarray) -> np.ndarray:
        base = (self.seed * 1_000_003 + dataset * 7_919 + SPLITS.index(self.which) * 104_729)
        return _splitmix(epoch.astype(np.uint64) + np.uint64(base & _MASK64))

    def samples(self, g: np.ndarray) -> np.ndarray:
        """(n, seq + 1) token ids of global samples `g`; ids outside the vocabulary refused."""
        g = np.asarray(g, dtype=np.int64).reshape(-1)
        d, window = self.locate(g)
        out = np.empty((g.size, self.seq_len + 1), dtype=np.int64)
        for i in range(g.size):
            part = self.parts[int(d[i])]
            tokens = self._tokens.get(int(d[i]))
            if tokens is None:
                tokens = self._tokens[int(d[i])] = open_tokens(part.index)
            start = part.begin + int(window[i]) * self.seq_len
            out[i] = tokens[start: start + self.seq_len + 1]
        if out.size and (out.min() < 0 or out.max() >= self.vocab_size):
            i = int(np.argmax((out < 0).any(1) | (out >= self.vocab_size).any(1)))
            row = out[i]
            bad = int(row.min()) if row.min() < 0 else int(row.max())  # the offending id
            raise SpecError(f"--data {self.parts[int(d[i])].index.prefix}: sample {int(g[i])} "
                            f"holds token id {bad}, outside the model's "
                            f"vocabulary of {self.vocab_size:,}; the dataset was tokenized "
                            "for another vocabulary.")
        return out


# ----------------------------------------------------------------------- permutation
def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def feistel(i: np.ndarray, n: int, key: np.ndarray, rounds: int = 4) -> np.ndarray:
    """A keyed bijection of [0, n), applied elementwise: a balanced Feistel network over the
    smallest even number of bits holding n, cycle-walked back into range (Black & Rogaway,
    "Ciphers with arbitrary finite domains", 2002). Each element may have its own key."""
    i = np.asarray(i, dtype=np.uint64)
    key = np.broadcast_to(np.asarray(key, dtype=np.uint64), i.shape)
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)

    def once(x: np.ndarray, k: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        with np.errstate(over="ignore"):
            for r in range(rounds):
                f = _splitmix(right ^ (k + np.uint64(r) * np.uint64(0xD1B54A32D192ED03))) & mask
                left, right = right, left ^ f
        return (left << np.uint64(half)) | right

    out = once(i, key)
    walk = out >= np.uint64(n)
    while walk.any():  # cycle-walking: stays a bijection of [0, n)
        out[walk] = once(out[walk], key[walk])
        walk = out >= np.uint64(n)
    return out.astype(np.int64)
