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
START_PPID_ENV = "MOEPLAN_START_PPID"  # set by `python -m moeplan` (__main__) as it starts
STOP_ENV = "MOEPLAN_STOP_SIGNAL"
"""The stop signal (SIGTERM or SIGINT, as a number) a process received before it could pass it
on: a stop that reached the agent before its workers existed, or a worker before its handlers.
Set in the process's own environment, so the workers the agent starts afterwards inherit it and
stop at their first step boundary instead of never hearing of it."""

BOOTSTRAP = (
    "import os, runpy, signal, sys\n"
    "def _stop(signum, _frame):\n"
    f"    seen = int(os.environ.get('{STOP_ENV}') or 0)\n"
    f"    os.environ['{STOP_ENV}'] = str(max(seen, signum))\n"
    "for _s in (signal.SIGTERM, signal.SIGINT):\n"
    "    signal.signal(_s, _stop)\n"
    "sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")
"""What `python -c BOOTSTRAP MODULE ARGS...` runs: SIGTERM and SIGINT recorded (`STOP_ENV`)
from the interpreter's first instruction, then MODULE as `python -m MODULE ARGS...` would run
it. `-m` would import the moeplan package (a second of pydantic models) before any handler of
the module could be installed, and a stop in that second would kill the process outright."""


def bootstrap_command(module: str, *args: str, unbuffered: bool = False) -> list[str]:
    """The command line that runs `module` as `python -m` does, with stops recorded from the
    start (`BOOTSTRAP`); `unbuffered` as `python -u` (torchrun's own worker line)."""
    return [sys.executable, *(["-u"] if unbuffered else []), "-c", BOOTSTRAP, module, *args]


def pending_stop() -> int:
    """The stop signal recorded before this process's own handlers were installed (0: none)."""
    value = os.environ.get(STOP_ENV, "")
    return int(value) if value.isdigit() else 0


def record_stop(signum: int) -> None:
    """Record a stop signal in this process's environment (`STOP_ENV`), for the processes it
    starts from now on."""
    os.environ[STOP_ENV] = str(max(pending_stop(), int(signum)))


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
