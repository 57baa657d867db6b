"""The `torch` backend: plain PyTorch ops in the weights' dtype (fp32 or bf16).

Grouped GEMM uses `torch._grouped_mm` where this torch build supports it for the shapes at hand
(rows 16-byte aligned), else one GEMM per expert: both are exact, so the choice never changes
results beyond float rounding. Permutation is a stable sort by expert id plus index ops; there is
no Python loop over tokens anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .backend import register_backend


def _grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`torch._grouped_mm` needs 16-byte aligned row strides of both operands and the output."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    item = x.element_size()
    return (x.shape[1] * item) % 16 == 0 and (weight.shape[2] * item) % 16 == 0


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    # _grouped_mm's backward rejects expanded (stride-0) gradients, e.g. from `.sum()`.
    return grad.contiguous()


class NoTokens(torch.autograd.Function):
    """A GEMM without rows: (0, width) out, zero gradients, one autograd node.

    Ranks whose experts received no tokens run this where their peers run a GEMM, so every
    rank's autograd graph has the same shape and backward reaches the TP and EP collectives in
    the same order (another shape reorders independent branches and deadlocks them).
    `torch._grouped_mm` cannot take zero rows in backward, and skipping the GEMM drops the node.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, width: int) -> torch.Tensor:
        ctx.shapes = (x.shape, weight.shape)
        return x.new_zeros(0, width)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xs, ws = ctx.shapes
        return dy.new_zeros(xs), dy.new_zeros(ws), None


class TorchBackend:
    """Reference backend: what every other backend must match."""

    name = "torch"

    def __init__(self, use_grouped_mm: bool = True):
        self.use_grouped_mm = use_grouped_mm

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def extra_state(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """State the backend keeps between steps (none here; FP8 recipes keep amax histories)."""
        return {}

    def load_extra_state(self, params: Mapping[str, torch.Tensor],
                         state: Mapping[str, torch.Tensor]) -> int:
        return 0

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor,
                   tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # x (N, in) rows grouped by expert; weight (E, in, out); tokens_per_expert (E,) → (N, out)
        if self.use_grouped_mm and _grouped_mm_supported(x, weight):
            if x.shape[0] == 0:  # one node, like the grouped GEMM (see NoTokens)
                return NoTokens.apply(x, weight, weight.shape[2])
            offs = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
            y = torch._grouped_mm(x, weight, offs=offs)
            if y.requires_grad:
                y.register_hook(_contiguous_grad)
            return y
        return self.grouped_mm_loop(x, weight, tokens_per_expert)

    @staticmethod
    def grouped_mm_loop(x: torch.Tensor, weight: torch.Tensor,
                        tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """One GEMM per expert (a loop over experts, never over tokens)."""
        counts = tokens_per_expert.tolist()
        chunks = torch.split(x, counts, dim=0)
        outs = [c @ weight[e] for e, c in enumerate(chunks)]
        if not outs:
            return x.new_zeros(0, weight.shape[2])
        return torch.cat(outs, dim=0)

    def permute(self, x: torch.Tensor, expert_of_copy: torch.Tensor,
                num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x (T, h); expert_of_copy (T, k) → copies (T·k, h) sorted by expert (stable: token order
        # within an expert), order (T·k,) index into the flattened (T, k), counts (E,)
        k = expert_of_copy.shape[1]
        flat = expert_of_copy.reshape(-1)  # (T·k,)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts)
        copies = x.index_select(0, order // k)  # (T·k, h)
        return copies, order, counts

    def unpermute(self, y: torch.Tensor, order: torch.Tensor, probs: torch.Tensor,
                  num_tokens: int) -> torch.Tensor:
        # y (T·k, h) sorted; probs (T, k) → out (T, h) = Σ_k probs[t, k] · y[copy (t, k)]
        k = probs.shape[1]
        weighted = y * probs.reshape(-1).index_select(0, order).unsqueeze(1).to(y.dtype)
        out = y.new_zeros(num_tokens, y.shape[1])
        return out.index_add(0, order // k, weighted)


register_backend("torch", TorchBackend)
