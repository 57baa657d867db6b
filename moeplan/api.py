"""Public entry points shared by the Python API and the CLI: one layout in, one Estimate out.

`estimate` accepts specs or names (preset, file), a Plan, or a Plan file, so a notebook and the
`moeplan estimate` command take the same path; `describe_spec` and `validate_spec_file` are the
documents `moeplan specs show` and `moeplan specs validate` print.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .errors import SpecError
from .fsio import is_file
from .limits import check_imbalance, clip, excerpt
from .specs import (
    Choices,
    ClusterSpec,
    Estimate,
    Layout,
    ModelSpec,
    Plan,
    TrainingSpec,
    load_cluster,
    load_model,
    load_plan,
    load_training,
)
from .specs.loader import (
    build,
    check_stack,
    document_kind,
    format_validation_error,
    parse_text,
    read_document,
    read_text,
    ref_kind,
)
from .specs.rules import check_target, shards_optimizer


def describe_spec(ref: str | Path, seq: int = 4096) -> dict[str, Any]:
    """{"name", "kind", "spec", "derived"} for a model or cluster preset or file (SPEC §4):
    a model's derived parameter counts and FLOPs per token at `seq`; a cluster has none."""
    if ref_kind(ref) == "cluster":
        c = load_cluster(ref)
        return {"name": c.name, "kind": "cluster", "spec": c.model_dump(mode="json"),
                "derived": {}}
    m = load_model(ref)
    return {"name": m.name, "kind": "model", "spec": m.model_dump(mode="json"),
            "derived": {"total_params": m.total_params(), "active_params": m.active_params(),
                        "flops_per_token": m.flops_per_token(seq)}}


def validate_spec_file(path: str | Path) -> dict[str, Any]:
    """{"valid": True, "kind", "name", "path"} for a valid ModelSpec, ClusterSpec, TrainingSpec
    or Plan file (kind told by `specs.loader.document_kind`); SpecError naming the field else."""
    if not str(path).strip():  # Path("") is the current directory
        raise SpecError("the path is empty; pass the path of a YAML/JSON spec.")
    p = Path(path)
    data = read_document(p) if is_file(p) else None
    if data is None:
        raise SpecError(f"{clip(str(path))} is not a readable file. Pass the path of a "
                        "YAML/JSON spec.")
    kind = document_kind(data)
    if kind == "plan":
        name = load_plan(p).model.name
    elif kind == "cluster":
        name = load_cluster(p).name
    elif kind == "training":
        load_training(p)
        name = p.stem
    else:
        name = load_model(p).name
    return {"valid": True, "kind": kind, "name": name, "path": str(p)}


def with_calibration(plan: Plan, calibration: str | Path | None) -> Plan:
    """`plan` with the efficiency constants of a `moeplan calibrate -o` file overlaid on its
    cluster (`--calibration`); the plan itself when none is given."""
    if calibration is None:
        return plan
    return plan.model_copy(update={"cluster": load_cluster(plan.cluster, None, calibration)})


def load_routing_histogram(path: str | Path) -> dict[str, Any]:
    """Read `{"layers": [{"layer": i, "tokens_per_expert": [...]}, ...]}` (as `moeplan run`
    writes routing.json), with a clear error when the shape is wrong."""
    p = Path(path)
    if not is_file(p):
        raise SpecError(f"--routing-histogram {excerpt(str(path))}: not a readable file. Pass "
                        "the routing.json `moeplan run` writes.")
    data = parse_text(read_text(p, "routing histogram"), f"--routing-histogram {p}", True)
    layers = data.get("layers") if isinstance(data, dict) else None
    ok = isinstance(layers, list) and all(
        isinstance(e, dict) and isinstance(e.get("layer"), int)
        and isinstance(e.get("tokens_per_expert"), list)
        and all(isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0
                for n in e["tokens_per_expert"]) for e in layers)
    if not ok:
        raise SpecError(f"--routing-histogram {path}: expected {{\"layers\": [{{\"layer\": i, "
                        "\"tokens_per_expert\": [...]}, ...]} (the routing.json `moeplan run` "
                        "writes).")
    return data


def plan_from_options(
    model: str | ModelSpec,
    cluster: str | ClusterSpec,
    gpus: int | None,
    seq: int | None,
    gbs: int | None,
    precision: str | None = None,
    axes: dict[str, Any] | None = None,
    recompute: list[str] | None = None,
    offload: list[str] | None = None,
    stage_layout: str | None = None,
    calibration: str | Path | None = None,
    optimizer_offload_fraction: float = 0.0,
    grad_reduce_dtype: str = "fp32",
    target: str = "megatron",
    software_stack: str = "current",
    moe_capacity_factor: float | None = None,
    moe_pad_expert_input_to_capacity: bool = False,
) -> Plan:
    """A Plan (no estimate yet) from command-line style values; dp and micro-batches derived."""
    missing = [f for f, v in (("--gbs", gbs),) if v is None]
    c = load_cluster(cluster, gpus, calibration)
    if c.num_gpus is None:
        missing.append("--gpus")
    if missing:
        raise SpecError(f"moeplan estimate needs {', '.join(missing)} (or a PLAN.json).")
    m = load_model(model)
    t = load_training(seq_len=seq, global_batch_size=gbs, precision=precision,
                      grad_reduce_dtype=grad_reduce_dtype,
                      software_stack=check_stack(software_stack),
                      moe_capacity_factor=moe_capacity_factor,
                      moe_pad_expert_input_to_capacity=moe_pad_expert_input_to_capacity)
    axes = dict(axes or {})
    check_flex_backend(axes, m)
    if not shards_optimizer(t.software_stack, target):
        axes.setdefault("distributed_optimizer", False)
    try:
        layout = Layout.build(c.num_gpus, t.global_batch_size, **axes)
    except ValidationError as err:
        raise SpecError(format_validation_error(err, "layout", "command line")) from None
    choices = build(Choices, {"recompute": recompute or [], "offload": offload or [],
                              "stage_layout": stage_layout,
                              "optimizer_offload_fraction": optimizer_offload_fraction},
                    "choices", "command line")
    check_target(target)
    return Plan(model=m, cluster=c, training=t, layout=layout, choices=choices, target=target)


def check_flex_backend(axes: dict[str, Any], model: ModelSpec) -> None:
    """A flex backend named without the flex dispatcher would be ignored: refused, naming
    the flag, as the rules refuse what a dense model would ignore (a dense model takes no
    dispatcher at all, so the fix there is only to drop the flag)."""
    dispatcher = axes.get("dispatcher") or "alltoall"
    if "flex_backend" in axes and not model.is_moe:
        raise SpecError(f"--flex-backend {axes['flex_backend']}: {model.name} is a dense model, "
                        "with no experts for a token dispatcher to send tokens to; drop "
                        "--flex-backend.")
    if "flex_backend" in axes and dispatcher != "flex":
        raise SpecError(f"--flex-backend {axes['flex_backend']}: the flex backend is the "
                        "library the flex dispatcher runs, and the layout's dispatcher is "
                        f"{dispatcher}, which would ignore it; add --dispatcher flex, or drop "
                        "--flex-backend.")


def estimate(
    model: str | ModelSpec | Plan | Path,
    cluster: str | ClusterSpec | None = None,
    training: TrainingSpec | None = None,
    layout: Layout | None = None,
    choices: Choices | None = None,
    *,
    imbalance: float = 1.0,
    routing_histogram: dict[str, Any] | str | Path | None = None,
    calibration: dict[str, Any] | None = None,
    target: str | None = None,
) -> Estimate:
    """Predict step time, throughput and memory of one layout.

    `model` may be a Plan or a plan file (then the other specs come from it), or a ModelSpec /
    preset name with `cluster`, `training` and `layout`. Raises LayoutError naming each rule of
    the target executor it breaks (`target`, else the plan's, else megatron); a valid layout
    that does not fit returns `fits=False`.
    """
    from .cost_models import estimate as _estimate

    if isinstance(model, (str, Path)) and str(model).endswith(".json") and is_file(model):
        data = read_document(Path(model))
        if isinstance(data, dict) and {"model", "cluster", "layout"} <= data.keys():
            model = load_plan(model)
    if isinstance(model, Plan):
        plan = model
        m, c, t, lay, ch = plan.model, plan.cluster, plan.training, plan.layout, plan.choices
        target = target or plan.target
    else:
        if cluster is None or training is None or layout is None:
            raise SpecError("estimate needs a Plan, or a model with cluster, training and layout.")
        m, c, t, lay, ch = load_model(model), load_cluster(cluster), training, layout, choices
        if c.num_gpus is None:
            c = c.with_gpus(lay.world_size)
    check_imbalance(imbalance)
    hist = (load_routing_histogram(routing_histogram)
            if isinstance(routing_histogram, (str, Path)) else routing_histogram)
    return _estimate(m, c, t, lay, ch, imbalance=imbalance, routing_histogram=hist,
                     calibration=calibration, target=target or "megatron")
