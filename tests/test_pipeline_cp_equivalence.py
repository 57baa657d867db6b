"""Pipeline and context parallelism train like the single-process plan (fp32, same seed, gloo).

One spawned world of 8 processes (`pipeline_cp_worker.py`) trains each layout of the tiny models
(the dense tied-embedding model under the layouts without experts): per-step losses within 1e-4
relative of the world-1 reference, and after the first step the reduced gradient of every
parameter, shards gathered over tp, ep and the pipeline stages, equal to the reference's.
The tiny models' 3 decoder layers do not split evenly over 2 or 4 virtual stages, so every pp
layout here runs Megatron's balanced uneven layout (E, L and MTP counted as a layer each).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import run_world
from .test_equivalence import ALL_MODELS, MODELS, assert_matches_reference


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_cp") / "results.pt"
    run_world("pipeline_cp_worker.py", out)
    return torch.load(out)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_pp2_1f1b_with_uneven_stages_matches_single_process(results, model):
    """tiny_deepseek_v3 puts its MTP depth on the last stage with a copy of the embedding;
    tiny_dense_tied shares the tied output head with the first stage the same way."""
    assert_matches_reference(results, "pp2", model)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_pp2_interleaved_vpp2_with_tp2_matches_single_process(results, model):
    assert_matches_reference(results, "pp2_vpp2_tp2", model)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_cp2_ring_attention_with_load_balancing_matches_single_process(results, model):
    assert_matches_reference(results, "cp2", model)


@pytest.mark.parametrize("model", ALL_MODELS)
def test_cp4_dp2_three_ring_shifts_and_dp_cp_reduction_match_single_process(results, model):
    assert_matches_reference(results, "cp4_dp2", model)


@pytest.mark.parametrize("model", MODELS)
def test_tp2_cp2_pp2_with_ep4_on_eight_ranks_matches_single_process(results, model):
    assert_matches_reference(results, "tp2_cp2_pp2_ep4", model)


def test_pipeline_ranks_report_time_blocked_on_receives(results):
    waits = results[("pp2", MODELS[0])]["pipeline_wait"]
    assert len(waits) == 3 and all(0 <= wait <= total for wait, total in waits)
