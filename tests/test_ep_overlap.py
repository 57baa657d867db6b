"""EP communication overlap (the merged 1F1B schedule) trains like one process, really overlaps.

One spawned world (`ep_overlap_worker.py`, 4 processes) trains both tiny MoE models under the
overlap layouts; each test checks one claim against the world-1 reference (losses within 1e-4
relative, first-step reduced gradients like `test_equivalence.py`), or what the schedule's
trace recorded. The schedule itself is checked without processes: a simulation of every rank's
merged steps that would stall on a cycle.
"""

from __future__ import annotations

import pytest
import torch

from moeplan.runtime.pipeline import merged_schedule, schedule
from moeplan.runtime.support import features_not_executed
from moeplan.specs import Choices, Layout, Plan, TrainingSpec, load_cluster, load_model

from .conftest import DATA, run_world
from .test_equivalence import assert_matches_reference

MODELS = ["tiny_qwen3_moe", "tiny_deepseek_v3"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep_overlap") / "results.pt"
    run_world("ep_overlap_worker.py", out)
    return torch.load(out)


@pytest.mark.parametrize("model", MODELS)
def test_ep2_overlap_matches_single_process(results, model):
    assert results[("ep2_overlap", model)]["overlap"]
    assert_matches_reference(results, "ep2_overlap", model)


@pytest.mark.parametrize("model", MODELS)
def test_pp2_vpp2_ep2_overlap_matches_single_process(results, model):
    assert results[("pp2_vpp2_ep2_overlap", model)]["overlap"]
    assert_matches_reference(results, "pp2_vpp2_ep2_overlap", model)


@pytest.mark.parametrize("model", MODELS)
def test_ep2_etp2_overlap_matches_single_process(results, model):
    assert_matches_reference(results, "ep2_etp2_overlap", model)


@pytest.mark.parametrize("model", MODELS)
def test_flex_dispatcher_overlap_across_two_domains_matches_single_process(results, model):
    """Both flex hops (rail all-to-all, fan-out inside the domain) issued asynchronously."""
    assert_matches_reference(results, "ep4_flex_2_domains_overlap", model)
    hops = {(r["what"], r["handles"]) for t in results[("ep4_flex_2_domains_overlap", model)]
            ["traces"] for r in t}
    assert ("dispatch", 3) in hops  # the rail hop: rows, expert ids, probabilities at once


@pytest.mark.parametrize("model", MODELS)
def test_ep2_overlap_with_selective_recompute_matches_single_process(results, model):
    """layernorm, core_attn, moe_act and shared-expert recompute replay inside the pieces."""
    assert_matches_reference(results, "ep2_overlap_selective_recompute", model)


@pytest.mark.parametrize("model", MODELS)
def test_ep2_overlap_with_every_activation_offload_matches_single_process(results, model):
    """Every offload module moves what its ops save to host inside the merged schedule's
    pieces (the layer's scope spans them), and the function is the reference's."""
    row = results[("ep2_overlap_offload", model)]
    assert row["overlap"] and row["offloaded_bytes"] > 0
    assert results[("ep2_overlap", model)]["offloaded_bytes"] == 0
    assert_matches_reference(results, "ep2_overlap_offload", model)


@pytest.mark.parametrize("model", MODELS)
def test_pp2_vpp2_ep2_overlap_with_per_rank_offload_and_recompute_matches_single_process(
        results, model):
    row = results[("pp2_vpp2_ep2_overlap_offload_recompute", model)]
    assert row["overlap"] and row["offloaded_bytes"] > 0
    assert_matches_reference(results, "pp2_vpp2_ep2_overlap_offload_recompute", model)


# Megatron's pairing (combined_1f1b): what runs behind each hop of the other micro-batch
BEHIND = {("F", "dispatch"): "B experts", ("B", "dispatch"): "F experts",
          ("B", "combine"): "F attention", ("F", "combine"): "B attention"}


@pytest.mark.parametrize("model", MODELS)
def test_every_steady_state_hop_is_in_flight_behind_the_other_micro_batchs_compute(results,
                                                                                   model):
    """pp = 1, 4 micro-batches per rank: F0, (F1, B0), (F2, B1), (F3, B2), B3. Every hop of a
    merged step was issued asynchronously (a work handle), and the other micro-batch's
    attention or expert compute ran while its handle was outstanding, as Megatron pairs them;
    the lone F0 and B3 have nothing to hide behind."""
    traces = results[("ep2_overlap", model)]["traces"]
    assert len(traces) == 2 and all(traces)
    for trace in traces:
        for r in trace:
            assert r["handles"] >= 1, r
            lone = (r["side"] == "F" and r["mb"] == 0) or (r["side"] == "B" and r["mb"] == 3)
            if lone:
                assert r["overlapped"] == [], r
                continue
            other = "B" if r["side"] == "F" else "F"
            assert r["overlapped"], r
            assert all(lab.startswith(other) and not lab.endswith(f"mb{r['mb']}")
                       for lab in r["overlapped"]), r
            assert any(lab.startswith(BEHIND[r["side"], r["what"]]) for lab in r["overlapped"]), r


def test_some_transfer_was_still_running_when_the_other_micro_batch_computed(results):
    """The transfers really ran concurrently with compute: at least one hop's all-to-all had
    not completed when the other micro-batch's next sub-module began."""
    pending = [r["pending"] for (name, _), v in results.items() if name != "reference"
               for t in v["traces"] for r in t]
    assert pending and any(pending)


def test_the_reference_runs_without_the_merged_schedule(results):
    assert not results[("reference", MODELS[0])]["overlap"]
    assert not results[("reference", MODELS[0])]["traces"][0]


# ------------------------------------------------------------------------ schedule, no processes
def _simulate(pp: int, vpp: int, m: int) -> int:
    """Run every rank's merged steps as the executor does (receive both inputs, compute, send
    both outputs); returns the number of rounds, or fails on a stall (a deadlock)."""
    steps = {r: merged_schedule(pp, vpp, r, m) for r in range(pp)}
    last = pp * vpp - 1
    done: set[tuple[str, int, int]] = set()  # (kind, virtual stage, micro-batch)
    pos, rounds = dict.fromkeys(range(pp), 0), 0
    while any(pos[r] < len(steps[r]) for r in range(pp)):
        progressed = []
        for r in range(pp):
            if pos[r] == len(steps[r]):
                continue
            f, b = steps[r][pos[r]]
            ok = True
            if f is not None:
                s = f[0] * pp + r
                ok &= s == 0 or ("F", s - 1, f[1]) in done
            if b is not None:
                s = b[0] * pp + r
                ok &= ("F", s, b[1]) in done  # its own forward ran in an earlier step
                ok &= s == last or ("B", s + 1, b[1]) in done
                assert f is None or f[1] != b[1] or f[0] != b[0]
            if ok:
                progressed.append((r, f, b))
        assert progressed, f"pp{pp} vpp{vpp} m{m}: stalled at {pos}"
        for r, f, b in progressed:
            if f is not None:
                done.add(("F", f[0] * pp + r, f[1]))
            if b is not None:
                done.add(("B", b[0] * pp + r, b[1]))
            pos[r] += 1
        rounds += 1
    return rounds


@pytest.mark.parametrize("pp,vpp,m", [(1, 1, 1), (1, 1, 4), (2, 2, 4), (2, 2, 8), (4, 2, 8),
                                      (2, 3, 6), (4, 4, 16)])
def test_merged_schedule_runs_every_action_once_and_never_deadlocks(pp, vpp, m):
    for r in range(pp):
        merged = merged_schedule(pp, vpp, r, m)
        fwd = [f for f, _ in merged if f is not None]
        bwd = [b for _, b in merged if b is not None]
        plain = schedule(pp, vpp, r, m)
        assert fwd == [(c, mb) for k, c, mb in plain if k == "F"]  # the same orders
        assert bwd == [(c, mb) for k, c, mb in plain if k == "B"]
        assert all(f != b for f, b in merged)
    _simulate(pp, vpp, m)


def test_merged_schedule_with_one_stage_is_megatrons_no_pipelining_order():
    assert merged_schedule(1, 1, 0, 3) == [((0, 0), None), ((0, 1), (0, 0)), ((0, 2), (0, 1)),
                                           (None, (0, 2))]


# ------------------------------------------------------------------------------- refusals
def _plan(choices: Choices | None = None, **axes) -> Plan:
    return Plan(model=load_model(DATA / "tiny_qwen3_moe.yaml"),
                cluster=load_cluster("h100", gpus=4),
                training=TrainingSpec(seq_len=32, global_batch_size=8),
                layout=Layout.build(4, 8, **axes), choices=choices or Choices())


def test_ep_overlap_plans_are_executed_with_pp1_and_with_interleaved_pp():
    assert features_not_executed(_plan(ep=2, ep_overlap=True)) == []
    assert features_not_executed(_plan(ep=2, pp=2, vpp=2, ep_overlap=True)) == []
    assert features_not_executed(_plan(ep=4, dispatcher="flex", ep_overlap=True)) == []


def test_ep_overlap_with_activation_offload_is_executed():
    assert features_not_executed(_plan(Choices(offload=["core_attn"]), ep=2,
                                       ep_overlap=True)) == []
