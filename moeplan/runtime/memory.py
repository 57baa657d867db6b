"""Activation recompute and offload, per module, exactly as the plan's `Choices` name them.

The planner decides which modules of which pipeline rank recompute or offload; this module only
maps those names onto the model's modules (STYLE.md #2). Three mechanisms, as in Megatron Core:

- **Checkpoint** (`full`, `core_attn`, `mlp`, `moe`, `shared_experts`): the module runs under
  `torch.utils.checkpoint(use_reentrant=False)`: nothing inside it is kept for backward, only its
  inputs; backward re-runs it (its collectives included, at the same point on every peer).
- **Output-discarding recompute** (`layernorm`, `moe_act`, `mla_up_proj`; Megatron's
  `CheckpointWithoutOutput`): the module is checkpointed, and where the *following* ops save
  its outputs they keep a recipe instead; their backward recomputes the outputs once (no
  graph), the module's own backward recomputes it again inside the graph. Megatron recomputes
  once and writes the result back into the freed storage; the second, elementwise-cheap pass
  keeps autograd's gradient accumulation order exactly as without recompute (a single replay
  through a nested backward sums the residual stream's gradient in another order, which Adam
  turned into 7e-6 relative loss differences within three steps under tp2·ep2).
- **Offload** (`attn_norm`, `qkv_linear`, `core_attn`, `attn_proj`, `mlp_norm`, `expert_fc1`,
  `moe_act`): every tensor an op inside the module saves for backward is copied to host memory
  (pinned, on a side CUDA stream) and brought back, a whole layer at a time, when its backward
  first needs one; that also starts bringing back the layer before it (the next one backward
  reaches), so its copies overlap this layer's backward. Parameters, buffers and RoPE tables
  are never moved.

All three act through one `torch.autograd.graph.saved_tensors_hooks` scope per decoder layer
(`_Scope`), which also keeps the byte count `ActivationMeter` reports.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .layers import MLP, MLAttention
from .moe import MoE
from .replay import recompute_mode

_SCOPES: list[_Scope] = []  # the decoder layer whose forward is running (innermost last)
# the offload group of the layer that ran last inside the model chunk's forward now running
# (one entry per running chunk; empty outside a chunk's forward, e.g. in a backward replay)
_CHAIN: list[_OffloadGroup | None] = []


# ------------------------------------------------------------------------------- accounting
@dataclass
class ActivationMeter:
    """Bytes of activations kept for backward on the device, per decoder-layer forward.

    Counted at pack time by the layer scopes (each storage once, parameters excluded), plus the
    inputs a checkpointed module holds. `by_module` splits the kept bytes by the innermost
    plan-named module running when the tensor was saved (`other` outside every named one).
    """

    kept_bytes: int = 0
    offloaded_bytes: int = 0
    discarded: int = 0  # saved tensors replaced by a recompute recipe
    by_module: dict[str, int] = field(default_factory=dict)
    by_layer: list[int] = field(default_factory=list)  # one entry per layer forward, in order
    _seen: set[int] = field(default_factory=set)

    def keep(self, t: torch.Tensor, module: str) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._seen:
            return
        self._seen.add(ptr)
        n = t.untyped_storage().nbytes()
        self.kept_bytes += n
        self.by_module[module] = self.by_module.get(module, 0) + n
        if self.by_layer:
            self.by_layer[-1] += n


_METERS: list[ActivationMeter] = []


@contextlib.contextmanager
def measure_activations() -> Iterator[ActivationMeter]:
    """Count the activation bytes the instrumented layers keep inside this `with` block."""
    meter = ActivationMeter()
    _METERS.append(meter)
    try:
        yield meter
    finally:
        _METERS.remove(meter)


# ------------------------------------------------------------------------------- host copies
class _Offloaded:
    """A saved tensor's host copy; `reload` brings it back to its device."""

    def __init__(self, t: torch.Tensor):
        self.device, self.event, self.on_device = t.device, None, None
        self.host = torch.empty(t.size(), dtype=t.dtype, pin_memory=t.is_cuda)
        if t.is_cuda:  # copy on a side stream; t's memory is not reused before it is done
            stream = _side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
            t.record_stream(stream)
            self.event = stream.record_event()
        else:  # a real copy into a separate buffer, so the CPU runs the same path
            self.host.copy_(t)

    def reload(self) -> None:
        if self.on_device is not None:
            return
        if self.device.type != "cuda":
            self.on_device = self.host
            return
        stream = _side_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self.event)
            self.on_device = self.host.to(self.device, non_blocking=True)
        self.event = stream.record_event()

    def get(self) -> torch.Tensor:
        if self.device.type == "cuda" and self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.on_device.record_stream(torch.cuda.current_stream(self.device))
            self.event = None
        return self.on_device


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


@dataclass(frozen=True)
class _HostRef:
    """What the graph holds for an offloaded tensor."""

    group: _OffloadGroup
    item: _Offloaded


class _OffloadGroup:
    """One layer's host copies: the first one backward needs brings the whole layer back, and
    starts the copies of `prev`, the layer that ran before it in the same chunk's forward."""

    def __init__(self) -> None:
        self.items: list[_Offloaded] = []
        self.prev: _OffloadGroup | None = None  # set by the chunk's forward (`_layer_scope`)

    def fetch(self, item: _Offloaded) -> torch.Tensor:
        for it in self.items:  # ahead of use: the rest of the layer's backward needs them next
            it.reload()
        self.items = []  # from now on each copy lives as long as the graph node saving it
        item.reload()
        if self.prev is not None:  # prefetch one layer ahead (async on the side stream)
            for it in self.prev.items:
                it.reload()
            self.prev = None
        return item.get()


# ------------------------------------------------------------------------ discarded outputs
class _Recipe:
    """How to recompute one call of a module whose outputs the following ops do not keep."""

    def __init__(self, fn: Callable, inputs: tuple):
        self.fn, self.inputs = fn, inputs
        self.outputs: tuple | None = None

    def ensure(self) -> tuple:
        """The recomputed outputs (computed once, on first use in backward)."""
        if self.outputs is None:
            # with a graph, as in forward: some ops pick another kernel without one
            leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor)
                      else x for x in self.inputs]
            with torch.enable_grad(), recompute_mode():
                out = self.fn(*leaves)
            self.outputs = tuple(o.detach() for o in (out if isinstance(out, tuple) else (out,)))
        return self.outputs


@dataclass(frozen=True)
class _FromRecipe:
    """A saved tensor that was a discarded output: recomputed on first use."""

    recipe: _Recipe
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def get(self) -> torch.Tensor:
        base = self.recipe.ensure()[self.index].detach()
        return base.as_strided(self.size, self.stride, self.offset)


# ------------------------------------------------------------------------------- the scope
class _Scope:
    """Saved-tensor hooks of one decoder-layer forward: offload, discard, or keep (and count)."""

    def __init__(self, constants: set[int]):
        self.constants = constants  # storages of parameters, buffers, RoPE tables
        self.regions: list[str] = []  # plan-named modules running, innermost last
        self.offload: set[str] = set()
        self.discardable: dict[int, tuple[weakref.ref, _Recipe, int]] = {}
        self.group = _OffloadGroup()
        self.copies: dict[tuple, tuple[weakref.ref, _Offloaded]] = {}

    def pack(self, t: torch.Tensor) -> object:
        ptr = t.untyped_storage().data_ptr()
        if isinstance(t, nn.Parameter) or ptr in self.constants:
            return t
        hit = self.discardable.get(ptr)
        if hit is not None and hit[0]() is not None:  # alive: the pointer is not reused
            for m in _METERS:
                m.discarded += 1
            return _FromRecipe(hit[1], hit[2], t.size(), t.stride(), t.storage_offset())
        if any(r in self.offload for r in self.regions):
            key = (ptr, t.storage_offset(), tuple(t.size()), t.stride(), t.dtype)
            seen = self.copies.get(key)
            if seen is not None and seen[0]() is t:  # q, k and v projections save one input
                return _HostRef(self.group, seen[1])
            item = _Offloaded(t)
            self.group.items.append(item)
            self.copies[key] = (weakref.ref(t), item)
            for m in _METERS:
                m.offloaded_bytes += t.numel() * t.element_size()
            return _HostRef(self.group, item)
        self.count_kept(t)
        return t

    def count_kept(self, t: torch.Tensor) -> None:
        if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in self.constants:
            return
        for m in _METERS:
            m.keep(t, self.regions[-1] if self.regions else "other")

    @staticmethod
    def unpack(x: object) -> torch.Tensor:
        if isinstance(x, _FromRecipe):
            return x.get()
        if isinstance(x, _HostRef):
            return x.group.fetch(x.item)
        return x  # type: ignore[return-value]

    def close(self) -> None:
        """End of the layer's forward: forget what only the forward needed (and the
        scope ↔ recipe cycle, so everything is freed by reference counting)."""
        self.discardable.clear()
        self.copies.clear()

    def discard(self, recipe: _Recipe, outputs: tuple) -> None:
        for i, o in enumerate(outputs):
            self.discardable[o.untyped_storage().data_ptr()] = (weakref.ref(o), recipe, i)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run code of this layer's forward under the scope's saved-tensor hooks."""
        _SCOPES.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            _SCOPES.pop()


def _constants(model: nn.Module) -> set[int]:
    tensors = [*model.parameters(), *model.buffers()]
    for pair in getattr(model, "_rope", {}).values():
        tensors += list(pair)
    return {t.untyped_storage().data_ptr() for t in tensors}


# ------------------------------------------------------------------------------- wrappers
def _wrap(obj: object, attr: str, wrapper: Callable) -> None:
    """Replace the bound method `obj.attr` by `wrapper(inner, *args)` on this instance only,
    so module and parameter names never change."""
    inner = getattr(obj, attr)
    setattr(obj, attr, functools.wraps(inner)(functools.partial(wrapper, inner)))


def _chunk_scope(inner: Callable, *args: object, **kwargs: object) -> object:
    """A model chunk's forward: its layers' offload groups chain in the order they run."""
    _CHAIN.append(None)
    try:
        return inner(*args, **kwargs)
    finally:
        _CHAIN.pop()


@contextlib.contextmanager
def chunk_chain(link: list) -> Iterator[None]:
    """Run one piece of a model chunk's forward with `link[0]` (the offload group of the
    chunk's last layer so far) as the chain, and keep the updated end in `link[0]`: a chunk run
    in pieces (the EP-overlap schedule, whose pieces interleave with another micro-batch's
    backward) chains its layers' groups like a chunk run whole (`_chunk_scope`)."""
    _CHAIN.append(link[0])
    try:
        yield
    finally:
        link[0] = _CHAIN.pop()


def _open_scope(root: nn.Module, offload: set[str]) -> _Scope:
    """A decoder layer's saved-tensor scope, chained after the layer that ran before it in the
    same chunk, with its own entry in every running meter."""
    scope = _Scope(_constants(root))
    scope.offload = offload
    if _CHAIN and torch.is_grad_enabled():
        scope.group.prev, _CHAIN[-1] = _CHAIN[-1], scope.group
    for m in _METERS:
        m.by_layer.append(0)
    return scope


def _layer_scope(root: nn.Module, offload: set[str]) -> Callable:
    def run(inner: Callable, *args: object) -> torch.Tensor:
        scope = _open_scope(root, offload)
        try:
            with scope.active():
                return inner(*args)
        finally:
            scope.close()
    return run


class LayerPieces:
    """One decoder layer's saved-tensor scope for a caller that runs the layer in pieces (the
    EP-overlap schedule calls attention, experts and combine apart, with another micro-batch's
    backward in between): every piece wrapped by `wrap` runs inside the same scope, so what the
    plan offloads goes to host as one group and recompute discards outputs across pieces, as in
    the layer's plain forward. `close()` after the last piece. A layer without memory choices
    (`apply_memory` not applied) runs its pieces as they are."""

    def __init__(self, block: nn.Module):
        self.factory: Callable[[], _Scope] | None = getattr(block, "_memory_scope", None)
        self.scope: _Scope | None = None

    def wrap(self, fn: Callable) -> Callable:
        if self.factory is None:
            return fn

        def run(*args: object) -> object:
            if self.scope is None:
                self.scope = self.factory()  # in the first piece: chained in the chunk's order
            with self.scope.active():
                return fn(*args)
        return run

    def close(self) -> None:
        if self.scope is not None:
            self.scope.close()


def _region(name: str) -> Callable:
    def run(inner: Callable, *args: object, **kwargs: object) -> object:
        scope = _SCOPES[-1] if _SCOPES else None
        if scope is None:
            return inner(*args, **kwargs)
        scope.regions.append(name)
        try:
            return inner(*args, **kwargs)
        finally:
            scope.regions.pop()
    return run


def _checkpointed(inner: Callable, *args: object, **kwargs: object) -> object:
    scope = _SCOPES[-1] if _SCOPES else None
    if scope is not None:  # the inputs are what a checkpointed module keeps
        for x in args:
            if isinstance(x, torch.Tensor):
                scope.count_kept(x)
    return checkpoint(inner, *args, **kwargs, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), recompute_mode()))


def _discarded(inner: Callable, *args: object) -> object:
    """Checkpointed (its own backward re-runs it in the graph, so gradients accumulate exactly
    as without recompute), and its outputs, where later ops save them, replaced by a recipe."""
    scope = _SCOPES[-1] if _SCOPES else None
    if not torch.is_grad_enabled():
        return inner(*args)
    out = _checkpointed(inner, *args)
    if scope is not None:
        scope.discard(_Recipe(inner, args), out if isinstance(out, tuple) else (out,))
    return out


# ------------------------------------------------------------------------------- apply_*
def _sites(block: nn.Module) -> dict[str, list[tuple[object, str]]]:
    """Each plan module name → the (object, method) pairs it names in one decoder layer."""
    attn, mlp = block.attention, block.mlp
    mla = isinstance(attn, MLAttention)
    qkv = ([attn.q_down if attn.q_rank else attn.q_proj, attn.kv_down] if mla
           else [attn.q_proj, attn.k_proj, attn.v_proj])
    moe = isinstance(mlp, MoE)
    return {
        "full": [(block, "forward")],
        "core_attn": [(attn.core_attn, "forward")],
        "layernorm": [(block.attn_norm, "forward"), (block.mlp_norm, "forward")],
        "mla_up_proj": [(attn, "up_proj")] if mla else [],
        "mlp": [(mlp, "forward")] if isinstance(mlp, MLP) else [],
        "moe": [(mlp, "forward")] if moe else [],
        "shared_experts": [(mlp.shared, "forward")] if moe and mlp.shared is not None else [],
        "moe_act": [(mlp.experts, "act")] if moe else [],
        "attn_norm": [(block.attn_norm, "forward")],
        "qkv_linear": [(lin, "forward") for lin in qkv],
        "attn_proj": [(attn.o_proj, "forward")],
        "mlp_norm": [(block.mlp_norm, "forward")],
        "expert_fc1": [(mlp.experts, "fc1")] if moe else [],
    }


# cheap to replay, and their outputs are saved by the next ops (Megatron's selection)
OUTPUT_DISCARDING = ("layernorm", "moe_act", "mla_up_proj")


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """This rank's decoder layers, then the blocks of its MTP depths."""
    blocks = [b for _, b in model.layer_items()]  # type: ignore[operator]
    return blocks + [m.block for m in getattr(model, "mtp", [])]


def apply_recompute(model: nn.Module, modules: Iterable[str]) -> None:
    """Checkpoint (or output-discarding recompute for `OUTPUT_DISCARDING`) every module named."""
    for block in decoder_blocks(model):
        sites = _sites(block)
        for name in modules:
            for obj, attr in sites[name]:
                _wrap(obj, attr, _discarded if name in OUTPUT_DISCARDING else _checkpointed)


def apply_offload(model: nn.Module, modules: Iterable[str]) -> None:
    """Give every decoder layer its saved-tensor scope; what ops inside a module named in
    `modules` save goes to host memory. Every plan-named module is marked as a region, so
    the meter can also say where the bytes it counts come from."""
    modules = set(modules)
    blocks = decoder_blocks(model)
    names = [n for n in _sites(blocks[0]) if n not in ("full", "layernorm")] if blocks else []
    for block in blocks:
        sites = _sites(block)
        for name in names:
            for obj, attr in sites[name]:
                _wrap(obj, attr, _region(name))
        _wrap(block, "forward", _layer_scope(model, modules))
        block._memory_scope = functools.partial(_open_scope, model, modules)  # LayerPieces
    if modules and hasattr(model, "forward_chunk"):
        _wrap(model, "forward_chunk", _chunk_scope)


def apply_memory(model: nn.Module, recompute: Iterable[str], offload: Iterable[str],
                 measure: bool = False) -> nn.Module:
    """Recompute and offload `model`'s layers as named. Nothing is wrapped when nothing is
    asked, unless `measure` (to count the activation bytes of a plain model)."""
    recompute, offload = list(recompute), list(offload)
    if recompute or offload or measure:
        apply_recompute(model, recompute)
        apply_offload(model, offload)
    return model
