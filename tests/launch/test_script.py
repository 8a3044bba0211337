"""``ftlm launch local ... -- SCRIPT ARGS``: every rank runs a user's own training script.

What the launcher gives a script (the command line, ``FTLM_CONFIG`` and ``FTLM_RUN_DIR`` beside
the usual environment) and what it needs back (each rank's ``FTLM_RESULT`` line): on real
processes with a stand-in script; then a real fault-tolerant job whose groups run a plain
PyTorch loop through ``ftlm.train.session.Session``, checked like every job of
``test_fault_tolerance.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftlm.config import build_config, load_config
from ftlm.errors import ConfigError
from ftlm.launch.local import LocalLauncher

sys.path.insert(0, str(Path(__file__).parent))
from test_fault_tolerance import ALL_IN_FIRST_QUORUM, check_invariants, injected  # noqa: E402

STEPS = 40


def make_config(run_dir: Path, steps: int = STEPS, ft: dict | None = None):
    """A job's config without model or data sections: a script brings its own."""
    return build_config({
        "run": {"name": "script", "dir": str(run_dir), "seed": 3},
        "train": {"steps": steps, "batch_size": 4, "lr": 0.05, "warmup_steps": 0, "threads": 1},
        "ft": {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, "join_timeout": 2.0,
               "allreduce_timeout": 5.0, "quorum_timeout": 30.0, "give_up_seconds": 90.0,
               "restart_delay": 0.2, "bucket_bytes": 65536, **(ft or {})},
        "observe": {"progress": False},
    })


# A stand-in for a training script: it records what it was given and prints the result line a
# Session prints at its end (the group reached the last step), which is all the launcher needs to
# count the group finished.
RECORDING_SCRIPT = """
import json, os, sys
env = {k: v for k, v in os.environ.items() if k.startswith(("FTLM_", "RANK", "WORLD_SIZE", "MASTER_"))}
rank = int(os.environ["RANK"])
out = os.path.join(os.environ["FTLM_RUN_DIR"], f"seen.{os.environ['FTLM_GROUP_ID']}.r{rank}.json")
with open(out, "w") as f:
    json.dump({"argv": sys.argv, "env": env}, f)
steps = int(sys.argv[sys.argv.index("--steps") + 1])
print("FTLM_RESULT " + json.dumps({"state_hash": "same-state", "step": steps, "rank": rank,
                                   "incarnation": os.environ["FTLM_INCARNATION"]}), flush=True)
"""


def test_a_script_that_does_not_exist_is_refused_before_anything_starts(tmp_path):
    config = make_config(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"script .*nope\.py does not exist or is not a file"):
        LocalLauncher(config, groups=2, script=tmp_path / "nope.py")
    assert not (tmp_path / "run").exists()


def test_ftlm_train_ranks_get_the_run_config_and_the_run_directory(tmp_path, monkeypatch):
    """Every group process gets ``FTLM_CONFIG`` and ``FTLM_RUN_DIR``, ``ftlm train`` ranks too."""
    config = make_config(tmp_path / "run")
    launcher = LocalLauncher(config, groups=1, ranks_per_group=2, progress=False)
    config_file = launcher._prepare_run_dir()
    started: list[tuple[list[str], dict]] = []

    class Recorded:
        def __init__(self, cmd, env, **_):
            started.append((cmd, env))

        def wait(self, timeout=None):  # the launcher's exit watcher waits on each process
            return 0

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    launcher._spawn(launcher.groups[0], config_file, "http://127.0.0.1:9")
    assert [cmd[3:5] for cmd, _ in started] == [["train", str(config_file)]] * 2
    for rank, (_, env) in enumerate(started):
        assert env["FTLM_CONFIG"] == str(config_file.absolute())
        assert env["FTLM_RUN_DIR"] == str(config.run.path.absolute())
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "2")
    # The file it names is the resolved run config (every field, the launcher's group count).
    resolved = load_config(config_file)
    assert (resolved.train.steps, resolved.ft.groups) == (STEPS, 1)


def test_a_launched_script_gets_its_arguments_and_environment_and_its_result_is_read(tmp_path):
    """The whole launch of a stand-in script on real processes: the ranks of a group run
    ``ftlm run SCRIPT ARGS`` with the job's environment, and the launcher reads their results as
    it reads those of ``ftlm train`` (final steps, state hashes). The stand-in trains nothing, so
    the run fails its checks: no committed step."""
    script = tmp_path / "my_train.py"
    script.write_text(RECORDING_SCRIPT)
    config = make_config(tmp_path / "run")
    summary = LocalLauncher(config, groups=1, ranks_per_group=2, progress=False, script=script,
                            script_args=["--steps", str(STEPS), "--", "x"],
                            coordinator_standby=False).run()
    run_dir = config.run.path
    for group in ("g0",):
        for rank in (0, 1):
            seen = json.loads((run_dir / f"seen.{group}.r{rank}.json").read_text())
            assert seen["argv"] == [str(script), "--steps", str(STEPS), "--", "x"]
            env = seen["env"]
            assert env["FTLM_CONFIG"] == str((run_dir / "config.toml").absolute())
            assert env["FTLM_RUN_DIR"] == str(run_dir.absolute())
            assert (env["FTLM_GROUP_ID"], env["RANK"], env["WORLD_SIZE"]) == (group, str(rank), "2")
            assert env["FTLM_COORDINATOR"].startswith("http://127.0.0.1:")
            assert env["FTLM_TOKEN"] == (run_dir / "token").read_text().strip()
            assert env["FTLM_GROUPS"] == "1" and env["FTLM_INCARNATION"]
    assert summary["final_steps"] == {"g0": STEPS}
    assert summary["restarts"] == {"g0": 0}
    assert list(summary["state_hashes"]) == ["g0"]
    assert summary["problems"], "a run that committed no step passed its checks"


# A plain PyTorch loop (not ftlm's Transformer) made fault tolerant by the Session: the data set
# is defined by position, and the Session hands each step the positions this rank trains.
SESSION_SCRIPT = """
import torch
from ftlm.train.session import Session

torch.manual_seed(0)  # every group builds the same initial model
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)


def sample(position):
    x = torch.randn(8, generator=torch.Generator().manual_seed(position))
    return x, x.sum().tanh().reshape(1)


with Session(model, optimizer, lr=0.05) as session:
    for step in session:
        xs, ys = zip(*(sample(i) for i in step.samples))
        loss = torch.nn.functional.mse_loss(model(torch.stack(xs)), torch.stack(ys))
        loss.backward()
        session.commit(loss)
"""


@pytest.mark.slow
def test_groups_running_a_session_script_survive_a_group_killed_mid_step(tmp_path):
    """A planned kill at the all-reduce of a script's group. The default tier covers the path:
    tests/examples runs a Session script under the launcher with chaos, and
    tests/train/test_session.py kills a Session group mid-step (before its commit)."""
    script = tmp_path / "my_train.py"
    script.write_text(SESSION_SCRIPT)
    config = make_config(tmp_path / "run", ft=ALL_IN_FIRST_QUORUM)
    summary = LocalLauncher(config, groups=2, progress=False, script=script,
                            faults={"g1": ["before_allreduce@10+"]}).run()
    from ftlm.observe.events import read_events
    events = read_events(config.run.path / "events.jsonl")
    assert injected(events, "g1") == ["before_allreduce"]
    assert summary["restarts"]["g1"] == 1
    check_invariants(summary, events, 2, steps=STEPS)
