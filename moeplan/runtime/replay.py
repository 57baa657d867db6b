"""Whether a backward pass is re-running a forward right now (activation recompute).

A flag of its own, below both sides: `memory.py` sets it around every recompute it triggers,
and stateful modules (the MoE layer's routing counters, `moe.py`) read it so that a replayed
forward does not count twice. Keeping it here lets `memory.py` know the MoE layer without the
MoE layer knowing the recompute machinery.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_DEPTH = [0]  # nesting depth of recompute replays now running (one process, one thread)


def recomputing() -> bool:
    """True while a backward pass re-runs a forward: stateful counters must not count twice."""
    return _DEPTH[0] > 0


@contextlib.contextmanager
def recompute_mode() -> Iterator[None]:
    """Mark the forward run inside as a recompute replay (nestable)."""
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1
