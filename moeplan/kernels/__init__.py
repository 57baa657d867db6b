"""Compute backends: the GEMMs, grouped GEMMs and token permutations the runtime calls.

One registry, chosen at start-up (`get_backend`). Every backend implements `KernelBackend`, so the
runtime never branches on the backend and FP8 backends (`te` with Transformer Engine, `emulated`
with quantise/dequantise on any device) plug in by registering another implementation. The
`torch` backend is the reference every other backend is tested against.
"""

from .backend import KernelBackend, available_backends, get_backend, register_backend
from .torch_backend import TorchBackend

__all__ = ["KernelBackend", "TorchBackend", "available_backends", "get_backend",
           "register_backend"]
