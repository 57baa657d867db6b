"""Hugging Face checkpoints in and out: `run --init-from HF_DIR` and `checkpoint export --to hf`.

Loading: every parameter of this rank's (already split and sharded, still meta) model is
mapped to the HF tensor(s) it comes from, and only the box this rank keeps is read, through
`safetensors.safe_open(...).get_slice` (the file is memory-mapped; nothing else is touched),
so no rank ever holds the whole model. Layout differences are exact re-indexings:

- experts: HF v5 stores them fused, `gate_up_proj (E, 2f, h)` and `down_proj (E, h, f)`; hub
  checkpoints per expert, `experts.{e}.gate_proj.weight (f, h)` (Mixtral v4: w1/w3/w2);
  moeplan keeps `w_gate, w_up (E, h, f)` and `w_down (E, f, h)` (grouped-GEMM layout).
- DeepSeek RoPE: with `rope_interleave` HF's rotary dims are interleaved pairs (x0, x1), (x2,
  x3), ...; moeplan rotates halves, so the rotary rows of q_b_proj / q_proj and of
  kv_a_proj_with_mqa are permuted evens-then-odds, which gives the same q·k exactly.
- MTP depth k (DeepSeek-V3, GLM-4.5): `model.layers.{L+k}.{enorm, hnorm, eh_proj,
  shared_head.norm}` and that layer's own block weights; the export also writes the hub's
  copies of the embedding and output layer there (`embed_tokens`, `shared_head.head`), which
  moeplan's MTP shares with the model and so never reads.

A tensor missing from the checkpoint, or of another shape than the plan's model needs, is a
SpecError naming the tensor (exit 2), found by `check_hf_dir` from the file headers before any
worker starts.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import SpecError
from ..fsio import FileRefused, loads_json, open_regular, read_regular
from ..specs import ModelSpec
from .layers import shard_info

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KB
MAX_INDEX_BYTES = 64 << 20  # index.json of the largest public checkpoints is a few MB


# ------------------------------------------------------------------------------ the files
def read_json(path: Path, limit: int) -> dict[str, Any]:
    """A strict JSON object from `path`: a regular file (a named pipe or a link to a device is
    refused, never waited on or read without end), at most `limit` bytes, no repeated key, no
    NaN or infinity (`1e999` included) — the planner's reader (`specs.loader`) refuses the same."""
    try:
        raw = read_regular(path, limit)
    except FileRefused as err:
        if err.kind == "size":
            raise SpecError(f"{path} is more than the {limit:,} bytes a Hugging Face file of "
                            "this kind can be; check the path.") from None
        if err.kind == "unreadable":
            raise SpecError(f"cannot read {path}: {err.reason}. Check the path.") from None
        raise SpecError(f"{path} {err.reason}; a Hugging Face checkpoint directory holds "
                        "regular files.") from None
    try:
        data = loads_json(raw)
    except UnicodeDecodeError:
        raise SpecError(f"{path} is not UTF-8 text; it is not a Hugging Face JSON file.") from None
    except (ValueError, RecursionError) as err:
        raise SpecError(f"{path} is not valid JSON: {str(err)[:120]}. Fix the file.") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path} must hold a JSON object.")
    return data


def hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """The config.json of an HF checkpoint directory."""
    d = Path(hf_dir)
    if not d.is_dir():
        raise SpecError(f"--init-from {d}: not a directory; pass a Hugging Face checkpoint "
                        "directory (config.json and *.safetensors).")
    return read_json(d / "config.json", MAX_CONFIG_BYTES)


def hf_model_spec(hf_dir: str | Path) -> ModelSpec:
    """The ModelSpec of an HF checkpoint directory's config.json."""
    from ..specs.hf import model_from_hf_config

    d = Path(hf_dir)
    return model_from_hf_config(hf_config(d), str(d / "config.json"), name=d.name or "hf")


class HFWeights:
    """The tensors of an HF checkpoint directory, by name: `model.safetensors.index.json` when
    present (its weight_map says which file holds which tensor), else every *.safetensors.
    Files are opened lazily; a read takes only the asked box (safetensors slicing)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir, self._open, self._files = Path(hf_dir), safe_open, {}
        self.elements_read = 0  # what the slicing actually read (the tests check it)
        index = self.dir / "model.safetensors.index.json"
        self.where: dict[str, str] = {}
        if index.is_file():
            wm = read_json(index, MAX_INDEX_BYTES).get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise SpecError(f"{index}: weight_map must map tensor names to file names.")
            for name, file in wm.items():
                if Path(file).name != file:
                    raise SpecError(f"{index}: file {file[:80]!r} of {name[:80]!r} is not a "
                                    "plain file name in the checkpoint directory.")
            self.where = dict(wm)
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise SpecError(f"{self.dir}: no *.safetensors file; --init-from needs the "
                                "weights in safetensors (pickled .bin files are never loaded).")
            for f in files:
                for name in self._file(f).keys():  # noqa: SIM118 (safe_open is not iterable)
                    self.where[name] = f

    def _file(self, name: str):
        if name not in self._files:
            path = self.dir / name
            try:  # a named pipe would block safe_open forever, a device read without end
                os.close(open_regular(path))
            except FileRefused as err:
                raise SpecError(f"{path} {err.reason}; the weights of a Hugging Face "
                                "checkpoint are regular safetensors files.") from None
            try:
                self._files[name] = self._open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise SpecError(f"{path}: not a readable safetensors file "
                                f"({str(err)[:120]}).") from None
        return self._files[name]

    def has(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.where:
            raise SpecError(f"{self.dir}: the checkpoint has no tensor {name!r}, which the "
                            "plan's model needs; is it the checkpoint of this config.json?")
        try:
            return tuple(self._file(self.where[name]).get_slice(name).get_shape())
        except SpecError:
            raise
        except Exception:
            raise SpecError(f"{self.dir}: tensor {name!r} is listed in the index but "
                            f"missing from {self.where[name]}.") from None

    def read(self, name: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """HF tensor `name` cut to `box` ((start, stop) per dim), as fp32."""
        self.shape(name)
        sl = self._file(self.where[name]).get_slice(name)
        t = sl[tuple(slice(a, b) for a, b in box)] if box else sl[:]
        self.elements_read += t.numel()
        return t.to(torch.float32)


# ------------------------------------------------------------------------- name mapping
def rope_perm(n: int) -> torch.Tensor:
    """Evens then odds: HF interleaved rotary pairs → moeplan's rotate-half layout."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


@dataclass(frozen=True)
class Direct:
    """moeplan tensor = HF tensor `name`, its dim-0 rows taken through `rows` when given."""

    name: str
    rows: torch.Tensor | None = None

    def shape(self, w: HFWeights) -> tuple[int, ...]:
        return w.shape(self.name)

    def label(self) -> str:
        return repr(self.name)

    def read(self, w: HFWeights, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        if self.rows is None:
            return w.read(self.name, box)
        idx = self.rows[box[0][0]: box[0][1]]
        lo, hi = int(idx.min()), int(idx.max()) + 1
        t = w.read(self.name, ((lo, hi), *box[1:]))
        return t[idx - lo]

    def to_hf(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.rows is None:
            return {self.name: full}
        out = torch.empty_like(full)
        out[self.rows] = full
        return {self.name: out}


@dataclass(frozen=True)
class Experts:
    """moeplan w_gate / w_up (E, h, f) or w_down (E, f, h) from HF fused or per-expert tensors.

    `fused`: `{prefix}.gate_up_proj (E, 2f, h)` (gate rows first) / `{prefix}.down_proj (E, h, f)`;
    else `{prefix}.{e}.{sub}.weight` per expert, (f, h) for gate/up and (h, f) for down."""

    prefix: str
    part: str  # gate | up | down
    E: int
    f: int
    h: int
    fused: bool
    sub: str  # per-expert tensor name (gate_proj / w1, ...)

    def shape(self, w: HFWeights) -> tuple[int, ...]:
        E, f, h = self.E, self.f, self.h
        if self.fused:
            name = f"{self.prefix}.{'down_proj' if self.part == 'down' else 'gate_up_proj'}"
            want = (E, h, f) if self.part == "down" else (E, 2 * f, h)
            _expect(w, name, want)
        else:
            for e in range(E):
                _expect(w, self._name(e), (h, f) if self.part == "down" else (f, h))
        return (E, f, h) if self.part == "down" else (E, h, f)

    def label(self) -> str:
        part = "down_proj" if self.part == "down" else "gate_up_proj"
        return repr(f"{self.prefix}.{part}" if self.fused else self._name(0)) + " (and peers)"

    def _name(self, e: int) -> str:
        return f"{self.prefix}.{e}.{self.sub}.weight"

    def read(self, w: HFWeights, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        (e0, e1), (a0, a1), (b0, b1) = box  # moeplan dims: (E, h, f) or (E, f, h)
        if self.fused:
            if self.part == "down":  # HF (E, h, f) ↔ moeplan (E, f, h)
                return w.read(f"{self.prefix}.down_proj", ((e0, e1), (b0, b1), (a0, a1))
                              ).transpose(1, 2)
            off = 0 if self.part == "gate" else self.f  # HF (E, 2f, h) ↔ moeplan (E, h, f)
            return w.read(f"{self.prefix}.gate_up_proj",
                          ((e0, e1), (b0 + off, b1 + off), (a0, a1))).transpose(1, 2)
        per = [w.read(self._name(e), ((b0, b1), (a0, a1))).t() for e in range(e0, e1)]
        return torch.stack(per)

    def to_hf(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per expert, or this part of the fused tensor (the caller concatenates gate, up)."""
        if self.fused:
            key = "down_proj" if self.part == "down" else "gate_up_proj"
            return {f"{self.prefix}.{key}#{self.part}": full.transpose(1, 2).contiguous()}
        return {self._name(e): full[e].t().contiguous() for e in range(self.E)}


def _expect(w: HFWeights, name: str, want: tuple[int, ...]) -> None:
    got = w.shape(name)
    if got != want:
        raise SpecError(f"{w.dir}: tensor {name!r} has shape {list(got)} but the plan's model "
                        f"needs {list(want)}; the checkpoint does not match its config.")


_ATTN = {"q_down": "q_a_proj", "q_down_norm": "q_a_layernorm", "q_up": "q_b_proj",
         "kv_down": "kv_a_proj_with_mqa", "kv_down_norm": "kv_a_layernorm",
         "kv_up": "kv_b_proj"}
_MTP = {"emb_norm": "enorm", "hidden_norm": "hnorm", "proj": "eh_proj",
        "final_norm": "shared_head.norm"}


class Mapping:
    """moeplan parameter/buffer name → its HF source, for one model and checkpoint layout."""

    def __init__(self, spec: ModelSpec, config: dict[str, Any], weights: HFWeights | None):
        self.spec, self.w = spec, weights
        self.interleave = spec.attention == "mla" and bool(config.get("rope_interleave", True))
        self.moe_prefix = "mlp"
        if weights is not None and any(".block_sparse_moe." in n for n in weights.where):
            self.moe_prefix = "block_sparse_moe"  # Mixtral checkpoints written by v4

    def _rows(self, kind: str) -> torch.Tensor | None:
        """Row permutation of MLA's projections holding rotary dims (see module doc)."""
        s = self.spec
        if not self.interleave:
            return None
        r = s.qk_rope_head_dim or 0
        if kind == "q":  # (a·(nope + rope), ·): the rope rows of every head
            qk = (s.qk_nope_head_dim or 0) + r
            head = torch.cat([torch.arange(s.qk_nope_head_dim or 0),
                              (s.qk_nope_head_dim or 0) + rope_perm(r)])
            return torch.cat([head + i * qk for i in range(s.num_attention_heads)])
        kvr = s.kv_lora_rank or 0  # (kv_rank + rope, ·)
        return torch.cat([torch.arange(kvr), kvr + rope_perm(r)])

    def _experts(self, layer: str, part: str) -> Experts:
        s = self.spec
        prefix = f"{layer}.{self.moe_prefix}.experts"
        fused = self.w is None or self.w.has(f"{prefix}.down_proj")
        old = self.moe_prefix == "block_sparse_moe"
        sub = {"gate": "w1" if old else "gate_proj", "up": "w3" if old else "up_proj",
               "down": "w2" if old else "down_proj"}[part]
        return Experts(prefix, part, s.num_experts, s.moe_ffn_hidden_size or 0, s.hidden_size,
                       fused, sub)

    def layer_source(self, layer: str, rest: str) -> Direct | Experts | None:
        """The source of `rest` (a name inside a Block) in HF decoder layer `layer`."""
        parts = rest.split(".")
        if rest == "attn_norm.weight":
            return Direct(f"{layer}.input_layernorm.weight")
        if rest == "mlp_norm.weight":
            return Direct(f"{layer}.post_attention_layernorm.weight")
        if parts[0] == "attention":
            mod, leaf = parts[1], ".".join(parts[2:])
            name = f"{layer}.self_attn.{_ATTN.get(mod, mod)}.{leaf}"
            rows = None
            if (mod in ("q_up", "q_proj") and self.spec.attention == "mla"
                    and leaf == "weight"):
                rows = self._rows("q")
            elif mod == "kv_down":
                rows = self._rows("kv")
            return Direct(name, rows)
        if parts[0] != "mlp":
            return None
        if parts[1] == "experts":
            part = {"w_gate": "gate", "w_up": "up", "w_down": "down"}[parts[2]]
            return self._experts(layer, part)
        if parts[1] == "router":
            leaf = {"weight": "weight", "bias": "bias",
                    "expert_bias": "e_score_correction_bias"}[parts[2]]
            return Direct(f"{layer}.{self.moe_prefix}.gate.{leaf}")
        if parts[1] == "shared":
            if parts[2] == "out_gate":
                return Direct(f"{layer}.mlp.shared_expert_gate.weight")
            # Qwen2Moe's gated shared expert is one `shared_expert`; DeepSeek's and GLM's
            # ungated ones are `shared_experts`
            shared = "shared_expert" if self.spec.shared_expert_gate else "shared_experts"
            return Direct(f"{layer}.mlp.{shared}.{'.'.join(parts[2:])}")
        return Direct(f"{layer}.mlp.{'.'.join(parts[1:])}")  # dense MLP

    def source(self, name: str) -> Direct | Experts:
        """The HF source of moeplan tensor `name` (SpecError if moeplan has no HF name for it)."""
        src: Direct | Experts | None = None
        if name == "embedding.weight":
            src = Direct("model.embed_tokens.weight")
        elif name == "output":
            src = Direct("lm_head.weight")
        elif name == "final_norm.weight":
            src = Direct("model.norm.weight")
        elif m := re.fullmatch(r"layers\.(\d+)\.(.+)", name):
            src = self.layer_source(f"model.layers.{m[1]}", m[2])
        elif m := re.fullmatch(r"mtp\.(\d+)\.(.+)", name):
            layer = f"model.layers.{self.spec.num_layers + int(m[1])}"
            head, _, rest = m[2].partition(".")
            if head == "block":
                src = self.layer_source(layer, rest)
            elif head in _MTP:
                src = Direct(f"{layer}.{_MTP[head]}.{rest}")
        if src is None:
            raise SpecError(f"moeplan tensor {name!r} has no Hugging Face counterpart; this "
                            "model cannot be loaded from or exported to Hugging Face.")
        return src


# ------------------------------------------------------------------------------ loading
def _box(full: tuple[int, ...], cuts: tuple[tuple[int, int, int], ...]
         ) -> tuple[tuple[int, int], ...]:
    """(start, stop) per dim of the piece that successive narrows `cuts` keep of `full`."""
    box = [(0, n) for n in full]
    for dim, start, size in cuts:
        lo = box[dim][0] + start
        box[dim] = (lo, lo + size)
    return tuple(box)


def _tensors(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor, bool]]:
    """(full name, owning module, key, tensor, is_buffer) of every parameter and persistent
    buffer holding model state (norms, biases, expert-bias), each shared tensor once."""
    out = []
    for mod_name, module in model.named_modules():
        for key, t in [*((k, v) for k, v in module._parameters.items()),
                       *((k, v) for k, v in module._buffers.items()
                         if k not in module._non_persistent_buffers_set)]:
            if t is None:
                continue
            full = f"{mod_name}.{key}" if mod_name else key
            out.append((full, module, key, t, key in module._buffers))
    return out


def expected_names(model: nn.Module) -> list[str]:
    return [n for n, *_ in _tensors(model)]


def load_hf_(model: nn.Module, hf_dir: str | Path, spec: ModelSpec,
             weights: HFWeights | None = None) -> nn.Module:
    """Fill every parameter and buffer of `model` (this rank's stages and shards, big weights
    still on the meta device) from the HF checkpoint in `hf_dir`, reading only this rank's
    boxes. Replaces meta Parameters as `layers.materialize_` does, keeping their attributes."""
    w = weights or HFWeights(hf_dir)
    mapping = Mapping(spec, hf_config(hf_dir), w)
    done: dict[int, torch.Tensor] = {}
    for name, module, key, t, is_buffer in _tensors(model):
        if id(t) in done:
            module._parameters[key] = done[id(t)]  # type: ignore[assignment]
            continue
        src = mapping.source(name)
        full = src.shape(w)
        info = shard_info(t)
        want = info.full_shape
        box = _box(full, info.slices)
        local = tuple(b - a for a, b in box)
        if (want is not None and tuple(want) != full) or local != tuple(t.shape):
            raise SpecError(f"{hf_dir}: tensor {src.label()} has shape {list(full)} in the "
                            f"checkpoint but the plan's model needs {list(want or t.shape)} "
                            f"for its {name!r}; the checkpoint does not match the plan.")
        value = src.read(w, box).contiguous()
        if is_buffer:
            module._buffers[key] = value.to(t.dtype)
            continue
        new = nn.Parameter(value, requires_grad=t.requires_grad)
        new.__dict__.update(t.__dict__)
        done[id(t)] = new
        module._parameters[key] = new
    return model


def _function_fields(spec: ModelSpec) -> dict[str, Any]:
    """The ModelSpec fields that define the function (not its name or training objective),
    with defaults resolved (head_dim None and head_dim = h/a are the same model)."""
    d = spec.model_dump(exclude={"name", "moe_aux_loss_coeff"})
    if spec.position_embedding == "rope":  # a RoPE model's context length: not its function
        d.pop("max_position_embeddings")
    if spec.attention == "gqa":
        d.update(head_dim=spec.head_dim_, num_kv_heads=spec.kv_heads)
    return d


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:80] + "…"


def check_hf_dir(spec: ModelSpec, hf_dir: str | Path) -> None:
    """Refuse (SpecError, exit 2) an HF directory whose config or tensors do not match `spec`,
    from config.json and the safetensors headers only; run before any worker starts."""
    from .model import Transformer

    with _config_notes_off("RANK" in os.environ):  # workers repeat the launcher's check
        other = hf_model_spec(hf_dir)
    a, b = _function_fields(spec), _function_fields(other)
    w = HFWeights(hf_dir)
    if a["mtp_layers"] > b["mtp_layers"]:
        # transformers builds no MTP module, so a config read for it may count none (GLM-4.5,
        # DeepSeek-V3 under v5 keys), while the hub's checkpoints carry the weights as
        # model.layers.{L+k}: the plan's depth is read from them (shapes checked below)
        missing = _missing_mtp(w, spec)
        if missing:
            raise SpecError(f"--init-from {hf_dir}: the plan's model has {spec.mtp_layers} MTP "
                            f"depth(s), but the checkpoint holds no {missing!r} (nor its "
                            "config a count); plan with mtp_layers "
                            f"{b['mtp_layers']}, or load a checkpoint that has them.")
        b["mtp_layers"] = a["mtp_layers"]
    for f in a:
        if a[f] != b[f]:
            raise SpecError(f"--init-from {hf_dir}: its config has {f}={_short(b[f])} but the "
                            f"plan's model has {f}={_short(a[f])}; plan with that config.json "
                            f"as the model (`moeplan search --model "
                            f"{Path(hf_dir) / 'config.json'} ...`).")
    with torch.device("meta"):
        model = Transformer(spec, materialize=False)
    mapping = Mapping(spec, hf_config(hf_dir), w)
    for name, _module, _key, t, _buf in _tensors(model):
        src = mapping.source(name)
        full = src.shape(w)
        want = shard_info(t).full_shape or tuple(t.shape)
        if full != want:
            raise SpecError(f"{hf_dir}: tensor {src.label()} has shape {list(full)} but the "
                            f"plan's model needs {list(want)} for its {name!r}; the "
                            "checkpoint does not match the plan.")


@contextlib.contextmanager
def _config_notes_off(off: bool = True) -> Iterator[None]:
    """The config reader's notes (logger `moeplan.hf`) silenced while the block runs, when
    `off`: for a config already read once, or one moeplan wrote itself."""
    log = logging.getLogger("moeplan.hf")
    was = log.disabled
    log.disabled = was or off
    try:
        yield
    finally:
        log.disabled = was


def _missing_mtp(w: HFWeights, spec: ModelSpec) -> str | None:
    """The first MTP depth's projection the checkpoint lacks (None: it holds every depth's)."""
    names = (f"model.layers.{spec.num_layers + k}.eh_proj.weight"
             for k in range(spec.mtp_layers))
    return next((n for n in names if not w.has(n)), None)


def describe_objective(spec: ModelSpec, aux_coeff: float) -> str:
    """What a run trains, in one line: its loss terms and their weights, and where the
    model's own config names another load-balancing coefficient (HF router_aux_loss_coef,
    DeepSeek aux_loss_alpha), that one and how to follow it."""
    terms = ["cross-entropy"]
    if spec.is_moe and aux_coeff:
        terms.append(f"{aux_coeff:g} × switch load-balancing loss summed over MoE layers")
    if spec.router_expert_bias:
        terms.append("aux-loss-free expert-bias balancing")
    if spec.mtp_layers:
        terms.append(f"{spec.mtp_layers} MTP depth(s)")
    line = "objective: " + " + ".join(terms)
    own = spec.moe_aux_loss_coeff
    if spec.is_moe and own is not None and own != aux_coeff:
        line += (f" (the model's config names a load-balancing coefficient of {own:g}; set "
                 f"training moe_aux_loss_coeff: {own:g} to train its own objective)")
    return line


__all__ = ["HFWeights", "Mapping", "check_hf_dir", "describe_objective", "hf_config",
           "hf_model_spec", "load_hf_"]


# ------------------------------------------------------------------------------ export
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size


_ROPE_KEYS = {
    "linear": ("factor",), "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "longrope": ("factor", "short_factor", "long_factor", "original_max_position_embeddings",
                 "attention_factor"),
}


def _rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    """v5 `rope_parameters`: θ, and the scaling keys transformers reads for its rope_type."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    r = spec.rope_scaling
    if r is not None:
        out["rope_type"] = r.kind
        out.update({k: getattr(r, k) for k in _ROPE_KEYS[r.kind] if getattr(r, k) is not None})
    return out


def _hf_architecture(spec: ModelSpec) -> str:
    """The transformers architecture that computes exactly `spec` (SpecError if none does)."""
    if spec.attention == "mla":
        return "DeepseekV3ForCausalLM"
    if spec.is_moe and (spec.router_score == "sigmoid" or spec.rotary_percent != 1.0):
        return "Glm4MoeForCausalLM"  # DeepSeek-V3's MoE under GQA
    if spec.is_moe:
        return "Qwen3MoeForCausalLM" if spec.qk_norm else "MixtralForCausalLM"
    return "Qwen3ForCausalLM" if spec.qk_norm else "LlamaForCausalLM"


def hf_config_for(spec: ModelSpec) -> dict[str, Any]:
    """config.json (v5 keys) of the HF architecture computing `spec`; checked by importing it
    back: a model no HF architecture computes exactly is refused, naming the field."""
    from ..specs.hf import ARCHITECTURES, HIDDEN_ACT

    arch = _hf_architecture(spec)
    act = {v: k for k, v in reversed(list(HIDDEN_ACT.items()))}.get(spec.activation)
    max_pos = ((spec.rope_scaling.max_position_embeddings if spec.rope_scaling else None)
               or (spec.rope_scaling.original_max_position_embeddings
                   if spec.rope_scaling and spec.rope_scaling.kind == "dynamic" else None)
               or spec.max_position_embeddings or 32768)
    c: dict[str, Any] = {
        "architectures": [arch], "model_type": ARCHITECTURES[arch],
        "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads, "intermediate_size": spec.ffn_hidden_size,
        "vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tie_embeddings,
        "rms_norm_eps": spec.norm_eps, "hidden_act": act or spec.activation,
        "rope_parameters": _rope_parameters(spec), "max_position_embeddings": max_pos,
        "attention_bias": spec.attn_out_bias, "torch_dtype": "float32",
    }
    if spec.attention == "gqa":
        c.update(num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim_)
    if arch == "LlamaForCausalLM":
        c["mlp_bias"] = spec.mlp_bias
    if spec.is_moe:
        c.update(num_experts_per_tok=spec.moe_top_k, norm_topk_prob=spec.norm_topk_prob)
        if spec.moe_aux_loss_coeff is not None:
            c["router_aux_loss_coef"] = spec.moe_aux_loss_coeff
    if arch == "MixtralForCausalLM":
        c["num_local_experts"] = spec.num_experts
    elif arch == "Qwen3MoeForCausalLM":
        moe = spec.moe_layers()
        c.update(num_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size,
                 decoder_sparse_step=1, mlp_only_layers=[i for i, m in enumerate(moe) if not m])
    elif arch == "Glm4MoeForCausalLM":
        c["rope_parameters"]["partial_rotary_factor"] = spec.rotary_percent
        c.update(attention_bias=spec.qkv_bias, use_qk_norm=spec.qk_norm,
                 n_routed_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size,
                 n_shared_experts=spec.num_shared_experts,
                 first_k_dense_replace=spec.first_k_dense, n_group=spec.router_num_groups or 1,
                 topk_group=spec.router_groups_per_token or 1,
                 routed_scaling_factor=spec.routed_scaling_factor,
                 num_nextn_predict_layers=spec.mtp_layers)  # the hub's layout, model.layers.{L+k}
    elif arch == "DeepseekV3ForCausalLM":
        c.pop("attention_bias")
        c.update(num_key_value_heads=spec.num_attention_heads, q_lora_rank=spec.q_lora_rank,
                 kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
                 qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim,
                 n_routed_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size,
                 n_shared_experts=spec.num_shared_experts,
                 first_k_dense_replace=spec.first_k_dense, n_group=spec.router_num_groups or 1,
                 topk_group=spec.router_groups_per_token or 1,
                 routed_scaling_factor=spec.routed_scaling_factor,
                 attention_bias=spec.attn_out_bias, rope_interleave=True,
                 num_nextn_predict_layers=0)
        if spec.mtp_layers:  # DeepSeek's own format: MTP weights as model.layers.{L+k}
            c.update(num_nextn_predict_layers=spec.mtp_layers, topk_method="noaux_tc",
                     scoring_func="sigmoid")
    from ..specs.hf import model_from_hf_config

    with _config_notes_off():  # reading our own config back: no notes
        back = _function_fields(model_from_hf_config(c, "export"))
    want = _function_fields(spec)
    if arch == "Glm4MoeForCausalLM":  # MTP weights travel; transformers builds no MTP module
        back["mtp_layers"] = want["mtp_layers"]
    for f in want:
        if want[f] != back[f]:
            raise SpecError(f"model {spec.name!r}: {f}={_short(want[f])} has no exact "
                            f"counterpart in transformers' {arch} (it would run "
                            f"{f}={_short(back[f])}); this checkpoint cannot be exported to "
                            "Hugging Face.")
    return c


def hf_tensors(spec: ModelSpec, full: dict[str, torch.Tensor],
               per_expert: bool = True) -> dict[str, torch.Tensor]:
    """moeplan's full tensors (by moeplan name) → HF tensors (by HF name, HF layout): the hub
    layout save_pretrained writes (experts one by one; Mixtral's as block_sparse_moe w1/w3/w2),
    or v5's fused expert tensors with `per_expert=False`."""
    mapping = Mapping(spec, {"rope_interleave": True}, None)
    if per_expert and _hf_architecture(spec) == "MixtralForCausalLM":
        mapping.moe_prefix = "block_sparse_moe"
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in full.items():
        src = mapping.source(name)
        if isinstance(src, Experts) and per_expert:
            src = Experts(src.prefix, src.part, src.E, src.f, src.h, False, src.sub)
        for key, v in src.to_hf(t.detach().float().cpu()).items():
            base, _, part = key.partition("#")
            if part:
                fused.setdefault(base, {})[part] = v
            else:
                out[key] = v.contiguous()
    for base, parts in fused.items():  # gate rows first, then up (HF chunk(2) order)
        out[base] = (parts["down"] if "down" in parts
                     else torch.cat([parts["gate"], parts["up"]], dim=1)).contiguous()
    for k in range(spec.mtp_layers):
        # the hub's MTP layers carry their own copies of the embedding and the output layer
        # (DeepSeek-V3's and GLM-4.5's checkpoints; vLLM's MTP loader reads them there)
        layer = f"model.layers.{spec.num_layers + k}"
        out[f"{layer}.embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        head = out.get("lm_head.weight", out["model.embed_tokens.weight"])
        out[f"{layer}.shared_head.head.weight"] = head.clone()
    return out


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------ tokenizer
TOKENIZER_DIR = "tokenizer"  # in a --ckpt-dir: the tokenizer the run trained with


def keep_tokenizer(tokenizer_model: str, ckpt_dir: str | Path) -> Path:
    """Copy the run's tokenizer into CKPT_DIR/tokenizer (replaced atomically: written beside it,
    then renamed), so `checkpoint export --to hf` ships the tokenizer the weights were trained
    with, even after the original files move."""
    import shutil
    import uuid

    from ..data.tokenizer import export_tokenizer, load_tokenizer

    _, info = load_tokenizer(tokenizer_model)
    root = Path(ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{TOKENIZER_DIR}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        export_tokenizer(info, tmp)
        old = root / TOKENIZER_DIR
        if old.exists():
            shutil.rmtree(old)
        tmp.rename(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root / TOKENIZER_DIR


def checkpoint_tokenizer(ckpt_dir: str | Path):
    """The TokenizerInfo a run kept in CKPT_DIR/tokenizer, or None when it ran without one."""
    from ..data.tokenizer import load_tokenizer

    d = Path(ckpt_dir) / TOKENIZER_DIR
    return load_tokenizer(d)[1] if (d / "tokenizer.json").is_file() else None


def _hf_special_ids(config: dict[str, Any], tokenizer) -> dict[str, Any]:
    """config.json's eos_token_id from the tokenizer's end-of-document token, so `generate`
    knows where a text ends."""
    if tokenizer is None or tokenizer.eod_id is None:
        return config
    return {**config, "eos_token_id": tokenizer.eod_id}


def _export_tmp(out: Path) -> Path:
    """The temporary sibling an export of `out` writes into: `.OUT.tmp-HOST-PID-RANDOM`, so a
    later export can tell the leftover of a killed one from one in progress."""
    import socket
    import uuid

    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64]
    return out.parent / f".{out.name}.tmp-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _remove_stale_exports(out: Path) -> list[Path]:
    """Remove what killed exports to `out` left behind (their temporary directories never
    reached the rename): those of this host whose process is gone, and any of an older naming
    without host and pid. A live export's directory, and other hosts', are left alone."""
    import shutil
    import socket

    host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64]
    gone = []
    for p in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        tail = p.name[len(out.name) + 6:]
        m = re.fullmatch(r"(.+)-(\d+)-[0-9a-f]{8}", tail)
        if m is None and not re.fullmatch(r"[0-9a-f]{8}", tail):
            continue  # not a name an export gives
        if m is not None and (m[1] != host or _alive(int(m[2]))):
            continue
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_hf(spec: ModelSpec, full: dict[str, torch.Tensor], out_dir: str | Path,
             max_shard_bytes: int = MAX_SHARD_BYTES, tokenizer=None) -> Path:
    """config.json + sharded safetensors + model.safetensors.index.json (+ the tokenizer's
    files, `tokenizer`: a `data.tokenizer.TokenizerInfo`), atomically: written into a temporary
    sibling directory, each file fsynced, then renamed to `out_dir` (which must not exist
    yet), so a failed export leaves nothing behind, and what a killed one left is removed by
    the next export to the same place."""
    import shutil

    from safetensors.torch import save

    out = Path(out_dir)
    if out.exists():
        raise SpecError(f"-o {out}: it already exists; export into a new directory.")
    if not out.parent.is_dir():
        raise SpecError(f"-o {out}: the parent directory {out.parent} does not exist.")
    _remove_stale_exports(out)
    config = _hf_special_ids(hf_config_for(spec), tokenizer)
    tensors = hf_tensors(spec, full)
    tmp = _export_tmp(out)
    try:
        tmp.mkdir()
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name in sorted(tensors):
            n = tensors[name].numel() * tensors[name].element_size()
            if shards[-1] and size + n > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensors[name]
            size += n
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            _fsync_write(tmp / file, save(shard, metadata={"format": "pt"}))
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _fsync_write(tmp / "model.safetensors.index.json",
                     json.dumps(index, indent=1, allow_nan=False).encode())
        _fsync_write(tmp / "config.json", json.dumps(config, indent=1, allow_nan=False).encode())
        if tokenizer is not None:
            from ..data.tokenizer import export_tokenizer

            export_tokenizer(tokenizer, tmp)
        os.rename(tmp, out)
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SpecError(f"-o {out}: cannot write the export ({err.strerror}).") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
