"""Every layout trains like the single-process plan (fp32, same seed, CPU/gloo).

One spawned world (`equivalence_worker.py`, 4 processes) trains every layout of both tiny MoE
models (and the layouts without experts of a tiny dense model with tied embeddings and biases); each test checks one claim: per-step losses within 1e-4 relative of the world-1
reference and, after the first step, the reduced gradient of every parameter (shards gathered
back to full size) equal to the reference's.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import run_world

MODELS = ["tiny_qwen3_moe", "tiny_deepseek_v3"]
ALL_MODELS = [*MODELS, "tiny_dense_tied"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence") / "results.pt"
    run_world("equivalence_worker.py", out)
    return torch.load(out)


def assert_matches_reference(results, layout: str, model: str,
                             reference: str = "reference") -> None:
    ref, got = results[(reference, model)], results[(layout, model)]
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step + 1}: loss {a} vs reference {b}"
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in got["grads"].items():
        r = ref["grads"][name]
        assert g.shape == r.shape, name
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4 * float(r.abs().max()) + 1e-10,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("model", ALL_MODELS)
def test_reference_learns_and_every_parameter_gets_a_gradient(results, model):
    ref = results[("reference", model)]
    assert ref["losses"][-1] < ref["losses"][0]
    for name, g in ref["grads"].items():
        assert g.abs().sum() > 0, name


@pytest.mark.parametrize("model", ALL_MODELS)
def test_tp2_with_sequence_parallelism_matches_single_process(results, model):
    assert_matches_reference(results, "tp2_sp", model)


@pytest.mark.parametrize("model", MODELS)
def test_ep2_matches_single_process(results, model):
    assert_matches_reference(results, "ep2", model)


@pytest.mark.parametrize("model", MODELS)
def test_tp2_ep4_dp2_folding_ep_beyond_dp_matches_single_process(results, model):
    assert_matches_reference(results, "tp2_ep4_dp2", model)


@pytest.mark.parametrize("model", MODELS)
def test_ep2_etp2_matches_single_process(results, model):
    assert_matches_reference(results, "ep2_etp2", model)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_dp4_with_distributed_optimizer_matches_single_process(results, model):
    assert_matches_reference(results, "dp4_distopt", model)


@pytest.mark.parametrize("model", MODELS)
def test_replicated_optimizer_dp2_ep2_matches_single_process(results, model):
    assert_matches_reference(results, "dp2_ep2_no_distopt", model)


@pytest.mark.parametrize("model", MODELS)
def test_allgather_dispatcher_matches_single_process(results, model):
    assert_matches_reference(results, "tp2_ep4_allgather", model)


@pytest.mark.parametrize("layout", ["ep4_flex_2_domains", "ep2_etp2_flex_2_domains"])
@pytest.mark.parametrize("model", MODELS)
def test_flex_dispatcher_across_two_nvlink_domains_matches_single_process(results, model,
                                                                          layout):
    """One copy per (token, remote domain) over the rail, fanned out inside the domain (and
    gathered over etp), one partial sum back: the same function as the all-to-all one."""
    assert results[(layout, model)]["dispatchers"] == ["FlexDispatcher"]
    assert_matches_reference(results, layout, model)


@pytest.mark.parametrize("model", MODELS)
def test_order_tp_cp_ep_pp_dp_with_etp2_matches_single_process(results, model):
    assert_matches_reference(results, "tp2_ep2_etp2_order_pp_dp", model)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_tp2_dp2_matches_single_process(results, model):
    assert_matches_reference(results, "tp2_dp2", model)


@pytest.mark.parametrize("model", MODELS)
def test_capacity_dropping_is_the_same_with_and_without_ep(results, model):
    """Dropping decides on each rank's own tokens, so dp2 and dp2+ep2 drop the same copies."""
    assert_matches_reference(results, "dp2_ep2_capacity", model, reference="dp2_capacity")
    dropless, dropped = results[("reference", model)], results[("dp2_capacity", model)]
    assert dropped["losses"] != dropless["losses"]  # capacity 1.0 did drop something


def test_a_wrong_gradient_would_be_caught(results):
    """The comparison can fail: the reference against itself with one gradient halved."""
    model = MODELS[0]
    ref = results[("reference", model)]
    broken = {"losses": ref["losses"], "grads": dict(ref["grads"])}
    name = next(n for n in broken["grads"] if "router" in n)
    broken["grads"][name] = broken["grads"][name] * 0.5
    with pytest.raises(AssertionError):
        assert_matches_reference({**results, ("broken", model): broken}, "broken", model)
