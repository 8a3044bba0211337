"""Building and running a post-training group: the objective and data of a command, the Trainer.

``build(kind, config)`` turns the ``[post]`` section into an ``Objective`` and a ``TrainData``;
``run(kind, config)`` trains one replica group with them, alone or, under ``FTLM_COORDINATOR``
(``ftlm launch local`` starts groups that way), as a fault-tolerant group of the job, exactly as
``ftlm train`` does for pretraining.

Not responsible for: the objectives (``ftlm.post.objectives``), data formats (``ftlm.post.data``),
argument parsing or launching a job of several groups (``ftlm.post_cli``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ftlm.data.split import split_heldout
from ftlm.data.tokenizer import Tokenizer
from ftlm.errors import ConfigError, DataError
from ftlm.model import Transformer
from ftlm.post.data import (
    Rows,
    pair_rows,
    read_records,
    sft_rows,
    suite_tasks,
    task_records,
    training_tasks,
)
from ftlm.post.forward import check_packing_config
from ftlm.post.objectives import DPO, GRPO, SFT, reference_table, with_row_index
from ftlm.post.rewards import reward_function
from ftlm.train.objective import Objective, TrainData

if TYPE_CHECKING:  # the composition root; post-training never imports it (nor, through it, launch)
    from ftlm.config import RunConfig

KINDS = ("sft", "dpo", "grpo")


def load_tokenizer(config: RunConfig) -> Tokenizer:
    """The run's tokenizer (data.tokenizer, else data.dir/tokenizer.json), checked against the model."""
    path = Path(config.data.tokenizer) if config.data.tokenizer else Path(config.data.dir) / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer {path} not found; set data.tokenizer to the tokenizer.json the "
                        "model was pretrained with (or data.dir to its prepared data folder)")
    tokenizer = Tokenizer.load(path)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size={config.model.vocab_size} is smaller than the "
                          f"tokenizer's vocabulary ({tokenizer.vocab_size}); raise model.vocab_size")
    if config.data.seq_len > config.model.max_seq_len:
        raise ConfigError(f"data.seq_len={config.data.seq_len} exceeds "
                          f"model.max_seq_len={config.model.max_seq_len}")
    return tokenizer


def load_reference(config: RunConfig, device: torch.device) -> Transformer:
    """The frozen reference model: post.reference, else train.init_from (the starting model)."""
    from ftlm.train.trainer import load_weights
    name = "post.reference" if config.post.reference else "train.init_from"
    path = Path(config.post.reference or config.train.init_from)
    if not str(path) or str(path) == ".":
        raise ConfigError("DPO and GRPO need a reference model: set train.init_from (or "
                          "post.reference) to a model.safetensors of an earlier run")
    model = Transformer(config.model).to(device)
    load_weights(model, path, name)
    return model.eval().requires_grad_(False)


def _split(rows: np.ndarray, config: RunConfig, where: str) -> tuple[Rows, Rows]:
    """(train, held-out) rows: data.eval_samples rows held out, as pretraining does."""
    count = config.data.eval_samples
    if count >= len(rows):
        raise DataError(f"data.eval_samples={count} leaves no training rows: {where} makes "
                        f"{len(rows)}; lower data.eval_samples or set post.heldout to a file")
    split = split_heldout(Rows(rows), count, config.data.eval_seed)
    idx = np.arange(len(split.train))
    return Rows(split.train.samples(idx)), Rows(split.heldout.samples(np.arange(count)))


def _rows_of(kind: str, path: str, tokenizer: Tokenizer, seq_len: int) -> np.ndarray:
    records = read_records(Path(path), "preference" if kind == "dpo" else "instruction")
    make = pair_rows if kind == "dpo" else sft_rows
    return make(records, tokenizer, seq_len, path)


def build_sft(config: RunConfig, tokenizer: Tokenizer) -> tuple[Objective, TrainData]:
    check_packing_config(config.train)
    post, seq_len = config.post, config.data.seq_len
    if post.data:
        rows = _rows_of("sft", post.data, tokenizer, seq_len)
        if post.heldout:
            train, heldout = Rows(rows), Rows(_rows_of("sft", post.heldout, tokenizer, seq_len))
        else:
            train, heldout = _split(rows, config, post.data)
    else:  # the task suite: its training split, and its held-out split for the eval loss
        train = Rows(sft_rows(task_records(suite_tasks(post, "train")), tokenizer, seq_len,
                              "task suite"))
        held = suite_tasks(post, "test")
        heldout = Rows(sft_rows(task_records(held), tokenizer, seq_len, "task suite")
                       if held else np.zeros((0, 3, seq_len + 1), dtype=np.int64))
    return SFT(seq_len), TrainData(tokenizer, train, heldout)


def build_dpo(config: RunConfig, tokenizer: Tokenizer,
              device: torch.device) -> tuple[Objective, TrainData]:
    post, seq_len = config.post, config.data.seq_len
    if not post.data:
        raise ConfigError("post.data is empty: DPO trains on preference pairs; build them from "
                          "the task suite with `ftlm pairs CONFIG --out pairs.jsonl` and set "
                          "post.data=pairs.jsonl (or point it at your own pairs file)")
    rows = _rows_of("dpo", post.data, tokenizer, seq_len)
    if post.heldout:
        train, heldout = Rows(rows), Rows(_rows_of("dpo", post.heldout, tokenizer, seq_len))
    else:
        train, heldout = _split(rows, config, post.data)
    reference = load_reference(config, device)
    if not post.dpo_precompute:
        objective = DPO(reference, seq_len, beta=post.beta, loss_type=post.dpo_loss,
                        nll_coef=post.dpo_nll)
        return objective, TrainData(tokenizer, train, heldout)
    # Every row gets its index into one table of the reference's log-probs (training rows, then
    # held-out ones); the reference model is dropped once the table is made.
    train_rows = train.samples(np.arange(len(train)))
    held_rows = heldout.samples(np.arange(len(heldout)))
    table = reference_table(reference, torch.from_numpy(np.concatenate((train_rows, held_rows))),
                            post.dpo_loss)
    del reference
    objective = DPO(None, seq_len, beta=post.beta, loss_type=post.dpo_loss,
                    nll_coef=post.dpo_nll, reference_logps=table)
    return objective, TrainData(tokenizer, Rows(with_row_index(train_rows)),
                                Rows(with_row_index(held_rows, len(train_rows))))


def build_grpo(config: RunConfig, tokenizer: Tokenizer,
               device: torch.device) -> tuple[Objective, TrainData]:
    post = config.post
    train, heldout = training_tasks(post)
    tasks = train + heldout  # rows index this list: training tasks first, then held-out ones
    reward = reward_function(post.reward, post.verify, probe=train[0])
    # Without a KL term the reference is never read: not loaded (TRL's beta = 0).
    reference = load_reference(config, device) if post.kl_coef else None
    objective = GRPO(tasks, tokenizer, reference, seq_len=config.data.seq_len,
                     seed=config.run.seed, group_size=post.group_size, clip=post.clip,
                     kl_coef=post.kl_coef, max_new_tokens=post.max_new_tokens,
                     temperature=post.temperature, top_k=post.top_k, nll_coef=post.grpo_nll,
                     reward=reward, loss_type=post.grpo_loss, ppo_epochs=post.ppo_epochs,
                     filter_zero_variance=post.filter_zero_variance,
                     mask_truncated=post.mask_truncated)
    index = np.arange(len(tasks), dtype=np.int64)[:, None]
    return objective, TrainData(tokenizer, Rows(index[:len(train)]), Rows(index[len(train):]))


def build(kind: str, config: RunConfig) -> tuple[Objective, TrainData]:
    """The objective and data of ``kind`` (sft, dpo, grpo) as ``config`` asks."""
    from ftlm.train.trainer import resolve_device
    if kind not in KINDS:
        raise ConfigError(f"post-training kind {kind!r}; valid: {', '.join(KINDS)}")
    tokenizer = load_tokenizer(config)
    if kind == "sft":
        return build_sft(config, tokenizer)
    device = resolve_device(config.train.device)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    return (build_dpo if kind == "dpo" else build_grpo)(config, tokenizer, device)


def _trainer(kind: str, config: RunConfig, **kwargs):
    from ftlm.train.trainer import Trainer
    objective, data = build(kind, config)
    trainer = Trainer.for_run(config, objective=objective, data=data, **kwargs)
    if isinstance(objective, GRPO):
        # Samples are seeded by the step the update is for: a retry draws the same ones.
        objective.clock = lambda: trainer.state.step
    return trainer


def run(kind: str, config: RunConfig) -> dict:
    """Train one group: alone, or as a group of a fault-tolerant job under FTLM_COORDINATOR.

    The same shape as ``ftlm train`` (``ftlm.cli.cmd_train``): alone it returns the run summary
    (and writes the report); in a job it prints the ``FTLM_RESULT`` line the supervisor reads.
    """
    coordinator = config.ft.coordinator or os.environ.get("FTLM_COORDINATOR", "")
    if not coordinator:
        summary = _trainer(kind, config).train()
        if int(os.environ.get("RANK", "0")) == 0:
            from ftlm.observe.events import read_events
            from ftlm.observe.report import write_report
            write_report(config.run.path, summary, read_events(config.run.path / "events.jsonl"))
        return summary
    from ftlm.train.job import run_group
    return run_group(config, coordinator, lambda **kw: _trainer(kind, config, **kw))
