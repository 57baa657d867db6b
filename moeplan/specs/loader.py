"""Resolve user input (preset name, YAML/JSON spec file, Hugging Face config) into specs.

Every failure becomes a SpecError whose message is one paragraph naming the field and the fix,
so the CLI can print it without a traceback.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from .. import limits
from ..errors import SpecError
from ..fsio import (
    FileRefused,
    TooDeep,
    file_problem,
    first_nonfinite,
    is_file,
    loads_json,
    read_regular,
)
from .cluster import ClusterSpec
from .hf import model_from_hf_config
from .model import ModelSpec
from .plan import Plan
from .training import PRECISIONS, STACKS, TrainingSpec
from .validated import build, format_validation_error, unprintable

__all__ = [
    "SpecKind", "build", "cluster_presets", "document_kind", "format_validation_error", "is_hf_config",
    "foreign_calibration", "list_presets", "load_cluster", "load_model", "load_plan",
    "load_training", "parse_text", "read_calibration", "read_document", "read_text", "ref_kind",
]
SpecKind = Literal["plan", "cluster", "training", "model"]
_PRESETS = resources.files("moeplan.specs") / "presets"


def _preset_names(kind: str) -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in (_PRESETS / kind).iterdir()
                  if p.name.endswith(".yaml"))


def list_presets() -> dict[str, list[str]]:
    """Preset names by kind: {"models": [...], "clusters": [...]}."""
    return {"models": _preset_names("models"), "clusters": _preset_names("clusters")}


def cluster_presets() -> list[ClusterSpec]:
    """Every cluster preset, by GPU memory then name: the one list of the GPUs moeplan knows,
    so that advice such as "a larger-memory GPU" names each preset, new ones included."""
    return sorted((load_cluster(name) for name in _preset_names("clusters")),
                  key=lambda c: (c.hbm_gb, c.name))


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing documents whose alias expansion is too large.

    Why: aliases let a few hundred bytes stand for billions of values (`a: &a [x, x]`,
    `b: [*a, *a]`, ...). Composing keeps one node per anchor, so the expanded size is counted on
    the node graph (each node once, memoised) before anything is constructed.
    """

    def compose_document(self):  # type: ignore[no-untyped-def]
        node = super().compose_document()
        _check_expansion(node)
        return node

    # Nesting is refused while scanning: PyYAML's scanner is quadratic in the flow depth, so
    # `[[[[…` 100k deep would take seconds before the composer's recursion gave up.
    def fetch_flow_collection_start(self, TokenClass):  # type: ignore[no-untyped-def]  # noqa: N803
        super().fetch_flow_collection_start(TokenClass)
        if self.flow_level > limits.MAX_NESTING:
            raise _too_deep()

    def add_indent(self, column):  # type: ignore[no-untyped-def]
        if len(self.indents) >= limits.MAX_NESTING:
            raise _too_deep()
        return super().add_indent(column)

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        """Refuse a key written twice in one mapping (PyYAML keeps the last silently). Keys
        brought in by a merge (`<<: *base`) are not written twice: an explicit key overrides
        them, as YAML intends."""
        if isinstance(node, yaml.MappingNode):
            seen: set[object] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base constructor refuses it
                    continue
                if dup:
                    raise SpecError(f"key `{limits.excerpt(key)}` is written twice in one "
                                    f"mapping (line {key_node.start_mark.line + 1}); give each "
                                    "field once.")
        return super().construct_mapping(node, deep=deep)


def _too_deep() -> SpecError:
    return SpecError(f"the document nests deeper than {limits.MAX_NESTING} levels; spec files "
                     "are flat mappings of fields.")


def _check_expansion(root: yaml.Node) -> None:
    """Raise SpecError when the document under `root` expands past the limits."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        kids = _children(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            if size[key] > limits.MAX_DOCUMENT_NODES:
                raise SpecError(f"the document expands to more than "
                                f"{limits.MAX_DOCUMENT_NODES:,} values (YAML aliases repeat "
                                "content); write the values out or use fewer aliases.")
            if depth[key] > limits.MAX_NESTING:
                raise SpecError(f"the document nests deeper than {limits.MAX_NESTING} levels; "
                                "spec files are flat mappings of fields.")
            continue
        if key in size:
            continue
        if key in on_path:
            raise SpecError("the document refers to itself through a YAML alias; spec files "
                            "cannot be recursive.")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def parse_text(text: str, source: str, as_json: bool) -> Any:
    """Parse YAML or JSON text within the document limits; a key written twice in one mapping
    is refused; NaN and infinities (YAML `.nan`, non-standard JSON `NaN`, `1e999`) are parsed,
    then refused naming the field they sit in."""
    kind = "JSON" if as_json else "YAML"
    try:
        data = (loads_json(text, allow_nonfinite=True) if as_json
                else yaml.load(text, Loader=_BoundedLoader))  # noqa: S506 (a SafeLoader)
    except (RecursionError, TooDeep):
        raise SpecError(f"{source} nests deeper than {limits.MAX_NESTING} levels; spec files "
                        "are flat mappings of fields.") from None
    except (ValueError, yaml.YAMLError) as err:  # JSONDecodeError is a ValueError
        if "integer string conversion" in str(err):  # Python's 4,300-digit guard
            raise SpecError(f"{source} holds a whole number of thousands of digits; no field "
                            "takes one. Fix the number.") from None
        raise SpecError(f"{source} is not valid {kind}: {_syntax_error(err)}. "
                        "Fix the syntax.") from None
    except SpecError as err:
        raise SpecError(f"{source}: {err}") from None
    if as_json:  # JSON has no aliases; bound its size and depth the same way as YAML's
        _check_json_shape(data, source)
    bad = first_nonfinite(data)
    if bad is not None:
        raise SpecError(f"{source}: field `{bad}` is not a finite number (NaN or infinity); "
                        "give a finite value.")
    return data


def _syntax_error(err: Exception) -> str:
    """What is wrong and where, as the JSON parser says it: PyYAML's first line is its context
    ("while scanning for the next token"), which names neither the problem nor the line; the
    problem and its 1-based line and column are in the error's fields."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    if isinstance(err, yaml.MarkedYAMLError) and (problem or mark):
        text = limits.clip(problem or err.context or "a syntax error", 160)
        context = getattr(err, "context", None)
        if problem and context:
            text += f" ({limits.clip(context, 80)})"
        return text + (f": line {mark.line + 1} column {mark.column + 1}" if mark else "")
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return limits.clip(first, 160)


def _check_json_shape(data: Any, source: str) -> None:
    count, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        count += 1
        if count > limits.MAX_DOCUMENT_NODES:
            raise SpecError(f"{source} holds more than {limits.MAX_DOCUMENT_NODES:,} values; "
                            "spec files are small.")
        if level > limits.MAX_NESTING:
            raise SpecError(f"{source} nests deeper than {limits.MAX_NESTING} levels; spec "
                            "files are flat mappings of fields.")
        children = (value.values() if isinstance(value, dict)
                    else value if isinstance(value, list) else ())
        stack.extend((c, level + 1) for c in children)


def read_text(path: Path, what: str = "file") -> str:
    """A file's UTF-8 text, refused (SpecError) when missing, not a regular file (a named pipe,
    a device), too large or not UTF-8; at most the limit plus one byte is read."""
    try:
        raw = read_regular(path, limits.MAX_FILE_BYTES)
    except FileRefused as err:
        if err.kind == "size":
            raise SpecError(f"{what} {path} is larger than the limit of "
                            f"{limits.MAX_FILE_BYTES // 2**20} MiB; spec, plan and CSV files are "
                            "small text files. Check that this is the file you meant.") from None
        if err.kind == "unreadable":
            raise SpecError(f"cannot read {what} {path}: {err.reason}. Check the "
                            "path.") from None
        raise SpecError(f"{what} {path} {err.reason}; pass a YAML, JSON or CSV text "
                        "file.") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"{what} {path} is not UTF-8 text (byte {err.start} is "
                        f"{raw[err.start]:#04x}); pass a YAML, JSON or CSV text file.") from None


def read_document(path: Path) -> Any:
    """Parse a YAML or JSON file, with a clear error on unreadable, oversized or malformed
    content (size, alias expansion and nesting bounded; NaN and infinities refused)."""
    return parse_text(read_text(path), str(path), path.suffix == ".json")


def is_hf_config(data: Any) -> bool:
    """A Hugging Face config.json (load_model imports it as a ModelSpec)."""
    return isinstance(data, dict) and ("architectures" in data or "model_type" in data)


SHOWN_KEYS = frozenset({"name", "kind", "spec", "derived"})
"""The keys of the document `moeplan specs show --json` writes (SPEC §4)."""


def shown_spec(data: Any) -> tuple[Literal["model", "cluster"], dict[str, Any]] | None:
    """(kind, spec) of a document `moeplan specs show --json` wrote, `{"name", "kind":
    "model"|"cluster", "spec": {...}, "derived": {...}}`, so that what it shows reads back as the
    spec it shows; None for any other document (one with a key besides those, or without
    `kind` and `spec`, is not that document and is read as it is)."""
    if (isinstance(data, dict) and {"kind", "spec"} <= data.keys() <= SHOWN_KEYS
            and data["kind"] in ("model", "cluster") and isinstance(data["spec"], dict)):
        return data["kind"], data["spec"]
    return None


def document_kind(data: Any) -> SpecKind:
    """Which spec a parsed document describes, told by a field only that kind has: a Plan embeds
    model, cluster and layout; a ClusterSpec has `bf16_tflops`; a TrainingSpec
    `global_batch_size`; `specs show --json` says it (`shown_spec`). Anything else is read as
    a model (a ModelSpec or a Hugging Face config), so that a broken model file is reported by
    the model's own field errors."""
    shown = shown_spec(data)
    if shown is not None:
        return shown[0]
    if isinstance(data, dict):
        if {"model", "cluster", "layout"} <= data.keys():
            return "plan"
        if "bf16_tflops" in data:
            return "cluster"
        if "global_batch_size" in data:
            return "training"
    return "model"


def preset_name(ref: str, kind: str) -> str | None:
    """The preset `ref` names, matched without regard to case (`H100`, `mixtral-8x7B`), or
    None."""
    names = _preset_names(kind)
    if ref in names:
        return ref
    folded = {n.casefold(): n for n in names}
    return folded.get(ref.casefold())


def did_you_mean(ref: str, kind: str) -> list[str]:
    """Presets close to a name that matches none (a typo, a missing dash, a size off by one
    character), closest first."""
    if len(ref) > 64:  # no preset name is this long: nothing is close, and the compare stays cheap
        return []
    names = _preset_names(kind)
    folded = {n.casefold(): n for n in names}
    key = ref.casefold().strip()
    prefix = [n for n in folded if n.startswith(key)] if len(key) >= 2 else []
    close = prefix[:3] or difflib.get_close_matches(key, list(folded), n=3, cutoff=0.6)
    squeezed = {n.replace("-", "").replace("_", ""): n for n in folded}
    bare = key.replace("-", "").replace("_", "").replace(" ", "")
    if bare in squeezed and squeezed[bare] not in close:
        close.insert(0, squeezed[bare])
    return [folded[n] for n in close]


def ref_kind(ref: str | Path) -> SpecKind:
    """The kind of spec a preset name or file holds (`moeplan specs show` takes either).

    A preset name is its kind; a file is read and told by `document_kind`; anything else is
    taken for a model, whose loader then names the presets and the accepted files.
    """
    ref_s = str(ref)
    if is_file(Path(ref_s)) and preset_name(ref_s, "clusters") != ref_s and preset_name(
            ref_s, "models") != ref_s:
        return document_kind(read_document(Path(ref_s)))
    if preset_name(ref_s, "clusters") is not None:
        return "cluster"
    if preset_name(ref_s, "models") is None and did_you_mean(ref_s, "clusters") and not \
            did_you_mean(ref_s, "models"):
        return "cluster"  # so the cluster loader names the cluster presets it is close to
    return "model"


def _resolve(ref: str | Path, kind: str) -> tuple[Any, str]:
    """(parsed document, source description) for a preset name or a file path."""
    ref_s = str(ref)
    noun = "model" if kind == "models" else "cluster"
    if not ref_s.strip():  # Path("") is the current directory: not what the user meant
        raise SpecError(f"the {noun} name is empty; give a preset "
                        f"({', '.join(_preset_names(kind))}) or the path of a YAML/JSON {noun} "
                        "spec.")
    path = Path(ref_s)
    name = preset_name(ref_s, kind)
    if name is not None and (name == ref_s or not is_file(path)):  # a file wins over a case-
        text = (_PRESETS / kind / f"{name}.yaml").read_text()     # folded preset name
        return parse_text(text, f"preset '{name}'", False), f"preset '{name}'"
    if is_file(path):
        return _unwrapped(read_document(path), noun, str(path)), str(path)
    names = ", ".join(_preset_names(kind))
    problem = file_problem(path)
    if problem is not None and problem.startswith("is "):  # there, but not a spec file
        inside = path / "config.json"
        hint = (f" (a Hugging Face checkpoint directory: give its {inside})"
                if kind == "models" and is_file(inside) else "")
        raise SpecError(f"{noun} {limits.excerpt(ref_s)} {problem}{hint}; give a preset "
                        f"({names}) or the path of a YAML/JSON {noun} spec.")
    close = did_you_mean(ref_s, kind)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise SpecError(f"unknown {noun} {limits.excerpt(ref_s)}: it is neither a preset nor a "
                    f"file.{hint} Presets: {names}. Pass one of them or the path of a "
                    f"YAML/JSON {noun} spec"
                    + (" or a Hugging Face config.json." if kind == "models" else "."))


def _unwrapped(data: Any, noun: str, source: str) -> Any:
    """A file's document as the spec it holds: the `spec` of what `moeplan specs show --json`
    wrote (refused, naming the kind it holds, when that is not a `noun`), else the document."""
    shown = shown_spec(data)
    if shown is None:
        return data
    kind, spec = shown
    if kind != noun:
        raise SpecError(f"{source} holds a {kind} spec (as `moeplan specs show --json` "
                        f"writes it), not a {noun} spec; give it as the {kind} (--{kind} "
                        "FILE).")
    return spec


def load_model(ref: str | Path | ModelSpec) -> ModelSpec:
    """A ModelSpec from a preset name, a ModelSpec YAML/JSON, or a Hugging Face config.json."""
    if isinstance(ref, ModelSpec):
        return ref
    data, source = _resolve(ref, "models")
    if is_hf_config(data):
        return model_from_hf_config(data, source, name=Path(str(ref)).stem)
    if isinstance(data, dict) and "name" not in data:
        data = {"name": Path(str(ref)).stem, **data}
    return build(ModelSpec, data, "model spec", source)


def load_cluster(
    ref: str | Path | ClusterSpec, gpus: int | None = None, calibration: str | Path | None = None
) -> ClusterSpec:
    """A ClusterSpec from a preset name or file; `gpus` sets the count, `calibration` overlays
    the efficiency constants measured by `moeplan calibrate`."""
    if isinstance(ref, ClusterSpec):
        spec = ref
    else:
        data, source = _resolve(ref, "clusters")
        if isinstance(data, dict) and "name" not in data:
            data = {"name": Path(str(ref)).stem, **data}
        spec = build(ClusterSpec, data, "cluster spec", source)
    if gpus is not None:
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus <= 0:
            raise SpecError(f"--gpus must be a positive whole number, got {limits.excerpt(gpus)}.")
        limits.check("--gpus", gpus, limits.MAX_GPUS, "plan a smaller cluster")
        spec = spec.with_gpus(gpus)
    if calibration is not None:
        path = Path(str(calibration))
        constants, _ = read_calibration(path)
        doc = {**spec.model_dump(), "calibration": {**spec.calibration, **constants}}
        spec = build(ClusterSpec, doc, "calibration", f"--calibration {path}")
    return spec


def read_calibration(path: Path) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """(constants, (GPU, architecture) they were measured on) of a `--calibration` file: the
    `calibration` mapping of a ClusterSpec file such as `moeplan calibrate -o` writes, whose
    `gpu` and `architecture` say where it was measured, or a bare mapping of constants, which
    says nothing of it (None)."""
    cal = _unwrapped(read_document(path), "cluster", str(path)) if is_file(path) else None
    if not isinstance(cal, dict):
        raise SpecError(f"--calibration {limits.clip(str(path))}: not a readable "
                        "calibration file (a YAML/JSON mapping). Pass a file written by "
                        "`moeplan calibrate -o FILE`.")
    constants = cal.get("calibration", cal)
    if not isinstance(constants, dict):
        raise SpecError(f"--calibration {path}: `calibration` must be a mapping of "
                        f"constants, got {type(constants).__name__}. Pass a file written by "
                        "`moeplan calibrate -o FILE`.")
    gpu, arch = cal.get("gpu"), cal.get("architecture")
    measured_on = (gpu, arch) if "calibration" in cal and isinstance(gpu, str) and isinstance(
        arch, str) else None
    return constants, measured_on


def _shown(name: str) -> str:
    """A name from a file as a message prints it: as written when printable, else quoted."""
    return limits.clip(name) if unprintable(name) is None else limits.excerpt(name)


def _same_gpu(a: str, b: str) -> bool:
    """Whether two GPU names are one name, whatever their case, spaces and dashes."""
    def bare(name: str) -> str:
        return "".join(ch for ch in name.casefold() if ch.isalnum())

    return bare(a) == bare(b)


def foreign_calibration(cluster: ClusterSpec, calibration: str | Path | None) -> str | None:
    """The warning when a `--calibration` file was measured on another GPU than `cluster`'s
    (the cluster with the file overlaid, as `load_cluster` returns it): the file's GPU, the
    cluster's, and which of the file's constants the overlay applies and which it cannot (its
    entries for another GPU or architecture, which pricing this cluster never reads,
    `cost_models.calibration.unread_entries`). None when the file records no GPU, or the
    cluster's. A file of which nothing applies is refused (SpecError): it would price the
    cluster on the shipped profile while the command says it is calibrated."""
    from ..cost_models.calibration import KEYED_BY_GPU, unread_entries

    if calibration is None:
        return None
    path = Path(str(calibration))
    constants, measured_on = read_calibration(path)
    if measured_on is None or _same_gpu(measured_on[0], cluster.gpu):
        return None
    gpu, arch = measured_on
    unread = unread_entries(constants, cluster)
    applied = [name for key, value in constants.items()
               for name in ([f"{key}[{entry}]" for entry in value]
                            if key in KEYED_BY_GPU and isinstance(value, dict) else [key])
               if name not in unread]
    unread, applied = [_shown(n) for n in unread], [_shown(n) for n in applied]
    there = f"{_shown(gpu)} ({_shown(arch)})"
    here = f"{cluster.gpu} ({cluster.architecture})"
    if not applied:
        raise SpecError(f"--calibration {limits.clip(str(path))} was measured on {there}, and "
                        f"none of its constants applies to the cluster's {here}: each is an "
                        f"entry for another GPU or architecture ({', '.join(unread)}), so the "
                        "cluster would be priced on the shipped profile as if calibrated. Run "
                        "`moeplan calibrate -o FILE` on the cluster's GPU, or drop "
                        "--calibration.")
    kept = (f" Not applied (entries for another GPU or architecture; the cluster keeps the "
            f"shipped ones): {', '.join(unread)}." if unread else "")
    return (f"--calibration {limits.clip(str(path))} was measured on {there}, not on the "
            f"cluster's {here}. Applied anyway: {', '.join(applied)}.{kept} Run `moeplan "
            "calibrate` on the cluster's GPU for constants of its own.")


def load_training(ref: str | Path | TrainingSpec | None = None, **overrides: Any) -> TrainingSpec:
    """A TrainingSpec from a YAML/JSON file and/or command-line values (None values ignored)."""
    if isinstance(ref, TrainingSpec):
        base: dict[str, Any] = ref.model_dump()
        source = "training spec"
    elif ref is not None:
        base = read_document(Path(ref)) or {}
        source = str(ref)
    else:
        base, source = {}, "command line"
    base.update({k: v for k, v in overrides.items() if v is not None})
    if overrides.get("precision") is not None:
        base["precision"] = check_precision(overrides["precision"])
    return build(TrainingSpec, base, "training spec", source)


PRECISION_WORDS = {
    "bf16": "BF16 everywhere", "fp8-delayed": "FP8 with delayed (amax-history) scaling",
    "fp8-tensorwise": "FP8 with current per-tensor scaling",
    "fp8-blockwise": "FP8 with 128-wide block scaling, DeepSeek-V3's recipe",
    "mxfp8": "MXFP8, 32-wide block scaling, Blackwell", "nvfp4": "NVFP4, Blackwell",
}


def check_precision(value: str, allow_auto: bool = False, flag: str = "--precision") -> str:
    """The precision `value` names, whatever its case; refused, when moeplan does not know it,
    with the list of those it does, each in words, and the closest (`fp8` alone names no
    scaling recipe: the fp8-* ones first)."""
    v = str(value).casefold()
    if v in PRECISIONS or (allow_auto and v == "auto"):
        return v
    close = ([p for p in PRECISIONS if p.startswith(v)] or
             difflib.get_close_matches(v, list(PRECISIONS), n=3, cutoff=0.5)) if v and len(
        v) <= 64 else []
    listed = "; ".join(f"{p} ({w})" for p, w in PRECISION_WORDS.items() if p in PRECISIONS)
    if v == "auto":  # known, but here one plan is priced: there is nothing to pick among
        raise SpecError(f"{flag} auto picks the fastest recipe the GPU runs, and only search "
                        "and whatif pick (they price each); this command prices one plan, so "
                        f"give it one recipe: {listed}.")
    auto = ("; auto (the fastest recipe the GPU runs)" if allow_auto
            else "; auto (search and whatif only)")
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    raise SpecError(f"{flag} {limits.excerpt(value)} is not a precision moeplan knows.{hint} "
                    f"Give one of: {listed}{auto}.")


def check_stack(value: str, flag: str = "--stack") -> str:
    """The software stack `value` names (`training.STACKS`), whatever its case; refused, when
    moeplan does not know it, with each stack it does in words."""
    v = str(value).casefold()
    if v in STACKS:
        return v
    close = (difflib.get_close_matches(v, list(STACKS), n=2, cutoff=0.5)
             if v and len(v) <= 64 else [])
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    listed = "; ".join(f"{k} ({w})" for k, w in STACKS.items())
    raise SpecError(f"{flag} {limits.excerpt(value)} is not a software stack moeplan knows."
                    f"{hint} Give one of: {listed}.")


def load_plan(path: str | Path) -> Plan:
    """A Plan JSON written by `moeplan search -o` or `moeplan estimate -o`."""
    p = Path(path)
    if not is_file(p):
        raise SpecError(f"plan file {limits.clip(str(p))} {file_problem(p) or 'cannot be read'}. "
                        "Write one with `moeplan search -o plan.json` or `moeplan estimate ... "
                        "-o plan.json`.")
    return build(Plan, read_document(p), "plan", str(p))
