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
        elif e["type"] == "less_than_equal":
            parts.append(f"field `{loc}`: {limits.excerpt(e.get('input'))} is above the limit "
                         f"of {e.get('ctx', {}).get('le')} (moeplan bounds every size; see "
                         "the README's Limits)")
        elif not loc and ": " in msg:  # a cross-field rule names its field first
            field, _, rest = msg.partition(": ")
            parts.append(f"field `{field}`: {rest}")
        else:
            got = e.get("input")
            shown = (f" (got {limits.excerpt(got)})" if got is not None
                     and not isinstance(got, dict) else "")
            parts.append(f"field `{loc}`: {msg}{shown}" if loc else msg)
    fix = ("" if source == "command line" or source.startswith("preset")
           else " (`moeplan specs validate FILE` checks a file)")
    return (f"invalid {what} in {source}: " + "; ".join(parts)
            + f". Fix the {what} and try again{fix}.")


def build(cls: type[T], data: Any, what: str, source: str) -> T:
    """Validate `data` into `cls`, turning pydantic's errors into one SpecError paragraph."""
    if not isinstance(data, dict):
        raise SpecError(f"invalid {what} in {source}: expected a mapping of fields, got "
                        f"{type(data).__name__}. Write the {what} as YAML or JSON key: value pairs.")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, what, source)) from None
