"""`moeplan calibrate`: real microbenchmarks and collectives on a tiny grid, the spec they write,
the `--calibration` overlay, and `--from-runs` refits (recovering known constants; bad input)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from moeplan.calibrate.fit import GemmSample, fit_collective, fit_gemm_curve, gemm_shape_factor
from moeplan.calibrate.refit import PARAMS, RunRecord, overrides_for, predict, refit
from moeplan.specs import ClusterSpec, Layout, Plan, TrainingSpec, load_cluster, load_model

from .conftest import DATA

MODEL = str(DATA / "tiny_qwen3_moe.yaml")
EST = ["--model", MODEL, "--gpus", "2", "--seq", "64", "--gbs", "8", "--ep", "2", "--json"]


@pytest.fixture(scope="module")
def local_yaml(tmp_path_factory):
    """One real `moeplan calibrate` on the tiny grid over 2 processes (gloo), shared by tests."""
    from .conftest import run_cli

    path = tmp_path_factory.mktemp("cal") / "local.yaml"
    r = run_cli("calibrate", "--grid", "tiny", "--nproc", "2", "-o", str(path), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    (path.parent / "stderr.txt").write_text(r.stderr)  # as piped to a log
    return path


def test_the_file_names_the_flag_that_chose_its_grid(local_yaml):
    """`--grid tiny` wrote a header saying `--tiny`, a flag calibrate does not have."""
    from moeplan.calibrate import MachineOptions

    assert local_yaml.read_text().startswith(
        "# Written by `moeplan calibrate` --grid tiny on 2 processes.")
    assert [MachineOptions(m, 1, False).flag for m in ("quick", "full", "tiny")] == [
        "--quick", "--full", "--grid tiny"]


def test_a_piped_calibrate_keeps_its_table_title_on_one_line(local_yaml):
    """Piped to a log, the table's title wrapped at the table's width: one line read as two."""
    lines = (local_yaml.parent / "stderr.txt").read_text().splitlines()
    title = [line for line in lines if "devices, fp32 compute" in line]
    assert len(title) == 1, lines
    assert title[0].strip().startswith(yaml.safe_load(local_yaml.read_text())["gpu"]), lines
    assert title[0].rstrip().endswith(" s)") and "tiny grid (" in title[0], lines


def test_calibrate_writes_a_valid_cpu_cluster_spec(local_yaml, cli):
    doc = yaml.safe_load(local_yaml.read_text())
    spec = ClusterSpec.model_validate(doc)
    assert spec.architecture == "cpu" and spec.gpus_per_node == 2
    assert spec.bf16_tflops > 0 and spec.fp32_tflops and spec.hbm_tb_s > 0
    # a CPU device's memory is DRAM (each figure rounded to four digits in its own unit)
    assert spec.host_memory_bw_gb_s == pytest.approx(spec.hbm_tb_s * 1e3, rel=1e-3)
    cal = spec.calibration
    assert cal["gemm_eff_max"]["cpu"] > 0 and cal["gemm_half_dim"] > 0
    assert cal["attn_fwd_eff"]["cpu"] > 0 and cal["layer_overhead_s"] > 0
    # a CPU's cores launch and compute: its launches add (layer_overhead_s), no host floor
    assert cal["launch_us"] == {"x86": 0.0, "grace": 0.0}
    assert "launch" in spec.sources["launch_us"]
    assert spec.nvlink_gb_s > 0 and spec.nvlink_latency_us >= 0   # from the gloo collectives
    assert "collectives" in spec.sources
    r = cli("specs", "validate", str(local_yaml))
    assert r.returncode == 0, r.stderr
    r = cli("estimate", "--cluster", str(local_yaml), *EST)
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)
    assert est["step_time_s"] > 0 and est["confidence"]["label"] == "calibrated"


def test_calibration_overlay_moves_the_prediction_the_expected_way(local_yaml, cli, tmp_path):
    doc = yaml.safe_load(local_yaml.read_text())
    slow = dict(doc["calibration"])
    slow["layer_overhead_s"] = doc["calibration"]["layer_overhead_s"] * 10 + 0.01
    slow["step_overhead_s"] = doc["calibration"]["step_overhead_s"] + 1.0
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump({"calibration": slow}))

    def step(*extra: str) -> float:
        r = cli("estimate", *EST, *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["step_time_s"]

    base = step("--cluster", str(local_yaml))
    assert step("--cluster", str(local_yaml), "--calibration", str(path)) > base + 1.0
    # the measured constants onto a GPU preset: the preset's overheads give way to the host's
    h100 = step("--cluster", "h100")
    shipped = load_cluster("h100")
    over = load_cluster("h100", None, local_yaml)
    assert over.calibration["step_overhead_s"] == doc["calibration"]["step_overhead_s"]
    moved = step("--cluster", "h100", "--calibration", str(local_yaml))
    assert moved != h100 and shipped.bf16_tflops == over.bf16_tflops


def test_cpu_cluster_without_its_own_efficiencies_is_refused_by_name(local_yaml, cli, tmp_path):
    doc = yaml.safe_load(local_yaml.read_text())
    del doc["calibration"]["attn_bwd_eff"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    r = cli("specs", "validate", str(bad))
    assert r.returncode == 2 and "attn_bwd_eff" in r.stderr and "moeplan calibrate" in r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------------------- fits, derivable
def test_one_refit_cluster_writes_the_file_and_several_write_one_file_each(tmp_path):
    from moeplan.calibrate.refit import cluster_document, output_paths

    assert output_paths(tmp_path / "fit.yaml", ["local-2"]) == [tmp_path / "fit.yaml"]
    assert output_paths(tmp_path / "fit", ["local-2", "local-4"]) == [
        tmp_path / "fit-local-2.yaml", tmp_path / "fit-local-4.yaml"]
    doc = cluster_document(load_cluster("h100", 8), {"layer_overhead_s": 1e-3}, "fit")
    assert doc["name"] == "fit" and doc["num_gpus"] is None
    assert doc["calibration"] == {"layer_overhead_s": 1e-3}
    assert ClusterSpec.model_validate(doc).gpu == load_cluster("h100").gpu


def _a100_calibration(path, constants):
    """A calibration measured on an A100, as `moeplan calibrate --from-runs` writes it."""
    from moeplan.calibrate import write_cluster_yaml
    from moeplan.calibrate.refit import cluster_document

    write_cluster_yaml(cluster_document(load_cluster("a100-80g"), constants, path.stem), path)
    return path


A100_FIT = {"gemm_eff_max": {"A100-80GB SXM": 0.7, "ampere": 0.7},
            "attn_fwd_eff": {"ampere": 0.5}, "layer_overhead_s": 1e-3, "nvlink_eff": 0.8}


def test_a_calibration_from_another_gpu_says_so_in_one_line_naming_what_applies(tmp_path,
                                                                                 capsys):
    from moeplan.cli import main

    path = _a100_calibration(tmp_path / "a100-fit.yaml", A100_FIT)
    for cmd in (["estimate", *EST, "--cluster", "h100"],
                ["search", *EST[:-3], "--cluster", "h100", "--json"]):
        assert main([*cmd, "--calibration", str(path)]) == 0
        err = capsys.readouterr().err
        warned = [line for line in err.splitlines() if line.startswith("warning:")]
        assert len(warned) == 1 and "Traceback" not in err, err
        line = warned[0]
        assert "measured on A100-80GB SXM (ampere)" in line and "H100-SXM (hopper)" in line
        applied, unread = line.split("Applied anyway:")[1].split("Not applied")
        assert "layer_overhead_s" in applied and "nvlink_eff" in applied
        assert "gemm_eff_max[ampere]" in unread and "attn_fwd_eff[ampere]" in unread
    # measured on the cluster's own GPU: nothing to say
    assert main(["estimate", *EST, "--cluster", "a100-80g", "--calibration", str(path)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_calibration_of_which_nothing_applies_to_the_clusters_gpu_is_refused(tmp_path,
                                                                                capsys):
    from moeplan.cli import main

    path = _a100_calibration(tmp_path / "a100-gemm.yaml",
                             {"gemm_eff_max": {"A100-80GB SXM": 0.7, "ampere": 0.7}})
    assert main(["estimate", *EST, "--cluster", "h100", "--calibration", str(path)]) == 2
    cap = capsys.readouterr()
    msg = " ".join(cap.err.split())
    assert cap.out == "" and "Traceback" not in cap.err
    assert "none of its constants applies to the cluster's H100-SXM (hopper)" in msg
    assert "gemm_eff_max[ampere]" in msg and "drop --calibration" in msg


def test_calibrate_defaults_come_from_the_devices_present():
    import os

    import torch

    from moeplan.calibrate import machine_options
    from moeplan.errors import SpecError

    opts = machine_options()
    gpu = torch.cuda.is_available()
    assert opts.gpu == gpu and opts.mode == ("full" if gpu else "quick")
    assert opts.nproc == (torch.cuda.device_count() if gpu else min(4, os.cpu_count() or 1))
    assert machine_options(1, "fp32", None, "tiny").mode == "tiny"
    assert machine_options(1, quick=True).mode == "quick"
    with pytest.raises(SpecError, match="--dtype takes fp32 or bf16"):
        machine_options(dtype="fp16")
    with pytest.raises(SpecError, match="--grid takes quick, full or tiny"):
        machine_options(1, grid="huge")


def test_a_cpu_host_too_small_for_its_processes_is_refused_before_measuring(monkeypatch):
    """A device is its share of the host's memory: 6 GB over 2 processes leaves each less than
    the reserve and workspace a plan keeps free. The spec refused that only after the whole grid
    had run, in words for a GPU; `--nproc` is refused first, with the count that fits."""
    import torch

    from moeplan.calibrate import host, machine_options
    from moeplan.errors import SpecError

    if torch.cuda.is_available():
        pytest.skip("a GPU's memory is its own, not a share of the host's")
    monkeypatch.setattr(host, "total_memory_gb", lambda device: 6.0)
    with pytest.raises(SpecError, match=r"--nproc 2: .* 3\.0 GB, no more than the 3\.5 GB .*"
                       r"\(at most 1\)"):
        machine_options(2, grid="tiny")
    assert machine_options(1, grid="tiny").nproc == 1


def test_gemm_curve_fit_recovers_the_constants_it_was_built_from():
    shapes = [(m, k, n) for m in (8, 32, 128, 512) for n in (16, 256) for k in (64, 1024)]
    samples = [GemmSample(m, k, n, 2.0 * 0.6 * gemm_shape_factor(m, k, n, 96.0))
               for m, k, n in shapes]
    eff, half, err = fit_gemm_curve(samples, peak_tflops=2.0)
    assert eff == pytest.approx(0.6, rel=1e-3) and half == pytest.approx(96.0, rel=1e-2)
    assert err < 1e-3


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce", "all_to_all",
                                  "p2p"])
def test_alpha_beta_fit_inverts_the_cost_model_forms(kind):
    n, alpha, beta = 4, 20e-6, 5e9
    steps = {"all_gather": (n - 1, (n - 1) / n), "reduce_scatter": (n - 1, (n - 1) / n),
             "all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
             "all_to_all": (1 + math.log2(n), (n - 1) / n), "p2p": (1, 1)}[kind]
    sizes = [1e3, 1e5, 1e6, 1e7]
    times = [steps[0] * alpha + steps[1] * s / beta for s in sizes]
    ab = fit_collective(kind, n, sizes, times)
    assert ab.alpha_us == pytest.approx(20.0, rel=1e-6)
    assert ab.beta_gb_s == pytest.approx(5.0, rel=1e-6)


# ------------------------------------------------------------- a GPU's measurements, priced
def _gpu_measurements(device_name: str, arch: str = "hopper", peak: float = 989.0,
                      exp_scale: float = 1.0):
    """What `moeplan calibrate` measures on a GPU, built from known rates: GEMMs on a curve
    (0.74 of `peak`, half-dim 300), attention at 0.5 / 0.4 of the cost model's own time,
    2.9 / 2.7 TB/s elementwise, NCCL rings at 360 GB/s and all-to-all at 210 GB/s."""
    from moeplan.calibrate.host import Measurements
    from moeplan.cost_models.calibration import calibration_for
    from moeplan.cost_models.compute import attended_keys, attention_time

    shapes = [(m, 4096, n) for m in (256, 1024, 4096, 16384) for n in (1024, 8192)]
    gemm = {dt: [{"m": m, "k": k, "n": n,
                  "tflops": scale * peak * 0.74 * gemm_shape_factor(m, k, n, 300.0)}
                 for m, k, n in shapes] for dt, scale in (("bf16", 1.0), ("fp32", 0.05))}
    attn_cal = calibration_for({"attn_fwd_eff": {arch: 0.5}, "attn_bwd_eff": {arch: 0.4}})
    attention = []
    for b, h, s, d in ((1, 16, 1024, 128), (1, 16, 4096, 128), (2, 32, 8192, 64)):
        flops = b * s * attended_keys(s) * h * 2 * (2 * d)
        f, bw = attention_time(flops, peak, attn_cal, arch, d, s, exp_scale=exp_scale)
        attention.append({"batch": b, "heads": h, "seq": s, "head_dim": d, "fwd_s": f,
                          "bwd_s": bw})
    # the grouped expert GEMM at 0.8 of the plain GEMM of its per-expert shape
    grouped = [{"experts": e, "tokens": t, "k": 4096, "n": 1536,
                "tflops": 0.8 * peak * 0.74 * gemm_shape_factor(t, 4096, 1536, 300.0)}
               for e, t in ((8, 128), (16, 512))]
    memory = [{"op": op, "size_mb": 1024, "nbytes": 1, "gb_s": gb_s}
              for op, gb_s in (("copy", 3000.0), ("add", 2900.0), ("rmsnorm", 2700.0),
                               ("h2d", 52.0))]
    n, alpha = 2, 6e-6
    steps = {"all_gather": (n - 1, (n - 1) / n), "reduce_scatter": (n - 1, (n - 1) / n),
             "all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
             "all_to_all": (1 + math.log2(n), (n - 1) / n), "p2p": (1, 1)}
    collectives = {kind: [[size, a * alpha + b * size / (210e9 if kind == "all_to_all"
                                                          else 360e9)]
                          for size in (4e3, 1e6, 64e6)] for kind, (a, b) in steps.items()}
    return Measurements("cuda", device_name, "bf16", n, 1, 80.0, gemm=gemm,
                        grouped_gemm=grouped, attention=attention, memory=memory,
                        collectives=collectives,
                        layer_overhead_s=2e-4, step_overhead_s=0.01, launch_us=9.0,
                        architecture=arch)


def _prices_as_measured(cluster: ClusterSpec, m) -> None:
    """The cost models, pricing `cluster`, give back what `m` measured: each GEMM's time, each
    attention shape's forward and backward, the elementwise bandwidth and the ring link."""
    from moeplan.cost_models.calibration import calibration_on
    from moeplan.cost_models.compute import attended_keys, attention_time, gemm_time

    cal = calibration_on(cluster)
    arch = cluster.architecture
    for g in m.gemm["bf16"]:
        priced = gemm_time(g["m"], g["k"], g["n"], cluster.bf16_tflops, cal,
                           cal.gemm_eff_max_for(cluster), half_dim=cal.half_dim_for(arch),
                           ceiling_tflops=cluster.mamf("bf16"))
        measured = 2.0 * g["m"] * g["k"] * g["n"] / (g["tflops"] * 1e12)
        assert priced == pytest.approx(measured, rel=2e-3), g
    for a in m.attention:
        flops = a["batch"] * a["seq"] * attended_keys(a["seq"]) * a["heads"] * 4 * a["head_dim"]
        f, b = attention_time(flops, cluster.bf16_tflops, cal, arch, a["head_dim"], a["seq"],
                              exp_scale=cluster.sfu_exp_scale)
        assert (f, b) == pytest.approx((a["fwd_s"], a["bwd_s"]), rel=2e-3), a
    elementwise = math.sqrt(2900.0 * 2700.0)
    assert cal.hbm_eff * cluster.hbm_tb_s * 1e3 == pytest.approx(elementwise, rel=2e-3)
    assert cal.nvlink_eff * cluster.nvlink_gb_s == pytest.approx(360.0, rel=2e-3)
    assert cal.a2a_nvlink_eff * cluster.nvlink_gb_s == pytest.approx(210.0, rel=2e-3)


@pytest.mark.parametrize(("device", "preset"), [("NVIDIA H100 80GB HBM3", "h100"),
                                                ("NVIDIA B300 SXM6 AC", "b300")])
def test_a_gpu_a_preset_describes_is_calibrated_in_the_presets_terms(device, preset, tmp_path,
                                                                     capsys):
    """On a preset's GPU the file is the preset with measured constants: overlaid on the
    preset with --calibration or used as the cluster, its constants price what was measured,
    and nothing is said about another GPU."""
    from moeplan.calibrate import write_cluster_yaml
    from moeplan.calibrate.host import build_cluster
    from moeplan.cli import main
    from moeplan.specs.loader import foreign_calibration

    base = load_cluster(preset)
    m = _gpu_measurements(device, base.architecture, base.bf16_tflops, base.sfu_exp_scale)
    path = tmp_path / "measured.yaml"
    write_cluster_yaml(build_cluster(m, "measured"), path)
    as_cluster, overlaid = load_cluster(path, 8), load_cluster(preset, 8, path)
    assert as_cluster.gpu == base.gpu and as_cluster.bf16_tflops == base.bf16_tflops
    assert as_cluster.scaleout_gb_s == base.scaleout_gb_s
    for cluster in (as_cluster, overlaid):
        _prices_as_measured(cluster, m)
    assert foreign_calibration(overlaid, path) is None
    # the grouped GEMM checked against the pricing of its per-expert shape
    assert "at 0.80× the rate priced for its per-expert shape (128–512 tokens per expert" in (
        as_cluster.sources["grouped_gemm"])
    # the scale-out network one host cannot measure keeps the shipped constants
    assert "scaleout_eff" not in as_cluster.calibration
    for how in (["--cluster", str(path)], ["--cluster", preset, "--calibration", str(path)]):
        assert main(["estimate", "--model", "mixtral-8x7b", "--gpus", "16", "--seq", "4096",
                     "--gbs", "64", "--ep", "8", "--pp", "2", *how, "--json"]) == 0
        cap = capsys.readouterr()
        assert "warning" not in cap.err
        assert json.loads(cap.out)["confidence"]["label"] == "calibrated"


def test_a_gpu_no_preset_describes_prices_its_measured_rates_as_the_cluster(tmp_path):
    """A PCIe H100 has no preset: its file carries its measured peaks, and as the cluster it
    prices what was measured (the GEMM curve's half-dim included, which the shipped Hopper
    entry would otherwise replace)."""
    from moeplan.calibrate import write_cluster_yaml
    from moeplan.calibrate.host import build_cluster

    m = _gpu_measurements("NVIDIA H100 PCIe", peak=756.0)
    path = tmp_path / "pcie.yaml"
    write_cluster_yaml(build_cluster(m, "pcie"), path)
    cluster = load_cluster(path, 2)
    assert cluster.gpu == "NVIDIA H100 PCIe"
    assert cluster.bf16_tflops == pytest.approx(max(g["tflops"] for g in m.gemm["bf16"]),
                                                rel=1e-3)
    _prices_as_measured(cluster, m)


# ---------------------------------------------------------------------------- --from-runs
CPU_CLUSTER = {
    "name": "host", "gpu": "test-cpu", "architecture": "cpu", "bf16_tflops": 0.5,
    "fp32_tflops": 0.1, "hbm_gb": 8, "hbm_tb_s": 0.02, "nvlink_gb_s": 1.0,
    "nvlink_domain_gpus": 4, "gpus_per_node": 4, "scaleout_gb_s": 1.0,
    "nvlink_latency_us": 100.0, "scaleout_latency_us": 100.0, "host_memory_gb": 8,
    "host_link_gb_s": 20.0,
    "calibration": {"gemm_eff_max": {"cpu": 0.2}, "gemm_half_dim": 8.0,
                    "attn_fwd_eff": {"cpu": 0.05}, "attn_bwd_eff": {"cpu": 0.05},
                    "layer_overhead_s": 5e-4, "step_overhead_s": 2e-3},
}
TRUE = {"compute_scale": 0.7, "comm_scale": 0.4, "layer_overhead_s": 1.5e-3,
        "step_overhead_s": 0.02}
LAYOUTS = [  # (model, world, gbs, seq, axes): different layer counts, micro-batches and sizes
    ("tiny_qwen3_moe", 1, 4, 64, {}),
    ("tiny_qwen3_moe", 2, 8, 128, {"ep": 2}),
    ("tiny_deepseek_v3", 2, 4, 64, {"pp": 2}),
    ("tiny_dense_tied", 1, 16, 256, {}),
    ("tiny_dense_tied", 2, 2, 32, {"tp": 2}),
    ("tiny_qwen3_moe", 4, 8, 64, {"tp": 2, "ep": 2}),
]


def _plans() -> list[Plan]:
    cluster = ClusterSpec.model_validate(CPU_CLUSTER)
    out = []
    for name, world, gbs, seq, axes in LAYOUTS:
        t = TrainingSpec(seq_len=seq, global_batch_size=gbs)
        out.append(Plan(model=load_model(DATA / f"{name}.yaml"),
                        cluster=cluster.with_gpus(world), training=t,
                        layout=Layout.build(world, gbs, **axes)))
    return out


def _write_runs(root, plans: list[Plan], theta: dict[str, float], device: str = "cpu") -> list:
    """Run directories whose measured step time (on `device`) is the cost model's under
    `theta`."""
    dirs = []
    for i, plan in enumerate(plans):
        rec = RunRecord(f"r{i}", plan, 1.0)
        truth = predict(rec, overrides_for(theta, plan.cluster.calibration, plan.cluster))
        d = root / f"run{i}"
        d.mkdir(parents=True)
        (d / "plan.json").write_text(plan.model_dump_json())
        (d / "summary.json").write_text(json.dumps({"scaled_down": False, "device": device,
                                                    "measured": {"step_time_s": truth},
                                                    "predicted": None}))
        dirs.append(d)
    return dirs


def test_refit_recovers_known_constants_and_reports_held_out_runs_apart(tmp_path):
    plans = _plans()
    dirs = _write_runs(tmp_path, plans, TRUE)
    from moeplan.calibrate.refit import load_run

    res = refit([load_run(d) for d in dirs[:5]], [load_run(dirs[5])], prior_weight=0.0)
    for k in PARAMS:
        assert res["fitted"][k] == pytest.approx(TRUE[k], rel=1e-3), k
    held = [r for r in res["runs"] if r["split"] == "held-out"]
    assert len(held) == 1 and abs(held[0]["after_error"]) < 1e-3
    assert abs(held[0]["before_error"]) > 0.05            # the starting constants were off
    assert res["mean_abs_log_error"]["fit"]["after"] < 1e-4


def test_from_runs_cli_writes_a_cluster_that_predicts_the_held_out_run(tmp_path, cli):
    dirs = _write_runs(tmp_path, _plans(), TRUE)
    out = tmp_path / "refit.yaml"
    r = cli("calibrate", "--from-runs", *map(str, dirs[:5]), "--eval", str(dirs[5]),
            "-o", str(out), "--prior-weight", "0", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {row["split"] for row in doc["runs"]} == {"fit", "held-out"}
    spec = ClusterSpec.model_validate(yaml.safe_load(out.read_text()))
    assert spec.calibration["step_overhead_s"] == pytest.approx(0.02, rel=1e-3)
    held = json.loads((dirs[5] / "summary.json").read_text())["measured"]["step_time_s"]
    r = cli("estimate", str(dirs[5] / "plan.json"), "--calibration", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step_time_s"] == pytest.approx(held, rel=1e-3)


def test_a_refit_on_enough_runs_writes_their_band_into_a_cluster_that_loads(tmp_path, cli):
    """Nine runs or more give a finite 80% band, which the refit writes into the cluster's
    calibration (`interval_runs`): the file must load as a cluster, and plans priced on it take
    that band instead of the published rows'."""
    plans = _plans()
    plans += [p.model_copy(update={"training": p.training.model_copy(
        update={"seq_len": p.training.seq_len // 2})}) for p in plans]
    dirs = _write_runs(tmp_path, plans[:10], TRUE)
    for i, d in enumerate(dirs):   # measured ±3% around the physics, as real runs scatter
        doc = json.loads((d / "summary.json").read_text())
        doc["measured"]["step_time_s"] *= 1 + 0.03 * math.sin(1.7 * i)
        (d / "summary.json").write_text(json.dumps(doc))
    out = tmp_path / "refit.yaml"
    r = cli("calibrate", "--from-runs", *map(str, dirs), "-o", str(out), "--json")
    assert r.returncode == 0, r.stderr
    spec = ClusterSpec.model_validate(yaml.safe_load(out.read_text()))
    band = spec.calibration["interval_runs"]
    assert band["runs"] == 10 and 0 < band["low"] < 0.1 and 0 < band["high"] < 0.1
    r = cli("estimate", str(dirs[0] / "plan.json"), "--calibration", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["interval"]["regime"] == "runs measured on this cluster"


@pytest.mark.parametrize("priced,measured", [("h100", "cpu"), ("host", "cuda")])
def test_a_run_measured_on_another_kind_of_device_than_it_was_priced_for_is_refused(
        priced, measured, tmp_path, cli):
    """A CPU run of a plan priced for H100s refit the H100's constants to CPU timings, and
    wrote them as an H100 cluster, without a word (and a GPU run of a CPU plan the reverse)."""
    plans = _plans()[:2]
    if priced == "h100":
        plans = [p.model_copy(update={"cluster": load_cluster("h100", gpus=p.cluster.num_gpus)})
                 for p in plans]
    wrong = _write_runs(tmp_path, plans[:1], TRUE, device=measured)[0]
    right = _write_runs(tmp_path / "right", _plans()[1:2], TRUE)[0]  # a CPU run of a CPU plan
    out = tmp_path / "refit.yaml"
    for flag, args in (("--from-runs", ["--from-runs", str(wrong)]),
                       ("--eval", ["--from-runs", str(right), "--eval", str(wrong)])):
        r = cli("calibrate", *args, "-o", str(out))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # one paragraph
        assert f"{wrong}: this run was measured on" in r.stderr
        assert "`moeplan calibrate -o local.yaml`" in r.stderr and "then run" in r.stderr
        assert f"leave this run out of {flag}" in r.stderr
        assert not out.exists()


@pytest.mark.slow
def test_a_scaled_down_run_is_refit_on_the_cluster_it_was_predicted_on(tmp_path, cli):
    """`run --scale-down --cluster host.yaml` prices the shrunk plan on host.yaml; the refit
    re-priced it on the plan's H100s (and refit those), so its "before" was not the run's."""
    host = tmp_path / "host.yaml"
    host.write_text(yaml.safe_dump(CPU_CLUSTER))
    plan = Plan(model=load_model(MODEL), cluster=load_cluster("h100", gpus=1),
                training=TrainingSpec(seq_len=32, global_batch_size=2),
                layout=Layout.build(1, 2))
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    run = tmp_path / "run"
    r = cli("run", str(tmp_path / "plan.json"), "--scale-down", "--cluster", str(host),
            "--steps", "2", "--out", str(run), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    printed = json.loads((run / "summary.json").read_text())["predicted"]["step_time_s"]
    r = cli("calibrate", "--from-runs", str(run), "--fit", "step_overhead_s", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["runs"][0]["before_s"] == pytest.approx(printed, rel=1e-9)
    assert [c["name"] for c in doc["clusters"]] == ["host"]


def test_fewer_runs_than_constants_fitted_is_one_warning_line_not_an_error(tmp_path, cli):
    dirs = _write_runs(tmp_path, _plans()[:2], TRUE)
    r = cli("calibrate", "--from-runs", *map(str, dirs), "--json")
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "2 runs fitted for 4 constants" in warned[0], r.stderr
    assert json.loads(r.stdout)["warnings"] == [warned[0].removeprefix("warning: ")]
    r = cli("calibrate", "--from-runs", *map(str, dirs), "--fit", "compute_scale,step_overhead_s")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


@pytest.mark.parametrize("band", [{"runs": 20}, {"low": 1.5, "high": 0.1, "runs": 10},
                                  {"low": 0.1, "high": 0.1, "runs": 9.5}])
def test_a_runs_band_not_shaped_as_a_refit_writes_it_is_refused_by_name(band, tmp_path, cli):
    """A hand-edited `interval_runs` without its low end was read as one and raised KeyError:
    it is refused, naming the entry and the command that writes it."""
    doc = load_cluster("h100").model_dump(mode="json")
    doc["calibration"] = {"interval_runs": band}
    path = tmp_path / "banded.yaml"
    path.write_text(yaml.safe_dump(doc))
    r = cli("estimate", *EST[:-1], "--cluster", str(path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "`interval_runs` must be the band" in r.stderr and "--from-runs" in r.stderr


@pytest.mark.parametrize("twice", ["fit_and_eval", "fit_twice", "folder_and_run_in_it"])
def test_a_run_given_twice_or_to_both_fit_and_eval_is_refused(twice, tmp_path, cli):
    """A held-out error on a fitted run is no evidence; one run counted three times is one
    measurement weighed three times. Paths are compared resolved (`./a`, `a/../a`)."""
    dirs = _write_runs(tmp_path, _plans()[:2], TRUE)
    again = str(dirs[0].parent / ".." / tmp_path.name / dirs[0].name)
    args = {"fit_and_eval": ["--from-runs", str(dirs[0]), str(dirs[1]), "--eval", again],
            "fit_twice": ["--from-runs", str(dirs[0]), str(dirs[1]), again],
            "folder_and_run_in_it": ["--from-runs", str(tmp_path), str(dirs[1])]}[twice]
    r = cli("calibrate", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert ("both --from-runs and --eval" if twice == "fit_and_eval" else "twice") in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("value,named", [("nan", "not a finite number"),
                                         ("inf", "not a finite number"),
                                         ("1e308", "from 0 to 1000"), ("-1", "from 0 to 1000")])
def test_a_prior_weight_that_is_not_finite_or_past_its_bound_is_refused(value, named, tmp_path,
                                                                        cli):
    dirs = _write_runs(tmp_path, _plans()[:1], TRUE)
    r = cli("calibrate", "--from-runs", str(dirs[0]), "--prior-weight", value)
    assert r.returncode == 2 and named in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr


def test_the_from_runs_table_at_50_columns_shows_every_number_whole(tmp_path):
    """The per-run table folds columns onto indented lines on a narrow terminal, as every
    other table does, instead of cutting numbers to `0.1…`."""
    from .test_cli_terminal import assert_fits_and_whole, json_of, raw_in_pty, screen_of

    dirs = _write_runs(tmp_path, _plans()[:3], TRUE)
    args = ("calibrate", "--from-runs", *map(str, dirs), "--prior-weight", "0")
    screen = screen_of(raw_in_pty(args, 50), 50)
    assert "…" not in screen, screen
    doc = json_of(args)
    numbers = [f"{r[k]:.4g}" for r in doc["runs"] for k in ("measured_s", "before_s", "after_s")]
    numbers += [f"{r[k]:+.1%}" for r in doc["runs"] for k in ("before_error", "after_error")]
    assert_fits_and_whole(screen, 50, numbers + [d.name for d in dirs])


@pytest.mark.parametrize("case", ["missing_dir", "no_summary", "malformed", "no_step",
                                  "measured_nothing", "no_plan", "eval_without_from_runs",
                                  "fit_without_from_runs", "unknown_constant",
                                  "predicted_nothing"])
def test_from_runs_bad_input_exits_2_naming_the_file_and_the_fix(case, tmp_path, cli):
    d = tmp_path / "run"
    d.mkdir()
    args = ["calibrate", "--from-runs", str(d)]
    named = str(d)
    if case == "missing_dir":
        args[-1] = named = str(tmp_path / "nowhere")
    elif case == "malformed":
        (d / "summary.json").write_text("{not json")
        named = "summary.json"
    elif case == "no_step":
        (d / "summary.json").write_text(json.dumps({"measured": {}}))
        named = "measured.step_time_s"
    elif case == "measured_nothing":  # a restart resumed the run at its last step
        (d / "summary.json").write_text(json.dumps({"measured": {}, "steps": 5,
                                                    "resumed_from": 5}))
        named = "measured nothing"
    elif case == "no_plan":
        (d / "summary.json").write_text(json.dumps({"measured": {"step_time_s": 0.1}}))
        named = "plan.json"
    elif case == "unknown_constant":
        dirs = _write_runs(tmp_path, _plans()[:1], TRUE)
        args = ["calibrate", "--from-runs", str(dirs[0]), "--fit", "gemm_scale"]
        named = "compute_scale"
    elif case == "predicted_nothing":  # scaled down on a CPU without --cluster
        (d / "plan.json").write_text(_plans()[0].model_dump_json())
        (d / "summary.json").write_text(json.dumps({
            "measured": {"step_time_s": 0.1}, "scaled_down": True, "device": "cpu",
            "predicted_cluster": None}))
        named = "--scale-down --cluster FILE"
    elif case == "eval_without_from_runs":
        args = ["calibrate", "--eval", str(d)]
        named = "--from-runs"
    elif case == "fit_without_from_runs":  # it ran the whole microbenchmark instead
        args = ["calibrate", "--fit", "compute_scale"]
        named = "--fit needs --from-runs"
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    assert named in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) <= 6     # one wrapped paragraph


def test_a_real_run_leaves_its_plan_and_refits_from_it(local_yaml, cli, tmp_path):
    """calibrate → estimate → run → --from-runs: the run directory holds plan.json."""
    plan, run = tmp_path / "plan.json", tmp_path / "run"
    r = cli("estimate", "--cluster", str(local_yaml), "--model", MODEL, "--gpus", "1", "--seq",
            "32", "--gbs", "2", "-o", str(plan), "--json")
    assert r.returncode == 0, r.stderr
    r = cli("run", str(plan), "--steps", "3", "--out", str(run), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "plan.json").read_text())["layout"]["tp"] == 1
    r = cli("calibrate", "--from-runs", str(run), "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)["runs"][0]
    assert row["split"] == "fit" and abs(row["after_error"]) <= abs(row["before_error"])


def test_the_launch_time_per_eager_kernel_is_a_few_microseconds_of_host_time():
    """`moeplan calibrate` measures the host floor's time per launch (cost_models.host): a
    one-element add per launch, timed on the host; on this CPU it is the dispatcher's cost."""
    import torch

    from moeplan.calibrate.micro import launch_us

    us = launch_us(torch.device("cpu"), n=500)
    assert 0.05 < us < 500.0


def test_the_gpus_numa_cpus_are_read_from_sysfs_as_torchrun_binds_them(tmp_path):
    """`moeplan run` binds each worker to its GPU's NUMA node (torchrun --numa-binding node) and
    `moeplan calibrate` measures the launch time so: the node of the GPU's PCI address (-1, a
    machine of one node, read as node 0, as torch reads it), less the CPUs the job may not use;
    nvidia-smi's 8-digit PCI domain is read as sysfs names it."""
    from types import SimpleNamespace

    from moeplan.runtime.guard import pci_address, sysfs_bus

    assert sysfs_bus("00000000:1B:00.0") == "0000:1b:00.0"
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)  # torch's ids
    assert pci_address(props) == "0000:1b:00.0" and pci_address(object()) is None
    assert sysfs_bus("00000001:DC:00.0\n") == "0001:dc:00.0"
    from moeplan.runtime.guard import cpu_list, numa_cpus

    assert cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11} and cpu_list("") == set()
    for node, cpus in ((0, "0-3\n"), (1, "4-7,12\n")):
        d = tmp_path / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus)
    for bus, node in (("0000:1b:00.0", "1\n"), ("0000:dc:00.0", "-1\n")):
        d = tmp_path / "bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node)
    every = set(range(16))
    assert numa_cpus("0000:1B:00.0", tmp_path, every) == {4, 5, 6, 7, 12}
    assert numa_cpus("0000:dc:00.0", tmp_path, every) == {0, 1, 2, 3}
    assert numa_cpus("0000:99:00.0", tmp_path, every) == set()  # no such device: unbound
    assert numa_cpus("0000:1b:00.0", tmp_path, {0, 1, 12}) == {12}  # only the CPUs allowed


def test_a_cpu_calibration_measures_its_launches_unbound():
    import os

    import torch

    from moeplan.calibrate.micro import near_gpu

    before = os.sched_getaffinity(0)
    with near_gpu(torch.device("cpu")) as bound:
        assert bound is False and os.sched_getaffinity(0) == before
