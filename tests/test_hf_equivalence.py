"""`--init-from` computes transformers' function: step-1 loss equal to HF's on the same batch.

Tiny random checkpoints (`hf_tiny.py`, written with save_pretrained by transformers) of
Qwen3-MoE (v5 keys, attention biases, per-expert tensors), DeepSeek-V3 (yarn with
mscale_all_dim, group-limited routing with correction bias, attention biases, interleaved
RoPE, fused experts), Mixtral top-1 and top-2, Llama 3.1 (llama3 scaling) and dense Qwen3 are
loaded under world 1, tp2·ep2, pp2·dp2·ep2 and cp2 (one spawned world of 4,
`hf_equivalence_worker.py`), each rank reading only its own slices.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from moeplan.runtime.data import MarkovData  # noqa: E402
from moeplan.runtime.hf_io import hf_model_spec  # noqa: E402

from .conftest import TESTS  # noqa: E402
from .hf_equivalence_worker import DENSE, GBS, LAYOUTS, make_plan  # noqa: E402
from .hf_tiny import SEQ, hf_loss, write_models  # noqa: E402

MODELS = ["qwen3_moe", "deepseek_v3", "mixtral_top1", "mixtral_top2", "llama31", "qwen3"]
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
    from moeplan.runtime.parallelize import local_groups
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
])
def test_the_comparison_fails_without_the_feature(hf_dirs, reference, model, update):
    """Each imported feature changes the loss far beyond the tolerance: the tests can fail."""
    assert abs(moeplan_loss(hf_dirs[model]) - reference[model]) <= RTOL * reference[model]
    wrong = moeplan_loss(hf_dirs[model], **update)
    assert abs(wrong - reference[model]) > 10 * RTOL * reference[model]
