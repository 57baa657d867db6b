"""Training data: a seeded synthetic Markov chain, or a memory-mapped token file on disk.

Both are deterministic per (seed, step), whatever the plan (docs/DATA.md for the file format).

Why a Markov chain: it is learnable (each token has four likely successors, so the loss can fall
from ln V towards ≈1.2 nats), cheap to generate on every rank, and the global batch of a step
depends only on the seed and the step, never on the plan: every layout sees the same sequences.
Each data-parallel rank then takes its contiguous slice of the global batch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from ..errors import SpecError
from .storage import TOKEN_FORMAT, sidecar_path

SUCCESSORS = 4
_PROBS = torch.tensor([0.55, 0.25, 0.12, 0.08])


class MarkovData:
    """Global batches of shape (gbs, seq + 1) drawn from one fixed seeded transition table."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int):
        self.vocab, self.seq_len, self.gbs, self.seed = vocab, seq_len, global_batch, seed
        gen = torch.Generator().manual_seed(seed * 7919 + 1)
        self.successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=gen)  # (V, 4)

    def global_batch(self, step: int, rows: slice | None = None) -> torch.Tensor:
        """(gbs, seq + 1) token ids for `step` (or just `rows` of them, drawn identically);
        inputs are [:, :-1], targets [:, 1:]."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        choice = torch.multinomial(_PROBS, self.gbs * self.seq_len, replacement=True,
                                   generator=gen).view(self.gbs, self.seq_len)
        cur = torch.randint(0, self.vocab, (self.gbs,), generator=gen)
        if rows is not None:  # every rank draws the same random numbers, walks only its rows
            choice, cur = choice[rows], cur[rows]
        out = torch.empty(cur.shape[0], self.seq_len + 1, dtype=torch.long)
        out[:, 0] = cur
        for t in range(self.seq_len):  # a loop over positions, vectorised over sequences
            cur = self.successors[cur, choice[:, t]]
            out[:, t + 1] = cur
        return out

    def micro_batches(self, step: int, dp_rank: int, dp: int,
                      mbs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This data-parallel rank's micro-batches: [(tokens (mbs, s), targets (mbs, s)), ...]."""
        per = self.gbs // dp
        mine = self.global_batch(step, slice(dp_rank * per, (dp_rank + 1) * per))
        return [(mine[i: i + mbs, :-1], mine[i: i + mbs, 1:]) for i in range(0, per, mbs)]


# ------------------------------------------------------------------------ token files on disk
class TokenData:
    """Global batches from a memory-mapped token file, the same interface as `MarkovData`.

    The corpus is cut into non-overlapping windows of seq_len + 1 tokens (stride seq_len, so
    every token is a target once per epoch). Global sample g = step · gbs + row lives in epoch
    g // windows at position perm(seed, epoch)[g % windows]: a pure function of (seed, epoch,
    global sample index), so a step's global batch is the same under every plan and after any
    restart, and the data position to checkpoint is just the step.
    """

    def __init__(self, path: str | Path, vocab: int, seq_len: int, global_batch: int,
                 seed: int):
        meta = json.loads(sidecar_path(path).read_text())
        self.tokens = np.memmap(path, dtype=meta["dtype"], mode="r")
        self.seq_len, self.gbs, self.seed = seq_len, global_batch, seed
        self.windows = (len(self.tokens) - 1) // seq_len
        self._perm: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:  # one permutation held at a time
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7_777_777 + epoch)
            self._perm = (epoch, torch.randperm(self.windows, generator=gen))
        return self._perm[1]

    def sample(self, index: int) -> torch.Tensor:
        """Global sample `index`: seq_len + 1 token ids."""
        epoch, pos = divmod(index, self.windows)
        start = int(self._order(epoch)[pos]) * self.seq_len
        return torch.from_numpy(self.tokens[start: start + self.seq_len + 1].astype(np.int64))

    def global_batch(self, step: int, rows: slice | None = None) -> torch.Tensor:
        """(gbs, seq + 1) token ids of `step`, or just `rows` of them."""
        rows = rows or slice(0, self.gbs)
        return torch.stack([self.sample(step * self.gbs + r)
                            for r in range(*rows.indices(self.gbs))])

    micro_batches = MarkovData.micro_batches


def write_tokens(tokens: np.ndarray, out: str | Path, vocab_size: int | None = None) -> Path:
    """Write a flat token array as OUT (.bin) plus its sidecar; uint16 when ids fit."""
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size and (not np.issubdtype(tokens.dtype, np.integer) or tokens.min() < 0):
        raise SpecError("token arrays must hold non-negative integers.")
    top = int(tokens.max()) if tokens.size else 0
    vocab_size = vocab_size or top + 1
    if top >= vocab_size:
        raise SpecError(f"token id {top} is outside --vocab-size {vocab_size}.")
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    out = Path(out).with_suffix(".bin")
    tokens.astype(dtype).tofile(out)
    sidecar_path(out).write_text(json.dumps({
        "format": TOKEN_FORMAT, "dtype": dtype, "num_tokens": int(tokens.size),
        "vocab_size": vocab_size}, indent=1))
    return out


BYTE_EOS = 0  # byte-level tokenizer: ids are UTF-8 bytes; NUL (never in text) ends a document


def byte_tokens(texts: list[str]) -> np.ndarray:
    """Byte-level tokenization (vocabulary 256, no download): each document's UTF-8 bytes,
    then the end-of-document id 0."""
    parts = []
    for text in texts:
        parts += [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16),
                  np.array([BYTE_EOS], dtype=np.uint16)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def main(argv: list[str] | None = None) -> None:
    """`python -m moeplan.runtime.data {text,npy} INPUT... -o OUT.bin`: see docs/DATA.md."""
    p = argparse.ArgumentParser(prog="python -m moeplan.runtime.data",
                                description="Convert text files or a NumPy array to a token file.")
    p.add_argument("kind", choices=("text", "npy"))
    p.add_argument("inputs", nargs="+")
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--vocab-size", type=int, default=None, help="npy: the tokenizer's vocabulary")
    a = p.parse_args(argv)
    if a.kind == "text":
        tokens = byte_tokens([Path(f).read_text(encoding="utf-8") for f in a.inputs])
        out = write_tokens(tokens, a.out, vocab_size=256)
    else:
        tokens = np.concatenate([np.load(f, mmap_mode="r").reshape(-1) for f in a.inputs])
        out = write_tokens(tokens, a.out, vocab_size=a.vocab_size)
    print(f"{out}: {tokens.size} tokens")


if __name__ == "__main__":
    main()
