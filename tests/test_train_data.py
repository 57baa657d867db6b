"""Training for real, end to end through `moeplan run` (torchrun, gloo): a corpus written by
megatron-core's own IndexedDatasetBuilder trains under ep2 and tp2 with a falling validation
loss and TensorBoard scalars that TensorBoard's EventAccumulator reads; real text prepared with
a BPE tokenizer trained here trains under ep2 and tp2·pp2 and exports to a Hugging Face
directory that transformers loads, model and tokenizer, and generates from."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

from moeplan import Layout, Plan, TrainingSpec, load_cluster, load_model

from .conftest import DATA
from .test_data import texts, train_bpe

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

VOCAB = 512  # the BPE tokenizer's, and the model's
SEQ, GBS = 32, 8


def write_plan(path, world: int, **axes) -> str:
    model = load_model(DATA / "tiny_qwen3_moe.yaml").model_copy(update={"vocab_size": VOCAB})
    plan = Plan(model=model, cluster=load_cluster("h100", gpus=world),
                training=TrainingSpec(seq_len=SEQ, global_batch_size=GBS),
                layout=Layout.build(world, GBS, **axes))
    path.write_text(plan.model_dump_json())
    return str(path)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def evaluations(out) -> list[float]:
    return [r["eval_loss"] for r in rows(out) if "eval_loss" in r]


def same_losses(a, b, steps: int = 10) -> None:
    """Every plan of a model trains the same losses on the same batches (fp32, same seed, same
    data), step by step. Compared over the first `steps`: further on, a rounding difference of
    one reduction order flips some token's top-k expert and the runs part by more than 1e-4."""
    la, lb = [r["loss"] for r in rows(a)], [r["loss"] for r in rows(b)]
    assert len(la) == len(lb) and la[:steps] == pytest.approx(lb[:steps], rel=1e-4)


@pytest.mark.slow
def test_a_megatron_built_corpus_trains_under_ep2_and_tp2_and_tensorboard_reads_the_logs(
        cli, tmp_path):
    tok_path = train_bpe(tmp_path / "tokenizer.json", VOCAB)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    eod = tok.token_to_id("<|endoftext|>")
    builder = IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for text in texts():  # megatron-core writes the dataset
        builder.add_item(torch.tensor(tok.encode(text).ids + [eod]))
        builder.end_document()
    builder.finalize(str(tmp_path / "mc.idx"))
    steps, warm, lr = 20, 3, 3e-3
    common = ["--data", str(tmp_path / "mc"), "--split", "90,10,0", "--tokenizer-model",
              tok_path, "--steps", str(steps), "--eval-interval", "5", "--eval-iters", "4",
              "--lr", str(lr), "--min-lr", "5e-4", "--lr-warmup-iters", str(warm),
              "--lr-decay-style", "cosine", "--train-iters", str(steps), "--log-interval", "10",
              "--dtype", "fp32"]
    outs = {}
    for name, axes in (("ep2", {"ep": 2}), ("tp2", {"tp": 2})):
        out = outs[name] = tmp_path / name
        extra = ["--tensorboard-dir", str(tmp_path / "tb"), "--cluster", "h100"] \
            if name == "ep2" else []
        r = cli("run", write_plan(tmp_path / f"{name}.json", 2, **axes), "--out", str(out),
                *common, *extra, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        ev = evaluations(out)
        assert len(ev) == 4 and ev[-1] < ev[0] - 0.3, ev  # validation loss logged, falling
        assert f"validation at step {steps}" in r.stderr
    same_losses(outs["ep2"], outs["tp2"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
               for tag in acc.Tags()["scalars"]}
    for tag in ("lm loss", "learning-rate", "throughput", "tokens-per-second", "grad-norm",
                "mfu", "mem-peak-gigabytes", "moe/load-imbalance", "lm loss validation"):
        assert tag in scalars, (tag, sorted(scalars))
    assert [s for s, _ in scalars["lm loss"]] == list(range(1, steps + 1))
    assert [v for _, v in scalars["lm loss"]] == pytest.approx(
        [r["loss"] for r in rows(outs["ep2"])], rel=1e-6)
    # the learning rate follows the warm-up, then the cosine to min_lr at --train-iters
    got = [v for _, v in scalars["learning-rate"]]
    for step, value in enumerate(got):  # step counted from 0
        n = step + 1
        want = lr * n / warm if n <= warm else 5e-4 + 0.5 * (lr - 5e-4) * (
            1 + math.cos(math.pi * (n - warm) / (steps - warm)))
        assert value == pytest.approx(want, rel=1e-6)
    assert [s for s, _ in scalars["lm loss validation"]] == [5, 10, 15, 20]
    # Megatron's load_balancing_loss: per MoE layer, without the coefficient (1.0: balanced)
    moe_layers = sum(load_model(DATA / "tiny_qwen3_moe.yaml").moe_layers())
    lbl = [v for _, v in scalars["load_balancing_loss"]]
    assert lbl == pytest.approx([r["aux_loss"] / (1e-3 * moe_layers) for r in rows(outs["ep2"])],
                                rel=1e-5)
    assert all(0.9 < v < 3 for v in lbl), lbl
    assert all(v > 0 for _, v in scalars["tokens-per-second"] + scalars["mfu"])


@pytest.mark.slow
def test_prepared_text_trains_under_ep2_and_tp2_pp2_and_exports_with_its_tokenizer(cli,
                                                                                   tmp_path):
    tok_path = train_bpe(tmp_path / "tokenizer.json", VOCAB)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for text in texts():
            f.write(json.dumps({"text": text}) + "\n")
    r = cli("data", "prepare", str(tmp_path / "docs.jsonl"), "--tokenizer-model", tok_path,
            "-o", str(tmp_path / "docs"), "--workers", "2")
    assert r.returncode == 0, r.stderr
    steps = 50
    common = ["--data", str(tmp_path / "docs"), "--split", "95,5,0", "--tokenizer-model",
              tok_path, "--steps", str(steps), "--eval-interval", "10", "--eval-iters", "4",
              "--lr", "3e-3", "--lr-warmup-iters", "3", "--log-interval", "25",
              "--dtype", "fp32"]
    for name, world, axes in (("ep2", 2, {"ep": 2}), ("tp2pp2", 4, {"tp": 2, "pp": 2})):
        r = cli("run", write_plan(tmp_path / f"{name}.json", world, **axes), "--out",
                str(tmp_path / name), "--ckpt-dir", str(tmp_path / f"ckpt_{name}"), *common,
                timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        ev = evaluations(tmp_path / name)
        assert len(ev) == 5 and ev[-1] < ev[0] - 0.15, ev
    same_losses(tmp_path / "ep2", tmp_path / "tp2pp2")

    r = cli("checkpoint", "export", str(tmp_path / "ckpt_tp2pp2"), "--to", "hf", "-o",
            str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == Path(tok_path).read_bytes()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeplan.runtime.data import TokenData

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    prompt = "The for statement is used to iterate"
    ids = tok(prompt, return_tensors="pt")
    assert ids["input_ids"][0].tolist() == json_ids(tok_path, prompt)  # the run's tokenizer
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 8 or tok.eos_token_id in out[0].tolist()
    assert tok.decode(out[0]).startswith(prompt)
    # transformers' loss on the validation batches is the run's last evaluation loss
    valid = TokenData(str(tmp_path / "docs"), VOCAB, SEQ, GBS, seed=0, split="95,5,0",
                      which="valid")
    batch = torch.cat([valid.global_batch(i) for i in range(4)])  # --eval-iters 4
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    assert float(ce) == pytest.approx(evaluations(tmp_path / "tp2pp2")[-1], rel=1e-4)


def json_ids(tok_path: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tok_path).encode(text).ids


def test_a_blend_member_of_weight_zero_or_with_no_windows_in_the_split_is_never_sampled(tmp_path):
    """Megatron's blending rule breaks its first tie toward the lowest index, which samples a
    weight-0 dataset listed first; a dataset with no windows in a split (its size-proportional
    weight is 0) was then sampled too, and finding a window among none never ended. Neither
    is ever drawn, and both blends answer at once."""
    from moeplan.data.corpus import Corpus
    from moeplan.data.indexed import write_documents

    write_documents(tmp_path / "small", [np.full(20, 3)] * 30, np.uint16)
    write_documents(tmp_path / "big", [np.arange(400) % 500] * 100, np.uint16)
    g = np.arange(30_000)
    valid = Corpus(f"{tmp_path / 'small'} {tmp_path / 'big'}", None, "valid", 32, 0, 512)
    assert valid.parts[0].windows == 0 and set(valid.locate(g)[0]) == {1}
    zero = Corpus(f"0 {tmp_path / 'small'} 1 {tmp_path / 'big'}", "100,0,0", "train", 32, 0, 512)
    assert set(zero.locate(g)[0]) == {1}
    assert zero.samples(np.arange(4)).shape == (4, 33)


def test_a_blend_draws_every_weight_as_given_down_to_one_in_a_million(tmp_path):
    """Weights were held to multiples of 1/10,000 (a repeated block of draws), so a weight of
    1e-6 was drawn 100 times too often and a many-dataset blend with small weights refused.
    Each dataset's count after n samples is now within a few samples of weight × n, and its
    samples are its own 0, 1, 2, ... in order (every window drawn once per epoch)."""
    from moeplan.data.corpus import Corpus
    from moeplan.data.indexed import write_documents

    write_documents(tmp_path / "a", [np.arange(200) % 500] * 10, np.uint16)
    write_documents(tmp_path / "b", [np.arange(200) % 500] * 10, np.uint16)
    g = np.arange(3_000_000)
    rare = Corpus(f"0.000001 {tmp_path / 'a'} 0.999999 {tmp_path / 'b'}", "100,0,0", "train",
                  32, 0, 512)
    d, _ = rare.locate(g)
    assert (d == 0).sum() == 3
    weights = np.random.default_rng(0).lognormal(sigma=2.0, size=300)
    many = Corpus(" ".join(f"{float(w)!r} {tmp_path / ('a' if i % 2 else 'b')}"
                           for i, w in enumerate(weights)), "100,0,0", "train", 32, 0, 512)
    d, k = many.tree.assign(g[:1_000_000])
    counts = np.bincount(d, minlength=300)
    assert np.abs(counts - weights / weights.sum() * 1_000_000).max() < 10
    for j in (0, int(np.argmin(weights)), int(np.argmax(weights))):
        assert (k[d == j] == np.arange(counts[j])).all()
    from moeplan.errors import SpecError

    with pytest.raises(SpecError, match=f"weight of {tmp_path / 'a'} is below 2\\^-32"):
        Corpus(f"1e-12 {tmp_path / 'a'} 1 {tmp_path / 'b'}", "100,0,0", "train", 32, 0, 512)


@pytest.mark.slow
def test_separate_validation_data_is_read_whole_and_leaves_training_as_it_was(cli, tmp_path):
    """Megatron users bring a validation set of its own (--valid-data-path); moeplan took only
    a --split share of --data and said "No such option"."""
    from moeplan.data.indexed import write_documents
    from moeplan.runtime.settings import validation_source

    from .test_data import random_documents

    write_documents(tmp_path / "a", random_documents(300, 250, seed=4), np.uint16)
    unseen = [d + 250 for d in random_documents(60, 250, seed=5)]  # ids training never sees
    write_documents(tmp_path / "b", unseen, np.uint16)
    assert validation_source("a", None, "b") == ("b", "0,100,0")
    plan = write_plan(tmp_path / "w1.json", 1)
    evals, losses = {}, {}
    for name, extra in (("own", []), ("separate", ["--valid-data-path", str(tmp_path / "b")])):
        out = tmp_path / name
        r = cli("run", plan, "--data", str(tmp_path / "a"), "--split", "90,10,0", "--steps",
                "40", "--eval-iters", "2", "--log-interval", "40", "--dtype", "fp32", "--out",
                str(out), *extra, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        evals[name], losses[name] = evaluations(out), [x["loss"] for x in rows(out)]
    assert len(evals["own"]) == len(evals["separate"]) == 1  # --eval-iters alone: at the end
    assert losses["own"] == losses["separate"]
    assert evals["separate"][0] > evals["own"][0] + 0.3  # tokens it never trained on
