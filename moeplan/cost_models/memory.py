"""Static memory per GPU: weights, gradients and optimizer states of the parameters it holds.

Bytes per parameter in BF16 mixed precision (Megatron `theoretical_memory_usage.py`; the
Megatron Core MoE report): bf16 weight 2 + fp32 main gradient 4 = 6 always (the main gradient
is bf16, 2 bytes, with `--grad-reduce-in-bf16`); fp32 master weight
4 + Adam m and v (4 + 4, or 2 + 2 with BF16 moments) = 12 (8), divided by d with the distributed
optimizer, where d = dp·cp for dense parameters and d = edp for expert parameters. A fraction of
the optimizer states may live on the host (`--optimizer-cpu-offload`).

Under an FP8 or FP4 recipe Transformer Engine quantizes each GEMM weight once per step, on the
first micro-batch, and keeps the quantized copies for the others (its weight workspace,
`get_weight_workspace` with Megatron passing `is_first_microbatch`): the row-wise copy of the
forward and the column-wise one of the data-gradient GEMM, twice the recipe's bytes per element
per GEMM parameter beside the bf16 weight (`weight_bytes`). With `--fp8-param-gather` the
parameters are those quantized tensors and no bf16 weight is kept (Megatron's "mxfp8 without ...
fp8_param_gather will use significant amount additional GPU memory", optimizer_config.py). The
embedding and output layer run no quantized GEMM.

What moves to the host lives in the node's host memory (`host`, checked against
`ClusterSpec.host_memory_gb` × HOST_USABLE by `estimate`): Megatron's HybridDeviceOptimizer
keeps, for the offloaded share of a rank's optimizer shard, a pinned fp32 copy of each
parameter, an fp32 gradient copy the backward's gradients are copied into, and the Adam
moments (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py): 4 + 4 + 2 × moment bytes
per parameter; fine-grained activation offloading holds each in-flight micro-batch's offloaded
tensors there until its backward.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
HOST_USABLE = 0.8
"""Share of the host memory per GPU (`ClusterSpec.host_memory_gb`, the node's memory over its
GPUs) one training process may fill with offloaded state: the rest keeps the operating system,
the page cache the data loader reads through, the CUDA driver's pinned staging buffers and the
Python process itself. A prior, not a fit: no published run reports its host memory."""


@dataclass(frozen=True)
class StaticMemory:
    """Weights, gradients and optimizer bytes on one GPU."""

    weights: float
    grads: float
    optimizer: float
    host: float = 0.0  # on the host: the offloaded optimizer share and its gradient copies

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def static_memory(dense_params: float, expert_params: float, dense_shards: int,
                  expert_shards: int, moments_bytes: int = 4, distributed_optimizer: bool = True,
                  optimizer_offload_fraction: float = 0.0, grad_bytes: int = 4,
                  gemm_weight_bytes: float = 2.0, embedding_params: float = 0.0
                  ) -> StaticMemory:
    """Bytes of weights, main grads (`grad_bytes`: fp32, or bf16 when gradients are reduced in
    bf16) and optimizer states (fp32 master + 2 moments).

    `dense_shards`/`expert_shards` are dp·cp and edp; they only shard the optimizer states when
    the distributed optimizer is on. `gemm_weight_bytes`: what a GEMM weight holds per
    parameter (`weight_bytes`: 2 in bf16, more with a recipe's quantized copies); the
    `embedding_params` among the dense ones hold a bf16 weight whatever the recipe.
    """
    params = dense_params + expert_params
    gemm = params - embedding_params
    per_param = 4 + 2 * moments_bytes
    shard = (dense_params / dense_shards + expert_params / expert_shards
             if distributed_optimizer else params)
    f = optimizer_offload_fraction
    return StaticMemory(2.0 * embedding_params + gemm_weight_bytes * gemm,
                        float(grad_bytes) * params, per_param * shard * (1.0 - f),
                        (per_param + 4) * shard * f)


def weight_bytes(quantized_bytes: float | None, fp8_param_gather: bool) -> float:
    """Bytes a GEMM weight holds per parameter: bf16 (2) alone; under a recipe whose operands
    take `quantized_bytes` per element, also the row-wise and column-wise copies Transformer
    Engine keeps through the step, or those copies alone when the parameters are them
    (`--fp8-param-gather`). See the module docstring."""
    if quantized_bytes is None:
        return 2.0
    copies = 2.0 * quantized_bytes
    return copies if fp8_param_gather else 2.0 + copies
