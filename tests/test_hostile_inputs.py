"""Hostile input is normal input: each case a user (or an attacker) can type is refused with
exit 2, one short paragraph naming the field, and no traceback, within a second; every file
the CLI writes appears atomically or not at all; exported scripts run no injected command."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moeplan.api
import moeplan.planner.search
import moeplan.planner.whatif  # noqa: F401 (imported up front: the timings measure refusals)
from moeplan import fsio, limits
from moeplan.cli import main
from moeplan.errors import SpecError
from moeplan.specs import load_plan

from .conftest import run_cli

EST = ["estimate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8", "--seq", "4096",
       "--gbs", "64"]
MAX_MESSAGE = 2500  # an error never echoes the input back at length


def refused(args: list[str], capsys, *needles: str, code: int = 2) -> str:
    """Run the CLI in-process; assert a fast, clean refusal mentioning each needle."""
    t0 = time.perf_counter()
    got = main(args)
    elapsed = time.perf_counter() - t0
    cap = capsys.readouterr()
    assert got == code, (got, cap.err[-2000:])
    assert cap.out == ""  # nothing half-printed, no partial JSON document
    assert "Traceback" not in cap.err and len(cap.err) < MAX_MESSAGE, cap.err[:3000]
    assert elapsed < 1.0, f"refusal took {elapsed:.2f} s"
    for needle in needles:
        assert needle.lower() in cap.err.lower(), cap.err
    return cap.err


# ------------------------------------------------------------------------ non-finite numbers
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_estimate_imbalance_nan_or_inf_exits_2(value, capsys):
    refused([*EST, "--imbalance", value, "--json"], capsys, "--imbalance", "finite")


def test_whatif_tokens_nan_exits_2(capsys):
    refused(["whatif", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8",
             "--tokens", "nan", "--json"], capsys, "--tokens", "finite")


@pytest.mark.parametrize("flag", ["--days", "--budget", "--gpu-hour-price"])
def test_whatif_inf_money_and_time_exit_2(flag, capsys):
    refused(["whatif", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8", flag, "inf"],
            capsys, "finite")


@pytest.mark.parametrize("command,flag", [("search", "--time-limit"), ("whatif", "--time-limit"),
                                          ("search", "--imbalance")])
def test_a_nan_float_option_is_called_not_finite_not_out_of_range(command, flag, capsys):
    msg = refused([command, "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8", flag,
                   "nan"], capsys, flag, "not a finite number")
    assert "greater than" not in msg


@pytest.mark.parametrize("command", ["search", "whatif"])
def test_a_time_limit_below_a_tenth_of_a_second_is_refused_naming_the_bound(command, capsys):
    refused([command, "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8",
             "--time-limit", "0.01"], capsys, "--time-limit", "at least 0.1")


def test_a_malformed_routing_histogram_is_refused_with_an_example_whose_brackets_balance(
        tmp_path, capsys):
    bad = tmp_path / "routing.json"
    bad.write_text('{"layers": 3}')
    msg = refused([*EST, "--routing-histogram", str(bad)], capsys, "--routing-histogram",
                  '"tokens_per_expert"')
    example = msg.split("expected ", 1)[1].split(" (the routing.json", 1)[0]
    assert example.count("{") == example.count("}") and example.count("[") == example.count("]")


def test_rope_theta_inf_in_yaml_spec_exits_2(tmp_path, capsys):
    spec = tmp_path / "m.yaml"
    spec.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                    "ffn_hidden_size: 128\nvocab_size: 100\nrope_theta: .inf\n")
    refused(["specs", "show", str(spec), "--json"], capsys, "rope_theta", "finite")


def test_nan_in_json_plan_exits_2(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main([*EST, "-o", str(plan)]) == 0
    capsys.readouterr()
    plan.write_text(plan.read_text().replace('"lr": 0.0003', '"lr": NaN'))
    refused(["export", str(plan)], capsys, "lr")


# ------------------------------------------------------------------------ bounded sizes
@pytest.mark.parametrize("cmd", [
    ["search", "--model", "llama3-8b", "--cluster", "h100"],
    EST[:5],
])
def test_trillion_gpus_refused_before_any_search(cmd, capsys):
    refused([*cmd, "--gpus", "1000000000000", "--gbs", "64"], capsys, "--gpus", "131,072")


def test_whatif_gpu_range_from_zero_refused(capsys):
    refused(["whatif", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "0-8"], capsys,
            "--gpus", "lo")


def test_whatif_gpu_range_above_limit_refused(capsys):
    refused(["whatif", "--model", "llama3-8b", "--cluster", "h100", "--gpus",
             "1-99999999999999999999"], capsys, "--gpus", "limit")


def test_whatif_sweep_too_many_points_refused(capsys):
    gpus = ",".join(str(8 * i) for i in range(1, 100))
    refused(["whatif", "--model", "llama3-8b", "--cluster", "h100,h200,b200", "--gpus", gpus,
             "--seq", "1024,2048,4096,8192,16384"], capsys, "sweep points", "1,024")


def test_num_layers_billion_refused(tmp_path, capsys):
    spec = tmp_path / "m.yaml"
    spec.write_text("num_layers: 1000000000\nhidden_size: 64\nnum_attention_heads: 4\n"
                    "ffn_hidden_size: 128\nvocab_size: 100\n")
    refused(["specs", "validate", str(spec)], capsys, "num_layers", "1024", "limit")


@pytest.mark.parametrize("field,value", [("num_experts", 10**7), ("hidden_size", 10**9),
                                         ("vocab_size", 10**10)])
def test_model_sizes_above_limits_refused(field, value, tmp_path, capsys):
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "ffn_hidden_size": 128, "vocab_size": 100}
    spec = tmp_path / "m.json"
    spec.write_text(json.dumps({**base, field: value}))
    refused(["specs", "validate", str(spec)], capsys, field, "limit")


def test_seq_and_batch_above_limits_refused(capsys):
    refused([*EST[:7], "--seq", str(10**9), "--gbs", "64"], capsys, "`--seq`", "limit")
    refused([*EST[:9], "--gbs", str(10**12)], capsys, "`--gbs`", "limit")


def alias_bomb() -> str:
    """The billion-laughs shape: nine levels, each nine references to the one below."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, cur in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_refused_fast_with_short_message(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 500
    err = refused(["specs", "validate", str(bomb)], capsys, "aliases", "200,000")
    assert "lol" not in err


def test_recursive_yaml_alias_refused(tmp_path, capsys):
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &a [*a]\n")
    refused(["specs", "validate", str(loop)], capsys)


def test_yaml_aliases_within_limits_still_load(tmp_path, capsys):
    spec = tmp_path / "m.yaml"
    spec.write_text("num_layers: &n 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                    "ffn_hidden_size: 128\nvocab_size: 100\nmoe_layer_freq: *n\n")
    assert main(["specs", "validate", str(spec)]) == 0


def test_calibrate_nproc_1000_refused_before_starting_anything(capsys):
    refused(["calibrate", "--nproc", "1000"], capsys, "--nproc", "limit")


def test_whatif_workers_above_cores_refused(capsys):
    refused(["whatif", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8",
             "--workers", "100000"], capsys, "--workers")


@pytest.mark.parametrize("gpus,needle", [("100000000", "131,072"), ("0", "positive"),
                                         ("-8", "positive")])
def test_groups_huge_zero_or_negative_world_refused(gpus, needle, capsys):
    refused(["groups", "--gpus", gpus], capsys, "--gpus", needle)


def test_plan_file_with_huge_layout_refused(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main([*EST, "-o", str(plan)]) == 0
    capsys.readouterr()
    doc = json.loads(plan.read_text())
    doc["layout"].update(dp=10**9)
    for derived in ("world_size", "edp", "sequence_parallel"):
        doc["layout"].pop(derived, None)
    plan.write_text(json.dumps(doc))
    refused(["groups", str(plan)], capsys, "world_size", "131,072")


def test_spec_file_above_size_limit_refused(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# " + b"x" * limits.MAX_FILE_BYTES + b"\n")
    refused(["specs", "validate", str(big)], capsys, "MiB")


def test_binary_spec_refused(tmp_path, capsys):
    blob = tmp_path / "blob.json"
    blob.write_bytes(bytes(range(256)) * 8)
    refused(["specs", "validate", str(blob)], capsys, "UTF-8")


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_100k_deep_spec_refused(suffix, tmp_path, capsys):
    deep = tmp_path / f"deep{suffix}"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    refused(["specs", "validate", str(deep)], capsys, "nest")


def test_huge_argument_quoted_as_short_excerpt(capsys):
    refused(["search", "--model", "x" * 100_000, "--cluster", "h100"], capsys, "unknown model")


# ------------------------------------------------------------------------ CSV cells
HEADER = ("id,model_preset,cluster_preset,num_gpus,seq_len,global_batch_seqs,micro_batch,tp,pp,"
          "tokens_per_s_per_gpu,flops_convention\n")
GOOD = {"id": "r1", "model_preset": "llama3-8b", "cluster_preset": "h100", "num_gpus": "8",
        "seq_len": "4096", "global_batch_seqs": "64", "micro_batch": "1", "tp": "1", "pp": "1",
        "tokens_per_s_per_gpu": "10000", "flops_convention": "causal_halved"}


def runs_csv(tmp_path: Path, **cells: str) -> Path:
    row = {**GOOD, **cells}
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + ",".join(row[c] for c in HEADER.strip().split(",")) + "\n")
    return path


def test_valid_csv_row_is_predicted(tmp_path, capsys):
    assert main(["validate", str(runs_csv(tmp_path)), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) == 1


@pytest.mark.parametrize("col,value", [("tp", "0"), ("tp", "nan"), ("seq_len", "inf"),
                                       ("tokens_per_s_per_gpu", "nan"), ("pp", "-1"),
                                       ("num_gpus", "2.5"), ("num_gpus", "1e30"),
                                       ("tp", "two")])
def test_bad_csv_cell_exits_2_naming_row_and_column(col, value, tmp_path, capsys):
    refused(["validate", str(runs_csv(tmp_path, **{col: value}))], capsys, "r1", col)


@pytest.mark.parametrize("col,value", [("tokens_per_s_per_gpu", "1e-308"),
                                       ("tokens_per_s_per_gpu", "1e300")])
def test_a_measurement_outside_any_real_range_is_refused_naming_row_and_column(col, value,
                                                                               tmp_path, capsys):
    refused(["validate", str(runs_csv(tmp_path, **{col: value}))], capsys, "r1", col,
            "measurement from")


@pytest.mark.parametrize("col", ["tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "memory_gb"])
def test_a_measurement_of_zero_is_refused_not_read_as_unpublished(col, tmp_path, capsys):
    path = runs_csv(tmp_path, **({col: "0"} if col in GOOD else {}))
    if col not in GOOD:  # a column of its own beside the published tokens/s
        path.write_text(path.read_text().replace("convention\n", f"convention,{col}\n")
                        .replace("causal_halved\n", "causal_halved,0\n"))
    refused(["validate", str(path)], capsys, "r1", col, "measurement from")


def test_a_csv_with_more_rows_than_the_limit_is_refused_before_any_row_is_priced(tmp_path,
                                                                                  capsys):
    from moeplan.limits import MAX_CSV_ROWS

    path = runs_csv(tmp_path)
    head, row = path.read_text().splitlines(keepends=True)
    path.write_text(head + row * (MAX_CSV_ROWS + 1))
    refused(["validate", str(path)], capsys, f"{MAX_CSV_ROWS:,} rows", "split it")


def _with_stack(path: Path, stacks: dict[str, str]) -> Path:
    """The CSV at `path` with a `software_stack` column, its row copied once per id."""
    head, row = path.read_text().splitlines()
    path.write_text(f"{head},software_stack\n" + "".join(
        f"{row.replace('r1,', f'{rid},', 1)},{stack}\n" for rid, stack in stacks.items()))
    return path


def test_a_rows_skip_reason_is_printed_whole_with_the_value_and_the_fix(tmp_path, capsys):
    path = _with_stack(runs_csv(tmp_path), {"X1": "mcore2024", "X2": ""})
    assert main(["validate", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table wraps at any width
    assert "'mcore2024' is not a software stack" in out and "Did you mean mcore-2024?" in out
    assert "1 run predicted, 1 skipped" in out and "1 row skipped" in out


def test_a_csv_no_row_of_which_can_be_predicted_exits_2_naming_the_commonest_reasons(tmp_path,
                                                                                     capsys):
    path = _with_stack(runs_csv(tmp_path), {"X1": "mcore2024", "X2": "mcore2024"})
    msg = refused(["validate", str(path)], capsys, "none of its 2 rows", "'mcore2024'",
                  "2 rows: X1, X2")
    assert msg.count("\n") == 1  # one paragraph
    one = tmp_path / "one.csv"
    one.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))
    refused(["validate", str(one)], capsys, "its one row could not be predicted")


def test_a_hand_edited_stage_layout_is_named_as_the_plan_files_field(tmp_path, capsys):
    """A plan file's stage layout was refused as `--stage-layout`, a flag the user never
    typed: the message names the file's field too."""
    plan = tmp_path / "p.json"
    assert main([*EST, "-o", str(plan)]) == 0
    capsys.readouterr()
    doc = json.loads(plan.read_text())
    doc["choices"]["stage_layout"] = "Et*999|tL"
    plan.write_text(json.dumps(doc))
    refused(["estimate", str(plan)], capsys, "`choices.stage_layout`", "decoder layers")


def test_a_csv_naming_two_rows_by_one_id_is_refused(tmp_path, capsys):
    """Two rows called r1 printed, skipped and cross-validated as one name: refused, naming it."""
    path = runs_csv(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join([*lines, lines[1]]))
    refused(["validate", str(path)], capsys, "the id 'r1' names two rows")


def test_the_validate_footnote_names_the_settings_its_rows_assumed(capsys):
    """Korthikanti's 2022 A100 rows assume their stack and a replicated optimizer, not a
    Megatron-Bridge recipe: the footnote says what these rows assumed."""
    from .conftest import REPO

    assert main(["validate", str(REPO / "bench" / "data" / "korthikanti_2022_table5.csv")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(here: distributed optimizer, software stack;" in out
    assert "Megatron-Bridge" not in out and "MXFP8" not in out


def test_a_csv_saved_with_a_byte_order_mark_reads_as_without(tmp_path, capsys):
    path = runs_csv(tmp_path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert main(["validate", str(path), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) == 1


@pytest.mark.parametrize("text, needle", [
    ("", "holds no rows"), (HEADER, "holds no rows"),
    (HEADER.replace(",seq_len", "") + "r1,llama3-8b,h100,8,64,1,1,1,10000,causal_halved\n",
     "`seq_len`"),
    (HEADER.replace("tokens_per_s_per_gpu", "note")
     + "r1,llama3-8b,h100,8,4096,64,1,1,1,10000,causal_halved\n", "`tokens_per_s_per_gpu`"),
    (HEADER + "r1,llama3-8b,h100,8,4096,64,1,1,1,10000,causal_halved,extra\n", "more cells"),
    (HEADER + 'r1,llama3-8b,h100,8,4096,64,1,1,1,"10000,causal_halved\n', "not a valid CSV"),
])
def test_a_csv_without_rows_columns_or_shape_is_refused_not_scored_as_nothing(text, needle,
                                                                              tmp_path, capsys):
    path = tmp_path / "runs.csv"
    path.write_text(text)
    refused(["validate", str(path)], capsys, needle)


def test_non_utf8_csv_exits_2(tmp_path, capsys):
    path = tmp_path / "runs.csv"
    path.write_bytes(HEADER.encode() + b"r1,\xff\xfe\xfa,h100\n")
    refused(["validate", str(path)], capsys, "UTF-8")


# ------------------------------------------------------------------------ --calibration
@pytest.mark.parametrize("text", [
    "calibration: 5\n", "- 1\n- 2\n", "hbm_eff: abc\n", "hbm_eff: .nan\n",
    "gemm_eff_max: 0.7\n", "gemm_eff_max: {hopper: [1]}\n", "calibrated: 3\n", "{{{\n",
])
def test_malformed_calibration_exits_2(text, tmp_path, capsys):
    path = tmp_path / "cal.yaml"
    path.write_text(text)
    refused([*EST, "--calibration", str(path)], capsys, "calibration")


def test_calibration_that_is_a_directory_exits_2(tmp_path, capsys):
    refused([*EST, "--calibration", str(tmp_path)], capsys, "calibration")


# ------------------------------------------------------------------------ outputs
def test_output_into_missing_directory_exits_2(tmp_path, capsys):
    target = tmp_path / "no" / "such" / "plan.json"
    refused([*EST, "-o", str(target)], capsys, str(target), "does not exist")
    assert not target.parent.exists()


def test_output_onto_a_directory_exits_2(tmp_path, capsys):
    refused([*EST, "-o", str(tmp_path)], capsys, str(tmp_path), "directory")


def test_output_into_read_only_location_exits_2(capsys):
    refused([*EST, "-o", "/proc/moeplan-plan.json"], capsys, "/proc/moeplan-plan.json")


def test_report_output_into_missing_directory_exits_2_before_searching(tmp_path, capsys):
    refused(["whatif", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8", "-o",
             str(tmp_path / "no" / "r.md")], capsys, "does not exist")


def test_calibrate_output_into_missing_directory_exits_2_before_measuring(tmp_path, capsys):
    refused(["calibrate", "-o", str(tmp_path / "no" / "c.yaml")], capsys, "does not exist")


def test_run_out_onto_a_file_exits_2(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main([*EST, "-o", str(plan)]) == 0
    capsys.readouterr()
    afile = tmp_path / "afile"
    afile.write_text("keep")
    refused(["run", str(plan), "--out", str(afile)], capsys, "--out", "not a directory")
    refused(["run", str(plan), "--out", str(afile / "sub")], capsys, "not a directory")
    assert afile.read_text() == "keep"


def test_failed_write_keeps_old_file_and_leaves_no_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    target.write_text("old contents")

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fsio.os, "fsync", disk_full)
    with pytest.raises(SpecError, match="No space left on device") as info:
        fsio.atomic_write_text(target, "new contents " * 1000)
    assert str(target) in str(info.value)
    assert target.read_text() == "old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_interrupted_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "report.md"

    def interrupted(src: object, dst: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(fsio.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fsio.atomic_write_text(target, "text")
    assert list(tmp_path.iterdir()) == []


def test_rewritten_output_keeps_the_file_mode(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    plan.chmod(0o640)
    assert main([*EST, "-o", str(plan)]) == 0
    assert stat.S_IMODE(plan.stat().st_mode) == 0o640
    assert load_plan(plan).model.name == "llama3-8b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_json_with_nan_is_refused_on_output():
    with pytest.raises(Exception, match="non-finite"):
        fsio.strict_dumps({"x": float("nan")})


# ------------------------------------------------------------------------ no traceback, ever
@pytest.mark.parametrize("args", [
    ["groups", "--gpus", "0"],
    ["estimate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8", "--seq", "4096",
     "--gbs", "64", "--imbalance", "nan", "--json"],
])
def test_refusals_print_no_traceback_in_a_real_process(args):
    proc = run_cli(*args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


# ------------------------------------------------------------------------ shell-safe exports
HOSTILE_PLAN = "x;$(touch PWNED2).json"
# a newline in a name is refused at the door now (`specs.validated.printable_name`); every
# shell metacharacter a name may hold is still tried
HOSTILE_MODEL = "mx';touch PWNED5;'$(touch PWNED7)`touch PWNED8`#"
STUB = """#!/bin/sh
# stands in for torchrun/srun/scontrol: records its arguments, one per line, and runs nothing
for a in "$@"; do printf '%s\\n' "$a"; done >> "$STUB_LOG"
echo node0
"""


def test_exported_scripts_with_hostile_names_run_no_injected_command(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("torchrun", "srun", "scontrol"):
        (bin_dir / tool).write_text(STUB)
        (bin_dir / tool).chmod(0o755)
    src = work / "plain.json"
    assert main([*EST, "-o", str(src)]) == 0
    doc = json.loads(src.read_text())
    doc["model"]["name"] = HOSTILE_MODEL
    doc["cluster"]["name"] = "c`touch PWNED6`"
    (work / HOSTILE_PLAN).write_text(json.dumps(doc))
    capsys.readouterr()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n0",
           "SLURM_JOB_ID": "7", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "DATA": "synthetic", "STEPS": "5", "CKPT_DIR": str(tmp_path / "ckpt")}
    for fmt in ("torchrun", "slurm"):
        log = tmp_path / f"{fmt}.log"
        assert main(["export", str(work / HOSTILE_PLAN), "--format", fmt]) == 0
        script = capsys.readouterr().out
        (tmp_path / f"{fmt}.sh").write_text(script)
        subprocess.run(["bash", str(tmp_path / f"{fmt}.sh")], cwd=work, check=True, timeout=30,
                       env={**env, "STUB_LOG": str(log)})
        assert not list(work.glob("PWNED*")) and not list(tmp_path.glob("PWNED*"))
        argv = log.read_text().splitlines()
        assert str(work / HOSTILE_PLAN) in argv  # the name arrives intact, as one argument
        if fmt == "slurm":
            assert "127.0.0.1:29500" in argv or "node0:29500" in argv  # $VARs still expand
            job = next(line for line in script.splitlines() if "--job-name" in line)
            assert job.startswith("#SBATCH --job-name=") and " " not in job.split("=", 1)[1]
            comment = script.splitlines()[1]
            assert comment.startswith("# ") and "touch PWNED5" in comment  # stays in the comment


def test_megatron_export_quotes_every_value():
    from moeplan.planner.export import format_megatron

    line = format_megatron(["--data-path", "$(touch PWNED)", "--x", "a b;c"])
    assert "'$(touch PWNED)'" in line and "'a b;c'" in line


@pytest.mark.parametrize("imbalance", [float("nan"), float("inf"), 0.5])
def test_python_api_refuses_non_finite_imbalance(imbalance):
    plan = moeplan.api.plan_from_options("llama3-8b", "h100", 8, 4096, 64)
    with pytest.raises(SpecError, match="imbalance"):
        moeplan.api.estimate(plan, imbalance=imbalance)


# ------------------------------------------------------------------------ round 3: files and runs
def _run_plan(tmp_path: Path, world: int = 1, **axes) -> str:
    import torch  # noqa: F401  (imported before the timed refusal, as a real launcher has it)

    from .test_run_cli import write_plan

    return write_plan(tmp_path / "plan.json", world, **axes)


@pytest.mark.parametrize("seed", ["-5", "99999999999999999999999", str(2**32)])
def test_a_seed_the_checkpoint_rule_refuses_is_refused_where_options_are_parsed(seed, tmp_path,
                                                                              capsys):
    """A negative seed used to train and save checkpoints that resume, list and export all
    refuse; a huge one passed the launcher and killed the workers with an overflow."""
    plan = _run_plan(tmp_path)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    refused(["run", plan, "--seed", seed, "--out", str(out), "--ckpt-dir", str(ckpt)], capsys,
            "--seed", "0", f"{2**32 - 1:,}")
    assert not out.exists() and not ckpt.exists()


def test_the_seed_rule_is_the_checkpoint_metadata_rule(tmp_path):
    """One rule, in one place: every seed `run` accepts is one a checkpoint's meta.json may
    hold, and the other way round."""
    from moeplan.runtime.storage import CKPT_FORMAT, check_meta

    step = tmp_path / "step_00000001"
    for seed in (-5, 0, 7, limits.MAX_SEED, limits.MAX_SEED + 1, 10**23):
        try:
            limits.check_seed(seed)
            by_run = True
        except SpecError:
            by_run = False
        try:
            check_meta(step, {"format": CKPT_FORMAT, "step": 1, "seed": seed, "world_size": 1})
            by_meta = True
        except SpecError:
            by_meta = False
        assert by_run == by_meta == (0 <= seed <= limits.MAX_SEED), seed


def test_steps_beyond_the_limit_are_refused_before_any_worker(tmp_path):
    r = run_cli("run", _run_plan(tmp_path), "--steps", str(10**30), "--out",
                str(tmp_path / "o"), timeout=60)  # (it used to train on, step after step)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "--steps" in r.stderr and "limit" in r.stderr and not (tmp_path / "o").exists()


def test_a_ckpt_dir_that_is_a_file_is_refused_before_any_worker(tmp_path, capsys):
    """It used to kill the workers with a traceback (exit 1) at the first save."""
    plan = _run_plan(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for ckpt in (afile, afile / "sub"):
        refused(["run", plan, "--ckpt-dir", str(ckpt), "--out", str(tmp_path / "o")], capsys,
                "--ckpt-dir", "not a directory")
    assert afile.read_text() == "keep" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["chmod", "proc"])
def test_a_ckpt_dir_that_cannot_be_written_is_refused_before_any_worker(where, tmp_path, capsys):
    """A read-only --ckpt-dir used to be found only at the first save, after training."""
    plan = _run_plan(tmp_path)
    if where == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only mode directory; the /proc case runs")
        ckpt = tmp_path / "ro"
        ckpt.mkdir()
        ckpt.chmod(0o555)
    else:
        ckpt = Path("/proc/self")  # a directory no one may create files in
    refused(["run", plan, "--ckpt-dir", str(ckpt), "--out", str(tmp_path / "o")], capsys,
            "--ckpt-dir", "cannot")
    assert not (tmp_path / "o").exists()


def test_a_ckpt_dir_held_by_another_run_is_refused_naming_the_holder(tmp_path, capsys):
    """Two runs on one --ckpt-dir pruned each other's steps; now the first run holds a lock
    for its whole life and a second one exits 2 naming it."""
    from moeplan.runtime.storage import CkptLock

    plan = _run_plan(tmp_path)
    ckpt = tmp_path / "ckpt"
    with CkptLock(ckpt, "moeplan run first.json --out runs/first"):
        for extra in ([], ["--resume"]):
            said = refused(["run", plan, "--ckpt-dir", str(ckpt), "--out", str(tmp_path / "o"),
                            *extra], capsys, "in use", f"pid {os.getpid()}", "runs/first")
            assert "Nothing was run" in said
    assert not (tmp_path / "o").exists()
    with CkptLock(ckpt, "again"):  # released when the holder ends
        pass


def test_a_symlinked_metrics_file_is_refused_and_its_target_is_untouched(tmp_path, capsys):
    """metrics.jsonl is appended to; a link to a file outside --out used to be followed."""
    plan = _run_plan(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / "metrics.jsonl").symlink_to(victim)
    refused(["run", plan, "--out", str(out)], capsys, "metrics.jsonl", "link")
    assert victim.read_text() == "precious\n"


def test_appending_never_follows_a_link_or_blocks_on_a_pipe(tmp_path):
    """The one way run outputs are appended (metrics.jsonl): a link or a named pipe swapped in
    during the run is refused, not followed or waited on."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(victim)
    with pytest.raises(SpecError, match="link"):
        fsio.append_text(link, "{}\n")
    assert victim.read_text() == "precious\n"
    pipe = tmp_path / "pipe.jsonl"
    os.mkfifo(pipe)
    with pytest.raises(SpecError, match="named pipe"):
        fsio.append_text(pipe, "{}\n")
    fsio.append_text(tmp_path / "new.jsonl", "a\n")
    fsio.append_text(tmp_path / "new.jsonl", "b\n")
    assert (tmp_path / "new.jsonl").read_text() == "a\nb\n"


# --------------------------------------------- round 3: every read is bounded and of a regular file
def _hf_dir(tmp_path: Path) -> tuple[Path, str]:
    """A Hugging Face directory whose config.json is the tiny model's, and a plan of it."""
    from moeplan.runtime.hf_io import hf_config_for

    plan = _run_plan(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config_for(load_plan(plan).model)))
    return hf, plan


@pytest.mark.parametrize("which", ["config.json", "model.safetensors"])
def test_a_named_pipe_in_an_init_from_directory_is_refused_not_waited_on(which, tmp_path):
    """A named pipe as config.json or as the weights file hung the launcher until killed."""
    hf, plan = _hf_dir(tmp_path)
    if which == "config.json":
        (hf / which).unlink()
    os.mkfifo(hf / which)
    t0 = time.perf_counter()
    r = run_cli("run", plan, "--init-from", str(hf), "--out", str(tmp_path / "o"), timeout=60)
    assert r.returncode == 2 and time.perf_counter() - t0 < 30, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "named pipe" in r.stderr and which in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("how", ["link", "hf"])
def test_a_config_json_linked_to_dev_zero_is_refused_not_read_without_bound(how, tmp_path,
                                                                            capsys):
    """`read_json` trusted st_size == 0 and read /dev/zero until memory ran out."""
    if how == "link":  # `--model` on the planner side: the same reader
        cfg = tmp_path / "config.json"
        cfg.symlink_to("/dev/zero")
        with pytest.raises(SpecError, match="not a regular file"):
            from moeplan.specs.loader import read_document

            read_document(cfg)
        return
    hf, plan = _hf_dir(tmp_path)
    (hf / "config.json").unlink()
    (hf / "config.json").symlink_to("/dev/zero")
    t0 = time.perf_counter()
    r = run_cli("run", plan, "--init-from", str(hf), "--out", str(tmp_path / "o"), timeout=60)
    assert r.returncode == 2 and time.perf_counter() - t0 < 30, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "not a regular file" in r.stderr


def test_the_one_reader_reads_at_most_the_limit_plus_one_byte(tmp_path):
    """Whatever a file claims about its size (/proc files say 0), no more than limit + 1
    bytes are read, and only from a regular file."""
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 5000)
    assert len(fsio.read_regular(big, 5000)) == 5000
    with pytest.raises(SpecError, match="larger than"):
        fsio.read_regular(big, 4999)
    assert fsio.read_regular(Path("/proc/self/status"), 1 << 20).startswith(b"Name:")
    with pytest.raises(SpecError, match="not a regular file"):
        fsio.read_regular(Path("/dev/zero"), 10)
    with pytest.raises(SpecError, match="directory"):
        fsio.read_regular(tmp_path, 10)
    link = tmp_path / "link.json"
    link.symlink_to(big)
    assert len(fsio.read_regular(link, 5000)) == 5000
    with pytest.raises(SpecError, match="link"):
        fsio.read_regular(link, 5000, follow_links=False)


# ------------------------------------------------------------------------ round 3: duplicate keys
SPEC_YAML = ("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\n"
             "vocab_size: 100\n")


def test_a_repeated_key_in_a_spec_yaml_is_refused(tmp_path, capsys):
    spec = tmp_path / "m.yaml"
    spec.write_text(SPEC_YAML + "num_layers: 4\n")
    refused(["specs", "validate", str(spec)], capsys, "num_layers", "twice")


def test_yaml_merge_keys_are_not_duplicates(tmp_path, capsys):
    spec = tmp_path / "m.yaml"
    spec.write_text("base: &b {num_layers: 2, hidden_size: 64}\n<<: *b\nnum_layers: 4\n"
                    "num_attention_heads: 4\nffn_hidden_size: 128\nvocab_size: 100\n")
    from moeplan.specs.loader import read_document

    assert read_document(spec)["num_layers"] == 4  # an explicit key overrides a merged one


def test_a_repeated_key_in_a_plan_json_is_refused(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main([*EST, "-o", str(plan)]) == 0
    capsys.readouterr()
    text = plan.read_text()
    plan.write_text(text.replace('"layout": {', '"layout": {"tp": 8, ', 1))
    refused(["export", str(plan)], capsys, "tp", "twice")


def _hf_config_text() -> str:
    from moeplan.runtime.hf_io import hf_config_for
    from moeplan.specs import load_model

    from .conftest import DATA

    return json.dumps(hf_config_for(load_model(DATA / "tiny_qwen3_moe.yaml")))


@pytest.mark.parametrize("bad,needle", [(', "hidden_size": 4096}', "twice"),
                                        (', "rope_theta2": 1e999}', "finite")])
def test_a_repeated_key_or_overflowing_number_in_an_hf_config_is_refused_on_every_path(
        bad, needle, tmp_path, capsys):
    """The planner's `--model config.json` and the runtime's `--init-from` read it alike."""
    text = _hf_config_text()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(text[:-1] + bad)
    refused(["specs", "show", str(hf / "config.json"), "--json"], capsys, needle)
    from moeplan.runtime.hf_io import hf_config

    with pytest.raises(SpecError, match=needle):
        hf_config(hf)


# ------------------------------------------------------------------------ round 3: reports
def test_a_dollar_sign_in_a_cluster_name_is_plain_text_in_the_report(tmp_path, capsys):
    """`$…$` rendered as matplotlib mathtext, and `$\\frac{$` crashed `whatif -o report.html`."""
    import importlib.resources

    import yaml

    text = (importlib.resources.files("moeplan.specs") / "presets" / "clusters"
            / "h100.yaml").read_text()
    doc = yaml.safe_load(text) | {"name": "x$\\frac{$"}
    cluster = tmp_path / "c$\\frac{$.yaml"
    cluster.write_text(yaml.safe_dump(doc))
    report = tmp_path / "report.html"
    assert main(["whatif", "--model", "llama3-8b", "--cluster", str(cluster), "--gpus", "8",
                 "-o", str(report)]) == 0, capsys.readouterr().err[-2000:]
    assert report.stat().st_size > 1000


# ------------------------------------------------------------------------ round 3: small gaps
def test_per_core_limits_count_the_cpus_this_process_may_run_on(tmp_path, monkeypatch):
    """os.cpu_count() ignores CPU affinity and cgroup quotas; the limits use what this
    process may run on."""
    monkeypatch.setattr(limits.os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    assert limits.usable_cpus() == 1
    assert limits.max_cpu_procs() == limits.PROCS_PER_CORE
    monkeypatch.setattr(limits.os, "sched_getaffinity", lambda _pid: set(range(8)),
                        raising=False)
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 CPUs of time: 2 processes can use it
    monkeypatch.setattr(limits, "CGROUP_CPU_MAX", quota)
    assert limits.usable_cpus() == 2
    quota.write_text("max 100000\n")
    assert limits.usable_cpus() == 8


def test_whatif_workers_above_the_affinity_limit_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(limits.os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    refused(["whatif", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8",
             "--workers", str(limits.PROCS_PER_CORE + 1)], capsys, "--workers",
            str(limits.PROCS_PER_CORE))


def test_unknown_keys_in_a_calibration_file_are_refused_by_name(tmp_path, capsys):
    path = tmp_path / "cal.yaml"
    path.write_text("hbm_eff: 0.8\ngemm_eff_maxx: {hopper: 0.7}\n")
    refused([*EST, "--calibration", str(path)], capsys, "gemm_eff_maxx", "gemm_eff_max")


def test_a_csv_with_a_duplicated_column_is_refused(tmp_path, capsys):
    path = tmp_path / "runs.csv"
    header = HEADER.strip() + ",tp\n"
    row = ",".join(GOOD[c] for c in HEADER.strip().split(",")) + ",8\n"
    path.write_text(header + row)
    refused(["validate", str(path)], capsys, "tp", "twice")


if sys.platform != "linux":  # /proc and the bash stubs are Linux-specific
    pytestmark = pytest.mark.skip("Linux-only checks")


def test_a_named_pipe_as_a_datasets_index_or_a_tokenizer_is_refused_not_waited_on(tmp_path):
    """The data and tokenizer readers use the one non-blocking regular-file check too."""
    pytest.importorskip("tokenizers")
    from moeplan.data.indexed import read_index
    from moeplan.data.tokenizer import load_tokenizer

    (tmp_path / "corpus.bin").write_bytes(b"\0" * 8)
    os.mkfifo(tmp_path / "corpus.idx")
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match="named pipe"):
        read_index(tmp_path / "corpus")
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(SpecError, match="named pipe"):
        load_tokenizer(tmp_path / "tokenizer.json")
    assert time.perf_counter() - t0 < 5


# ------------------------------------------------------------------------ round 4
@pytest.mark.parametrize("kind", ["fifo", "empty"])
def test_output_onto_a_pipe_or_an_empty_path_is_refused_and_nothing_is_replaced(kind, tmp_path,
                                                                              capsys):
    """`-o` renames a new file over its target: a named pipe (or /dev/null, as root) would be
    replaced by a plain file, so it is refused; `-o ''` would write nothing and exit 0."""
    target = tmp_path / "pipe"
    if kind == "fifo":
        os.mkfifo(target)
    path = str(target) if kind == "fifo" else ""
    refused([*EST, "-o", path], capsys, "--output" if kind == "empty" else "named pipe")
    if kind == "fifo":
        assert stat.S_ISFIFO(target.lstat().st_mode)
    refused([*EST, "--report", ""], capsys, "--report")


@pytest.mark.parametrize("layout", ["Et*99999999999|L", "((((t*99)*99)*99)*99)|L",
                                    "E" + "t" * 20000 + "|L"])
def test_a_stage_layout_that_would_unroll_past_any_model_is_refused_before_it_unrolls(
        layout, capsys):
    err = refused([*EST, "--stage-layout", layout], capsys, "unrolls to more than")
    assert len(err) < 1000


@pytest.mark.parametrize("field, value", [("nvlink_gb_s", 1e-308), ("bf16_tflops", 1e-308),
                                          ("hbm_gb", 1e308), ("scaleout_latency_us", 1e300)])
def test_cluster_figures_outside_a_physical_range_are_refused_by_name(field, value, tmp_path,
                                                                      capsys):
    plan = tmp_path / "p.json"
    assert main([*EST, "-o", str(plan)]) == 0
    doc = json.loads(plan.read_text())
    doc["cluster"][field] = value
    plan.write_text(json.dumps(doc))
    capsys.readouterr()
    refused(["estimate", str(plan), "--json"], capsys, f"cluster.{field}")


@pytest.mark.parametrize("args, needle", [
    (["--imbalance", "1e308"], "--imbalance"),
    (["--capacity-factor", "1e308", "--pad-to-capacity"], "--capacity-factor"),
])
def test_routing_factors_beyond_their_limits_are_refused(args, needle, capsys):
    moe = ["estimate", "--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "16", "--seq",
           "4096", "--gbs", "64", "--ep", "8"]
    refused([*moe, *args], capsys, needle)


@pytest.mark.parametrize("args, needle", [
    (["--tokens", "1e308"], "--tokens"), (["--gpu-hour-price", "1e308"], "--gpu-hour-price"),
    (["--days", "1e300"], "--days"), (["--gpu-hour-price", "2", "--budget", "1e300"], "--budget"),
])
def test_whatif_quantities_beyond_their_limits_are_refused_before_the_sweep(args, needle, capsys):
    refused(["whatif", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8", *args],
            capsys, needle)


def test_a_json_document_nested_past_the_reader_is_a_refusal():
    with pytest.raises(fsio.TooDeep, match="nests deeper"):
        fsio.loads_json("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("where", ["under-a-file", "read-only"])
def test_a_tensorboard_dir_that_cannot_be_written_is_refused_before_any_worker(where, tmp_path,
                                                                               capsys):
    if where == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    plan = _run_plan(tmp_path)
    if where == "under-a-file":
        (tmp_path / "afile").write_text("x")
        tb = tmp_path / "afile" / "tb"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        tb = ro / "tb"
    refused(["run", plan, "--steps", "1", "--out", str(tmp_path / "out"), "--tensorboard-dir",
             str(tb)], capsys, "--tensorboard-dir", "cannot write there")


@pytest.mark.parametrize("kind, field, value", [
    ("model", "name", "a\x1b[31mRED"), ("model", "name", "x\u202ey"),
    ("cluster", "gpu", "H100\x07"), ("cluster", "name", "two\nlines")])
def test_a_name_holding_a_terminal_escape_or_a_direction_override_is_refused(
        kind, field, value, tmp_path, capsys):
    """Names are printed in tables and reports: an ESC would recolour or move the cursor, a
    U+202E reverse what follows, a newline break the table."""
    import yaml

    preset = "mixtral-8x7b" if kind == "model" else "h100"
    root = Path(moeplan.api.__file__).parent / "specs" / "presets" / f"{kind}s"
    doc = yaml.safe_load((root / f"{preset}.yaml").read_text())
    doc[field] = value
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(doc))
    args = (["specs", "show", str(path)] if kind == "model" else
            ["estimate", "--model", "llama3-8b", "--cluster", str(path), "--gpus", "8",
             "--seq", "4096", "--gbs", "64"])
    err = refused(args, capsys, f"`{field}`", "control or formatting character")
    assert "\x1b" not in err and "\u202e" not in err


def test_a_csv_id_holding_a_terminal_escape_is_refused(tmp_path, capsys):
    refused(["validate", str(runs_csv(tmp_path, id="r\x1b[2J1"))], capsys, "`id`",
            "control or formatting character")


def test_a_directory_or_device_given_for_a_file_is_said_as_such_not_reported_missing(tmp_path,
                                                                                     capsys):
    refused(["specs", "show", str(tmp_path)], capsys, "is a directory, not a regular file")
    refused(["specs", "show", "/dev/zero"], capsys, "is a character device")
    refused(["estimate", str(tmp_path)], capsys, "plan file", "is a directory")
    (tmp_path / "config.json").write_text("{}")
    refused(["specs", "show", str(tmp_path)], capsys, "give its")  # an HF checkpoint directory


def test_flags_a_plan_file_would_ignore_are_refused_by_name(tmp_path, capsys):
    """`estimate PLAN.json --tp 4` priced the plan's own layout and said nothing of --tp; each
    such flag is now refused, by name (the flags that go with a plan are still taken)."""
    plan = tmp_path / "p.json"
    assert main([*EST, "-o", str(plan)]) == 0
    capsys.readouterr()
    refused(["estimate", str(plan), "--tp", "4", "--gpus", "1024", "--recompute", "full"],
            capsys, "--tp", "--gpus", "--recompute", "would be ignored")
    refused(["groups", str(plan), "--gpus", "32"], capsys, "--gpus", "would be ignored")
    refused(["export", str(plan), "--format", "slurm", "--flags-only"], capsys, "--flags-only")
    assert main(["estimate", str(plan), "--imbalance", "1.0", "--json"]) == 0


@pytest.mark.parametrize("where, field", [("model", "num_layers"), ("layout", "ep"),
                                          ("cluster", "hbm_gb")])
def test_true_or_false_where_a_number_belongs_is_refused_not_read_as_one(where, field, tmp_path,
                                                                         capsys):
    """pydantic's lax mode read `num_layers: true` as 1 layer and `hbm_gb: true` as 1 GB; the
    Hugging Face importer already refused the same bool."""
    plan = tmp_path / "p.json"
    assert main([*EST, "-o", str(plan)]) == 0
    capsys.readouterr()
    doc = json.loads(plan.read_text())
    doc[where][field] = True
    plan.write_text(json.dumps(doc))
    refused(["estimate", str(plan)], capsys, f"`{where}.{field}` is true/false")


def test_a_gpu_whose_memory_the_reserve_takes_whole_is_refused_naming_hbm_gb(tmp_path, capsys):
    """1 GB of HBM under a 2 GB reserve left a budget of −1 GB, and "nothing fits" then advised
    twice the GPUs, which no count can meet: such a cluster is refused by the field."""
    import yaml

    from moeplan.specs import load_cluster

    doc = load_cluster("h100").model_dump(mode="json")
    doc["hbm_gb"] = 1.0
    path = tmp_path / "tiny-hbm.yaml"
    path.write_text(yaml.safe_dump(doc))
    refused(["search", "--model", "mixtral-8x7b", "--cluster", str(path), "--gpus", "64",
             "--gbs", "64"], capsys, "`hbm_gb`", "2 GB reserve", "more than 3.5")


def test_a_bad_command_line_value_is_named_by_its_flag_and_an_empty_plan_in_words(tmp_path,
                                                                                  capsys):
    """pydantic's paths (`recompute.0.0`) and Python's type names (NoneType) are not what the
    user typed or wrote."""
    err = refused(["estimate", "--model", "llama3-8b", "--cluster", "h100", "--gpus", "8",
                   "--gbs", "64", "--recompute", "attn"], capsys, "`--recompute`",
                  "on the command line", "got 'attn'")
    assert "recompute.0" not in err
    empty = tmp_path / "plan.json"
    empty.write_text("null")
    err = refused(["estimate", str(empty)], capsys, "got nothing (null, or an empty file)")
    assert "NoneType" not in err


def test_an_append_cut_short_by_a_full_disk_leaves_the_file_as_it_was(tmp_path):
    """A full disk wrote part of a record and left metrics.jsonl ending mid-line, which a
    resumed run then appended to. The kernel's file-size limit cuts the write the same way."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    code = ("import resource, signal, sys\n"
            "from moeplan import fsio\n"
            "from moeplan.errors import SpecError\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (20, 20))\n"
            "try:\n"
            f"    fsio.append_text({str(path)!r}, '{{\"step\": 2, \"loss\": 1.0}}\\n')\n"
            "except SpecError as e:\n"
            "    print(e); sys.exit(2)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot write" in r.stdout, r.stdout + r.stderr
    assert path.read_text() == '{"step": 1}\n'
