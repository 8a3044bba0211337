"""The eval loss: correct, deterministic, side-effect free, emitted every K committed steps only,
and the same on every rank of an FSDP2-sharded group."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ftlm.errors import ConfigError
from ftlm.ft.protocol import NoFaultTolerance, StepPlan
from ftlm.observe.events import read_events
from ftlm.observe.metrics import TrainingMetrics
from ftlm.train.evaluate import Evaluator, NoEvaluation
from ftlm.train.trainer import Trainer


def advance(trainer: Trainer) -> bool:
    """One step through the trainer's session, as its loop takes it (``next``, then train and
    commit); True if it committed."""
    return trainer.train_step(next(trainer.session))

BATCH, SEQ = 4, 64


def evals(trainer: Trainer) -> list[dict]:
    return [e for e in read_events(trainer.run_dir / "events.jsonl") if e["kind"] == "eval"]


def test_loss_is_the_mean_cross_entropy_over_the_first_heldout_batches(tiny_config) -> None:
    trainer = Trainer.for_run(tiny_config(train={"eval_every": 5, "eval_batches": 3}))
    try:
        rows = torch.from_numpy(trainer.data.heldout.samples(np.arange(3 * BATCH)))
        with torch.no_grad():
            logits = trainer.model(rows[:, :-1])
            expected = F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1))
        got = trainer.evaluator.evaluate()
        assert got.eval_tokens == 3 * BATCH * SEQ
        assert got.loss == pytest.approx(float(expected), rel=1e-6)
        assert got.seconds > 0
    finally:
        trainer.loader.close()


def test_evaluation_changes_no_state_no_rng_and_no_mode(tiny_config) -> None:
    trainer = Trainer.for_run(tiny_config(train={"steps": 6, "eval_every": 3}))
    for _ in range(3):
        advance(trainer)  # a trained model, optimizer state and cursor, not just the initial ones
    try:
        before = trainer.state_hash()
        rng = torch.get_rng_state()
        grads = [p.grad for p in trainer.params]
        first = trainer.evaluator.evaluate().loss
        second = trainer.evaluator.evaluate().loss
        assert first == second, "the same model on the same samples: bitwise the same loss"
        assert trainer.state_hash() == before
        assert torch.equal(torch.get_rng_state(), rng)
        assert trainer.model.training
        assert all(p.grad is g for p, g in zip(trainer.params, grads))
        assert (trainer.state.step, trainer.state.cursor) == (3, 3 * BATCH)
    finally:
        trainer.loader.close()


def test_eval_event_every_k_committed_steps_and_after_the_last(tiny_config) -> None:
    trainer = Trainer.for_run(tiny_config(train={"steps": 12, "eval_every": 5, "eval_batches": 2}))
    summary = trainer.train()
    got = evals(trainer)
    assert [e["step"] for e in got] == [5, 10, 12]
    for e in got:
        assert e["group"] == "g0" and e["tokens"] == e["step"] * BATCH * SEQ
        assert math.isfinite(e["loss"]) and e["seconds"] >= 0
    assert got[-1]["loss"] < math.log(1024), "a trained model beats uniform guessing"
    assert summary["final_eval_loss"] == got[-1]["loss"]


class ScriptedFaults(NoFaultTolerance):
    """A lone group whose step ``fail`` fails once and whose step ``recover`` is spent once as a
    recovering member that receives nothing (so it is retried, like a failed step)."""

    def __init__(self, fail: int, recover: int) -> None:
        super().__init__()
        self.fail, self.recover = {fail}, {recover}
        self.plan: StepPlan | None = None

    def start_step(self, step: int, *rest) -> StepPlan:
        self.plan = super().start_step(step, *rest)
        if step in self.recover:
            self.recover.discard(step)
            self.plan = dataclasses.replace(self.plan, participant_index=None, recovering=True)
        return self.plan

    def commit(self) -> bool:
        if self.plan.step in self.fail and not self.plan.recovering:
            self.fail.discard(self.plan.step)
            return False
        return super().commit()


def test_no_eval_after_a_failed_or_recovering_step(tiny_config) -> None:
    # Each happens when the model has 5 / 10 committed steps, i.e. when an evaluation is due:
    # only the committed steps that reached 5 and 10 may evaluate.
    config = tiny_config(train={"steps": 12, "eval_every": 5, "eval_batches": 1})
    trainer = Trainer.for_run(config, ft=ScriptedFaults(fail=5, recover=10))
    trainer.train()
    events = read_events(trainer.run_dir / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "step_failed"] == [5]
    assert [e["step"] for e in evals(trainer)] == [5, 10, 12]
    assert [e["step"] for e in events if e["kind"] == "commit"] == list(range(12))


def test_eval_off_and_bad_settings(tiny_config) -> None:
    trainer = Trainer.for_run(tiny_config(train={"steps": 3, "eval_every": 0}))
    assert isinstance(trainer.evaluator, NoEvaluation) and not trainer.evaluator.due(50)
    assert trainer.train()["final_eval_loss"] is None
    assert evals(trainer) == []
    with pytest.raises(ConfigError, match=r"train\.eval_batches=4 x train\.batch_size=4 = 16 "
                                          r"held-out samples, but data\.eval_samples=10"):
        Trainer.for_run(tiny_config(data={"eval_samples": 10}, train={"eval_batches": 4}))
    with pytest.raises(ConfigError, match=r"data\.eval_samples=0"):
        Trainer.for_run(tiny_config(data={"eval_samples": 0}, train={"eval_every": 5}))
    with pytest.raises(ConfigError, match=r"train\.eval_every=-1"):
        tiny_config(train={"eval_every": -1})


def test_training_never_sees_a_heldout_sample(tiny_config) -> None:
    trainer = Trainer.for_run(tiny_config(train={"steps": 4, "eval_every": 0}))
    try:
        held = {tuple(r) for r in trainer.data.heldout.samples(np.arange(256)).tolist()}
        epoch = len(trainer.data.train)
        assert epoch == len(trainer.data.train.source) - 256
        trained = trainer.loader.compute(0, 0, 1, epoch)  # one whole epoch of the global order
        assert not held & {tuple(r) for r in trained.tolist()}
    finally:
        trainer.loader.close()


def test_eval_loss_gauge_is_nan_until_the_first_evaluation() -> None:
    m = TrainingMetrics("job", "g0", 0)
    labels = {"job": "job", "group": "g0", "rank": "0"}
    assert math.isnan(m.registry.get_sample_value("ftlm_eval_loss", labels))
    m.on_eval(3.25)
    assert m.registry.get_sample_value("ftlm_eval_loss", labels) == 3.25


# -- an FSDP2 group of two ranks ------------------------------------------------------------------
def _fsdp_worker(rank: int, world: int, store: str, run_dir: str, data_dir: str, out: str) -> None:
    """One rank: shard the tiny model over the group, evaluate twice, report what it saw."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import TINY_MODEL

    from ftlm.config import build_config
    from ftlm.data.split import split_heldout
    from ftlm.train.parallelize import group_mesh, parallelize
    from ftlm.train.trainer import build_model, load_data

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    try:
        config = build_config({"run": {"dir": run_dir}, "model": dict(TINY_MODEL),
                               "data": {"dir": data_dir, "seq_len": SEQ}})
        device = torch.device("cpu")
        model = parallelize(build_model(config, device), group_mesh(device),
                            activation_checkpointing=False, compile=False)
        _, dataset = load_data(config)
        heldout = split_heldout(dataset, config.data.eval_samples, config.data.eval_seed).heldout
        ev = Evaluator(model, heldout, every=1, batches=2, batch_size=BATCH, micro_batch=1,
                       last_step=1, rank=rank, ranks=world)
        shards = [p.to_local().clone() for p in model.parameters()]
        rng = torch.get_rng_state()
        losses = [ev.evaluate().loss, ev.evaluate().loss]
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        report = {
            "losses": losses,
            "sharded": sharded,
            "same_shards": sharded and all(torch.equal(a, p.to_local())
                                           for a, p in zip(shards, model.parameters())),
            "same_rng": bool(torch.equal(rng, torch.get_rng_state())),
        }
        Path(out).write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_every_rank_of_a_sharded_group_gets_the_unsharded_loss(tiny_config, tmp_path) -> None:
    config = tiny_config()
    reference = Trainer.for_run(config)
    try:
        ref = Evaluator(reference.model, reference.data.heldout, every=1, batches=2,
                        batch_size=BATCH, micro_batch=BATCH, last_step=1).evaluate().loss
    finally:
        reference.loader.close()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [subprocess.Popen([sys.executable, __file__, "fsdp-worker", json.dumps(
        [r, 2, str(tmp_path / "store"), str(tmp_path / f"r{r}"), config.data.dir,
         str(tmp_path / f"rank{r}.json")])], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["losses"] == reports[1]["losses"], "every rank: the same number"
    for rep in reports:
        assert rep["losses"][0] == rep["losses"][1]
        assert rep["losses"][0] == pytest.approx(ref, rel=1e-5)
        assert rep["sharded"] and rep["same_shards"] and rep["same_rng"], rep


if __name__ == "__main__" and sys.argv[1:2] == ["fsdp-worker"]:
    _fsdp_worker(*json.loads(sys.argv[2]))
    # Its report is written and its process group destroyed: leave without the interpreter's
    # teardown, where torch's native threads ended a rank with "terminate called without an
    # active exception" (SIGABRT) once in a full suite on a loaded box (2026-12-01).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
