"""Pipeline schedule orders: which (chunk, micro-batch) each pipeline rank runs, and when.

Megatron Core's orders (`schedules.py`): 1F1B runs min(m, pp − r − 1) warm-up forwards, then
one-forward-one-backward, then the cool-down backwards; interleaved 1F1B with v chunks runs
(pp − r − 1)·2 + (v − 1)·pp warm-up forwards, visiting chunks in groups of pp micro-batches
(Narayanan et al. 2021 §2.2). Under EP overlap (Megatron's combined 1F1B,
`--overlap-moe-expert-parallel-comm`) each steady-state forward is merged with the backward
that follows it, after one extra warm-up forward.

Why here, torch-free: the runtime executes these orders and the plan report draws them, and the
planner never imports torch; one definition serves both, so the picture is the order that runs.
"""

from __future__ import annotations

Action = tuple[int, int]  # (chunk, micro-batch)


def _phases(pp: int, vpp: int, rank: int, m: int, extra_warmup: int
            ) -> tuple[list[Action], list[tuple[Action, Action]], list[Action]]:
    """Megatron Core's order as warm-up forwards, steady (forward, backward) pairs and
    cool-down backwards."""
    total = m * vpp
    warmup = (min(m, pp - rank - 1) if vpp == 1
              else min(total, (pp - rank - 1) * 2 + (vpp - 1) * pp))
    warmup = min(total, warmup + extra_warmup)

    def at(k: int, backward: bool) -> Action:
        group = k // pp
        chunk = group % vpp
        mb = (group // vpp) * pp + k % pp
        return (vpp - 1 - chunk if backward else chunk), mb

    return ([at(k, False) for k in range(warmup)],
            [(at(warmup + i, False), at(i, True)) for i in range(total - warmup)],
            [at(k, True) for k in range(total - warmup, total)])


def schedule(pp: int, vpp: int, rank: int, m: int) -> list[tuple[str, int, int]]:
    """Rank `rank`'s actions ('F' or 'B', chunk, micro-batch) in Megatron Core's order."""
    warm, steady, cool = _phases(pp, vpp, rank, m, 0)
    acts = [("F", *f) for f in warm]
    for f, b in steady:
        acts += [("F", *f), ("B", *b)]
    return acts + [("B", *b) for b in cool]


def merged_schedule(pp: int, vpp: int, rank: int, m: int
                    ) -> list[tuple[Action | None, Action | None]]:
    """The EP-overlap order (Megatron's combined 1F1B): steps of (forward, backward), either
    None. Each steady-state forward is merged with the backward that follows it; one extra
    warm-up forward (Megatron's `num_warmup_microbatches + 1` under
    `--overlap-moe-expert-parallel-comm`) makes the two always different micro-batches,
    independent of each other; with pp = 1 this is F0, (F1, B0), …, B(m−1)."""
    warm, steady, cool = _phases(pp, vpp, rank, m, 1)
    return ([(f, None) for f in warm] + [(f, b) for f, b in steady]
            + [(None, b) for b in cool])
