"""`--init-from` computes transformers' function: step-1 loss equal to HF's on the same batch.

Tiny random checkpoints (`hf_tiny.py`, written with save_pretrained by transformers) of
Qwen3-MoE (v5 keys, attention biases, per-expert tensors), DeepSeek-V3 (yarn with
mscale_all_dim, group-limited routing with correction bias, attention biases, interleaved
RoPE, fused experts), Mixtral top-1 and top-2, Llama 3.1 (llama3 scaling), dense Qwen3 and
GLM-4.5's Glm4Moe (RoPE on half of each head, q/k/v biases and norms, DeepSeek's MoE) are
loaded under world 1, tp2·ep2, pp2·dp2·ep2 and cp2 (one spawned world of 4,
`hf_equivalence_worker.py`), each rank reading only its own slices.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from moeplan.runtime.data import MarkovData  # noqa: E402
from moeplan.runtime.hf_io import hf_model_spec  # noqa: E402

from .conftest import TESTS  # noqa: E402
from .hf_equivalence_worker import DENSE, GBS, LAYOUTS, make_plan  # noqa: E402
from .hf_tiny import SEQ, hf_loss, write_models  # noqa: E402

# transformers is a test dependency (the `test` extra): these tests never skip silently
MODELS = ["qwen3_moe", "deepseek_v3", "mixtral_top1", "mixtral_top2", "llama31", "qwen3",
          "glm4_moe"]
RTOL = 1e-5


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("hf"))


def batch(directory):
    spec = hf_model_spec(directory)
    return next(iter(MarkovData(spec.vocab_size, SEQ, GBS, 0).micro_batches(0, 0, 1, GBS)))


@pytest.fixture(scope="module")
def reference(hf_dirs):
    """transformers' loss of each model on the batch a seed-0 run trains first."""
    return {name: hf_loss(d, *batch(d)) for name, d in hf_dirs.items()}


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_runs") / "losses.json"
    root = next(iter(hf_dirs.values())).parent
    proc = subprocess.run([sys.executable, str(TESTS / "hf_equivalence_worker.py"), str(root),
                           str(out)], capture_output=True, text=True, timeout=600, cwd=TESTS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def moeplan_loss(directory, **update) -> float:
    """World-1 step-1 loss, in process, of the checkpoint under a (possibly altered) spec."""
    from moeplan.runtime.groups import local_groups
    from moeplan.runtime.train import Trainer

    plan = make_plan(directory, 1, {})
    plan = plan.model_copy(update={"model": plan.model.model_copy(update=update)})
    return Trainer(plan, local_groups(), seed=0, init_from=str(directory)).step(0)[0].loss


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", MODELS)
def test_init_from_hf_gives_transformers_step1_loss(runs, reference, layout, model):
    if model in DENSE and LAYOUTS[layout][1].get("ep", 1) > 1:
        pytest.skip("dense model: no expert axis")
    got, ref = runs[layout][model][0], reference[model]
    assert abs(got - ref) <= RTOL * abs(ref), f"{layout}/{model}: {got} vs transformers {ref}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "world1"])
def test_training_from_hf_weights_matches_world1_at_step2(runs, layout):
    for model, losses in runs[layout].items():
        ref = runs["world1"][model][1]
        assert abs(losses[1] - ref) <= 1e-4 * abs(ref), f"{layout}/{model}"


@pytest.mark.parametrize(("model", "update"), [
    ("deepseek_v3", {"rope_scaling": None}),  # yarn frequencies and mscale² dropped
    ("llama31", {"rope_scaling": None}),  # llama3 scaling dropped
    ("mixtral_top1", {"norm_topk_prob": False}),  # top-1 weight not renormalised to 1
    ("qwen3_moe", {"rope_theta": 10000.0}),  # v5 rope_parameters θ (1e6) ignored
    ("glm4_moe", {"rotary_percent": 1.0}),  # the whole head rotated, not its first half
])
def test_the_comparison_fails_without_the_feature(hf_dirs, reference, model, update):
    """Each imported feature changes the loss far beyond the tolerance: the tests can fail."""
    assert abs(moeplan_loss(hf_dirs[model]) - reference[model]) <= RTOL * reference[model]
    wrong = moeplan_loss(hf_dirs[model], **update)
    assert abs(wrong - reference[model]) > 10 * RTOL * reference[model]


def test_imported_specs_count_transformers_parameters(hf_dirs):
    from transformers import AutoModelForCausalLM

    for name, d in hf_dirs.items():
        hf = AutoModelForCausalLM.from_pretrained(d)
        assert hf_model_spec(d).total_params() == hf.num_parameters(), name


ROPE_CASES = {
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 4.0},
    "yarn": {"factor": 40.0, "original_max_position_embeddings": 16, "beta_fast": 32,
             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "longrope": {"short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
                 "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("kind", list(ROPE_CASES))
@pytest.mark.parametrize("seq", [8, 64])
def test_rope_scaling_frequencies_equal_transformers(kind, seq):
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moeplan.runtime.layers import rope_frequencies
    from moeplan.specs.hf import model_from_hf_config

    params = {"rope_type": kind, "rope_theta": 5e5, **ROPE_CASES[kind]}
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=32,
                      rope_parameters=params)
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=seq)
    spec = model_from_hf_config(cfg.to_dict(), "cfg")
    inv, factor = rope_frequencies(spec.head_dim_, spec.rope_theta, spec.rope_scaling, seq)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-12)


@pytest.mark.slow
def test_cli_run_init_from_trains_from_transformers_weights(cli, hf_dirs, reference, tmp_path):
    plan = make_plan(hf_dirs["qwen3_moe"], 2, {"ep": 2})
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    out = tmp_path / "run"
    r = cli("run", str(path), "--steps", "2", "--out", str(out), "--init-from",
            str(hf_dirs["qwen3_moe"]), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    ref = reference["qwen3_moe"]
    assert abs(summary["measured"]["first_loss"] - ref) <= RTOL * ref
    assert any(n.startswith("objective: cross-entropy") for n in summary["notes"])


def _broken_copy(src, dst, edit):
    """A copy of checkpoint `src` whose tensors `edit` changed (a dict → dict)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    save_file(edit(load_file(f)), f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("edit", "named"), [
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.gate.weight"},
     "model.layers.1.mlp.gate.weight"),
    (lambda t: {**t, "model.norm.weight": t["model.norm.weight"][:-1]}, "model.norm.weight"),
    (lambda t: {k: v for k, v in t.items() if "experts.3.up_proj" not in k},
     "model.layers.0.mlp.experts.3.up_proj.weight"),
])
def test_a_checkpoint_not_matching_the_plan_is_refused_naming_the_tensor(hf_dirs, tmp_path,
                                                                         edit, named):
    from moeplan import SpecError
    from moeplan.runtime.hf_io import check_hf_dir

    bad = _broken_copy(hf_dirs["qwen3_moe"], tmp_path / "bad", edit)
    with pytest.raises(SpecError, match=re.escape(named)):
        check_hf_dir(hf_model_spec(hf_dirs["qwen3_moe"]), bad)


def test_init_from_another_models_checkpoint_exits_2_naming_the_field(cli, hf_dirs, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(make_plan(hf_dirs["qwen3_moe"], 1, {}).model_dump_json())
    r = cli("run", str(path), "--steps", "1", "--out", str(tmp_path / "o"), "--init-from",
            str(hf_dirs["mixtral_top2"]))
    assert r.returncode == 2 and "its config has" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("model", MODELS)
def test_import_then_export_without_training_is_bit_identical(hf_dirs, tmp_path, model):
    """Every tensor transformers wrote comes back bit for bit, under the same names (MLA's
    RoPE rows permuted and back, experts split and stacked and back), in several shards."""
    import torch
    from safetensors.torch import load_file

    from moeplan.runtime.groups import local_groups
    from moeplan.runtime.hf_io import HFWeights, write_hf
    from moeplan.runtime.train import Trainer

    d = hf_dirs[model]
    plan = make_plan(d, 1, {})
    trainer = Trainer(plan, local_groups(), seed=0, init_from=str(d))
    state = {n: p.detach() for n, p in trainer.model.named_parameters()}
    state.update({n: b for n, b in trainer.model.named_buffers() if n.endswith("expert_bias")})
    out = write_hf(plan.model, state, tmp_path / "out", max_shard_bytes=20_000)
    w = HFWeights(out)
    assert len(set(w.where.values())) > 1  # sharded, with an index
    original = load_file(d / "model.safetensors")
    assert set(w.where) == set(original)
    for name, t in original.items():
        assert torch.equal(w.read(name, ()), t), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left


@pytest.mark.slow
def test_exported_checkpoint_in_transformers_gives_the_next_steps_loss(cli, hf_dirs, tmp_path):
    """Train DeepSeek-V3 from HF weights under tp2, checkpointing step 2; export step 2, and
    transformers' loss on step 3's batch equals the loss the run computed at step 3."""
    d = hf_dirs["deepseek_v3"]
    path = tmp_path / "plan.json"
    path.write_text(make_plan(d, 2, {"tp": 2}).model_dump_json())
    ckpt, hf_out, run = tmp_path / "ckpt", tmp_path / "hf_out", tmp_path / "run"
    r = cli("run", str(path), "--steps", "3", "--out", str(run), "--init-from", str(d),
            "--ckpt-dir", str(ckpt), "--ckpt-every", "2", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    listed = cli("checkpoint", "list", str(ckpt), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    assert [(row["step"], row["verified"]) for row in rows] == [(2, True), (3, True)]
    r = cli("checkpoint", "export", str(ckpt), "--to", "hf", "-o", str(hf_out), "--step", "2",
            timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step3 = next(row["loss"] for row in rows if row["step"] == 3)
    tokens, targets = next(iter(MarkovData(64, SEQ, GBS, 0).micro_batches(2, 0, 1, GBS)))
    ref = hf_loss(hf_out, tokens, targets)
    assert abs(step3 - ref) <= RTOL * ref, (step3, ref)


def test_export_refuses_another_format_an_existing_directory_and_a_missing_step(cli, tmp_path):
    from moeplan import SpecError
    from moeplan.runtime.checkpoint import export_checkpoint
    from moeplan.runtime.hf_io import write_hf

    r = cli("checkpoint", "export", str(tmp_path), "--to", "gguf", "-o", str(tmp_path / "x"))
    assert r.returncode == 2 and "--to takes hf" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(SpecError, match="no complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "x")
    with pytest.raises(SpecError, match="already exists"):
        write_hf(_tiny_deepseek(), {}, tmp_path)


def _tiny_deepseek():
    from moeplan import load_model

    from .conftest import DATA

    return load_model(DATA / "tiny_deepseek_v3.yaml")


def test_export_refuses_a_model_no_transformers_architecture_computes():
    from moeplan import SpecError, load_model
    from moeplan.runtime.hf_io import hf_config_for

    from .conftest import DATA

    spec = load_model(DATA / "tiny_deepseek_v3.yaml").model_copy(
        update={"router_expert_bias": False})
    with pytest.raises(SpecError, match="router_expert_bias"):
        hf_config_for(spec)


@pytest.mark.parametrize("model", ["deepseek_v3", "qwen3_moe", "mixtral_top2", "glm4_moe"])
@pytest.mark.parametrize(("tp_rank", "ep_rank"), [(0, 0), (1, 1), (0, 1)])
def test_each_rank_reads_exactly_the_elements_it_keeps(hf_dirs, model, tp_rank, ep_rank):
    """A tp2·ep2 rank's shards equal its slices of the whole model, and the safetensors reads
    took exactly those elements: no rank reads the model (DeepSeek's fused-by-head rotary rows,
    per-expert and v4 Mixtral expert names included)."""
    import torch

    from moeplan.runtime.comm import Axis
    from moeplan.runtime.hf_io import HFWeights, load_hf_
    from moeplan.runtime.layers import shard_info
    from moeplan.runtime.model import Transformer
    from moeplan.runtime.parallelize import ExpertParallel, apply_ep, apply_tp

    d = hf_dirs[model]
    spec = hf_model_spec(d)
    whole = load_hf_(Transformer(spec, materialize=False), d, spec)
    full = dict(whole.named_parameters())
    rank = Transformer(spec, materialize=False)
    apply_tp(rank, Axis(size=2, rank=tp_rank))
    apply_ep(rank, ExpertParallel(ep=Axis(size=2, rank=ep_rank)))
    w = HFWeights(d)
    load_hf_(rank, d, spec, weights=w)
    kept = 0
    for name, p in rank.named_parameters():
        t = full[name]
        for dim, start, size in shard_info(p).slices:
            t = t.narrow(dim, start, size)
        assert torch.equal(p, t), name
        kept += p.numel()
    kept += sum(b.numel() for n, b in rank.named_buffers() if n.endswith("expert_bias"))
    assert w.elements_read == kept < sum(p.numel() for p in full.values())


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("hf_variants"), variants=True)


@pytest.mark.parametrize("model", ["deepseek_no_qlora", "qwen3_moe_mixed",
                                   "llama_dynamic_gelu_tanh", "qwen3_linear_gelu"])
def test_more_features_at_world1_give_transformers_loss(variant_dirs, model):
    """MLA without q LoRA and with halves RoPE (rope_interleave false), several shared
    experts, yarn without mscale; dense layers among MoE ones, no renormalisation, tied
    embeddings; dynamic NTK beyond the original context, gated tanh GELU, attention and MLP
    biases; linear scaling and gated exact GELU."""
    d = variant_dirs[model]
    ref = hf_loss(d, *batch(d))
    got = moeplan_loss(d)
    assert abs(got - ref) <= RTOL * ref, (got, ref)


def test_mtp_weights_round_trip_as_deepseeks_model_layers_n(tmp_path):
    """A moeplan DeepSeek-V3 with an MTP depth exports it as model.layers.{L}.{enorm, hnorm,
    eh_proj, shared_head.norm, ...} in DeepSeek's own config format, and --init-from reads it
    back bit for bit (MTP module included)."""

    from moeplan import load_model
    from moeplan.runtime.hf_io import HFWeights, write_hf
    from moeplan.runtime.model import Transformer

    from .conftest import DATA

    spec = load_model(DATA / "tiny_deepseek_v3.yaml")
    seeded = Transformer(spec, seed=3)
    state = _state(seeded)
    out = write_hf(spec, state, tmp_path / "hf")
    L = spec.num_layers
    assert {f"model.layers.{L}.enorm.weight", f"model.layers.{L}.eh_proj.weight",
            f"model.layers.{L}.shared_head.norm.weight"} <= set(HFWeights(out).where)
    assert hf_model_spec(out).mtp_layers == 1
    _loads_back_bit_for_bit(spec, out, state)


def _state(model) -> dict:
    """A model's parameters and its expert-bias buffers, each bias made distinct."""
    state = {n: p.detach() for n, p in model.named_parameters()}
    state.update({n: b + 0.01 * i for i, (n, b) in enumerate(model.named_buffers())
                  if n.endswith("expert_bias")})
    return state


def _loads_back_bit_for_bit(spec, out, state: dict) -> None:
    """`check_hf_dir` accepts `out` for `spec`, and `load_hf_` reads `state` back exactly."""
    import torch

    from moeplan.runtime.hf_io import check_hf_dir, load_hf_
    from moeplan.runtime.model import Transformer

    check_hf_dir(spec, out)
    loaded = Transformer(spec, materialize=False)
    load_hf_(loaded, out, spec)
    got = {n: p for n, p in loaded.named_parameters()}
    got.update({n: b for n, b in loaded.named_buffers() if n.endswith("expert_bias")})
    assert got.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(got[name], t), name


def test_glm_mtp_weights_travel_in_the_hubs_layout_and_transformers_loads_the_export(
        hf_dirs, tmp_path):
    """A GLM-4.5-style model with an MTP depth (as the glm-4.5 presets train) exports its MTP
    module as model.layers.{L}.* with num_nextn_predict_layers, the hub's layout; transformers
    loads the directory and computes the same loss as moeplan; `--init-from` reads the depth
    back from the weights, bit for bit, although the config counts none for transformers."""
    import torch

    from moeplan.runtime.hf_io import HFWeights, write_hf
    from moeplan.runtime.model import Transformer

    spec = hf_model_spec(hf_dirs["glm4_moe"]).model_copy(update={"mtp_layers": 1})
    seeded = Transformer(spec, seed=5)
    state = _state(seeded)
    out = write_hf(spec, state, tmp_path / "hf")
    L = spec.num_layers
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    w = HFWeights(out)
    assert {f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.mlp.gate.weight",
            f"model.layers.{L}.embed_tokens.weight",
            f"model.layers.{L}.shared_head.head.weight"} <= set(w.where)
    assert torch.equal(w.read(f"model.layers.{L}.shared_head.head.weight", ()),
                       state["output"])  # the hub's copy of the output layer
    assert hf_model_spec(out).mtp_layers == 0  # what transformers builds
    _loads_back_bit_for_bit(spec, out, state)
    ref = hf_loss(out, *batch(out))  # the MTP weights passed over, as transformers does
    assert abs(moeplan_loss(out) - ref) <= RTOL * ref


def test_a_plan_with_an_mtp_depth_the_checkpoint_lacks_is_refused_naming_the_weights(hf_dirs):
    from moeplan import SpecError
    from moeplan.runtime.hf_io import check_hf_dir

    d = hf_dirs["glm4_moe"]
    spec = hf_model_spec(d).model_copy(update={"mtp_layers": 1})
    with pytest.raises(SpecError, match=r"holds no 'model\.layers\.2\.eh_proj\.weight'"):
        check_hf_dir(spec, d)
