"""Validate a parsed document into a spec class, with pydantic's errors as one paragraph.

Its own module so that the loader (which resolves presets and files) and the Hugging Face
importer (which builds a ModelSpec from a config) can both use it without importing each other.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from .. import limits
from ..errors import SpecError

T = TypeVar("T", bound=BaseModel)

UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
"""Unicode categories a name may not hold: control characters (ESC starts a terminal escape,
a newline breaks a table), format characters (U+202E reverses the text after it), surrogates,
private-use and unassigned code points, line and paragraph separators."""


def unprintable(text: str) -> str | None:
    """The first character of `text` a terminal or a table would not show as itself, as
    U+XXXX at its position, or None."""
    import unicodedata

    for i, ch in enumerate(text):
        if unicodedata.category(ch) in UNPRINTABLE:
            return f"U+{ord(ch):04X} at position {i}"
    return None


def printable_name(value: str) -> str:
    """A name printed in tables and reports: refused when it holds an unprintable character
    (`UNPRINTABLE`), so no spec file can move the cursor, recolour or reorder a terminal."""
    bad = unprintable(value)
    if bad is not None:
        raise ValueError(f"holds a control or formatting character ({bad}); a name is "
                         "printable text")
    return value


FLAG_OF_FIELD = {"seq_len": "--seq", "global_batch_size": "--gbs", "num_gpus": "--gpus",
                 "grad_reduce_dtype": "--grad-reduce", "software_stack": "--stack",
                 "moe_capacity_factor": "--capacity-factor",
                 "moe_pad_expert_input_to_capacity": "--pad-to-capacity"}
"""A field whose command-line flag is not its own name with hyphens."""


def _where(e: Any, source: str) -> str:
    """Where an error sits: in a file, the field's dotted path (`recompute.0.0`); on the
    command line, the flag that set it (`--recompute`), never an index the user never typed."""
    loc = ".".join(str(x) for x in e["loc"])
    if source != "command line" or not e["loc"]:
        return loc
    head = str(e["loc"][0])
    return FLAG_OF_FIELD.get(head, "--" + head.replace("_", "-"))


def format_validation_error(err: ValidationError, what: str, source: str,
                            file_hint: bool = True) -> str:
    """One paragraph from pydantic's errors: each offending field, what is wrong, what was given."""
    parts = []
    for e in err.errors():
        loc = _where(e, source)
        name = f"`{loc}`" if loc.startswith("--") else f"field `{loc}`"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            parts.append(f"{name} is required but missing")
        elif e["type"] == "extra_forbidden":
            parts.append(f"{name} is not a {what} field (check its spelling)")
        elif e["type"] == "less_than_equal":
            parts.append(f"{name}: {limits.excerpt(e.get('input'))} is above the limit "
                         f"of {e.get('ctx', {}).get('le')} (moeplan bounds every size; see "
                         "the README's Limits)")
        elif not loc and ": " in msg:  # a cross-field rule names its field first
            field, _, rest = msg.partition(": ")
            parts.append(f"field `{field}`: {rest}")
        else:
            got = e.get("input")
            shown = (f" (got {limits.excerpt(got)})" if got is not None
                     and not isinstance(got, dict) else "")
            parts.append(f"{name}: {msg}{shown}" if loc else msg)
    fix = ("" if not file_hint or source == "command line" or source.startswith("preset")
           else " (`moeplan specs validate FILE` checks a file)")
    where = "on the command line" if source == "command line" else f"in {source}"
    return (f"invalid {what} {where}: " + "; ".join(parts)
            + f". Fix the {what} and try again{fix}.")


def _takes_bool(annotation: Any) -> bool:
    """Whether a field's type admits a bool as itself (bool, Any, or a union holding one)."""
    import typing

    if annotation is bool or annotation is Any:
        return True
    return any(_takes_bool(a) for a in typing.get_args(annotation))


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model class a field holds (itself or inside an Optional), else None."""
    import typing

    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def stray_bool(cls: type[BaseModel], data: Any, at: str = "") -> str | None:
    """The dotted path of the first true/false given to a field that is not a flag (pydantic's
    lax mode reads `num_layers: true` as 1, `hbm_gb: true` as 1.0), in `data` and the models
    nested in it; None when there is none."""
    if not isinstance(data, dict):
        return None
    for key, value in data.items():
        field = cls.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue  # an unknown field: pydantic names it
        where = f"{at}.{key}" if at else key
        if isinstance(value, bool) and not _takes_bool(field.annotation):
            return where
        inner = _nested_model(field.annotation)
        if inner is not None:
            found = stray_bool(inner, value, where)
            if found:
                return found
    return None


def build(cls: type[T], data: Any, what: str, source: str) -> T:
    """Validate `data` into `cls`, turning pydantic's errors into one SpecError paragraph."""
    if not isinstance(data, dict):
        kind = {type(None): "nothing (null, or an empty file)", list: "a list", str: "a string",
                bool: "true/false", int: "a number", float: "a number"}.get(type(data),
                                                                           "another kind of value")
        raise SpecError(f"invalid {what} in {source}: expected a mapping of fields, got "
                        f"{kind}. Write the {what} as YAML or JSON key: value pairs.")
    bad = stray_bool(cls, data)
    if bad is not None:
        raise SpecError(f"invalid {what} in {source}: field `{bad}` is true/false where a "
                        f"number or a name belongs. Fix the {what} and try again.")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, what, source)) from None
