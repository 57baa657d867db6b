"""Pipeline parallelism: stages from the plan's stage layout, 1F1B and interleaved 1F1B.

Stages. The plan's layout (Megatron's `--pipeline-model-parallel-layout`, `specs.stage_layout`)
lists virtual stages in virtual-stage order: stage v·pp + r is pp rank r's chunk v. Each rank
constructs the model with its large weights deferred (meta device), `split_stage` keeps only its
chunks' parts, and only those are drawn, by parameter name (`layers.materialize_`), so weights
match the single-process model by construction without any rank holding the whole model. The embedding rides on the first virtual stage;
the loss head (final norm, output layer, MTP depths) on the last. When the last stage also needs
the embedding (tied output head, or MTP reading token embeddings) it keeps a copy whose gradient
is summed with the first stage's over the embedding group (Megatron's `embedding_group`), and the
copy is left out of the gradient norm so each element counts once.

Schedules. Megatron Core's orders (`schedules.py`): 1F1B runs min(m, pp − r − 1) warm-up forwards,
then one-forward-one-backward, then the cool-down backwards; interleaved 1F1B with v chunks runs
(pp − r − 1)·2 + (v − 1)·pp warm-up forwards, visiting chunks in groups of pp micro-batches
(Narayanan et al. 2021 §2.2). The order is executed with non-blocking sends and blocking receives
over the pp group, tagged by (kind, receiving virtual stage, micro-batch). Each pipeline edge and
direction has its own 2-rank group (`ParallelGroups.pp_links`): activations and gradients never
share a communicator, and on each link both ends post their operations in the same order
(Megatron's forward and backward orders are the same function of k on every rank), which is what
NCCL, ignoring tags, matches by.

Why not `torch.distributed.pipelining`: its `loss_fn(output, target)` sees only the last stage's
output, while our objective also has per-stage MoE aux losses (each stage must differentiate its
own), MTP losses that need the micro-batch's targets next to the hidden state, and loss terms
that must come back out of the schedule for the reported loss; and its stages pass only what
`forward` returns. A compact executor of Megatron's order over our own stage modules keeps one
model and one set of parameter names for every plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..specs import Plan
from ..specs.schedule import merged_schedule, schedule
from .comm import Axis
from .layers import update_shard_info
from .model import Chunk, LossTerms, Transformer
from .overlap import ChunkForward, OverlapTrace, chunk_backward, chunk_forward, interleave


def plan_stages(plan: Plan) -> list[list[str]]:
    """The plan's virtual stages (lists of 'E', 't', 'm', 'L') in virtual-stage order."""
    return plan.stages()


def rank_chunks(stages: list[list[str]], pp: int, rank: int) -> list[Chunk]:
    """pp rank `rank`'s chunks (virtual stages rank, pp + rank, ...), decoder layers numbered
    in model order across all stages."""
    chunks, first = [], 0
    for stage in stages:
        n = stage.count("t")
        chunks.append(Chunk("E" in stage, tuple(range(first, first + n)), "L" in stage))
        first += n
    return chunks[rank::pp]


def needs_shared_embedding(model: Transformer) -> bool:
    """The loss head reads the embedding: tied output layer or MTP depths."""
    return model.spec.tie_embeddings or model.spec.mtp_layers > 0


def split_stage(model: Transformer, chunks: list[Chunk], pp: int) -> Transformer:
    """Drop every part of `model` outside this rank's chunks (in place; names unchanged)."""
    keep = sorted(i for c in chunks for i in c.layers)
    model.layers = nn.ModuleDict({str(i): model.layers[i] for i in keep})  # type: ignore[assignment]
    embed, loss = any(c.embed for c in chunks), any(c.loss for c in chunks)
    if not loss:
        model.final_norm = None  # type: ignore[assignment]
        model.output = None
        model.mtp = nn.ModuleList()
    if pp > 1 and needs_shared_embedding(model) and (embed or loss):
        # the last stage's copy: summed gradient, counted once in the norm
        update_shard_info(model.embedding.weight, embedding_group=True, duplicate=not embed)
    elif not embed:
        model.embedding = None  # type: ignore[assignment]
    return model


@dataclass
class PipelineStats:
    """Time this rank spent blocked on receives (its bubble) and in the whole schedule."""

    wait_s: float = 0.0
    total_s: float = 0.0
    history: list[tuple[float, float]] = field(default_factory=list)


class PipelineSchedule:
    """Runs one step's micro-batches through this rank's chunks in the 1F1B / interleaved order."""

    def __init__(self, model: Transformer, chunks: list[Chunk], pp: Axis,
                 links: tuple[tuple[int, int, dist.ProcessGroup], ...],
                 act_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 ep_overlap: bool = False):
        self.model, self.chunks, self.pp = model, chunks, pp
        self.links = {(kind, src): group for kind, src, group in links}
        self.vpp = len(chunks)
        self.act_shape, self.dtype, self.device = act_shape, dtype, device
        self.stats = PipelineStats()
        self.ep_overlap = ep_overlap
        self.trace = OverlapTrace()  # the last step's hops under EP overlap

    # ------------------------------------------------------------------- neighbours and tags
    def _stage(self, chunk: int) -> int:
        return chunk * self.pp.size + self.pp.rank

    def _peer(self, stage: int) -> int:
        """Global rank holding virtual stage `stage`."""
        return self.pp.ranks[stage % self.pp.size]

    def _tag(self, kind: int, stage: int, mb: int, m: int) -> int:
        return (kind * self.pp.size * self.vpp + stage) * m + mb

    def _recv(self, src_stage: int, kind: int, dst_stage: int, mb: int, m: int) -> torch.Tensor:
        buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
        start = time.perf_counter()
        group = self.links[kind, src_stage % self.pp.size]
        dist.irecv(buf, self._peer(src_stage), group=group,
                   tag=self._tag(kind, dst_stage, mb, m)).wait()
        self.stats.wait_s += time.perf_counter() - start
        return buf

    def _send(self, x: torch.Tensor, dst_stage: int, kind: int, mb: int, m: int,
              pending: list) -> None:
        x = x.detach().contiguous()
        group = self.links[kind, self.pp.rank]
        pending.append((dist.isend(x, self._peer(dst_stage), group=group,
                                   tag=self._tag(kind, dst_stage, mb, m)), x))

    # --------------------------------------------------------------------------------- run
    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], tokens_global: int,
            microbatches_global: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of every micro-batch; returns this rank's Σ ce (last stage
        only, else 0) and Σ aux/M (its own chunks), both float64 without host syncs."""
        if self.ep_overlap:
            return self.run_overlapped(micro_batches, tokens_global, microbatches_global)
        m, last = len(micro_batches), self.pp.size * self.vpp - 1
        ce_total = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)
        stash: dict[tuple[int, int], tuple] = {}
        pending: list = []
        self.stats.wait_s, start = 0.0, time.perf_counter()
        for kind, c, mb in schedule(self.pp.size, self.vpp, self.pp.rank, m):
            chunk, stage = self.chunks[c], self._stage(c)
            tokens, targets = micro_batches[mb]
            if kind == "F":
                x = None
                if not chunk.embed:
                    x = self._recv(stage - 1, 0, stage, mb, m).requires_grad_()
                out, terms = self.model.forward_chunk(x, tokens, targets, chunk)
                aux_total += terms.aux.detach().double() / microbatches_global
                if chunk.loss:
                    ce_total += terms.ce_sum.detach()
                    stash[c, mb] = (x, terms.objective(tokens_global, microbatches_global), None)
                else:
                    assert out is not None and stage < last
                    self._send(out, stage + 1, 0, mb, m, pending)
                    stash[c, mb] = (x, out, _aux_objective(terms, microbatches_global))
            else:
                x, out, aux = stash.pop((c, mb))
                if chunk.loss:
                    torch.autograd.backward(out)
                else:
                    grad = self._recv(stage + 1, 1, stage, mb, m)
                    outs, grads = [out], [grad]
                    if aux is not None:
                        outs.append(aux)
                        grads.append(None)
                    torch.autograd.backward(outs, grads)
                if not chunk.embed:
                    self._send(x.grad, stage - 1, 1, mb, m, pending)
        for req, _ in pending:
            req.wait()
        self.stats.total_s = time.perf_counter() - start
        self.stats.history.append((self.stats.wait_s, self.stats.total_s))
        return ce_total, aux_total

    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
                     ) -> torch.Tensor:
        """Forward of every micro-batch through this rank's chunks, for evaluation: Σ ce on the
        last stage (0 elsewhere), float64. Each rank visits (micro-batch, chunk) in order; a
        stage's input comes from a lower (micro-batch, stage) pair, so blocking receives and
        non-blocking sends cannot deadlock, and each link carries its messages in one order."""
        m = len(micro_batches)
        ce_total = torch.zeros((), dtype=torch.float64, device=self.device)
        pending: list = []
        for mb, (tokens, targets) in enumerate(micro_batches):
            for c, chunk in enumerate(self.chunks):
                stage = self._stage(c)
                x = None if chunk.embed else self._recv(stage - 1, 0, stage, mb, m)
                out, terms = self.model.forward_chunk(x, tokens, targets, chunk)
                if chunk.loss:
                    ce_total += terms.ce_sum.double()
                else:
                    assert out is not None
                    self._send(out, stage + 1, 0, mb, m, pending)
        for req, _ in pending:
            req.wait()
        return ce_total

    def run_overlapped(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                       tokens_global: int, microbatches_global: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """`run` in the merged order: each step receives what its forward and its backward
        need, runs them interleaved at sub-module granularity (overlap.py), then sends."""
        m = len(micro_batches)
        ce_total = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)
        stash: dict[tuple[int, int], tuple[torch.Tensor | None, ChunkForward]] = {}
        pending: list = []
        self.trace.clear()
        self.stats.wait_s, start = 0.0, time.perf_counter()
        for f, b in merged_schedule(self.pp.size, self.vpp, self.pp.rank, m):
            f_gen = b_gen = x = None
            if f is not None:
                c, mb = f
                chunk, stage = self.chunks[c], self._stage(c)
                tokens, targets = micro_batches[mb]
                if not chunk.embed:
                    x = self._recv(stage - 1, 0, stage, mb, m).requires_grad_()
                f_gen = chunk_forward(self.model, chunk, x, tokens, targets, mb, self.trace,
                                      tokens_global, microbatches_global)
            if b is not None:
                bc, bmb = b
                b_chunk, b_stage = self.chunks[bc], self._stage(bc)
                b_x, fwd = stash.pop((bc, bmb))
                grad = None if b_chunk.loss else self._recv(b_stage + 1, 1, b_stage, bmb, m)
                b_gen = chunk_backward(fwd, grad, b_x, microbatches_global)
            x_grad, out = interleave(b_gen, f_gen)
            if f is not None:
                assert isinstance(out, ChunkForward)
                stash[f] = (x, out)
                ce_total += out.ce_sum
                aux_total += out.aux_sum / microbatches_global
                if out.output is not None:
                    self._send(out.output, stage + 1, 0, mb, m, pending)
            if b is not None and not b_chunk.embed:
                assert isinstance(x_grad, torch.Tensor)
                self._send(x_grad, b_stage - 1, 1, bmb, m, pending)
        for req, _ in pending:
            req.wait()
        self.stats.total_s = time.perf_counter() - start
        self.stats.history.append((self.stats.wait_s, self.stats.total_s))
        return ce_total, aux_total


def _aux_objective(terms: LossTerms, microbatches_global: int) -> torch.Tensor | None:
    """The chunk's aux-loss share to differentiate with its output, when it has a gradient."""
    return terms.aux / microbatches_global if terms.aux.requires_grad else None
