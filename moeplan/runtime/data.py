"""Training data as torch batches: a seeded synthetic Markov chain, or Megatron indexed datasets.

Both give the global batch of a step as a function of (seed, step) alone, whatever the plan;
each data-parallel rank then takes its contiguous slice of it (docs/DATA.md). The datasets are
read by `moeplan.data` (numpy, no torch; the launcher opens and checks them before any worker
starts); this module only turns their samples into tensors.

Why a Markov chain: it is learnable (each token has four likely successors, so the loss can fall
from ln V towards ≈1.2 nats), cheap to generate on every rank, and needs no files. Its
validation stream is the same chain drawn from other seeds, so validation measures how well the
chain was learned, never memorisation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..data.corpus import Corpus
from ..data.indexed import write_documents

SUCCESSORS = 4
_PROBS = torch.tensor([0.55, 0.25, 0.12, 0.08])
_VALID_OFFSET = 1 << 40  # validation batches of the synthetic stream: steps no run reaches


class MarkovData:
    """Global batches of shape (gbs, seq + 1) drawn from one fixed seeded transition table."""

    def __init__(self, vocab: int, seq_len: int, global_batch: int, seed: int,
                 which: str = "train"):
        self.vocab, self.seq_len, self.gbs, self.seed = vocab, seq_len, global_batch, seed
        self.offset = 0 if which == "train" else _VALID_OFFSET
        gen = torch.Generator().manual_seed(seed * 7919 + 1)
        self.successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=gen)  # (V, 4)

    def global_batch(self, step: int, rows: slice | None = None) -> torch.Tensor:
        """(gbs, seq + 1) token ids for `step` (or just `rows` of them, drawn identically);
        inputs are [:, :-1], targets [:, 1:]."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + self.offset)
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


class TokenData:
    """Global batches from Megatron indexed datasets (`--data`, `--split`), the same interface
    as `MarkovData`: row r of step s is global sample s·gbs + r of the split (`Corpus`)."""

    def __init__(self, data: str | Path, vocab: int, seq_len: int, global_batch: int,
                 seed: int, split: str | None = None, which: str = "train"):
        # the launcher scanned the ids already; every sample read is checked again (Corpus)
        self.corpus = Corpus(str(data), split, which, seq_len, seed, vocab, scan=False)
        self.seq_len, self.gbs, self.seed = seq_len, global_batch, seed

    def global_batch(self, step: int, rows: slice | None = None) -> torch.Tensor:
        """(gbs, seq + 1) token ids of `step`, or just `rows` of them."""
        rows = rows or slice(0, self.gbs)
        g = step * self.gbs + np.arange(*rows.indices(self.gbs), dtype=np.int64)
        return torch.from_numpy(self.corpus.samples(g))

    micro_batches = MarkovData.micro_batches


def make_data(data: str, vocab: int, seq_len: int, global_batch: int, seed: int,
              split: str | None = None, which: str = "train") -> MarkovData | TokenData:
    """The `which` split ("train" or "valid") of `--data` (a blend, or 'synthetic')."""
    if data == "synthetic":
        return MarkovData(vocab, seq_len, global_batch, seed, which)
    return TokenData(data, vocab, seq_len, global_batch, seed, split, which)


def write_tokens(tokens: np.ndarray, out: str | Path, vocab_size: int | None = None) -> Path:
    """A flat array of token ids as a one-document indexed dataset at OUT's prefix (OUT.bin
    and OUT.idx; `corpus.bin` and `corpus` name the same one); returns the .bin path."""
    tokens = np.asarray(tokens).reshape(-1)
    top = int(tokens.max()) + 1 if tokens.size else 1
    dtype = np.uint16 if (vocab_size or top) < 65500 else np.int32
    prefix = str(out).removesuffix(".bin").removesuffix(".idx")
    return write_documents(prefix, [tokens], dtype)[0]
