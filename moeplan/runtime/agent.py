"""torchrun's agent as `moeplan run` starts it: `python -m moeplan.runtime.agent TORCHRUN-ARGS`.

The same elastic agent as `torchrun` (same arguments, rendezvous and restarts), with three
differences a launcher needs:
- it dies with the launcher (parent-death signal), and its workers die with it (each worker
  sets its own, see `worker.main`), so no worker outlives a SIGKILLed `moeplan run`;
- SIGTERM and SIGINT are passed on to the workers as they are (to workers not started yet
  through their environment, `lifecycle.STOP_ENV`; the agent itself starts under
  `lifecycle.BOOTSTRAP`, which records a stop from its first instruction), and nothing else
  happens: the workers agree on a step boundary, checkpoint, and exit 0, after which the agent
  exits 0 too
  (torchrun itself would shut the workers down after 30 s and raise with a traceback). torchrun
  is told to handle only SIGQUIT, the hard stop;
- a failed worker is reported in one line (rank, exit code or signal) instead of torchrun's
  ChildFailedError traceback, and the agent exits with the worker's code; a first failure
  that exited 2 is a worker refusing bad input, which printed the one paragraph saying why
  itself (rank 0 for a refusal all ranks agreed on, such as a checkpoint that cannot be
  written), so the agent adds nothing.
"""

from __future__ import annotations

import logging
import signal
import sys

from .lifecycle import (
    AGENT_PID_ENV,
    LAUNCHER_PID_ENV,
    record_stop,
    set_parent_death_signal,
    signal_children,
)

HARD_STOP = "SIGQUIT"  # the one signal left to torchrun: stop the workers now
REFUSED = 2  # a worker's exit code for bad input (MoeplanError), explained by rank 0


def _forward(signum: int, _frame: object) -> None:
    # the workers now running get it as a signal; those torchrun starts later (a stop before
    # they were spawned, a restart) inherit it from this process's environment
    record_stop(signum)
    signal_children(signum)


RESTART_LOGGER = "torch.distributed.elastic.agent.server.api"


FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _SayRestart(logging.Handler):
    """torchrun's record of a restart (`SimpleElasticAgent._invoke_run`: "[role] Worker group
    FAILED. k/n attempts left; will restart worker group"), said in one line naming the worker
    that failed, which torchrun recorded just before (`SubprocessContext._poll`: "failed
    (exitcode: %s) local_rank: %s ..."); the agent's other records stay silent. `node_ranks`:
    whether a local rank is the rank (one node), else it is named as this node's."""

    def __init__(self, node_ranks: bool) -> None:
        super().__init__()
        self.node_ranks = node_ranks
        self.failed: tuple[int, int] | None = None  # (local rank, exit code) of the last failure

    def emit(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        if msg.startswith("failed (exitcode"):
            try:
                self.failed = (int(record.args[1]), int(record.args[0]))  # type: ignore[index]
            except (TypeError, ValueError, IndexError):
                self.failed = None
            return
        if "attempts left" not in msg:
            return
        try:
            _, state, left, most = record.args  # type: ignore[misc]
            which = f"restart {int(most) - int(left) + 1} of {int(most)}"
        except (TypeError, ValueError):
            state, which = "FAILED", "a restart"
        if self.failed is None:
            who = f"a worker failed (worker group {str(state).lower()})"
        else:
            rank, code = self.failed
            name = f"local rank {rank} of this node" if self.node_ranks else f"rank {rank}"
            who = f"worker {name} {ended(code)}"
        self.failed = None
        print(f"{who}; restarting the workers from the newest checkpoint: {which} "
              "(--max-restarts).", file=sys.stderr, flush=True)


def ended(exitcode: int) -> str:
    """How a worker ended, in words: the signal that killed it, or its exit code."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = " (the out-of-memory killer sends SIGKILL)" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with code {exitcode}"


def failure_line(rank: int, exitcode: int) -> str:
    """One line naming the first failed worker and how it ended."""
    return f"worker rank {rank} {ended(exitcode)}; the other workers were stopped."


def main(argv: list[str] | None = None) -> int:
    import os

    set_parent_death_signal(LAUNCHER_PID_ENV)
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _forward)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import parse_args, run

    for name in list(logging.root.manager.loggerDict):  # created at import, level from env
        if name.startswith("torch.distributed.elastic") or name == "torch.distributed.run":
            logging.getLogger(name).setLevel(logging.CRITICAL)  # this module reports failures
    args = parse_args([f"--signals-to-handle={HARD_STOP}",
                       *(sys.argv[1:] if argv is None else argv)])
    say = _SayRestart(node_ranks=str(args.nnodes) not in ("1", "1:1"))
    for name, level in ((RESTART_LOGGER, logging.INFO), (FAILURE_LOGGER, logging.ERROR)):
        log = logging.getLogger(name)  # but a restart is said, in one line, with its failure
        log.setLevel(level)
        log.handlers[:] = [say]
        log.propagate = False
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()  # the others were stopped because of it
        if failure.exitcode == REFUSED:
            return REFUSED  # the worker(s) said why, in one paragraph
        print(failure_line(rank, failure.exitcode), file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except RendezvousError as e:
        print(f"rendezvous failed ({type(e).__name__}: {e}); check that every node runs the "
              "same command with the same --rdzv-endpoint, reachable from all of them.",
              file=sys.stderr, flush=True)
        return 1
    except SignalException as e:  # the hard stop: torchrun has stopped the workers
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
