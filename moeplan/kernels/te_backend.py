"""The `te` backend: Transformer Engine's FP8/FP4 linears, registered only where TE imports on a GPU.

Why TE: it runs every recipe of the plan (delayed, current, block, MXFP8, NVFP4 scaling) with
fused quantisation kernels, and is what Megatron-LM uses. TE modules own their weights, while
the runtime owns its Parameters (sharding, the distributed optimizer); so each call site gets a
weightless te.Linear / te.GroupedLinear whose weight entries are pointed at the runtime's tensor
before each call, and the call runs under `te.fp8_autocast(enabled=True, fp8_recipe=...)`. TE
keeps the scaling state (amax histories) in that module, one per weight, across steps.

Recipes map to `transformer_engine.common.recipe` (TE docs, "Using FP8 with Transformer
Engine"): DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling,
NVFP4BlockScaling; Format.HYBRID (E4M3 forward, E5M2 gradients) for delayed and current
scaling, Format.E4M3 for block and MXFP8 scaling (Megatron's low-precision guide; `Recipe`).
Feature dimensions TE cannot take in FP8 (not multiples of 16) run the emulated recipe.

This backend is exercised only where TE is installed on a GPU (its tests skip elsewhere); its
absence is never an error — selection then falls back to torch-fp8 or emulated.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .backend import register_backend
from .emulated import EmulatedBackend, QuantisedLinear

#: minimum compute capability per recipe (MXFP8 and NVFP4 need Blackwell's block-scaled GEMMs)
MIN_CAPABILITY = {"fp8-delayed": (8, 9), "fp8-tensorwise": (8, 9), "fp8-blockwise": (9, 0),
                  "mxfp8": (10, 0), "nvfp4": (10, 0)}


def te_importable() -> bool:
    """Transformer Engine's PyTorch bindings import and a CUDA GPU is present."""
    if importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken install (missing CUDA libraries) counts as absent
        return False
    return True


def te_recipe(precision: str) -> Any:
    """The TE recipe object for a plan precision."""
    from transformer_engine.common import recipe

    hybrid, e4m3 = recipe.Format.HYBRID, recipe.Format.E4M3
    if precision == "fp8-delayed":
        return recipe.DelayedScaling(fp8_format=hybrid, amax_history_len=1024,
                                     amax_compute_algo="max")
    if precision == "fp8-tensorwise":
        return recipe.Float8CurrentScaling(fp8_format=hybrid)
    if precision == "fp8-blockwise":
        return recipe.Float8BlockScaling(fp8_format=e4m3)
    if precision == "mxfp8":
        return recipe.MXFP8BlockScaling(fp8_format=e4m3)
    if precision == "nvfp4":
        return recipe.NVFP4BlockScaling()
    raise ValueError(f"no TE recipe for {precision!r}")


def te_supports(precision: str, device: torch.device) -> bool:
    """TE imports, this TE version has the recipe, and the GPU is new enough for it."""
    if precision not in MIN_CAPABILITY or device.type != "cuda" or not te_importable():
        return False
    try:
        te_recipe(precision)
    except (AttributeError, ImportError):
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY[precision]


class TEBackend(EmulatedBackend):
    """te.Linear / te.GroupedLinear under fp8_autocast; permutations are the torch backend's."""

    name = "te"

    def __init__(self, precision: str = "fp8-delayed"):
        import transformer_engine.pytorch as te

        super().__init__(precision)
        self.te, self.te_recipe = te, te_recipe(precision)
        self._modules: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight → TE module

    def _module(self, weight: torch.Tensor, make) -> torch.nn.Module:
        mod = self._modules.get(weight)
        if mod is None:
            mod = self._modules[weight] = make()
        return mod

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        # x (..., in), weight (out, in) → (..., out)
        out_f, in_f = weight.shape
        if out_f % 16 or in_f % 16:
            lead = x.shape[:-1]
            y = QuantisedLinear.apply(x.reshape(-1, in_f), weight, self.recipe,
                                      self.site_state(weight)).view(*lead, out_f)
            return y if bias is None else y + bias
        mod = self._module(weight, lambda: self.te.Linear(
            in_f, out_f, bias=False, params_dtype=weight.dtype, device=weight.device))
        mod._parameters["weight"] = weight  # the runtime's Parameter, not a copy
        with self.te.fp8_autocast(enabled=True, fp8_recipe=self.te_recipe):
            y = mod(x)
        return y if bias is None else y + bias

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor,
                   tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # x (N, in) grouped by expert, weight (E, in, out) → (N, out)
        E, in_f, out_f = weight.shape
        if out_f % 16 or in_f % 16 or not hasattr(self.te, "GroupedLinear"):
            return EmulatedBackend.grouped_mm(self, x, weight, tokens_per_expert)
        te = self.te
        mod = self._module(weight, lambda: te.GroupedLinear(
            E, in_f, out_f, bias=False, params_dtype=weight.dtype, device=weight.device))
        for e in range(E):  # TE GroupedLinear holds weight0..weight{E-1}, each (out, in)
            mod._parameters[f"weight{e}"] = weight[e].t()
        splits = tokens_per_expert.tolist()
        with te.fp8_autocast(enabled=True, fp8_recipe=self.te_recipe):
            if hasattr(te, "Fp8Padding"):  # FP8 GEMMs need each expert's rows aligned
                padded, padded_splits = te.Fp8Padding(E)(x, splits)
                return te.Fp8Unpadding(E)(mod(padded, padded_splits), splits)
            return mod(x, splits)


if te_importable():
    register_backend("te", TEBackend)
