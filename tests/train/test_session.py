"""``ftlm.train.Session`` with a plain ``nn.Module`` and a ten-line loop: alone, and as groups of a
job against a real coordinator with one group killed mid-step and restarted (live recovery)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ftlm.errors import EXIT_RETIRED, ConfigError
from ftlm.ft.config import FTConfig
from ftlm.ft.coordinator import Coordinator
from ftlm.ft.quorum import Convicted
from ftlm.observe.events import read_events
from ftlm.observe.summary import build_summary
from ftlm.train import Session, Step

ROWS = 256


def dataset(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression problem: ``ROWS`` inputs and their targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def test_a_plain_module_trains_alone_and_every_sample_is_used_once(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FTLM_CONFIG", raising=False)
    monkeypatch.delenv("FTLM_COORDINATOR", raising=False)
    x, y = dataset()
    net = model()
    session = Session(net, torch.optim.AdamW(net.parameters()), lr=3e-2, grad_clip=1.0,
                      steps=40, batch_size=16, run_dir=tmp_path)
    seen: list[int] = []
    for step in session:
        rows = [p % ROWS for p in step.samples]
        seen += list(step.samples)
        loss = nn.functional.mse_loss(net(x[rows]), y[rows])
        loss.backward()
        assert session.commit(loss)
    summary = session.close()
    assert seen == list(range(40 * 16))
    assert summary["steps_committed"] == 40 and summary["data"]["duplicates"] == 0
    assert summary["data"]["gaps"] == 0 and summary["replicas_identical"]
    losses = session.losses
    assert statistics.fmean(losses[-5:]) < 0.5 * statistics.fmean(losses[:5]), losses
    assert (tmp_path / "model.safetensors").is_file()


def test_a_session_retired_for_a_suspect_state_sets_its_checkpoint_aside(tmp_path, monkeypatch) -> None:
    """The coordinator retires a group whose state may hold a corrupt group's bits (rule I2),
    naming that state (``Convicted.suspect_state``): the session moves its checkpoint aside as
    the process exits with EXIT_RETIRED, and the next session resumes from an older one."""
    monkeypatch.delenv("FTLM_CONFIG", raising=False)
    monkeypatch.delenv("FTLM_COORDINATOR", raising=False)
    x, y = dataset()

    def train(steps: int) -> Session:
        net = model()
        session = Session(net, torch.optim.SGD(net.parameters()), lr=0.1, steps=steps, batch_size=8,
                          run_dir=tmp_path, checkpoint_every=4)
        return session

    first = train(8)
    net = first.model
    for step in first:
        rows = [p % ROWS for p in step.samples]
        loss = nn.functional.mse_loss(net(x[rows]), y[rows])
        loss.backward()
        first.commit(loss)
    first.close()
    suspect = (first.state.step, first.state.chain)
    assert suspect[0] == 8
    second = train(12)
    with pytest.raises(SystemExit) as exited:
        with second:
            raise Convicted("replica g0:x was retired: its state may hold a corrupt group's bits", suspect)
    assert exited.value.code == EXIT_RETIRED
    assert (tmp_path / "checkpoints" / "rejected-step-00000008").is_dir()
    third = train(12)
    assert third.state.step == 4
    third.abort()


def test_gradient_accumulation_under_no_sync_matches_one_backward(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FTLM_CONFIG", raising=False)
    x, y = dataset()
    hashes = []
    for accum in (1, 2):
        net = model()
        session = Session(net, torch.optim.SGD(net.parameters()), lr=0.1, steps=3, batch_size=8,
                          run_dir=tmp_path / f"a{accum}")
        for step in session:
            rows = torch.tensor([p % ROWS for p in step.samples]).chunk(accum)
            total = 0.0
            for i, part in enumerate(rows):
                loss = nn.functional.mse_loss(net(x[part]), y[part], reduction="sum") / 8
                with session.no_sync() if i < accum - 1 else _nothing():
                    loss.backward()
                total += float(loss)
            session.commit(total)
        session.close()
        hashes.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*hashes):
        assert torch.allclose(a, b, atol=1e-6)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def test_step_slices_the_groups_samples_per_rank() -> None:
    group = range(32, 48)  # participant 2 of 4 at cursor 0, batch 16
    per_rank = [range(group.start + r * 4, group.start + (r + 1) * 4) for r in range(4)]
    steps = [Step(step=0, samples=s, group_samples=group, lr=0.1, participants=4, index=2)
             for s in per_rank]
    assert [p for s in steps for p in s.samples] == list(group)
    assert all(s.cursor == 0 for s in steps)
    assert Step(step=5, samples=range(88, 96), group_samples=range(88, 96), lr=0.1,
                participants=2, index=1).cursor == 80


def test_an_argument_that_contradicts_the_launchers_config_is_refused(tmp_path, monkeypatch) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'[run]\ndir = "{tmp_path / "run"}"\n[train]\nsteps = 30\nbatch_size = 8\n')
    monkeypatch.setenv("FTLM_CONFIG", str(config))
    monkeypatch.delenv("FTLM_COORDINATOR", raising=False)
    net = model()
    with pytest.raises(ConfigError, match=r"steps=20 contradicts the launcher's config .*train\.steps: 30"):
        Session(net, torch.optim.SGD(net.parameters()), lr=0.1, steps=20)
    session = Session(net, torch.optim.SGD(net.parameters()), lr=0.1, steps=30)
    assert (session.steps, session.batch_size, session.run_dir) == (30, 8, tmp_path / "run")
    session.close()
    monkeypatch.delenv("FTLM_CONFIG")
    with pytest.raises(ConfigError, match="Session needs batch_size"):
        Session(net, torch.optim.SGD(net.parameters()), lr=0.1, steps=30)


def test_a_hugging_face_causal_lm_trains_through_the_session(tmp_path, monkeypatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.delenv("FTLM_CONFIG", raising=False)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(config)
    tokens = torch.arange(16 * 64).reshape(64, 16) % 64  # a sequence anyone can learn
    session = Session(lm, torch.optim.AdamW(lm.parameters()), lr=3e-3, steps=12, batch_size=4,
                      run_dir=tmp_path)
    for step in session:
        batch = tokens[[p % 64 for p in step.samples]]
        out = lm(input_ids=batch, labels=batch)
        out.loss.backward()
        session.commit(out.loss)
    session.close()
    assert session.losses[-1] < session.losses[0]
    assert (tmp_path / "model.safetensors").is_file()


# -- groups of a job -----------------------------------------------------------------------------

# Starting a process (importing torch) takes seconds, minutes on a loaded box: the replacement of
# the killed group is started with the others and waits, imports done, for the test's go.
WORKER = r"""
import os, sys, time
from pathlib import Path
import torch
from torch import nn
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
from test_session import ROWS, dataset, model
import ftlm.ft.manager
from ftlm.train import Session

pace, go = Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None
deadline = time.monotonic() + 600
while go is not None and not go.exists():
    assert time.monotonic() < deadline, "no go within 600 s"
    time.sleep(0.05)
x, y = dataset()
net = model()
with Session(net, torch.optim.AdamW(net.parameters()), lr=1e-2, grad_clip=1.0) as session:
    for step in session:
        rows = [p % ROWS for p in step.samples]
        loss = nn.functional.mse_loss(net(x[rows]), y[rows])
        loss.backward()
        session.commit(loss)
        if pace.exists():  # until the test saw the restarted group recover
            time.sleep(0.1)
"""

FT = dict(heartbeat_interval=0.05, heartbeat_timeout=1.0, join_timeout=2.0,
          allreduce_timeout=5.0, quorum_timeout=60.0, groups=3, min_replicas=1)
STEPS = 600


def _start(tmp_path: Path, url: str, group: str, fault: str = "", go: str = "") -> subprocess.Popen:
    env = dict(os.environ, FTLM_CONFIG=str(tmp_path / "config.toml"), FTLM_COORDINATOR=url,
               FTLM_GROUP_ID=group, FTLM_FAULT=fault, PYTHONUNBUFFERED="1")
    args = [str(Path(__file__).parent), str(tmp_path / "pace")] + ([go] if go else [])
    return subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(events: Path, what, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if events.exists() and any(what(e) for e in read_events(events)):
            return
        time.sleep(0.1)
    raise AssertionError(f"not seen in {events} within {timeout} s")


@pytest.mark.timeout(900)  # four processes importing torch: minutes on a loaded 2-core box
def test_three_groups_one_killed_mid_step_and_restarted_end_identical_with_each_sample_once(
        tmp_path) -> None:
    run = tmp_path / "run"
    ft_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in FT.items())
    (tmp_path / "config.toml").write_text(
        f'[run]\ndir = "{run}"\n[train]\nsteps = {STEPS}\nbatch_size = 8\n[ft]\n{ft_lines}\n')
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "pace").touch()
    go = tmp_path / "go"
    coordinator = Coordinator(FTConfig(**FT).coordinator_config())
    coordinator.start()
    procs: list[subprocess.Popen] = []
    try:
        procs = [_start(tmp_path, coordinator.url, f"g{i}", "before_commit@5+" if i == 1 else "")
                 for i in range(3)]
        procs.append(_start(tmp_path, coordinator.url, "g1", go=str(go)))  # g1's replacement
        assert procs[1].wait(timeout=600) == -9, procs[1].stdout.read()  # killed by its fault
        go.touch()
        events = run / "events.jsonl"
        _wait_for(events, lambda e: e["kind"] == "recovery_end" and e["group"] == "g1", 240)
        (tmp_path / "pace").unlink()
        outputs = []
        for p in procs[:1] + procs[2:]:
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, out
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        coordinator.stop()
    results = [json.loads(line.split(" ", 1)[1]) for out in outputs
               for line in out.splitlines() if line.startswith("FTLM_RESULT ")]
    assert len(results) == 3 and len({r["state_hash"] for r in results}) == 1, results
    assert {r["step"] for r in results} == {STEPS}
    log = read_events(run / "events.jsonl")
    summary = build_summary(log, wall_seconds=1.0, groups=["g0", "g1", "g2"], config={},
                            state_hashes={f"g{i}": results[0]["state_hash"] for i in range(3)})
    assert summary["data"]["duplicates"] == 0 and summary["data"]["gaps"] == 0, summary["data"]
    assert summary["data"]["inconsistent_steps"] == []
    commits = {e["step"]: e for e in log if e["kind"] == "commit"}
    assert sorted(commits) == list(range(STEPS))
    assert any(e["kind"] == "failure_injected" and e["group"] == "g1" for e in log)
    early = statistics.fmean(commits[s]["loss"] for s in range(5))
    late = statistics.fmean(commits[s]["loss"] for s in range(STEPS - 5, STEPS))
    assert late < 0.5 * early, (early, late)
