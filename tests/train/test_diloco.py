"""DiLoCo alone (``ft.sync = "diloco"``): the config's checks, the fragments, the int8 code, and a
group training through ``ftlm.train.Session`` in plain, streaming, overlapped and quantised form.
The fault-tolerant runs with several groups are in ``test_diloco_launch.py``."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ftlm.errors import ConfigError
from ftlm.ft.config import FTConfig
from ftlm.observe.events import read_events
from ftlm.train import Session
from ftlm.train.diloco import (INT8_ROW, int8_decode, int8_encode, int8_levels, int8_rows,
                               mirror_module, split_fragments)

sys.path.insert(0, str(Path(__file__).parent))
from test_session import ROWS, dataset, model  # noqa: E402


@pytest.mark.parametrize("fields, message", [
    ({"sync": "sometimes"}, r"ft.sync='sometimes'; valid: every_step"),
    ({"diloco_inner_steps": 0}, r"ft.diloco_inner_steps=0 must be an integer >= 1"),
    ({"diloco_inner_steps": 10, "diloco_fragments": 4}, r"must be a multiple of ft.diloco_fragments=4"),
    ({"diloco_inner_steps": 8, "diloco_fragments": 4, "diloco_overlap_steps": 2},
     r"diloco_overlap_steps=2 must be below the 2 inner steps"),
    ({"diloco_outer_lr": 0.0}, r"ft.diloco_outer_lr=0.0 must be a number > 0"),
    ({"diloco_outer_momentum": 1.0}, r"diloco_outer_momentum=1.0 must be a number in \[0, 1\)"),
    ({"diloco_outer_momentum": 0.0}, r"diloco_nesterov=true needs ft.diloco_outer_momentum > 0"),
    ({"diloco_merge_alpha": 1.5}, r"diloco_merge_alpha=1.5 must be a number in \[0, 1\]"),
    ({"diloco_wire_dtype": "fp8"}, r"diloco_wire_dtype='fp8'; valid: float32, bfloat16, int8"),
    ({"diloco_fragment_split": "random"}, r"diloco_fragment_split='random'; valid: contiguous"),
])
def test_a_bad_diloco_setting_names_the_field_and_what_is_valid(fields, message) -> None:
    with pytest.raises(ConfigError, match=message):
        FTConfig(**{"sync": "diloco", **fields})


def test_inner_steps_per_sync_is_h_over_the_fragments() -> None:
    assert FTConfig().inner_steps_per_sync == 1
    assert FTConfig(sync="diloco", diloco_inner_steps=100, diloco_fragments=4).inner_steps_per_sync == 25


def test_fragments_cover_every_parameter_once_strided_or_in_balanced_runs() -> None:
    sizes = [100, 10, 10, 100, 10, 10, 100, 10]
    strided = split_fragments(sizes, 3, "strided")
    assert strided == [[0, 3, 6], [1, 4, 7], [2, 5]]
    runs = split_fragments(sizes, 3, "contiguous")
    assert sorted(i for f in runs for i in f) == list(range(len(sizes)))
    assert all(f and f == list(range(f[0], f[-1] + 1)) for f in runs)
    assert split_fragments([1, 1], 2, "contiguous") == [[0], [1]]
    with pytest.raises(ValueError, match="exceeds the model's 2 trainable parameters"):
        split_fragments([1, 1], 3, "strided")


def test_int8_codes_of_every_participant_sum_without_overflow_and_decode_near_the_mean() -> None:
    g = torch.Generator().manual_seed(0)
    participants = 5
    values = [torch.randn(3 * INT8_ROW + 7, generator=g) * (i + 1) for i in range(participants)]
    rows = [int8_rows(v) for v in values]
    range_sum = sum(r.abs().amax(dim=1) for r in rows)
    levels = int8_levels(participants)
    coded = [int8_encode(r, range_sum, levels) for r in rows]
    wide = sum(c.to(torch.int32) for c, _ in coded)
    assert int(wide.abs().max()) <= 127  # the int8 SUM on the wire cannot wrap
    code_sum = sum((c for c, _ in coded), torch.zeros_like(coded[0][0]))
    assert torch.equal(code_sum.to(torch.int32), wide)
    mean = sum(rows) / participants
    got = int8_decode(code_sum, range_sum, levels, participants)
    step = (range_sum / levels).unsqueeze(1)
    assert float(((got - mean).abs() / step).max()) <= 0.5 + 1e-4  # each code off by half a step
    # What each code left out is exactly what error feedback adds to the next round.
    for r, (c, error) in zip(rows, coded):
        torch.testing.assert_close(c.float() * step + error, r)
    with pytest.raises(ValueError, match="use bfloat16 for that many"):
        int8_levels(64)


def test_the_outer_copy_has_the_models_parameter_names() -> None:
    net = model()
    outer, params = mirror_module(net)
    assert [n for n, _ in outer.named_parameters()] == [n for n, _ in net.named_parameters()]
    assert all(torch.equal(a, b) and a is not b for a, b in zip(params, net.parameters()))


def _train(tmp_path: Path, monkeypatch, steps: int, **ft) -> tuple[Session, list[int]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    lines = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in ft.items())
    config = tmp_path / "config.toml"
    config.write_text(f'[run]\ndir = "{tmp_path / "run"}"\n[train]\nsteps = {steps}\n'
                      f'batch_size = 16\n[ft]\nsync = "diloco"\n{lines}\n'.replace("True", "true")
                      .replace("False", "false"))
    monkeypatch.setenv("FTLM_CONFIG", str(config))
    monkeypatch.delenv("FTLM_COORDINATOR", raising=False)
    x, y = dataset()
    net = model()
    session = Session(net, torch.optim.AdamW(net.parameters()), lr=2e-2, grad_clip=1.0)
    seen: list[int] = []
    for step in session:
        rows = [p % ROWS for p in step.samples]
        seen += list(step.samples)
        loss = nn.functional.mse_loss(net(x[rows]), y[rows])
        loss.backward()
        assert session.commit(loss)
    session.summary = session.close()
    return session, seen


def test_a_group_alone_takes_h_inner_steps_per_outer_step_and_each_sample_once(
        tmp_path, monkeypatch) -> None:
    # (The default outer momentum 0.9 overshoots with one group and H this small.)
    session, seen = _train(tmp_path, monkeypatch, steps=12, diloco_inner_steps=5,
                           diloco_outer_momentum=0.5)
    assert seen == list(range(12 * 5 * 16))  # train.steps counts outer steps
    summary = session.summary
    assert summary["steps_committed"] == 12 and summary["replicas_identical"]
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0
    commits = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["kind"] == "commit"]
    assert [e["samples"] for e in commits[:2]] == [[0, 80], [80, 160]]
    assert all(e["inner_steps"] == 5 and e["fragment"] == 0 and e["staleness"] == 0 for e in commits)
    # One outer gradient (4 bytes a parameter) per 5 x 16 samples of one token each.
    params = sum(p.numel() for p in session.diloco.outer)
    assert commits[0]["wire_bytes"] == 4 * params
    assert summary["bytes_between_groups_per_token"] == round(4 * params / 80, 4)
    # The model the group ends with is the outer state: the replicated one.
    for p, o in zip(session.model.parameters(), session.diloco.outer):
        assert torch.equal(p, o)
    losses = session.losses
    assert statistics.fmean(losses[-3:]) < 0.5 * statistics.fmean(losses[:3]), losses


def test_one_group_with_outer_sgd_at_lr_1_matches_its_inner_steps_exactly(tmp_path, monkeypatch) -> None:
    """Outer SGD at lr 1 without momentum applies the group's own pseudo-gradient: the outer state
    is the inner parameters after each phase (up to the rounding of one subtraction)."""
    session, _ = _train(tmp_path / "a", monkeypatch, steps=6, diloco_inner_steps=4,
                        diloco_outer_lr=1.0, diloco_outer_momentum=0.0, diloco_nesterov=False)
    monkeypatch.setenv("FTLM_CONFIG", "")
    x, y = dataset()
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=2e-2)
    for position in range(0, 6 * 4 * 16, 16):
        rows = [p % ROWS for p in range(position, position + 16)]
        nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        torch.nn.utils.clip_grad_norm_(list(net.parameters()), 1.0, foreach=True)
        opt.step()
        opt.zero_grad()
    for a, b in zip(session.model.parameters(), net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "int8"])
def test_streaming_fragments_with_overlap_and_a_low_precision_wire_train_each_sample_once(
        tmp_path, monkeypatch, wire) -> None:
    session, seen = _train(tmp_path, monkeypatch, steps=16, diloco_inner_steps=8,
                           diloco_fragments=4, diloco_overlap_steps=1, diloco_wire_dtype=wire)
    assert seen == list(range(16 * 2 * 16))  # one fragment every 8 / 4 = 2 inner steps
    commits = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["kind"] == "commit"]
    assert [e["fragment"] for e in commits[:5]] == [0, 1, 2, 3, 0]
    assert {e["staleness"] for e in commits} == {1}
    fragment_bytes = [sum(session.diloco.outer[i].numel() for i in f) for f in session.diloco.fragments]
    per_value = {"float32": 4, "bfloat16": 2, "int8": 1}[wire]
    for e in commits[:4]:
        payload = fragment_bytes[e["fragment"]] * per_value
        assert payload <= e["wire_bytes"] <= payload + (4 * (payload // INT8_ROW + 1) if wire == "int8" else 0)
    assert session.summary["data"]["gaps"] == 0 and session.summary["replicas_identical"]
    losses = session.losses
    assert statistics.fmean(losses[-3:]) < 0.5 * statistics.fmean(losses[:3]), losses
