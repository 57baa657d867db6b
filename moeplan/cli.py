"""The `moeplan` command: parse, call the public API, render (rich table or one JSON document).

The work lives in `moeplan.api`, `moeplan.specs`, `moeplan.calibrate` and the planner; this
module parses options, calls them and renders what they return. Errors are mapped to exit codes
in one place (`main`, through `moeplan.errors.EXIT_CODES`): MoeplanError → 2 with one paragraph
on stderr, InfeasibleError → 3, a failed or stopped run → its own code (75/130 for
SIGTERM/SIGINT); `--debug` shows the traceback of bad input instead.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from . import limits
from . import specs as S
from .errors import (
    InfeasibleError,
    MoeplanError,
    RunStopped,
    SpecError,
    TorchMissing,
    exit_code,
    exit_rule,
)
from .fsio import check_writable, strict_dumps, write_json
from .runtime.options import DIST_TIMEOUT_MINUTES, EVAL_ITERS
from .specs.rules import check_target
from .specs.training import STACKS, priced_on
from .terminal import (
    Column,
    Line,
    Progress,
    figure,
    make_console,
    pairs_lines,
    plural,
    screen_width,
    share,
    table_lines,
    wrap,
)

app = typer.Typer(
    name="moeplan",
    help="Plan, predict and run Mixture-of-Experts LLM training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
specs_app = typer.Typer(help="List, show and validate model and cluster specs.",
                        no_args_is_help=True)
app.add_typer(specs_app, name="specs")
checkpoint_app = typer.Typer(help="List checkpoints and export them to Hugging Face.",
                             no_args_is_help=True)
app.add_typer(checkpoint_app, name="checkpoint")
data_app = typer.Typer(help="Tokenize text or JSONL into Megatron's indexed datasets "
                       "(PREFIX.bin + PREFIX.idx), the format `run --data` reads.",
                       short_help="Tokenize text into Megatron's indexed datasets.",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")

out = make_console()
err = make_console(stderr=True)  # piped, a line stays one line (terminal.make_console)

GRAD_REDUCE_HELP = ("Data-parallel gradient reduction dtype: fp32 (Megatron's default) or bf16 "
                    "(half the bytes and gradient memory; Megatron --grad-reduce-in-bf16).")


REPORT_HELP = ("Write the plans as a self-contained HTML page (report.html: the ranking key, "
               "intervals, step time by term, the chosen plan's schedule and memory per "
               "pipeline rank) or as Markdown tables (report.md).")


def _check_report(path: str | None) -> None:
    """Refuse a bad --report before the work, not after it."""
    if path is not None:
        from .planner.report import check_plan_report_path

        check_plan_report_path(path)


def _warn_foreign_calibration(cluster: S.ClusterSpec, calibration: str | None) -> None:
    """One warning line when --calibration was measured on another GPU than the cluster's
    (`specs.loader.foreign_calibration`: what is applied and what is not)."""
    from .specs.loader import foreign_calibration

    words = foreign_calibration(cluster, calibration)
    if words:
        err.print(f"warning: {words}", markup=False, highlight=False, soft_wrap=True)


def _write_plan_report(plans: list[S.Plan], title: str, path: str, objective: str | None,
                       stopped_early: bool = False) -> None:
    from .planner.report import write_plan_report

    written = write_plan_report(plans, title, path, objective, stopped_early)
    err.print(f"wrote {written}", highlight=False, markup=False)


AXIS_HELP = {
    "tp": "Tensor parallel size (attention and dense MLP; sequence parallel when > 1).",
    "pp": "Pipeline parallel size.",
    "vpp": "Virtual pipeline stages per pipeline rank (interleaved schedule).",
    "cp": "Context parallel size (attention only).",
    "ep": "Expert parallel size.",
    "etp": "Expert tensor parallel size.",
    "mbs": "Micro-batch size in sequences.",
}
TARGET_HELP = ("The executor the plan is for, whose rules it must keep (docs/EXPORT.md): "
               "megatron (Megatron-LM; one recompute and offload set for every stage) or "
               "moeplan (`moeplan run`).")
# ------------------------------------------------------------------- options shared by commands
# Declared once: every command that takes one of these takes it under the same name and help.
MODEL_HELP = "Preset, spec file or HF config."
CLUSTER_HELP = "Cluster preset or file."
PRECISION_HELP = "bf16, fp8-delayed, fp8-tensorwise, fp8-blockwise, mxfp8, nvfp4"
ModelOpt = Annotated[str, typer.Option("--model", help=MODEL_HELP)]
MaybeModelOpt = Annotated[str | None, typer.Option("--model", help=MODEL_HELP)]
ClusterOpt = Annotated[str, typer.Option("--cluster", help=CLUSTER_HELP)]
MaybeClusterOpt = Annotated[str | None, typer.Option("--cluster", help=CLUSTER_HELP)]
GpusOpt = Annotated[int | None, typer.Option("--gpus", min=1, help="GPU count.")]
SeqOpt = Annotated[int, typer.Option("--seq", min=1, help="Sequence length.")]
MaybeSeqOpt = Annotated[int | None, typer.Option("--seq", min=1, help="Sequence length.")]
GbsOpt = Annotated[int | None, typer.Option("--gbs", min=1, help="Global batch (sequences).")]
PrecisionOpt = Annotated[str | None, typer.Option("--precision", help=PRECISION_HELP + ".")]
CalibrationOpt = Annotated[str | None, typer.Option(
    "--calibration", help="Overlay measured efficiency constants (moeplan calibrate -o).")]
GradReduceOpt = Annotated[str, typer.Option("--grad-reduce", help=GRAD_REDUCE_HELP)]
CapacityOpt = Annotated[float | None, typer.Option(
    "--capacity-factor", help="Token dropping: each expert takes at most this multiple of the "
    "even share of routed tokens (Megatron --moe-expert-capacity-factor); default dropless.")]
PadOpt = Annotated[bool, typer.Option(
    "--pad-to-capacity", help="Pad each expert's input to its capacity (Megatron "
    "--moe-pad-expert-input-to-capacity, as Megatron-Bridge's token-drop recipes run): static "
    "shapes, no routing sync, and CUDA graphs capture the whole MoE layer; needs "
    "--capacity-factor and the alltoall dispatcher.")]
def _path(param: typer.CallbackParam, value: str | None) -> str | None:
    """A path flag's value, refused when given but blank (`-o ''` would otherwise write
    nothing and exit 0)."""
    if value is not None and not value.strip():
        flag = max(param.opts, key=len) if param.opts else str(param.name)
        raise SpecError(f"{flag} was given an empty value; give a file or directory name, or "
                        "leave the option out.")
    return value


ReportOpt = Annotated[str | None, typer.Option("--report", help=REPORT_HELP, callback=_path)]
StackOpt = Annotated[str, typer.Option("--stack", help="The software stack the plans are "
                     "priced on, and run no feature it predates: " + "; ".join(
                         f"{k} ({w})" for k, w in STACKS.items()) + ".")]


def axis_option(name: str) -> Any:
    """`--tp`, `--pp`, ...: one parallel degree (AXIS_HELP), at least 1."""
    return Annotated[int, typer.Option(f"--{name}", min=1, help=AXIS_HELP[name])]


TpOpt, PpOpt, VppOpt, CpOpt, EpOpt, EtpOpt, MbsOpt = (
    axis_option(a) for a in ("tp", "pp", "vpp", "cp", "ep", "etp", "mbs"))


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def emit(data: Any, as_json: bool, render: Callable[[], None]) -> None:
    """Print `data` as one JSON document, or call `render` for the human view."""
    if as_json:
        if hasattr(data, "model_dump"):
            data = data.model_dump(mode="json")
        sys.stdout.write(strict_dumps(data) + "\n")
    else:
        render()


def _width(console: Console) -> int:
    return screen_width(console.is_terminal, console.width)


def print_lines(lines: list[Line], console: Console | None = None) -> None:
    """Print lines laid out by `moeplan.terminal` (already fitted: rich must not re-wrap)."""
    console = console or out
    for line in lines:
        console.print(Text(line.text, style=line.style or ""), soft_wrap=True)


@contextmanager
def progress_line(every_s: float = 5.0) -> Iterator[Progress]:
    """A `Progress` on stderr for the block: one updating line on a terminal, plain periodic
    lines when piped. An error leaves the line as it was, ended, so the message starts a line
    of its own."""
    def write(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    bar = Progress(write, err.is_terminal, _width(err), every_s)
    try:
        yield bar
    except BaseException:
        bar.done()
        raise


def require_finite(**flags: float | None) -> None:
    """Refuse NaN and infinities in float options (click parses `nan` and `inf`), which would
    otherwise flow into every prediction and come out as non-JSON `NaN`."""
    for name, value in flags.items():
        if value is not None and not math.isfinite(value):
            raise SpecError(f"--{name.replace('_', '-')} {value}: not a finite number; give a "
                            "finite value.")


def require_range(flag: str, value: float | None, lo: float, hi: float, what: str,
                  why: str = "") -> None:
    """Refuse a float option outside lo..hi, after `require_finite` has refused NaN and the
    infinities: click's own range check would call NaN "not greater than or equal to" the
    bound, so float options carry no `min=` and are bounded here. `what`: what the value is;
    `why`: why the bound, for the message."""
    if value is not None and not lo <= value <= hi:
        span = f"at least {lo:g}" if hi == math.inf else f"from {lo:g} to {hi:g}"
        raise SpecError(f"{flag} {value:g}: {what} must be {span}"
                        + (f"; {why}." if why else "."))


def csv_ints(value: str | None, flag: str, limit: int) -> list[int] | None:
    """Parse '64,128,256' or '64-256' (powers of two in between) into ints, with a clear error.

    Every value must be in 1..`limit`, and there are at most limits.MAX_SWEEP_POINTS of them,
    checked before any list is built (a range doubles from lo, so lo must be positive).
    """
    if value is None:
        return None
    shown = limits.excerpt(value)
    if len(value) > 20 * limits.MAX_SWEEP_POINTS:
        raise SpecError(f"{flag}: the list is longer than {limits.MAX_SWEEP_POINTS} values "
                        f"(got {shown}); give fewer values.")
    try:
        if "-" in value and "," not in value:
            lo, hi = (int(x) for x in value.split("-"))
            if lo <= 0 or hi < lo:
                raise SpecError(f"{flag} range lo-hi needs 1 ≤ lo ≤ hi (values double from lo), "
                                f"got {shown}.")
            limits.check(flag, hi, limit, f"give a range up to {limit:,}")
            vals, n = [], lo
            while n <= hi:
                vals.append(n)
                n *= 2
        else:
            vals = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"{flag} takes whole numbers separated by commas (e.g. 64,128) or a "
                        f"range lo-hi, got {shown}.") from None
    if not vals or any(v <= 0 for v in vals):
        raise SpecError(f"{flag} takes positive whole numbers, got {shown}.")
    limits.check(f"{flag} count of values", len(vals), limits.MAX_SWEEP_POINTS,
                 "give fewer values")
    limits.check(flag, max(vals), limit, f"give values up to {limit:,}")
    return vals


def csv_names(value: str | None) -> list[str]:
    return [x.strip() for x in (value or "").split(",") if x.strip()]


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        sys.stdout.write(f"moeplan {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Declares the root options; `main` reads --debug from the command line itself."""


# ---------------------------------------------------------------------------------------- specs
@specs_app.command("list")
def specs_list(as_json: JsonOpt = False) -> None:
    """List the model and cluster presets."""
    presets = S.list_presets()

    def render() -> None:
        print_lines(pairs_lines(None, [("models", ", ".join(presets["models"])),
                                       ("clusters", ", ".join(presets["clusters"]))],
                                _width(out)))

    emit(presets, as_json, render)


@specs_app.command("show")
def specs_show(
    ref: Annotated[str, typer.Argument(help="Preset name, spec file or Hugging Face config.json.")],
    seq: Annotated[int, typer.Option("--seq", min=1, help="Sequence length for FLOPs.")] = 4096,
    as_json: JsonOpt = False,
) -> None:
    """Show a spec with its derived parameter counts and FLOPs per token."""
    from .api import describe_spec

    limits.check("--seq", seq, limits.MAX_SEQ_LEN, "give a shorter sequence")
    doc = describe_spec(ref, seq)

    def render() -> None:
        pairs = [(k, str(v)) for k, v in doc["spec"].items() if v not in (None, {}, [])]
        d = doc["derived"]
        if d:
            pairs += [("total params", f"{d['total_params'] / 1e9:.2f} B"),
                      ("active params", f"{d['active_params'] / 1e9:.2f} B"),
                      (f"FLOPs/token (s={seq})", f"{d['flops_per_token'] / 1e9:.1f} GFLOP")]
        print_lines(pairs_lines(f"{doc['kind']} {doc['name']}", pairs, _width(out)))

    emit(doc, as_json, render)


@specs_app.command("validate")
def specs_validate(
    path: Annotated[str, typer.Argument(help="A ModelSpec/ClusterSpec/TrainingSpec/Plan file.")],
    as_json: JsonOpt = False,
) -> None:
    """Check a spec file; exits 2 with the offending field when it is invalid."""
    from .api import validate_spec_file

    doc = validate_spec_file(path)
    emit(doc, as_json, lambda: out.print(f"[green]valid[/] {doc['kind']} spec '{doc['name']}' "
                                         f"({doc['path']})"))


def given(ctx: typer.Context, name: str) -> bool:
    """Whether parameter `name` was typed on the command line (not a default)."""
    source = ctx.get_parameter_source(name)
    # compared by name: typer may carry a click of its own
    return source is not None and source.name == "COMMANDLINE"


def ignored_flags(ctx: typer.Context, kept: frozenset[str]) -> list[str]:
    """The flags given on the command line, other than `kept`, that a command reading its
    layout from a plan file would not use: each is refused rather than silently ignored."""
    return [max(p.opts, key=len) for p in ctx.command.params
            if p.name not in kept and p.opts and given(ctx, str(p.name))]


ESTIMATE_WITH_PLAN = frozenset({"plan_file", "calibration", "output", "report", "target",
                                "imbalance", "routing_histogram", "as_json"})
"""What `estimate PLAN.json` takes besides the plan: the rest is the plan's own."""


@app.command()
def estimate(
    ctx: typer.Context,
    plan_file: Annotated[str | None, typer.Argument(
        metavar="[PLAN.json]", help="A plan written by `search -o` or `estimate -o`.")] = None,
    model: MaybeModelOpt = None,
    cluster: MaybeClusterOpt = None,
    gpus: GpusOpt = None,
    seq: MaybeSeqOpt = None,
    gbs: GbsOpt = None,
    tp: TpOpt = 1,
    pp: PpOpt = 1,
    vpp: VppOpt = 1,
    cp: CpOpt = 1,
    ep: EpOpt = 1,
    etp: EtpOpt = 1,
    mbs: MbsOpt = 1,
    recompute: Annotated[str | None, typer.Option("--recompute", help="e.g. core_attn,moe_act "
                                                  "or full.")] = None,
    offload: Annotated[str | None, typer.Option("--offload", help="e.g. expert_fc1,moe_act.")
                       ] = None,
    precision: PrecisionOpt = None,
    dispatcher: Annotated[str, typer.Option("--dispatcher", help="alltoall, allgather, flex.")
                          ] = "alltoall",
    flex_backend: Annotated[str, typer.Option(
        "--flex-backend", help="The flex dispatcher's library: hybridep, or deepep (about half "
        "the bandwidth across a multi-node NVLink domain).")] = "hybridep",
    ep_overlap: Annotated[bool, typer.Option("--ep-overlap", help="Merged fwd/bwd EP overlap.")
                          ] = False,
    tp_comm_overlap: Annotated[bool, typer.Option(
        "--tp-comm-overlap", help="TP comm overlapped with the GEMMs (TE userbuffers).")] = False,
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs", help="CUDA graphs over each layer's static-shape part.")] = False,
    cuda_graph_scope: Annotated[str, typer.Option(
        "--cuda-graph-scope", help="layer (each layer's static-shape part) or full_iteration "
        "(the whole step as one graph; turns --cuda-graphs on; a dropless MoE takes HybridEP's "
        "per-rank token budget and the paged stash).")] = "layer",
    fused_grouped_mlp: Annotated[bool, typer.Option(
        "--fused-grouped-mlp", help="Experts as Transformer Engine's fused grouped MLP (one "
        "CuTe-DSL GEMM with the activation and MXFP8 quantisation in its epilogue; mxfp8 or "
        "nvfp4 on Blackwell, TE >= 2.14).")] = False,
    grad_reduce: GradReduceOpt = "fp32",
    capacity_factor: CapacityOpt = None,
    pad_to_capacity: PadOpt = False,
    stack: StackOpt = "current",
    stage_layout: Annotated[str | None, typer.Option(
        "--stage-layout", help="Megatron --pipeline-model-parallel-layout, e.g. "
        "'Et*3|(tt|)*29,m|L'.")] = None,
    imbalance: Annotated[float, typer.Option("--imbalance", help="Tokens on the busiest EP rank "
                                             "over the mean (1.0: forced balance).")] = 1.0,
    routing_histogram: Annotated[str | None, typer.Option(
        "--routing-histogram", help="routing.json: per-layer tokens per expert.")] = None,
    calibration: CalibrationOpt = None,
    output: Annotated[str | None, typer.Option("-o", "--output", help="Write the Plan JSON.", callback=_path)
                      ] = None,
    report: ReportOpt = None,
    target: Annotated[str | None, typer.Option(
        "--target", help=TARGET_HELP + " Default: the plan's own, else megatron.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Predict step time, throughput and memory of one layout.

    The layout is checked against every rule of its target executor (exit 2 naming each one
    it breaks, with the fix)."""
    _check_report(report)
    from .api import estimate as api_estimate
    from .api import plan_from_options, with_calibration

    require_finite(imbalance=imbalance, capacity_factor=capacity_factor)
    if output:
        check_writable(output)
    if routing_histogram and imbalance != 1.0:
        raise SpecError("give either --imbalance or --routing-histogram, not both.")
    unsaid = False  # a plan file whose estimate does not record its routing imbalance
    if plan_file:
        if model or cluster:
            raise SpecError("give either PLAN.json or --model/--cluster, not both.")
        extra = ignored_flags(ctx, ESTIMATE_WITH_PLAN)
        if extra:
            raise SpecError(f"{', '.join(extra)}: PLAN.json holds its own layout and training, "
                            "so these would be ignored; drop them, or build another plan from "
                            "--model and --cluster with them.")
        plan = with_calibration(S.load_plan(plan_file), calibration)
        unsaid = plan.estimate is not None and plan.estimate.imbalance is None
        if plan.estimate is not None and routing_histogram is None \
                and not given(ctx, "imbalance"):
            imbalance = plan.estimate.imbalance or 1.0  # what the plan was priced at
    else:
        if not model or not cluster:
            raise SpecError("moeplan estimate needs PLAN.json, or --model and --cluster with "
                            "--gpus, --seq, --gbs and the layout (--tp, --pp, ...).")
        axes = {"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "ep": ep, "etp": etp, "mbs": mbs,
                "dispatcher": dispatcher, "ep_overlap": ep_overlap,
                "tp_comm_overlap": tp_comm_overlap,
                "cuda_graphs": cuda_graphs or cuda_graph_scope == "full_iteration",
                "cuda_graph_scope": cuda_graph_scope, "fused_grouped_mlp": fused_grouped_mlp}
        if given(ctx, "flex_backend"):  # read only with the flex dispatcher: refused without
            axes["flex_backend"] = flex_backend
        plan = plan_from_options(model, cluster, gpus, seq, gbs, precision, axes,
                                 csv_names(recompute), csv_names(offload), stage_layout,
                                 calibration, grad_reduce_dtype=grad_reduce,
                                 target=target or "megatron",
                                 software_stack=stack, moe_capacity_factor=capacity_factor,
                                 moe_pad_expert_input_to_capacity=pad_to_capacity)
    _warn_foreign_calibration(plan.cluster, calibration)
    if target is not None:
        check_target(target)
        plan = plan.model_copy(update={"target": target})
    est = api_estimate(plan, imbalance=imbalance, routing_histogram=routing_histogram)
    # a plan file priced at a routing it does not record (written before it was, or from a
    # histogram) is priced balanced here: said where that moves it
    moved = plan.estimate is not None and (plan.estimate.step_time_s, plan.estimate.memory) != (
        est.step_time_s, est.memory)
    if moved and unsaid and routing_histogram is None:
        err.print("note: the plan does not record the routing it was priced at (an older plan "
                  "file, or a routing histogram), and priced balanced it moves; pass "
                  "--imbalance or --routing-histogram as it was priced.", markup=False,
                  highlight=False)
    # a search's "why this plan" holds only for the estimate it was written with: a plan file
    # edited since (another layout, another choice) or priced otherwise drops it
    before = plan.estimate
    if before is not None and before.imbalance is None:  # unrecorded: not a difference
        before = before.model_copy(update={"imbalance": est.imbalance})
    stale = bool(plan.explanation) and before != est
    plan = plan.model_copy(update={"estimate": est, **({"explanation": []} if stale else {})})
    if stale and before is None:  # nothing to compare with: it cannot be shown to hold
        err.print("note: the plan's search explanation was dropped: the plan records no "
                  "estimate (its `estimate` was removed), so nothing shows the explanation "
                  "still holds for it.", markup=False, highlight=False)
    elif stale:
        err.print("note: the plan's search explanation was dropped: this estimate differs "
                  "from the one the search wrote it for (the file was edited, or priced with "
                  "other settings).", markup=False, highlight=False)
    if report:
        _write_plan_report([plan], f"{plan.headline()}: estimate", report, None)
    verdict = fit_verdict(plan)
    if output:
        write_json(output, plan.model_dump(mode="json"))
        err.print(f"wrote {output}" + ("" if est.fits else f" (this plan {verdict})"),
                  markup=False, highlight=False)

    def render() -> None:
        head = "" if est.fits else "DOES NOT FIT: "
        print_lines(pairs_lines(f"{head}{plan.headline()}, {plan.batch_words()}: "
                                f"{plan.summary()}",
                                estimate_pairs(plan), _width(out)))
        for w in est.warnings:
            err.print(f"[yellow]warning:[/] {escape(w)}")

    emit(est, as_json, render)


def fit_verdict(plan: S.Plan) -> str:
    """`fits` or `does NOT fit`, with the line it is judged against (HBM − reserve − margin,
    the one rule in cost_models.uncertainty)."""
    from .planner.anatomy import fit_failure, fit_line_gb, fit_rule_words

    failure = fit_failure(plan)
    if failure is None:
        return f"fits under the fit line {fit_line_gb(plan):.1f} GB ({fit_rule_words(plan)})"
    return f"does NOT fit: {failure}"


def estimate_pairs(plan: S.Plan) -> list[tuple[str, str]]:
    """The estimate as (label, value) rows: the numbers `estimate --json` carries, formatted."""
    est = plan.estimate
    assert est is not None
    mem = est.memory
    rows = [("step time", f"{est.step_time_s:.3g} s" if est.step_time_s < 0.1
             else f"{est.step_time_s:.3f} s"),
            ("tokens/s/GPU", figure(est.tokens_per_s_per_gpu)),
            ("TFLOPS/GPU (model)", f"{figure(est.tflops_per_gpu)} (MFU {share(est.mfu)} of the "
             "dense BF16 peak)"),
            ("time by term", "each term on its own; communication overlaps compute, and "
             "exposed comm is what the step waits for")]
    for k, v in est.time.model_dump().items():
        if v:
            alone = " (alone)" if k in ("tp_comm_s", "cp_comm_s", "ep_comm_s", "dp_comm_s") else ""
            rows.append((f"  {k.removesuffix('_s').replace('_', ' ')}{alone}", f"{v:.3f} s"))
    if est.unmodelled_s:
        rows.append(("  unmodelled (measured)", f"{est.unmodelled_s:.3f} s"))
    rows += [("peak memory", f"{mem.peak_gb:.1f} GB of {plan.cluster.hbm_gb:g} GB: "
              + fit_verdict(plan)),
             ("  weights / grads / optimizer",
              f"{mem.weights_gb:.1f} / {mem.grads_gb:.1f} / {mem.optimizer_gb:.1f} GB"),
             ("  activations / buffers", f"{mem.activations_gb:.1f} / {mem.buffers_gb:.1f} GB"),
             ("  headroom / margin", f"{mem.headroom_gb:.1f} / {mem.margin_gb:.1f} GB "
              "(the margin holds the reserve and the model's error at this peak; fits when "
              "headroom ≥ margin)")]
    if mem.host_gb:
        rows.append(("host memory", f"{mem.host_gb:.1f} GB of {plan.cluster.host_memory_gb:g} GB "
                     "per GPU offloaded (optimizer share, gradient copies, activations)"))
    rows.append(("bottleneck", est.bottleneck))
    if est.interval is not None:
        (lo, hi), (slo, shi) = est.interval.tokens_per_s_per_gpu, est.interval.step_time_s
        rows.append((f"{est.interval.level:.0%} interval", f"{lo:,.0f}–{hi:,.0f} tokens/s/GPU, "
                     f"{slo:.3f}–{shi:.3f} s per step"))
    weak = [a.term for a in est.assumptions if not a.validated]
    if weak:
        rows.append(("not validated", "; ".join(weak)))
    if est.confidence:
        rows.append(("confidence", f"{est.confidence.label}: {est.confidence.reason}"))
    stack = plan.training.software_stack
    rows.append(("software stack", f"{stack}: {STACKS[stack]}"))
    return rows


@app.command(short_help="Predict published runs and score the error.")
def validate(
    runs_csv: Annotated[str | None, typer.Argument(
        metavar="[RUNS.csv]", help="A CSV shaped like published_runs.csv (default: the "
        "published runs shipped with moeplan).")] = None,
    cv: Annotated[str | None, typer.Option("--cv", help="Cross-validate instead: model "
                  "(leave one model out) or release (leave one software release out); each "
                  "fold refits the calibration without its rows (a quick refit: one sweep).")
                  ] = None,
    jobs: Annotated[int, typer.Option("--jobs", min=1, max=limits.MAX_JOBS, help="With --cv: "
                    "folds refitted at once, each in a process of its own (the result does not "
                    "depend on it).")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Predict published runs and report the error per row: runs the shipped calibration was
    fitted on apart from runs it was not (held out), which are the evidence."""
    from .validation import read_rows, validate_rows

    if cv is not None:
        _validate_cv(runs_csv, cv, as_json, jobs)
        return
    if jobs != 1:
        raise SpecError(f"--jobs {jobs}: sets how many cross-validation folds run at once; "
                        "pass it with --cv model or --cv release (a plain validate prices "
                        "every run under the shipped calibration, with no refit to spread).")
    rows = read_rows(runs_csv)
    with progress_line(2.0) as bar:
        res = validate_rows(rows, progress=lambda done, total: bar.update(
            f"validating: {done / total:.0%} ({done} of {total} rows)"))
        bar.done(f"validated: 100% ({plural(len(rows), 'row')}: {len(res['rows'])} predicted, "
                 f"{len(res['skipped'])} skipped)")
    if not res["rows"]:  # nothing scored is no result: a script reading exit 0 would trust it
        from .validation.scoring import common_skip_reasons

        none = ("its one row could not be predicted" if len(rows) == 1 else
                f"none of its {len(rows):,} rows could be predicted")
        raise SpecError(f"{runs_csv or 'the CSV'}: {none}. The commonest reasons: "
                        f"{common_skip_reasons(res['skipped'])}. Fix those cells and run "
                        "validate again.")
    doc = {k: res[k] for k in ("rows", "mape_tokens_per_s", "skipped", "mape_tokens_per_s_fit",
                               "mape_tokens_per_s_held_out", "mape_tflops", "mape_memory_gb",
                               "coverage", "median_interval_width", "coverage_fit",
                               "coverage_cross_validated", "cross_validated", "unseen",
                               "ranking")}

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def render() -> None:
        width = _width(out)
        cols = [Column("id"), Column("split", fold=3), Column("model", fold=2),
                Column("gpu", fold=1), Column("precision", fold=0),
                Column("tok/s/GPU pred", right=True), Column("published", right=True),
                Column("error", right=True)]
        body = []
        for r in res["rows"]:
            pub, pred = r["published_tokens_per_s_per_gpu"], r["predicted_tokens_per_s_per_gpu"]
            e = f"{pred / pub - 1:+.1%}" if pub else "-"
            body.append([r["id"] + ("*" if r.get("assumed") else ""), r["split"], r["model"],
                         r["gpu"], r["precision"], f"{pred:,.0f}",
                         f"{pub:,.0f}" if pub else "-", e])
        print_lines(table_lines(f"{plural(len(res['rows']), 'run')} predicted, "
                                f"{len(res['skipped'])} skipped", cols, body, width))
        if res["skipped"]:
            from .validation import skip_groups
            from .validation.scoring import first_ids

            print_lines([Line(x, "bold") for x in wrap(
                f"{plural(len(res['skipped']), 'row')} skipped, by reason (each row's own: "
                "--json, `skipped`)", width, "  ")])
            for why, ids in skip_groups(res["skipped"]):
                print_lines([Line(x) for x in wrap(f"{why} ({first_ids(ids)})", width, " " * 7,
                                                   f"{len(ids):>5}  ")])
        notes = _validate_notes(res, pct)
        if any(not r["published_tokens_per_s_per_gpu"] for r in res["rows"]):
            notes.insert(0, "- published: the row gives no tokens/s/GPU and no TFLOPS this "
                         "prediction can be compared with (TFLOPS in an unknown FLOP "
                         "convention, or none); it is priced, not scored (--json has its "
                         "`flops_convention`)")
        assumed = sorted({k for r in res["rows"] for k in (r.get("assumed") or {})})
        if assumed:
            words = ", ".join(ASSUMED_WORDS.get(k, k.replace("_", " ")) for k in assumed)
            notes.insert(0, "* priced with settings its source documents but the row does not "
                         f"print (here: {words}; each row's own are `assumed` in --json)")
        for note in notes:
            print_lines([Line(x) for x in wrap(note, width, "  ")])

    emit(doc, as_json, render)


ASSUMED_WORDS = {
    "recipe": "the Megatron-Bridge workload recipe whose sizes the row matches",
    "cluster": "the cluster the source ran", "vpp": "the recipe's virtual pipeline size",
    "ep_overlap": "EP overlap", "cuda_graphs": "CUDA graphs",
    "cuda_graph_scope": "CUDA graph scope", "tp_comm_overlap": "TP comm overlap",
    "fp8_param_gather": "FP8 parameter gather", "grad_reduce_dtype": "gradient reduction dtype",
    "moe_capacity_factor": "capacity factor",
    "moe_pad_expert_input_to_capacity": "padding to capacity",
    "optimizer_moments_dtype": "Adam moments dtype",
}
"""The `assumed` settings of validate's rows (validation.cases) in the words its footnote uses;
any other key is read with its underscores as spaces."""


def _groups_off(groups: list[dict[str, Any]]) -> str:
    """The model × GPU-family groups (`scoring.family_groups`) and those off as a whole."""
    from .validation.scoring import FAMILY_BAR

    off = ", ".join(f"{g['model']} on {g['gpu_family']} {g['mean_error']:+.1%} ({g['rows']} "
                    "rows)" for g in groups if g["off"]) or "none"
    return (f"Model × GPU-family groups of two or more rows: {len(groups)}; off by more than "
            f"±{FAMILY_BAR:.0%} as a whole: {off}.")


def _validate_notes(res: dict[str, Any], pct: Callable[[float | None], str]) -> list[str]:
    """`validate`'s summary: the held-out rows (runs the shipped calibration was not fitted on)
    measured as new runs are judged, the fit rows' in-sample error named as such, with the
    cross-validated figures that are evidence for them."""
    from .cost_models.uncertainty import YARDSTICKS
    from .validation.scoring import STEP_BAR

    notes, un = [], res["unseen"]
    if un["rows"]:
        parts = [f"Held-out rows (runs the shipped calibration was not fitted on): {un['rows']}."]
        mapes = []
        if un["tokens_rows"]:
            mapes.append(f"{pct(un['mape_tokens_per_s'])} over "
                         f"{plural(un['tokens_rows'], 'row')} publishing it")
        if un["tflops_only_rows"]:
            mapes.append(f"{pct(un['mape_tflops_only'])} over "
                         f"{plural(un['tflops_only_rows'], 'row')} publishing only TFLOPS "
                         "(their tokens/s derived from it)")
        if mapes:
            parts.append("MAPE tokens/s/GPU " + "; ".join(mapes) + ".")
        if un["family_groups"]:
            parts.append(_groups_off(un["family_groups"]))
        if un["coverage"] is not None:
            parts.append(f"80% intervals hold {pct(un['coverage'])} of them, median width "
                         f"{pct(un['median_interval_width'])} of the point.")
        lp = un["layout_pairs"]
        if lp["pairs"]:
            parts.append(f"Layout pairs of one release among them: {lp['ordered']} of "
                         f"{lp['pairs']} ordered as measured, {lp['ordered_within_step_bar']} "
                         f"of those priced within {STEP_BAR:.0%} of the measured ratio.")
        seq = un["sequence_steps"]
        if seq and seq["steps"]:
            parts.append(f"Steps of sequence length among them (one model, cluster, precision "
                         f"and release): {seq['moves_as_measured']} of {seq['steps']} move the "
                         f"way they were measured (TFLOPS/GPU where published), "
                         f"{seq['within_step_bar']} within {STEP_BAR:.0%} of the measured ratio.")
        notes.append(" ".join(parts))
    fit = [r for r in res["rows"] if r["split"] == "fit"]
    if fit:
        cv = res["cross_validated"]
        quoted = "; ".join(
            f"{name} {pct(cv[k].get('mape'))}, 80% intervals hold {pct(cv[k].get('coverage'))}"
            f" (median width {pct(cv[k].get('median_width'))})"
            for k, name in YARDSTICKS.items() if k in cv)
        notes.append(f"Fit rows (runs the shipped calibration was fitted on): {len(fit)}, MAPE "
                     f"tokens/s/GPU {pct(res['mape_tokens_per_s_fit'])}: in sample, not "
                     "evidence." + (f" Cross-validated over the shipped runs, each row "
                                    f"predicted by a refit that did not see it: {quoted} "
                                    "(`moeplan validate --cv model|release`)." if quoted else ""))
    rk = res["ranking"]
    scored = sum(1 for r in res["rows"] if r["published_tokens_per_s_per_gpu"])
    derived = sum(1 for r in res["rows"]
                  if r["published_tokens_per_s_per_gpu"] and r["tokens_derived_from_tflops"])
    how = f", {derived} of them derived from TFLOPS" if derived else ""
    notes.append(f"All rows scored: MAPE tokens/s/GPU {pct(res['mape_tokens_per_s'])} over "
                 f"the {scored} with a tokens/s figure{how}, TFLOPS (own "
                 f"convention) {pct(res['mape_tflops'])}; layout pairs of one release ordered "
                 f"as measured {rk['ordered']} of {rk['pairs']}.")
    return notes


def _validate_cv(runs_csv: str | None, by: str, as_json: bool, jobs: int = 1) -> None:
    """`validate --cv`: leave-one-model-out or leave-one-release-out error per family."""
    from .validation import read_rows
    from .validation.crossval import CLI_CHOICES, cross_validate_rows

    if by not in CLI_CHOICES:
        raise SpecError(f"--cv {limits.excerpt(by)}: takes {' or '.join(CLI_CHOICES)} (leave one model "
                        "out, or one software release out).")
    res = cross_validate_rows(read_rows(runs_csv), by, "quick",  # type: ignore[arg-type]
                              log=lambda m: err.print(m, highlight=False, markup=False),
                              jobs=jobs)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def render() -> None:
        width = _width(out)
        cols = [Column("family"), Column("rows", right=True), Column("MAPE", right=True),
                Column("mean error", right=True)]
        body = [[k, str(v["rows"]), pct(v["mape"]), f"{v['bias']:+.1%}"]
                for k, v in res["by_family"].items()]
        title = (f"leave one {by} out: {plural(res['count'], 'run')} predicted by a "
                 f"calibration refitted without {'its' if res['count'] == 1 else 'their'} "
                 f"{by} ({plural(len(res['folds']), 'fold')}, {res['refit']} refit)")
        print_lines(table_lines(title, cols, body, width))
        notes = [f"MAPE tokens/s/GPU {pct(res['mape'])} (median {pct(res['median_ape'])}; "
                 f"90th percentile {pct(res['p90_ape'])})", _groups_off(res["model_gpu_groups"])]
        for note in notes:
            print_lines([Line(x) for x in wrap(note, width, "  ")])

    emit(res, as_json, render)


@app.command()
def search(
    model: ModelOpt,
    cluster: ClusterOpt,
    gpus: GpusOpt = None,
    seq: SeqOpt = 4096,
    gbs: Annotated[int | None, typer.Option("--gbs", min=1, help="Global batch (sequences); "
                                            "default about 4M tokens.")] = None,
    precision: Annotated[str, typer.Option("--precision", help=PRECISION_HELP + ", or auto.")
                         ] = "bf16",
    top: Annotated[int, typer.Option("--top", min=1, help="Plans to report.")] = 5,
    target: Annotated[str, typer.Option("--target", help=TARGET_HELP)] = "megatron",
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="Stop "
                          "searching after this many seconds (at least 0.1) and report the "
                          "best so far (the "
                          "layouts are enumerated and bounded first, and a first plan that "
                          "fits is always found, so 'nothing fits' stays a proof).")
                          ] = None,
    imbalance: Annotated[float, typer.Option("--imbalance", help="Tokens on the "
                         "busiest EP rank over the mean.")] = 1.0,
    calibration: CalibrationOpt = None,
    output: Annotated[str | None, typer.Option("-o", "--output", help="Write the best plan.", callback=_path)
                      ] = None,
    report: ReportOpt = None,
    objective: Annotated[str, typer.Option("--objective", help="robust: rank by the low end of "
                         "the 80 % tokens/s/GPU interval, so a plan wins only if it still wins "
                         "when its unvalidated effects disappoint; expected: rank by the point "
                         "estimate.")] = "robust",
    grad_reduce: GradReduceOpt = "fp32",
    capacity_factor: CapacityOpt = None,
    pad_to_capacity: PadOpt = False,
    stack: StackOpt = "current",
    as_json: JsonOpt = False,
) -> None:
    """Search every folded layout and rank the best plans."""
    _check_report(report)
    from . import search as api_search

    require_finite(time_limit=time_limit, imbalance=imbalance, capacity_factor=capacity_factor)
    require_range("--time-limit", time_limit, limits.MIN_TIME_LIMIT_S, math.inf,
                  "the seconds the search may take")
    limits.check_imbalance(imbalance)
    limits.check("--top", top, limits.MAX_TOP_PLANS, "ask for fewer plans")
    if output:
        check_writable(output)
    if calibration is not None:
        _warn_foreign_calibration(S.load_cluster(cluster, gpus, calibration), calibration)
    may_fit = 0
    with progress_line() as bar:
        def progress(done: int, total: int) -> None:
            # each candidate layout is visited at most twice (bounded, then solved); the rest
            # are pruned by the bound, so the share may jump to 100 % at the end
            nonlocal may_fit
            may_fit = total // 2
            bar.update(f"searching: {min(done / total, 1):.0%} of the {may_fit:,} layouts "
                       "that may fit examined")

        try:
            res = api_search(model, cluster, gpus=gpus, seq=seq, gbs=gbs, precision=precision,
                             top_k=top, target=target, time_limit_s=time_limit,
                             imbalance=imbalance, calibration=calibration, progress=progress,
                             objective=objective, grad_reduce_dtype=grad_reduce,
                             moe_capacity_factor=capacity_factor,
                             moe_pad_expert_input_to_capacity=pad_to_capacity, stack=stack)
        except InfeasibleError as e:
            # a proof that nothing fits is a result: a script reading --json gets one document
            # saying so (exit 3, the paragraph on stderr as ever), not an empty stream
            emit({"plans": [], "infeasible": True, "message": _one_paragraph(str(e))},
                 as_json, lambda: None)
            raise
        # the same count the progress line gave, beside all the valid ones
        fit = f" ({may_fit:,} that may fit)" if may_fit else ""
        bar.done(f"searching: 100%, {plural(res.layouts, 'valid layout')}{fit} in "
                 f"{res.seconds:.1f} s" + (" (stopped at the time limit)" if res.stopped_early
                                           else ""))
    if output:
        write_json(output, res.plans[0].model_dump(mode="json"))
        err.print(f"wrote {output} (the best plan)", highlight=False, markup=False)
    if report:
        best = res.plans[0]
        best_words = "best plan" if len(res.plans) == 1 else f"best {len(res.plans)} plans"
        _write_plan_report(res.plans, f"{best.headline()}: {best_words}",
                           report, res.objective, res.stopped_early)
    if res.stopped_early:
        err.print(f"note: stopped at the time limit ({time_limit:g} s); the plans are the best "
                  "found so far", highlight=False)

    def render() -> None:
        from .planner.explain import terminal_notes

        width = _width(out)
        best = res.plans[0]
        key = SEARCH_KEYS[res.objective]
        print_lines(table_lines(
            f"{best.headline()}, {best.batch_words()}: best {len(res.plans)} of "
            f"{plural(res.layouts, 'layout')} "
            f"({res.seconds:.1f} s), ranked by {key}", search_columns(res.objective),
            [search_row(i, p, res.objective) for i, p in enumerate(res.plans)], width))
        for line in terminal_notes(res):
            print_lines([Line(s) for s in wrap(line, width, "  ")])
        print_warnings(best)
        print_lines([Line(s, "dim") for s in wrap(_next_steps(output), width, "  ")])

    emit(res.to_json(), as_json, render)


def print_warnings(plan: S.Plan) -> None:
    """The plan's estimate warnings on stderr, as `moeplan estimate` prints them: a search
    says them once, for the best plan (the other rows' come with `estimate` on their file)."""
    assert plan.estimate is not None
    width = _width(err)
    for w in plan.estimate.warnings:
        print_lines([Line(s, "yellow") for s in wrap(w, width, "  ", "warning (#1): ")], err)


SEARCH_KEYS = {"robust": "low end: the 80% interval's low end of tokens/s/GPU",
               "expected": "tok/s/GPU: the point estimate"}


def search_columns(objective: str) -> list[Column]:
    """The search table's columns: the ranking key first after the rank, never folded."""
    cols = [Column("#", right=True), Column("low end", right=True),
            Column("layout", fold=2), Column("choices", fold=1),
            Column("step s", right=True), Column("tok/s/GPU", right=True),
            Column("TFLOPS", right=True, fold=4), Column("MFU", right=True),
            Column("peak/fit GB", right=True, fold=3), Column("bottleneck", fold=0)]
    if objective == "expected":  # the point is the key: it moves next to the rank
        cols.insert(1, cols.pop(5))
    return cols


def search_row(i: int, p: S.Plan, objective: str = "robust") -> list[str]:
    """One plan as the search table's cells (`Plan.layout_summary`/`choices_summary` words);
    memory as peak / fit line (HBM − reserve − margin), the line `fits` is judged by."""
    from .planner.anatomy import fit_line_gb

    e = p.estimate
    assert e is not None
    low = f"{e.interval.tokens_per_s_per_gpu[0]:,.0f}" if e.interval else "-"
    row = [str(i + 1), low, p.layout_summary(), p.choices_summary(), f"{e.step_time_s:.3g}",
           figure(e.tokens_per_s_per_gpu), figure(e.tflops_per_gpu), share(e.mfu),
           f"{e.memory.peak_gb:.1f}/{fit_line_gb(p):.1f}", e.bottleneck]
    if objective == "expected":
        row.insert(1, row.pop(5))
    return row


def _next_steps(output: str | None) -> str:
    """The one line after a search: how to keep the best plan and what to do with it."""
    if output:
        return (f"next: moeplan estimate {output} (breakdown), moeplan export {output} --format "
                f"megatron|torchrun|slurm, or moeplan run {output} --scale-down (a small "
                "local run).")
    return ("next: add -o plan.json to keep the best plan, then moeplan estimate plan.json, "
            "moeplan export plan.json --format megatron, or moeplan run plan.json.")


# what-if columns: the point's key and its headline numbers stay in the row, the rest fold
WHATIF_COLUMNS = {
    "cluster": Column("cluster"), "GPUs": Column("GPUs", right=True),
    "seq": Column("seq", right=True, fold=4), "gbs": Column("gbs", right=True, fold=3),
    "layout": Column("layout", fold=1), "tok/s/GPU": Column("tok/s/GPU", right=True),
    "MFU": Column("MFU", right=True, fold=5), "step s": Column("step s", right=True, fold=6),
    "days": Column("days", right=True), "GPU-hours": Column("GPU-hours", right=True, fold=7),
    "cost": Column("cost", right=True, fold=8), "scaling": Column("scaling", right=True, fold=2),
    "pareto": Column("pareto"), "why": Column("why", fold=0),
}


@app.command(short_help="Capacity planning: time and cost per cluster.")
def whatif(
    model: ModelOpt,
    cluster: Annotated[str, typer.Option("--cluster", help="Cluster presets or files, "
                       "comma-separated (h100,h200,gb200-nvl72).")],
    gpus: Annotated[str | None, typer.Option("--gpus", help="GPU counts: 64,128,256 or a "
                    "range 64-1024 (doubling).")] = None,
    seq: Annotated[str, typer.Option("--seq", help="Sequence lengths, comma-separated.")] = (
        "4096"),
    gbs: Annotated[str | None, typer.Option("--gbs", help="Global batches (sequences), "
                   "comma-separated; default about 4M tokens per step.")] = None,
    precision: Annotated[str, typer.Option("--precision", help="Precisions, comma-separated "
                         "(bf16, fp8-tensorwise, mxfp8, ..., auto).")] = "bf16",
    tokens: Annotated[float, typer.Option("--tokens", help="Tokens to train, as 1e12 "
                      "(default: 15e12).", show_default=False)] = (
        15e12),
    gpu_hour_price: Annotated[str | None, typer.Option("--gpu-hour-price", help="USD per "
                              "GPU-hour: one price, or one per --cluster kind in order.")
                              ] = None,
    days: Annotated[float | None, typer.Option("--days", help="Also answer: the fewest GPUs "
                    "of each kind that finish within D days.")] = None,
    budget: Annotated[float | None, typer.Option("--budget", help="Also answer: the fastest "
                      "option within this many USD (needs --gpu-hour-price).")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Plans kept per search (the best "
                   "is reported).")] = 1,
    time_limit: Annotated[float | None, typer.Option("--time-limit", help="Overall "
                          "seconds (at least 0.1), shared out over the points; each reports "
                          "the best found.")
                          ] = None,
    workers: Annotated[int, typer.Option("--workers", min=0, help="Processes searching "
                       "points at once (0: one per CPU core for four points or more).")] = 0,
    output: Annotated[str | None, typer.Option("-o", "--output", "--report", help="Write "
                      "report.md or report.html (self-contained, with plots); --report as in "
                      "search and estimate.", callback=_path)] = None,
    stack: StackOpt = "current",
    as_json: JsonOpt = False,
) -> None:
    """Capacity planning: best plan, time and cost per cluster kind and GPU count."""
    from . import whatif as api_whatif
    from .planner.report import rows, write_report
    from .specs.loader import check_precision

    require_finite(tokens=tokens, days=days, budget=budget, time_limit=time_limit)
    require_range("--time-limit", time_limit, limits.MIN_TIME_LIMIT_S, math.inf,
                  "the seconds the sweep may take")
    try:
        prices = ([float(x) for x in csv_names(gpu_hour_price)] if gpu_hour_price is not None
                  else None)
    except ValueError:
        raise SpecError(f"--gpu-hour-price takes numbers separated by commas, got "
                        f"{limits.excerpt(gpu_hour_price)}.") from None
    for price in prices or []:
        require_finite(gpu_hour_price=price)
    limits.check("--top", top, limits.MAX_TOP_PLANS, "ask for fewer plans")
    limits.check("--workers", workers, limits.max_cpu_procs(),
                 f"use at most {limits.PROCS_PER_CORE} per CPU core (0: one per core)")
    if output and Path(output).suffix.lower() not in (".md", ".html", ".htm"):
        raise SpecError(f"-o {limits.clip(output)}: the report is .md (Markdown) or .html "
                        "(self-contained HTML with plots).")
    if output:
        check_writable(output)
    clusters, precisions = csv_names(cluster), csv_names(precision) or ["bf16"]
    precisions = [check_precision(p, allow_auto=True) for p in precisions]
    gpu_counts = csv_ints(gpus, "--gpus", limits.MAX_GPUS)
    seqs = csv_ints(seq, "--seq", limits.MAX_SEQ_LEN) or [4096]
    batches = csv_ints(gbs, "--gbs", limits.MAX_GLOBAL_BATCH)
    points = (len(clusters) * len(gpu_counts or [1]) * len(seqs) * len(batches or [1])
              * len(precisions))
    limits.check("sweep points (clusters × --gpus × --seq × --gbs × --precision)", points,
                 limits.MAX_SWEEP_POINTS, "sweep fewer values at once")
    with progress_line() as bar:
        # a point's result is kept when piped; "searching" notices only as a heartbeat
        res = api_whatif(model, clusters, gpu_counts,
                         seqs=seqs, gbs=batches,
                         precisions=precisions, tokens=tokens,
                         gpu_hour_price=prices, days=days, budget_usd=budget, top_k=top,
                         time_limit_s=time_limit, workers=workers, stack=stack,
                         progress=lambda msg: bar.update(msg, force=not msg.endswith("searching")))
        bar.done(f"whatif: 100%, {plural(len(res.points), 'point')} in {res.seconds:.1f} s")
    if output:
        err.print(f"wrote {write_report(res, output)}", highlight=False, markup=False)

    def render() -> None:
        from .planner.report import answers, whatif_notices
        from .specs.plan import token_words

        table = rows(res)
        cols = [WHATIF_COLUMNS.get(c, Column(c, fold=0)) for c in (table[0] if table else {})]
        width = _width(out)
        print_lines(table_lines(
            f"{res.model}: {token_words(res.tokens)} tokens, {plural(len(res.points), 'point')} "
            f"({res.seconds:.1f} s); ★ Pareto front (time vs "
            f"{'cost' if res.priced else 'GPU-hours'})", cols, [list(r.values()) for r in table],
            width, ["bold" if p.pareto else ("dim" if not p.fits else None)
                    for p in res.points]))
        for line in [*answers(res), priced_on(res.stack)]:
            print_lines([Line(s) for s in wrap(line, width, "  ")])
        for notice in whatif_notices(res):  # what the reports put first, said here too
            if notice.level != "bad":  # "nothing fits" is the exit-3 paragraph below
                level = {"warn": "warning", "info": "note"}.get(notice.level, notice.level)
                print_lines([Line(s) for s in wrap(f"{level}: {notice.head} "
                                                   f"{notice.text}", width, "  ")])

    emit(res.to_json(), as_json, render)
    if not res.any_fits:
        raise InfeasibleError("no point of the sweep fits; each point's `why` says what came "
                              "closest.")


@app.command(short_help="Train under a plan with torchrun workers.")
def run(
    plan: Annotated[str, typer.Argument(help="Plan JSON (from search/estimate -o).")],
    steps: Annotated[int | None, typer.Option(
        "--steps", help="Step to reach (default: --train-iters, or the plan's train_iters, "
        "else 10).")] = None,
    data: Annotated[str | None, typer.Option(
        "--data", help="Megatron indexed datasets: a PREFIX (PREFIX.bin + PREFIX.idx) or a blend "
        "\"0.7 PREFIX_A 0.3 PREFIX_B\" (make one with `moeplan data prepare`), or 'synthetic' "
        "(seeded Markov chain, the default).")] = None,
    split: Annotated[str | None, typer.Option(
        "--split", help="Train,valid,test weights of each dataset, by sequence (Megatron's "
        "--split; default 969,30,1).")] = None,
    valid_data: Annotated[str | None, typer.Option(
        "--valid-data", "--valid-data-path", help="Validation datasets read whole (a prefix "
        "or a blend, as Megatron's --valid-data-path); --data then trains on all of its "
        "datasets unless --split says otherwise.")] = None,
    tokenizer_model: Annotated[str | None, typer.Option(
        "--tokenizer-model", help="The data's Hugging Face tokenizer (tokenizer.json or a "
        "directory holding one): vocabulary checked against the model's, kept with the "
        "checkpoints and exported with them.")] = None,
    config: Annotated[str | None, typer.Option(
        "--config", help="A YAML/JSON file of the settings below under the flags' names "
        "(lr, lr-warmup-iters, data, eval-interval, ...); flags given here win.")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="Peak learning rate.")] = None,
    min_lr: Annotated[float | None, typer.Option(
        "--min-lr", help="Learning rate at the end of the decay.")] = None,
    lr_warmup_iters: Annotated[int | None, typer.Option(
        "--lr-warmup-iters", help="Linear warm-up iterations.")] = None,
    lr_decay_style: Annotated[str | None, typer.Option(
        "--lr-decay-style", help="constant, linear, cosine or WSD.")] = None,
    lr_decay_iters: Annotated[int | None, typer.Option(
        "--lr-decay-iters", help="Iteration the decay ends at (default: --train-iters).")] = None,
    lr_wsd_decay_style: Annotated[str | None, typer.Option(
        "--lr-wsd-decay-style", help="WSD's final decay: linear, cosine, exponential or "
        "minus_sqrt.")] = None,
    lr_wsd_decay_iters: Annotated[int | None, typer.Option(
        "--lr-wsd-decay-iters", help="WSD: iterations of the final decay.")] = None,
    weight_decay: Annotated[float | None, typer.Option(
        "--weight-decay", help="Decoupled weight decay.")] = None,
    clip_grad: Annotated[float | None, typer.Option(
        "--clip-grad", help="Global gradient-norm clip (0: off).")] = None,
    train_iters: Annotated[int | None, typer.Option(
        "--train-iters", help="Iterations of the whole run (the schedule's length).")] = None,
    train_tokens: Annotated[float | None, typer.Option(
        "--train-tokens", help="Tokens of the whole run, instead of --train-iters (e.g. "
        "1e9).")] = None,
    eval_interval: Annotated[int | None, typer.Option(
        "--eval-interval", help="Steps between evaluations on the validation split (and at the "
        "last step); default: none.")] = None,
    eval_iters: Annotated[int | None, typer.Option(
        "--eval-iters", help=f"Global batches per evaluation (default {EVAL_ITERS}); without "
        "--eval-interval, one evaluation at the last step.")] = None,
    log_interval: Annotated[int | None, typer.Option(
        "--log-interval", help="Steps between progress lines (metrics.jsonl has every step; "
        "default 1).")] = None,
    tensorboard_dir: Annotated[str | None, typer.Option(
        "--tensorboard-dir", help="Write TensorBoard event files here (loss, lr, grad norm, "
        "throughput, MFU, memory, expert load).", callback=_path)] = None,
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Same seed: same data and weights (default 0).")] = None,
    dtype: Annotated[str | None, typer.Option(
        "--dtype", help="fp32|bf16 (default: bf16 on GPU, fp32 on CPU).")] = None,
    out_dir: Annotated[str | None, typer.Option(
        "--out", help="Output directory (default runs/PLAN-STEM).", callback=_path)] = None,
    scale_down: Annotated[bool, typer.Option(
        "--scale-down", help="Shrink the model and batch, keeping every parallel degree.")] = False,
    nproc_per_node: Annotated[int | None, typer.Option(
        "--nproc-per-node", help="Workers on this node (default: the plan's world size).")] = None,
    nnodes: Annotated[int, typer.Option("--nnodes", help="Nodes taking part.")] = 1,
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="This node's rank.")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(
        "--rdzv-endpoint", help="HOST:PORT, the same on every node (multi-node).")] = None,
    rdzv_backend: Annotated[str, typer.Option("--rdzv-backend", help="torchrun rendezvous.")] = (
        "c10d"),
    rdzv_id: Annotated[str | None, typer.Option("--rdzv-id", help="Job id for rendezvous.")] = None,
    ckpt_dir: Annotated[str | None, typer.Option(
        "--ckpt-dir", help="Checkpoint directory (sharded, atomic, checksummed).")] = None,
    ckpt_every: Annotated[int, typer.Option("--ckpt-every", help="Steps between checkpoints.")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint.")] = (
        False),
    max_restarts: Annotated[int, typer.Option(
        "--max-restarts", help="torchrun restarts of failed workers.")] = 0,
    ckpt_keep: Annotated[int, typer.Option(
        "--ckpt-keep", help="Complete checkpoints kept (0: all).")] = 3,
    max_nonfinite_steps: Annotated[int, typer.Option(
        "--max-nonfinite-steps", help="NaN/inf steps in a row skipped before the run stops.")
                                   ] = 3,
    distributed_timeout_minutes: Annotated[float, typer.Option(
        "--distributed-timeout-minutes", help="Minutes a collective waits for a peer (a hung "
        "rank) before the run fails, as Megatron's flag.")] = DIST_TIMEOUT_MINUTES,
    cluster: Annotated[str | None, typer.Option(
        "--cluster", help="This machine as a ClusterSpec (preset or `moeplan calibrate -o` "
        "file), for the predictions a --scale-down run is compared with.")] = None,
    init_from: Annotated[str | None, typer.Option(
        "--init-from", help="Start from a Hugging Face checkpoint directory (config.json + "
        "*.safetensors); each rank reads only its own slices.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Train under a plan with torchrun workers (gloo on CPU, NCCL on GPU)."""
    if out_dir is not None:
        _check_out_dir(out_dir)
    from .runtime.settings import read_config

    training, options = read_config(config) if config else ({}, {})
    training.update({k: v for k, v in dict(
        lr=lr, min_lr=min_lr, lr_warmup_iters=lr_warmup_iters, lr_decay_style=lr_decay_style,
        lr_decay_iters=lr_decay_iters, lr_wsd_decay_style=lr_wsd_decay_style,
        lr_wsd_decay_iters=lr_wsd_decay_iters, weight_decay=weight_decay, clip_grad=clip_grad,
        train_iters=train_iters, train_tokens=train_tokens).items() if v is not None})
    if train_iters is not None or train_tokens is not None:  # a flag replaces the file's either
        training.pop("train_tokens" if train_iters is not None else "train_iters", None)
    options.update({k: v for k, v in dict(
        steps=steps, seed=seed, data=data, split=split, valid_data=valid_data,
        tokenizer_model=tokenizer_model,
        eval_interval=eval_interval, eval_iters=eval_iters, log_interval=log_interval,
        tensorboard_dir=tensorboard_dir).items() if v is not None})
    require_torch("moeplan run")
    from .runtime.launch import run as run_plan

    # RunFailed (workers failed) and RunStopped (a signal stopped them) reach main's table; a
    # stop with a summary prints it under --json too (one document on stdout, exit 75/130)
    stopped: RunStopped | None = None
    with _stdout_to_stderr(as_json):  # --json: the workers' logs must not mix into stdout
        try:
            summary = run_plan(
                plan, dtype=dtype, out=out_dir, scale_down=scale_down,
                nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                rdzv_endpoint=rdzv_endpoint, rdzv_backend=rdzv_backend, rdzv_id=rdzv_id,
                ckpt_dir=ckpt_dir, ckpt_every=ckpt_every, resume=resume,
                max_restarts=max_restarts, ckpt_keep=ckpt_keep,
                max_nonfinite_steps=max_nonfinite_steps,
                distributed_timeout_minutes=distributed_timeout_minutes, cluster=cluster,
                init_from=init_from,
                training=training or None, **options)
        except RunStopped as e:
            stopped = e
    if stopped is not None:
        if as_json and stopped.summary:
            emit(stopped.summary, True, lambda: None)
        raise stopped
    if not summary:  # a worker inside someone else's launch: rank 0 of the launch reports
        return

    def render() -> None:
        meas, pred = summary["measured"], summary["predicted"] or {}
        if not meas:  # a restart that resumed at the last step: nothing left to measure
            print_lines(pairs_lines(f"moeplan run: {summary['model']}", [
                ("measured", "nothing (no step left to train)")], _width(err)), err)
            for note in summary.get("notes", []):
                err.print(f"note: {note}", highlight=False, markup=False)
            return
        pairs = []
        for key, label, fmt in (("step_time_s", "step time (s)", "{:.4g}"),
                                ("tokens_per_s_per_gpu", "tokens/s/GPU", "{:,.0f}"),
                                ("tflops_per_gpu", "TFLOPS/GPU", "{:.3g}"),
                                ("peak_mem_gb", "peak memory (GB)", "{:.3g}")):
            pred_s = fmt.format(pred[key]) if pred.get(key) is not None else "—"
            pairs.append((label, f"{_shown(meas.get(key), fmt)} measured, {pred_s} predicted"))
        pairs.append(("loss", f"{_shown(meas.get('first_loss'), '{:.4f}')} → "
                              f"{_shown(meas.get('final_loss'), '{:.4f}')}"))
        print_lines(pairs_lines(f"moeplan run: {summary['model']}", pairs, _width(err)), err)
        band, inside = pred.get("step_time_interval_s"), summary.get("inside_interval")
        if band and inside is not None:  # null: priced for another kind of device (a note)
            where = "inside" if inside else "outside"
            print_lines([Line(x) for x in wrap(
                f"measured step time {meas['step_time_s']:.3g} s is {where} the plan's 80% "
                f"interval {band[0]:.3g}–{band[1]:.3g} s", _width(out), "  ")])
        for note in summary.get("notes", []):
            err.print(f"note: {note}", highlight=False, markup=False)

    emit(summary, as_json, render)


def _shown(value: float | None, fmt: str) -> str:
    """A measured figure for the run's summary; a loss that was NaN or infinite is recorded as
    null (`fsio.finite_or_null`) and shown as such."""
    if value is None:
        return "not finite"
    return fmt.format(value)


def require_torch(command: str) -> None:
    """Exit 2 with what to install when torch is missing: the planner never needs it, so a
    planner-only install (`pip install moeplan`) is normal, not broken. Found, not imported:
    the launcher itself runs no torch (its workers do), and importing it costs seconds."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a half-imported torch
        found = False
    if not found:
        raise TorchMissing(command)


@contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """Point file descriptor 1 at stderr (children inherit it) while the block runs."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _check_out_dir(out_dir: str) -> None:
    """`run --out`: refuse a path that is, or lies under, an existing non-directory."""
    path = Path(out_dir)
    for p in (path, *path.parents):
        try:
            if p.exists() and not p.is_dir():
                raise SpecError(f"--out {limits.clip(out_dir)}: {p} is a file, not a directory. "
                                "Give a directory (it is created if missing).")
        except (OSError, ValueError) as err:
            raise SpecError(f"--out {limits.clip(out_dir)}: not a usable directory ({err}). "
                            "Give another directory.") from None
        if p.exists():
            return


@app.command(short_help="Print a layout's process groups.")
def groups(
    ctx: typer.Context,
    plan: Annotated[str | None, typer.Argument(help="Plan JSON; or give the sizes.")] = None,
    gpus: Annotated[int | None, typer.Option("--gpus", help="World size.")] = None,
    tp: TpOpt = 1,
    cp: CpOpt = 1,
    pp: PpOpt = 1,
    ep: EpOpt = 1,
    etp: EtpOpt = 1,
    order: Annotated[str, typer.Option("--order", help="tp-cp-ep-dp-pp or tp-cp-ep-pp-dp.")] = (
        "tp-cp-ep-dp-pp"),
    as_json: JsonOpt = False,
) -> None:
    """Print the process groups of a layout (identical to Megatron Core's)."""
    from . import groups as layout_groups

    extra = ignored_flags(ctx, frozenset({"plan", "as_json"})) if plan is not None else []
    if extra:
        raise SpecError(f"{', '.join(extra)}: the plan holds its own layout, so these would be "
                        "ignored; drop them, or give the sizes without a plan.")
    if plan is None and gpus is not None:
        if gpus <= 0:
            raise SpecError(f"--gpus {gpus}: the world size must be a positive whole number.")
        limits.check("--gpus", gpus, limits.MAX_GPUS, "print the groups of a smaller layout")
    doc = layout_groups(plan, gpus=gpus, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)

    def render() -> None:
        pairs = []
        for axis, members in doc.items():
            shown = " ".join(str(g).replace(", ", ",") for g in members[:16])
            more = f" … ({len(members)} groups)" if len(members) > 16 else ""
            pairs.append((axis, shown + more))
        print_lines(pairs_lines("process groups (global ranks)", pairs, _width(out)))

    emit(doc, as_json, render)


@app.command(short_help="Export a plan as a Megatron-LM or torchrun launch.")
def export(
    plan: Annotated[str, typer.Argument(help="Plan JSON written by `search -o` or `estimate -o`.")],
    fmt: Annotated[str, typer.Option(
        "--format", help="megatron (pretrain_gpt.py flags), torchrun (launch line for "
        "`moeplan run`) or slurm (sbatch script).")] = "megatron",
    nnodes: Annotated[int | None, typer.Option("--nnodes", help="Nodes to launch on.")] = None,
    nproc_per_node: Annotated[int | None, typer.Option(
        "--nproc-per-node", help="Processes (GPUs) per node; default: the cluster's GPUs per "
        "node.")] = None,
    train_iters: Annotated[int | None, typer.Option(
        "--train-iters", min=1, help="megatron: iterations to train; warm-up and decay keep "
        "their TrainingSpec fractions.")] = None,
    train_tokens: Annotated[float | None, typer.Option(
        "--train-tokens", help="megatron: tokens to train (e.g. 1e12), as iterations at the "
        "plan's global batch.")] = None,
    flags_only: Annotated[bool, typer.Option(
        "--flags-only", help="megatron: print the pretrain_gpt.py flags alone, without the "
        "environment and the torchrun line.")] = False,
    log_interval: Annotated[int, typer.Option("--log-interval", help="megatron: iterations "
                                              "between log lines.")] = 10,
    save_interval: Annotated[int | None, typer.Option(
        "--save-interval", help="megatron: iterations between checkpoints (default 1,000, or "
        "the run's length if shorter).")] = None,
    eval_interval: Annotated[int | None, typer.Option(
        "--eval-interval", help="megatron: iterations between evaluations (default: at each "
        "checkpoint).")] = None,
    eval_iters: Annotated[int, typer.Option("--eval-iters", help="megatron: validation "
                                            "iterations per evaluation.")] = 10,
    as_json: JsonOpt = False,
) -> None:
    """Export a plan as a Megatron-LM launch, a torchrun line or a Slurm script.

    Each format first checks the plan against its executor's rules and exits 2 naming any it
    breaks. Warnings (plan choices Megatron cannot express exactly) go to stderr.
    """
    from . import export as export_plan
    from .planner.export import Cadence

    if flags_only and fmt.lower() != "megatron":
        raise SpecError(f"--flags-only prints pretrain_gpt.py's flags, which only --format "
                        f"megatron has; drop it with --format {limits.clip(fmt)}.")
    doc = export_plan(plan, fmt.lower(), nnodes=nnodes, nproc_per_node=nproc_per_node,
                      train_iters=train_iters, train_tokens=train_tokens,
                      cadence=Cadence(log_interval, save_interval, eval_interval, eval_iters))
    for w in doc.get("warnings", []):
        err.print(f"warning: {w}", markup=False, highlight=False, soft_wrap=True)

    def render() -> None:
        if doc["format"] == "megatron" and flags_only:
            from .planner.export import format_megatron

            # the flags alone on stdout, to paste after `pretrain_gpt.py \` or take in $(…);
            # what to set before running goes to stderr
            for c in doc["comments"]:
                err.print(f"# {c}", markup=False, highlight=False, soft_wrap=True)
            sys.stdout.write(format_megatron(doc["args"]) + "\n")
        elif doc["format"] == "megatron":
            sys.stdout.write(doc["launch"])
        else:
            sys.stdout.write(doc["script"])

    emit(doc, as_json, render)


@app.command(short_help="Measure this machine, or refit from runs.")
def calibrate(
    runs: Annotated[list[str] | None, typer.Argument(
        metavar="[DIR]...", help="More run directories for --from-runs.")] = None,
    output: Annotated[str | None, typer.Option(
        "-o", "--output", help="Write the ClusterSpec YAML here (default: print it; with "
        "--from-runs, only the table prints and nothing is written without -o).",
        callback=_path)] = None,
    quick: Annotated[bool | None, typer.Option(
        "--quick/--full", help="Small grid, under two minutes (default on CPU) or the full one "
        "(default on GPU).")] = None,
    nproc: Annotated[int | None, typer.Option(
        "--nproc", min=1, help="Processes (devices) to describe and run collectives between "
        "(default: GPUs present, or min(4, CPU cores) on CPU).")] = None,
    dtype: Annotated[str | None, typer.Option(
        "--dtype", help="Compute dtype the constants describe, as `moeplan run --dtype` "
        "(default: fp32 on CPU, bf16 on GPU).")] = None,
    from_runs: Annotated[list[str] | None, typer.Option(
        "--from-runs", help="Refit constants from these `moeplan run --out` directories "
        "(or folders holding them) instead of microbenchmarking.")] = None,
    eval_runs: Annotated[list[str] | None, typer.Option(
        "--eval", help="With --from-runs: runs predicted with the refit constants but not "
        "fitted (held out).")] = None,
    prior_weight: Annotated[float, typer.Option(
        "--prior-weight", help="With --from-runs: pull of each constant toward its "
        f"starting value, from 0 (plain least squares) to {limits.MAX_PRIOR_WEIGHT:g}.")
        ] = 0.05,
    fit: Annotated[str | None, typer.Option(
        "--fit", help="With --from-runs: constants to fit, from compute_scale, comm_scale, "
        "layer_overhead_s, step_overhead_s (default: all four).")] = None,
    grid: Annotated[str | None, typer.Option("--grid", hidden=True)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Measure this machine and write a calibrated ClusterSpec, or refit it from measured runs."""
    require_finite(prior_weight=prior_weight)
    require_range("--prior-weight", prior_weight, 0.0, limits.MAX_PRIOR_WEIGHT,
                  "the pull toward the starting constants", f"at {limits.MAX_PRIOR_WEIGHT:g} "
                  "every constant already stays where it started")
    if output:
        check_writable(output)
    if runs and not from_runs:
        raise SpecError(f"unexpected argument {runs[0]!r}: run directories follow --from-runs "
                        "(moeplan calibrate --from-runs DIR [DIR ...]).")
    if from_runs:
        _calibrate_from_runs([*from_runs, *(runs or [])], eval_runs or [], output,
                             prior_weight, csv_names(fit), as_json)
        return
    for flag, value in (("--eval", eval_runs), ("--fit", fit)):
        if value:
            raise SpecError(f"{flag} needs --from-runs (the runs the constants are fitted on); "
                            "without it calibrate measures this machine instead.")
    import yaml

    from .calibrate import calibrate_machine, machine_options, write_cluster_yaml

    opts = machine_options(nproc, dtype, quick, grid)
    mode, n = opts.mode, opts.nproc
    name = Path(output).stem if output else "local"
    doc, report = calibrate_machine(mode, n, dtype, name,
                                    progress=lambda s: err.print(f"calibrate: {s}",
                                                                 highlight=False))
    if output:
        write_cluster_yaml(doc, output, f" {opts.flag} on {plural(n, 'process', 'processes')}")
        err.print(f"wrote {output} ({report['seconds']['total']:.1f} s)", highlight=False)

    def render() -> None:
        preset = report.get("preset")
        title = f"{doc['gpu']}" + (f" (preset {preset})" if preset else "")
        t = Table(title=_table_title(f"{title}: {plural(n, 'device')}, {report['dtype']} compute, "
                                     f"{mode} grid ({report['seconds']['total']:.1f} s)", err),
                  show_header=False)
        t.add_row("peak TFLOPS bf16 / fp32", f"{doc['bf16_tflops']:.4g} / "
                  f"{doc['fp32_tflops']:.4g}" + (" (datasheet bf16)" if preset else ""))
        c = doc["calibration"]
        arch = doc["architecture"]
        t.add_row("GEMM eff_max / half_dim", f"{c['gemm_eff_max'][arch]:.3g} / "
                  f"{c['gemm_half_dim']:.4g}")
        t.add_row("attention eff fwd / bwd", f"{c['attn_fwd_eff'][arch]:.3g} / "
                  f"{c['attn_bwd_eff'][arch]:.3g}")
        t.add_row("memory GB/s (eff)", f"{doc['hbm_tb_s'] * 1e3:.4g} ({c['hbm_eff']:.3g})")
        if not report.get("collectives"):
            t.add_row("link", "one process: no collectives measured ("
                      + ("the preset's constants)" if preset else "the copy bandwidth stands "
                         "in)"))
        elif "nvlink_eff" in c:
            t.add_row("link GB/s, α µs", f"{doc['nvlink_gb_s']:.4g} × {c['nvlink_eff']:.3g}, "
                      f"{doc['nvlink_latency_us']:.4g} (all-to-all eff "
                      f"{c['a2a_nvlink_eff']:.3g})")
        if "grouped_gemm" in doc["sources"]:
            t.add_row("grouped GEMM", doc["sources"]["grouped_gemm"].split(";")[0])
        t.add_row("overhead per layer / step", f"{c.get('layer_overhead_s', 0) * 1e3:.3g} ms / "
                  f"{c.get('step_overhead_s', 0) * 1e3:.3g} ms")
        err.print(t)
        if not output:
            sys.stdout.write(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True,
                                            width=100))

    emit({"cluster": doc, "measured": report}, as_json, render)


def _table_title(title: str, console: Console) -> str | Text:
    """A rich table's title: on a terminal rich wraps it at the table's width; piped, one line
    (a log line split at the table's width reads as two records)."""
    if console.is_terminal:
        return title
    return Text(title, style="table.title", no_wrap=True, overflow="ignore")


def _calibrate_from_runs(paths: list[str], eval_paths: list[str], output: str | None,
                         prior_weight: float, fit: list[str], as_json: bool) -> None:
    """`moeplan calibrate --from-runs`: refit, report per-run error, write the constants."""
    from .calibrate import calibrate_from_runs

    res, written = calibrate_from_runs(paths, eval_paths, prior_weight, fit, output)
    for w in res["warnings"]:  # --json or not: stderr is for logs
        err.print(f"warning: {w}", markup=False, highlight=False)
    for path in written:
        err.print(f"wrote {path}", highlight=False)

    def pct(x: float) -> str:
        return f"{x:+.1%}"

    def render() -> None:  # laid out by moeplan.terminal: a narrow screen folds, never cuts
        width = _width(out)
        cols = [Column("run"), Column("split", fold=0), Column("measured s", right=True),
                Column("before s", right=True, fold=1),
                Column("error before", right=True, fold=2), Column("after s", right=True),
                Column("error after", right=True)]
        body = [[Path(r["path"]).name, r["split"], f"{r['measured_s']:.4g}",
                 f"{r['before_s']:.4g}", pct(r["before_error"]), f"{r['after_s']:.4g}",
                 pct(r["after_error"])] for r in res["runs"]]
        print_lines(table_lines("step time, predicted against measured", cols, body, width))
        f = res["fitted"]
        notes = [f"fitted: compute scale {f['compute_scale']:.3g}, comm scale "
                 f"{f['comm_scale']:.3g}, layer overhead {f['layer_overhead_s'] * 1e3:.3g} ms, "
                 f"step overhead {f['step_overhead_s'] * 1e3:.3g} ms"]
        notes += [f"mean |log error| {split}: {e['before']:.3f} → {e['after']:.3f}"
                  for split, e in res["mean_abs_log_error"].items() if e["before"] is not None]
        for note in notes:
            print_lines([Line(x) for x in wrap(note, width, "  ")])

    emit(res, as_json, render)


# ----------------------------------------------------------------------------------------- main
def _one_paragraph(msg: str) -> str:
    """One line, and never more than a few lines' worth: messages quote excerpts of the input,
    and this cap holds even where one does not."""
    return limits.clip(" ".join(str(msg).split()), 2000)


@checkpoint_app.command("list")
def checkpoint_list(
    ckpt_dir: Annotated[str, typer.Argument(help="A --ckpt-dir of `moeplan run`.")],
    as_json: JsonOpt = False,
) -> None:
    """Every step: usable or not (the rule --resume and export use), its model and layout."""
    from .runtime.storage import list_checkpoints  # JSON only: no torch to start

    rows = list_checkpoints(ckpt_dir)

    def render() -> None:
        width = _width(out)
        if not rows:
            out.print(f"no checkpoint in {ckpt_dir}", highlight=False)
            return
        print_lines(table_lines(
            "checkpoints, oldest first",
            [Column("step"), Column("state"), Column("model", fold=2),
             Column("layout", fold=1), Column("problem", fold=0)],
            [[str(r["step"]) + (" (newest)" if r["newest"] else ""), r["state"],
              r["model"] if r["usable"] else "—", r["layout"] if r["usable"] else "—",
              r["problem"] or "—"] for r in rows], width,
            [None if r["usable"] else "bold red" for r in rows]))
        newest = next(r for r in rows if r["newest"]) if any(r["newest"] for r in rows) else None
        if newest is None:
            said = "no step is a checkpoint: --resume starts afresh and export has nothing"
        elif newest["usable"]:
            said = f"--resume and checkpoint export take step {newest['step']}"
        else:
            usable = [r["step"] for r in rows if r["usable"]]
            said = (f"the newest step, {newest['step']}, is {newest['state']}: --resume and "
                    "export refuse it" + (f"; export an earlier one with --step {usable[-1]}"
                                          if usable else ""))
        print_lines([Line(s, "dim") for s in wrap(said, width, "  ")])

    emit({"checkpoints": rows}, as_json, render)


@checkpoint_app.command("export")
def checkpoint_export(
    ckpt_dir: Annotated[str, typer.Argument(help="A --ckpt-dir of `moeplan run`.")],
    to: Annotated[str, typer.Option("--to", help="Target format: hf (Hugging Face).")],
    output: Annotated[str, typer.Option("-o", "--output", help="New directory to write.",
                                        callback=_path)],
    step: Annotated[int | None, typer.Option("--step", help="Step (default: newest).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a checkpoint as config.json + sharded safetensors that transformers loads."""
    if to != "hf":
        raise SpecError(f"--to takes hf (Hugging Face), got {to!r}.")
    from .runtime.checkpoint import export_checkpoint

    path, exported = export_checkpoint(ckpt_dir, output, step)
    emit({"path": str(path), "step": exported}, as_json, lambda: err.print(
        f"wrote {path} from step {exported} (load it with "
        "AutoModelForCausalLM.from_pretrained)", highlight=False))


@data_app.command("prepare")
def data_prepare(
    inputs: Annotated[list[str], typer.Argument(
        help="Text files, or JSONL files (.jsonl/.json: one object per line).")],
    tokenizer_model: Annotated[str, typer.Option(
        "--tokenizer-model", help="A Hugging Face tokenizer.json, or a directory holding one.")],
    output: Annotated[str, typer.Option(
        "-o", "--output-prefix", help="Writes PREFIX.bin and PREFIX.idx (pass PREFIX to "
        "`run --data`).", callback=_path)],
    json_key: Annotated[str, typer.Option(
        "--json-key", help="The JSONL field holding a document's text.")] = "text",
    document_per: Annotated[str, typer.Option(
        "--document-per", help="Text files: one document per file, line or paragraph (blank-"
        "line separated).")] = "file",
    workers: Annotated[int, typer.Option(
        "--workers", help="Tokenizer processes (default: the CPU count, at most 8).",
        show_default=False)] = 0,
    append_eod: Annotated[bool, typer.Option(
        "--append-eod/--no-append-eod", help="End each document with the end-of-document "
        "token (Megatron's --append-eod).")] = True,
    eod_token: Annotated[str | None, typer.Option(
        "--eod-token", help="The end-of-document token (default: tokenizer_config.json's "
        "eos_token, else a usual name such as <|endoftext|>).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Tokenize text or JSONL with a Hugging Face tokenizer into a Megatron indexed dataset."""
    from .data.prepare import ProgressLine, prepare

    if eod_token is not None and not append_eod:
        raise SpecError("--eod-token names the token appended to each document, and "
                        "--no-append-eod appends none; give one or the other.")
    n = workers or min(8, os.cpu_count() or 1)
    bar = ProgressLine(f"tokenizing with {n} process{'es' if n > 1 else ''}")
    try:
        res = prepare(inputs, tokenizer_model, output, json_key=json_key, workers=n,
                      append_eod=append_eod, eod_token=eod_token, document_per=document_per,
                      progress=bar)
    finally:
        bar.close()
    doc = res.record()

    def render() -> None:
        print_lines(pairs_lines(f"wrote {res.prefix}.bin and {res.prefix}.idx", [
            ("documents", f"{res.documents:,}"), ("tokens", f"{res.tokens:,}"),
            ("token dtype", res.dtype), ("vocabulary", f"{res.vocab_size:,}"),
            ("end of document", res.eod_token or "not appended"),
            ("time", f"{res.seconds:.1f} s"),
            ("train on it", f"moeplan run PLAN --data {shlex.quote(str(res.prefix))} "
                            f"--tokenizer-model {shlex.quote(str(tokenizer_model))}")],
            _width(err)), err)

    emit(doc, as_json, render)


LABEL_STYLES = {"error": "bold red", "infeasible": "bold yellow"}


def report_error(exc: BaseException) -> int:
    """Print `exc` as its one line on stderr and return its exit code, both from EXIT_CODES."""
    rule = exit_rule(exc)
    assert rule is not None
    _, label = rule
    text = escape(_one_paragraph(str(exc)))
    if isinstance(exc, KeyboardInterrupt):
        text = "interrupted"
    if label:
        text = f"[{LABEL_STYLES[label]}]{label}:[/] {text}"
    if text:
        err.print(text, highlight=False, soft_wrap=True)
    return exit_code(exc)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and map every error type onto its exit code through one table
    (`moeplan.errors.EXIT_CODES`: 2 invalid input, 3 infeasible, a run's own code, 130
    interrupted); `--debug` shows the traceback instead.

    Typer itself reports usage errors (unknown flag, bad value) with exit code 2.
    """
    if os.environ.get("MOEPLAN_START_PID") != str(os.getpid()):  # inherited, or none: ours now
        os.environ["MOEPLAN_START_PPID"] = str(os.getppid())
        os.environ["MOEPLAN_START_PID"] = str(os.getpid())
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        app(args=args, prog_name="moeplan")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except (Exception, KeyboardInterrupt) as e:
        # unlisted types are bugs: their traceback shows; --debug shows one for bad input too,
        # but a run keeps its own exit code (75 tells a scheduler to requeue)
        if exit_rule(e) is None or (debug and isinstance(e, (MoeplanError, InfeasibleError))):
            raise
        code = report_error(e)
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
