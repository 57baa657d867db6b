"""TensorBoard scalars land under Megatron-LM's own tags: the same scalars written by
`torch.utils.tensorboard` (the writer Megatron-LM uses) with the tags Megatron's
`training_log` and `evaluate_and_print_results` pass read back, through TensorBoard's own
EventAccumulator, as the same tags, steps and values as moeplan's files."""

from __future__ import annotations

import math
import warnings

import pytest

pytest.importorskip("tensorboardX")
pytest.importorskip("tensorboard")

from moeplan.runtime.tblog import TensorBoard  # noqa: E402

GBS = 8
RECORDS = [{"loss": 10.5 - s * 0.25, "lr": 1e-4 * s, "grad_norm": 3.0 / s, "step_time_s": 0.5,
            "tflops_per_gpu": 400.0 + s, "aux_loss": 0.01 * s,
            "load_balancing_loss": 1.0 + 0.1 * s, "tokens_per_s": 1e5,
            "peak_mem_gb": 12.5, "load_imbalance": 1.25, "mfu": 0.4} for s in (1, 2, 3)]
EVALUATIONS = {2: 9.75, 3: 9.5}


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def megatron_writes(logdir) -> None:
    """What Megatron-LM (megatron/training/training.py) writes for the same steps."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(logdir))
    for step, r in enumerate(RECORDS, start=1):
        samples = step * GBS
        writer.add_scalar("learning-rate", r["lr"], step)
        writer.add_scalar("learning-rate vs samples", r["lr"], samples)
        writer.add_scalar("batch-size", GBS, step)
        writer.add_scalar("batch-size vs samples", GBS, samples)
        writer.add_scalar("lm loss", r["loss"], step)
        writer.add_scalar("lm loss vs samples", r["loss"], samples)
        writer.add_scalar("grad-norm", r["grad_norm"], step)
        writer.add_scalar("grad-norm vs samples", r["grad_norm"], samples)
        writer.add_scalar("load_balancing_loss", r["load_balancing_loss"], step)
        writer.add_scalar("iteration-time", r["step_time_s"], step)
        writer.add_scalar("throughput", r["tflops_per_gpu"], step)
        if step in EVALUATIONS:
            loss = EVALUATIONS[step]
            writer.add_scalar("lm loss validation", loss, step)
            writer.add_scalar("lm loss validation vs samples", loss, samples)
            writer.add_scalar("lm loss validation ppl", math.exp(loss), step)
            writer.add_scalar("lm loss validation ppl vs samples", math.exp(loss), samples)
    writer.close()


def test_every_tag_megatron_writes_for_a_step_reads_back_the_same_from_moeplans_files(tmp_path):
    tb = TensorBoard(tmp_path / "moeplan", GBS)
    for step, record in enumerate(RECORDS, start=1):
        tb.step(step, record)
        if step in EVALUATIONS:
            tb.evaluation(step, EVALUATIONS[step])
    tb.close()
    megatron_writes(tmp_path / "megatron")
    ours, theirs = scalars(tmp_path / "moeplan"), scalars(tmp_path / "megatron")
    assert "lm loss" in theirs and "lm loss validation" in theirs  # spaces kept by Megatron's
    missing = sorted(set(theirs) - set(ours))
    assert not missing, missing
    for tag, points in theirs.items():
        assert [s for s, _ in ours[tag]] == [s for s, _ in points], tag
        assert [v for _, v in ours[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag
    # moeplan's own figures, which Megatron has no tag for
    assert set(ours) - set(theirs) == {"tokens-per-second", "mfu", "mem-peak-gigabytes",
                                       "moe/load-imbalance"}


def test_a_non_finite_step_value_is_left_out_and_a_huge_validation_loss_has_no_perplexity(
        tmp_path):
    tb = TensorBoard(tmp_path, GBS)
    tb.step(1, {**RECORDS[0], "loss": math.nan, "grad_norm": math.inf})
    tb.evaluation(1, 800.0)
    tb.close()
    got = scalars(tmp_path)
    assert "lm loss" not in got and "grad-norm" not in got and "lm loss vs samples" not in got
    assert got["lm loss validation"] == [(1, 800.0)]
    assert "lm loss validation ppl" not in got


def test_a_log_disk_that_fills_mid_run_stops_tensorboard_with_one_warning_not_the_training(
        tmp_path):
    """tensorboardX's asynchronous writer failed in a thread of its own and again at exit, and
    the run died with two tracebacks; now the failing write is answered where it happens."""
    from rich.console import Console

    from moeplan.runtime.options import RunOptions
    from moeplan.runtime.runlog import RunLog
    from moeplan.runtime.train import StepMetrics

    console = Console(record=True, width=200)
    log = RunLog(tmp_path, RunOptions(steps=3, tensorboard_dir=str(tmp_path / "tb")), console,
                 None, GBS)
    log.tb.writer._py_recordio_writer._writer = open("/dev/full", "wb")  # noqa: SIM115 (ENOSPC)
    for s in (1, 2, 3):
        log.step(StepMetrics(step=s, loss=1.0, grad_norm=1.0, lr=1e-3, step_time_s=1.0,
                             tokens_per_s=1.0, tflops_per_gpu=1.0, peak_mem_gb=1.0), None)
    log.close()
    text = console.export_text()
    assert text.count("warning:") == 1 and "failed at step 1" in text, text
    assert "No space left on device" in log.tb_error
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_tensorboard_dir_that_cannot_be_made_is_refused_naming_the_flag(tmp_path):
    from moeplan.errors import SpecError

    (tmp_path / "file").write_text("")
    with pytest.raises(SpecError, match="--tensorboard-dir .*cannot write there"):
        TensorBoard(tmp_path / "file" / "tb", GBS)
