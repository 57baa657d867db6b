"""Resolve user input (preset name, YAML/JSON spec file, Hugging Face config) into specs.

Every failure becomes a SpecError whose message is one paragraph naming the field and the fix,
so the CLI can print it without a traceback.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import SpecError
from .cluster import ClusterSpec
from .model import ModelSpec
from .plan import Plan
from .training import TrainingSpec

T = TypeVar("T", bound=BaseModel)
_PRESETS = resources.files("moeplan.specs") / "presets"


def _preset_names(kind: str) -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in (_PRESETS / kind).iterdir()
                  if p.name.endswith(".yaml"))


def list_presets() -> dict[str, list[str]]:
    """Preset names by kind: {"models": [...], "clusters": [...]}."""
    return {"models": _preset_names("models"), "clusters": _preset_names("clusters")}


def format_validation_error(err: ValidationError, what: str, source: str) -> str:
    """One paragraph from pydantic's errors: each offending field, what is wrong, what was given."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            parts.append(f"field `{loc}` is required but missing")
        elif e["type"] == "extra_forbidden":
            parts.append(f"field `{loc}` is not a {what} field (check its spelling)")
        elif not loc and ": " in msg:  # a cross-field rule names its field first
            field, _, rest = msg.partition(": ")
            parts.append(f"field `{field}`: {rest}")
        else:
            got = e.get("input")
            shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
            parts.append(f"field `{loc}`: {msg}{shown}" if loc else msg)
    return (f"invalid {what} in {source}: " + "; ".join(parts)
            + f". Fix the {what} and try again (`moeplan specs validate FILE` checks a file).")


def build(cls: type[T], data: Any, what: str, source: str) -> T:
    """Validate `data` into `cls`, turning pydantic's errors into one SpecError paragraph."""
    if not isinstance(data, dict):
        raise SpecError(f"invalid {what} in {source}: expected a mapping of fields, got "
                        f"{type(data).__name__}. Write the {what} as YAML or JSON key: value pairs.")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, what, source)) from None


def read_document(path: Path) -> Any:
    """Parse a YAML or JSON file, with a clear error on unreadable or malformed content."""
    try:
        text = path.read_text()
    except OSError as err:
        raise SpecError(f"cannot read {path}: {err.strerror}. Check the path.") from None
    try:
        if path.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise SpecError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                        f"{str(err).splitlines()[0]}. Fix the syntax.") from None


def is_hf_config(data: Any) -> bool:
    return isinstance(data, dict) and ("architectures" in data or "model_type" in data)


def _resolve(ref: str | Path, kind: str) -> tuple[Any, str]:
    """(parsed document, source description) for a preset name or a file path."""
    ref_s = str(ref)
    if ref_s in _preset_names(kind):
        text = (_PRESETS / kind / f"{ref_s}.yaml").read_text()
        return yaml.safe_load(text), f"preset '{ref_s}'"
    path = Path(ref_s)
    if path.is_file():
        return read_document(path), str(path)
    names = ", ".join(_preset_names(kind))
    noun = "model" if kind == "models" else "cluster"
    raise SpecError(f"unknown {noun} '{ref_s}': it is neither a preset nor a file. Presets: "
                    f"{names}. Pass one of them or the path of a YAML/JSON {noun} spec"
                    + (" or a Hugging Face config.json." if kind == "models" else "."))


def load_model(ref: str | Path | ModelSpec) -> ModelSpec:
    """A ModelSpec from a preset name, a ModelSpec YAML/JSON, or a Hugging Face config.json."""
    if isinstance(ref, ModelSpec):
        return ref
    data, source = _resolve(ref, "models")
    if is_hf_config(data):
        from .hf import model_from_hf_config

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
            raise SpecError(f"--gpus must be a positive whole number, got {gpus!r}.")
        spec = spec.with_gpus(gpus)
    if calibration is not None:
        cal = read_document(Path(calibration)) if Path(str(calibration)).is_file() else None
        if not isinstance(cal, dict):
            raise SpecError(f"--calibration {calibration}: not a readable calibration file. "
                            "Pass a file written by `moeplan calibrate -o FILE`.")
        constants = cal.get("calibration", cal)
        spec = spec.model_copy(update={"calibration": {**spec.calibration, **constants}})
    return spec


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
    return build(TrainingSpec, base, "training spec", source)


def load_plan(path: str | Path) -> Plan:
    """A Plan JSON written by `moeplan search -o` or `moeplan estimate -o`."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"plan file {p} does not exist. Write one with `moeplan search -o "
                        "plan.json` or `moeplan estimate ... -o plan.json`.")
    return build(Plan, read_document(p), "plan", str(p))
