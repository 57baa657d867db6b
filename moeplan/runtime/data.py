"""Synthetic data: a seeded Markov chain over the vocabulary, deterministic per (seed, step).

Why a Markov chain: it is learnable (each token has four likely successors, so the loss can fall
from ln V towards ≈1.2 nats), cheap to generate on every rank, and the global batch of a step
depends only on the seed and the step, never on the plan: every layout sees the same sequences.
Each data-parallel rank then takes its contiguous slice of the global batch.
"""

from __future__ import annotations

import torch

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
