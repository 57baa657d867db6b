"""Compute backends: the GEMMs, grouped GEMMs and token permutations the runtime calls.

One registry, chosen at start-up (`choose_backend` picks by precision recipe and device). Every backend implements `KernelBackend`, so the
runtime never branches on the backend and FP8 backends (`te` with Transformer Engine, `emulated`
with quantise/dequantise on any device) plug in by registering another implementation. The
`torch` backend is the reference every other backend is tested against.
"""

from .backend import KernelBackend, available_backends, get_backend, register_backend
from .emulated import FP8_RECIPES, EmulatedBackend, Recipe
from .select import BackendChoice, backend_for, choose_backend
from .te_backend import te_importable
from .torch_backend import TorchBackend
from .torch_fp8 import TorchFp8Backend, scaled_mm_available

__all__ = ["FP8_RECIPES", "BackendChoice", "EmulatedBackend", "KernelBackend", "Recipe",
           "TorchBackend", "TorchFp8Backend", "available_backends", "backend_for",
           "choose_backend", "get_backend", "register_backend", "scaled_mm_available",
           "te_importable"]
