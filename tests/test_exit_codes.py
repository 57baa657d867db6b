"""One table turns every moeplan error into its exit code: 2 bad input, 3 proven infeasibility,
a run's own code (the workers' status; 130 SIGINT, 75 SIGTERM), 130 for Ctrl-C; `cli.main`
prints each as one line and maps it through that table, a failed run included."""

from __future__ import annotations

import importlib
import signal

import pytest

import moeplan.runtime.launch as launch
from moeplan.cli import main
from moeplan.errors import (
    EXIT_CODES,
    InfeasibleError,
    LayoutError,
    MoeplanError,
    NotYetAvailable,
    RunFailed,
    RunStopped,
    SpecError,
    TorchMissing,
    exit_code,
    exit_rule,
)

# the torch-free modules that define or raise moeplan's error types
ERROR_MODULES = ("moeplan.errors", "moeplan.runtime.launch", "moeplan.cli", "moeplan.api",
                 "moeplan.planner.search", "moeplan.specs.loader", "moeplan.calibrate")
# signals inside one module, caught there, never shown to a user: the search catches the
# MILP's "this layout's stages fit no budget" (and "the solver stopped without a solution")
# and moves on to the next layout
INTERNAL = {"moeplan.planner.ilp.InfeasibleStages", "moeplan.planner.ilp.SolverStopped",
            "moeplan.fsio.TooDeep"}  # a ValueError of fsio.loads_json: its callers say it


def _moeplan_exception_types() -> list[type[BaseException]]:
    for name in ERROR_MODULES:
        importlib.import_module(name)
    found, todo = [], [BaseException]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("moeplan"):
            found.append(cls)
    return found


def test_every_moeplan_error_type_has_an_entry_in_the_one_table():
    types = _moeplan_exception_types()
    assert {SpecError, LayoutError, InfeasibleError, RunFailed, launch.Stopped} <= set(types)
    missing = [t.__qualname__ for t in types if f"{t.__module__}.{t.__qualname__}" not in
               INTERNAL and not any(c in EXIT_CODES for c in t.__mro__)]
    assert not missing, f"not in errors.EXIT_CODES: {missing}"


def test_each_error_gets_its_documented_code():
    assert exit_code(SpecError("x")) == exit_code(NotYetAvailable("x")) == 2
    assert exit_code(LayoutError([("rule", "why")])) == exit_code(TorchMissing("moeplan run")) == 2
    assert exit_code(InfeasibleError("nothing fits")) == 3
    assert exit_code(RunFailed(7)) == 7
    assert exit_code(launch.Stopped(signal.SIGTERM, None, None)) == 75
    assert exit_code(launch.Stopped(signal.SIGINT, None, None)) == 130
    assert exit_code(KeyboardInterrupt()) == 130
    assert exit_rule(ValueError("a bug")) is None and exit_code(ValueError("a bug")) == 1
    # the attribute the workers read is the table's too
    assert SpecError("x").exit_code == 2 and InfeasibleError("y").exit_code == 3
    assert issubclass(launch.Stopped, RunStopped) and launch.RunFailed is RunFailed


def _run_raising(exc: BaseException, monkeypatch, capsys, *flags: str) -> tuple[int, str]:
    """`moeplan run` whose launcher raises `exc`: main's exit code and stderr."""
    def fail(*_args: object, **_kw: object) -> dict:
        raise exc
    monkeypatch.setattr(launch, "run", fail)
    code = main([*flags, "run", "plan.json"])
    cap = capsys.readouterr()
    assert cap.out == "" and "Traceback" not in cap.err
    return code, cap.err


def test_failed_workers_exit_with_their_code_and_one_error_line(monkeypatch, capsys):
    code, err = _run_raising(RunFailed(7), monkeypatch, capsys)
    assert code == 7
    assert err.strip() == "error: training workers exited with code 7"


@pytest.mark.parametrize(("sig", "expected"), [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_stopped_run_exits_75_or_130_with_its_one_line_even_under_debug(
        sig, expected, monkeypatch, capsys):
    stop = launch.Stopped(sig, {"preempted_at": 4, "stop_checkpoint": "ckpt/step-4"}, "ckpt")
    for flags in ((), ("--debug",)):
        code, err = _run_raising(stop, monkeypatch, capsys, *flags)
        assert code == expected
        assert err.strip() == str(stop) and "at step 4" in err and "error" not in err


def test_a_quiet_rank_of_a_stopped_run_prints_nothing(monkeypatch, capsys):
    code, err = _run_raising(launch.Stopped(signal.SIGTERM, None, None, quiet=True),
                             monkeypatch, capsys)
    assert code == 75 and err == ""


def test_ctrl_c_before_the_run_exits_130(monkeypatch, capsys):
    code, err = _run_raising(KeyboardInterrupt(), monkeypatch, capsys)
    assert code == 130 and err.strip() in ("", "interrupted")  # (typer itself exits 130)


def test_bad_input_is_one_error_paragraph_and_debug_shows_its_traceback(monkeypatch, capsys):
    code, err = _run_raising(SpecError("field `x`: bad.\n  Fix it."), monkeypatch, capsys)
    assert code == 2 and err.strip() == "error: field `x`: bad. Fix it."
    monkeypatch.setattr(launch, "run", lambda *a, **k: (_ for _ in ()).throw(SpecError("x")))
    with pytest.raises(MoeplanError):
        main(["--debug", "run", "plan.json"])


def test_an_unlisted_exception_is_a_bug_and_keeps_its_traceback(monkeypatch):
    monkeypatch.setattr(launch, "run", lambda *a, **k: (_ for _ in ()).throw(ZeroDivisionError()))
    with pytest.raises(ZeroDivisionError):
        main(["run", "plan.json"])
