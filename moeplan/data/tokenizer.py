"""Hugging Face tokenizers: `--tokenizer-model PATH` (a tokenizer.json, or a directory holding
one, as Megatron's `--tokenizer-type HuggingFaceTokenizer --tokenizer-model`).

Read with the `tokenizers` library itself (the Rust tokenizer transformers' fast tokenizers
wrap), so `moeplan data prepare` gives the ids `AutoTokenizer` gives. No torch here.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import limits
from ..errors import SpecError
from ..fsio import FileRefused, atomic_write_bytes, loads_json, read_regular

MAX_TOKENIZER_BYTES = 256 << 20  # the largest public tokenizer.json files are ~30 MB
# files of a Hugging Face tokenizer directory that go with it into an export
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja")
# end-of-document tokens of common tokenizers, tried in order when none is named
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>",
                  "[SEP]", "<|eot_id|>")


def require_tokenizers() -> Any:
    """The `tokenizers` module, or exit 2 saying what to install."""
    try:
        import tokenizers
    except ImportError:
        raise SpecError("Hugging Face tokenizers need the `tokenizers` package, which is not "
                        "installed: pip install 'moeplan[data]' (or 'moeplan[run]').") from None
    return tokenizers


@dataclass(frozen=True)
class TokenizerInfo:
    """What a run and an export need to know of a tokenizer."""

    file: Path  # the tokenizer.json
    directory: Path | None  # the directory it came with (its config files), if one was given
    vocab_size: int  # ids 0 .. vocab_size − 1, added tokens included
    eod_token: str | None
    eod_id: int | None


def tokenizer_file(path: str | Path, flag: str = "--tokenizer-model") -> tuple[Path, Path | None]:
    """(tokenizer.json, its directory or None) of a file or directory argument."""
    p = Path(path)
    if p.is_dir():
        f = p / "tokenizer.json"
        if not f.exists():
            has = sorted(x.name for x in p.iterdir() if x.name in TOKENIZER_FILES)[:4]
            raise SpecError(f"{flag} {limits.clip(str(path))}: the directory holds no "
                            "tokenizer.json" + (f" (it has {', '.join(has)}: a slow "
                                                "tokenizer; save it with a fast tokenizer's "
                                                "save_pretrained)" if has else "")
                            + ". Give a Hugging Face tokenizer.json or a directory with one.")
        return f, p
    if p.exists():  # what kind of file it is, the one reader checks (`load_tokenizer`)
        return p, None
    raise SpecError(f"{flag} {limits.clip(str(path))}: no such file or directory. Give a "
                    "Hugging Face tokenizer.json or a model directory holding one.")


def load_tokenizer(path: str | Path, flag: str = "--tokenizer-model",
                   eod_token: str | None = None) -> tuple[Any, TokenizerInfo]:
    """(tokenizers.Tokenizer, TokenizerInfo), size-bounded, with its end-of-document token:
    `eod_token` when given, else tokenizer_config.json's eos_token, else a common name."""
    tokenizers = require_tokenizers()
    file, directory = tokenizer_file(path, flag)
    try:  # the one bounded reader: a regular file, at most the limit (a pipe never blocks)
        text = read_regular(file, MAX_TOKENIZER_BYTES).decode("utf-8")
    except FileRefused as err:
        raise SpecError(f"{flag} {file}: {err.reason}; give a tokenizer.json (at most "
                        f"{MAX_TOKENIZER_BYTES:,} bytes) or a directory holding one.") from None
    except UnicodeDecodeError:
        raise SpecError(f"{flag} {file}: not UTF-8 text, so not a tokenizer.json.") from None
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as err:  # the Rust side raises a plain Exception on malformed files
        raise SpecError(f"{flag} {file}: not a Hugging Face tokenizer.json "
                        f"({limits.clip(str(err), 120)}).") from None
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    name = eod_token or _config_eos(directory) or next(
        (c for c in EOD_CANDIDATES if tok.token_to_id(c) is not None), None)
    eod_id = tok.token_to_id(name) if name is not None else None
    if eod_token is not None and eod_id is None:
        raise SpecError(f"--eod-token {limits.excerpt(eod_token)} is not a token of {file}.")
    return tok, TokenizerInfo(file, directory, vocab, name if eod_id is not None else None,
                              eod_id)


def _config_eos(directory: Path | None) -> str | None:
    """tokenizer_config.json's eos_token (a string or {"content": ...}), if there is one."""
    cfg = directory / "tokenizer_config.json" if directory else None
    if cfg is None or not cfg.exists():
        return None
    try:
        doc = loads_json(read_regular(cfg, limits.MAX_FILE_BYTES))
    except (FileRefused, ValueError) as err:
        # its eos_token decides the end-of-document id: a file that cannot be read is said,
        # not passed over for a guess
        raise SpecError(f"{cfg} cannot be read ({limits.clip(str(err), 160)}); repair it, or "
                        "name the end-of-document token with --eod-token.") from None
    eos = doc.get("eos_token") if isinstance(doc, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def check_vocabulary(info: TokenizerInfo, model_vocab: int, model_name: str) -> None:
    """A model must hold every id its tokenizer can produce (a padded vocabulary is larger)."""
    if info.vocab_size > model_vocab:
        raise SpecError(f"--tokenizer-model {info.file}: the tokenizer has {info.vocab_size:,} "
                        f"tokens but {model_name}'s vocabulary is {model_vocab:,}, so some ids "
                        "would index past the embedding. Use the model's own tokenizer, or a "
                        "model spec whose vocab_size is at least the tokenizer's. Nothing was "
                        "run.")


def export_tokenizer(info: TokenizerInfo, dest: str | Path) -> list[str]:
    """Copy the tokenizer into `dest` (an existing directory) as `save_pretrained` lays it out:
    tokenizer.json and, from its directory, the other tokenizer files; with no
    tokenizer_config.json to copy, one naming transformers' generic fast tokenizer and the
    end-of-document token as eos, so `AutoTokenizer.from_pretrained(dest)` loads it. Returns
    the file names written."""
    dest = Path(dest)
    written = []
    for name in TOKENIZER_FILES:
        src = info.file if name == "tokenizer.json" else (
            info.directory / name if info.directory else None)
        if src is not None and src.is_file():
            shutil.copyfile(src, dest / name)
            written.append(name)
    if "tokenizer_config.json" not in written:
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if info.eod_token is not None:
            config["eos_token"] = info.eod_token
        atomic_write_bytes(dest / "tokenizer_config.json",
                           json.dumps(config, indent=1).encode())
        written.append("tokenizer_config.json")
    return written
