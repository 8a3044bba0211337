"""Run configuration: TOML + ``--set`` overrides, coercion, refusal of unknown or bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftlm.config import RunConfig, build_config, load_config, save_config
from ftlm.data.config import DataConfig
from ftlm.errors import ConfigError
from ftlm.ft.config import FTConfig
from ftlm.model.config import ModelConfig
from ftlm.train.config import CheckpointConfig, TrainConfig

TOML = """
[run]
name = "exp1"
seed = 3

[model]
size = "tiny"
dim = 96
n_heads = 6
n_kv_heads = 2

[train]
steps = 50
lr = 1e-3
schedule = "wsd"
compile = false

[checkpoint]
every = 10
"""


@pytest.fixture
def toml_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    return path


def test_toml_values_land_in_their_sections_and_unset_fields_keep_defaults(toml_file) -> None:
    cfg = load_config(toml_file)
    assert (cfg.run.name, cfg.run.seed) == ("exp1", 3)
    assert cfg.run.path == Path("runs/exp1")
    assert (cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads) == (96, 6, 2)
    assert cfg.model.n_layers == 4  # filled from the "tiny" row
    assert (cfg.train.steps, cfg.train.lr, cfg.train.schedule) == (50, 1e-3, "wsd")
    assert cfg.train.batch_size == TrainConfig().batch_size
    assert cfg.checkpoint.every == 10
    assert cfg.data == DataConfig() and cfg.ft == FTConfig()


def test_set_overrides_of_every_type(toml_file: Path) -> None:
    cfg = load_config(toml_file, [
        "train.steps=7",                  # int
        "train.lr=0.02",                  # float
        "train.grad_clip=2",              # float given as an integer literal
        "train.compile=true",             # bool
        "checkpoint.async_save=no",       # bool, other spelling
        "train.schedule = cosine",        # str, spaces around '='
        "run.dir=/tmp/r1",                # str with '/'
        "model.tie_embeddings=false",     # optional bool
        "model.vocab_size=2048",          # optional int
        "model.ffn_dim=none",             # optional set back to None: filled from the size row
        "data.tokenizer=",                # empty string
    ])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == 0.02
    assert cfg.train.grad_clip == 2.0 and isinstance(cfg.train.grad_clip, float)
    assert cfg.train.compile is True
    assert cfg.checkpoint.async_save is False
    assert cfg.train.schedule == "cosine"
    assert cfg.run.dir == "/tmp/r1" and cfg.run.path == Path("/tmp/r1")
    assert cfg.model.tie_embeddings is False
    assert cfg.model.vocab_size == 2048
    assert cfg.model.ffn_dim == 384
    assert cfg.data.tokenizer == ""


def test_later_override_wins_and_overrides_beat_the_file(toml_file: Path) -> None:
    cfg = load_config(toml_file, ["train.steps=5", "train.steps=6"])
    assert cfg.train.steps == 6


def test_no_file_gives_defaults_plus_overrides() -> None:
    cfg = load_config(None, ["train.steps=3"])
    assert cfg.train.steps == 3
    assert cfg.model == ModelConfig()


@pytest.mark.parametrize("raw, overrides, needles", [
    ({"trian": {"steps": 1}}, [], ["[trian]", "train"]),
    ({}, ["trian.steps=1"], ["trian", "train"]),
    ({"train": {"stpes": 1}}, [], ["train.stpes", "steps"]),
    ({}, ["train.stpes=1"], ["train.stpes", "steps"]),
    ({}, ["train.steps"], ["train.steps", "section.key=value"]),
    ({}, ["steps=1"], ["steps=1", "section.key=value"]),
    ({"train": 3}, [], ["[train]", "table"]),
])
def test_unknown_sections_and_keys_are_refused(raw, overrides, needles) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(raw, overrides)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize("raw, overrides, needles", [
    ({}, ["train.steps=abc"], ["train.steps='abc'", "int"]),
    ({}, ["train.steps=2.5"], ["train.steps='2.5'", "int"]),
    ({}, ["train.lr=fast"], ["train.lr='fast'", "float"]),
    ({}, ["train.compile=maybe"], ["train.compile='maybe'", "bool"]),
    ({}, ["train.steps=none"], ["train.steps='none'", "int"]),
    ({"train": {"steps": "10"}}, [], ["train.steps='10'", "int"]),     # TOML string, not a number
    ({"train": {"steps": 10.0}}, [], ["train.steps=10.0", "int"]),
    ({"train": {"steps": True}}, [], ["train.steps=True", "int"]),
    ({"observe": {"progress": 1}}, [], ["observe.progress=1", "bool"]),
    ({"train": {"schedule": 3}}, [], ["train.schedule=3", "str"]),
])
def test_values_of_the_wrong_type_are_refused(raw, overrides, needles) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(raw, overrides)
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize("override, needles", [
    # [train]
    ("train.steps=0", ["train.steps=0", "> 0"]),
    ("train.batch_size=-4", ["train.batch_size=-4"]),
    ("train.lr=0", ["train.lr=0.0", "> 0"]),
    ("train.warmup_steps=-1", ["train.warmup_steps=-1", ">= 0"]),
    ("train.grad_accum=3", ["train.batch_size=8", "train.grad_accum=3", "divisible"]),
    ("train.schedule=linear", ["train.schedule='linear'", "cosine"]),
    ("train.decay_fraction=0", ["train.decay_fraction=0.0", "(0, 1]"]),
    ("train.min_lr_ratio=1.5", ["train.min_lr_ratio=1.5", "[0, 1]"]),
    ("train.beta2=1.0", ["train.beta2=1.0", "[0, 1)"]),
    ("train.device=tpu", ["train.device='tpu'", "cuda"]),
    ("train.dtype=float16", ["train.dtype='float16'", "bfloat16"]),
    ("train.max_seconds=-1", ["train.max_seconds=-1.0"]),
    # [checkpoint]
    ("checkpoint.every=-1", ["checkpoint.every=-1", ">= 0"]),
    ("checkpoint.keep=0", ["checkpoint.keep=0", "at least 1"]),
    # [data]
    ("data.seq_len=1", ["data.seq_len=1", ">= 2"]),
    ("data.prefetch=-1", ["data.prefetch=-1", ">= 0"]),
    # [model]
    ("model.size=huge", ["model.size='huge'", "tiny"]),
    ("model.dim=0", ["model.dim=0", "positive"]),
    ("model.norm_eps=-1e-5", ["model.norm_eps=-1e-05", "positive"]),
    ("model.n_heads=3", ["model.dim=128", "model.n_heads=3", "divisible"]),
    ("model.n_kv_heads=3", ["model.n_heads=4", "model.n_kv_heads=3"]),
    ("model.dim=12", ["dim/n_heads=3", "even"]),
    # [ft]
    ("ft.lr_policy=cube", ["ft.lr_policy='cube'", "sqrt"]),
    ("ft.catchup_max_steps=0", ["ft.catchup_max_steps=0", ">= 1"]),
    ("ft.heartbeat_interval=0", ["ft.heartbeat_interval=0.0", "> 0"]),
    ("ft.transfer_chunk_bytes=10", ["ft.transfer_chunk_bytes=10", ">= 1024"]),
    # [run], [observe]
    ("run.name=a/b", ["run.name='a/b'", "'/'"]),
    ("run.seed=-1", ["run.seed=-1", "non-negative"]),
    ("observe.log_every=0", ["observe.log_every=0", ">= 1"]),
])
def test_invalid_values_name_the_field_and_the_value(override: str, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({}, [override])
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_non_integer_counts_are_refused_when_constructed_directly() -> None:
    with pytest.raises(ConfigError, match=r"train\.steps=2\.5 must be an integer"):
        TrainConfig(steps=2.5)
    with pytest.raises(ConfigError, match=r"checkpoint\.every=True"):
        CheckpointConfig(every=True)


def test_timeout_chain_violation_is_refused_naming_both_fields() -> None:
    with pytest.raises(ConfigError) as err:
        build_config({"ft": {"heartbeat_timeout": 20.0}})
    msg = str(err.value)
    assert "ft.heartbeat_timeout=20.0" in msg and "ft.allreduce_timeout=10.0" in msg
    assert "timeout chain" in msg
    with pytest.raises(ConfigError, match=r"ft\.quorum_timeout=500.*ft\.give_up_seconds=300"):
        build_config({}, ["ft.quorum_timeout=500"])
    # A consistent chain with every value moved is accepted.
    ok = build_config({}, ["ft.heartbeat_interval=0.5", "ft.heartbeat_timeout=2",
                           "ft.allreduce_timeout=5", "ft.quorum_timeout=30",
                           "ft.give_up_seconds=60"])
    assert ok.ft.allreduce_timeout == 5.0


def test_missing_and_malformed_files_are_config_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml does not exist"):
        load_config(missing)
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = ")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        load_config(bad)


def test_resolved_config_round_trips(toml_file: Path, tmp_path: Path) -> None:
    cfg = load_config(toml_file, ["train.lr=3.3e-4", "model.tie_embeddings=false",
                                  "ft.lr_policy=linear", "run.dir=/tmp/x"])
    path = tmp_path / "out" / "config.toml"
    save_config(cfg, path)
    again = load_config(path)
    assert isinstance(again, RunConfig)
    assert again == cfg
    # Every field is written, defaults included, so the file alone reproduces the run.
    text = path.read_text()
    for section in ("[run]", "[model]", "[data]", "[train]", "[ft]", "[checkpoint]", "[observe]"):
        assert section in text
    assert "allreduce_timeout" in text and "min_lr_ratio" in text


def test_default_config_round_trips(tmp_path: Path) -> None:
    cfg = RunConfig()
    save_config(cfg, tmp_path / "c.toml")
    assert load_config(tmp_path / "c.toml") == cfg


# --- non-finite and out-of-range numbers -----------------------------------------------------

@pytest.mark.parametrize("override, needles", [
    ("train.lr=inf", ["train.lr=inf", "finite", "> 0"]),
    ("train.lr=nan", ["train.lr=nan", "finite"]),
    ("train.lr=-inf", ["train.lr=-inf", "finite"]),
    ("train.eps=inf", ["train.eps=inf", "finite", "> 0"]),
    ("train.eps=nan", ["train.eps=nan", "finite"]),
    ("train.weight_decay=inf", ["train.weight_decay=inf", "finite", ">= 0"]),
    ("train.weight_decay=nan", ["train.weight_decay=nan", "finite"]),
    ("train.grad_clip=inf", ["train.grad_clip=inf", "finite", "0 disables"]),
    ("train.grad_clip=-1", ["train.grad_clip=-1.0", ">= 0"]),
    ("train.max_seconds=inf", ["train.max_seconds=inf", "finite", "0 means no limit"]),
    ("train.min_lr_ratio=nan", ["train.min_lr_ratio=nan", "[0, 1]"]),
    ("train.min_lr_ratio=-0.5", ["train.min_lr_ratio=-0.5", "[0, 1]"]),
    ("train.decay_fraction=nan", ["train.decay_fraction=nan", "(0, 1]"]),
    ("train.beta1=nan", ["train.beta1=nan", "[0, 1)"]),
    ("train.beta1=1", ["train.beta1=1.0", "[0, 1)"]),
    ("train.beta2=-0.1", ["train.beta2=-0.1", "[0, 1)"]),
    ("train.beta2=inf", ["train.beta2=inf", "[0, 1)"]),
    ("model.norm_eps=inf", ["model.norm_eps=inf", "finite", "> 0"]),
    ("model.norm_eps=nan", ["model.norm_eps=nan", "finite"]),
    ("model.rope_theta=inf", ["model.rope_theta=inf", "finite"]),
    ("model.rope_theta=1", ["model.rope_theta=1.0", "> 1"]),
    ("model.init_std=nan", ["model.init_std=nan", "finite"]),
    ("ft.heartbeat_interval=inf", ["ft.heartbeat_interval=inf", "finite"]),
    ("ft.allreduce_timeout=nan", ["ft.allreduce_timeout=nan", "finite"]),
    ("ft.join_timeout=inf", ["ft.join_timeout=inf", "finite", ">= 0"]),
    ("ft.restart_delay=nan", ["ft.restart_delay=nan", "finite"]),
])
def test_non_finite_and_out_of_range_floats_are_refused(override: str,
                                                         needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({}, [override])
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_toml_inf_and_nan_literals_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "inf.toml"
    path.write_text("[train]\nlr = inf\n")
    with pytest.raises(ConfigError, match=r"train\.lr=inf must be a finite number > 0"):
        load_config(path)
    path.write_text("[train]\neps = nan\n")
    with pytest.raises(ConfigError, match=r"train\.eps=nan must be a finite number > 0"):
        load_config(path)


def test_valid_edge_values_are_still_accepted() -> None:
    cfg = build_config({}, ["train.beta1=0", "train.grad_clip=0", "train.min_lr_ratio=1",
                            "train.weight_decay=0", "train.max_seconds=0",
                            "train.decay_fraction=1", "ft.join_timeout=0"])
    assert cfg.train.beta1 == 0.0 and cfg.train.grad_clip == 0.0


def test_an_integer_too_large_for_a_float_field_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"train\.lr=1{400}.*finite"):
        build_config({"train": {"lr": int("1" * 400)}})


def test_non_utf8_config_file_names_the_file_the_line_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes("[run]\nname = \"ok\"\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "latin1.toml" in msg and "line 3" in msg and "UTF-8" in msg, msg
    assert "\n" not in msg


def test_unreadable_config_path_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path)  # a folder, not a file


def test_a_model_too_large_to_build_is_refused_before_anything_is_allocated(tmp_path) -> None:
    for override, needle in (("model.dim=1000000000", "parameters, above"),
                             ("model.n_layers=1000000000", "n_layers=1000000000 is above"),
                             ("model.max_seq_len=1000000000000", "max_seq_len=1000000000000")):
        with pytest.raises(ConfigError, match=needle) as caught:
            load_config(None, [override])
        assert "\n" not in str(caught.value)


def test_a_deeply_nested_toml_array_is_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("[train]\nsteps = " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match="nests arrays or tables too deeply") as caught:
        load_config(path)
    assert "\n" not in str(caught.value)
