"""The `torch-fp8` backend: `fp8-tensorwise` GEMMs through `torch._scaled_mm` (Hopper and newer).

Why a torch-native FP8 path: it needs nothing beyond PyTorch on an sm_89+ GPU and runs the same
recipe as the `emulated` backend (per-tensor current scaling, E4M3 forward / E5M2 gradients,
TE Float8CurrentScaling), so the two are interchangeable numerically and the emulated one is
this one's CPU reference. `torch._scaled_mm` takes FP8 operands with per-tensor fp32 dequant
scales (scale_a, scale_b), the second operand column-major, and accumulates in fp32.

Shapes: `_scaled_mm` needs every GEMM dimension a multiple of 16. Rows (tokens) are zero-padded
to 16 (zero rows change neither amax nor results); a GEMM whose feature dimensions are not
multiples of 16 runs the emulated recipe instead — the same numerics, without the speed.
On a CPU or a GPU older than sm_89 the backend refuses to run (it is never selected there).
"""

from __future__ import annotations

import torch

from ..errors import NotYetAvailable
from .backend import register_backend
from .emulated import EmulatedBackend, QuantisedLinear, SiteState
from .quant import FP8_DTYPES, FP8_MAX, scale_from_amax


def scaled_mm_available(device: torch.device | None = None) -> bool:
    """A CUDA device of compute capability 8.9 (Ada) or newer, and a torch with _scaled_mm."""
    if not (hasattr(torch, "_scaled_mm") and torch.cuda.is_available()):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _to_fp8(t: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling → (FP8 tensor, fp32 dequant scale = amax / fp8_max)."""
    scale = scale_from_amax(t.detach().abs().amax().float(), FP8_MAX[fmt])
    m = FP8_MAX[fmt]
    return (t.float() * scale).clamp(-m, m).to(FP8_DTYPES[fmt]), scale.reciprocal()


def _scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) row-major FP8 @ b (K, N) column-major FP8 → (M, N) in out_dtype."""
    out = torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out  # older torch returned (out, amax)


def _pad_rows(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    pad = -t.shape[0] % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


class ScaledMmLinear(torch.autograd.Function):
    """fprop Q(x)·Q(W)ᵀ, dgrad Q(dy)·Q(W), wgrad Q(dy)ᵀ·Q(x) as three `_scaled_mm` calls."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # x (M, K), weight (N, K) → (M, N)
        M = x.shape[0]
        xq, xs = _to_fp8(_pad_rows(x.contiguous()), "e4m3")  # (M16, K)
        wq, ws = _to_fp8(weight.contiguous(), "e4m3")  # (N, K)
        y = _scaled_mm(xq, xs, wq.t(), ws, x.dtype)[:M]
        ctx.save_for_backward(xq, xs, wq, ws)
        ctx.M, ctx.dtypes = M, (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = _to_fp8(_pad_rows(dy.contiguous()), "e5m2")  # (M16, N)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (N, K); W column-major
            dx = _scaled_mm(gq, gs, wq.t().contiguous().t(), ws, ctx.dtypes[0])[:ctx.M]
        if ctx.needs_input_grad[1]:  # (N, M) @ (M, K); x column-major
            dw = _scaled_mm(gq.t().contiguous(), gs, xq.t().contiguous().t(), xs, ctx.dtypes[1])
        return dx, dw


class TorchFp8Backend(EmulatedBackend):
    """`fp8-tensorwise` with real FP8 GEMMs; the emulated recipe for unaligned feature dims."""

    name = "torch-fp8"

    def __init__(self, precision: str = "fp8-tensorwise", fp8_format: str | None = "hybrid"):
        if precision != "fp8-tensorwise" or fp8_format != "hybrid":
            raise NotYetAvailable(f"the torch-fp8 backend runs fp8-tensorwise (hybrid) only, "
                                  f"not {precision} ({fp8_format}).")
        super().__init__(precision, fp8_format)

    def check_device(self, x: torch.Tensor) -> None:
        """Refuse anything but an sm_89+ CUDA device (the GEMMs would not be FP8 kernels)."""
        if x.device.type != "cuda" or not scaled_mm_available(x.device):
            raise NotYetAvailable("the torch-fp8 backend needs torch._scaled_mm on a CUDA GPU "
                                  "of compute capability 8.9 or newer; use the emulated backend.")

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, state: SiteState) -> torch.Tensor:
        self.check_device(x)
        if weight.shape[0] % 16 or weight.shape[1] % 16:
            return QuantisedLinear.apply(x, weight, self.recipe, state)
        self.recipe.calls += 1
        return ScaledMmLinear.apply(x, weight)


register_backend("torch-fp8", TorchFp8Backend)
