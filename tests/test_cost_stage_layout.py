"""Megatron's --pipeline-model-parallel-layout syntax: parse, format, balance."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeplan.errors import SpecError
from moeplan.specs.stage_layout import (
    balanced_stage_layout,
    format_stage_layout,
    parse_stage_layout,
    stage_layout_for,
)


def test_parse_megatron_docstring_example():
    stages = parse_stage_layout("Ettt|(tt|)*29,m|L", pp=8, num_layers=61, mtp_layers=1)
    assert stages == [["E", "t", "t", "t"]] + [["t", "t"]] * 29 + [["m"], ["L"]]
    assert parse_stage_layout("Et*3|(tt|)*29,m|L") == stages


@pytest.mark.parametrize("bad, why", [
    ("Ettx|L", "unknown character"),
    ("tt|EL", "embedding"),
    ("Ett|tt", "loss"),
    ("Ett|ttL", "decoder layers"),
])
def test_parse_rejects_with_reason(bad, why):
    with pytest.raises(SpecError, match=why):
        parse_stage_layout(bad, num_layers=5)


def test_parse_checks_stage_count_against_pp():
    with pytest.raises(SpecError, match="multiple of pp"):
        parse_stage_layout("Ett|tt|ttL", pp=2)


def test_balanced_deepseek_v3_on_pp8_vpp4_is_two_units_per_stage():
    stages = balanced_stage_layout(61, 32, mtp_layers=1)
    assert all(len(s) == 2 for s in stages)
    assert stages[0] == ["E", "t"] and stages[-1] == ["m", "L"]
    assert sum(s.count("t") for s in stages) == 61


def test_balanced_qwen3_235b_on_32_stages():
    stages = balanced_stage_layout(94, 32)
    sizes = [len(s) for s in stages]
    assert max(sizes) - min(sizes) <= 1 and sum(s.count("t") for s in stages) == 94


def test_even_split_puts_embedding_and_loss_on_end_stages():
    stages = stage_layout_for(8, 2, 2)
    assert stages == [["E", "t", "t"], ["t", "t"], ["t", "t"], ["t", "t", "L"]]


@given(st.integers(1, 120), st.integers(1, 32), st.integers(0, 2))
def test_format_round_trips(layers, n, mtp):
    if n > layers + 2 + mtp:
        with pytest.raises(SpecError):
            balanced_stage_layout(layers, n, mtp)
        return
    stages = balanced_stage_layout(layers, n, mtp)
    assert len(stages) == n
    assert parse_stage_layout(format_stage_layout(stages)) == stages
