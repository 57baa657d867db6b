"""What `moeplan run` trains with besides the plan's layout: the schedule under Megatron's names,
the data, evaluation and logging, from flags or one config file. No torch: the launcher checks
all of it before any worker starts.

Training settings (`--lr`, `--min-lr`, `--lr-warmup-iters`, `--lr-decay-style`,
`--lr-decay-iters`, `--lr-wsd-decay-style`, `--lr-wsd-decay-iters`, `--weight-decay`,
`--clip-grad`, `--train-iters` or `--train-tokens`) are written into the plan's `training`
section (`apply_settings`), so OUT/plan.json, every checkpoint's plan.json and `moeplan
export --format megatron` of that plan carry them. `--config FILE` (YAML or JSON) holds the same
settings and the run's data, evaluation and logging options, under the flags' names (`lr`,
`lr-warmup-iters` or `lr_warmup_iters`, `data`, `eval-interval`, ...); a flag given on the
command line wins over the file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .. import limits
from ..errors import SpecError
from ..specs import Plan, TrainingSpec
from ..specs.validated import build
from .options import RunOptions

DEFAULT_STEPS = 10  # without --steps and without a train_iters in the plan
TRAINING_KEYS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters",
                 "lr_wsd_decay_style", "lr_wsd_decay_iters", "weight_decay", "clip_grad",
                 "train_iters", "train_tokens")
INT_OPTIONS = ("steps", "seed", "eval_interval", "eval_iters", "log_interval")
TEXT_OPTIONS = ("data", "split", "valid_data", "tokenizer_model", "tensorboard_dir")
OPTION_KEYS = INT_OPTIONS + TEXT_OPTIONS


def read_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(training settings, run options) of a `--config` file; an unknown key exits 2 naming it."""
    from ..specs.loader import read_document

    p = Path(path)
    if not p.is_file():
        raise SpecError(f"--config {limits.clip(str(path))}: no such file. Give a YAML or JSON "
                        "file of run settings (docs/RUNTIME.md, \"Training settings\").")
    doc = read_document(p) or {}
    if not isinstance(doc, dict):
        raise SpecError(f"--config {p}: expected a mapping of settings (lr: 3e-4, ...), got "
                        f"{type(doc).__name__}.")
    training, options = {}, {}
    for key, value in doc.items():
        name = str(key).removeprefix("--").replace("-", "_")
        if name in TRAINING_KEYS:
            training[name] = value
        elif name in OPTION_KEYS:
            ok = (isinstance(value, int) and not isinstance(value, bool) if name in INT_OPTIONS
                  else isinstance(value, (str, int, float)) and not isinstance(value, bool))
            if not ok:
                raise SpecError(f"--config {p}: `{key}` must be "
                                f"{'a whole number' if name in INT_OPTIONS else 'text'}, got "
                                f"{limits.excerpt(value)}.")
            options[name] = value if name in INT_OPTIONS else str(value)
        else:
            raise SpecError(f"--config {p}: unknown setting {limits.excerpt(key)}; the file takes "
                            f"{', '.join(k.replace('_', '-') for k in TRAINING_KEYS + OPTION_KEYS)}.")
    return training, options


def apply_settings(plan: Plan, opts: RunOptions) -> Plan:
    """The plan with `opts.training` written into its training section (validated; the
    message names the setting), and `opts.steps` resolved: --steps, else the plan's
    train_iters, else DEFAULT_STEPS."""
    settings = dict(opts.training or {})
    tokens = settings.pop("train_tokens", None)
    if tokens is not None:
        if settings.get("train_iters") is not None:
            raise SpecError("give either --train-iters or --train-tokens, not both.")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) \
                or not math.isfinite(tokens) or tokens <= 0:
            raise SpecError(f"--train-tokens takes a positive number of tokens (e.g. 1e12), got "
                            f"{limits.excerpt(tokens)}.")
        settings["train_iters"] = math.ceil(tokens / plan.training.tokens_per_step)
    unknown = set(settings) - set(TRAINING_KEYS)
    if unknown:
        raise SpecError(f"unknown training settings {sorted(unknown)}.")
    if settings:
        training = build(TrainingSpec, {**plan.training.model_dump(), **settings},
                         "training setting", "the flags or --config of moeplan run")
        plan = plan.model_copy(update={"training": training})
    if opts.steps is None:
        opts.steps = plan.training.train_iters or DEFAULT_STEPS
    asked = opts.eval_iters is not None or opts.valid_data is not None
    if asked and opts.eval_interval is None:  # Megatron evaluates at the end of training
        opts.eval_interval = min(opts.steps, limits.MAX_TRAIN_ITERS)
    if opts.valid_data is not None and opts.split is None:
        opts.split = WHOLE_SPLIT["train"]  # as Megatron's separate paths: each read whole
    return plan


WHOLE_SPLIT = {"train": "100,0,0", "valid": "0,100,0"}  # a dataset read whole as one split


def validation_source(data: str, split: str | None, valid_data: str | None
                      ) -> tuple[str, str | None]:
    """(blend, split) evaluation reads: --valid-data whole when given, as Megatron reads
    --valid-data-path; else the valid split of --data."""
    return (valid_data, WHOLE_SPLIT["valid"]) if valid_data else (data, split)


def keeps_vocabulary(opts: RunOptions) -> bool:
    """--scale-down keeps the model's vocabulary when real token ids will index it."""
    return opts.data != "synthetic" or opts.tokenizer_model is not None


def check_run_inputs(running: Plan, opts: RunOptions) -> list[str]:
    """Refuse (exit 2, before any worker starts) bad data, split, tokenizer, evaluation and
    logging options; return one line per dataset split the run reads."""
    from ..data.corpus import Corpus

    for flag, value in (("--eval-interval", opts.eval_interval), ("--eval-iters", opts.eval_iters),
                        ("--log-interval", opts.log_interval)):
        if value is not None and not 1 <= value <= limits.MAX_TRAIN_ITERS:
            raise SpecError(f"{flag} must be between 1 and {limits.MAX_TRAIN_ITERS:,}, got "
                            f"{value}.")
    t, lines = running.training, []
    if opts.tokenizer_model is not None:
        from ..data.tokenizer import check_vocabulary, load_tokenizer

        _, info = load_tokenizer(opts.tokenizer_model)
        check_vocabulary(info, running.model.vocab_size, running.model.name)
    if opts.valid_data is not None and opts.data == "synthetic":
        raise SpecError("--valid-data names the datasets evaluation reads beside the --data "
                        "a run trains on; the synthetic stream has a validation stream of its "
                        "own. Pass --data, or drop --valid-data.")
    if opts.data == "synthetic":
        if opts.split is not None:
            raise SpecError("--split cuts the datasets given with --data; the synthetic stream "
                            "has a validation stream of its own. Drop --split or pass --data.")
    else:
        train = Corpus(opts.data, opts.split, "train", t.seq_len, opts.seed,
                       running.model.vocab_size)
        lines.append(train.describe())
        if opts.eval_interval:
            blend, split = validation_source(opts.data, opts.split, opts.valid_data)
            lines.append(Corpus(blend, split, "valid", t.seq_len, opts.seed,
                                running.model.vocab_size,
                                scan=opts.valid_data is not None).describe())
    if opts.tensorboard_dir is not None:
        from ..fsio import check_writable_dir
        from .tblog import require_writer

        require_writer()
        check_writable_dir(opts.tensorboard_dir, "--tensorboard-dir")
    return lines
