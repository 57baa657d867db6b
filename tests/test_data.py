"""Megatron indexed datasets, blends and splits, `moeplan data prepare`: tested against
megatron-core's own `indexed_dataset` (its builder writes, we read; we write, it reads) and the
`tokenizers` library, with a BPE tokenizer trained here on real English text (the Python
documentation topics CPython ships in `pydoc_data`)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest

from moeplan.data.corpus import Corpus, feistel, parse_blend, parse_split, split_bounds
from moeplan.data.indexed import read_index, write_documents
from moeplan.data.prepare import prepare
from moeplan.data.tokenizer import load_tokenizer
from moeplan.errors import SpecError

from .conftest import REPO, run_cli

torch = pytest.importorskip("torch")
with warnings.catch_warnings():  # megatron-core warns that Apex/TE are absent on CPU
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def texts() -> list[str]:
    """Real English: the Python documentation's topics, shipped with CPython."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def train_bpe(path, vocab_size: int = 512) -> str:
    """A byte-level BPE tokenizer trained by `tokenizers` on `texts()`, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


def random_documents(n: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, 60)) for _ in range(n)]


# ------------------------------------------------------------------ the format, both ways
@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 60_000), (np.int32, 150_000)])
def test_a_dataset_megatrons_builder_writes_reads_back_token_for_token(tmp_path, dtype, vocab):
    docs = random_documents(40, vocab)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for i in range(0, 40, 2):  # documents of two sequences (add_document) and of one (add_item)
        if i % 4:
            builder.add_item(torch.tensor(docs[i]))
            builder.add_item(torch.tensor(docs[i + 1]))
            builder.end_document()
        else:
            builder.add_document(np.concatenate([docs[i], docs[i + 1]]),
                                 [len(docs[i]), len(docs[i + 1])])
    builder.finalize(str(tmp_path / "m.idx"))
    ours, theirs = read_index(tmp_path / "m"), IndexedDataset(str(tmp_path / "m"))
    assert ours.dtype == np.dtype(dtype) and ours.num_sequences == len(theirs) == 40
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    assert ours.num_documents == 20
    tokens = np.memmap(tmp_path / "m.bin", dtype=ours.dtype, mode="r")
    for i in range(40):
        lo = ours.token_offset(i)
        assert np.array_equal(tokens[lo: lo + ours.sequence_lengths[i]], theirs[i])


def test_a_dataset_we_write_is_byte_identical_to_megatrons_and_megatron_reads_it(tmp_path):
    docs = random_documents(30, 1000, seed=1)
    write_documents(tmp_path / "ours", docs, np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.tensor(d))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"m{suffix}").read_bytes()
    theirs = IndexedDataset(str(tmp_path / "ours"))
    assert all(np.array_equal(theirs[i], d) for i, d in enumerate(docs))
    assert list(theirs.document_indices) == list(range(31))


# ------------------------------------------------------------------------ prepare
def test_prepare_gives_the_tokenizers_ids_with_an_eod_per_document_whatever_the_workers(
        tmp_path):
    tok_path = train_bpe(tmp_path / "tokenizer.json")
    docs = texts()[:40]
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i, t in enumerate(docs):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
    one = prepare([tmp_path / "docs.jsonl"], tok_path, tmp_path / "w1", workers=1)
    two = prepare([tmp_path / "docs.jsonl"], tok_path, tmp_path / "w2", workers=2)
    assert (tmp_path / "w1.bin").read_bytes() == (tmp_path / "w2.bin").read_bytes()
    assert (tmp_path / "w1.idx").read_bytes() == (tmp_path / "w2.idx").read_bytes()
    tok, info = load_tokenizer(tok_path)
    assert one.documents == two.documents == 40 and info.eod_token == "<|endoftext|>"
    theirs = IndexedDataset(str(tmp_path / "w2"))  # megatron-core reads what we wrote
    for i, text in enumerate(docs):
        assert theirs[i].tolist() == tok.encode(text).ids + [info.eod_id]
    assert one.dtype == "uint16" and one.tokens == sum(len(theirs[i]) for i in range(40))


def test_prepare_cuts_text_files_into_documents_file_line_or_paragraph(tmp_path):
    tok_path = train_bpe(tmp_path / "tokenizer.json")
    tok, info = load_tokenizer(tok_path)
    body = "\n\n".join(texts()[:30])
    (tmp_path / "a.txt").write_text(body)
    (tmp_path / "b.txt").write_text("first line\nsecond line\n\nnext paragraph\n")
    prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tok_path, tmp_path / "f")
    got = IndexedDataset(str(tmp_path / "f"))
    assert len(got) == 2 and got[0].tolist() == tok.encode(body).ids + [info.eod_id]
    for per, n in (("line", 3), ("paragraph", 2)):
        prepare([tmp_path / "b.txt"], tok_path, tmp_path / per, document_per=per)
        assert read_index(tmp_path / per).num_documents == n  # empty lines are no documents


@pytest.mark.parametrize("content,needle", [
    ('{"text": "ok"}\nnot json\n', "docs.jsonl:2 is not a JSON object"),
    ('{"body": "ok"}\n', "docs.jsonl:1 has no 'text' field (its keys: body)"),
    ('{"text": 5}\n', "'text' is int, not text"),
    ('{"text": "ok"}\n{"text": "broken \\ud800 x"}\n', "docs.jsonl:2: 'text' holds"),
    ('{"text": "x", "d": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "docs.jsonl:1 is not"),
    ('{"text": "a", "text": "b"}\n', "docs.jsonl:1 is not a JSON object"),  # a key twice
])
def test_prepare_names_the_file_and_line_of_a_bad_record(tmp_path, content, needle):
    tok_path = train_bpe(tmp_path / "tokenizer.json", 300)
    (tmp_path / "docs.jsonl").write_text(content)
    with pytest.raises(SpecError, match=re.escape(needle)):
        prepare([tmp_path / "docs.jsonl"], tok_path, tmp_path / "out")
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".out*"))  # nothing left


def test_data_prepare_cli_prints_one_json_document_and_plain_progress_when_piped(tmp_path):
    tok_path = train_bpe(tmp_path / "tokenizer.json", 300)
    (tmp_path / "a.txt").write_text("\n".join(texts()[:5]))
    r = run_cli("data", "prepare", str(tmp_path / "a.txt"), "--tokenizer-model", tok_path,
                "-o", str(tmp_path / "corpus"), "--workers", "2", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["documents"] == 1 and doc["tokens"] > 1000 and doc["dtype"] == "uint16"
    assert "100%" in r.stderr and "\r" not in r.stderr  # a pipe gets plain lines
    assert r.stderr.count("100%") == 1, r.stderr  # the end is said once
    r = run_cli("data", "prepare", str(tmp_path / "a.txt"), "--tokenizer-model",
                str(tmp_path / "missing.json"), "-o", str(tmp_path / "x"))
    assert r.returncode == 2 and "no such file or directory" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------ blends and splits
@pytest.mark.parametrize("text", ["969,30,1", "99,1", "1", "0.5, 0.25, 0.25", "70/20/10"])
def test_split_is_megatrons(text):
    assert parse_split(text) == pytest.approx(parse_and_normalize_split(text))


def test_split_bounds_are_megatrons_rounding():
    assert split_bounds(200, parse_split("969,30,1")) == [(0, 194), (194, 200), (200, 200)]
    assert split_bounds(1000, parse_split("8,1,1")) == [(0, 800), (800, 900), (900, 1000)]


def test_a_blend_is_megatrons_data_path():
    assert parse_blend("0.7 a 0.3 b.bin") == parse_blend("0.7 a.idx 0.3 b")
    assert parse_blend("a b").weights is None and parse_blend("a b").prefixes == ("a", "b")
    for bad in ("0.7 a 0.3", "-1 a 2 b", "0 a 0 b", ""):
        with pytest.raises(SpecError):
            parse_blend(bad)


def test_a_dataset_path_with_spaces_is_one_prefix_and_a_resume_compares_what_data_names(
        tmp_path, monkeypatch):
    """`--data "my data/corpus"` was split at the space into a blend of two missing datasets;
    a resume compared --split and --data as typed, refusing `969, 30, 1` after the default."""
    from moeplan.data.corpus import data_key

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my data").mkdir()
    write_documents(tmp_path / "my data" / "corpus", random_documents(20, 100, seed=1), np.uint16)
    assert parse_blend("my data/corpus").prefixes == ("my data/corpus",)
    assert parse_blend(str(tmp_path / "my data" / "corpus.bin")).weights is None
    assert data_key("my data/corpus", None) == data_key(
        str(tmp_path / "my data" / "corpus.idx"), "969, 30, 1")
    assert data_key("0.7 a 0.3 b", "99,1") == data_key("7 ./a 3 b.bin", "990,10,0")
    assert data_key("0.7 a 0.3 b", None) != data_key("0.3 a 0.7 b", None)
    assert data_key("a", "9,1,0") != data_key("a", "8,2,0")


def test_feistel_permutes_every_domain():
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        for key in (0, 7, 2**63):
            assert sorted(feistel(np.arange(n), n, np.uint64(key)).tolist()) == list(range(n))
    assert feistel(np.arange(100), 100, np.uint64(1)).tolist() != list(range(100))


@pytest.fixture
def blend(tmp_path):
    write_documents(tmp_path / "a", random_documents(300, 500, seed=2), np.uint16)
    b = [d + 500 for d in random_documents(300, 500, seed=3)]  # ids 500.. tell b apart
    write_documents(tmp_path / "b", b, np.uint16)
    return f"0.7 {tmp_path / 'a'} 0.3 {tmp_path / 'b'}"


def test_a_blend_draws_its_weights_and_each_split_only_its_own_sequences(blend, tmp_path):
    train = Corpus(blend, "8,2,0", "train", 16, seed=5, vocab_size=1000)
    samples = train.samples(np.arange(20_000))
    from_b = samples[:, 0] >= 500
    assert abs(from_b.mean() - 0.3) < 1e-3
    valid = Corpus(blend, "8,2,0", "valid", 16, seed=5, vocab_size=1000)
    idx = read_index(tmp_path / "a")
    tokens = np.memmap(tmp_path / "a.bin", dtype=np.uint16, mode="r")
    cut = idx.token_offset(split_bounds(idx.num_sequences, parse_split("8,2,0"))[0][1])
    windows = {tuple(tokens[i: i + 17]) for i in range(cut, idx.num_tokens - 16, 16)}
    for row in valid.samples(np.arange(200)):
        if row[0] < 500:
            assert tuple(row) in windows  # a validation sample of `a` lies past the train cut


def test_token_batches_are_a_function_of_seed_and_step_under_any_dp_split(blend):
    from moeplan.runtime.data import TokenData

    data = TokenData(blend, 1000, seq_len=16, global_batch=8, seed=3)
    for step in (0, 500):  # step 500 is past the first epoch of either dataset
        whole = data.global_batch(step)
        for dp in (2, 4):
            parts = [torch.cat([tok for tok, _ in data.micro_batches(step, r, dp, 1)])
                     for r in range(dp)]
            assert torch.equal(torch.cat(parts), whole[:, :-1])
        assert torch.equal(TokenData(blend, 1000, 16, 8, seed=3).global_batch(step), whole)
    assert not torch.equal(TokenData(blend, 1000, 16, 8, seed=4).global_batch(0),
                           data.global_batch(0))


# ------------------------------------------------------------------------ hostile input
def _idx_bytes(prefix) -> bytes:
    return (prefix.parent / f"{prefix.name}.idx").read_bytes()


@pytest.mark.parametrize("damage,needle", [
    ("truncate_bin", "the .bin is truncated"),
    ("truncate_idx", "is truncated or not an index"),
    ("magic", "does not start with Megatron's index magic"),
    ("float", "names token dtype code 7 (float32)"),
    ("dtype", "dtype code says int32 tokens (4 bytes), but its sequence pointers step by 2"),
    ("pointer", "sequence 2 starts at byte 41"),
    ("documents", "document boundaries run from"),
    ("vocab", "token id 9 (near token 0) is outside the model's vocabulary of 8"),
])
def test_a_damaged_dataset_is_refused_by_name(tmp_path, damage, needle):
    prefix = tmp_path / "c"
    write_documents(prefix, [np.arange(10) % 40] * 5, np.uint16)
    idx, vocab = bytearray(_idx_bytes(prefix)), 40
    if damage == "truncate_bin":
        (tmp_path / "c.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:-2])
    elif damage == "truncate_idx":
        (tmp_path / "c.idx").write_bytes(idx[:-8])
    elif damage == "magic":
        (tmp_path / "c.idx").write_bytes(b"GARBAGE!!" + idx[9:])
    elif damage == "float":
        idx[17] = 7
        (tmp_path / "c.idx").write_bytes(idx)
    elif damage == "dtype":  # an int32 code on uint16 tokens: not a layout moeplan can't read
        idx[17] = 4
        (tmp_path / "c.idx").write_bytes(idx)
    elif damage == "pointer":  # sequence 2 starts one byte late
        at = 34 + 4 * 5 + 8 * 2
        idx[at: at + 8] = struct.pack("<q", 2 * 20 + 1)
        (tmp_path / "c.idx").write_bytes(idx)
    elif damage == "documents":
        idx[-8:] = struct.pack("<q", 9)
        (tmp_path / "c.idx").write_bytes(idx)
    else:
        vocab = 8
    with pytest.raises(SpecError, match=re.escape(needle)) as e:
        Corpus(str(prefix), None, "train", 8, seed=0, vocab_size=vocab)
    assert str(prefix) in str(e.value)


def test_a_text_file_as_data_says_a_tokenized_dataset_is_needed_and_how_to_make_one(tmp_path):
    (tmp_path / "corpus.txt").write_text("plain text")
    for given in (tmp_path / "corpus.txt", tmp_path / "nothing"):
        with pytest.raises(SpecError) as e:
            Corpus(str(given), None, "train", 8, seed=0, vocab_size=100)
        msg = str(e.value)
        assert "moeplan data prepare" in msg and "--tokenizer-model" in msg
        assert "sidecar" not in msg and "byte" not in msg
    write_documents(tmp_path / "half", [np.arange(40)], np.uint16)
    (tmp_path / "half.idx").unlink()
    with pytest.raises(SpecError, match=r"half.idx is missing"):
        Corpus(str(tmp_path / "half"), None, "train", 8, seed=0, vocab_size=100)


def test_a_link_loop_and_a_saved_hf_dataset_are_named_for_what_they_are(tmp_path):
    """A symbolic link loop read as "no such dataset"; a Hugging Face `save_to_disk`
    directory got the generic message."""
    (tmp_path / "loop.bin").symlink_to(tmp_path / "loop.idx")
    (tmp_path / "loop.idx").symlink_to(tmp_path / "loop.bin")
    with pytest.raises(SpecError, match="loop.bin is a symbolic link that leads to no file"):
        Corpus(str(tmp_path / "loop"), None, "train", 8, seed=0, vocab_size=100)
    saved = tmp_path / "hf_saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    (saved / "data-00000-of-00001.arrow").write_bytes(b"")
    with pytest.raises(SpecError) as e:
        Corpus(str(saved), None, "train", 8, seed=0, vocab_size=100)
    assert "Hugging Face datasets directory" in str(e.value) and "to_json" in str(e.value)


def test_a_split_too_small_for_one_sequence_is_refused_naming_the_split(tmp_path):
    write_documents(tmp_path / "c", [np.arange(20)] * 50, np.uint16)
    with pytest.raises(SpecError, match="valid split of .* holds fewer than seq_len"):
        Corpus(str(tmp_path / "c"), "9,1,0", "valid", 128, seed=0, vocab_size=100)


# ------------------------------------------------------------------------ no torch
def test_the_data_package_never_imports_torch():
    code = ("import sys\nimport moeplan.data.corpus, moeplan.data.prepare, "
            "moeplan.data.tokenizer\nprint(any(m == 'torch' or m.startswith('torch.') "
            "for m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_a_line_past_the_document_bound_is_refused_having_read_only_the_bound(tmp_path,
                                                                               monkeypatch):
    """A line is read to at most the bound plus one byte, so a file with no newline in its
    gigabytes is refused without holding them."""
    import moeplan.data.prepare as P

    monkeypatch.setattr(P, "MAX_DOCUMENT_BYTES", 64)
    tok_path = train_bpe(tmp_path / "tokenizer.json", 300)
    (tmp_path / "docs.jsonl").write_text('{"text": "ok"}\n{"text": "' + "x" * 10_000 + '"}\n')
    reads: list[int] = []
    real = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            return self.f.read(n)

        def readline(self, limit=-1):
            line = self.f.readline(limit)
            reads.append(len(line))
            return line

    monkeypatch.setattr(P, "open", lambda path, mode: Counting(real(path, mode)), raising=False)
    with pytest.raises(SpecError, match="docs.jsonl:2: a line of more than 64 bytes"):
        prepare([tmp_path / "docs.jsonl"], tok_path, tmp_path / "out")
    assert max(reads) == 65


@pytest.mark.parametrize("name, head, needle", [
    ("docs.jsonl", b"\x1f\x8b\x08\x00", "is a .gz file, not text: decompress it"),
    ("data.parquet", b"plain ascii", "is a .parquet file, not text: export its text column"),
])
def test_prepare_refuses_compressed_or_columnar_inputs_saying_what_to_do(name, head, needle,
                                                                         tmp_path):
    """A gzip stream was refused as "not UTF-8 (iconv it)", and a .parquet file whose bytes
    happened to be ASCII was tokenized as one text document."""
    tok_path = train_bpe(tmp_path / "tokenizer.json", 300)
    (tmp_path / name).write_bytes(head)
    with pytest.raises(SpecError, match=re.escape(needle)):
        prepare([tmp_path / name], tok_path, tmp_path / "out")


def test_an_eod_token_with_no_eod_appended_is_refused(tmp_path, capsys):
    from moeplan.cli import main

    tok_path = train_bpe(tmp_path / "tokenizer.json", 300)
    (tmp_path / "a.txt").write_text("hello")
    assert main(["data", "prepare", str(tmp_path / "a.txt"), "--tokenizer-model", str(tok_path),
                 "-o", str(tmp_path / "out"), "--no-append-eod", "--eod-token", "x"]) == 2
    assert "give one or the other" in capsys.readouterr().err


def test_a_split_of_a_one_document_dataset_says_to_prepare_more_documents(tmp_path):
    """A book prepared as one document has an empty validation split at any --split, and the
    advice to give the split "a larger share" could not help."""
    write_documents(tmp_path / "book", [np.arange(5000) % 400], np.uint16)
    with pytest.raises(SpecError, match="holds 1: prepare its text with `moeplan data "
                                        "prepare --document-per paragraph`"):
        Corpus(str(tmp_path / "book"), "90,10,0", "valid", 32, 0, 512)
