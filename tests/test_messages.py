"""Messages that point the right way: rules in words with what would work instead, preset
names whatever their case with the closest named, and the list of precisions.

Every suggestion a message makes is checked here against the thing it suggests: the GPU
counts it names do have valid layouts, and the ones between do not.
"""

from __future__ import annotations

import json
import re

from moeplan import load_cluster, load_model
from moeplan.planner.enumerate import enumerate_layouts
from moeplan.planner.search import search_space
from moeplan.specs import PRECISIONS, TrainingSpec

from .conftest import run_cli


def valid_layouts(model: str, gpus: int, gbs: int, seq: int = 4096) -> int:
    c = load_cluster("h100", gpus)
    t = TrainingSpec(seq_len=seq, global_batch_size=gbs)
    return len(enumerate_layouts(load_model(model), c, t, gpus, search_space(c, "bf16",
                                                                             "megatron")).rows)


def test_a_gpu_count_without_layouts_names_rules_in_words_and_the_nearest_that_work(cli):
    r = cli("search", "--model", "deepseek-v3", "--cluster", "h100", "--gpus", "1000",
            "--seq", "4096", "--gbs", "8192")
    assert r.returncode == 3 and "Traceback" not in r.stderr
    msg = " ".join(r.stderr.split())
    assert "the global batch (8,192 sequences) must divide evenly" in msg.lower()
    assert not re.search(r"\b[a-z]+_[a-z_]+\b ×", msg)  # no internal rule codes
    found = re.search(r"GPU counts near 1,000 that have valid layouts: ([\d,]+) and ([\d,]+)",
                      msg)
    assert found, msg
    below, above = (int(x.replace(",", "")) for x in found.groups())
    assert (below, above) == (992, 1024)
    # checked, not guessed: these have valid layouts and every count between does not
    assert valid_layouts("deepseek-v3", below, 8192) and valid_layouts("deepseek-v3", above, 8192)
    assert not any(valid_layouts("deepseek-v3", n, 8192) for n in range(below + 1, above))
    gbs = int(re.search(r"keep 1,000 GPUs with --gbs (\d+)", msg).group(1))
    assert valid_layouts("deepseek-v3", 1000, gbs) > 0


def test_presets_match_whatever_the_case():
    r = run_cli("estimate", "--model", "Mixtral-8x7B", "--cluster", "H100", "--gpus", "8",
                "--gbs", "64", "--ep", "8", "--json")
    assert r.returncode == 0, r.stderr
    r = run_cli("specs", "show", "H100", "--json")
    assert r.returncode == 0 and '"name": "h100"' in r.stdout and '"kind": "cluster"' in r.stdout


def test_an_unknown_preset_names_the_closest(cli):
    for model, cluster, wanted in (("mixtral-8x7c", "h100", "Did you mean mixtral-8x7b"),
                                   ("deepseekv3", "h100", "Did you mean deepseek-v3?"),
                                   ("mixtral-8x7b", "gb200", "Did you mean gb200-nvl72?")):
        r = cli("search", "--model", model, "--cluster", cluster, "--gpus", "8")
        assert r.returncode == 2 and wanted in " ".join(r.stderr.split()), r.stderr


def test_an_unknown_precision_lists_the_precisions():
    r = run_cli("estimate", "--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "8",
                "--gbs", "64", "--precision", "fp8")
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "Did you mean fp8-delayed or fp8-tensorwise or fp8-blockwise?" in msg
    assert all(p in msg for p in PRECISIONS) and "specs validate" not in msg
    r = run_cli("whatif", "--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "8",
                "--precision", "bf16,fp8")
    assert r.returncode == 2 and "fp8-blockwise" in r.stderr and "auto" in r.stderr


def test_precision_auto_outside_search_and_whatif_says_it_is_theirs_and_asks_for_one_recipe():
    r = run_cli("estimate", "--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "8",
                "--gbs", "64", "--precision", "auto")
    msg = " ".join(r.stderr.split())
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "only search and whatif pick" in msg and "give it one recipe" in msg
    assert "is not a precision moeplan knows" not in msg
    assert all(p in msg for p in PRECISIONS)


def test_the_searched_sentence_counts_layouts_and_refused_splits_apart():
    """Bounds set aside valid layouts; rules refuse candidate splits that never were layouts.
    Summed in one list they read as more removed than searched (gpt-oss on 64 B200: 8,568
    searched, 10,857 "removed" by one rule)."""
    from moeplan.planner.branch import BOUNDS
    from moeplan.planner.enumerate import SAME_JOB
    from moeplan.planner.explain import searched_sentence
    from moeplan.planner.search import search
    from moeplan.specs import TrainingSpec, load_cluster, load_model
    from moeplan.specs.rules import BY_NAME

    # the enumeration's own two placement prunes and its copies of one job, beside the rules
    # table's names
    refusals = set(BY_NAME) | {"flex_inside_nvlink", "tp_cp_within_nvlink", *SAME_JOB}
    for model, cluster, gpus, gbs in (("qwen3-30b-a3b", "h100", 16, 256),
                                      ("gpt-oss-120b", "b200", 64, 512)):
        res = search(load_model(model), load_cluster(cluster, gpus),
                     TrainingSpec(seq_len=4096, global_batch_size=gbs))
        unknown = [k for k in res.pruned if k not in BOUNDS and k not in refusals]
        assert not unknown, unknown  # each count is a set-aside layout or a refused split
    said = searched_sentence(res, res.plans[0])
    set_aside = sum(v for k, v in res.pruned.items() if k in BOUNDS)
    refused = sum(v for k, v in res.pruned.items() if k not in BOUNDS and k not in SAME_JOB)
    copies = sum(v for k, v in res.pruned.items() if k in SAME_JOB)
    assert set_aside <= res.layouts < set_aside + refused
    assert f"the rules refused {refused:,} candidate splits" in said
    # copies of a kept job are no refusal: counted apart
    assert copies and f"{copies:,} rows repeating a kept job were not enumerated" in said
    head = said.split(". Before that")[0]
    assert "set aside:" in head and "expert parallel" not in head


def test_nothing_fits_with_fp32_gradients_suggests_bf16_ones_and_the_saving_they_make():
    """The GB the hint promises are the GB a search with --grad-reduce bf16 needs less, and
    where they cannot make the closest layout fit (DeepSeek-V3 on 8 H100) it is not offered as
    a way to fit; a search already reducing in bf16, and whatif (which takes no
    --grad-reduce), get no hint."""
    def answer(*extra: str) -> str:
        r = run_cli("search", "--model", "deepseek-v3", "--cluster", "h100", "--gpus", "8",
                    "--json", *extra)
        assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
        return json.loads(r.stdout)["message"]

    def need_gb(msg: str) -> int:
        return int(re.search(r"needs at least (\d+) GB per GPU", msg).group(1))

    fp32, bf16 = answer(), answer("--grad-reduce", "bf16")
    hint = re.search(r"Gradients reduced in bf16 \(--grad-reduce bf16\) would free about "
                     r"(\d+) GB per GPU at the closest layout, not enough on its own\.", fp32)
    assert hint and "or gradients reduced" not in fp32, fp32
    assert abs(need_gb(fp32) - need_gb(bf16) - int(hint.group(1))) <= 1
    assert "--grad-reduce" not in bf16
    r = run_cli("whatif", "--model", "deepseek-v3", "--cluster", "h100", "--gpus", "8",
                "--json")
    assert r.returncode == 3 and "nothing fits" in r.stdout and "--grad-reduce" not in r.stdout
    # where they can (Mixtral-8x7B on 4 H100), it is a way to fit, and the search then fits
    mixtral = ("search", "--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "4",
               "--seq", "4096", "--gbs", "64", "--top", "1", "--json")
    r = run_cli(*mixtral)
    assert r.returncode == 3, r.stderr
    assert "or gradients reduced in bf16 (--grad-reduce bf16), about" in r.stdout, r.stdout
    assert run_cli(*mixtral, "--grad-reduce", "bf16").returncode == 0
