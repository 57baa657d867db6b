"""The `emulated` backend: FP8/FP4 precision recipes as quantise → dequantise around fp32 GEMMs.

Why: FP8 numerics (and their effect on training) should be testable and trainable on any device,
with the same scaling recipes Transformer Engine and Megatron use (see `quant.py` for each
recipe's source). Only the GEMMs of linears and expert GEMMs go through a recipe; the caller
keeps router, embedding, output layer and optimizer in high precision, as Megatron does.

Every GEMM of a linear y = x Wᵀ quantises its operands along its own reduction dimension, as a
real FP8 GEMM must (TE quantises row- and column-wise copies for the same reason):

    fprop  y  = Q(x) Q(W)ᵀ           E4M3 × E4M3
    dgrad  dx = Q(dy) Q(W)           E5M2 × E4M3   (hybrid format, Megatron --fp8-format hybrid;
    wgrad  dW = Q(dy)ᵀ Q(x)          E5M2 × E4M3    E4M3 for blockwise and mxfp8, see `Recipe`)

Gradients are quantised in the custom autograd Function's backward. Bias is added (and its
gradient taken) in high precision. Expert GEMMs quantise each expert's GEMM on its own, like
TE GroupedLinear (one quantiser per GEMM).

State: delayed scaling needs an amax history per tensor role per GEMM call site. The backend
keeps it keyed by the weight Parameter (a weak-identity map, so it lives as long as the weight
and across steps; for expert weights also by expert index). The optimizer updates weights in
place, so the key is stable for the whole run. `extra_state`/`load_extra_state` export and restore
the histories by parameter name, so a checkpoint resumed under the same plan continues them
exactly (TE keeps the same state as a module's extra state). Not emulated: TE's amax
all-reduce over the data/tensor-parallel group (each rank keeps its own history), and TE's replay
of the forward's scales when activation recompute runs a forward again (here the recomputed
forward records another amax and uses the advanced scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .backend import register_backend
from .quant import (
    DelayedScalingState,
    quantise_blockwise,
    quantise_mxfp8,
    quantise_nvfp4,
    quantise_tensorwise,
)
from .torch_backend import NoTokens, TorchBackend

FP8_RECIPES = ("fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "mxfp8", "nvfp4")
DEFAULT_FP8_FORMAT = {"fp8-delayed": "hybrid", "fp8-tensorwise": "hybrid", "fp8-blockwise": "e4m3",
                      "mxfp8": "e4m3", "nvfp4": "e4m3"}  # nvfp4: E2M1 throughout, unused
SiteState = dict[str, DelayedScalingState]  # role ("input" | "weight" | "grad") → history


@dataclass
class Recipe:
    """One precision recipe's quantiser for the three GEMM operands.

    fp8_format "hybrid": E4M3 forward, E5M2 gradients (TE Format.HYBRID, Megatron's
    --fp8-format hybrid); "e4m3": E4M3 everywhere. None takes the recipe's default, the pairing
    of Megatron's low-precision guide that `moeplan export` writes too: hybrid for fp8-delayed
    and fp8-tensorwise, e4m3 for fp8-blockwise and mxfp8 (also TE Float8BlockScaling's and
    MXFP8BlockScaling's defaults). NVFP4 is E2M1 for every operand.
    Delayed scaling takes TE DelayedScaling's defaults (window 1024, max of the window, margin 0).
    """

    precision: str
    fp8_format: str | None = None
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    calls: int = field(default=0)  # operands quantised so far (tests check the path ran)

    def __post_init__(self) -> None:
        if self.precision not in FP8_RECIPES:
            raise ValueError(f"precision {self.precision!r} is not an FP8/FP4 recipe "
                             f"({', '.join(FP8_RECIPES)})")
        if self.fp8_format is None:
            self.fp8_format = DEFAULT_FP8_FORMAT[self.precision]
        if self.fp8_format not in ("hybrid", "e4m3"):
            raise ValueError(f"fp8_format takes hybrid or e4m3, got {self.fp8_format!r}")

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor: the same quantised copy serves every GEMM orientation."""
        return self.precision in ("fp8-delayed", "fp8-tensorwise")

    def fmt(self, role: str) -> str:
        return "e5m2" if role == "grad" and self.fp8_format == "hybrid" else "e4m3"

    def quantise(self, t: torch.Tensor, role: str, k_dim: int, state: SiteState) -> torch.Tensor:
        """t (2-D) with reduction dimension `k_dim` → its fp32 dequantised copy."""
        self.calls += 1
        p, fmt = self.precision, self.fmt(role)
        if p == "fp8-tensorwise":
            return quantise_tensorwise(t, fmt)
        if p == "fp8-delayed":
            if role not in state:
                state[role] = DelayedScalingState(fmt, self.amax_history_len,
                                                  self.amax_compute_algo, self.margin)
            return state[role].quantise(t)
        if p == "fp8-blockwise":
            return quantise_blockwise(t, fmt, (128, 128) if role == "weight" else (1, 128), k_dim)
        if p == "mxfp8":
            return quantise_mxfp8(t, fmt, k_dim)
        return quantise_nvfp4(t, (16, 16) if role == "weight" else (1, 16), k_dim)

    @property
    def weight_blocks_2d(self) -> bool:
        """Weights scaled in square blocks: one quantised copy serves fprop and dgrad."""
        return self.precision in ("fp8-blockwise", "nvfp4")


class QuantisedLinear(torch.autograd.Function):
    """y = Q(x) Q(W)ᵀ with the recipe's quantisers in forward and backward (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe,
                state: SiteState) -> torch.Tensor:
        # x (M, K), weight (N, K) → (M, N) in x's dtype
        xq = recipe.quantise(x, "input", 1, state)
        wq = recipe.quantise(weight, "weight", 1, state)
        if recipe.per_tensor:
            ctx.save_for_backward(xq, wq)
        else:  # other orientations are quantised again from the originals in backward
            ctx.save_for_backward(xq, wq, x, weight)
        ctx.recipe, ctx.state, ctx.dtypes = recipe, state, (x.dtype, weight.dtype)
        return (xq @ wq.t()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        r: Recipe = ctx.recipe
        xq, wq, *orig = ctx.saved_tensors
        g = r.quantise(dy, "grad", 1, ctx.state)  # (M, N), blocks along N for dgrad
        if r.per_tensor:
            g_col, x_col, w_col = g, xq, wq
        else:
            x, w = orig
            g_col = r.quantise(dy, "grad", 0, ctx.state)  # blocks along M for wgrad
            x_col = r.quantise(x, "input", 0, ctx.state)
            w_col = wq if r.weight_blocks_2d else r.quantise(w, "weight", 0, ctx.state)
        dx = (g @ w_col).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None  # (M, K)
        dw = (g_col.t() @ x_col).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None  # (N, K)
        return dx, dw, None, None


class EmulatedBackend(TorchBackend):
    """FP8/FP4 recipes by fake quantisation; permutations are the torch backend's."""

    name = "emulated"

    def __init__(self, precision: str = "fp8-tensorwise", fp8_format: str | None = None,
                 amax_history_len: int = 1024, amax_compute_algo: str = "max", margin: int = 0):
        super().__init__()
        self.precision = precision
        self.recipe = Recipe(precision, fp8_format, amax_history_len, amax_compute_algo, margin)
        self._sites: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight → {expert: SiteState}

    def site_state(self, weight: torch.Tensor, expert: int = 0) -> SiteState:
        """The amax histories of the GEMM that uses `weight` (expert `expert` of a stack)."""
        per_weight = self._sites.get(weight)
        if per_weight is None:
            per_weight = self._sites[weight] = {}
        return per_weight.setdefault(expert, {})

    def extra_state(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The delayed-scaling histories of the GEMMs of `params` (name → this rank's
        Parameter), as flat tensors under "NAME/EXPERT/ROLE/{history,scale,calls}"."""
        out: dict[str, torch.Tensor] = {}
        for name, p in params.items():
            for expert, site in (self._sites.get(p) or {}).items():
                for role, st in site.items():
                    if st.history is None or st.scale is None:
                        continue
                    key = f"{name}/{expert}/{role}"
                    out[f"{key}/history"] = st.history.detach().clone()
                    out[f"{key}/scale"] = st.scale.detach().clone().reshape(1)
                    out[f"{key}/calls"] = torch.tensor([st.calls], dtype=torch.int64)
        return out

    def load_extra_state(self, params: Mapping[str, torch.Tensor],
                         state: Mapping[str, torch.Tensor]) -> int:
        """Restore what `extra_state` exported (same names, same shards); returns the number of
        histories restored. Keys of parameters this rank does not hold are ignored."""
        restored = 0
        for key in state:
            if not key.endswith("/history"):
                continue
            name, expert, role, _ = key.rsplit("/", 3)
            p = params.get(name)
            if p is None:
                continue
            base = f"{name}/{expert}/{role}"
            st = DelayedScalingState(self.recipe.fmt(role), self.recipe.amax_history_len,
                                     self.recipe.amax_compute_algo, self.recipe.margin)
            st.history = state[f"{base}/history"].to(p.device, torch.float32).clone()
            st.scale = state[f"{base}/scale"].to(p.device, torch.float32).reshape(()).clone()
            st.calls = int(state[f"{base}/calls"].reshape(-1)[0])
            self.site_state(p, int(expert))[role] = st
            restored += 1
        return restored

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, state: SiteState) -> torch.Tensor:
        """x (M, K), weight (N, K) → (M, N) under the recipe; subclasses swap in real FP8 GEMMs."""
        return QuantisedLinear.apply(x, weight, self.recipe, state)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        # x (..., in), weight (out, in) → (..., out)
        lead = x.shape[:-1]
        y = self._gemm(x.reshape(-1, x.shape[-1]), weight, self.site_state(weight))
        y = y.view(*lead, weight.shape[0])
        return y if bias is None else y + bias

    def grouped_mm(self, x: torch.Tensor, weight: torch.Tensor,
                   tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # x (N, in) grouped by expert, weight (E, in, out) → (N, out): one quantised GEMM per
        # expert (a loop over experts, never over tokens). An expert without tokens still gets
        # a GEMM node (`NoTokens`), so the graph's shape does not depend on the token counts.
        chunks = torch.split(x, tokens_per_expert.tolist(), dim=0)
        outs = [self._gemm(c, weight[e].t(), self.site_state(weight, e)) if c.shape[0]
                else NoTokens.apply(c, weight[e].t(), weight.shape[2])
                for e, c in enumerate(chunks)]
        if not outs:
            return x.new_zeros(0, weight.shape[2])
        return torch.cat(outs, dim=0)


register_backend("emulated", EmulatedBackend)
