"""Exception types, and the one table (`EXIT_CODES`) that turns them into process exit codes.

Library code raises meaningful errors and never calls `sys.exit` itself; `moeplan.cli.main`
maps whatever reaches it through `EXIT_CODES`, so an exit code is decided in one place:

  2    bad input (MoeplanError and its kinds): one clear paragraph naming the field and the fix
  3    proven infeasibility (InfeasibleError): nothing fits, with what came closest
  130  interrupted (Ctrl-C before a run started)
  a run's own code (RunFailed): the workers' exit status; 130 (SIGINT) or 75 (SIGTERM,
       preemption) when a signal stopped the run at a step boundary (RunStopped)

No imports: the planner, the runtime and the CLI all raise these.
"""

from __future__ import annotations


class MoeplanError(Exception):
    """Bad input from the user: exit code 2, one clear paragraph, no traceback."""

    @property
    def exit_code(self) -> int:
        return exit_code(self)


class SpecError(MoeplanError):
    """A model, cluster, training or plan description is invalid; the message names the field."""


EXECUTORS = {"megatron": "Megatron-LM", "moeplan": "`moeplan run`"}


class LayoutError(MoeplanError):
    """A plan breaks one or more rules of its target executor (each named, with its fix; the
    rules table is `moeplan.specs.rules`)."""

    def __init__(self, violations: list[tuple[str, str]], target: str | None = None):
        self.violations, self.target = violations, target
        lines = "; ".join(f"[{rule}] {why}" for rule, why in violations)
        who = f" for {EXECUTORS.get(target, target)}" if target else ""
        super().__init__(f"invalid layout{who}: {lines}")


class NotYetAvailable(MoeplanError):
    """A command or plan feature that this version does not execute; never faked."""


class TorchMissing(SpecError):
    """A command that trains or measures needs PyTorch, which a planner-only install
    (`pip install moeplan`) normally lacks: say what to install, not a traceback."""

    def __init__(self, command: str):
        super().__init__(
            f"{command} trains with PyTorch, which is not installed (the planner commands do "
            "not need it). Install the runtime: pip install 'moeplan[run]' (on a CPU-only "
            "machine first pip install torch==2.13.0; on a GPU machine the CUDA build of torch "
            "for your driver).")


class InfeasibleError(Exception):
    """Nothing fits: exit code 3, with what came closest and why."""

    @property
    def exit_code(self) -> int:
        return exit_code(self)


class RunFailed(Exception):
    """A training run did not finish: its workers exited with `code` (their output says why).

    The process exits with that same code, so a scheduler sees what the workers reported.
    """

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message if message is not None
                         else f"training workers exited with code {code}")
        self.exit_code = code


class RunRefused(RunFailed):
    """The workers refused to go on with exit 2 (a checkpoint that cannot be written, say),
    after rank 0 printed the one paragraph that says why: nothing more is printed."""

    def __init__(self) -> None:
        super().__init__(2, "")


class RunStopped(RunFailed):
    """SIGINT or SIGTERM stopped a run at a step boundary: exit 130 or 75, and the message is
    the one line saying where it stopped and what was saved (empty where another rank says
    it). `summary`: the workers' summary.json of the stop, when they wrote one."""

    summary: dict | None = None


# Exception type → (exit code, word the CLI prints before the message). The most derived type
# listed wins (RunStopped before RunFailed). None: the code the run ended with (`exit_code` of
# the RunFailed instance, the workers' status or the stop signal's documented code); "": the
# message is the whole line.
EXIT_CODES: dict[type[BaseException], tuple[int | None, str]] = {
    MoeplanError: (2, "error"),
    InfeasibleError: (3, "infeasible"),
    RunStopped: (None, ""),
    RunRefused: (None, ""),
    RunFailed: (None, "error"),
    KeyboardInterrupt: (130, ""),
}


def exit_rule(exc: BaseException) -> tuple[int | None, str] | None:
    """The EXIT_CODES entry of `exc`'s most derived listed type, or None when none is listed
    (an unexpected error: a bug, shown with its traceback)."""
    for cls in type(exc).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return None


def exit_code(exc: BaseException) -> int:
    """The process exit code for `exc` (1 for a type EXIT_CODES does not list)."""
    rule = exit_rule(exc)
    if rule is None:
        return 1
    code = rule[0]
    if code is None:  # a run's own code, set on the instance
        return int(exc.__dict__.get("exit_code", 1))
    return code
