"""Megatron's `--pipeline-model-parallel-layout` syntax: parse, format, and balance.

A layout lists the virtual pipeline stages in *virtual-stage order* (stage index v·pp + r is pp
rank r's v-th model chunk), separated by `|`; inside a stage, `E` is the embedding, `t` a decoder
layer, `m` an MTP layer, `L` the loss (final norm, output layer, cross-entropy). `x*n` repeats a
character, `(...)*n` a group, commas are cosmetic. Example: `Et*3|(tt|)*29,m|L` is
[E,t,t,t] + [t,t]×29 + [m] + [L]  (Megatron Core
`pipeline_parallel_layer_layout.py::parse_str_to_list`).

The cost models and the runtime both read a layout as `list[list[str]]` (one list of the
characters above per virtual stage), so a plan means the same split everywhere.
"""

from __future__ import annotations

import re
from itertools import groupby

from ..errors import SpecError
from ..limits import MAX_LAYERS, MAX_LAYOUT_CHARS, excerpt

LAYER_CHARS = frozenset("EtmL")
_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")

Stages = list[list[str]]


def parse_stage_layout(text: str, pp: int | None = None, num_layers: int | None = None,
                       mtp_layers: int | None = None) -> Stages:
    """Parse the layout string into one list of layer characters per virtual stage.

    Checks what Megatron checks: known characters, the stage count divisible by pp, exactly one
    E first and one L last, and (when given) the decoder and MTP layer counts.
    """
    shown = excerpt(text)
    too_long = SpecError(f"--stage-layout {shown}: it unrolls to more than {MAX_LAYOUT_CHARS:,} "
                         f"characters, more than any model of at most {MAX_LAYERS:,} layers "
                         "has; give one entry per layer of the model.")

    def unroll(part: str, count: str) -> str:
        # the product is checked before the string is built
        if len(count) > 9 or len(part) * int(count) > MAX_LAYOUT_CHARS:
            raise too_long
        return part * int(count)

    s = text.replace(",", "").replace(" ", "")
    if len(s) > MAX_LAYOUT_CHARS:
        raise too_long
    prev = None
    while prev != s:  # innermost groups first, so nested groups unroll too
        prev, s = s, _GROUP.sub(lambda g: unroll(g.group(1), g.group(2)), s)
        if len(s) > MAX_LAYOUT_CHARS:
            raise too_long
    s = _REPEAT.sub(lambda g: unroll(g.group(1), g.group(2)), s)
    if len(s) > MAX_LAYOUT_CHARS:
        raise too_long
    bad = set(s) - LAYER_CHARS - {"|"}
    if bad:
        raise SpecError(f"--stage-layout {shown}: unknown character(s) {sorted(bad)}; use E "
                        "(embedding), t (decoder layer), m (MTP layer), L (loss), | between "
                        "stages, x*n and (...)*n for repeats.")
    stages = [list(part) for part in s.split("|")]
    flat = [c for st in stages for c in st]
    problems = []
    if pp is not None and len(stages) % pp:
        problems.append(f"{len(stages)} stages are not a multiple of pp={pp}")
    if flat.count("E") != 1 or not flat or flat[0] != "E":
        problems.append("the embedding E must appear exactly once, first")
    if flat.count("L") != 1 or not flat or flat[-1] != "L":
        problems.append("the loss L must appear exactly once, last")
    if num_layers is not None and flat.count("t") != num_layers:
        problems.append(f"it has {flat.count('t')} decoder layers t, the model {num_layers}")
    if mtp_layers is not None and flat.count("m") != mtp_layers:
        problems.append(f"it has {flat.count('m')} MTP layers m, the model {mtp_layers}")
    if problems:
        raise SpecError(f"--stage-layout {shown}: " + "; ".join(problems) + ".")
    return stages


def format_stage_layout(stages: Stages) -> str:
    """The shortest plain form Megatron accepts: runs as `t*n`, repeated stages as `(..|)*n`."""

    def one(stage: list[str]) -> str:
        return "".join(k * n if n <= 2 else f"{k}*{n}" for k, n in _runs(stage))

    text = [f"({part}|)*{n}," if n >= 3 else (part + "|") * n
            for part, n in _runs([one(st) for st in stages])]
    return "".join(text).rstrip("|,")


def _runs(items: list[str]) -> list[tuple[str, int]]:
    """Consecutive equal items as (item, count)."""
    return [(k, len(list(g))) for k, g in groupby(items)]


def balanced_stage_layout(num_layers: int, num_stages: int, mtp_layers: int = 0) -> Stages:
    """Split E, the decoder layers, the MTP layers and L over the virtual stages as evenly as
    possible, counting E, L and each MTP layer as one layer (Megatron's recipes for uneven
    models, e.g. DeepSeek-V3's 61 layers + E + m + L = 64 units over PP8×VPP4 = 2 per stage).

    Units are dealt in model order; stage i gets units [⌊i·U/n⌋, ⌊(i+1)·U/n⌋) so sizes differ by
    at most one, and the extra units go to the middle/late stages rather than the first (which
    already holds the most in-flight micro-batches).
    """
    units = ["E"] + ["t"] * num_layers + ["m"] * mtp_layers + ["L"]
    u, n = len(units), num_stages
    if n > u:
        raise SpecError(f"{n} virtual stages exceed the {u} layers (decoder + embedding + loss "
                        "+ MTP); lower pp or vpp.")
    bounds = [(i * u) // n for i in range(n + 1)]
    return [units[bounds[i]:bounds[i + 1]] for i in range(n)]


def stage_layers_to_layout(stage_layers: list[int], mtp_layers: int = 0) -> Stages:
    """A layout from decoder layers per virtual stage: E joins the first stage, MTP and L the last."""
    stages = [["t"] * k for k in stage_layers]
    stages[0].insert(0, "E")
    stages[-1].extend(["m"] * mtp_layers + ["L"])
    return stages


def stage_layout_for(num_layers: int, pp: int, vpp: int, mtp_layers: int = 0,
                     text: str | None = None) -> Stages:
    """The layout a plan runs: an explicit string, else an even split when the decoder layers
    divide evenly (Megatron's default, E/L/MTP riding on the end stages), else the balanced
    uneven layout."""
    n = pp * vpp
    if text:
        stages = parse_stage_layout(text, pp, num_layers, mtp_layers)
        if len(stages) != n:
            raise SpecError(f"--stage-layout has {len(stages)} stages but pp·vpp = {n}; give "
                            "one stage per virtual pipeline stage.")
        return stages
    if num_layers % n == 0:
        return stage_layers_to_layout([num_layers // n] * n, mtp_layers)
    return balanced_stage_layout(num_layers, n, mtp_layers)


def plan_stages(model, layout, choices=None) -> Stages:  # noqa: ANN001 (specs import this module)
    """The virtual stages a plan runs (`Plan.stages`): its explicit layout, or the default."""
    return stage_layout_for(model.num_layers, layout.pp, layout.vpp, model.mtp_layers,
                            choices.stage_layout if choices is not None else None)


def layers_layout_text(stage_layers: list[int], mtp_layers: int = 0) -> str:
    """Decoder layers per virtual stage as a layout string (E on the first stage, MTP and L on
    the last): how a planned stage split is written into a plan."""
    return format_stage_layout(stage_layers_to_layout(list(stage_layers), mtp_layers))
