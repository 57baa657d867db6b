"""Which backend runs a plan's precision recipe on this device, and why.

Order (DESIGN "kernels"): bf16 → `torch` (weights' dtype, no quantisation); an FP8/FP4 recipe →
`te` when Transformer Engine imports on this GPU and supports the recipe there; else `torch-fp8`
for fp8-tensorwise on sm_89+; else `emulated` (same recipe by quantise → dequantise, any
device). The reason string is what the worker logs, so a run says which path its GEMMs took.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backend import KernelBackend, get_backend
from .te_backend import te_importable, te_supports
from .torch_fp8 import scaled_mm_available


class BackendChoice(NamedTuple):
    backend: KernelBackend
    reason: str  # e.g. "fp8-delayed: emulated backend (no GPU)"


def choose_backend(precision: str, device: torch.device | str = "cpu") -> BackendChoice:
    """The backend for `precision` on `device`, with the reason for the choice."""
    device = torch.device(device)
    if precision == "bf16":
        return BackendChoice(get_backend("torch"), "bf16: torch backend")
    if device.type == "cuda" and te_supports(precision, device):
        return BackendChoice(get_backend("te", precision=precision),
                             f"{precision}: te backend (Transformer Engine)")
    if precision == "fp8-tensorwise" and device.type == "cuda" and scaled_mm_available(device):
        return BackendChoice(get_backend("torch-fp8", precision=precision),
                             f"{precision}: torch-fp8 backend (torch._scaled_mm)")
    if device.type != "cuda":
        why = "no GPU"
    elif te_importable():
        why = "Transformer Engine does not run this recipe on this GPU"
    else:
        why = "no Transformer Engine" + ("" if precision == "fp8-tensorwise" else
                                        "; torch-fp8 runs fp8-tensorwise only")
        if precision == "fp8-tensorwise":
            why += ", GPU older than sm_89"
    return BackendChoice(get_backend("emulated", precision=precision),
                         f"{precision}: emulated backend ({why})")


def backend_for(precision: str, device: torch.device | str = "cpu") -> KernelBackend:
    """`choose_backend(...).backend`."""
    return choose_backend(precision, device).backend
