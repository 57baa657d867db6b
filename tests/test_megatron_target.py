"""The plan is the job: what `--target megatron` recommends, Megatron's own code accepts.

megatron-core (from the package index, as in the test extras) builds its TransformerConfig from
each export of the acceptance set listed in docs/EXPORT.md, with only Transformer Engine's
kernels stood in; every rule of the rules table whose source is megatron-core is shown to be
one megatron-core enforces (the unguarded export of a plan breaking it fails there), and every
rule read from `validate_args` (not on the package index) fires on a plan that breaks it.
"""

from __future__ import annotations

import warnings

import pytest

from moeplan import Choices, Layout, Plan, TrainingSpec, load_cluster, load_model
from moeplan.errors import LayoutError
from moeplan.planner import export as export_mod
from moeplan.planner.export import export, megatron_env, to_megatron_args
from moeplan.specs import layout_violations
from moeplan.specs.rules import (
    BY_NAME,
    MEGATRON,
    RULES,
    STACK_FEATURES,
    STACK_RULES,
    markdown,
    rules_for,
)

from .megatron_core_config import (
    EXPORT_DOC,
    acceptance_plans,
    filled,
    parsed_values,
    parser,
    transformer_config,
)

pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore", module="megatron")


def test_the_export_page_lists_every_rule_with_its_source():
    text = EXPORT_DOC.read_text()
    block = text.split("<!-- rules:begin -->", 1)[1].split("<!-- rules:end -->", 1)[0]
    assert block.strip() == markdown().strip()
    assert all(f"`{r.name}`" in block for r in RULES)


# --------------------------------------------------------------- the acceptance set, in CI
@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    return acceptance_plans(tmp_path_factory.mktemp("acceptance"))


def _config_values(cfg, args) -> dict[str, object]:
    layout = getattr(cfg, "pipeline_model_parallel_layout", None)
    vpp = cfg.virtual_pipeline_model_parallel_size or (
        layout.virtual_pipeline_model_parallel_size if layout is not None else None) or 1
    moe = cfg.num_moe_experts is not None
    return {"tp": cfg.tensor_model_parallel_size, "pp": cfg.pipeline_model_parallel_size,
            "cp": cfg.context_parallel_size, "ep": cfg.expert_model_parallel_size,
            "etp": cfg.expert_tensor_parallel_size if moe else None, "vpp": vpp,
            "dp": None, "mbs": args.micro_batch_size, "gbs": args.global_batch_size,
            "num_microbatches": None, "num_layers": cfg.num_layers,
            "mtp_num_layers": cfg.mtp_num_layers,
            "recompute_granularity": cfg.recompute_granularity,
            "recompute_modules": (sorted(cfg.recompute_modules)
                                  if cfg.recompute_granularity == "selective" else None),
            "offload_modules": (sorted(cfg.offload_modules)
                                if cfg.fine_grained_activation_offloading else None)}


@pytest.mark.slow
def test_every_acceptance_plan_builds_megatron_cores_config_with_the_plans_values(plans):
    """Top three plans of eight searches (DeepSeek-V3, Kimi-K2, Qwen3-235B, Qwen3-30B, Mixtral
    8x7B and 8x22B, Llama-3 70B; H100, B200, GB200) and every hand layout of docs/EXPORT.md."""
    assert len(plans) >= 8 * 3 + 5
    for label, plan in plans:
        assert plan.target == "megatron", label
        argv = filled(export(plan)["args"])
        cfg = transformer_config(argv)  # megatron-core's validation: must raise nothing
        got = _config_values(cfg, parser().parse_args(argv))
        want = parsed_values(plan)
        for key, value in got.items():
            if value is not None or key in ("mtp_num_layers", "recompute_granularity",
                                            "recompute_modules", "offload_modules"):
                assert value == want[key], (label, key, value, want[key])


@pytest.mark.slow
def test_megatron_target_searches_choose_one_set_for_every_stage(plans):
    for label, plan in plans:
        assert plan.choices.uniform(), label
        assert layout_violations(plan.model, plan.training, plan.layout, plan.world_size,
                                 plan.choices, plan.cluster, "megatron") == [], label


# ------------------------------------------------------------ each rule, shown to be real
def _plan(model: str, gpus: int, gbs: int = 64, seq: int = 4096, precision: str = "bf16",
          choices: Choices | None = None, **axes) -> Plan:
    return Plan(model=load_model(model), cluster=load_cluster("h100", gpus=gpus),
                training=TrainingSpec(seq_len=seq, global_batch_size=gbs, precision=precision),
                layout=Layout.build(gpus, gbs, **axes), choices=choices or Choices())


def _broken(name: str) -> Plan:
    """A plan that breaks the rule `name` and no other megatron-core check."""
    mixtral, ds, qwen = "mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b"
    return {
        "heads_divisible_by_tp": lambda: _plan("llama3-8b", 48, gbs=48, tp=3),
        "ep_overlap_needs_vpp": lambda: _plan(mixtral, 16, pp=2, ep=8, ep_overlap=True),
        "ep_overlap_dispatcher": lambda: _plan(mixtral, 16, ep=8, dispatcher="allgather",
                                               ep_overlap=True),
        "ep_overlap_needs_ep": lambda: _plan(mixtral, 16, ep=1, ep_overlap=True),
        "ep_overlap_recompute": lambda: _plan(mixtral, 16, ep=8, ep_overlap=True,
                                              choices=Choices(recompute=["full"])),
        "mla_up_proj_needs_mla": lambda: _plan(mixtral, 16, ep=8,
                                               choices=Choices(recompute=["mla_up_proj"])),
        "offload_attn_proj_needs_core_attn": lambda: _plan(
            mixtral, 16, ep=8, choices=Choices(offload=["attn_proj"])),
        "moe_recompute_excludes_moe_offload": lambda: _plan(
            mixtral, 16, ep=8, choices=Choices(recompute=["moe"], offload=["expert_fc1"])),
        "fp8_delayed_recompute": lambda: _plan(mixtral, 16, precision="fp8-delayed", ep=8,
                                               choices=Choices(recompute=["moe_act"])),
        "cuda_graphs_recompute": lambda: _plan(qwen, 16, ep=8, cuda_graphs=True,
                                               choices=Choices(recompute=["moe"])),
        "full_iteration_graphs_offload": lambda: _plan(
            qwen, 16, ep=8, dispatcher="flex", cuda_graphs=True,
            cuda_graph_scope="full_iteration", choices=Choices(offload=["expert_fc1"])),
        "ep_overlap_moe_graph": lambda: _token_drop(_plan(qwen, 16, ep=8, ep_overlap=True,
                                                          cuda_graphs=True)),
        "pad_to_capacity_dispatcher": lambda: _token_drop(_plan(
            qwen, 16, ep=8, dispatcher="flex", flex_backend="deepep")),
        "expert_bias_needs_sigmoid": lambda: _plan(
            load_model(mixtral).model_copy(update={"router_expert_bias": True}), 16, ep=8),
        "top1_softmax_needs_pre_softmax": lambda: _plan(
            load_model(mixtral).model_copy(update={"moe_top_k": 1}), 16, ep=8),
        "expert_bias_linear_needs_etp1": lambda: _plan("gpt-oss-120b", 16, ep=8, etp=2),
        "ep_overlap_mtp": lambda: _plan(
            load_model(ds).model_copy(update={"mtp_layers": 2}), 256, gbs=256, pp=4, vpp=2,
            ep=64, ep_overlap=True),
        "mtp_placement": lambda: _plan(ds, 256, gbs=256, pp=4, ep=64, choices=Choices(
            stage_layout="Et*15|t*15|t*15m|t*16L")),
        "stage_layout_valid": lambda: _plan(ds, 256, gbs=256, pp=4, ep=64, choices=Choices(
            stage_layout=BAD_LAYOUT)),
    }[name]()


def _token_drop(plan: Plan, pad: bool = True) -> Plan:
    """The plan with Megatron-Bridge's token dropping: capacity factor 1, padded or not."""
    t = plan.training.model_copy(update={"moe_capacity_factor": 1.0,
                                         "moe_pad_expert_input_to_capacity": pad})
    return plan.model_copy(update={"training": TrainingSpec.model_validate(t.model_dump())})


GOOD_LAYOUT, BAD_LAYOUT = "Et*15|t*15|t*15|t*16mL", "Et*15|t*15|t*15|t*15mL"  # 61 and 60 layers
# the check's wording in megatron-core, for the rules an older megatron-core may not have yet
SINCE = {"moe_recompute_excludes_moe_offload": "while recomputing the entire MoE layer",
         "fp8_delayed_recompute": "Delayed scaling does not support moe_act",
         "ep_overlap_mtp": "MTP",
         "pad_to_capacity_dispatcher": "does not support moe_pad_expert_input_to_capacity",
         "ep_overlap_moe_graph": "CUDA graph scope on moe and mlp is not",
         "full_iteration_graphs_offload": "fine_grained_offloading_max_inflight_offloads"}
CORE_RULES = [r.name for r in rules_for("megatron")
              if r.where.startswith(("megatron/core/transformer/transformer_config",
                                     "megatron/core/transformer/pipeline_parallel_layer_layout"))
              and r.name not in ("uniform_stage_choices", "ep_needs_experts",
                                 "kv_heads_divisible_by_tp", "too_many_stages")]


def _unguarded_argv(plan: Plan, monkeypatch) -> list[str]:
    monkeypatch.setattr(export_mod, "check_exportable", lambda plan, target="megatron": None)
    return filled(to_megatron_args(plan)[0])


@pytest.mark.parametrize("name", CORE_RULES)
def test_each_megatron_core_rule_is_one_megatron_core_enforces(name, monkeypatch):
    """The plan breaking the rule is refused by name, and its export, forced past the check,
    fails in megatron-core's own validation (or the version installed predates the check)."""
    plan = _broken(name)
    names = [n for n, _ in layout_violations(plan.model, plan.training, plan.layout,
                                              plan.world_size, plan.choices, plan.cluster,
                                              "megatron")]
    assert name in names
    with pytest.raises(LayoutError, match=name):
        export(plan)
    if name in SINCE and SINCE[name] not in _core_source():
        pytest.skip(f"the installed megatron-core predates the {name} check")
    if name == "stage_layout_valid":  # no stage list to export: write the bad string as given
        good = plan.model_copy(update={"choices": Choices(stage_layout=GOOD_LAYOUT)})
        argv = [BAD_LAYOUT if a == GOOD_LAYOUT else a
                for a in _unguarded_argv(good, monkeypatch)]
    else:
        argv = _unguarded_argv(plan, monkeypatch)
    with pytest.raises((ValueError, AssertionError, NotImplementedError)):
        transformer_config(argv)


def _core_source() -> str:
    import inspect

    from megatron.core.transformer import TransformerConfig

    return inspect.getsource(TransformerConfig.__post_init__)


ARGS_RULES = {  # validate_args (megatron/training, not on the package index): encoded, tested
    "seq_divisible_by_2cp": lambda: _plan("llama3-8b", 8, seq=4094, cp=2),
    "gbs_divisible": lambda: _plan("llama3-8b", 8, gbs=64).model_copy(update={
        "training": TrainingSpec(seq_len=4096, global_batch_size=60)}),
    "vpp_needs_pp": lambda: _plan("llama3-8b", 8).model_copy(update={
        "layout": Layout(dp=8, vpp=2, num_microbatches=8)}),
    "experts_divisible_by_ep": lambda: _plan("mixtral-8x7b", 16).model_copy(update={
        "layout": Layout(dp=16, ep=16, num_microbatches=4)}),
    "fp8_param_gather_needs_dist_opt": lambda: _plan(
        "mixtral-8x7b", 16, ep=8, distributed_optimizer=False).model_copy(update={
            "training": TrainingSpec(seq_len=4096, global_batch_size=64,
                                     precision="fp8-tensorwise", fp8_param_gather=True)}),
    "optimizer_offload_fp8_param_gather": lambda: _plan(
        "mixtral-8x7b", 16, ep=8, choices=Choices(optimizer_offload_fraction=0.5)).model_copy(
        update={"training": TrainingSpec(seq_len=4096, global_batch_size=64,
                                         precision="fp8-tensorwise", fp8_param_gather=True)}),
    # megatron/core/optimizer/__init__.py::get_megatron_optimizer, at the optimizer's set-up
    # (not in the installed megatron-core yet): the export turns on the precision-aware
    # optimizer for optimizer CPU offload and bf16 moments
    "precision_aware_optimizer_needs_dist_opt": lambda: _plan(
        "mixtral-8x7b", 16, ep=8, distributed_optimizer=False,
        choices=Choices(optimizer_offload_fraction=0.5)),
    "tp_comm_overlap_needs_tp": lambda: _plan("llama3-8b", 8, tp_comm_overlap=True),
    # token_dispatcher.py, not a config check: the alltoall dispatcher's host sync breaks the
    # capture at run time
    "full_iteration_graphs_moe_buffers": lambda: _plan(
        "qwen3-30b-a3b", 16, ep=8, cuda_graphs=True, cuda_graph_scope="full_iteration"),
    # experts.py, at model build: TEGroupedMLP asserts "Fused GroupedMLP is not supported for
    # this configuration" (a BF16 recipe on Hopper here)
    "fused_grouped_mlp_support": lambda: _plan("qwen3-30b-a3b", 16, ep=8,
                                               fused_grouped_mlp=True),
    "fused_grouped_mlp_offload": lambda: _plan(
        "qwen3-30b-a3b", 16, ep=8, fused_grouped_mlp=True,
        choices=Choices(offload=["expert_fc1"])),
    "full_recompute_alone": lambda: _plan("llama3-8b", 8).model_copy(update={
        "choices": Choices.model_construct(recompute=[["full", "mlp"]], offload=[],
                                           optimizer_offload_fraction=0.0,
                                           stage_layout=None)}),
    "world_size": None,
}


@pytest.mark.parametrize("name", sorted(k for k, v in ARGS_RULES.items() if v))
def test_each_validate_args_rule_fires_on_a_plan_that_breaks_it(name):
    plan = ARGS_RULES[name]()
    v = dict(layout_violations(plan.model, plan.training, plan.layout, plan.world_size,
                               plan.choices, plan.cluster, "megatron"))
    assert name in v and v[name]
    with pytest.raises(LayoutError, match=name):
        export(plan)


def test_no_megatron_search_plan_runs_the_precision_aware_optimizer_without_dist_opt():
    """Megatron sets up the precision-aware optimizer (optimizer CPU offload, bf16 moments) only
    under the distributed optimizer; the search ranked such plans second and third (8 H100,
    Qwen3-30B-A3B), and bf16 moments refuse every layout without it."""
    from moeplan.planner.search import search

    model, cluster = load_model("qwen3-30b-a3b"), load_cluster("h100", gpus=8)
    plans = search(model, cluster, TrainingSpec(seq_len=4096, global_batch_size=1024),
                   target="megatron", top_k=5).plans
    assert plans and all(p.layout.distributed_optimizer for p in plans
                         if p.choices.optimizer_offload_fraction > 0)
    from moeplan.planner.problem import optimizer_offload

    t = TrainingSpec(seq_len=4096, global_batch_size=1024)
    for dist_opt in (True, False):
        layout = Layout(dp=8, ep=8, num_microbatches=128, distributed_optimizer=dist_opt)
        assert optimizer_offload(model, t, layout, "megatron") is dist_opt
        assert optimizer_offload(model, t, layout, "moeplan")  # the runtime offloads either way
    bf16 = _plan("mixtral-8x7b", 16, ep=8, distributed_optimizer=False).training.model_copy(
        update={"optimizer_moments_dtype": "bf16"})
    plan = _plan("mixtral-8x7b", 16, ep=8, distributed_optimizer=False)
    v = dict(layout_violations(plan.model, bf16, plan.layout, plan.world_size, None,
                               plan.cluster, "megatron"))
    assert "precision_aware_optimizer_needs_dist_opt" in v
    assert not layout_violations(plan.model, bf16, plan.layout, plan.world_size, None,
                                 plan.cluster, "moeplan")


def _graph_modules(argv: list[str]) -> list[str]:
    i = argv.index("--cuda-graph-modules") + 1
    out = []
    while i < len(argv) and not argv[i].startswith("--"):
        out.append(argv[i])
        i += 1
    return out


def test_token_drop_exports_its_padding_and_the_graph_scopes_megatron_core_accepts():
    """Padded to capacity, the MoE layer is graphed whole (`moe`); with a capacity factor and
    no padding the alltoall preprocess holds a device-to-host copy, so its scope stays out:
    the scope the dropless export uses is what megatron-core refuses there."""
    qwen = "qwen3-30b-a3b"
    padded = filled(to_megatron_args(_token_drop(_plan(qwen, 16, ep=8, cuda_graphs=True)))[0])
    assert "--moe-pad-expert-input-to-capacity" in padded
    assert _graph_modules(padded) == ["attn", "moe"]
    transformer_config(padded)
    capped = filled(to_megatron_args(_token_drop(_plan(qwen, 16, ep=8, cuda_graphs=True),
                                                 pad=False))[0])
    assert "--moe-pad-expert-input-to-capacity" not in capped
    assert _graph_modules(capped) == ["attn", "moe_router"]
    transformer_config(capped)
    i = capped.index("--cuda-graph-modules")
    with pytest.raises(AssertionError, match="moe_preprocess"):
        transformer_config(capped[:i + 3] + ["moe_preprocess"] + capped[i + 3:])
    dropless = filled(to_megatron_args(_plan(qwen, 16, ep=8, cuda_graphs=True))[0])
    assert _graph_modules(dropless) == ["attn", "moe_router", "moe_preprocess"]


def test_world_size_rule_compares_the_layout_with_the_cluster():
    plan = _plan("llama3-8b", 8)
    v = dict(layout_violations(plan.model, plan.training, plan.layout, 16, plan.choices,
                               plan.cluster, "megatron"))
    assert "world_size" in v and "16" in v["world_size"]


# ------------------------------------------------------------ the software stack's rules
def _on(plan: Plan, stack: str) -> Plan:
    """The plan priced on another software stack."""
    return plan.model_copy(update={"training": plan.training.model_copy(
        update={"software_stack": stack})})


STACK_BROKEN = {  # rule: (a plan that breaks it on the stack, the stack, the feature)
    "stack_model": (lambda: _plan("mixtral-8x7b", 16, ep=8), "megatron-2023", "moe"),
    "stack_cp": (lambda: _plan("llama3-8b", 16, cp=2), "megatron-2022", "cp"),
    "stack_dispatcher": (lambda: _plan("qwen3-30b-a3b", 16, ep=16, dispatcher="flex"),
                         "mcore-2024", "hybridep"),
    "stack_ep_overlap": (lambda: _plan("qwen3-30b-a3b", 16, ep=16, ep_overlap=True),
                         "mcore-2024", "ep_overlap"),
    "stack_tp_comm_overlap": (lambda: _plan("llama3-8b", 16, tp=8, tp_comm_overlap=True),
                              "megatron-2023", "tp_comm_overlap"),
    "stack_cuda_graphs": (lambda: _plan("llama3-8b", 16, tp=2, cuda_graphs=True),
                          "megatron-2023", "cuda_graphs"),
    "stack_fused_grouped_mlp": (lambda: _plan("qwen3-30b-a3b", 16, ep=8,
                                              fused_grouped_mlp=True, precision="mxfp8"),
                                "mcore-2024", "fused_grouped_mlp"),
    "stack_modules": (lambda: _plan("mixtral-8x7b", 16, ep=8, choices=Choices(
        offload=["expert_fc1"])), "mcore-2024", "activation_offload"),
    "stack_optimizer_offload": (lambda: _plan("mixtral-8x7b", 16, ep=8, choices=Choices(
        optimizer_offload_fraction=0.5)), "megatron-2023", "optimizer_offload"),
    "stack_distributed_optimizer": (lambda: _plan("llama3-8b", 16, tp=2),
                                    "megatron-2022", "distributed_optimizer"),
}


@pytest.mark.parametrize("name", sorted(STACK_BROKEN))
def test_a_plan_priced_on_an_older_stack_uses_nothing_that_stacks_megatron_lacked(name):
    """Refused by name on the older stack, naming the release that added the feature and the
    fix; the same plan on the stack that has it keeps the rule."""
    build, stack, feature = STACK_BROKEN[name]
    plan = build()
    if feature == "fused_grouped_mlp":  # the fused MLP runs on Blackwell
        plan = plan.model_copy(update={"cluster": load_cluster("gb200-nvl72", gpus=16)})
    since = STACK_FEATURES[feature].since

    def broken(p: Plan) -> dict[str, str]:
        return dict(layout_violations(p.model, p.training, p.layout, p.world_size, p.choices,
                                      p.cluster, "megatron"))

    old = broken(_on(plan, stack))
    assert name in old, old
    assert STACK_FEATURES[feature].release in old[name] and f"--stack {since}" in old[name]
    assert name not in broken(_on(plan, since))
    with pytest.raises(LayoutError, match=name):
        export(_on(plan, stack))


def test_each_stack_feature_is_a_megatron_core_setting():
    """Every feature the stack rules date is a field of Megatron Core's TransformerConfig (the
    installed megatron-core, newer than each release named, has them all), so the table dates
    settings Megatron has, not names of our own; the fused grouped MLP is an environment
    switch (`launch_env`)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    configs = {c.__name__: {f.name for f in dataclasses.fields(c)}
               for c in (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig)}
    missing = {k: (f.config, f.field) for k, f in STACK_FEATURES.items()
               if f.field is not None and f.field not in configs[f.config]}
    assert not missing
    assert {k for k, f in STACK_FEATURES.items() if f.field is None} == {"fused_grouped_mlp"}


def test_every_megatron_rule_has_a_test():
    tested = set(CORE_RULES) | set(ARGS_RULES) | set(STACK_BROKEN) | {
        "uniform_stage_choices", "ep_needs_experts", "kv_heads_divisible_by_tp",
        "too_many_stages"}
    assert set(STACK_BROKEN) == {"stack_model", "stack_modules", "stack_optimizer_offload",
                                 *STACK_RULES}
    megatron_only = {r.name for r in RULES if r.targets == MEGATRON}
    assert megatron_only <= tested | {r.name for r in RULES if "megatron" not in r.targets}
    assert all(BY_NAME[n] for n in tested if n in BY_NAME)


def test_per_stage_sets_are_refused_by_the_megatron_export_and_run_by_moeplan():
    plan = _plan("mixtral-8x7b", 16, pp=2, ep=8, choices=Choices(
        recompute=[["core_attn"], []], offload=[["expert_fc1"], []]))
    with pytest.raises(LayoutError, match="uniform_stage_choices"):
        export(plan)
    assert "moeplan run" in export(plan, "torchrun")["script"]
    assert layout_violations(plan.model, plan.training, plan.layout, 16, plan.choices,
                             plan.cluster, "moeplan") == []


# ------------------------------------------------------------------ launch requirements
def test_hopper_tensor_parallelism_exports_one_cuda_connection_unless_ep_overlap():
    assert megatron_env(_plan("llama3-8b", 8, tp=2)) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert megatron_env(_plan("llama3-8b", 8, cp=2)) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert megatron_env(_plan("llama3-8b", 8)) == {}
    overlap = _plan("mixtral-8x7b", 16, tp=2, ep=8, ep_overlap=True)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in megatron_env(overlap)
    blackwell = _plan("llama3-8b", 8, tp=2).model_copy(update={
        "cluster": load_cluster("b200", gpus=8)})
    assert megatron_env(blackwell) == {}


def test_activation_offload_exports_te_offload_v1_and_mla_exports_no_rope_fusion():
    plan = _plan("mixtral-8x7b", 16, ep=8, choices=Choices(offload=["expert_fc1"]))
    assert megatron_env(plan) == {"NVTE_CPU_OFFLOAD_V1": "1"}
    doc = export(plan)
    assert "export NVTE_CPU_OFFLOAD_V1=1" in doc["launch"]
    assert "--no-rope-fusion" not in doc["args"]
    mla = _plan("deepseek-v3", 256, gbs=256, pp=4, ep=64)
    assert "--no-rope-fusion" in export(mla)["args"]


def test_the_flex_dispatcher_exports_the_backend_it_was_priced_on_with_hybrideps_topology():
    """HybridEP (the default backend, the one Megatron Core runs across multi-node NVLink)
    takes its topology from the environment, as Megatron-Bridge's launches set it: the EP ranks
    per NVLink domain, the domain's size, and MNNVL on an NVL72; DeepEP takes none."""
    def on(cluster: str, gpus: int, **axes) -> Plan:
        plan = _plan("deepseek-v3", gpus, gbs=gpus, pp=8, **axes)
        return plan.model_copy(update={"cluster": load_cluster(cluster, gpus=gpus)})

    nvl = on("gb200-nvl72", 256, ep=32, dispatcher="flex")
    assert megatron_env(nvl) == {"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "32",
                                 "NVLINK_DOMAIN_SIZE": "72", "USE_MNNVL": "1"}
    args = filled(to_megatron_args(nvl)[0])
    assert args[args.index("--moe-flex-dispatcher-backend") + 1] == "hybridep"
    transformer_config(args)
    assert "export USE_MNNVL=1" in export(nvl)["launch"]
    hgx = on("h100", 256, ep=32, dispatcher="flex")  # four 8-GPU nodes per EP group
    assert megatron_env(hgx)["NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"] == "8"
    assert megatron_env(hgx)["USE_MNNVL"] == "0"
    deep = on("h100", 256, ep=32, dispatcher="flex", flex_backend="deepep")
    assert "USE_MNNVL" not in megatron_env(deep)
    args = filled(to_megatron_args(deep)[0])
    assert args[args.index("--moe-flex-dispatcher-backend") + 1] == "deepep"
    transformer_config(args)
    assert "NVLINK_DOMAIN_SIZE" not in megatron_env(on("h100", 256, ep=32))  # alltoall


def test_hybridep_pads_to_capacity_where_deepep_refuses_as_megatron_core_checks():
    padded = _token_drop(_plan("qwen3-30b-a3b", 16, ep=8, dispatcher="flex"))
    assert layout_violations(padded.model, padded.training, padded.layout, 16, padded.choices,
                             padded.cluster, "megatron") == []
    transformer_config(filled(to_megatron_args(padded)[0]))


def test_partial_rotary_exports_megatrons_rotary_percent_and_megatron_core_builds_it():
    """GLM-4.5 rotates half of each head: Megatron's --rotary-percent carries it (its
    RotaryEmbedding rotates int(kv_channels · rotary_percent) leading dims, as transformers'
    Glm4Moe slices them); a whole-head model exports no such flag."""
    def argv(name: str) -> list[str]:
        return filled(export(_plan(name, 512, gbs=1024, tp=4, pp=4, ep=16))["args"])

    glm = argv("glm-4.5")
    args = parser().parse_args(glm)
    assert args.rotary_percent == 0.5 and args.kv_channels == 128 and args.add_qkv_bias
    transformer_config(glm)  # megatron-core's validation: raises nothing
    assert "--rotary-percent" not in argv("qwen3-235b-a22b")


def test_the_launch_is_a_torchrun_of_pretrain_gpt_with_the_cadence_flags():
    doc = export(_plan("mixtral-8x7b", 16, ep=8), train_iters=3000)
    launch = doc["launch"]
    assert launch.startswith("#!/bin/bash\n") and "set -euo pipefail" in launch
    assert "torchrun" in launch and "pretrain_gpt.py" in launch and "--nnodes 2" in launch
    assert doc["megatron"] == {"commit": "d98e8a6", "core": "0.20.0",
                               "transformer_engine": "2.12"}
    args = parser().parse_args(filled(doc["args"]))
    assert (args.save_interval, args.eval_interval, args.eval_iters, args.log_interval) == (
        1000, 1000, 10, 10)
    assert args.split == "969,30,1" and args.tensorboard_dir == "/ckpt/tb"
    assert args.exit_signal_handler


def test_optimizer_offload_with_current_scaling_fp8_exports_clean_as_validate_args_allows():
    """Megatron's `validate_args` refuses optimizer CPU offload with a recipe other than delayed
    only under --fp8-param-gather; the export warned on every such plan (read from a guide that
    never reached Megatron-LM's main branch), so `--objective expected` winners carried a false
    'may be refused'."""
    plan = _plan("mixtral-8x7b", 16, precision="fp8-tensorwise", ep=8,
                 choices=Choices(optimizer_offload_fraction=0.5))
    argv, warn = to_megatron_args(plan)
    assert "--optimizer-cpu-offload" in argv and "tensorwise" in argv
    assert "--fp8-param-gather" not in argv
    assert not [w for w in warn if "offload" in w]
    gather = plan.model_copy(update={"training": plan.training.model_copy(
        update={"fp8_param_gather": True})})
    with pytest.raises(LayoutError, match="optimizer_offload_fp8_param_gather"):
        export(gather)
