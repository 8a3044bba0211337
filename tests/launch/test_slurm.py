"""The Slurm launcher: generated scripts are valid shell, and a real one-node Slurm runs a job.

The real-cluster test starts munged, slurmctld and slurmd from the Debian packages (``make
system-deps-cluster``) and skips, saying why, where they are missing or cannot run.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftlm.errors import ConfigError
from ftlm.launch.cluster_config import ClusterConfig
from ftlm.launch.slurm import generate_slurm

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import SlurmCluster, missing_reason  # noqa: E402

SCRIPTS = ("coordinator.sbatch", "group-g0.sbatch", "group-g1.sbatch", "watch.sh",
           "submit-all.sh", "stop-all.sh")


def generate(tmp_path: Path, config, **cluster) -> Path:
    out = tmp_path / "slurm"
    generate_slurm(config, ClusterConfig(**cluster), out, config.to_toml(), workdir=tmp_path)
    return out


def test_scripts_are_valid_bash(tmp_path, tiny_config):
    out = generate(tmp_path, tiny_config(), groups=2, slurm_partition="gpu", slurm_account="ml",
                   slurm_setup="source /opt/venv/bin/activate")
    for name in SCRIPTS:
        r = subprocess.run(["bash", "-n", str(out / name)], capture_output=True, text=True)
        assert r.returncode == 0, f"{name}: {r.stderr}"


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed: run `make system-deps-cluster`")
def test_scripts_pass_shellcheck(tmp_path, tiny_config):
    out = generate(tmp_path, tiny_config(), groups=2, gpus_per_rank=1, ranks_per_group=4)
    r = subprocess.run(["shellcheck", *[str(out / n) for n in SCRIPTS]],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_group_script_requeues_forwards_usr2_and_places_the_group(tmp_path, tiny_config):
    out = generate(tmp_path, tiny_config(), groups=3, ranks_per_group=4, gpus_per_rank=2,
                   grace_seconds=90)
    text = (out / "group-g2.sbatch").read_text()
    assert "#SBATCH --requeue" in text
    assert "#SBATCH --signal=B:USR2@90" in text
    assert "#SBATCH --gpus-per-node=8" in text
    assert "trap on_usr2 USR2" in text and 'kill -TERM "$child"' in text
    assert re.search(r"srun .* -m torch\.distributed\.run .*--nproc-per-node=4 -m ftlm\.cli train",
                     text)
    assert "FTLM_GROUP_ID=g2 FTLM_GROUPS=3" in text
    assert sorted(p.name for p in out.glob("group-*.sbatch")) == [
        "group-g0.sbatch", "group-g1.sbatch", "group-g2.sbatch"]
    assert (out / "token").stat().st_mode & 0o777 == 0o600
    # Regenerating with fewer groups removes the old groups' scripts but keeps the token.
    token = (out / "token").read_text()
    generate(tmp_path, tiny_config(), groups=1)
    assert [p.name for p in out.glob("group-*.sbatch")] == ["group-g0.sbatch"]
    assert (out / "token").read_text() == token


def test_bad_cluster_values_name_the_field():
    with pytest.raises(ConfigError, match="cluster.slurm_time"):
        ClusterConfig(slurm_time="forever")
    with pytest.raises(ConfigError, match="cluster.slurm_partition"):
        ClusterConfig(slurm_partition="a b")


# -- a real Slurm ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-cluster"))
    try:
        cluster.start()
    except (subprocess.SubprocessError, RuntimeError, OSError) as e:
        cluster.stop()
        pytest.skip(f"a local Slurm cluster could not start here: {e}")
    yield cluster
    cluster.stop()


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)  # polling files written by processes under Slurm's control
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _results(out: Path, group: str) -> list[dict]:
    found = []
    for log in sorted(out.glob(f"logs/{group}-*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("FTLM_RESULT "):
                found.append(json.loads(line[len("FTLM_RESULT "):]))
    return found


@pytest.mark.timeout(400)
def test_cancelled_group_is_resubmitted_rejoins_and_replicas_match(tmp_path, tiny_config, slurm):
    steps = 1000
    config = tiny_config(train={"steps": steps})
    run_dir = config.run.path
    out = generate(tmp_path, config, groups=2, python=sys.executable, slurm_cpus_per_rank=1,
                   coordinator_port=_port(), watch_interval=1, grace_seconds=30)
    env = dict(slurm.env, FTLM_WATCH_INTERVAL="1")
    subprocess.run([str(out / "submit-all.sh"), "--no-watch"], check=True, env=env, timeout=60)
    watcher = subprocess.Popen([str(out / "watch.sh")], env=env, stdout=open(tmp_path / "watch.log", "w"),
                               stderr=subprocess.STDOUT)
    try:
        first_g1 = (out / "state" / "g1.jobid").read_text().strip()
        _wait_for(lambda: any(e["kind"] == "commit" and e["group"] == "g1" and e["step"] >= 20
                              for e in _events(run_dir)), 120, "g1 to commit step 20")
        subprocess.run(["scancel", first_g1], check=True, env=env, timeout=30)
        resubmitted = _wait_for(
            lambda: (out / "state" / "g1.jobid").read_text().strip() != first_g1
            and (out / "state" / "g1.jobid").read_text().strip(), 60, "g1 to be resubmitted")
        assert (out / "state" / "g1.restarts").read_text().strip() == "1"
        assert watcher.wait(timeout=300) == 0, (tmp_path / "watch.log").read_text()
    finally:
        if watcher.poll() is None:
            watcher.send_signal(signal.SIGTERM)
            watcher.wait(timeout=30)
        subprocess.run([str(out / "stop-all.sh")], env=env, timeout=60, check=False)
    events = _events(run_dir)
    recoveries = [e for e in events if e["kind"] == "recovery_end" and e["group"] == "g1"]
    assert recoveries and recoveries[-1]["ok"], "the resubmitted g1 did not recover from g0"
    g0, g1 = _results(out, "g0"), _results(out, "g1")
    assert g0 and g0[-1]["step"] == steps
    assert g1 and g1[-1]["step"] == steps, f"g1 (job {resubmitted}) did not finish the run"
    assert g0[-1]["state_hash"] == g1[-1]["state_hash"], "replicas differ at the end"
    committed = {e["step"] for e in events if e["kind"] == "commit"}
    assert committed == set(range(steps))


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
