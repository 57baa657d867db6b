"""No process outlives its launcher: parent-death signals, child lookup, stop exit codes.

`moeplan run` starts torchrun's agent in a session of its own, and the agent starts the
workers (torchrun puts each in yet another session, so no process-group kill reaches them). What
holds the tree together is Linux's parent-death signal, `prctl(PR_SET_PDEATHSIG)`: the agent dies
when the launcher dies, each worker when the agent dies, even when the parent was SIGKILLed and
ran no cleanup. Elsewhere (macOS) the call is a no-op and only the launcher's own cleanup holds.

Exit codes of a run that was asked to stop (README, docs/RUNTIME.md):
  75  (EX_TEMPFAIL) SIGTERM, i.e. preemption: stopped at a step boundary, checkpointed when a
      --ckpt-dir was given; run it again with --resume.
  130 SIGINT (Ctrl-C): the same stop, the shell's convention for an interrupt.
No torch here: the launcher uses it before any worker starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from pathlib import Path

PREEMPTED_EXIT = 75
INTERRUPTED_EXIT = 130
STOP_EXIT_CODES = {signal.SIGTERM: PREEMPTED_EXIT, signal.SIGINT: INTERRUPTED_EXIT}
PR_SET_PDEATHSIG = 1
LAUNCHER_PID_ENV = "MOEPLAN_LAUNCHER_PID"  # set by the launcher for the agent
AGENT_PID_ENV = "MOEPLAN_AGENT_PID"  # set by the agent for its workers


def set_parent_death_signal(expected_parent_env: str | None = None,
                            sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits (Linux).

    The parent may already be gone by the time this runs (the process was re-parented to init
    or a subreaper); when `expected_parent_env` names an environment variable holding the
    parent's pid, a mismatch means exactly that, and this process exits at once.
    Returns whether the signal was set.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    ok = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    expected = os.environ.get(expected_parent_env) if expected_parent_env else None
    if ok and expected and expected.isdigit() and os.getppid() != int(expected):
        os._exit(1)  # the parent died before the signal was armed
    return ok


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc; every thread's children), [] where unknown."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return sorted(set(out))


def signal_children(sig: int, pid: int | None = None) -> int:
    """Send `sig` to every direct child of `pid` (default: this process); how many got it."""
    sent = 0
    for child in child_pids(pid or os.getpid()):
        try:
            os.kill(child, sig)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def stop_exit_code(sig: int) -> int:
    """The documented exit code of a run stopped by `sig` (SIGTERM 75, SIGINT 130)."""
    return STOP_EXIT_CODES.get(signal.Signals(sig), 128 + int(sig))
