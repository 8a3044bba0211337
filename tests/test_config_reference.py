"""docs/config.md is the output of ``python -m ftlm.config_reference``, and that output covers every
field of ``RunConfig`` with its docstring, default and accepted values."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

from ftlm.config import RunConfig
from ftlm.config_reference import accepted, attribute_docstrings, reference
from ftlm.train.config import CheckpointConfig, TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def test_docs_config_md_equals_the_generator_output():
    on_disk = (ROOT / "docs" / "config.md").read_text()
    assert on_disk == reference(), (
        "docs/config.md is out of date: regenerate it with "
        "`python -m ftlm.config_reference > docs/config.md`")


def test_the_module_prints_the_reference():
    out = subprocess.run([sys.executable, "-m", "ftlm.config_reference"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out == reference()


def test_every_section_and_field_has_a_row_with_its_docstring():
    text = reference()
    hints = typing.get_type_hints(RunConfig)
    for section in dataclasses.fields(RunConfig):
        cls = hints[section.name]
        assert f"## [{section.name}]" in text
        docs = attribute_docstrings(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no attribute docstring"
            row = next(line for line in text.splitlines() if line.startswith(f"| `{f.name}` |")
                       and docs[f.name].replace("|", "\\|") in line)
            assert row.count(" | ") == 4, row


def test_accepted_values_are_the_sections_own_words():
    hints = typing.get_type_hints(TrainConfig)
    assert accepted("train", TrainConfig, "steps", hints["steps"]) == "an integer > 0"
    assert accepted("train", TrainConfig, "schedule", hints["schedule"]) == "cosine, wsd, constant"
    assert accepted("train", TrainConfig, "min_lr_ratio", hints["min_lr_ratio"]) == \
        "a finite number in [0, 1]"
    assert accepted("train", TrainConfig, "init_from", hints["init_from"]) == "any"
    assert accepted("train", TrainConfig, "compile", hints["compile"]) == "true, false"
    # 0 is refused with the tighter bound, not the >= 0 every count check says first.
    keep = typing.get_type_hints(CheckpointConfig)["keep"]
    assert accepted("checkpoint", CheckpointConfig, "keep", keep) == "at least 1"
