"""EP communication overlap: one micro-batch's forward interleaved with another's backward.

Megatron Core's `--overlap-moe-expert-parallel-comm` (`combined_1f1b.py`,
`TransformerLayerSchedulePlan`, `fine_grained_callables.py`; DeepSeek-V3 §3.2.1's dual
micro-batch overlap): each MoE layer is cut into sub-modules,

    attention (+ router, permute)  → dispatch hops → experts (+ shared experts) → combine hops
    → unpermute and residual,

and a merged step runs one micro-batch's forward and another's backward layer against layer,
so that every all-to-all of one is in flight while the other computes:

    B combine⁻¹ ‖ F attention,  F dispatch ‖ B experts⁻¹,  B dispatch⁻¹ ‖ F experts,
    F combine ‖ B attention⁻¹ (and the next layer's unpermute⁻¹).

Here each direction of a model chunk is a Python generator over its sub-modules (`Tape`):
a hop is issued with `async_op=True` (`comm.Pending`) and the generator yields; `interleave`
then runs the other direction until *it* yields, and only when the first resumes is the handle
waited on. The flex dispatcher's two hops (the rail all-to-all across NVLink domains, the
fan-out inside one) are issued the same way, each behind the other micro-batch's next piece
of compute. On a GPU Megatron puts compute and communication on two streams; on CPU/gloo the
transfer runs on gloo's own threads while this thread computes, which is what the trace
(`OverlapTrace`) records and `bench/ep_overlap.py` measures.

Autograd is cut at every sub-module boundary: a piece's inputs are detached leaves, its
backward is `torch.autograd.backward(outputs, grads)` and its leaves' gradients are summed into
the tensors that fed them; a hop's backward is its adjoint collective (all-to-all with the
splits swapped, gather ↔ reduce-scatter), issued asynchronously too. The function computed is
the same as the plain model's, so every layout is equivalence-tested against one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace

import torch

from .comm import AllToAllV, GatherV, Pending, ScatterV
from .memory import LayerPieces, chunk_chain
from .model import Chunk, Transformer
from .moe import AllToAllDispatcher, DispatchState, FlexDispatcher, MoE, Routing

Op = AllToAllV | GatherV | ScatterV
Steps = Generator[None, None, object]


# ------------------------------------------------------------------------------------ trace
@dataclass
class CommRecord:
    """One hop issued by a `Tape`: which direction, layer and micro-batch, whether the transfer
    was still running when the other direction started computing, and which of the other
    direction's sub-modules ran while its handle was outstanding."""

    side: str  # "F" or "B"
    what: str  # "dispatch" or "combine" (forward names; B runs their adjoints)
    layer: int
    mb: int
    issued_s: float
    waited_s: float = 0.0  # time blocked in wait()
    pending_when_overlapped: bool = False  # not yet complete when other compute began
    handles: int = 0  # torch.distributed work handles (async_op=True) it waited on
    # each collective issued, with its input's shape and dtype: to time them alone
    issued: list[tuple[Op, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    overlapped: list[str] = field(default_factory=list)


@dataclass
class OverlapTrace:
    """What the merged schedule did this step: every hop, and the hops outstanding now."""

    records: list[CommRecord] = field(default_factory=list)
    outstanding: list[tuple[int, CommRecord, Sequence[Pending]]] = field(default_factory=list)

    def computing(self, owner: int, label: str) -> None:
        """`owner`'s sub-module `label` starts: every other owner's outstanding hop overlaps."""
        for who, rec, pending in self.outstanding:
            if who != owner:
                rec.overlapped.append(label)
                if not all(p.done() for p in pending):
                    rec.pending_when_overlapped = True

    def clear(self) -> None:
        self.records.clear()
        self.outstanding.clear()

    def hidden_fraction(self) -> float:
        """Share of hops that had compute of the other micro-batch in flight behind them."""
        return sum(bool(r.overlapped) for r in self.records) / max(1, len(self.records))

    def wait_s(self) -> float:
        return sum(r.waited_s for r in self.records)


# ------------------------------------------------------------------------------------- tape
@dataclass
class _Compute:
    label: str
    inputs: tuple[torch.Tensor, ...]
    leaves: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


@dataclass
class _Hop:
    what: str
    layer: int
    ops: tuple[Op, ...]
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]


class Tape:
    """One (chunk, micro-batch)'s forward as sub-modules and hops, replayed backward.

    Gradients are routed by tensor identity: a piece's leaf gradients are summed into the
    tensor (an earlier piece's output or hop result) that the leaf was detached from.
    """

    def __init__(self, mb: int, trace: OverlapTrace):
        self.mb, self.trace = mb, trace
        self.steps: list[_Compute | _Hop] = []
        self.grads: dict[int, torch.Tensor] = {}
        self.chain: list = [None]  # the offload group of this chunk's last layer (memory.py)

    # ------------------------------------------------------------------------- forward
    def compute(self, label: str, fn: Callable[..., tuple[torch.Tensor, ...]],
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.trace.computing(id(self), f"F {label} mb{self.mb}")
        leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)
        with chunk_chain(self.chain):
            outputs = tuple(fn(*leaves))
        self.steps.append(_Compute(label, inputs, leaves, outputs))
        return outputs

    def hop(self, what: str, layer: int, ops: Sequence[Op],
            inputs: Sequence[torch.Tensor]) -> Generator[None, None, tuple[torch.Tensor, ...]]:
        """Issue `ops[i]` on `inputs[i]` asynchronously, yield, then wait for them."""
        rec = CommRecord("F", what, layer, self.mb, time.perf_counter())
        pending = [op.start(t.detach()) for op, t in zip(ops, inputs, strict=True)]
        rec.issued = [(op, tuple(t.shape), t.dtype) for op, t in zip(ops, inputs, strict=True)]
        outputs = yield from self._wait(rec, pending)
        outputs = tuple(o.requires_grad_(t.requires_grad) if o.is_floating_point() else o
                        for o, t in zip(outputs, inputs, strict=True))
        self.steps.append(_Hop(what, layer, tuple(ops), tuple(inputs), outputs))
        return outputs

    def _wait(self, rec: CommRecord, pending: list[Pending]
              ) -> Generator[None, None, tuple[torch.Tensor, ...]]:
        entry = (id(self), rec, pending)
        rec.handles = sum(p.work is not None for p in pending)
        self.trace.records.append(rec)
        self.trace.outstanding.append(entry)
        yield  # the other micro-batch computes now
        self.trace.outstanding.remove(entry)
        start = time.perf_counter()
        outputs = tuple(p.wait() for p in pending)
        rec.waited_s = time.perf_counter() - start
        return outputs

    # ------------------------------------------------------------------------ backward
    def seed(self, t: torch.Tensor, grad: torch.Tensor | None) -> None:
        """The gradient arriving at forward output `t` (None: nothing flows into it)."""
        if grad is not None and t.requires_grad:
            self._add(t, grad)

    def grad_of(self, t: torch.Tensor) -> torch.Tensor | None:
        return self.grads.get(id(t))

    def _add(self, t: torch.Tensor, g: torch.Tensor) -> None:
        key = id(t)
        self.grads[key] = g if key not in self.grads else self.grads[key] + g

    def backward(self) -> Steps:
        """Replay the steps in reverse; each hop's adjoint is issued async, then yield."""
        while self.steps:
            step = self.steps.pop()
            if isinstance(step, _Compute):
                self.trace.computing(id(self), f"B {step.label} mb{self.mb}")
                pairs = [(o, self.grads.pop(id(o))) for o in step.outputs
                         if o.requires_grad and id(o) in self.grads]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                for t, leaf in zip(step.inputs, step.leaves, strict=True):
                    if leaf.grad is not None:
                        self._add(t, leaf.grad)
                continue
            # every peer runs the same adjoint collective, with zeros where nothing flowed
            grads = [self.grads.pop(id(o), None) for o in step.outputs]
            todo = [(op, t, o, g) for op, t, o, g in zip(step.ops, step.inputs, step.outputs,
                                                         grads, strict=True)
                    if t.requires_grad]
            if not todo:
                continue
            rec = CommRecord("B", step.what, step.layer, self.mb, time.perf_counter())
            sent = [(op.adjoint(), torch.zeros_like(o) if g is None else g)
                    for op, _, o, g in todo]
            pending = [op.start(g) for op, g in sent]
            rec.issued = [(op, tuple(g.shape), g.dtype) for op, g in sent]
            back = yield from self._wait(rec, pending)
            for (_, t, _, _), g in zip(todo, back, strict=True):
                self._add(t, g)
        return None


def interleave(first: Steps | None, second: Steps | None) -> tuple[object, object]:
    """Run two generators alternately, each until its next yield (a hop in flight); returns
    both results. Megatron starts with the backward (its combine⁻¹ hides behind attention)."""
    gens = {0: first, 1: second}
    results: dict[int, object] = {0: None, 1: None}
    while any(g is not None for g in gens.values()):
        for i in (0, 1):
            g = gens[i]
            if g is None:
                continue
            try:
                next(g)
            except StopIteration as stop:
                results[i], gens[i] = stop.value, None
    return results[0], results[1]


# ----------------------------------------------------------------------- one chunk, forward
@dataclass
class ChunkForward:
    """What a chunk's forward leaves for its backward and for the loss report."""

    tape: Tape
    output: torch.Tensor | None  # hidden state for the next stage (None after the loss)
    objective: torch.Tensor | None  # loss chunk: what is differentiated
    aux_terms: list[torch.Tensor]  # each MoE layer's aux piece (gradient 1/M each)
    ce_sum: torch.Tensor
    aux_sum: torch.Tensor


def overlappable(moe: object) -> bool:
    """MoE layers whose dispatcher has hops to hide (ep or etp > 1, or the flex one)."""
    if not isinstance(moe, MoE):
        return False
    d = moe.dispatcher
    if isinstance(d, FlexDispatcher):
        return True
    return isinstance(d, AllToAllDispatcher) and not (d.ep.trivial and d.etp.trivial)


def chunk_forward(model: Transformer, chunk: Chunk, x_in: torch.Tensor | None,
                  tokens: torch.Tensor, targets: torch.Tensor, mb: int, trace: OverlapTrace,
                  tokens_global: int, microbatches_global: int
                  ) -> Generator[None, None, ChunkForward]:
    """`Transformer.forward_chunk` as sub-modules on a tape, yielding at every hop."""
    tape = Tape(mb, trace)
    seq = tokens.shape[1]
    if chunk.embed:
        (x,) = tape.compute("embedding", lambda: (model.embedding(model._local(tokens)),))
    else:
        assert x_in is not None
        x = x_in
    rope = model.rope(seq, x)
    aux_terms: list[torch.Tensor] = []
    for i in chunk.layers:
        block = model.layer(i)
        if overlappable(block.mlp):
            x, aux = yield from _moe_layer(tape, block, i, x, rope)
            aux_terms.append(aux)
        else:
            x, *aux = tape.compute(f"layer{i}", lambda x, b=block: _plain_block(b, x, rope), x)
            aux_terms += aux
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    aux_sum = sum((a.detach().double() for a in aux_terms), zero)
    if not chunk.loss:
        return ChunkForward(tape, x, None, aux_terms, zero, aux_sum)
    terms: dict[str, torch.Tensor] = {}

    def head(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # the loss head (final norm, output layer, MTP depths) runs as one piece; MTP blocks
        # use their dispatcher synchronously
        _, t = model.forward_chunk(x, tokens, targets, Chunk(False, (), True))
        terms.update(ce=t.ce_sum.detach(), aux=t.aux.detach().double())
        return (t.objective(tokens_global, microbatches_global),)

    (objective,) = tape.compute("loss", head, x)
    return ChunkForward(tape, None, objective, aux_terms, terms["ce"], aux_sum + terms["aux"])


def _plain_block(block, x: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
    out = block(x, rope)
    if isinstance(block.mlp, MoE) and block.mlp.aux_loss is not None:
        return out, block.mlp.aux_loss
    return (out,)


@dataclass
class _Held:
    """What the attention piece of one MoE layer leaves for the later pieces."""

    state: DispatchState | None = None  # the dispatch (for flex: the rail hop's)
    routing: Routing | None = None
    shape: tuple[int, ...] = ()  # (s/t, b, h) of the MoE input


def _moe_layer(tape: Tape, block, layer: int, x: torch.Tensor, rope
               ) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor]]:
    """One MoE decoder layer: attention → dispatch hops → experts → combine hops → residual."""
    moe: MoE = block.mlp
    d = moe.dispatcher
    held = _Held()
    pieces = LayerPieces(block)  # the layer's recompute/offload scope, across its pieces
    try:
        return (yield from _moe_pieces(tape, block, moe, d, held, pieces, layer, x, rope))
    finally:
        pieces.close()


def _moe_pieces(tape: Tape, block, moe: MoE, d, held: _Held, pieces: LayerPieces, layer: int,
                x: torch.Tensor, rope) -> Generator[None, None, tuple[torch.Tensor, torch.Tensor]]:
    """The pieces of `_moe_layer`, each run inside the layer's memory scope."""

    def attention(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x1 = x + block.attention(block.attn_norm(x), rope)
        h = block.mlp_norm(x1)  # (s/t, b, h)
        held.shape = tuple(h.shape)
        tokens = h.reshape(-1, h.shape[-1])  # (T, h)
        routing = moe.router(tokens)
        moe.tokens_per_expert += routing.counts.detach()
        if isinstance(d, FlexDispatcher):
            sent, held.state = d.rail_pre(tokens, routing)
        else:
            copies, held.state = d.dispatch_pre(tokens, routing)
            sent = (copies,)
        held.routing = routing
        return (x1, h, routing.probs, routing.aux_loss, *sent)

    x1, h, probs, aux, *sent = tape.compute(f"attention{layer}", pieces.wrap(attention), x)
    outer = held.state
    assert outer is not None and held.routing is not None
    if isinstance(d, FlexDispatcher):  # hop 1 over the rail, then the fan-out in the domain
        rail = d.rail_hop(outer)
        xr, er, pr = yield from tape.hop("dispatch", layer, [rail] * 3, sent)
        inner = d.inner

        def fan_out(xr: torch.Tensor, er: torch.Tensor, pr: torch.Tensor) -> tuple:
            # pr only rides along here: fan_in weights the partial sums with it
            y, outer.inner = inner.dispatch_pre(xr, d.inner_routing(er, pr, held.routing))
            return (y,)

        (y,) = tape.compute(f"fan_out{layer}", pieces.wrap(fan_out), xr, er, pr)
        state = outer.inner
        assert state is not None
    else:
        assert isinstance(d, AllToAllDispatcher)
        inner, state, (y,) = d, outer, sent
    for op in inner.dispatch_hops(state):
        (y,) = yield from tape.hop("dispatch", layer, [op], [y])

    def experts(y: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        expert_in, counts = inner.dispatch_post(y, state)
        out = inner.combine_pre(moe.experts(expert_in, counts), state)
        return (out,) if moe.shared is None else (out, moe.shared(h))

    out, *shared = tape.compute(f"experts{layer}", pieces.wrap(experts), y, h)
    for op in inner.combine_hops(state):
        (out,) = yield from tape.hop("combine", layer, [op], [out])
    if isinstance(d, FlexDispatcher):
        # the domain's weighted partial sums, with the probabilities as this piece's leaf
        (partial,) = tape.compute(
            f"fan_in{layer}", pieces.wrap(
                lambda out, pr: (inner.combine_post(out, replace(state, probs=pr)),)), out, pr)
        (out,) = yield from tape.hop("combine", layer, [d.rail_hop(outer).adjoint()], [partial])

    def residual(out: torch.Tensor, probs: torch.Tensor, x1: torch.Tensor, *shared):
        if isinstance(d, FlexDispatcher):
            y = d.rail_post(out, outer)
        else:
            y = d.combine_post(out, replace(outer, probs=probs))
        y = y.view(*held.shape).to(x1.dtype)
        return (x1 + (y if not shared else y + shared[0]),)

    (x_out,) = tape.compute(f"combine{layer}", pieces.wrap(residual), out, probs, x1, *shared)
    return x_out, aux


def chunk_backward(fwd: ChunkForward, grad_out: torch.Tensor | None, x_in: torch.Tensor | None,
                   microbatches_global: int) -> Generator[None, None, torch.Tensor | None]:
    """The chunk's backward over its tape; returns the gradient of its input (None if it
    embedded the tokens)."""
    tape = fwd.tape
    if fwd.objective is not None:
        tape.seed(fwd.objective, torch.ones_like(fwd.objective))
    else:
        assert fwd.output is not None
        tape.seed(fwd.output, grad_out)
    for a in fwd.aux_terms:
        tape.seed(a, torch.full_like(a, 1.0 / microbatches_global))
    yield from tape.backward()
    return None if x_in is None else tape.grad_of(x_in)
