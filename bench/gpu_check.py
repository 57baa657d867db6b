"""One-GPU check: a proxy MoE trained in bf16 and torch-native FP8, measured against the h200
cost model.

Why: the cost model predicts step time, TFLOPS/MFU, peak memory and the FP8 speed-up; this
measures the same plan on one real GPU (torch and triton only: no Transformer Engine, no
network, nothing installed) so the prediction can be checked. Each precision runs through
`moeplan run` (torchrun, NCCL), the same path users take; the plan carries the h200 estimate, so
summary.json holds measured and predicted figures side by side.

    python bench/gpu_check.py [--steps 12] [--seq 4096] [--gbs 8] [--out DIR]

Prints a markdown table, then a checkpoint round trip over NCCL (a run resumed from its sharded
checkpoint against the straight run) and, with two GPUs, the EP-overlap equivalence over NCCL
(ep2 merged 1F1B against one process); on a machine without a CUDA GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import moeplan
from moeplan import ClusterSpec, Layout, ModelSpec, Plan, TrainingSpec, load_cluster, load_model
from moeplan.fsio import atomic_write_text

PRECISIONS = ("bf16", "fp8-tensorwise")


def proxy_model() -> ModelSpec:
    """A Qwen3-MoE-shaped proxy: 8 layers, hidden 2048, 8 experts (top-2), ≈1 B parameters."""
    base = load_model("qwen3-30b-a3b")
    return ModelSpec.model_validate(base.model_copy(update=dict(
        name="proxy-moe-8e-h2048-l8", num_layers=8, hidden_size=2048, num_attention_heads=16,
        num_kv_heads=4, head_dim=128, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=2048,
        vocab_size=32768)).model_dump())


def make_plan(precision: str, seq: int, gbs: int, cluster: ClusterSpec | None = None) -> Plan:
    cluster = cluster or load_cluster("h200", gpus=1)
    training = TrainingSpec(seq_len=seq, global_batch_size=gbs, precision=precision)
    plan = Plan(model=proxy_model(), cluster=cluster, training=training,
                layout=Layout.build(1, gbs))
    return plan.model_copy(update={"estimate": moeplan.estimate(plan)})


def run(plan: Plan, steps: int, out: Path, timeout_s: float) -> tuple[dict, str]:
    """`moeplan run` the plan in bf16 weights → (summary.json, the kernels line of the log)."""
    path = out / f"{plan.training.precision}.json"
    atomic_write_text(path, plan.model_dump_json())
    run_dir = out / plan.training.precision
    r = subprocess.run([sys.executable, "-m", "moeplan", "run", str(path), "--steps", str(steps),
                        "--out", str(run_dir), "--dtype", "bf16"],
                       capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise SystemExit(f"{plan.training.precision} run failed (exit {r.returncode}):\n"
                         + r.stderr[-4000:])
    kernels = next((line.strip() for line in r.stderr.splitlines() if "kernels:" in line), "?")
    return json.loads((run_dir / "summary.json").read_text()), kernels


def losses(run_dir: Path) -> dict[int, float]:
    """Last record per step of a run's metrics.jsonl (a resumed run appends)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def checkpoint_roundtrip(out: Path, timeout_s: float, steps: int = 6) -> str:
    """Sharded checkpoints over NCCL: `steps` straight against steps/2, then resumed to
    `steps` from the checkpoint; the resumed losses must follow the straight ones."""
    plan = make_plan("bf16", 1024, 4)
    path = out / "ckpt_plan.json"
    atomic_write_text(path, plan.model_dump_json())

    def run_to(n: int, run_dir: Path, ckpt: Path, resume: bool) -> None:
        cmd = [sys.executable, "-m", "moeplan", "run", str(path), "--steps", str(n), "--out",
               str(run_dir), "--dtype", "fp32", "--seed", "3", "--ckpt-dir", str(ckpt),
               "--ckpt-every", str(steps // 2)] + (["--resume"] if resume else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise SystemExit(f"checkpoint run failed (exit {r.returncode}):\n" + r.stderr[-4000:])

    run_to(steps, out / "straight", out / "ckpt_straight", False)
    run_to(steps // 2, out / "resumed", out / "ckpt_resumed", False)
    run_to(steps, out / "resumed", out / "ckpt_resumed", True)
    a, b = losses(out / "straight"), losses(out / "resumed")
    worst = max(abs(b[k] - a[k]) / abs(a[k]) for k in range(steps // 2, steps))
    verdict = "follows" if worst <= 1e-4 else "DIVERGES from"
    return (f"checkpoint round trip (NCCL, fp32): the run resumed at step {steps // 2} "
            f"{verdict} the straight run; worst relative loss gap {worst:.1e} over steps "
            f"{steps // 2}–{steps - 1}")


def ep_overlap_check(out: Path, timeout_s: float, steps: int = 4) -> str:
    """EP overlap over NCCL: an ep2 plan with the merged 1F1B schedule (overlap.py) against the
    same plan in one process, fp32, same seed; the losses must agree within 1e-4 relative.
    Needs two GPUs: NCCL refuses two ranks on one device."""
    import torch

    if torch.cuda.device_count() < 2:
        return ("EP overlap over NCCL: not run, it needs 2 GPUs (ep2; NCCL refuses two ranks on "
                f"one device) and this machine has {torch.cuda.device_count()}; its CPU/gloo "
                "equivalence is tests/test_ep_overlap.py")
    model = ModelSpec.model_validate(proxy_model().model_copy(update=dict(
        name="proxy-moe-ep-overlap", num_layers=4, hidden_size=512, num_attention_heads=8,
        num_kv_heads=4, head_dim=64, moe_ffn_hidden_size=256, vocab_size=4096)).model_dump())
    training = TrainingSpec(seq_len=512, global_batch_size=8, lr=1e-3, warmup_steps=1)
    got = {}
    for name, world, axes in (("reference", 1, {}), ("ep2_overlap", 2, {"ep": 2,
                                                                        "ep_overlap": True})):
        plan = Plan(model=model, cluster=load_cluster("h200", gpus=world), training=training,
                    layout=Layout.build(world, 8, **axes))
        path = out / f"{name}.json"
        atomic_write_text(path, plan.model_dump_json())
        r = subprocess.run([sys.executable, "-m", "moeplan", "run", str(path), "--steps",
                            str(steps), "--out", str(out / name), "--dtype", "fp32", "--seed",
                            "3"], capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise SystemExit(f"EP overlap run {name} failed (exit {r.returncode}):\n"
                             + r.stderr[-4000:])
        got[name] = losses(out / name)
    ref, ovl = got["reference"], got["ep2_overlap"]
    worst = max(abs(ovl[k] - ref[k]) / abs(ref[k]) for k in ref)
    verdict = "equals" if worst <= 1e-4 else "DIFFERS from"
    return (f"EP overlap over NCCL (ep2, merged 1F1B, fp32): {verdict} one process; worst "
            f"relative loss gap {worst:.1e} over {steps} steps")


def table(rows: list[tuple[str, dict, str]], peak_bf16: float) -> str:
    head = ("| precision | kernels | step s meas / pred | TFLOPS/GPU meas / pred | "
            "MFU (bf16 peak) meas / pred | peak GB meas / pred | final loss |")
    lines = [head, "|" + "---|" * 7]
    for precision, s, kernels in rows:
        m, p = s["measured"], s["predicted"]
        lines.append(
            f"| {precision} | {kernels.split(': ', 2)[-1]} | {m['step_time_s']:.3f} / "
            f"{p['step_time_s']:.3f} | {m['tflops_per_gpu']:.0f} / {p['tflops_per_gpu']:.0f} | "
            f"{m['tflops_per_gpu'] / peak_bf16:.1%} / {p['tflops_per_gpu'] / peak_bf16:.1%} | "
            f"{m['peak_mem_gb']:.1f} / {p['peak_mem_gb']:.1f} | {m['final_loss']:.3f} |")
    return "\n".join(lines)


def calibrated_check(out: Path, measured_s: float, seq: int, gbs: int, timeout_s: float) -> str:
    """`moeplan calibrate --quick` on this GPU, then the bf16 plan priced on the GPU's preset
    with the shipped constants and with the measured ones overlaid (`--calibration`), against
    its measured step time: what calibrating buys, and whether the file applies to the preset."""
    path = out / "calibrated.yaml"
    r = subprocess.run([sys.executable, "-m", "moeplan", "calibrate", "--quick", "--nproc", "1",
                        "-o", str(path), "--json"], capture_output=True, text=True,
                       timeout=timeout_s)
    if r.returncode != 0:
        return f"calibrate failed (exit {r.returncode}):\n{r.stderr[-2000:]}"
    report = json.loads(r.stdout)
    preset, device = report["measured"]["preset"], report["measured"]["device_name"]
    if preset is None:
        return f"calibrate: {device} is no preset's GPU; its file holds its measured peaks"
    shipped = moeplan.estimate(make_plan("bf16", seq, gbs, load_cluster(preset, 1)))
    calibrated = moeplan.estimate(make_plan("bf16", seq, gbs, load_cluster(preset, 1, path)))
    cal = report["cluster"]["calibration"]
    arch = report["cluster"]["architecture"]
    took = report["measured"]["seconds"]["total"]
    return (f"calibrate on {device} (preset {preset}, {took:.0f} s): gemm_eff_max "
            f"{cal['gemm_eff_max'][arch]}, "
            f"attention {cal['attn_fwd_eff'][arch]} / {cal['attn_bwd_eff'][arch]}, hbm_eff "
            f"{cal['hbm_eff']}, launch {cal.get('launch_us', {}).get('x86', '?')} µs. bf16 step "
            f"measured {measured_s:.3f} s; predicted {shipped.step_time_s:.3f} s on the shipped "
            f"constants ({shipped.step_time_s / measured_s - 1:+.1%}), "
            f"{calibrated.step_time_s:.3f} s calibrated "
            f"({calibrated.step_time_s / measured_s - 1:+.1%})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="keep plans and run outputs here")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per run")
    a = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing measured.")
        return 0
    name, cap = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    out = a.out or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    precisions = PRECISIONS if cap >= (8, 9) else PRECISIONS[:1]
    rows = []
    for precision in precisions:
        summary, kernels = run(make_plan(precision, a.seq, a.gbs), a.steps, out, a.timeout_s)
        rows.append((precision, summary, kernels))
    peak_bf16 = load_cluster("h200").peak_tflops("bf16") or float("nan")
    print(f"## {proxy_model().name} on 1 × {name} (sm_{cap[0]}{cap[1]}), torch "
          f"{torch.__version__}; seq {a.seq}, gbs {a.gbs}, {a.steps} steps (median after the "
          f"first); predictions: cost model, cluster preset h200\n")
    print(table(rows, peak_bf16))
    if len(rows) == 2:
        (_, b, _), (_, f, _) = rows
        meas = b["measured"]["step_time_s"] / f["measured"]["step_time_s"]
        pred = b["predicted"]["step_time_s"] / f["predicted"]["step_time_s"]
        print(f"\nFP8 speed-up (bf16 step / fp8-tensorwise step): measured {meas:.2f}×, "
              f"predicted {pred:.2f}×")
    else:
        print(f"\nno FP8 run: torch._scaled_mm needs sm_89 or newer (this GPU is sm_{cap[0]}"
              f"{cap[1]})")
    print("\n" + calibrated_check(out, rows[0][1]["measured"]["step_time_s"], a.seq, a.gbs,
                                  a.timeout_s))
    print("\n" + checkpoint_roundtrip(out, a.timeout_s))
    print("\n" + ep_overlap_check(out, a.timeout_s))
    print(f"\nruns in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
