"""Static memory per GPU: weights, gradients and optimizer states of the parameters it holds.

Bytes per parameter in BF16 mixed precision (Megatron `theoretical_memory_usage.py`; the
Megatron Core MoE report): bf16 weight 2 + fp32 main gradient 4 = 6 always (the main gradient
is bf16, 2 bytes, with `--grad-reduce-in-bf16`); fp32 master weight
4 + Adam m and v (4 + 4, or 2 + 2 with BF16 moments) = 12 (8), divided by d with the distributed
optimizer, where d = dp·cp for dense parameters and d = edp for expert parameters. A fraction of
the optimizer states may live on the host (`--optimizer-cpu-offload`).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class StaticMemory:
    """Weights, gradients and optimizer bytes on one GPU."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def static_memory(dense_params: float, expert_params: float, dense_shards: int,
                  expert_shards: int, moments_bytes: int = 4, distributed_optimizer: bool = True,
                  optimizer_offload_fraction: float = 0.0, grad_bytes: int = 4) -> StaticMemory:
    """Bytes of weights (bf16), main grads (`grad_bytes`: fp32, or bf16 when gradients are
    reduced in bf16) and optimizer states (fp32 master + 2 moments).

    `dense_shards`/`expert_shards` are dp·cp and edp; they only shard the optimizer states when
    the distributed optimizer is on.
    """
    params = dense_params + expert_params
    per_param = 4 + 2 * moments_bytes
    if distributed_optimizer:
        opt = per_param * (dense_params / dense_shards + expert_params / expert_shards)
    else:
        opt = per_param * params
    return StaticMemory(2.0 * params, float(grad_bytes) * params,
                        opt * (1.0 - optimizer_offload_fraction))
