"""Exception types the CLI maps onto exit codes.

One table (`EXIT_CODES` in cli.py) turns these into process exit codes, so library code raises
meaningful errors and never calls `sys.exit` itself.
"""

from __future__ import annotations


class MoeplanError(Exception):
    """Bad input from the user: exit code 2, one clear paragraph, no traceback."""

    exit_code = 2


class SpecError(MoeplanError):
    """A model, cluster, training or plan description is invalid; the message names the field."""


class LayoutError(MoeplanError):
    """A layout breaks one or more of Megatron Core's validity rules (each named)."""

    def __init__(self, violations: list[tuple[str, str]]):
        self.violations = violations
        lines = "; ".join(f"[{rule}] {why}" for rule, why in violations)
        super().__init__(f"invalid layout: {lines}")


class NotYetAvailable(MoeplanError):
    """A command or plan feature that this version does not execute; never faked."""


class InfeasibleError(Exception):
    """Nothing fits: exit code 3, with what came closest and why."""

    exit_code = 3
