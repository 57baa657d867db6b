"""A decoder-only (MoE) transformer built from a ModelSpec, sequence-first (s, b, h).

Every weight is a function of (seed, parameter name) alone, so every plan trains the same full
model, yet no rank builds it: a Trainer constructs it with its large weights on the meta device
(`materialize=False`), drops the other pipeline stages (`pipeline.split_stage`), shards the rest
(`parallelize`), and only then draws the shards this rank keeps (`layers.materialize_`, block by
block from generators seeded by seed, name and block). Built alone (`materialize=True`, the
single-process reference) it draws every weight at once. Embedding and output layer are
vocab-parallel; the loss is a vocab-parallel cross-entropy, so no rank holds (tokens, V) logits.
A pipeline stage runs `forward_chunk` on the parts it keeps (`pipeline.split_stage`); a cp rank
takes its two load-balanced sequence chunks itself, so callers always pass full sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import NotYetAvailable
from ..kernels import KernelBackend, get_backend
from ..specs import ModelSpec
from .comm import SINGLE, gather_seq, scatter_seq, vocab_parallel_cross_entropy
from .cp import cp_positions
from .layers import (
    MLP,
    Attention,
    Linear,
    MLAttention,
    Norm,
    materialize_,
    normal_weight,
    rope_tables,
)
from .moe import MoE
from .support import model_features_not_executed

INIT_STD = 0.02


class Block(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp/moe(norm(·))."""

    def __init__(self, spec: ModelSpec, moe: bool, gen: torch.Generator | None,
                 backend: KernelBackend, aux_coeff: float, capacity_factor: float | None):
        super().__init__()
        out_std = INIT_STD / math.sqrt(2 * spec.num_layers)  # GPT-2 scaled init of outputs
        self.attn_norm = Norm(spec.hidden_size, spec.norm_eps, spec.normalization)
        attn_cls = MLAttention if spec.attention == "mla" else Attention
        self.attention = attn_cls(spec, INIT_STD, out_std, gen, backend)
        self.mlp_norm = Norm(spec.hidden_size, spec.norm_eps, spec.normalization)
        self.mlp: nn.Module = (
            MoE(spec, INIT_STD, out_std, gen, backend, aux_coeff, capacity_factor) if moe
            else MLP(spec, spec.ffn_hidden_size, INIT_STD, out_std, gen, backend)
        )

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class VocabEmbedding(nn.Module):
    """Embedding rows split over tp (Megatron VocabParallelEmbedding); output enters SP."""

    def __init__(self, vocab: int, hidden: int, gen: torch.Generator | None):
        super().__init__()
        self.weight = normal_weight((vocab, hidden), INIT_STD, gen)
        self.tp, self.start = SINGLE, 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens (s, b) → (s/t, b, h)
        if self.tp.trivial:
            return nn.functional.embedding(tokens, self.weight)
        local = tokens - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        emb = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return scatter_seq(emb * inside.unsqueeze(-1).to(emb.dtype), self.tp)


class MTPModule(nn.Module):
    """One multi-token-prediction depth (DeepSeek-V3 §2.2, eq. 21–25; Megatron `multi_token_prediction`).

    h' = Block(W·[norm(Emb(t_{i+k})); norm(h_i)]), then its own final norm and the shared output
    head predict t_{i+k+1}. The 2h→h projection is replicated over tp and runs on this rank's
    sequence shard (partial gradients, summed over tp like the norms).
    """

    def __init__(self, spec: ModelSpec, moe: bool, gen: torch.Generator | None,
                 backend: KernelBackend, aux_coeff: float, capacity_factor: float | None):
        super().__init__()
        h = spec.hidden_size
        self.emb_norm = Norm(h, spec.norm_eps, spec.normalization)
        self.hidden_norm = Norm(h, spec.norm_eps, spec.normalization)
        self.proj = Linear(2 * h, h, False, INIT_STD, gen, backend)
        self.block = Block(spec, moe, gen, backend, aux_coeff, capacity_factor)
        self.final_norm = Norm(h, spec.norm_eps, spec.normalization)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # hidden, emb (s/t, b, h) → (s/t, b, h)
        x = self.proj(torch.cat([self.emb_norm(emb), self.hidden_norm(hidden)], dim=-1))
        return self.final_norm(self.block(x, rope))


@dataclass(frozen=True)
class Chunk:
    """What one virtual pipeline stage runs: the embedding, decoder layers `layers` (indices
    into the full model), and the loss head (final norm, output layer, MTP depths, loss)."""

    embed: bool
    layers: tuple[int, ...]
    loss: bool


@dataclass
class LossTerms:
    """One micro-batch's loss terms on this rank.

    ce_sum: Σ token losses of this rank's sequences (equal on every tp rank); mtp_sum: Σ over
    MTP depths of the valid tokens' losses, already weighted by mtp_loss_weight / depth count;
    aux: this rank's piece of the load-balancing loss (pieces add up over the micro-batch's tp
    ranks).
    """

    ce_sum: torch.Tensor
    mtp_sum: torch.Tensor
    aux: torch.Tensor

    def objective(self, tokens_global: int, microbatches_global: int) -> torch.Tensor:
        """What this rank differentiates: its share of the global-batch mean loss."""
        return (self.ce_sum + self.mtp_sum) / tokens_global + self.aux / microbatches_global


class Transformer(nn.Module):
    """Embedding → blocks → final norm → (tied or own) vocab-parallel output head and loss,
    plus optional MTP depths sharing the embedding and the output head."""

    def __init__(self, spec: ModelSpec, seed: int = 0, backend: KernelBackend | None = None,
                 aux_coeff: float = 0.0, capacity_factor: float | None = None,
                 mtp_loss_weight: float = 0.1, materialize: bool = True):
        """`materialize=False` leaves the large weights on the meta device, for a caller that
        first drops the other pipeline stages and shards the rest, then calls `materialize_`:
        no rank ever holds the full model."""
        super().__init__()
        unsupported = model_features_not_executed(spec)
        if unsupported:
            raise NotYetAvailable("the runtime does not execute " + ", ".join(unsupported)
                                  + " yet; nothing was run.")
        backend = backend or get_backend("torch")
        gen = None  # weights are drawn by name (layers.materialize_), not in construction order
        self.spec = spec
        self.embedding = VocabEmbedding(spec.vocab_size, spec.hidden_size, gen)
        self.layers = nn.ModuleList(
            Block(spec, moe, gen, backend, aux_coeff, capacity_factor)
            for moe in spec.moe_layers()
        )
        self.final_norm = Norm(spec.hidden_size, spec.norm_eps, spec.normalization)
        self.output = None if spec.tie_embeddings else normal_weight(
            (spec.vocab_size, spec.hidden_size), INIT_STD, gen)
        last_moe = spec.moe_layers()[-1]
        self.mtp = nn.ModuleList(
            MTPModule(spec, last_moe, gen, backend, aux_coeff, capacity_factor)
            for _ in range(spec.mtp_layers)
        )
        self.mtp_scale = mtp_loss_weight / max(1, spec.mtp_layers)
        self.backend, self.tp, self.cp = backend, SINGLE, SINGLE
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        if materialize:
            materialize_(self, seed)

    def rope(self, seq: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (s_local, 1, 1, dim) at this cp rank's token positions."""
        s = self.spec
        dim = s.rotary_dim
        key = (seq, like.device, like.dtype)
        if key not in self._rope:
            cos, sin = rope_tables(seq, dim, s.rope_theta, like.device, like.dtype,
                                   s.rope_scaling)
            if not self.cp.trivial:  # RoPE positions follow the load-balanced split
                pos = cp_positions(seq, self.cp, like.device)
                cos, sin = cos[pos], sin[pos]
            self._rope[key] = (cos, sin)
        return self._rope[key]

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        """(b, s) → (s_local, b): this cp rank's two chunks, sequence-first."""
        if self.cp.trivial:
            return t.t()
        return t[:, cp_positions(t.shape[1], self.cp, t.device)].t()

    def layer_items(self) -> list[tuple[int, Block]]:
        """(layer index, block) of the decoder layers this rank holds (all, or its stage's)."""
        if isinstance(self.layers, nn.ModuleDict):
            return [(int(i), b) for i, b in self.layers.items()]
        return list(enumerate(self.layers))

    def layer(self, i: int) -> Block:
        return self.layers[str(i)] if isinstance(self.layers, nn.ModuleDict) else self.layers[i]

    def moe_layers(self) -> list[MoE]:
        """MoE blocks of the decoder layers, then those of the MTP depths."""
        blocks = [*(b for _, b in self.layer_items()), *(m.block for m in self.mtp)]
        return [b.mlp for b in blocks if isinstance(b.mlp, MoE)]

    def moe_layer_numbers(self) -> list[int]:
        """Layer number of each entry of `moe_layers()` (MTP depth k is layer L + k)."""
        main = [i for i, b in self.layer_items() if isinstance(b.mlp, MoE)]
        return main + [self.spec.num_layers + k for k, m in enumerate(self.mtp)
                       if isinstance(m.block.mlp, MoE)]

    def all_moe_layer_numbers(self) -> list[int]:
        """`moe_layer_numbers()` of the whole model, whatever this rank holds."""
        main = [i for i, moe in enumerate(self.spec.moe_layers()) if moe]
        last_moe = self.spec.moe_layers()[-1]
        return main + ([self.spec.num_layers + k for k in range(self.spec.mtp_layers)]
                       if last_moe else [])

    def _token_losses(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # x (s/t, b, h) normed, targets (s, b) → per-token losses (s·b,)
        x = gather_seq(x, self.tp)  # (s, b, h)
        weight = self.embedding.weight if self.output is None else self.output  # (V/t, h)
        # the output layer stays out of FP8 whatever the recipe (as in Megatron)
        logits = get_backend("torch").linear(x, weight)  # (s, b, V/t)
        return vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            targets.reshape(-1), self.tp,
                                            self.tp.rank * (self.spec.vocab_size // self.tp.size))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> LossTerms:
        """tokens, targets (b, s) → this rank's loss terms for these sequences."""
        whole = Chunk(True, tuple(range(self.spec.num_layers)), True)
        return self.forward_chunk(None, tokens, targets, whole)[1]

    def forward_chunk(self, x: torch.Tensor | None, tokens: torch.Tensor, targets: torch.Tensor,
                      chunk: Chunk) -> tuple[torch.Tensor | None, LossTerms]:
        """Run one virtual pipeline stage on a micro-batch.

        x (s_local/t, b, h) is the previous stage's output (None when `chunk.embed`); tokens,
        targets (b, s) full sequences. Returns the hidden state for the next stage (None after
        the loss) and this chunk's loss terms (ce and MTP only when `chunk.loss`; aux of the
        chunk's own MoE layers, read right away since the next micro-batch overwrites them).
        """
        seq = tokens.shape[1]
        if chunk.embed:
            x = self.embedding(self._local(tokens))  # (s_local/t, b, h)
        assert x is not None
        rope = self.rope(seq, x)
        aux = x.new_zeros((), dtype=torch.float32)
        for i in chunk.layers:
            block = self.layer(i)
            x = block(x, rope)
            if isinstance(block.mlp, MoE) and block.mlp.aux_loss is not None:
                aux = aux + block.mlp.aux_loss
        if not chunk.loss:
            zero = aux.new_zeros(())
            return x, LossTerms(zero, zero, aux)
        ce = self._token_losses(self.final_norm(x), self._local(targets))  # (s_local·b,)
        mtp_sum = ce.new_zeros(())
        pos = (torch.arange(seq, device=targets.device) if self.cp.trivial
               else cp_positions(seq, self.cp, targets.device))  # (s_local,)
        for k, module in enumerate(self.mtp, start=1):
            # depth k reads t_{i+k} and predicts t_{i+k+1}: valid for i < s − k
            inputs = self._local(targets.roll(-(k - 1), dims=1))  # (s_local, b)
            labels = self._local(targets.roll(-k, dims=1))
            valid = (pos < seq - k).to(ce.dtype)
            x = module(x, self.embedding(inputs), rope)
            mtp_ce = self._token_losses(x, labels).view(pos.numel(), -1)  # (s_local, b)
            mtp_sum = mtp_sum + (mtp_ce * valid[:, None]).sum() * self.mtp_scale
            if isinstance(module.block.mlp, MoE) and module.block.mlp.aux_loss is not None:
                aux = aux + module.block.mlp.aux_loss
        return None, LossTerms(ce.sum(), mtp_sum, aux)
