"""One torchrun worker: init the process group, build groups, model and optimizer, train,
write metrics.jsonl / summary.json / routing.json (rank 0).

A worker only reads the run the launcher prepared (`options.PreparedRun`: OUT/run.json, or
handed over in-process when `moeplan run` is itself a rank of a torchrun/SLURM launch); it never
loads, validates or scales the plan again. gloo on CPU, NCCL on GPU (one device per local rank);
the code path is otherwise identical.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import limits
from ..data.corpus import SAMPLER
from ..errors import MoeplanError, SpecError
from ..fsio import finite_or_null, write_json
from ..specs import ClusterSpec, Plan
from ..specs.grid import RankGrid
from . import checkpoint
from .groups import build_groups
from .lifecycle import AGENT_PID_ENV, pending_stop, set_parent_death_signal, stop_exit_code
from .options import DIST_TIMEOUT_MINUTES, PreparedRun, RunOptions
from .runlog import RunLog, eval_due, peak_tflops
from .storage import LOCKED_ENV, CkptLock, manifest_sha256, newest_checkpoint, step_dir
from .train import StepMetrics, Trainer


def _device() -> torch.device:
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        return dev
    if "OMP_NUM_THREADS" not in os.environ:  # the launcher sets it: cores / local workers
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, limits.usable_cpus() // local))
    return torch.device("cpu")


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # --dtype's words


def run_worker(run: PreparedRun, out: Path) -> int | None:
    """Train `run.options.steps` steps of the prepared run as this process's rank (environment
    set by torchrun).

    Returns the signal (SIGTERM/SIGINT) the ranks agreed to stop on, None when the run
    reached its last step."""
    stop = _StopOnSignal()  # from the start: a stop during set-up waits for the first step
    given, running, opts = run.given, run.running, run.options
    assert opts.steps is not None  # resolved by the launcher (settings.apply_settings)
    device = _device()
    dtype = {name: d for d, name in DTYPE_NAMES.items()}[
        opts.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if not dist.is_initialized():
        _init_process_group(device, opts.distributed_timeout_minutes)
    rank0 = dist.get_rank() == 0
    lock = _lock_ckpt_dir(opts, out, device)  # held until this process exits
    groups = build_groups(RankGrid.from_layout(running.layout),
                          domain=running.cluster.usable_domain(running.layout.world_size),
                          timeout=timedelta(minutes=opts.distributed_timeout_minutes))
    assert groups is not None
    trainer = Trainer(running, groups, seed=opts.seed, dtype=dtype, device=device,
                      data=opts.data, init_from=opts.init_from, split=opts.split,
                      valid_data=opts.valid_data)
    start = _resume(trainer, opts)
    stop.on(device)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        from ..terminal import make_console

        console = make_console(stderr=True, highlight=False)  # piped: one line per step
        console.print(f"[b]moeplan run[/] {running.model.name}: world {dist.get_world_size()} "
                      f"({running.summary()}), {device.type}/{dist.get_backend()}, "
                      f"{str(dtype).removeprefix('torch.')}, {opts.steps} steps → {out}"
                      + (f", resumed at step {start}" if start else ""))
        console.print(f"kernels: {trainer.kernels.reason}")
        console.print(objective_line(running))
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        log = RunLog(out, opts, console, peak_tflops(running, device.type, gpu, opts.cluster),
                     running.training.global_batch_size)
        if opts.ckpt_dir and opts.tokenizer_model:  # for `checkpoint export --to hf`
            from .hf_io import keep_tokenizer

            keep_tokenizer(opts.tokenizer_model, opts.ckpt_dir)
    history: list[StepMetrics] = []
    bad, preempted_at, stop_sig, stop_ckpt = 0, 0, 0, None
    for step in range(start, opts.steps):
        metrics, _ = trainer.step(step)
        history.append(metrics)
        bad = bad + 1 if metrics.skipped else 0
        eval_loss = (trainer.evaluate(opts.batches_per_eval) if eval_due(metrics.step, opts)
                     else None)
        if rank0:
            log.step(metrics, eval_loss)
        if bad >= opts.max_nonfinite_steps:
            if rank0:
                console.print(f"[bold red]error:[/] {bad} steps in a row (to step "
                              f"{metrics.step}) had a non-finite loss or gradient; stopping. "
                              "Resume from the last checkpoint with a lower lr or other data.")
            dist.destroy_process_group()
            raise SystemExit(1)
        stop_sig = stop.agreed()
        preempt = bool(stop_sig) and metrics.step < opts.steps  # the last step just finishes
        done = metrics.step
        if opts.ckpt_dir and (preempt or done == opts.steps
                              or (opts.ckpt_every and done % opts.ckpt_every == 0)):
            path = checkpoint.save(trainer, opts.ckpt_dir, done, keep=opts.ckpt_keep,
                                   extra={"data": opts.data, "split": opts.split,
                                          "sampler": SAMPLER, "preempted": preempt,
                                          "dtype": DTYPE_NAMES[dtype]})
            if preempt:
                stop_ckpt = str(path)  # the launcher's one stop line names it
            elif rank0:
                console.print(f"checkpoint {path}")
        if preempt:
            preempted_at = done
            break
        stop_sig = 0
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if not history:  # resumed (after a restart) at the last step: nothing left to train
        if rank0:
            write_json(out / "summary.json", {
                "model": running.model.name, "world_size": dist.get_world_size(),
                "layout": running.summary(), "steps": opts.steps, "resumed_from": start,
                "restarts": restarts, "measured": {}, "predicted": None, "evaluations": [],
                "notes": [f"resumed at step {start}, the last: the attempt before this one "
                          f"trained every step and saved step {start}, then failed; this "
                          "attempt had nothing left to train, so it measured nothing"]})
        dist.barrier()
        dist.destroy_process_group()
        return None
    peak = torch.tensor([max(m.peak_mem_gb for m in history)], dtype=torch.float64,
                        device=device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)  # every rank's peak, in rank order
    if rank0:
        routing = {"layers": [
            {"layer": i, "tokens_per_expert": trainer.routing_totals[j].tolist()}
            for j, i in enumerate(trainer.moe_layer_numbers)  # MTP depth k: layer L + k
        ], "steps": opts.steps}
        write_json(out / "routing.json", routing, indent=1)
        summary = _summary(given, running, history, [float(p) for p in peaks], device, dtype,
                           opts)
        skipped = sum(m.skipped for m in history)
        if skipped:
            summary["notes"].append(
                f"{skipped} step(s) had a non-finite loss or gradient and applied no update "
                "(marked `skipped` in metrics.jsonl)")
        if restarts:
            summary["notes"].append(
                f"the workers were restarted {restarts} time(s) (--max-restarts); these "
                f"figures are the last attempt's, from step {start}")
        summary.update(resumed_from=start, restarts=restarts, skipped_steps=skipped,
                       preempted_at=preempted_at,
                       stopped_by=signal.Signals(stop_sig).name if stop_sig else None,
                       stop_checkpoint=stop_ckpt, precision=running.training.precision,
                       kernel_backend=trainer.kernels.backend.name)
        summary["evaluations"] = log.evaluations
        log.close()
        if log.tb_error:
            summary["notes"].append(log.tb_error)
        write_json(out / "summary.json", finite_or_null(summary))
    dist.barrier()
    dist.destroy_process_group()
    if lock is not None:
        lock.release()
    return stop_sig or None


def _lock_ckpt_dir(opts: RunOptions, out: Path, device: torch.device) -> CkptLock | None:
    """Global rank 0 locks --ckpt-dir for the run (storage.CkptLock) unless the launcher of
    the whole run holds it already (a single-node `moeplan run`); several nodes, or a torchrun
    or SLURM launch that `moeplan run` joins, have no such launcher. Collective: a lock held
    by another run refuses the run on every rank alike."""
    if not opts.ckpt_dir or os.environ.get(LOCKED_ENV) == "1":
        return None
    lock, error = None, None
    if dist.get_rank() == 0:
        try:
            lock = CkptLock(opts.ckpt_dir, f"moeplan run --out {out}").acquire()
        except SpecError as e:
            error = str(e)
    error = checkpoint.broadcast_json(error, device)  # type: ignore[assignment]
    if error:
        raise checkpoint.Agreed(str(error))
    return lock


def _init_process_group(device: torch.device,
                        timeout_minutes: float = DIST_TIMEOUT_MINUTES) -> None:
    """NCCL on GPU, gloo on CPU, from torchrun's environment; a collective that waits longer
    than `timeout_minutes` for a peer (a hung or stopped rank) fails the run.

    After a torchrun restart the workers reconnect to the agent's store, which still holds the
    previous attempt's keys (process-group addresses under the same names); a prefix per
    attempt keeps the new groups from reading them and connecting to dead peers.
    """
    backend, kw = ("nccl", {"device_id": device}) if device.type == "cuda" else ("gloo", {})
    kw["timeout"] = timedelta(minutes=timeout_minutes)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=timedelta(minutes=timeout_minutes))
        dist.init_process_group(backend, store=dist.PrefixStore(f"moeplan/attempt_{restart}",
                                                                base),
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), **kw)
    else:
        dist.init_process_group(backend, **kw)


def _resume(trainer: Trainer, opts: RunOptions) -> int:
    """Load the step the launcher verified (`opts.resume_step`, checked against its manifest
    digest), or after a torchrun restart the newest checkpoint, which rank 0 verifies
    completely; return the step to continue from (0 when there is none).

    Rank 0 decides and every rank loads that one directory: no rank picks a checkpoint alone.
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not opts.ckpt_dir or not (opts.resume or restarted):
        return 0
    found: dict = {"path": None, "manifest": opts.resume_manifest}
    if dist.get_rank() == 0:
        try:
            if restarted or opts.resume_step is None:  # a checkpoint written by this run, or
                path = newest_checkpoint(opts.ckpt_dir)  # a worker started without a launcher
                found["manifest"] = manifest_sha256(path) if path else None
            else:
                path = step_dir(opts.ckpt_dir, opts.resume_step) if opts.resume_step else None
            if path is not None and opts.resume_step and \
                    int(path.name.removeprefix("step_")) < opts.resume_step:
                raise SpecError(f"{path} is older than step {opts.resume_step}, which the "
                                "launcher verified; the checkpoint directory changed.")
            found["path"] = str(path) if path else None
        except SpecError as e:
            found = {"error": str(e)}
    found = checkpoint.broadcast_json(found, trainer.device)  # type: ignore[assignment]
    if "error" in found:
        raise checkpoint.Agreed(found["error"])
    if found["path"] is None:
        return 0
    return checkpoint.load(trainer, found["path"], manifest_sha256=found["manifest"])


class _StopOnSignal:
    """SIGTERM (preemption) or SIGINT (Ctrl-C; the launcher passes both on) records the signal;
    at each step boundary the ranks agree on it (max over the world), so they all stop after,
    and checkpoint, the same step. Installed before set-up, so a stop then waits for the first
    step instead of killing the process mid-initialisation."""

    def __init__(self) -> None:
        # a stop this process got before now (`lifecycle.BOOTSTRAP` records it from the
        # interpreter's start), or that reached the agent before it started this worker
        self.seen = pending_stop()
        self.flag: torch.Tensor | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def on(self, device: torch.device) -> None:
        self.flag = torch.zeros(1, device=device)

    def _handle(self, signum: int, _frame: object) -> None:
        if self.seen and self.flag is None:
            # a second stop while still setting up (a rendezvous whose peers never come):
            # no step boundary may ever arrive, so this one is obeyed at once
            os._exit(stop_exit_code(signum))
        self.seen = max(self.seen, int(signum))

    def agreed(self) -> int:
        """The stop signal some rank received (0: none), the same on every rank."""
        assert self.flag is not None
        self.flag.fill_(float(self.seen))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)
        return int(self.flag.item())


def numa_bound(device: torch.device) -> bool | None:
    """Whether this worker runs only on CPUs of its GPU's NUMA node, as `moeplan run` binds its
    workers and the runs the host launch time is priced on were bound (`launch.numa_binding`);
    None on a CPU, which has no GPU to be near."""
    from .guard import numa_cpus, pci_address

    if device.type != "cuda" or not hasattr(os, "sched_getaffinity"):
        return None
    bus = pci_address(torch.cuda.get_device_properties(device))
    mine = os.sched_getaffinity(0)
    return bus is not None and bool(mine) and numa_cpus(bus, allowed=mine) == mine


def _summary(given: Plan, running: Plan, history: list[StepMetrics], peaks_gb: list[float],
             device: torch.device, dtype: torch.dtype, opts: RunOptions) -> dict:
    """Measured figures (median step after the first) next to the plan's predictions, and
    their ratios measured/predicted (peak memory: the busiest rank; on CPU it is the process's
    peak RSS, so the ratio says little there)."""
    steady = history[1:] or history
    step_s = statistics.median(m.step_time_s for m in steady)
    tokens = running.training.global_batch_size * running.training.seq_len
    world = running.layout.world_size
    if opts.scale_down:
        predicted, notes, priced_on = _predicted_here(running, device, dtype, opts)
    else:
        est, notes = given.estimate, []
        priced_on = None if est is None else given.cluster
        predicted = None if est is None else {
            "step_time_s": est.step_time_s, "tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
            "tflops_per_gpu": est.tflops_per_gpu, "peak_mem_gb": est.memory.peak_gb,
        }
        if predicted is not None:
            gpus = given.cluster.num_gpus or given.layout.world_size
            notes.append(f"predicted figures are for {gpus} × {given.cluster.gpu}; measured on "
                         f"{device.type}")
        if est is not None and est.interval is not None:
            predicted["step_time_interval_s"] = list(est.interval.step_time_s)
    # a step is judged against an interval priced for its own kind of device only
    judged = priced_on is not None and priced_on.device_kind == device.type
    if priced_on is not None and not judged:
        notes.append(f"the step time is not judged against the predicted interval: that is "
                     f"priced for {priced_on.gpu} ({priced_on.device_kind}), this step ran on "
                     f"{device.type}")
    notes = [objective_line(running), *notes]
    bound = numa_bound(device)
    if bound is False:
        notes.append("rank 0 ran unbound to its GPU's NUMA node: the predicted step prices the "
                     "host's kernel launches from bound ranks (docs/RUNTIME.md, CPU binding)")
    if opts.init_from:
        notes.append(f"initialised from the Hugging Face checkpoint {opts.init_from}")
    band = (predicted or {}).get("step_time_interval_s") if judged else None
    return {
        "model": running.model.name, "world_size": world, "layout": running.summary(),
        "steps": opts.steps, "device": device.type, "dtype": str(dtype).removeprefix("torch."),
        "seed": opts.seed, "scaled_down": opts.scale_down, "numa_bound": bound,
        "measured": {
            "step_time_s": step_s, "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_gpu": tokens / step_s / world,
            "tflops_per_gpu": running.model.flops_per_token(running.training.seq_len) * tokens
            / step_s / world / 1e12,
            "peak_mem_gb": max(peaks_gb), "peak_mem_gb_per_rank": peaks_gb,
            "first_loss": history[0].loss, "final_loss": history[-1].loss,
        },
        "predicted": predicted,
        "ratio": None if predicted is None else {
            key: _ratio(value, predicted[key]) for key, value in
            (("step_time_s", step_s), ("peak_mem_gb", max(peaks_gb))) if key in predicted
        },
        # null: no interval, or one priced for another kind of device than this run's
        "inside_interval": None if not band else band[0] <= step_s <= band[1],
        # the cluster the predicted step time was priced on (`calibrate --from-runs` re-prices
        # the run on it); null: no step-time prediction
        "predicted_cluster": None if priced_on is None else priced_on.model_dump(mode="json"),
        "notes": notes,
    }


def _predicted_here(running: Plan, device: torch.device, dtype: torch.dtype,
                    opts: RunOptions) -> tuple[dict, list[str], ClusterSpec | None]:
    """Predictions for the scaled-down plan on this machine, not the plan's cluster: memory
    from the launcher's guard pricing (the same cost model, at the run's dtype, host copies kept
    on CPU), step time from the cost model on `--cluster` or the preset of the GPU present
    (a CPU has none: `moeplan calibrate` writes one). Also returns that cluster (None: no
    step-time prediction)."""
    from ..cost_models.estimate import estimate
    from ..errors import MoeplanError
    from . import guard

    kind, dt = device.type, str(dtype).removeprefix("torch.").replace("float32", "fp32")
    dt = "bf16" if dt == "bfloat16" else dt
    world = running.layout.world_size
    needs = guard.price_ranks(running, list(range(world)), dt, kind)
    base = guard.CUDA_CONTEXT_GB if kind == "cuda" else 0.0  # not in max_memory_allocated
    predicted: dict = {"peak_mem_gb": max(n.total_gb for n in needs) - base}
    notes = [f"scaled down: measured and predicted figures are for the smaller model and batch "
             f"on this machine ({kind}, {dt})"]
    gpu = torch.cuda.get_device_name(device) if kind == "cuda" else None
    try:
        cluster = guard.machine_cluster(running, kind, gpu, opts.cluster)
        est = None if cluster is None else estimate(running.model, cluster, running.training,
                                                    running.layout, running.choices,
                                                    target="moeplan")
    except MoeplanError as e:
        cluster, est = None, None
        notes.append(f"no step-time prediction: {e}")
    if est is not None and cluster is not None:
        predicted.update(step_time_s=est.step_time_s,
                         tokens_per_s_per_gpu=est.tokens_per_s_per_gpu,
                         tflops_per_gpu=est.tflops_per_gpu)
        if est.interval is not None:
            predicted["step_time_interval_s"] = list(est.interval.step_time_s)
        notes.append(f"predicted step time: the cost model on {world} × {cluster.gpu} "
                     f"({cluster.name})")
    elif cluster is None:
        notes.append("no step-time prediction: no description of this machine; write one "
                     "with `moeplan calibrate -o local.yaml` and pass `--cluster local.yaml`")
    return predicted, notes, (cluster if est is not None else None)


def objective_line(plan: Plan) -> str:
    from .hf_io import describe_objective

    return describe_objective(plan.model, plan.training.moe_aux_loss_coeff)


def _ratio(measured: float, predicted: float) -> float | None:
    return measured / predicted if predicted > 0 else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="moeplan torchrun worker (started by `moeplan run`)")
    p.add_argument("run_dir", help="the run directory holding the launcher's run.json")
    a = p.parse_args(argv)
    set_parent_death_signal(AGENT_PID_ENV)  # no worker outlives its agent (lifecycle.py)
    try:
        out = Path(a.run_dir)
        run_worker(PreparedRun.read(out), out)
    except MoeplanError as e:  # rank 0 says it; another rank only what it found alone
        rank = os.environ.get("RANK", "0")
        if rank == "0" or not isinstance(e, checkpoint.Agreed):
            where = "" if rank == "0" else f" (worker rank {rank})"
            print(f"error{where}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        if dist.is_initialized():  # leave the group before exiting (gloo aborts otherwise)
            dist.destroy_process_group()
        raise SystemExit(e.exit_code) from None
    except RuntimeError as e:  # a peer died mid-collective: the agent names it, in one line
        timed_out = "Timed out waiting" in str(e)  # gloo's collective timeout
        if not isinstance(e, dist.DistError) and not timed_out and not any(
                k in str(e) for k in ("closed by peer", "reset by peer", "Broken pipe")):
            raise
        why = str(e).splitlines()[0].split("] ", 1)[-1].split(". ")[0]  # gloo: "[file:line] ..."
        what = ("waited past --distributed-timeout-minutes for a peer (a hung or stopped rank)"
                if timed_out else "lost a peer")
        print(f"worker rank {os.environ.get('RANK', '?')}: {what} ({why[:120]})",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    # stopped by a signal: exit 0 all the same, so the agent ends quietly; the launcher reports


if __name__ == "__main__":
    main()
