"""Fake quantisers: round a tensor to FP8/FP4 with a scaling recipe and return it dequantised.

Why quantise → dequantise: the GEMM then runs in fp32 on any device, yet every operand carries
exactly the rounding a real FP8/FP4 GEMM would see (the GEMM itself accumulates in fp32 on
Hopper/Blackwell too), so the recipes' numerics can be trained and tested on a CPU.

Each function takes a 2-D operand whose reduction (K) dimension is `k_dim` and returns an fp32
tensor of the same shape. The recipes follow their public definitions:

- per-tensor current scaling (`fp8-tensorwise`): scale = fp8_max / amax(tensor), Transformer
  Engine `recipe.Float8CurrentScaling` (TE docs, "FP8 current scaling");
- delayed scaling (`fp8-delayed`): the scale comes from an amax history of earlier calls,
  TE `recipe.DelayedScaling` (defaults amax_history_len=1024, amax_compute_algo="max",
  margin=0, fp8_format=HYBRID) — see `DelayedScalingState`;
- blockwise (`fp8-blockwise`): 1×128 tiles for activations and gradients, 128×128 blocks for
  weights, DeepSeek-V3 technical report §3.3.2 "Fine-grained quantization" and TE
  `recipe.Float8BlockScaling` (power-of-two scales by default);
- MXFP8 (`mxfp8`): 32-element blocks along K sharing an E8M0 (power-of-two) scale, OCP
  Microscaling Formats (MX) v1.0 spec §5; the exponent is rounded up so no element saturates,
  as in NVIDIA's MXFP8 recipe (Mishra et al. 2025, "Recipes for Pre-training LLMs with MXFP8")
  and TE `recipe.MXFP8BlockScaling`;
- NVFP4 (`nvfp4`): E2M1 elements in 16-element blocks with an E4M3 block scale and a per-tensor
  fp32 scale (NVIDIA, "Pretraining Large Language Models with NVFP4", 2025, §2; TE
  `recipe.NVFP4BlockScaling`): 1×16 blocks for activations and gradients, 16×16 for weights.
  Not emulated: the random Hadamard transform on weight-gradient inputs and stochastic rounding
  of gradients (round-to-nearest-even is used everywhere).

Casts saturate at the format's largest finite value, as TE's casts do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # largest finite E4M3 (fn) and E5M2 values
FP8_EMAX = {"e4m3": 8, "e5m2": 15}  # exponent of the largest normal (OCP MX spec Table 2)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the 8 E2M1 magnitudes (OCP MX spec §5.3.3)
E2M1_MAX = 6.0


def cast_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round to E4M3 / E5M2 (nearest-even, saturating) and back to fp32."""
    m = FP8_MAX[fmt]
    return x.float().clamp(-m, m).to(FP8_DTYPES[fmt]).float()


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the E2M1 grid {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}, nearest with ties to the even
    mantissa (the even grid index), saturating at ±6."""
    grid = torch.tensor(E2M1_GRID, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2  # (7,)
    a = x.float().abs().clamp(max=E2M1_MAX).contiguous()
    idx = torch.bucketize(a, mids)  # mids[i-1] < a <= mids[i] → i (ties round down)
    tie = (a == mids[idx.clamp(max=len(mids) - 1)]) & (idx % 2 == 1)
    return torch.sign(x.float()) * grid[idx + tie.long()]


def scale_from_amax(amax: torch.Tensor, fmax: float, pow2: bool = False) -> torch.Tensor:
    """fp8_max / amax, 1 where amax is 0 (TE keeps the scale then); power of two (rounded down,
    so nothing saturates) when asked."""
    scale = torch.where(amax > 0, fmax / amax.clamp(min=torch.finfo(torch.float32).tiny),
                        torch.ones_like(amax))
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def quantise_tensorwise(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Per-tensor current scaling: one scale = fp8_max / amax(x) (TE Float8CurrentScaling)."""
    scale = scale_from_amax(x.detach().abs().amax().float(), FP8_MAX[fmt])
    return cast_fp8(x.float() * scale, fmt) / scale


def _blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """x (M, K) zero-padded to whole blocks → (M/rows, rows, K/cols, cols), and (M, K)."""
    M, K = x.shape
    pm, pk = -M % rows, -K % cols
    xp = torch.nn.functional.pad(x.float(), (0, pk, 0, pm))
    return xp.view((M + pm) // rows, rows, (K + pk) // cols, cols), (M, K)


def _unblock(xb: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    a, r, b, c = xb.shape
    return xb.reshape(a * r, b * c)[:shape[0], :shape[1]]


def _oriented(x: torch.Tensor, k_dim: int) -> torch.Tensor:
    """View with K last, so 1-D blocks always run along the reduction dimension."""
    return x if k_dim == x.dim() - 1 else x.transpose(0, 1)


def quantise_blockwise(x: torch.Tensor, fmt: str, block: tuple[int, int], k_dim: int = 1,
                       pow2: bool = True) -> torch.Tensor:
    """FP8 with one scale per (rows × cols) block, cols along K (DeepSeek-V3 §3.3.2: 1×128 tiles
    for activations/gradients, 128×128 blocks for weights; TE Float8BlockScaling)."""
    xo = _oriented(x, k_dim)
    xb, shape = _blocks(xo, *block)
    amax = xb.detach().abs().amax(dim=(1, 3), keepdim=True)  # (M/r, 1, K/c, 1)
    scale = scale_from_amax(amax, FP8_MAX[fmt], pow2)
    out = _unblock(cast_fp8(xb * scale, fmt) / scale, shape)
    return _oriented(out, k_dim)


def mx_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """E8M0 dequantisation scale 2^e of an MX block: the smallest power of two with
    amax / 2^e <= fp8_max (rounded up, NVIDIA's MXFP8 recipe), e clamped to E8M0's [-127, 127].
    The OCP spec's floor(log2 amax) - emax can saturate the block's largest element instead."""
    safe = amax.clamp(min=torch.finfo(torch.float32).tiny)
    e = torch.ceil(torch.log2(safe / FP8_MAX[fmt])).clamp(-127, 127)
    return torch.where(amax > 0, torch.exp2(e), torch.ones_like(amax))


def quantise_mxfp8(x: torch.Tensor, fmt: str, k_dim: int = 1, block_size: int = 32) -> torch.Tensor:
    """MXFP8: 32 consecutive elements along K share one E8M0 scale (OCP MX v1.0 §5)."""
    xo = _oriented(x, k_dim)
    xb, shape = _blocks(xo, 1, block_size)
    scale = mx_scale(xb.detach().abs().amax(dim=(1, 3), keepdim=True), fmt)
    out = _unblock(cast_fp8(xb / scale, fmt) * scale, shape)
    return _oriented(out, k_dim)


def quantise_nvfp4(x: torch.Tensor, block: tuple[int, int] = (1, 16),
                   k_dim: int = 1) -> torch.Tensor:
    """NVFP4 two-level scaling (NVIDIA NVFP4 pretraining paper §2, eq. 1–3).

    Global encode scale s = 6·448 / amax(x) (fp32); each block's decode scale amax_b / 6 is
    stored in E4M3 after multiplying by s; elements are x · s / scale_b rounded to E2M1, and
    dequantise as q · scale_b / s.
    """
    xo = _oriented(x, k_dim)
    xb, shape = _blocks(xo, *block)
    amax = xb.detach().abs().amax()
    s_enc = scale_from_amax(amax, E2M1_MAX * FP8_MAX["e4m3"])
    amax_b = xb.detach().abs().amax(dim=(1, 3), keepdim=True)
    scale_b = cast_fp8(amax_b / E2M1_MAX * s_enc, "e4m3")  # E4M3 block scale (× s)
    safe = torch.where(scale_b > 0, scale_b, torch.ones_like(scale_b))
    q = round_e2m1(xb * s_enc / safe)
    out = _unblock(torch.where(scale_b > 0, q * safe / s_enc, torch.zeros_like(q)), shape)
    return _oriented(out, k_dim)


@dataclass
class DelayedScalingState:
    """Amax history of one tensor role at one GEMM call site (TE DelayedScaling).

    Each call quantises with the scale derived from the history *before* it, then records its
    own amax; so a call never sees its own amax (the first call uses scale 1, TE's initial
    value). scale = fp8_max / (max or most-recent amax of the window) / 2^margin; an all-zero
    history keeps the previous scale.
    """

    fmt: str
    history_len: int = 1024
    algo: str = "max"  # "max" | "most_recent"
    margin: int = 0
    history: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    calls: int = field(default=0)

    def quantise(self, x: torch.Tensor) -> torch.Tensor:
        if self.history is None or self.history.device != x.device:
            self.history = torch.zeros(self.history_len, device=x.device)
            self.scale = torch.ones((), device=x.device)
        assert self.scale is not None
        out = cast_fp8(x.float() * self.scale, self.fmt) / self.scale
        self.history[self.calls % self.history_len] = x.detach().abs().amax().float()
        self.calls += 1
        amax = (self.history.max() if self.algo == "max"
                else self.history[(self.calls - 1) % self.history_len])
        new = FP8_MAX[self.fmt] / amax.clamp(min=torch.finfo(torch.float32).tiny) / 2 ** self.margin
        self.scale = torch.where(amax > 0, new, self.scale)
        return out


def e8m0_is_power_of_two(scale: torch.Tensor) -> bool:
    """True when every entry is an exact power of two (what an E8M0 scale can hold)."""
    m, _ = torch.frexp(scale.float())
    return bool((m.abs() == 0.5).all())
