"""moeplan: plan, predict and run Mixture-of-Experts training.

The public Python API; the `moeplan` command is a thin layer over these functions, so notebooks
and scripts behave exactly like the CLI. Importing moeplan never imports torch.
"""

from .api import estimate
from .errors import InfeasibleError, LayoutError, MoeplanError, NotYetAvailable, SpecError
from .specs import (
    Choices,
    ClusterSpec,
    Estimate,
    Layout,
    ModelSpec,
    Plan,
    TrainingSpec,
    list_presets,
    load_cluster,
    load_model,
    load_plan,
    load_training,
)

__version__ = "0.1.0"

__all__ = [
    "Choices", "ClusterSpec", "Estimate", "InfeasibleError", "Layout", "LayoutError",
    "ModelSpec", "MoeplanError", "NotYetAvailable", "Plan", "SpecError", "TrainingSpec",
    "estimate", "list_presets", "load_cluster", "load_model", "load_plan", "load_training",
]
__all__ += ["export"]


def export(
    plan: Plan | str,
    format: str = "megatron",  # noqa: A002 (the CLI option's name)
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    train_iters: int | None = None,
    train_tokens: float | None = None,
    cadence: object = None,
) -> dict:
    """Export a Plan (or plan file) as a Megatron-LM launch, a torchrun line or a Slurm script.

    Returns the `moeplan export --json` document. Imported lazily so that `import moeplan`
    stays light; see `moeplan.planner.export` for the flag mapping (and `train_iters` /
    `train_tokens`, which scale the Megatron schedule, and `cadence`, its log, eval and save
    intervals).
    """
    from .planner.export import Cadence
    from .planner.export import export as _export

    return _export(plan, format, nnodes=nnodes, nproc_per_node=nproc_per_node,
                   train_iters=train_iters, train_tokens=train_tokens,
                   cadence=cadence if isinstance(cadence, Cadence) else Cadence())


__all__ += ["groups", "run"]


def run(plan: Plan | str, **options: object) -> dict:
    """Train under a plan with torchrun workers; returns the run summary (SPEC "Run outputs").

    Options are those of `moeplan run` (steps, data, seed, dtype, out, scale_down,
    nproc_per_node, nnodes, ...). Raises NotYetAvailable naming any plan feature the runtime
    does not execute yet, before any worker starts. Imported lazily: torch loads only here.
    """
    from .runtime.launch import run as _run

    return _run(plan, **options)


def groups(
    plan: Plan | str | None = None,
    *,
    gpus: int | None = None,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    order: str = "tp-cp-ep-dp-pp",
) -> dict[str, list[list[int]]]:
    """Process-group membership of a layout, identical to Megatron Core's (no torch needed).

    Returns {"tp", "cp", "dp", "pp", "tp_cp", "ep", "etp", "edp"} → lists of global ranks.
    """
    from .specs.grid import PRINTED_AXES, RankGrid

    if plan is not None:
        layout = (plan if isinstance(plan, Plan) else load_plan(plan)).layout
        grid = RankGrid.from_layout(layout)
    else:
        if gpus is None:
            raise SpecError("moeplan groups needs a plan file or --gpus N with the sizes.")
        if order not in ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"):
            raise SpecError(f"--order takes tp-cp-ep-dp-pp or tp-cp-ep-pp-dp, got {order!r}.")
        if gpus % (tp * cp * pp):
            raise SpecError(f"{gpus} GPUs are not divisible by tp·cp·pp = {tp}·{cp}·{pp}.")
        if gpus % (etp * ep * pp):
            raise SpecError(f"{gpus} GPUs are not divisible by etp·ep·pp = {etp}·{ep}·{pp}, "
                            "so edp is not whole.")
        grid = RankGrid(tp=tp, cp=cp, dp=gpus // (tp * cp * pp), pp=pp, ep=ep, etp=etp,
                        order=order)
    return grid.all_groups(PRINTED_AXES)

__all__ += ["search"]


def search(
    model: ModelSpec | str,
    cluster: ClusterSpec | str,
    gpus: int | None = None,
    *,
    seq: int = 4096,
    gbs: int | None = None,
    training: TrainingSpec | None = None,
    precision: str = "bf16",
    top_k: int = 5,
    target: str = "megatron",
    time_limit_s: float | None = None,
    imbalance: float = 1.0,
    calibration: str | None = None,
    progress: object = None,
    objective: str = "robust",
    grad_reduce_dtype: str = "fp32",
    moe_capacity_factor: float | None = None,
    moe_pad_expert_input_to_capacity: bool = False,
    stack: str = "current",
):
    """The best plans for a model on a cluster (SPEC §4 `moeplan search`); see
    `moeplan.planner.search.search`. `gbs` defaults to about 4M tokens per step; `stack` is
    the software stack the plans are priced on and restricted to (`TrainingSpec.software_stack`,
    `specs.rules.STACK_FEATURES`)."""
    from .planner.search import default_gbs
    from .planner.search import search as _search
    from .specs.loader import check_precision, check_stack

    precision = check_precision(precision, allow_auto=True)
    stack = check_stack(stack)
    m = load_model(model)
    c = load_cluster(cluster, gpus, calibration)
    if training is None:
        training = load_training(seq_len=seq, global_batch_size=gbs or default_gbs(seq),
                                 precision="bf16" if precision == "auto" else precision,
                                 grad_reduce_dtype=grad_reduce_dtype,
                                 moe_capacity_factor=moe_capacity_factor,
                                 moe_pad_expert_input_to_capacity=moe_pad_expert_input_to_capacity,
                                 software_stack=stack)
    return _search(m, c, training, c.num_gpus, top_k=top_k, precision=precision, target=target,
                   time_limit_s=time_limit_s, imbalance=imbalance, objective=objective,
                   progress=progress)  # type: ignore[arg-type]

__all__ += ["whatif"]


def whatif(
    model: ModelSpec | str,
    clusters: list[ClusterSpec | str] | str,
    gpus: list[int] | None = None,
    **options: object,
):
    """Capacity planning (SPEC §4 `moeplan whatif`): the best plan, time and cost per cluster
    kind × GPU count × seq × batch × precision, the Pareto front and the inverse questions
    (`days=`, `budget_usd=`). See `moeplan.planner.whatif.whatif` for the options. Imported
    lazily so that `import moeplan` stays light."""
    from .planner.whatif import whatif as _whatif

    return _whatif(model, clusters, gpus, **options)  # type: ignore[arg-type]
