"""`moeplan export`: Megatron-LM flags, torchrun line, Slurm script.

The Megatron output is parsed back with an argparse built from the verified flag table, the way
Megatron's own parser would read it: a misspelt flag, a value after a store_true flag, a value
outside the choices or an unparseable pattern fails the test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Sequence

import pytest

import moeplan
from moeplan import Choices, Layout, Plan, TrainingSpec, load_cluster, load_model
from moeplan.errors import LayoutError, SpecError
from moeplan.planner.export import (
    MEGATRON_FLAGS,
    format_megatron,
    to_megatron_args,
    to_slurm,
    to_torchrun,
    torchrun_argv,
)
from moeplan.specs.stage_layout import parse_stage_layout

from .conftest import REPO
from .megatron_core_config import CUSTOM_TYPES


# ------------------------------------------------------------------ Megatron's parsing rules
def megatron_parser() -> argparse.ArgumentParser:
    """argparse with exactly the table's flags, arities, types and choices (allow_abbrev off,
    as in Megatron's parse_args)."""
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for name, f in MEGATRON_FLAGS.items():
        if f.nargs == 0:
            p.add_argument(name, action="store_true")
            continue
        kw: dict = {"type": CUSTOM_TYPES.get(name, f.type or str)}
        if f.choices:
            kw["choices"] = list(f.choices)
        if f.nargs == "+":
            kw["nargs"] = "+"
        p.add_argument(name, **kw)
    return p


def parse(argv: Sequence[str]) -> argparse.Namespace:
    return megatron_parser().parse_args(list(argv))


def flags(argv: Sequence[str]) -> dict[str, list[str]]:
    """{flag: [values]} from argv tokens."""
    out: dict[str, list[str]] = {}
    cur = None
    for tok in argv:
        if tok.startswith("--"):
            assert tok not in out, f"{tok} emitted twice"
            out[tok], cur = [], tok
        else:
            out[cur].append(tok)  # type: ignore[index]
    return out


# ------------------------------------------------------------------ plans
def deepseek_plan(**choices: object) -> Plan:
    return Plan(
        model=load_model("deepseek-v3"),
        cluster=load_cluster("h100", gpus=256),
        training=TrainingSpec(seq_len=4096, global_batch_size=1024),
        layout=Layout.build(256, 1024, pp=4, vpp=4, ep=64, ep_overlap=True),
        choices=Choices(**choices),  # type: ignore[arg-type]
    )


def qwen3_plan() -> Plan:
    return Plan(
        model=load_model("qwen3-235b-a22b"),
        cluster=load_cluster("h100", gpus=64),
        training=TrainingSpec(seq_len=4096, global_batch_size=256),
        layout=Layout.build(64, 256, tp=4, pp=2, ep=16, etp=1),
    )


def mixtral_plan(**layout: object) -> Plan:
    axes = {"tp": 2, "ep": 8, **layout}
    return Plan(
        model=load_model("mixtral-8x7b"),
        cluster=load_cluster("h100", gpus=16),
        training=TrainingSpec(seq_len=4096, global_batch_size=256, precision="fp8-delayed"),
        layout=Layout.build(16, 256, **axes),
    )


# ------------------------------------------------------------------ the flag table itself
def test_parser_rejects_what_megatron_rejects():
    """The harness would catch the mistakes it exists for."""
    parse(["--num-layers", "4", "--swiglu"])
    for bad in (["--num-layer", "4"], ["--swiglu", "yes"], ["--fp8-format", "nvfp4"],
                ["--moe-layer-freq", "([0] * 3)"], ["--fp4-format", "nvfp4"]):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            parse(bad)


def test_every_flag_says_where_it_is_defined_and_is_documented():
    doc = (REPO / "docs" / "EXPORT.md").read_text()
    for name, f in MEGATRON_FLAGS.items():
        assert f.where, name
        assert f"`{name}`" in doc, f"{name} missing from docs/EXPORT.md"


# ------------------------------------------------------------------ DeepSeek-V3
def test_deepseek_v3_flags_are_exact():
    argv, warnings = to_megatron_args(deepseek_plan(recompute=["mla_up_proj", "moe_act"]))
    ns = parse(argv)
    f = flags(argv)
    assert warnings == []
    # MLA shape
    assert ns.multi_latent_attention and ns.qk_layernorm
    assert (ns.q_lora_rank, ns.kv_lora_rank, ns.qk_head_dim, ns.qk_pos_emb_head_dim,
            ns.v_head_dim) == (1536, 512, 128, 64, 128)
    assert ns.rope_type == "rope"
    assert "--group-query-attention" not in f and "--kv-channels" not in f
    assert (ns.num_layers, ns.hidden_size, ns.ffn_hidden_size, ns.num_attention_heads) == (
        61, 7168, 18432, 128)
    # MoE: first 3 dense layers as a --moe-layer-freq pattern, router groups, MTP
    assert f["--moe-layer-freq"] == ["([0]*3+[1]*58)"]
    assert ns.moe_layer_freq == [0] * 3 + [1] * 58
    assert (ns.num_experts, ns.moe_router_topk, ns.moe_ffn_hidden_size,
            ns.moe_shared_expert_intermediate_size) == (256, 8, 2048, 2048)
    assert ns.moe_router_score_function == "sigmoid"
    assert (ns.moe_router_num_groups, ns.moe_router_group_topk) == (8, 4)
    assert ns.moe_router_topk_scaling_factor == 2.5
    assert ns.moe_router_enable_expert_bias and not ns.moe_router_pre_softmax
    assert not ns.moe_shared_expert_gate
    assert (ns.mtp_num_layers, ns.mtp_loss_scaling_factor) == (1, 0.1)
    # parallelism: 61 layers + E + m + L over pp4·vpp4 is uneven → a layout, never also vpp
    assert (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size,
            ns.expert_model_parallel_size, ns.expert_tensor_parallel_size,
            ns.context_parallel_size) == (1, 4, 64, 1, 1)
    assert "--num-virtual-stages-per-pipeline-rank" not in f
    stages = parse_stage_layout(ns.pipeline_model_parallel_layout, pp=4, num_layers=61,
                                mtp_layers=1)
    assert len(stages) == 16 and all(len(s) == 4 for s in stages)
    assert not ns.sequence_parallel  # tp = 1
    assert ns.use_distributed_optimizer and ns.overlap_moe_expert_parallel_comm
    assert ns.moe_token_dispatcher_type == "alltoall"
    # batch, memory, precision, vocab
    assert (ns.seq_length, ns.micro_batch_size, ns.global_batch_size) == (4096, 1, 1024)
    assert ns.recompute_granularity == "selective"
    assert ns.recompute_modules == ["moe_act", "mla_up_proj"]
    assert "--recompute-method" not in f  # Megatron refuses a method with selective
    assert ns.bf16 and "--fp8-format" not in f
    assert ns.vocab_size == 129280 and 129280 % ns.make_vocab_size_divisible_by == 0
    assert ns.disable_bias_linear and ns.untie_embeddings_and_output_weights
    assert (ns.rotary_base, ns.norm_epsilon, ns.normalization) == (10000, 1e-6, "RMSNorm")


def test_explicit_uneven_stage_layout_is_passed_through():
    plan = Plan(
        model=load_model("deepseek-v3"),
        cluster=load_cluster("h100", gpus=256),
        training=TrainingSpec(seq_len=4096, global_batch_size=1024),
        layout=Layout.build(256, 1024, pp=16, vpp=2, ep=16),
        choices=Choices(stage_layout="Et*3|(tt|)*29,m|L"),
    )
    f = flags(to_megatron_args(plan)[0])
    assert f["--pipeline-model-parallel-layout"] == ["Et*3|(tt|)*29,m|L"]
    assert "--num-virtual-stages-per-pipeline-rank" not in f
    assert "'Et*3|(tt|)*29,m|L'" in format_megatron(to_megatron_args(plan)[0])


def test_stage_layout_that_does_not_match_the_model_is_refused():
    plan = deepseek_plan(stage_layout="Et*3|(tt|)*6,t|mL")  # 16 stages, 16 layers, not 61
    with pytest.raises(LayoutError, match="stage_layout_valid"):
        to_megatron_args(plan)


def test_uneven_stage_layers_become_a_layout():
    plan = mixtral_plan(pp=4, tp=1, ep=4)
    plan = Plan.model_validate({**plan.model_dump(mode="json", exclude={"format_version"}),
                                "choices": {"stage_layers": [7, 9, 9, 7]}})  # format 1
    ns = parse(to_megatron_args(plan)[0])
    stages = parse_stage_layout(ns.pipeline_model_parallel_layout, pp=4, num_layers=32)
    assert [s.count("t") for s in stages] == [7, 9, 9, 7]
    assert stages[0][0] == "E" and stages[-1][-1] == "L"


def test_even_split_uses_virtual_stage_count():
    plan = mixtral_plan(pp=2, vpp=4, tp=1, ep=8)
    f = flags(to_megatron_args(plan)[0])
    assert f["--num-virtual-stages-per-pipeline-rank"] == ["4"]
    assert "--pipeline-model-parallel-layout" not in f


# ------------------------------------------------------------------ Qwen3, Mixtral, others
def test_qwen3_gqa_and_qk_layernorm():
    argv, warnings = to_megatron_args(qwen3_plan())
    ns, f = parse(argv), flags(argv)
    assert warnings == []
    assert ns.group_query_attention and ns.num_query_groups == 4 and ns.kv_channels == 128
    assert ns.qk_layernorm and not ns.multi_latent_attention
    assert f["--moe-layer-freq"] == ["1"] and ns.moe_layer_freq == 1
    assert (ns.num_experts, ns.moe_router_topk, ns.moe_ffn_hidden_size) == (128, 8, 1536)
    assert "--moe-shared-expert-intermediate-size" not in f
    assert ns.moe_router_score_function == "softmax" and not ns.moe_router_pre_softmax
    assert ns.sequence_parallel and ns.tensor_model_parallel_size == 4
    assert ns.expert_tensor_parallel_size == 1  # written although Megatron would default to tp
    assert ns.rotary_base == 1_000_000
    # padding-free vocabulary: 151936 is a multiple of divisor·tp
    assert 151936 % (ns.make_vocab_size_divisible_by * 4) == 0


def test_mixtral_fp8_and_softmax_router():
    argv, warnings = to_megatron_args(mixtral_plan())
    ns = parse(argv)
    assert warnings == []
    assert (ns.num_experts, ns.moe_router_topk, ns.moe_ffn_hidden_size) == (8, 2, 14336)
    assert ns.num_query_groups == 8 and ns.swiglu and ns.norm_epsilon == 1e-5
    assert (ns.fp8_format, ns.fp8_recipe) == ("hybrid", "delayed") and ns.bf16


@pytest.mark.parametrize("precision,expect", [
    ("fp8-tensorwise", {"--fp8-format": ["hybrid"], "--fp8-recipe": ["tensorwise"]}),
    ("fp8-blockwise", {"--fp8-format": ["e4m3"], "--fp8-recipe": ["blockwise"]}),
    ("mxfp8", {"--fp8-format": ["e4m3"], "--fp8-recipe": ["mxfp8"]}),
    ("nvfp4", {"--fp4-format": ["e2m1"], "--fp4-recipe": ["nvfp4"]}),
])
def test_precision_recipes(precision, expect):
    plan = mixtral_plan()
    plan = plan.model_copy(update={
        "cluster": load_cluster("b200", gpus=16),
        "training": plan.training.model_copy(update={"precision": precision})})
    argv = to_megatron_args(plan)[0]
    parse(argv)
    f = flags(argv)
    for k, v in expect.items():
        assert f[k] == v


def test_gpt_oss_sliding_window_sinks_and_biases():
    plan = Plan(model=load_model("gpt-oss-120b"), cluster=load_cluster("h100", gpus=16),
                training=TrainingSpec(seq_len=4096, global_batch_size=256),
                layout=Layout.build(16, 256, tp=2, ep=8, dispatcher="flex"))
    argv, warnings = to_megatron_args(plan)
    ns, f = parse(argv), flags(argv)
    assert ns.softmax_type == "learnable"
    assert ns.window_size == (127, 0)
    assert ns.window_attn_skip_freq == [1, 0] * 18  # sliding first, alternating
    assert "--disable-bias-linear" not in f  # every linear has a bias
    assert ns.kv_channels == 64
    assert (ns.moe_token_dispatcher_type, ns.moe_flex_dispatcher_backend) == ("flex", "hybridep")
    assert any("router" in w for w in warnings)  # learned router bias has no Megatron flag
    # YaRN, factor 32 over 4,096 positions, no rounding; mscale 1 / mscale_all_dim 0 make
    # Megatron's cos/sin factor get_mscale(32), as transformers derives it
    assert ns.position_embedding_type == "yarn"
    assert (ns.rotary_scaling_factor, ns.yarn_original_max_position_embeddings) == (32.0, 4096)
    assert (ns.yarn_beta_fast, ns.yarn_beta_slow, ns.mscale, ns.mscale_all_dim) == (
        32.0, 1.0, 1.0, 0.0)
    assert ns.yarn_correction_range_round_to_int is False
    assert not any("not exported" in w for w in warnings)
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor,
    )

    assert _yarn_get_concentration_factor(ns.rotary_scaling_factor, ns.mscale, ns.mscale_all_dim
                                          ) == pytest.approx(
        plan.model.rope_scaling.yarn_attention_factor())


def test_qwen2_qkv_bias_shared_gate_and_unnormalised_softmax():
    plan = Plan(model=load_model("qwen2-57b-a14b"), cluster=load_cluster("h100", gpus=8),
                training=TrainingSpec(seq_len=4096, global_batch_size=64),
                layout=Layout.build(8, 64, ep=8, order="tp-cp-ep-pp-dp"))
    ns = parse(to_megatron_args(plan)[0])
    assert ns.disable_bias_linear and ns.add_qkv_bias
    assert ns.moe_shared_expert_gate and ns.moe_shared_expert_intermediate_size == 20480
    assert ns.moe_router_pre_softmax  # norm_topk_prob false: softmax over all experts
    assert ns.use_tp_pp_dp_mapping


def test_dense_gpt3_has_no_moe_flags():
    plan = Plan(model=load_model("gpt3-175b"), cluster=load_cluster("h100", gpus=64),
                training=TrainingSpec(seq_len=2048, global_batch_size=256),
                layout=Layout.build(64, 256, tp=8, pp=8))
    argv, warnings = to_megatron_args(plan)
    ns, f = parse(argv), flags(argv)
    assert warnings == []
    assert not [k for k in f if k.startswith("--moe") or k == "--num-experts"]
    assert ns.position_embedding_type == "learned_absolute"
    assert ns.max_position_embeddings == 2048 and ns.normalization == "LayerNorm"
    assert "--untie-embeddings-and-output-weights" not in f  # tied
    assert "--swiglu" not in f and "--disable-bias-linear" not in f  # gelu with biases


# ------------------------------------------------------------------ what Megatron cannot say
def test_per_stage_recompute_is_refused_naming_the_megatron_rule():
    plan = deepseek_plan(recompute=[["core_attn", "moe_act"], ["core_attn"], ["core_attn"],
                                    ["layernorm"]])
    with pytest.raises(LayoutError, match="uniform_stage_choices") as err:
        to_megatron_args(plan)
    assert "rank 0: recompute core_attn, moe_act" in str(err.value)
    assert "--target megatron" in str(err.value)


def test_full_recompute_exports_whole_layer_recompute():
    plan = mixtral_plan(pp=2, tp=1, ep=8)
    plan = plan.model_copy(update={"choices": Choices(recompute=["full"])})
    argv, warnings = to_megatron_args(plan)
    ns = parse(argv)
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == (
        "full", "uniform", 1)
    assert "--recompute-modules" not in flags(argv) and warnings == []


def test_offload_and_optimizer_offload():
    plan = deepseek_plan(offload=["expert_fc1", "moe_act"], optimizer_offload_fraction=0.5)
    plan = plan.model_copy(update={
        "training": plan.training.model_copy(update={"optimizer_moments_dtype": "bf16"})})
    argv, warnings = to_megatron_args(plan)
    ns = parse(argv)
    assert ns.fine_grained_activation_offloading
    assert ns.offload_modules == ["expert_fc1", "moe_act"]
    assert ns.optimizer_cpu_offload and ns.optimizer_offload_fraction == 0.5
    assert ns.use_precision_aware_optimizer  # Megatron asserts it with CPU offload
    assert (ns.exp_avg_dtype, ns.exp_avg_sq_dtype) == ("bf16", "bf16")
    assert warnings == []


def test_partial_biases_and_unnormalised_sigmoid_warn():
    m = load_model("deepseek-v3").model_copy(update={"attn_out_bias": True,
                                                      "norm_topk_prob": False})
    plan = deepseek_plan().model_copy(update={"model": m})
    argv, warnings = to_megatron_args(plan)
    f = flags(argv)
    assert "--disable-bias-linear" not in f  # superset: every linear gets a bias
    assert any("QKV or MLP/expert bias" in w for w in warnings)
    assert any("sigmoid" in w for w in warnings)


def test_capacity_factor_is_exported_when_set():
    if "moe_capacity_factor" not in TrainingSpec.model_fields:
        pytest.skip("TrainingSpec has no capacity factor")
    plan = mixtral_plan()
    assert "--moe-expert-capacity-factor" not in flags(to_megatron_args(plan)[0])  # dropless
    plan = plan.model_copy(update={
        "training": plan.training.model_copy(update={"moe_capacity_factor": 1.25})})
    assert parse(to_megatron_args(plan)[0]).moe_expert_capacity_factor == 1.25


def test_invalid_layout_is_refused():
    plan = mixtral_plan()
    bad = plan.layout.model_copy(update={"ep": 3})
    with pytest.raises(LayoutError, match="experts_divisible_by_ep"):
        to_megatron_args(plan.model_copy(update={"layout": bad}))


# ------------------------------------------------------------------ torchrun and slurm
def test_torchrun_line_is_a_valid_torchrun_command():
    plan = deepseek_plan()
    argv = torchrun_argv(plan, nnodes=32, plan_path="ds.json")
    assert argv[0] == "torchrun"
    run_args = ["run", "ds.json", "--data", "${DATA:?}", "--steps", "${STEPS:?}",
                "--ckpt-dir", "${CKPT_DIR:?}", "--resume"]
    assert argv[-len(run_args) - 2:] == ["-m", "moeplan", *run_args]
    run = pytest.importorskip("torch.distributed.run")
    ns = run.get_args_parser().parse_args(argv[1:])
    assert (ns.nnodes, ns.nproc_per_node, ns.rdzv_backend) == ("32", "8", "c10d")
    assert ns.module and ns.training_script == "moeplan"
    assert ns.training_script_args == run_args
    text = to_torchrun(plan, nnodes=32, plan_path="ds.json")
    assert '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in text
    assert text.rstrip().endswith(
        '-m moeplan run ds.json --data "${DATA:?}" --steps "${STEPS:?}" '
        '--ckpt-dir "${CKPT_DIR:?}" --resume')
    assert all(f"#   {k}" in text for k in ("DATA", "STEPS", "CKPT_DIR"))


def test_torchrun_defaults_and_errors():
    plan = mixtral_plan()  # 16 GPUs, 8 per node
    argv = torchrun_argv(plan)
    assert argv[1:5] == ["--nnodes", "2", "--nproc-per-node", "8"]
    one = torchrun_argv(plan, nnodes=1)
    assert "--standalone" in one and "--rdzv-backend" not in one
    with pytest.raises(SpecError, match="product"):
        torchrun_argv(plan, nnodes=3, nproc_per_node=8)
    with pytest.raises(SpecError):
        torchrun_argv(plan, nnodes=3)


def _launched_torchrun_args(script: str, tmp_path, with_numactl: bool,
                            binding_torchrun: bool = True) -> tuple[list[str], str]:
    """Run a launch script under bash with stand-ins for torchrun (which writes down its
    arguments; its --help lists --numa-binding unless it stands for a PyTorch before 2.9) and,
    when asked, numactl on an otherwise empty PATH: what torchrun was given, and what the script
    said on stderr."""
    bin_dir = tmp_path / f"numactl-{with_numactl}-binding-{binding_torchrun}"
    bin_dir.mkdir()
    got = bin_dir / "args"
    usage = "[--numa-binding {node,socket}] " if binding_torchrun else ""
    (bin_dir / "torchrun").write_text(
        f'#!/bin/bash\n[ "$1" = --help ] && {{ echo "usage: torchrun {usage}[--nnodes]"; '
        f'exit 0; }}\nprintf "%s\\n" "$@" > {got}\n')
    names = ["torchrun", "numactl"] if with_numactl else ["torchrun"]
    if with_numactl:
        (bin_dir / "numactl").write_text("#!/bin/bash\nexit 0\n")
    for name in names:
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
           **{k: "x" for k in ("DATA_PATH", "TOKENIZER_MODEL", "CHECKPOINT_DIR", "DATA",
                               "STEPS", "CKPT_DIR")}}
    r = subprocess.run(["/bin/bash", "-c", script], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return got.read_text().splitlines(), r.stderr


@pytest.mark.parametrize("fmt", ["megatron", "torchrun"])
def test_gpu_launches_bind_each_rank_to_its_gpus_numa_node_where_numactl_is(fmt, tmp_path):
    """The runs the host launch time is fitted on bound every rank to its GPU's NUMA node
    (NVIDIA's performance launches); the exported launch does so through torchrun's own flag,
    which torch's parser takes, and without numactl (which torch binds through) or with a
    torchrun older than the flag says so in one line and runs unbound."""
    script = moeplan.export(deepseek_plan(), fmt)["launch" if fmt == "megatron" else "script"]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    bound, said = _launched_torchrun_args(script, tmp_path, with_numactl=True)
    assert bound[:3] == ["--numa-binding", "node", "--nnodes"] and said == ""
    run = pytest.importorskip("torch.distributed.run")
    ns = run.get_args_parser().parse_args(bound)
    assert str(getattr(ns.numa_binding, "value", ns.numa_binding)) == "node"
    unbound, said = _launched_torchrun_args(script, tmp_path, with_numactl=False)
    assert unbound == bound[2:]
    assert said.count("\n") == 1 and "not found: the ranks run unbound" in said
    older, said = _launched_torchrun_args(script, tmp_path, True, binding_torchrun=False)
    assert older == bound[2:] and "PyTorch >= 2.9" in said  # launched, not refused


@pytest.mark.parametrize("fmt", ["megatron", "torchrun", "slurm"])
def test_an_export_of_a_plan_that_does_not_fit_says_so_with_its_peak(fmt):
    """Every executor runs a plan as written: a plan whose estimate does not fit its GPUs
    exports as a job that runs out of memory, and each format says so, with the peak and the
    line it must stay under; a plan that fits says nothing of it."""
    plan = qwen3_plan()
    peak = moeplan.estimate(plan).memory.peak_gb
    said = [w for w in moeplan.export(plan, fmt)["warnings"] if "does not fit" in w]
    assert len(said) == 1 and f"peaks at {peak:.1f} GB, above the fit line of 72.3 GB" in said[0]
    assert not [w for w in moeplan.export(fitting_plan(), fmt)["warnings"]
                if "does not fit" in w]
    # what overflows is the host's share of the offloaded activations, not the GPU: said so
    host = Plan(model=load_model("mixtral-8x7b"),
                cluster=load_cluster("h100", gpus=32).model_copy(update={"host_memory_gb": 4.0}),
                training=TrainingSpec(seq_len=4096, global_batch_size=256),
                layout=Layout.build(32, 256, ep=8, pp=4),
                choices=Choices(offload=["expert_fc1", "moe_act"]))
    est = moeplan.estimate(host)
    assert not est.fits and est.memory.peak_gb < 72.3 < 80
    said = [w for w in moeplan.export(host, fmt)["warnings"] if "does not fit" in w]
    assert len(said) == 1 and "offloads" in said[0] and "to the host" in said[0]
    assert "above the fit line" not in said[0]


def test_train_tokens_short_of_one_step_are_refused_naming_the_step():
    """1e3 tokens for a run whose step is 1M tokens is a typo for 1e13, not a one-step run."""
    with pytest.raises(SpecError, match=r"--train-tokens 1,000 is less than one step of this "
                       r"plan \(1,048,576 tokens"):
        moeplan.export(fitting_plan(), train_tokens=1e3)
    assert moeplan.export(fitting_plan(), train_tokens=1_048_576)["schedule"]["train_iters"] == 1


def test_a_multi_node_torchrun_script_stops_when_the_rendezvous_address_is_unset(tmp_path):
    """A bash script that stops at its first unset placeholder: without MASTER_ADDR it must
    not launch torchrun with an empty rendezvous address."""
    script = moeplan.export(mixtral_plan(), "torchrun", nnodes=2)["script"]
    assert script.startswith("#!/bin/bash\n") and "\nset -euo pipefail\n" in script
    assert "#   MASTER_ADDR  the first node's address" in script
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(f"#!/bin/bash\ntouch {tmp_path / 'launched'}\n")
    (bin_dir / "torchrun").chmod(0o755)
    env = {"PATH": str(bin_dir), "DATA": "x", "STEPS": "1", "CKPT_DIR": "x"}
    r = subprocess.run(["/bin/bash", "-c", script], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "MASTER_ADDR" in r.stderr
    assert not (tmp_path / "launched").exists()


def test_slurm_script_contents():
    script = to_slurm(deepseek_plan(), nnodes=32, plan_path="ds.json")
    assert script.startswith("#!/bin/bash\n")
    for line in ("#SBATCH --nodes=32", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue",
                 "srun --kill-on-bad-exit=1 --ntasks-per-node=1 moeplan run ds.json",
                 "--nnodes 32", "--nproc-per-node 8", '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"',
                 '--rdzv-id "$SLURM_JOB_ID"', "scontrol show hostnames", '--data "${DATA:?}"',
                 '--steps "${STEPS:?}"', '--ckpt-dir "${CKPT_DIR:?}"', "--resume",
                 'if [ "$code" -eq 75 ]; then scontrol requeue "$SLURM_JOB_ID"; fi'):
        assert line in script
    assert "tp1 cp1 dp64 pp4 vpp4 ep64" in script and "seq 4096" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


# ------------------------------------------------------------------ API and CLI
def fitting_plan() -> Plan:
    """Qwen3-235B-A22B on 128 H100 with full recompute: a plan that fits its GPUs."""
    return Plan(model=load_model("qwen3-235b-a22b"), cluster=load_cluster("h100", gpus=128),
                training=TrainingSpec(seq_len=4096, global_batch_size=256),
                layout=Layout.build(128, 256, tp=2, pp=4, ep=32, etp=1),
                choices=Choices(recompute=[["full"]]))


def test_public_api_returns_the_json_document():
    doc = moeplan.export(fitting_plan(), train_iters=5000)
    assert doc["format"] == "megatron" and doc["warnings"] == []
    parse(doc["args"])
    short = moeplan.export(fitting_plan())["warnings"]  # moeplan's own default schedule: said
    assert len(short) == 1 and "--train-iters N or --train-tokens T" in short[0]
    decays = fitting_plan()  # a spec that sets its decay length has a schedule of its own
    decays = decays.model_copy(update={"training": decays.training.model_copy(
        update={"lr_decay_iters": 100_000})})
    assert moeplan.export(decays)["warnings"] == []
    assert set(moeplan.export(fitting_plan(), "slurm")) == {"format", "script", "placeholders",
                                                            "warnings"}
    with pytest.raises(SpecError):
        moeplan.export(qwen3_plan(), "deepspeed")


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    doc = deepseek_plan(recompute=["core_attn"], offload=["expert_fc1"]).model_dump(mode="json")
    for derived in ("world_size", "edp", "sequence_parallel"):  # computed, not input fields
        doc["layout"].pop(derived)
    path.write_text(json.dumps(doc))
    return path


def test_cli_megatron_text_and_json(cli, plan_file):
    r = cli("export", str(plan_file), "--format", "megatron", "--flags-only")
    assert r.returncode == 0, r.stderr
    comments = [line for line in r.stderr.split("\n") if line.startswith("# ")]
    assert any("DATA_PATH" in c for c in comments)  # the placeholders to set, on stderr
    assert any("d98e8a6" in c for c in comments)  # the Megatron-LM the flags are for
    lines = r.stdout.rstrip("\n").split("\n")  # the flags alone: paste after pretrain_gpt.py
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    assert all(line.startswith("--") for line in lines)
    assert "--moe-layer-freq '([0]*3+[1]*58)' \\" in lines
    r = cli("export", str(plan_file), "--format", "megatron")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash\n")
    assert "export NVTE_CPU_OFFLOAD_V1=1" in r.stdout and "pretrain_gpt.py \\" in r.stdout
    subprocess.run(["bash", "-n"], input=r.stdout, text=True, check=True)
    r = cli("export", str(plan_file), "--json", "--train-iters", "5000")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # the fixture's layout does not fit an H100: that is the one warning
    assert doc["format"] == "megatron" and [w[:24] for w in doc["warnings"]] == [
        "this plan does not fit: "]
    assert doc["env"] == {"NVTE_CPU_OFFLOAD_V1": "1"} and doc["launch"] == (
        cli("export", str(plan_file), "--train-iters", "5000").stdout)
    assert "MASTER_ADDR  the first node's address" in doc["launch"]  # 256 GPUs: 32 nodes
    assert "run this same script on each of the 32 nodes" in doc["launch"]
    parse(doc["args"])


def test_cli_torchrun_and_slurm(cli, plan_file):
    r = cli("export", str(plan_file), "--format", "torchrun", "--nnodes", "32", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "torchrun" and str(plan_file) in doc["script"]
    r = cli("export", str(plan_file), "--format", "slurm", "--nproc-per-node", "8")
    assert r.returncode == 0 and "#SBATCH --nodes=32" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (("export", "missing-plan.json"), "does not exist"),
    (("export", "{plan}", "--format", "deepspeed"), "--format"),
    (("export", "{plan}", "--format", "torchrun", "--nnodes", "3"), "--nnodes"),
    (("export", "{bad}"), "invalid plan"),
])
def test_cli_errors_exit_2(cli, plan_file, tmp_path, args, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {}, "cluster": {}, "layout": {}}))
    argv = [a.format(plan=plan_file, bad=bad) for a in args]
    r = cli(*argv)
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""


def test_group_limited_routing_is_exported_with_a_word_where_megatron_ranks_groups_otherwise():
    """Megatron ranks groups by the sum of their top topk // group_topk scores; DeepSeek-V3
    (8 // 4 = 2) matches the model's top 2, a model picking every group (8 // 8 = 1) does not."""
    plan = deepseek_plan()
    _, warnings = to_megatron_args(plan)
    assert not [w for w in warnings if "expert groups" in w]
    other = plan.model_copy(update={"model": plan.model.model_copy(
        update={"router_groups_per_token": 8})})
    _, warnings = to_megatron_args(other)
    assert any("sum of their top 1 scores" in w and "by its top 2" in w for w in warnings)


def test_a_one_iteration_schedule_reads_1_iteration():
    from moeplan.planner.export import megatron_comments

    lines = megatron_comments(qwen3_plan(), 1)
    assert any("schedule: 1 iteration," in ln for ln in lines), lines
