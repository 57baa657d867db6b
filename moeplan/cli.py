"""The `moeplan` command: parse, call the public API, render (rich table or one JSON document).

Errors are mapped to exit codes in one place (`main`): MoeplanError → 2 with one paragraph on
stderr, InfeasibleError → 3; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from . import specs as S
from .errors import InfeasibleError, MoeplanError, NotYetAvailable, SpecError

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

out = Console()
err = Console(stderr=True)
_state = {"debug": False}

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def emit(data: Any, as_json: bool, render: Callable[[], None]) -> None:
    """Print `data` as one JSON document, or call `render` for the human view."""
    if as_json:
        if hasattr(data, "model_dump"):
            data = data.model_dump(mode="json")
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        render()


def csv_ints(value: str | None, flag: str) -> list[int] | None:
    """Parse '64,128,256' or '64-256' (powers of two in between) into ints, with a clear error."""
    if value is None:
        return None
    try:
        if "-" in value and "," not in value:
            lo, hi = (int(x) for x in value.split("-"))
            vals, n = [], lo
            while n <= hi:
                vals.append(n)
                n *= 2
        else:
            vals = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"{flag} takes whole numbers separated by commas (e.g. 64,128) or a "
                        f"range lo-hi, got {value!r}.") from None
    if not vals or any(v <= 0 for v in vals):
        raise SpecError(f"{flag} takes positive whole numbers, got {value!r}.")
    return vals


def csv_names(value: str | None) -> list[str]:
    return [x.strip() for x in (value or "").split(",") if x.strip()]


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    _state["debug"] = debug


# ---------------------------------------------------------------------------------------- specs
def _spec_document(ref: str, seq: int) -> dict[str, Any]:
    """{"name", "kind", "spec", "derived"} for a model or cluster preset/file (SPEC §4)."""
    presets = S.list_presets()
    if ref in presets["clusters"] or (ref not in presets["models"] and _looks_like_cluster(ref)):
        c = S.load_cluster(ref)
        return {"name": c.name, "kind": "cluster", "spec": c.model_dump(mode="json"),
                "derived": {}}
    m = S.load_model(ref)
    return {
        "name": m.name,
        "kind": "model",
        "spec": m.model_dump(mode="json"),
        "derived": {
            "total_params": m.total_params(),
            "active_params": m.active_params(),
            "flops_per_token": m.flops_per_token(seq),
        },
    }


def _looks_like_cluster(ref: str) -> bool:
    path = Path(ref)
    if not path.is_file():
        return False
    data = S.loader.read_document(path)
    return isinstance(data, dict) and "bf16_tflops" in data


@specs_app.command("list")
def specs_list(as_json: JsonOpt = False) -> None:
    """List the model and cluster presets."""
    presets = S.list_presets()

    def render() -> None:
        t = Table("kind", "presets")
        t.add_row("models", ", ".join(presets["models"]))
        t.add_row("clusters", ", ".join(presets["clusters"]))
        out.print(t)

    emit(presets, as_json, render)


@specs_app.command("show")
def specs_show(
    ref: Annotated[str, typer.Argument(help="Preset name, spec file or Hugging Face config.json.")],
    seq: Annotated[int, typer.Option("--seq", min=1, help="Sequence length for FLOPs.")] = 4096,
    as_json: JsonOpt = False,
) -> None:
    """Show a spec with its derived parameter counts and FLOPs per token."""
    doc = _spec_document(ref, seq)

    def render() -> None:
        t = Table(title=f"{doc['kind']} {doc['name']}", show_header=False)
        for k, v in doc["spec"].items():
            if v not in (None, {}, []):
                t.add_row(k, str(v))
        d = doc["derived"]
        if d:
            t.add_row("[b]total params", f"{d['total_params'] / 1e9:.2f} B")
            t.add_row("[b]active params", f"{d['active_params'] / 1e9:.2f} B")
            t.add_row(f"[b]FLOPs/token (s={seq})", f"{d['flops_per_token'] / 1e9:.1f} GFLOP")
        out.print(t)

    emit(doc, as_json, render)


@specs_app.command("validate")
def specs_validate(
    path: Annotated[str, typer.Argument(help="A ModelSpec/ClusterSpec/TrainingSpec/Plan file.")],
    as_json: JsonOpt = False,
) -> None:
    """Check a spec file; exits 2 with the offending field when it is invalid."""
    p = Path(path)
    data = S.loader.read_document(p) if p.is_file() else None
    if data is None:
        raise SpecError(f"{path} is not a readable file. Pass the path of a YAML/JSON spec.")
    if isinstance(data, dict) and {"model", "cluster", "layout"} <= data.keys():
        kind, name = "plan", S.load_plan(p).model.name
    elif isinstance(data, dict) and "bf16_tflops" in data:
        kind, name = "cluster", S.load_cluster(p).name
    elif isinstance(data, dict) and "global_batch_size" in data:
        kind, name = "training", p.stem
        S.load_training(p)
    else:
        kind, name = "model", S.load_model(p).name
    doc = {"valid": True, "kind": kind, "name": name, "path": str(p)}
    emit(doc, as_json, lambda: out.print(f"[green]valid[/] {kind} spec '{name}' ({p})"))


# ------------------------------------------------------------------------ not yet available
def _not_yet(command: str) -> None:
    raise NotYetAvailable(f"`moeplan {command}` is not yet available in this version; nothing "
                          "was run. `moeplan specs` works today.")


_STUB_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command(context_settings=_STUB_SETTINGS)
def estimate(ctx: typer.Context) -> None:
    """Predict step time, throughput and memory of one layout."""
    _not_yet("estimate")


@app.command(context_settings=_STUB_SETTINGS)
def validate(ctx: typer.Context) -> None:
    """Predict published runs and report the error per row."""
    _not_yet("validate")


@app.command(context_settings=_STUB_SETTINGS)
def search(ctx: typer.Context) -> None:
    """Search every folded layout and rank the best plans."""
    _not_yet("search")


@app.command(context_settings=_STUB_SETTINGS)
def whatif(ctx: typer.Context) -> None:
    """Capacity planning: best plan, time and cost per cluster kind and GPU count."""
    _not_yet("whatif")


@app.command(context_settings=_STUB_SETTINGS)
def run(ctx: typer.Context) -> None:
    """Train under a plan with torchrun workers."""
    _not_yet("run")


@app.command(context_settings=_STUB_SETTINGS)
def groups(ctx: typer.Context) -> None:
    """Print the process groups of a layout (identical to Megatron Core's)."""
    _not_yet("groups")


@app.command(context_settings=_STUB_SETTINGS)
def export(ctx: typer.Context) -> None:
    """Export a plan as Megatron-LM flags, a torchrun line or a Slurm script."""
    _not_yet("export")


@app.command(context_settings=_STUB_SETTINGS)
def calibrate(ctx: typer.Context) -> None:
    """Measure this machine and write a calibrated ClusterSpec."""
    _not_yet("calibrate")


# ----------------------------------------------------------------------------------------- main
def _one_paragraph(msg: str) -> str:
    return " ".join(str(msg).split())


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and map our exceptions onto exit codes (2 invalid, 3 infeasible).

    Typer itself reports usage errors (unknown flag, bad value) with exit code 2.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        app(args=args, prog_name="moeplan")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except MoeplanError as e:
        if debug:
            raise
        err.print(f"[bold red]error:[/] {_one_paragraph(str(e))}", highlight=False, soft_wrap=True)
        code = e.exit_code
    except InfeasibleError as e:
        if debug:
            raise
        err.print(f"[bold yellow]infeasible:[/] {_one_paragraph(str(e))}", highlight=False,
                  soft_wrap=True)
        code = e.exit_code
    except KeyboardInterrupt:
        err.print("interrupted")
        code = 130
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
