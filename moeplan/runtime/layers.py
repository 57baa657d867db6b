"""Building blocks whose parallel behaviour is switched on by `parallelize`, not rewritten.

Every block has full-size weights until `parallelize` slices them and hands it the one `Axis`
it needs; with every axis trivial the blocks are the single-process reference model. Inside a
`Transformer` the large weights are deferred (meta device) until `materialize_` draws only the
slices a rank keeps, so slicing them costs no memory.
Tensors are sequence-first, (s, b, h), as in Megatron, so sequence parallelism shards dim 0.
Under sequence parallelism (tp > 1) block inputs and outputs are (s/t, b, h); a block gathers
the sequence once before its column-parallel GEMMs and reduce-scatters after its row-parallel
one. Weights replicated over tp that see only this rank's tokens or heads get partial gradients,
summed over tp after backward (the optimizer does it for every `ShardInfo.tp_dim is None` param).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import KernelBackend
from .comm import SINGLE, Axis, gather_seq, scatter_seq
from .cp import ring_attention


@dataclass(frozen=True)
class ShardInfo:
    """Everything the runtime records about one parameter, in one typed record.

    How it is split: along `tp_dim` over tp, along dim 0 over ep (`expert`), along `etp_dim`
    over etp (none of these: replicated within its grid), and the cuts this rank keeps
    (`slices`, in the order `shard_` made them). How it is drawn while deferred
    (`normal_weight`): N(0, `init_std`²) at `full_shape`. Pipeline roles of a shared embedding
    (`pipeline.split_stage`): in the first/last-stage embedding group, and the last stage's
    duplicate copy (summed gradient, counted once in the norm).

    Kept in the parameter's one `moeplan_shard` attribute so it survives what replaces a
    tensor's data (`shard_`, `.to()`) and is copied with the parameter (`materialize_`).
    """

    tp_dim: int | None = None
    expert: bool = False
    etp_dim: int | None = None
    slices: tuple[tuple[int, int, int], ...] = ()  # (dim, start, size) cuts, in order
    init_std: float | None = None
    full_shape: tuple[int, ...] | None = None
    embedding_group: bool = False
    duplicate: bool = False


_NO_SHARD = ShardInfo()


def shard_info(p: torch.Tensor) -> ShardInfo:
    """The record of `p` (a plain, replicated, already drawn tensor when none was made)."""
    return getattr(p, "moeplan_shard", _NO_SHARD)


def update_shard_info(p: torch.Tensor, **changes: object) -> ShardInfo:
    """Record `changes` on `p` (the other fields stay as they were)."""
    info = replace(shard_info(p), **changes)  # type: ignore[arg-type]
    p.moeplan_shard = info  # type: ignore[attr-defined]
    return info


def shard_(p: nn.Parameter, dim: int, axis: Axis) -> None:
    """Keep this rank's contiguous slice of `p` along `dim` (the full tensor is dropped). A
    weight not yet materialised (on the meta device) only records the slice."""
    if axis.trivial:
        return
    n = p.shape[dim]
    if n % axis.size:
        raise ValueError(f"dim {dim} of size {n} does not split over {axis.size} ranks")
    size = n // axis.size
    p.data = p.data.narrow(dim, axis.rank * size, size).clone()
    update_shard_info(p, slices=(*shard_info(p).slices, (dim, axis.rank * size, size)))


def normal_weight(shape: tuple[int, ...], std: float, gen: torch.Generator | None
                  ) -> nn.Parameter:
    """A weight drawn from N(0, std²). With a generator: drawn now, in construction order (a
    block built on its own). Without (inside a `Transformer`): deferred, on the meta device,
    and drawn later by `materialize_` from its parameter name, so a rank draws only the shards
    it keeps and every plan gets the same full weights."""
    if gen is not None:
        return nn.Parameter(torch.randn(shape, generator=gen) * std)
    w = nn.Parameter(torch.empty(shape, device="meta"))
    update_shard_info(w, init_std=std, full_shape=tuple(shape))
    return w


def _name_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))


ROW_BLOCK = 1024  # rows of a deferred 2-D weight drawn by one generator


def _draw(name: str, p: torch.Tensor, seed: int) -> torch.Tensor:
    """This rank's shard of the deferred weight `name` (see `materialize_`).

    A weight is drawn in blocks along dim 0, each from its own generator: one expert of a
    stack, or ROW_BLOCK rows of a matrix. Only blocks overlapping this rank's dim-0 slice are
    drawn, and each is cut to its other slices at once, so drawing never holds more than the
    shard and one block.
    """
    info = shard_info(p)
    std, full, slices = info.init_std, info.full_shape, list(info.slices)
    assert std is not None and full is not None, name
    lo, n = 0, full[0]
    for _dim, start, size in [c for c in slices if c[0] == 0]:
        lo, n = lo + start, size
    rest = [c for c in slices if c[0] != 0]
    block = 1 if len(full) == 3 else ROW_BLOCK
    parts = []
    for b in range(lo // block, -(-(lo + n) // block)):
        first = b * block
        rows = min(block, full[0] - first)
        t = torch.randn((rows, *full[1:]), generator=_name_generator(seed, f"{name}/{b}"))
        t = t[max(lo, first) - first: min(lo + n, first + rows) - first]
        for dim, start, size in rest:
            t = t.narrow(dim, start, size)
        parts.append(t.clone())
    return (torch.cat(parts) * std).contiguous()


def materialize_(model: nn.Module, seed: int) -> nn.Module:
    """Draw every deferred weight of `model` (`normal_weight`), only this rank's shard of it.

    Each weight is drawn in blocks along dim 0 (one expert of a stack, ROW_BLOCK rows of a
    matrix), each block from a generator seeded by (seed, parameter name, block), so a rank
    draws only its experts and the row blocks its shard needs, and every plan gets the same
    full weights. The meta Parameters are replaced (a shared one, e.g. a tied embedding, by one
    new Parameter) and keep their sharding attributes.
    """
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta or shard_info(p).full_shape is None:
                continue
            if id(p) not in done:
                new = nn.Parameter(_draw(names[id(p)], p, seed), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)
                done[id(p)] = new
            module._parameters[key] = done[id(p)]
    return model


class Norm(nn.Module):
    """RMSNorm (or LayerNorm with bias) over the last dim."""

    def __init__(self, dim: int, eps: float, kind: str = "rmsnorm"):
        super().__init__()
        self.eps, self.kind = eps, kind
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if kind == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


class Linear(nn.Module):
    """y = x Wᵀ + b through the kernel backend; W (out, in) as in nn.Linear."""

    def __init__(self, d_in: int, d_out: int, bias: bool, std: float, gen: torch.Generator | None,
                 backend: KernelBackend):
        super().__init__()
        self.backend = backend
        self.weight = normal_weight((d_out, d_in), std, gen)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        return self.backend.linear(x, self.weight, self.bias if bias else None)


def _yarn(inv_base: torch.Tensor, dim: int, theta: float, r) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, §3.2–3.4), as transformers' `_compute_yarn_parameters`: pairs
    rotating fewer than beta_slow times over the original context are interpolated (÷ factor),
    those rotating more than beta_fast times kept, a linear ramp in between; cos/sin × mscale."""
    factor, L0 = r.yarn_factor(), r.original_max_position_embeddings
    af = r.yarn_attention_factor()

    def corr_dim(rotations: float) -> float:
        return dim * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(r.beta_fast), corr_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (÷ factor)
    return inv_base / factor * (1 - keep) + inv_base * keep, float(af)


def rope_frequencies(dim: int, theta: float, scaling, seq: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (dim/2,) and the factor on cos/sin for a sequence of `seq` tokens.

    Plain RoPE is θ^(−2i/d) (Su et al. 2021); `scaling` (a ModelSpec.rope_scaling) follows
    transformers' `modeling_rope_utils.py` formula by formula, in fp32 as there, so that an
    imported checkpoint computes the same angles."""
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / theta ** exps
    if scaling is None:
        return inv, 1.0
    r, kind = scaling, scaling.kind
    if kind == "linear":  # position interpolation: every angle ÷ factor
        return inv / r.factor, 1.0
    if kind == "dynamic":  # NTK-aware θ growth beyond the original context only
        L0 = r.original_max_position_embeddings
        if seq <= L0:
            return inv, 1.0
        base = theta * ((r.factor * seq / L0) - (r.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / base ** exps, 1.0
    if kind == "yarn":
        return _yarn(inv, dim, theta, r)
    if kind == "llama3":  # Llama 3.1: long wavelengths ÷ factor, short kept, smooth between
        L0, f = r.original_max_position_embeddings, r.factor
        low_wl, high_wl = L0 / r.low_freq_factor, L0 / r.high_freq_factor
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wl, inv / f, inv)
        smooth = (L0 / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * out / f + smooth * out
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, out), 1.0
    # longrope: per-pair factors, the long ones beyond the original context
    L0 = r.original_max_position_embeddings
    factor = r.factor or (r.max_position_embeddings or L0) / L0
    af = r.attention_factor or (1.0 if factor <= 1 else math.sqrt(
        1 + math.log(factor) / math.log(L0)))
    ext = torch.tensor(r.long_factor if seq > L0 else r.short_factor, dtype=torch.float32)
    return 1.0 / (ext * theta ** exps), float(af)


def rope_tables(seq: int, dim: int, theta: float, device: torch.device,
                dtype: torch.dtype, scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (s, 1, 1, dim) for rotate-half RoPE (Su et al. 2021), scaled as `scaling`
    says (see `rope_frequencies`)."""
    inv, factor = rope_frequencies(dim, theta, scaling, seq)
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv)  # (s, dim/2)
    emb = torch.cat([ang, ang], dim=-1)[:, None, None, :]
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (s, b, heads, d), rotating halves; tables narrower than the head rotate its
    leading dims and pass the rest (partial rotary: HF partial_rotary_factor, Megatron
    --rotary-percent, which slice the same way)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q (s, b, a, d), k (s, b, g, d), v (s, b, g, dv) → (s, b, a·dv), causal
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # (b, heads, s, d)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                       enable_gqa=k.shape[1] != q.shape[1])
    s, b = o.shape[2], o.shape[0]
    return o.permute(2, 0, 1, 3).reshape(s, b, -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           cp: Axis) -> torch.Tensor:
    """Causal attention of this rank's tokens: local SDPA, or the ring over the cp group."""
    return _attend(q, k, v, scale) if cp.trivial else ring_attention(q, k, v, scale, cp)


class CoreAttention(nn.Module):
    """softmax(q kᵀ/√d) v, causal, without parameters: its own module so that the plan's
    `core_attn` recompute or offload has one place to wrap (`memory.py`)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                cp: Axis) -> torch.Tensor:
        # q (s, b, a, d), k (s, b, g, d), v (s, b, g, dv) → (s, b, a·dv)
        return attend(q, k, v, scale, cp)


class Attention(nn.Module):
    """GQA/MHA attention: column-parallel q, k, v (heads split over tp), row-parallel output."""

    def __init__(self, spec, std: float, out_std: float, gen: torch.Generator | None,
                 backend: KernelBackend):
        super().__init__()
        h, a, g, d = spec.hidden_size, spec.num_attention_heads, spec.kv_heads, spec.head_dim_
        self.head_dim, self.tp, self.cp = d, SINGLE, SINGLE
        self.q_proj = Linear(h, a * d, spec.qkv_bias, std, gen, backend)
        self.k_proj = Linear(h, g * d, spec.qkv_bias, std, gen, backend)
        self.v_proj = Linear(h, g * d, spec.qkv_bias, std, gen, backend)
        self.o_proj = Linear(a * d, h, spec.attn_out_bias, out_std, gen, backend)
        self.q_norm = Norm(d, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = Norm(d, spec.norm_eps) if spec.qk_norm else None
        self.core_attn = CoreAttention()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = gather_seq(x, self.tp)  # (s, b, h)
        s, b, d = x.shape[0], x.shape[1], self.head_dim
        q = self.q_proj(x).view(s, b, -1, d)  # (s, b, a/t, d)
        k = self.k_proj(x).view(s, b, -1, d)  # (s, b, g/t, d)
        v = self.v_proj(x).view(s, b, -1, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = self.o_proj(self.core_attn(q, k, v, 1.0 / math.sqrt(d), self.cp),
                        bias=False)  # (s, b, h)
        o = scatter_seq(o, self.tp)  # (s/t, b, h)
        return o if self.o_proj.bias is None else o + self.o_proj.bias


class MLAttention(nn.Module):
    """DeepSeek Multi-head Latent Attention (DeepSeek-V2 §2.1; Megatron `multi_latent_attention`).

    The down-projections and their norms run on this rank's sequence shard with replicated
    weights (partial gradients, summed over tp); the latents are gathered once, then the
    up-projections are column-parallel over heads and the output projection row-parallel.
    """

    def __init__(self, spec, std: float, out_std: float, gen: torch.Generator | None,
                 backend: KernelBackend):
        super().__init__()
        h, a = spec.hidden_size, spec.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = (spec.qk_nope_head_dim, spec.qk_rope_head_dim,
                                                spec.v_head_dim)
        self.kv_rank, self.q_rank, self.tp = spec.kv_lora_rank, spec.q_lora_rank, SINGLE
        self.cp = SINGLE
        qk = self.nope + self.rope_dim
        if self.q_rank:
            self.q_down = Linear(h, self.q_rank, spec.qkv_bias, std, gen, backend)
            self.q_down_norm = Norm(self.q_rank, spec.norm_eps)
            self.q_up = Linear(self.q_rank, a * qk, False, std, gen, backend)
        else:
            self.q_proj = Linear(h, a * qk, False, std, gen, backend)
        self.kv_down = Linear(h, self.kv_rank + self.rope_dim, spec.qkv_bias, std, gen, backend)
        self.kv_down_norm = Norm(self.kv_rank, spec.norm_eps)
        self.kv_up = Linear(self.kv_rank, a * (self.nope + self.v_dim), False, std, gen, backend)
        self.o_proj = Linear(a * self.v_dim, h, spec.attn_out_bias, out_std, gen, backend)
        self.core_attn = CoreAttention()
        # 1/√d_qk, times yarn's mscale² (DeepSeek-V2 §2.1 long context; transformers'
        # `yarn_apply_mscale`)
        self.scale = spec.softmax_scale_factor() / math.sqrt(self.nope + self.rope_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x (s/t, b, h)
        q_in = self.q_down_norm(self.q_down(x)) if self.q_rank else x  # (s/t, b, r_q or h)
        c_kv, k_pe = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = torch.cat([q_in, self.kv_down_norm(c_kv), k_pe], dim=-1)
        latent = gather_seq(latent, self.tp)  # (s, b, ·): one gather for all latents
        q_in, c_kv, k_pe = latent.split([q_in.shape[-1], self.kv_rank, self.rope_dim], dim=-1)
        q, k, v = self.up_proj(q_in, c_kv, k_pe, *rope)
        o = self.core_attn(q, k, v, self.scale, self.cp)  # (s, b, a/t·v)
        o = scatter_seq(self.o_proj(o, bias=False), self.tp)  # (s/t, b, h)
        return o if self.o_proj.bias is None else o + self.o_proj.bias


    def up_proj(self, q_in: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Up-projections and RoPE: the latents (s, b, ·) → q, k (s, b, a/t, qk), v (s, b, a/t, v).

        A method of its own: the plan's `mla_up_proj` recompute discards its outputs."""
        s, b = q_in.shape[0], q_in.shape[1]
        q = (self.q_up(q_in) if self.q_rank else self.q_proj(q_in)).view(
            s, b, -1, self.nope + self.rope_dim)  # (s, b, a/t, qk)
        kv = self.kv_up(c_kv).view(s, b, -1, self.nope + self.v_dim)  # (s, b, a/t, nope+v)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin).expand(-1, -1, q.shape[2], -1)
        return torch.cat([q_nope, q_pe], dim=-1), torch.cat([k_nope, k_pe], dim=-1), v


def activation(kind: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP nonlinearity; geglu* are gated (HF hidden_act gelu / gelu_pytorch_tanh)."""
    if kind in ("gelu", "geglu"):
        return F.gelu(x)
    if kind == "geglu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "squared_relu":
        return F.relu(x).square()
    return F.silu(x)


class MLP(nn.Module):
    """Dense MLP or shared expert: column-parallel gate/up, row-parallel down (Megatron TP)."""

    def __init__(self, spec, ffn: int, std: float, out_std: float, gen: torch.Generator | None,
                 backend: KernelBackend, gate: bool = False):
        super().__init__()
        h, bias = spec.hidden_size, spec.mlp_bias
        self.kind, self.tp = spec.activation, SINGLE
        self.gate_proj = Linear(h, ffn, bias, std, gen, backend) if spec.gated else None
        self.up_proj = Linear(h, ffn, bias, std, gen, backend)
        self.down_proj = Linear(ffn, h, bias, out_std, gen, backend)
        # Qwen2-MoE shared-expert gate: sigmoid(x·w) scales the shared expert's output.
        self.out_gate = Linear(h, 1, False, std, gen, backend) if gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xg = gather_seq(x, self.tp)  # (s, b, h)
        up = self.up_proj(xg)  # (s, b, f/t)
        act = activation(self.kind, self.gate_proj(xg)) * up if self.gate_proj else activation(
            self.kind, up)
        y = scatter_seq(self.down_proj(act, bias=False), self.tp)  # (s/t, b, h)
        if self.down_proj.bias is not None:
            y = y + self.down_proj.bias
        if self.out_gate is not None:
            y = y * torch.sigmoid(self.out_gate(x))
        return y
