"""The kernel backend interface and its registry.

Why an interface: the runtime's layers (linears, the MoE expert GEMMs, the dispatcher's
permutation) must run unchanged whether the GEMMs are plain torch, Transformer Engine FP8 or an
emulated FP8 recipe. Each backend is a small object with the same few methods; a precision
recipe chooses the backend, the layers only call it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from ..errors import NotYetAvailable


class KernelBackend(Protocol):
    """What the runtime asks of a compute backend (shapes in the comments of each method)."""

    name: str

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) @ weight(out, in)^T (+ bias) → (..., out)."""
        ...

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor,
                   tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x (N, in) sorted by expert, weight (E, in, out), counts (E,) → (N, out)."""
        ...

    def permute(self, x: torch.Tensor, expert_of_copy: torch.Tensor,
                num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of tokens sorted by expert.

        x (T, h), expert_of_copy (T, k) → (sorted copies (T·k, h), order (T·k,) flat index of
        each sorted copy into (T, k), tokens per expert (E,)).
        """
        ...

    def unpermute(self, y: torch.Tensor, order: torch.Tensor, probs: torch.Tensor,
                  num_tokens: int) -> torch.Tensor:
        """Weighted sum back to tokens: y (T·k, h) sorted, order (T·k,), probs (T, k) → (T, h)."""
        ...

    def extra_state(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors the backend carries from step to step (FP8 amax histories) for the GEMMs of
        `params` (name → this rank's Parameter), flat and by name, for checkpoints."""
        ...

    def load_extra_state(self, params: Mapping[str, torch.Tensor],
                         state: Mapping[str, torch.Tensor]) -> int:
        """Restore `extra_state`'s tensors; returns how many sites were restored."""
        ...


_REGISTRY: dict[str, Callable[..., KernelBackend]] = {}


def register_backend(name: str, factory: Callable[..., KernelBackend]) -> None:
    """Make a backend selectable by name (FP8 backends call this when importable)."""
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str = "torch", **options: object) -> KernelBackend:
    """The backend called `name`, built with `options` (e.g. precision="fp8-delayed");
    NotYetAvailable when this version or machine has none by that name."""
    if name not in _REGISTRY:
        raise NotYetAvailable(f"kernel backend {name!r} is not available here "
                              f"(available: {', '.join(available_backends())}).")
    return _REGISTRY[name](**options)
