"""Rotary settings: Llama 3.x rope scaling in the config (validation, --set, TOML) and its effect."""

from __future__ import annotations

import math

import pytest
import tomllib
import torch

from ftlm.config import build_config
from ftlm.errors import ConfigError
from ftlm.model import ModelConfig, Transformer
from ftlm.model.llama import rope_inv_freq

SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}


def test_named_sizes_keep_or_get_their_rope_settings():
    for size in ("tiny", "small", "125m"):
        cfg = ModelConfig(size=size)
        assert (cfg.rope_theta, cfg.rope_scaling) == (10000.0, {})
    for size, factor in (("1b", 32.0), ("8b", 8.0)):
        cfg = ModelConfig(size=size)
        assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == factor
    assert ModelConfig(size="1b", rope_scaling={}).rope_scaling == {}


def test_scaling_keeps_high_divides_low_and_blends_middle_frequencies():
    cfg = ModelConfig(size="tiny", dim=64, n_heads=2, rope_scaling=SCALING)
    plain = rope_inv_freq(ModelConfig(size="tiny", dim=64, n_heads=2))
    scaled = rope_inv_freq(cfg)
    wavelength = 2 * math.pi / plain
    high = wavelength < 32 / 4
    low = wavelength > 32 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(scaled[high], plain[high], rtol=0, atol=0)
    torch.testing.assert_close(scaled[low], plain[low] / 8, rtol=1e-12, atol=0)
    middle = ~high & ~low
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()
    tokens = torch.randint(0, 100, (1, 40))
    shape = dict(size="tiny", dim=64, n_heads=2, n_layers=1, vocab_size=100, max_seq_len=40)
    a, b = Transformer(ModelConfig(**shape)), Transformer(ModelConfig(**shape, rope_scaling=SCALING))
    assert not torch.allclose(a(tokens), b(tokens))


def test_rope_scaling_from_toml_and_set_round_trips():
    config = build_config({}, ["model.rope_scaling=factor=8,low_freq_factor=1,high_freq_factor=4,"
                               "original_max_position_embeddings=32"])
    assert config.model.rope_scaling == SCALING
    assert build_config(tomllib.loads(config.to_toml())).model == config.model
    assert build_config({}, ["model.size=8b", "model.rope_scaling="]).model.rope_scaling == {}


@pytest.mark.parametrize("value,message", [
    ({"factor": 8.0}, "missing keys"),
    ({**SCALING, "kind": 1}, "unknown keys"),
    ({**SCALING, "factor": float("nan")}, "factor=nan"),
    ({**SCALING, "factor": 0.5}, "must be >= 1"),
    ({**SCALING, "high_freq_factor": 1.0}, "must exceed low_freq_factor"),
    ({**SCALING, "original_max_position_embeddings": 32.5}, "whole number"),
    ("fast", "must be a table"),
])
def test_bad_rope_scaling_is_refused_by_name(value, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(size="tiny", rope_scaling=value)
