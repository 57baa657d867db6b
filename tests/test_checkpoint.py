"""Token files, checkpoints and resume, and faults: nothing lost, nothing silently diverging.

In-process checks for the data and file formats; one spawned world (`checkpoint_worker.py`)
for exact and resharded resume; a few real `moeplan run` launches at world 2 for resume through
the CLI, a worker SIGKILLed mid-run and restarted by torchrun, and SIGTERM preemption.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tokenize
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from moeplan import errors as moeplan_errors
from moeplan.errors import SpecError
from moeplan.runtime.data import TokenData, write_tokens
from moeplan.runtime.launch import PreparedRun, RunOptions, check_resume, prepare_plan
from moeplan.runtime.storage import (
    complete_steps,
    newest_checkpoint,
    publish,
    verify,
)
from moeplan.specs import Choices, load_plan

from .conftest import run_cli, run_cli_without_torch, run_world
from .test_run_cli import write_plan

STEPS = 24  # the end-to-end runs; the tiny model takes ~0.1 s a step


def last_per_step(metrics: Path) -> dict[int, float]:
    """Readers of an appended metrics.jsonl take the last record of each step."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


# ------------------------------------------------------------------------------ box geometry
@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 1, 3, 4)])
def test_a_flat_range_cuts_into_boxes_that_cover_exactly_its_elements(shape):
    from moeplan.runtime.checkpoint import _boxes, _index

    n = int(np.prod(shape))
    for a, b in [(0, n), (1, n - 1), (n // 3, n // 3 + 1), (2, 2 * n // 3), (0, 1), (n - 1, n)]:
        marks = torch.zeros(shape, dtype=torch.int64)
        for box in _boxes(a, b, shape):
            marks[_index(box)] += 1
        want = torch.zeros(n, dtype=torch.int64)
        want[a:b] = 1
        assert torch.equal(marks.reshape(-1), want), (a, b)
        assert len(_boxes(a, b, shape)) <= 2 * len(shape) - 1


def test_a_flat_range_splits_into_its_boxes_contents_in_order():
    """Each box of a flat range is a contiguous run of it, so a rank writes (and reads back)
    its optimizer slice without building the whole shard."""
    from moeplan.runtime.checkpoint import _boxes, _index, _split

    shape = (4, 3, 5)
    full = torch.arange(60.0).view(shape)
    boxes = _boxes(7, 53, shape)
    for piece, box in zip(_split(full.reshape(-1)[7:53], boxes), boxes, strict=True):
        assert torch.equal(piece, full[_index(box)])


def test_the_complement_of_a_box_covers_the_rest_once():
    from moeplan.runtime.checkpoint import _complement, _index

    shape, box = (6, 5, 4), ((2, 1, 0), (2, 3, 4))
    marks = torch.zeros(shape, dtype=torch.int64)
    marks[_index(box)] += 1
    for b in _complement(box, shape):
        marks[_index(b)] += 1
    assert bool((marks == 1).all())


# --------------------------------------------------------------------------------------- data
def test_token_batches_depend_on_seed_and_step_only_not_the_dp_split(tmp_path):
    path = write_tokens(np.random.default_rng(1).integers(0, 256, 2_000), tmp_path / "t.bin")
    data = TokenData(path, 256, seq_len=16, global_batch=8, seed=3)
    for step in (0, 20):  # step 20 is past the first epoch (124 windows): a new order
        whole = data.global_batch(step)
        for dp in (2, 4):
            parts = [torch.cat([tok for tok, _ in data.micro_batches(step, r, dp, 1)])
                     for r in range(dp)]
            assert torch.equal(torch.cat(parts), whole[:, :-1])
        again = TokenData(path, 256, seq_len=16, global_batch=8, seed=3).global_batch(step)
        assert torch.equal(again, whole)  # e.g. after a restart
    assert not torch.equal(TokenData(path, 256, 16, 8, seed=4).global_batch(0), data.global_batch(0))


# ------------------------------------------------------------------------------------- non-finite
def test_a_non_finite_loss_skips_the_update_and_training_goes_on(tmp_path):
    from moeplan.runtime.groups import local_groups
    from moeplan.runtime.train import Trainer

    plan = load_plan(write_plan(tmp_path / "plan.json", 1))
    trainer = Trainer(plan, local_groups(), seed=0)
    trainer.step(0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    count = trainer.optimizer.step_count
    hook = trainer.model.register_forward_hook(
        lambda _m, _i, terms: replace(terms, ce_sum=terms.ce_sum * float("nan")))
    metrics, _ = trainer.step(1)
    hook.remove()
    assert metrics.skipped and trainer.optimizer.step_count == count
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n
    metrics, _ = trainer.step(2)
    assert not metrics.skipped and np.isfinite(metrics.loss)


# ------------------------------------------------------------------------ spawned-world resume
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A world-4 run saved at step 3 under tp2·ep4, resumed under it, ep2·etp2 and pp2·vpp2·tp2;
    and one saved at step 3 under pp2·vpp2·tp2, resumed under it and under tp2·ep4."""
    root = tmp_path_factory.mktemp("ckpt_world4")
    run_world("checkpoint_worker.py", root)
    return root


@pytest.mark.slow
def test_resume_under_the_same_plan_reproduces_the_straight_losses_exactly(saved):
    losses = json.loads((saved / "losses.json").read_text())
    for a, b in zip(losses["resumed_same_plan"], losses["straight"][3:], strict=True):
        assert abs(a - b) <= 1e-6
    assert len(losses["resumed_same_plan"]) == 3


@pytest.mark.slow
def test_resume_under_another_plan_reshards_to_the_straight_losses(saved):
    losses = json.loads((saved / "losses.json").read_text())
    for a, b in zip(losses["resumed_ep2_etp2"], losses["straight"][3:], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_under_the_same_plan_exactly(saved):
    losses = json.loads((saved / "losses.json").read_text())
    assert len(losses["pp2_resumed_same_plan"]) == 3
    for a, b in zip(losses["pp2_resumed_same_plan"], losses["straight_pp2"][3:], strict=True):
        assert abs(a - b) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("resumed,straight", [("pp2_resumed_tp2_ep4", "straight_pp2"),
                                              ("resumed_pp2_vpp2_tp2", "straight")])
def test_a_checkpoint_resumes_under_another_pipeline_depth_to_the_straight_losses(
        saved, resumed, straight):
    losses = json.loads((saved / "losses.json").read_text())
    assert len(losses[resumed]) == 3
    for a, b in zip(losses[resumed], losses[straight][3:], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b)


@pytest.mark.slow
def test_fp8_delayed_scaling_resumes_exactly_with_its_amax_histories(saved):
    """The histories are saved per rank and restored under the same plan: the resumed FP8 run
    is the straight run; without them (the control) the first resumed step already differs."""
    losses = json.loads((saved / "losses.json").read_text())
    straight = losses["straight_fp8"][3:]
    assert losses["fp8_resumed_same_plan"] == straight
    assert losses["fp8_resumed_without_histories"][0] != straight[0]


@pytest.mark.slow
def test_every_rank_writes_its_part_and_the_step_is_sealed_with_a_manifest(saved):
    path = newest_checkpoint(saved / "ckpt")
    assert path is not None and path.name == "step_00000003"
    assert sorted(p.name for p in path.glob("*.safetensors")) == [
        f"rank_{r:05d}.safetensors" for r in range(4)]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "moeplan-ckpt-v3"
    assert set(manifest["files"]) == {"plan.json", "meta.json", "index.json",
                                      *(f"rank_{r:05d}.safetensors" for r in range(4))}
    assert sorted(p.name for p in path.iterdir()) == sorted([*manifest["files"], "manifest.json"])
    assert (saved / "ckpt" / "latest").read_text().strip() == "step_00000003"
    assert not [p for p in (saved / "ckpt").iterdir() if ".tmp" in p.name]


@pytest.mark.slow
def test_a_step_without_a_manifest_is_passed_over_by_name_and_replaced_at_the_next_save(
        saved, tmp_path, capsys):
    """A step_* without a manifest is not a checkpoint: resume says so and uses the previous
    sealed step; the run's next save of that step replaces it (before, it could never be
    saved again), and stale leftovers go."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", ckpt)
    half = ckpt / "step_00000005"  # e.g. its manifest deleted, or copied by hand
    shutil.copytree(ckpt / "step_00000003", half)
    (half / "manifest.json").unlink()
    (ckpt / ".step_00000006.tmp-dead").mkdir()  # a write interrupted by a crash
    assert complete_steps(ckpt) == [3]
    plan = load_plan(ckpt / "step_00000003" / "plan.json")
    assert check_resume(plan, RunOptions(steps=6, seed=5, ckpt_dir=str(ckpt), resume=True)) == 3
    said = " ".join(capsys.readouterr().err.split())
    assert "step_00000005 has no manifest.json, so it is not a checkpoint" in said
    assert (half / "rank_00000.safetensors").is_file()  # resume itself removes nothing
    tmp = ckpt / ".step_00000005.tmp-new"  # what the resumed run writes for step 5
    shutil.copytree(ckpt / "step_00000003", tmp)
    (tmp / "manifest.json").unlink()
    _rewrite_meta(tmp, step=5)
    publish(tmp, half, keep=3)
    assert complete_steps(ckpt) == [3, 5]
    verify(half)
    assert not [p for p in ckpt.iterdir() if ".tmp" in p.name or ".removing" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("opts,needle", [
    ({"resume": False}, "already holds checkpoints"),  # a fresh run would mix two runs
    ({"resume": True, "seed": 6}, "same seed"),
    ({"resume": True, "steps": 3}, "nothing to train"),
    ({"resume": True, "data": "corpus/docs"}, "same data and split"),  # trained on synthetic
    ({"resume": True, "split": "90,10,0"}, "same data and split"),
    ({"resume": True, "gbs": 2}, "same batch and sequence length"),  # data position s × gbs
])
def test_resume_refuses_what_would_silently_diverge(saved, opts, needle):
    ckpt = saved / "ckpt"
    plan = load_plan(ckpt / "step_00000003" / "plan.json")
    if "gbs" in opts:
        gbs = opts.pop("gbs")
        plan = plan.model_copy(update={"training": plan.training.model_copy(
            update={"global_batch_size": gbs})})
    with pytest.raises(SpecError, match=needle):
        check_resume(plan, RunOptions(ckpt_dir=str(ckpt), **{"steps": 6, "seed": 5, **opts}))


def test_resume_without_a_checkpoint_says_it_starts_at_step_zero(tmp_path, capsys):
    """A job that always passes --resume starts from nothing the first time; so does one whose
    --ckpt-dir is mistyped, so the launcher says which happened."""
    from moeplan.runtime.launch import verified_resume

    plan = load_plan(write_plan(tmp_path / "plan.json", 1))
    got = verified_resume(plan, RunOptions(ckpt_dir=str(tmp_path / "none"), resume=True,
                                           steps=2, seed=5))
    assert got == (0, None)
    assert "no checkpoint in" in capsys.readouterr().err


# ------------------------------------------------------------------- hostile checkpoints (CLI)
def _exploit(marker: Path) -> bytes:
    """A protocol-4 pickle whose STACK_GLOBAL names `os.system` through a module a DCP index
    may name, called on `touch MARKER`: what a crafted checkpoint ran on `--resume` before."""
    mod, name, cmd = (b"torch.distributed.checkpoint.filesystem", b"os.system",
                      f"touch {marker}".encode())
    return (b"\x80\x04" + b"\x8c" + bytes([len(mod)]) + mod + b"\x8c" + bytes([len(name)]) + name
            + b"\x93" + b"\x8c" + bytes([len(cmd)]) + cmd + b"\x85" + b"R" + b".")


def test_the_exploit_pickle_runs_code_when_unpickled(tmp_path):
    """The control for the tests below: the payload they plant is live."""
    marker = tmp_path / "PWNED"
    pickle.loads(_exploit(marker))
    assert marker.exists()


def _reseal(step: Path, *names: str, drop: tuple[str, ...] = ()) -> None:
    """Rewrite the manifest to match edited files, as whoever edits a file can."""
    manifest = json.loads((step / "manifest.json").read_text())
    for name in names:
        data = (step / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for name in drop:
        manifest["files"].pop(name)
    (step / "manifest.json").write_text(json.dumps(manifest))


def _rewrite_meta(directory: Path, **fields: object) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    (directory / "meta.json").write_text(json.dumps(meta | fields))


@pytest.fixture
def hostile(saved, tmp_path, cli):
    """A copy of the tp2·ep4 checkpoint to damage, and `refused()`: `moeplan run --resume` on it
    must exit 2 with one message and no traceback, start no worker, and run no planted code;
    it returns the message with whitespace removed (rich wraps long paths)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", ckpt)
    step = ckpt / "step_00000003"
    plan = tmp_path / "plan.json"
    shutil.copy(step / "plan.json", plan)
    marker = tmp_path / "PWNED"

    def refused() -> str:
        out = tmp_path / "out"
        r = cli("run", str(plan), "--steps", "6", "--out", str(out), "--ckpt-dir", str(ckpt),
                "--resume")
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr + r.stdout
        assert not out.exists() and not marker.exists()
        return "".join(r.stderr.split())

    return step, marker, refused


def _has(message: str, needle: str) -> bool:
    return needle.replace(" ", "") in message


@pytest.mark.slow
def test_a_tampered_shard_is_refused_naming_the_file(hostile):
    step, _, refused = hostile
    bad = step / "rank_00001.safetensors"
    data = bytearray(bad.read_bytes())
    for i in range(64):  # 64 flipped bytes in the tensor data, the manifest left as it was
        data[len(data) // 2 + i] ^= 0xFF
    bad.write_bytes(bytes(data))
    assert _has(refused(), "rank_00001.safetensors does not match its SHA-256")


@pytest.mark.slow
def test_a_truncated_shard_is_refused_naming_the_file(hostile):
    step, _, refused = hostile
    bad = step / "rank_00001.safetensors"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    said = refused()
    assert _has(said, "rank_00001.safetensors has") and _has(said, "(truncated or replaced)")


@pytest.mark.slow
def test_a_missing_shard_is_refused_naming_the_file(hostile):
    step, _, refused = hostile
    (step / "rank_00002.safetensors").unlink()
    assert _has(refused(), "rank_00002.safetensors is missing")


@pytest.mark.slow
def test_an_empty_manifest_is_refused_instead_of_turning_the_checks_off(hostile):
    step, _, refused = hostile
    bad = step / "rank_00001.safetensors"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    (step / "manifest.json").write_text("{}")
    assert _has(refused(), "manifest.json is empty")


@pytest.mark.slow
def test_a_meta_step_that_is_not_a_number_is_refused(hostile):
    step, _, refused = hostile
    _rewrite_meta(step, step="two")
    _reseal(step, "meta.json")
    assert _has(refused(), 'meta.json: "step" must be a whole number')


@pytest.mark.slow
def test_a_crafted_metadata_pickle_is_refused_without_running_it(hostile):
    """The first hole: a DCP-style `.metadata` whose pickle calls os.system, sealed into a
    consistent manifest. It is never unpickled; the step is refused by its format."""
    step, marker, refused = hostile
    (step / ".metadata").write_bytes(_exploit(marker))
    _reseal(step, ".metadata")
    said = refused()
    assert _has(said, "moeplan-ckpt-v2") and _has(said, "pickled .metadata index")


@pytest.mark.slow
def test_a_pickle_in_place_of_a_shard_is_refused_without_running_it(hostile):
    """The second hole: tensor bytes that are a pickle (read with torch.load before)."""
    step, marker, refused = hostile
    (step / "rank_00001.safetensors").write_bytes(_exploit(marker))
    _reseal(step, "rank_00001.safetensors")
    assert _has(refused(), "rank_00001.safetensors is not a safetensors file")


@pytest.mark.slow
def test_a_pickle_bearing_extra_file_is_refused(hostile):
    step, marker, refused = hostile
    (step / "extra.pt").write_bytes(_exploit(marker))
    assert _has(refused(), "extra.pt is not listed in manifest.json")
    _reseal(step, "extra.pt")  # listed in a rewritten manifest: still not part of a checkpoint
    assert _has(refused(), "extra.pt is not part of a checkpoint")


@pytest.mark.slow
def test_a_shard_that_does_not_match_the_index_is_refused(hostile):
    """A well-formed safetensors file from elsewhere (same tensor names, other shapes), sealed
    into the manifest: the headers are checked against index.json before any worker reads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    step, _, refused = hostile
    bad = step / "rank_00001.safetensors"
    with safe_open(str(bad), framework="pt") as f:
        names = list(f.keys())
    save_file({n: torch.zeros(1) for n in names}, str(bad))
    _reseal(step, "rank_00001.safetensors")
    assert _has(refused(), "rank_00001.safetensors does not hold")


@pytest.mark.slow
def test_a_v2_checkpoint_is_refused_naming_its_format(hostile):
    """A v2 step (DCP `.distcp` files, a pickled `.metadata`, a flat manifest) is refused by
    format; its index is never opened."""
    step, marker, refused = hostile
    for p in [*step.glob("*.safetensors"), step / "index.json"]:
        p.unlink()
    (step / "__0_0.distcp").write_bytes(b"\0" * 64)
    (step / ".metadata").write_bytes(_exploit(marker))
    _rewrite_meta(step, format="moeplan-ckpt-v2")
    (step / "manifest.json").write_text(json.dumps({
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in step.iterdir() if p.name != "manifest.json"}))
    said = refused()
    assert _has(said, "is a moeplan-ckpt-v2 checkpoint") and _has(said, "moeplan-ckpt-v3")


def _edit_index(step: Path, edit) -> None:
    index = json.loads((step / "index.json").read_text())
    edit(index)
    (step / "index.json").write_text(json.dumps(index))


def _first_box(index: dict) -> list:
    return next(t for k, t in index["tensors"].items() if k.startswith("optim/"))["boxes"][0]


@pytest.mark.slow
@pytest.mark.parametrize("damage,needle", [
    (lambda s: (s / "meta.json").write_text('{"format": "moeplan-ckpt-v3", "step": NaN}'),
     "meta.json is not strict JSON"),
    (lambda s: (s / "meta.json").write_text('{"step": 3, "step": 3}'), "a key appears twice"),
    (lambda s: (s / "index.json").write_text("[" * 100_000 + "]" * 100_000),
     "index.json is not"),
    (lambda s: _edit_index(s, lambda i: _first_box(i)[3].__setitem__(0, 10**9)),
     "leaves the shape"),
    (lambda s: _edit_index(s, lambda i: _first_box(i).__setitem__(0, 99)),
     "each box must be [file number"),
    (lambda s: _edit_index(s, lambda i: i["tensors"].__setitem__("x", {
        "shape": [4], "dtype": "F32", "boxes": [[0, "y", [0], [2]]]})), "hold 2 elements"),
    (lambda s: _edit_index(s, lambda i: i["tensors"].__setitem__("x", {
        "shape": [1], "dtype": "PICKLE", "boxes": [[0, "y", [0], [1]]]})), "is not one of"),
    (lambda s: _edit_index(s, lambda i: i["files"].append("../../etc/passwd")),
     "must be distinct rank_NNNNN.safetensors names"),
])
def test_hostile_json_in_a_checkpoint_is_refused_by_the_launcher_check(saved, tmp_path, damage,
                                                                        needle):
    """Malformed, non-strict, deeply nested or out-of-bounds metadata, sealed into a consistent
    manifest, is refused by `verify` (what the launcher runs) with a SpecError, never a crash."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", ckpt)
    step = ckpt / "step_00000003"
    damage(step)
    _reseal(step, "meta.json", "index.json")
    with pytest.raises(SpecError) as e:
        verify(step)
    assert needle in str(e.value)


@pytest.mark.slow
def test_a_symlinked_checkpoint_file_is_refused(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", ckpt)
    step = ckpt / "step_00000003"
    (step / "plan.json").unlink()
    (step / "plan.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(SpecError, match="plan.json is missing"):
        verify(step)


def test_workers_load_exactly_the_step_the_launcher_verified(tmp_path, monkeypatch):
    """The launcher hands the workers the step it verified and its manifest digest: a newer
    sealed step written since is not what they load, and a step rewritten since is refused."""
    import torch.distributed as dist

    from moeplan.runtime import checkpoint, worker
    from moeplan.runtime.groups import local_groups
    from moeplan.runtime.storage import manifest_sha256, step_dir
    from moeplan.runtime.train import Trainer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        plan, ckpt = load_plan(write_plan(tmp_path / "plan.json", 1)), tmp_path / "ckpt"
        trainer = Trainer(plan, local_groups(), seed=0)
        losses = [trainer.step(i)[0].loss for i in range(4)]
        for step in (2, 4):  # the launcher verified step 2; step 4 appeared later
            t = Trainer(plan, local_groups(), seed=0)
            for i in range(step):
                t.step(i)
            checkpoint.save(t, ckpt, step)
        digest = manifest_sha256(step_dir(ckpt, 2))
        resumed = Trainer(plan, local_groups(), seed=0)
        opts = RunOptions(steps=4, ckpt_dir=str(ckpt), resume=True, resume_step=2,
                          resume_manifest=digest)
        assert worker._resume(resumed, opts) == 2
        assert [resumed.step(i)[0].loss for i in (2, 3)] == losses[2:]
        _rewrite_meta(step_dir(ckpt, 2), note="rewritten")
        _reseal(step_dir(ckpt, 2), "meta.json")  # consistent, but not what was verified
        with pytest.raises(SpecError, match="changed after the launcher verified it"):
            worker._resume(Trainer(plan, local_groups(), seed=0), opts)
    finally:
        dist.destroy_process_group()


def test_the_launcher_passes_the_verified_step_to_the_workers(tmp_path):
    """The launcher writes the prepared run once (OUT/run.json); the worker command names only
    that directory, and what a worker reads back is the verified step and the prepared plans."""
    from moeplan.runtime.launch import torchrun_command

    opts = RunOptions(steps=6, ckpt_dir="c", resume=True, resume_step=3, resume_manifest="ab",
                      scale_down=True)
    given, running = prepare_plan(write_plan(tmp_path / "plan.json", 2, tp=2), opts)
    PreparedRun(given, running, opts).write(tmp_path / "out")
    cmd = torchrun_command(opts, tmp_path / "out", 2)
    assert cmd[-2:] == ["moeplan.runtime.worker", str(tmp_path / "out")]
    back = PreparedRun.read(tmp_path / "out")
    assert (back.options.resume_step, back.options.resume_manifest) == (3, "ab")
    assert back.running == running and back.given == given and running != given


def test_run_json_refers_to_the_plan_file_instead_of_copying_it(tmp_path):
    """One form per plan fact: OUT/run.json names OUT/plan.json by SHA-256 (the running plan is
    there only where it differs); a plan file changed after the launch is refused by name."""
    opts = RunOptions(steps=2)
    given, running = prepare_plan(write_plan(tmp_path / "plan.json", 2, tp=2), opts)
    out = tmp_path / "out"
    PreparedRun(given, running, opts).write(out)
    doc = json.loads((out / "run.json").read_text())
    assert set(doc) == {"format", "plan", "running", "options"} and doc["running"] is None
    assert doc["plan"]["file"] == "plan.json" and "model" not in json.dumps(doc["plan"])
    assert PreparedRun.read(out).given == given
    plan = json.loads((out / "plan.json").read_text())
    plan["training"]["lr"] = 0.5
    (out / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(SpecError, match="changed after"):
        PreparedRun.read(out)


def test_the_package_holds_no_pickle_loading_code():
    """No pickle, Unpickler, torch.load, weights_only=False, allow_pickle or DCP FileSystemReader
    anywhere in moeplan's code (comments and prose aside; a module named in a string counts)."""
    banned = re.compile(r"\b(pickle|_pickle|cPickle|dill|cloudpickle|Unpickler|FileSystemReader|"
                        r"allow_pickle)\b|torch\s*\.\s*load\b|weights_only\s*=\s*False")
    modules = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    package = Path(moeplan_errors.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        with open(path, "rb") as f:
            tokens = list(tokenize.tokenize(f.readline))
        code = " ".join(t.string for t in tokens if t.type not in (
            tokenize.COMMENT, tokenize.STRING, tokenize.ENCODING))
        strings = {t.string.strip("\"'") for t in tokens if t.type == tokenize.STRING}
        if banned.search(code) or strings & modules:
            found.append(str(path.relative_to(package)))
    assert found == []
    assert len(list(package.rglob("*.py"))) > 50  # the scan saw the package


# ------------------------------------------------------------------------- real launches (CLI)
@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> dict:
    """A world-2 plan (ep2, half the optimizer states on the host, so resume restores both
    parts), a token file and the uninterrupted run's losses."""
    root = tmp_path_factory.mktemp("launch")
    plan = write_plan(root / "ep2.json", 2, choices=Choices(optimizer_offload_fraction=0.5), ep=2)
    (root / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    write_tokens(np.frombuffer((root / "a.txt").read_bytes(), dtype=np.uint8),
                 root / "corpus.bin", vocab_size=256)  # byte ids, one document
    data = str(root / "corpus.bin")
    r = moeplan("run", plan, "--steps", str(STEPS), "--data", data, "--out", str(root / "straight"))
    assert r.returncode == 0, r.stderr[-3000:]
    return {"root": root, "plan": plan, "data": data,
            "straight": last_per_step(root / "straight" / "metrics.jsonl")}


def moeplan(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=300)


@pytest.mark.slow
def test_three_steps_then_resume_to_six_equals_six_straight_steps_through_the_cli(launch):
    root, common = launch["root"], ["--data", launch["data"], "--ckpt-dir"]
    out, ckpt = root / "parts", str(root / "ckpt_parts")
    r = moeplan("run", launch["plan"], "--steps", "3", "--out", str(out), *common, ckpt,
                "--ckpt-every", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    r = moeplan("run", launch["plan"], "--steps", "6", "--out", str(out), *common, ckpt,
                "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    got = last_per_step(out / "metrics.jsonl")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step, loss in got.items():
        assert abs(loss - launch["straight"][step]) <= 1e-6, step
    assert json.loads((out / "summary.json").read_text())["resumed_from"] == 3


def _worker_pids(marker: str) -> list[int]:
    """Processes running `moeplan.runtime.worker` whose command line mentions `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        argv = cmd.split(" ", 3)  # python -u -c BOOTSTRAP moeplan.runtime.worker OUT
        if argv[1:3] == ["-u", "-c"] and "moeplan.runtime.worker" in cmd and marker in cmd:
            pids.append(int(entry.name))
    return pids


def _wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run did not reach step {step}")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds worker processes through /proc")
def test_a_sigkilled_worker_is_restarted_and_the_run_matches_an_uninterrupted_one(launch):
    root = launch["root"]
    out = root / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeplan", "run", launch["plan"], "--steps", str(STEPS),
         "--data", launch["data"], "--out", str(out), "--ckpt-dir", str(root / "ckpt_killed"),
         "--ckpt-every", "4", "--max-restarts", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(out / "metrics.jsonl", 6, proc)
    victim = max(_worker_pids(str(out)))
    os.kill(victim, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "resumed at step" in " ".join(stderr.split())  # restarted workers loaded a checkpoint
    got = last_per_step(out / "metrics.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - launch["straight"][step]) <= 1e-6, step


@pytest.mark.slow
def test_sigterm_on_the_launcher_checkpoints_at_the_next_step_and_exits_75(launch):
    root = launch["root"]
    out, ckpt = root / "preempted", root / "ckpt_preempted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeplan", "run", launch["plan"], "--steps", str(STEPS),
         "--data", launch["data"], "--out", str(out), "--ckpt-dir", str(ckpt)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(out / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]  # preempted (docs/RUNTIME.md)
    at = json.loads((out / "summary.json").read_text())["preempted_at"]
    assert 3 <= at < STEPS
    assert complete_steps(ckpt) == [at]
    assert max(last_per_step(out / "metrics.jsonl")) == at


def test_the_run_stops_after_the_configured_non_finite_steps_in_a_row(tmp_path, monkeypatch,
                                                                      capsys):
    from moeplan.runtime import worker
    from moeplan.runtime.train import Trainer

    class PoisonedFromStep3(Trainer):
        def step(self, step, capture_grads=False):
            if step == 2:  # every later loss is NaN
                self.model.register_forward_hook(
                    lambda _m, _i, terms: replace(terms, ce_sum=terms.ce_sum * float("nan")))
            return super().step(step, capture_grads)

    with socket.socket() as sock:  # a free port for a one-process gloo group
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    monkeypatch.setattr(worker, "Trainer", PoisonedFromStep3)
    monkeypatch.setattr(worker.signal, "signal", lambda *_: None)  # keep pytest's SIGTERM
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                       "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    opts = RunOptions(steps=10, max_nonfinite_steps=2)
    with pytest.raises(SystemExit) as e:
        worker.run_worker(PreparedRun(*prepare_plan(write_plan(tmp_path / "plan.json", 1), opts),
                                      opts), out)
    assert e.value.code == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("skipped", False) for r in rows] == [False, False, True, True]
    assert "2 steps in a row" in " ".join(capsys.readouterr().err.split())


# ------------------------------------------------- one rule for list, export and resume (CLI)
@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> dict:
    """A world-2 (ep2) run saved at steps 3 and 6, as `moeplan run` writes it."""
    root = tmp_path_factory.mktemp("two_steps")
    plan = write_plan(root / "ep2.json", 2, ep=2)
    r = moeplan("run", plan, "--steps", "6", "--out", str(root / "out"), "--ckpt-dir",
                str(root / "ckpt"), "--ckpt-every", "3", "--seed", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    return {"root": root, "plan": plan, "ckpt": root / "ckpt"}


def _copy(two_steps: dict, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_steps["ckpt"], ckpt)
    return ckpt


def _listed(ckpt: Path) -> list[dict]:
    r = moeplan("checkpoint", "list", str(ckpt), "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return json.loads(r.stdout)["checkpoints"]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_damaged_newest_step_is_listed_damaged_and_refused_by_export_and_resume_alike(
        two_steps, tmp_path):
    """Steps 3 and 6 saved, a shard of step 6 lost: export used to export step 3 without a
    word and list to hide step 6, while --resume refused it. One rule now: list says step 6 is
    damaged and why, export and --resume refuse it by name and point at step 3."""
    ckpt = _copy(two_steps, tmp_path)
    (ckpt / "step_00000006" / "rank_00001.safetensors").unlink()
    rows = _listed(ckpt)
    assert [(r["step"], r["state"], r["usable"]) for r in rows] == [
        (3, "usable", True), (6, "damaged", False)]
    assert "rank_00001.safetensors is missing" in rows[1]["problem"] and rows[1]["newest"]
    hf = tmp_path / "hf"
    r = moeplan("checkpoint", "export", str(ckpt), "--to", "hf", "-o", str(hf))
    said = _flat(r.stderr)
    assert r.returncode == 2 and "Traceback" not in r.stderr and not hf.exists(), said
    assert "step_00000006" in said and "rank_00001.safetensors is missing" in said
    assert "--step 3" in said
    r = moeplan("run", two_steps["plan"], "--steps", "8", "--seed", "3", "--out",
                str(tmp_path / "out"), "--ckpt-dir", str(ckpt), "--resume")
    said = _flat(r.stderr)
    assert r.returncode == 2 and "Traceback" not in r.stderr, said
    assert "step_00000006" in said and "rank_00001.safetensors is missing" in said
    assert "newest usable step is 3" in said
    r = moeplan("checkpoint", "export", str(ckpt), "--to", "hf", "-o", str(hf), "--step", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (hf / "config.json").is_file()
    assert [r["step"] for r in _listed(ckpt)] == [3, 6]  # nothing was removed


def test_checkpoint_list_names_every_step_directory_and_the_layout_in_the_plan_vocabulary(
        two_steps, tmp_path):
    ckpt = _copy(two_steps, tmp_path)
    shutil.copytree(ckpt / "step_00000006", ckpt / "step_00000009")
    (ckpt / "step_00000009" / "manifest.json").unlink()  # not a checkpoint
    rows = _listed(ckpt)
    assert [(r["step"], r["state"]) for r in rows] == [
        (3, "usable"), (6, "usable"), (9, "not a checkpoint")]
    plan = load_plan(two_steps["plan"])
    assert rows[0]["layout"] == plan.summary()  # e.g. `tp1 cp1 dp2 pp1 ep2 etp1 edp1 …`
    assert rows[0]["layout"].startswith("tp1 cp1 dp2 pp1 ep2 etp1 edp1 mbs")
    assert rows[1]["newest"] and "no manifest.json" in rows[2]["problem"]
    text = moeplan("checkpoint", "list", str(ckpt)).stdout
    assert "--resume and checkpoint export take step 6" in _flat(text)


def test_checkpoint_list_verifies_every_step_without_importing_torch(two_steps, tmp_path):
    """Listing reads each step's JSON and hashes its files, nothing more, so its process never
    imports torch, and it says what it said before."""
    ckpt = _copy(two_steps, tmp_path)
    (ckpt / "step_00000006" / "rank_00001.safetensors").unlink()
    r = run_cli_without_torch("checkpoint", "list", str(ckpt), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["checkpoints"]
    assert [(x["step"], x["state"]) for x in rows] == [(3, "usable"), (6, "damaged")]
    assert rows[1]["newest"] and "rank_00001.safetensors is missing" in rows[1]["problem"]


def test_export_of_a_step_directory_says_to_give_the_directory_and_the_step(two_steps,
                                                                          tmp_path):
    """It used to say "no complete checkpoint", which sent the user looking for damage."""
    step = two_steps["ckpt"] / "step_00000006"
    r = moeplan("checkpoint", "export", str(step), "--to", "hf", "-o", str(tmp_path / "hf"))
    said = _flat(r.stderr)
    assert r.returncode == 2 and "no complete checkpoint" not in said, said
    assert f"export {two_steps['ckpt']} --step 6" in said and "give the directory" in said
    r = moeplan("checkpoint", "list", str(step))
    assert r.returncode == 2 and f"list {two_steps['ckpt']}" in _flat(r.stderr)


def _rank_file_with_rng(step: Path) -> Path:
    index = json.loads((step / "index.json").read_text())
    return step / index["files"][index["tensors"]["rng/torch"]["boxes"][0][0]]


def _rewrite_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _split_safetensors(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8: 8 + n]), blob[8 + n:]


def _trailing(header: dict, data: bytes) -> tuple[dict, bytes]:
    return header, data + b"\0" * 8


def _overlapping(header: dict, data: bytes) -> tuple[dict, bytes]:
    names = sorted((k for k in header if k != "__metadata__"),
                   key=lambda k: header[k]["data_offsets"][0])
    last = next(k for k in reversed(names) if header[k]["data_offsets"][1]
                > header[k]["data_offsets"][0] >= 8)
    a, b = header[last]["data_offsets"]
    header[last]["data_offsets"] = [a - 4, b - 4]  # reaches into the tensor before it
    return header, data[:-4]


def _metadata_not_strings(header: dict, data: bytes) -> tuple[dict, bytes]:
    header["__metadata__"] = {"format": 5}
    return header, data


@pytest.mark.parametrize("damage,needle", [
    (_trailing, "after its last tensor"),
    (_overlapping, "not where the previous tensor ends"),
    (_metadata_not_strings, "__metadata__"),
])
def test_a_rank_file_safetensors_refuses_is_refused_by_the_check_before_any_worker(
        two_steps, tmp_path, damage, needle):
    """Trailing bytes, overlapping ranges or a non-string __metadata__ (manifest resealed)
    passed the check, then failed inside safe_open: a SafetensorError traceback on export,
    dead workers on resume. The check now accepts exactly what safetensors accepts."""
    from safetensors import safe_open

    ckpt = _copy(two_steps, tmp_path)
    step = ckpt / "step_00000006"
    bad = step / "rank_00001.safetensors"
    _rewrite_safetensors(bad, *damage(*_split_safetensors(bad)))
    _reseal(step, bad.name)
    with pytest.raises(Exception), safe_open(str(bad), framework="pt") as f:  # noqa: B017
        for name in f.keys():  # noqa: SIM118  (the control: safetensors refuses it too)
            f.get_tensor(name)
    with pytest.raises(SpecError, match=needle):
        verify(step)
    r = moeplan("checkpoint", "export", str(ckpt), "--to", "hf", "-o", str(tmp_path / "hf"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in _flat(r.stderr)
    r = moeplan("run", two_steps["plan"], "--steps", "8", "--seed", "3", "--out",
                str(tmp_path / "out"), "--ckpt-dir", str(ckpt), "--resume")
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in _flat(r.stderr)
    assert not (tmp_path / "out").exists()  # refused before any worker started


def test_the_header_check_accepts_exactly_what_safetensors_opens(tmp_path):
    """Random edits of a small safetensors file (offsets, sizes, dtypes, shapes, metadata,
    trailing or missing bytes): `read_safetensors_header` accepts a file exactly when the
    safetensors library opens it and reads every tensor (ours may be stricter only where
    moeplan never writes such a file: dtypes and key order)."""
    import random

    from safetensors import safe_open
    from safetensors.torch import save_file

    from moeplan.runtime.storage import read_safetensors_header

    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16),
               "c": torch.zeros(0), "d": torch.arange(6, dtype=torch.int64)}, str(path),
              metadata={"format": "pt"})
    header, data = _split_safetensors(path)
    rng = random.Random(0)
    agree = 0
    for trial in range(300):
        h, d = json.loads(json.dumps(header)), data
        for _ in range(rng.randint(1, 2)):
            key = rng.choice(["a", "b", "c", "d"])
            edit = rng.randrange(6)
            if edit == 0:
                h[key]["data_offsets"] = [o + rng.choice([-4, -2, 2, 4]) for o in
                                          h[key]["data_offsets"]]
            elif edit == 1:
                h[key]["data_offsets"][1] += rng.choice([-2, 2])
            elif edit == 2:
                d = d + b"\0" * rng.choice([1, 2, 8]) if rng.random() < 0.5 else d[:-2]
            elif edit == 3:
                h[key]["shape"] = [*h[key]["shape"][:-1], max(0, h[key]["shape"][-1] - 1)] \
                    if h[key]["shape"] else [1]
            elif edit == 4:
                h["__metadata__"] = rng.choice([{"format": 5}, {"x": None}, ["pt"],
                                                {"format": "pt", "k": "v"}])
            else:
                h[key]["dtype"] = rng.choice(["F32", "F16", "I64", "U8"])
        _rewrite_safetensors(path, h, d)
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    f.get_tensor(name)
            theirs = True
        except Exception:
            theirs = False
        try:
            read_safetensors_header(path, tmp_path)
            ours = True
        except SpecError:
            ours = False
        assert ours == theirs, (trial, h, len(d))
        agree += ours
    assert 0 < agree < 300  # both verdicts occurred


def test_a_garbage_rng_state_is_refused_before_any_worker(two_steps, tmp_path):
    """An rng/torch of 0xFF bytes (manifest resealed) gave an "Invalid mt19937 state"
    traceback in a worker; the launcher's check refuses it now."""
    ckpt = _copy(two_steps, tmp_path)
    step = ckpt / "step_00000006"
    path = _rank_file_with_rng(step)
    header, data = _split_safetensors(path)
    a, b = header["rng/torch#0"]["data_offsets"]
    _rewrite_safetensors(path, header, data[:a] + b"\xff" * (b - a) + data[b:])
    _reseal(step, path.name)
    r = moeplan("run", two_steps["plan"], "--steps", "8", "--seed", "3", "--out",
                str(tmp_path / "out"), "--ckpt-dir", str(ckpt), "--resume")
    said = _flat(r.stderr)
    assert r.returncode == 2 and "Traceback" not in r.stderr, said
    assert "RNG state" in said and "mt19937" not in said and not (tmp_path / "out").exists()
    assert [(x["step"], x["usable"]) for x in _listed(ckpt)] == [(3, True), (6, False)]


def test_the_rng_check_accepts_exactly_what_torch_accepts():
    import random

    from moeplan.runtime.storage import rng_state_problem

    good = torch.get_rng_state()
    rng = random.Random(1)
    verdicts = set()
    for _ in range(300):
        state = bytearray(good.numpy().tobytes())
        for _ in range(rng.randint(1, 3)):
            at = rng.choice([8, 9, 10, 11, 12, 13, 16, 17, 18, 20, rng.randrange(len(state))])
            state[at] = rng.choice([0, 1, 2, 0x70, 0xFF])
        if rng.random() < 0.05:
            state = state[: rng.choice([5048, 100])]
        try:
            torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
            theirs = True
        except RuntimeError:
            theirs = False
        ours = rng_state_problem(bytes(state)) is None
        assert ours == theirs, bytes(state[:24]).hex()
        verdicts.add(ours)
    torch.set_rng_state(good)
    assert verdicts == {True, False}


def test_steps_past_1e8_are_seen_in_order_by_resume_list_and_prune(two_steps, tmp_path):
    """Step 100,000,000 is named with 9 digits; the scanner expected 8, so resume, list and
    prune never saw it."""
    from moeplan.runtime.storage import prune, resume_point, step_dir, step_of

    ckpt = _copy(two_steps, tmp_path)
    for big in (99_999_999, 100_000_000):
        step = step_dir(ckpt, big)
        shutil.copytree(ckpt / "step_00000006", step)
        _rewrite_meta(step, step=big)
        _reseal(step, "meta.json")
    assert step_dir(ckpt, 100_000_000).name == "step_100000000"
    assert step_of("step_000000003") is None  # not the name of step 3
    assert complete_steps(ckpt) == [3, 6, 99_999_999, 100_000_000]
    assert resume_point(ckpt)[0] == step_dir(ckpt, 100_000_000)
    assert verify(step_dir(ckpt, 100_000_000)).step == 100_000_000
    rows = _listed(ckpt)
    assert [r["step"] for r in rows if r["usable"]] == [3, 6, 99_999_999, 100_000_000]
    prune(ckpt, keep=2)
    assert complete_steps(ckpt) == [99_999_999, 100_000_000]


def test_a_killed_exports_leftover_is_removed_by_the_next_export_there(two_steps, tmp_path):
    """A killed export left its `.OUT.tmp-*` directory behind forever."""
    import socket

    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = [tmp_path / ".hf.tmp-0badc0de", tmp_path / f".hf.tmp-{host}-{dead}-0badc0de"]
    live = tmp_path / f".hf.tmp-{host}-{os.getpid()}-0badc0de"  # an export in progress
    other = tmp_path / ".hf2.tmp-0badc0de"  # another output's
    for d in (*stale, live, other):
        d.mkdir()
        (d / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    r = moeplan("checkpoint", "export", str(two_steps["ckpt"]), "--to", "hf", "-o",
                str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert not any(d.exists() for d in stale) and live.is_dir() and other.is_dir()


@pytest.mark.parametrize("columns", [60, 120])
def test_checkpoint_list_fits_the_terminal_and_says_what_is_wrong(two_steps, tmp_path, columns):
    """In a terminal of `columns` columns: no line wider, the damaged step's problem folded
    under its row rather than cut, and the line saying what --resume and export do."""
    from rich.cells import cell_len

    from .test_cli_terminal import render_in_pty

    ckpt = _copy(two_steps, tmp_path)
    (ckpt / "step_00000006" / "rank_00001.safetensors").unlink()
    screen = render_in_pty(("checkpoint", "list", str(ckpt)), columns)
    assert all(cell_len(line) <= columns for line in screen.split("\n")), screen
    flat = _flat(screen)
    assert "6 (newest) damaged" in flat and "rank_00001.safetensors is missing" in flat
    assert ("the newest step, 6, is damaged: --resume and export refuse it; export an earlier "
            "one with --step 3") in flat
    assert load_plan(two_steps["plan"]).layout_summary() in flat or columns < 100
