"""The Slurm launcher: generated scripts are valid shell, and a real one-node Slurm runs a job.

The real-cluster test starts munged, slurmctld and slurmd from the Debian packages (``make
system-deps-cluster``) and skips, saying why, where they are missing or cannot run.
"""

from __future__ import annotations

import json
import os
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
           "submit-all.sh", "stop-all.sh", "node.sh")


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


def test_group_script_requeues_signals_the_step_and_places_the_group(tmp_path, tiny_config):
    out = generate(tmp_path, tiny_config(), groups=3, ranks_per_group=4, gpus_per_rank=2,
                   grace_seconds=90)
    text = (out / "group-g2.sbatch").read_text()
    assert "#SBATCH --requeue" in text
    assert "#SBATCH --signal=B:USR2@90" in text
    assert "#SBATCH --gpus-per-node=8" in text
    # Defect 1: the trap signals the step's tasks, never srun (which would SIGKILL them).
    assert "trap on_usr2 USR2" in text and 'scancel --signal=TERM "$SLURM_JOB_ID"' in text
    assert 'kill -TERM "$child"' not in text
    # Defect 3: a requeued job appends to its log instead of truncating it.
    assert "#SBATCH --open-mode=append" in text
    node = (out / "node.sh").read_text()
    # Defect 2: torchrun's SIGTERM-to-SIGKILL grace follows grace_seconds (default 30 s).
    assert re.search(r"-m torch\.distributed\.run --standalone --nnodes=1 --nproc-per-node=4 "
                     r"--shutdown-timeout=80 --no-python sh -c '[^']*' \S+ -m ftlm\.cli train", node)
    assert "FTLM_GROUP_ID=g2 FTLM_GROUPS=3" in text
    # All ranks of one start of the group (every node) share one incarnation id.
    assert 'FTLM_INCARNATION="$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}.$(date +%s%N)"' in text
    assert text.index("export FTLM_INCARNATION") < text.index("srun ")
    assert sorted(p.name for p in out.glob("group-*.sbatch")) == [
        "group-g0.sbatch", "group-g1.sbatch", "group-g2.sbatch"]
    assert (out / "token").stat().st_mode & 0o777 == 0o600
    # Regenerating with fewer groups removes the old groups' scripts but keeps the token.
    token = (out / "token").read_text()
    generate(tmp_path, tiny_config(), groups=1)
    assert [p.name for p in out.glob("group-*.sbatch")] == ["group-g0.sbatch"]
    assert (out / "token").read_text() == token


def test_multi_node_group_runs_one_torchrun_per_node_through_c10d(tmp_path, tiny_config):
    out = generate(tmp_path, tiny_config(), groups=2, nodes_per_group=2, ranks_per_group=8,
                   gpus_per_rank=1, rendezvous_port=29555)
    text = (out / "group-g1.sbatch").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text
    assert "#SBATCH --gpus-per-node=4" in text
    assert re.search(r"^srun --nodes=2 --ntasks-per-node=1 .*bash \"\$OUT/node\.sh\" &$", text, re.M)
    node = (out / "node.sh").read_text()
    assert "--standalone" not in node
    assert re.search(r"--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=\"\$FTLM_HEAD:29555\" "
                     r"--rdzv-id=\"\$SLURM_JOB_ID-\$\{SLURM_RESTART_COUNT:-0\}\" --nproc-per-node=4 ", node)
    with pytest.raises(ConfigError, match="multiple of cluster.nodes_per_group"):
        ClusterConfig(nodes_per_group=3, ranks_per_group=4)


FAKE_TORCHRUN = """#!{python}
# Stands in for python on a node: `-m torch.distributed.run ... --no-python PROGRAM...` starts
# PROGRAM once per local rank (as torchrun does); anything else is a trainer, which records the
# metrics port it got and the discovery entry node.sh published for it.
import json, os, subprocess, sys
from pathlib import Path
args = sys.argv[1:]
if args[:2] == ["-m", "torch.distributed.run"]:
    nproc = int(next(a.split("=")[1] for a in args if a.startswith("--nproc-per-node=")))
    program = args[args.index("--no-python") + 1:]
    ranks = [subprocess.Popen(program, env=dict(os.environ, LOCAL_RANK=str(r))) for r in range(nproc)]
    sys.exit(max(p.wait() for p in ranks))
state = Path(os.environ["OUT"]) / "state"
sd = state / f"prometheus-{{os.environ['FTLM_GROUP_ID']}}-node{{os.environ['SLURM_NODEID']}}.json"
record = {{"port": int(os.environ["FTLM_METRICS_PORT"]), "host": os.environ["FTLM_HOST"],
          "args": args, "sd": json.loads(sd.read_text())}}
(Path(os.environ["FAKE_DIR"]) / f"rank-{{os.environ['LOCAL_RANK']}}.json").write_text(json.dumps(record))
"""


def test_group_metrics_get_a_port_per_local_rank_and_a_discovery_entry(tmp_path, tiny_config):
    """With observe.metrics on, node.sh gives each local rank its port (metrics_port + group
    index x ranks per node + local rank: groups may share a node) and publishes them in a
    Prometheus file_sd entry next to the coordinator's, removed when the node's trainers end.
    node.sh runs under bash with a stand-in for python and torchrun."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_TORCHRUN.format(python=sys.executable))
    fake.chmod(0o755)
    config = tiny_config(observe={"metrics": True})
    out = generate(tmp_path, config, groups=3, ranks_per_group=2, metrics_port=9500,
                   python=str(fake))
    env = dict(os.environ, OUT=str(out), FTLM_GROUP_ID="g2", SLURM_NODEID="0",
               FAKE_DIR=str(tmp_path))
    r = subprocess.run(["bash", str(out / "node.sh")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads((tmp_path / f"rank-{i}.json").read_text()) for i in (0, 1)]
    assert [x["port"] for x in records] == [9504, 9505]  # 9500 + 2 groups x 2 ranks before g2
    host = records[0]["host"]
    assert records[0]["sd"] == [{"targets": [f"{host}:9504", f"{host}:9505"],
                                 "labels": {"job": config.run.name}}]
    assert "observe.metrics_host=0.0.0.0" in records[0]["args"]
    assert records[0]["args"][:3] == ["-m", "ftlm.cli", "train"]
    assert not (out / "state" / "prometheus-g2-node0.json").exists()
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", str(out / "node.sh")], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout
    # Metrics off (the default config): no ports, nothing is published.
    out = generate(tmp_path / "off", tiny_config(), metrics_port=9500)
    assert "FTLM_METRICS_PORT" not in (out / "node.sh").read_text()
    assert "FTLM_METRICS_BASE" not in (out / "node.sh").read_text()
    with pytest.raises(ConfigError, match="cluster.metrics_port=65000"):
        generate(tmp_path / "high", config, groups=400, ranks_per_group=2, metrics_port=65000)


FAKE_RETIRED_RANK = """#!{python}
# Stands in for python on a node: torchrun starts PROGRAM once per local rank and exits 1 when
# any rank failed, whatever its status (as torchrun does); a trainer exits with the status
# FAKE_STATUS gives its local rank (a retired rank: ftlm.errors.EXIT_RETIRED).
import os, subprocess, sys
args = sys.argv[1:]
if args[:2] == ["-m", "torch.distributed.run"]:
    nproc = int(next(a.split("=")[1] for a in args if a.startswith("--nproc-per-node=")))
    program = args[args.index("--no-python") + 1:]
    ranks = [subprocess.Popen(program, env=dict(os.environ, LOCAL_RANK=str(r))) for r in range(nproc)]
    sys.exit(1 if any([p.wait() for p in ranks]) else 0)
sys.exit(int(os.environ["FAKE_STATUS"].split(",")[int(os.environ["LOCAL_RANK"])]))
"""


@pytest.mark.parametrize("statuses, retired", [("0,3", True), ("1,1", False)])
def test_node_records_a_rank_retired_for_failing_its_steps_for_the_watcher(tmp_path, tiny_config,
                                                                             statuses, retired):
    """torchrun exits 1 whatever its ranks' status: node.sh records a rank that exited with
    EXIT_RETIRED as state/<g>-<job id>.retired, where the watcher looks (a crash records nothing)."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_RETIRED_RANK.format(python=sys.executable))
    fake.chmod(0o755)
    out = generate(tmp_path, tiny_config(), groups=2, ranks_per_group=2, python=str(fake))
    env = dict(os.environ, OUT=str(out), FTLM_GROUP_ID="g1", SLURM_JOB_ID="100", FAKE_STATUS=statuses)
    r = subprocess.run(["bash", str(out / "node.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert (out / "state" / "g1-100.retired").exists() == retired


FAKE_TORCHRUN_COUNTING_TERMS = """#!/bin/bash
# Stands in for `python -m torch.distributed.run`: counts the SIGTERMs it gets, and exits 1 (as
# torchrun does after its trainers stopped) once a second of quiet follows the first.
trap 'echo TERM >> "$TERMS"' TERM
echo started > "$TERMS.started"
while [ ! -s "$TERMS" ]; do sleep 0.05; done
sleep 1 &
wait $!
exit 1
"""


def test_a_stop_request_reaches_torchrun_once(tmp_path, tiny_config):
    """USR2 makes the batch shell signal the step (``scancel --signal=TERM``): Slurm delivers that
    SIGTERM to every process of the step, node.sh's and torchrun's alike. A second one, passed on
    by node.sh, hit torchrun while it shut down, and torch printed a logging traceback."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_TORCHRUN_COUNTING_TERMS)
    fake.chmod(0o755)
    out = generate(tmp_path, tiny_config(), groups=2, python=str(fake))
    terms = tmp_path / "terms"
    env = dict(os.environ, OUT=str(out), FTLM_GROUP_ID="g0", SLURM_JOB_ID="100",
               TERMS=str(terms))
    node = subprocess.Popen(["bash", str(out / "node.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for(lambda: Path(f"{terms}.started").exists(), 30, "the stand-in torchrun")
        os.killpg(node.pid, signal.SIGTERM)  # what slurmstepd does to the step's processes
        output, _ = node.communicate(timeout=30)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=10)
    assert terms.read_text().splitlines() == ["TERM"], output
    assert node.returncode == 0 and "stopped on request" in output, output


def test_coordinator_job_has_its_own_partition_time_and_signal(tmp_path, tiny_config):
    out = generate(tmp_path, tiny_config(), slurm_partition="gpu", slurm_time="4:00:00",
                   slurm_coordinator_partition="cpu", slurm_coordinator_time="7-00:00:00")
    text = (out / "coordinator.sbatch").read_text()
    assert "#SBATCH --partition=cpu" in text and "#SBATCH --time=7-00:00:00" in text
    assert "#SBATCH --signal=B:USR2@60" in text and "trap on_usr2 USR2" in text
    assert "exec " not in text  # the shell stays to handle the signal
    # Convictions for corruption (quarantines) outlive the coordinator job: the next one reads them.
    assert '--record "$OUT/state/coordinator_record.jsonl"' in text
    group = (out / "group-g0.sbatch").read_text()
    assert "#SBATCH --partition=gpu" in group and "#SBATCH --time=4:00:00" in group
    # Defect 5: the groups reach the coordinator through a relay that re-reads its address file.
    assert "-m ftlm.launch.relay --url-file" in group
    assert 'FTLM_COORDINATOR="http://$FTLM_HEAD:$(cat "$relay_port_file")"' in group
    # Prometheus finds the coordinator wherever it runs (file-based discovery).
    line = next(x for x in text.splitlines() if x.startswith("printf"))
    sd = subprocess.run(["bash", "-c", line.split(" > ")[0]], env=dict(os.environ, PORT="1234"),
                        capture_output=True, text=True, timeout=10).stdout
    assert json.loads(sd)[0]["targets"][0].endswith(":1234")
    assert json.loads(sd)[0]["labels"] == {"job": "run"}
    out2 = generate(tmp_path / "b", tiny_config(), slurm_partition="gpu")
    assert "#SBATCH --partition=gpu" in (out2 / "coordinator.sbatch").read_text()


FAKE_COORDINATOR = """#!{python}
# Stands in for `python -m ftlm.cli coordinator`: records its pid, then the signal that ends it.
import os, signal, sys
from pathlib import Path
here = Path(os.environ["FAKE_DIR"])
def stop(signum, frame):
    (here / "child.signal").write_text(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(here / "child.pid").write_text(str(os.getpid()))
while True:
    signal.pause()
"""


@pytest.mark.parametrize("replaced", [False, True], ids=["own-address", "newer-address"])
def test_coordinator_job_on_usr2_withdraws_its_address_and_stops(tmp_path, tiny_config, replaced):
    """Defect 5: the coordinator job had no signal handling. Slurm's USR2 (--signal=B:USR2@60,
    to the batch shell) now withdraws the address the groups' relays follow (unless a newer
    coordinator already wrote its own), stops the server with SIGTERM and ends the job, so the
    watcher starts a fresh one. Runs the generated script under bash with a stand-in server."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_COORDINATOR.format(python=sys.executable))
    fake.chmod(0o755)
    out = generate(tmp_path, tiny_config(), python=str(fake))
    state = out / "state"
    url_file = state / "coordinator.url"
    env = dict(os.environ, SLURM_JOB_ID="4242", FAKE_DIR=str(tmp_path))
    log_path = tmp_path / "coordinator.log"
    with open(log_path, "w") as log_file:
        shell = subprocess.Popen(["bash", str(out / "coordinator.sbatch")], env=env,
                                 stdout=log_file, stderr=subprocess.STDOUT)
    child = tmp_path / "child.pid"
    try:
        _wait_for(lambda: child.is_file() and url_file.is_file(), 30,
                  "the coordinator job to publish its address and start the server")
        assert url_file.read_text().strip().startswith("http://")
        if replaced:  # a newer coordinator's address is not this job's to withdraw
            url_file.write_text("http://elsewhere:1234\n")
        shell.send_signal(signal.SIGUSR2)
        try:
            shell.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("the coordinator job did not end within 30 s of USR2: "
                                 + log_path.read_text()) from None
    finally:
        if shell.poll() is None:
            shell.kill()
            shell.wait(timeout=10)
        _stop_stand_in(child, fake)
    log = log_path.read_text()
    assert shell.returncode == 0, f"the job ended with {shell.returncode}: {log}"
    assert "USR2 received" in log, log
    assert (tmp_path / "child.signal").read_text() == "SIGTERM", log
    if replaced:
        assert url_file.read_text() == "http://elsewhere:1234\n"
    else:
        assert not url_file.exists(), "the stopped coordinator left its address for the relays"


def _stop_stand_in(pid_file: Path, program: Path) -> None:
    """SIGKILL the stand-in server if a failed job left it running (checked to be ours by its
    command line, so a reused pid is never hit)."""
    try:
        pid = int(pid_file.read_text())
        if str(program) in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
            os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def test_docs_say_how_long_a_requeued_job_waits():
    """Defect 3: a requeued job waits Slurm's job credential lifetime before it may start again
    (120 s by default); the operator reads it in docs/slurm.md, next to the setting."""
    text = (Path(__file__).parents[2] / "docs" / "slurm.md").read_text()
    paragraphs = text.split("\n\n")
    assert any("cred_expire" in p and "120 s" in p for p in paragraphs), \
        "docs/slurm.md does not say that a requeued job waits cred_expire (120 s by default)"


def test_submit_all_forgets_a_previous_run_in_the_same_folder(tmp_path, tiny_config):
    """Defect 3: a stale state/<g>.done made the watcher exit at once and cancel the coordinator."""
    out = generate(tmp_path, tiny_config(), groups=2)
    state = out / "state"
    for name in ("g0.done", "g1.done", "g1.restarts", "STOP", "coordinator.url", "exclude"):
        (state / name).write_text("old\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"  # a stand-in that hands out job ids, so no Slurm is needed
    fake.write_text("#!/bin/bash\nn=$(cat \"$0.n\" 2>/dev/null || echo 100)\n"
                    "echo $((n + 1)) > \"$0.n\"\necho $((n + 1))\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run([str(out / "submit-all.sh"), "--no-watch"], env=env, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    left = sorted(p.name for p in state.iterdir())
    assert left == ["coordinator.jobid", "g0.jobid", "g1.jobid"], left


FAKE_SLURM = {
    # Jobs are files under $FAKE: <id>.state (RUNNING, FAILED, ...) and <id>.nodes.
    "squeue": 'st=$(cat "$FAKE/$3.state" 2>/dev/null); case "$st" in RUNNING|PENDING) echo "$st";; esac\n',
    "scontrol": ('id=$4; [ -f "$FAKE/$id.state" ] || exit 1\n'
                 'echo "JobId=$id JobState=$(cat "$FAKE/$id.state") ReqNodeList=(null) '
                 'NodeList=$(cat "$FAKE/$id.nodes" 2>/dev/null || echo "(null)") ExcNodeList=(null)"\n'),
    "sacct": "exit 0\n",
    "sbatch": ('n=$(cat "$FAKE/next" 2>/dev/null || echo 300); echo $((n + 1)) > "$FAKE/next"\n'
               'echo "$n $*" >> "$FAKE/sbatch.log"; echo RUNNING > "$FAKE/$n.state"; echo "$n"\n'),
    "scancel": 'echo CANCELLED > "$FAKE/$1.state"\n',
}


def test_a_group_retired_for_failing_its_steps_is_resubmitted_away_from_its_nodes(tmp_path, tiny_config):
    """A bad link or device on a node: the coordinator retires the group's process (it exits with
    EXIT_RETIRED, which node.sh records in state/), and the watcher resubmits the group with those
    nodes excluded, for every later group job; a plain crash adds nothing, whatever its log says.
    Fake Slurm commands."""
    out = generate(tmp_path, tiny_config(), groups=2, max_restarts=5)
    fake, bin_dir, state = tmp_path / "fake", tmp_path / "bin", out / "state"
    fake.mkdir()
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)

    def job(jid: int, st: str, nodes: str = "") -> None:
        (fake / f"{jid}.state").write_text(st + "\n")
        if nodes:
            (fake / f"{jid}.nodes").write_text(nodes + "\n")

    job(50, "RUNNING")
    job(100, "FAILED", "gpu[001-002]")
    job(200, "RUNNING")
    for name, jid in (("coordinator", 50), ("g0", 100), ("g1", 200)):
        (state / f"{name}.jobid").write_text(f"{jid}\n")
    (state / "g0-100.retired").touch()  # what node.sh records of a rank that exited with EXIT_RETIRED
    (out / "logs" / "g0-300.log").write_text(  # the watcher reads no log
        "ftlm: error: replica g0:c3d4 was retired: its link to the others (or its device) "
        "fails the steps it takes part in\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE=str(fake), FTLM_WATCH_INTERVAL="0.1")
    log_path = tmp_path / "watch.log"
    watcher = subprocess.Popen([str(out / "watch.sh")], env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    submitted = fake / "sbatch.log"
    try:
        _wait_for(lambda: submitted.is_file(), 30, "the watcher to resubmit g0")
        job(300, "FAILED", "gpu007")  # the new g0 job crashes (no retirement): its node stays usable
        _wait_for(lambda: len(submitted.read_text().splitlines()) >= 2, 30, "the watcher to resubmit g0 again")
        (state / "STOP").touch()
        watcher.wait(timeout=30)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait(timeout=10)
    log = log_path.read_text()
    lines = submitted.read_text().splitlines()
    assert lines[0] == f"300 --parsable --exclude=gpu[001-002] {out}/group-g0.sbatch", log
    assert lines[1] == f"301 --parsable --exclude=gpu[001-002] {out}/group-g0.sbatch", log
    assert (state / "exclude").read_text() == "gpu[001-002]\n"
    assert "g0: job 100 was retired for failing its steps on gpu[001-002]; later group jobs avoid them" in log
    assert "job 300 was retired" not in log


def _fake_slurm(tmp_path: Path) -> tuple[Path, dict]:
    """FAKE_SLURM's commands on PATH, their jobs under tmp_path/fake; returns (fake, env)."""
    fake, bin_dir = tmp_path / "fake", tmp_path / "bin"
    fake.mkdir()
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return fake, dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE=str(fake))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped: its parent is the shell that started it) is gone too.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _new_watcher(state: Path, known: list[int]) -> int | None:
    """The pid in state/watch.pid once it names a watcher not in ``known``."""
    text = (state / "watch.pid").read_text().strip() if (state / "watch.pid").is_file() else ""
    return int(text) if text and int(text) not in known else None


def test_one_watcher_per_job_across_stop_and_submit(tmp_path, tiny_config):
    """``stop-all.sh`` then ``submit-all.sh``: the first watcher must not live on beside the
    second (both would resubmit the same failed group), and a watcher started by hand while
    one runs refuses to start. Fake Slurm commands."""
    out = generate(tmp_path, tiny_config(), groups=2)
    fake, env = _fake_slurm(tmp_path)
    env["FTLM_WATCH_INTERVAL"] = "30"  # the first watcher sleeps through stop-all's STOP file
    state = out / "state"
    pids = []
    try:
        for _ in range(2):
            r = subprocess.run([str(out / "submit-all.sh")], env=env, capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            pids.append(_wait_for(lambda: _new_watcher(state, pids), 30, "a watcher to start"))
            if len(pids) == 1:
                r = subprocess.run([str(out / "stop-all.sh")], env=env, capture_output=True,
                                   text=True, timeout=60)
                assert r.returncode == 0, r.stderr
        first, second = pids
        _wait_for(lambda: not _alive(first), 15, f"the first watcher (pid {first}) to end")
        assert _alive(second)
        r = subprocess.run([str(out / "watch.sh")], env=dict(env, FTLM_WATCH_LOCK_WAIT="1"),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "another watcher" in r.stdout + r.stderr, r.stdout + r.stderr
        assert _alive(second)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


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


@pytest.mark.timeout(600)
def test_cancelled_group_is_resubmitted_rejoins_and_replicas_match(tmp_path, tiny_config, slurm):
    steps = 1000
    # The resubmitted g1 must recover from g0, not resume from disk: on a loaded machine g0 may
    # reach the last step (always made durable) before g1's new job starts, and g1 would then
    # resume at the final step with nothing to recover. Without resuming it pulls from g0, which
    # waits for it at the end for up to ft.quorum_timeout.
    config = tiny_config(train={"steps": steps}, checkpoint={"resume": False},
                         ft={"quorum_timeout": 180.0, "give_up_seconds": 240.0})
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
        assert watcher.wait(timeout=480) == 0, (tmp_path / "watch.log").read_text()
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


@pytest.mark.slow  # about 50 s: two groups, a stop, and a requeue that waits cred_expire
@pytest.mark.timeout(300)
def test_usr2_stops_the_step_gracefully_and_the_requeued_job_appends_its_log(
        tmp_path, tiny_config, slurm):
    """Defects 1-3 on a real Slurm: the USR2 that Slurm sends before a time limit or a preemption
    reaches the trainers as SIGTERM; they finish their step, leave the quorum and exit (the
    task ends 0 and writes group_exit, no SIGKILL), the job requeues itself, and its log keeps
    the first incarnation's lines. Meanwhile the healthy group keeps committing."""
    config = tiny_config(train={"steps": 100000})
    run_dir = config.run.path
    # 2 ranks per group: every rank of a start shares the incarnation the script exports.
    out = generate(tmp_path, config, groups=2, ranks_per_group=2, python=sys.executable,
                   slurm_cpus_per_rank=1, coordinator_port=_port(), grace_seconds=30)
    env = slurm.env
    subprocess.run([str(out / "submit-all.sh"), "--no-watch"], check=True, env=env, timeout=60)
    try:
        g1_job = (out / "state" / "g1.jobid").read_text().strip()
        _wait_for(lambda: any(e["kind"] == "commit" and e["group"] == "g1" and e["step"] >= 5
                              for e in _events(run_dir)), 120, "g1 to commit step 5")
        subprocess.run(["scancel", "--signal=USR2", "--batch", g1_job], check=True, env=env,
                       timeout=30)
        exit_event = _wait_for(lambda: next((e for e in _events(run_dir) if e["kind"] == "group_exit"
                                             and e["group"] == "g1"), None), 60, "g1's group_exit")
        assert exit_event["ok"]
        log = out / "logs" / f"g1-{g1_job}.log"
        _wait_for(lambda: "trainers stopped on request" in log.read_text(), 60,
                  "the step's task to end on request")
        # The healthy group keeps committing after g1 left (it does not wait for a timeout).
        left_at = exit_event["ts"]
        _wait_for(lambda: any(e["kind"] == "commit" and e["group"] == "g0" and e["ts"] > left_at + 1
                              for e in _events(run_dir)), 60, "g0 to commit after g1 left")
        # The requeued job (same id, after the credential lifetime) starts a new incarnation.
        _wait_for(lambda: sum(e["kind"] == "group_start" and e["group"] == "g1"
                              for e in _events(run_dir)) >= 2, 120, "the requeued g1 to start")
        _wait_for(lambda: any(e["kind"] == "recovery_end" and e["group"] == "g1" and e["ts"] > left_at
                              for e in _events(run_dir)), 120, "the requeued g1 to recover")
        times = sorted(e["ts"] for e in _events(run_dir) if e["kind"] == "commit"
                       and e["group"] == "g0" and left_at - 5 < e["ts"] < left_at + 5)
        gaps = [b - a for a, b in zip(times, times[1:])]
        print(f"g1 stopped gracefully: longest gap between g0's commits around it "
              f"{max(gaps):.2f} s, median {sorted(gaps)[len(gaps) // 2]:.3f} s")
        text = log.read_text()
        assert "USR2 received" in text and "requeueing" in text, text[-3000:]
        assert "SIGKILL" not in text and "Killed" not in text, text[-3000:]
        # SIGTERM reached torchrun once: a second one, while it shut down, made torch's logging
        # print a traceback of its own. (torchrun reports the one it got as a SignalException.)
        assert "Logging error" not in text, text[-3000:]
        assert text.count("got signal: 15") == 1, text[-3000:]
        # The snapshot server's end on it is no error.
        assert "error: the snapshot server process" not in text, text[-3000:]
    finally:
        subprocess.run([str(out / "stop-all.sh")], env=env, timeout=60, check=False)


@pytest.mark.slow  # about a minute: a coordinator killed and resubmitted under a running job
@pytest.mark.timeout(300)
def test_groups_follow_a_resubmitted_coordinator_to_its_new_address(tmp_path, tiny_config, slurm):
    """Defect 5: the groups read the coordinator's address once. Here the coordinator job is
    cancelled and the watcher resubmits it at another address (another port: one node here,
    another node on a real cluster); the groups keep their processes, reach the new one through
    their relay, and no step is lost. Prints the stall it caused."""
    config = tiny_config(train={"steps": 100000})
    run_dir = config.run.path
    out = generate(tmp_path, config, groups=2, python=sys.executable, slurm_cpus_per_rank=1,
                   coordinator_port=_port(), watch_interval=1, grace_seconds=30)
    env = dict(slurm.env, FTLM_WATCH_INTERVAL="1")
    subprocess.run([str(out / "submit-all.sh"), "--no-watch"], check=True, env=env, timeout=60)
    url_file = out / "state" / "coordinator.url"
    # The watcher resubmits with another port: the new coordinator has another address.
    watcher = subprocess.Popen([str(out / "watch.sh")], env=dict(env, FTLM_COORDINATOR_PORT=str(_port())),
                               stdout=open(tmp_path / "watch.log", "w"), stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: all(any(e["kind"] == "commit" and e["group"] == g and e["step"] >= 5
                                  for e in _events(run_dir)) for g in ("g0", "g1")), 120,
                  "both groups to commit step 5")
        first_url = url_file.read_text().strip()
        subprocess.run(["scancel", (out / "state" / "coordinator.jobid").read_text().strip()],
                       check=True, env=env, timeout=30)
        killed_at = time.time()
        _wait_for(lambda: url_file.is_file() and url_file.read_text().strip() not in ("", first_url),
                  90, "the resubmitted coordinator's new address")
        before = max(e["step"] for e in _events(run_dir) if e["kind"] == "commit" and e["ts"] <= killed_at)
        _wait_for(lambda: all(any(e["kind"] == "commit" and e["group"] == g and e["step"] >= before + 10
                                  for e in _events(run_dir)) for g in ("g0", "g1")), 120,
                  "both groups to commit 10 more steps through the new coordinator")
        # The new coordinator knows both groups (from their heartbeats through the relays).
        import urllib.request
        new_url = url_file.read_text().strip()
        request = urllib.request.Request(f"{new_url}/status", headers={
            "Authorization": f"Bearer {(out / 'token').read_text().strip()}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            status = json.loads(answer.read())
        assert {m["group"] for m in status["members"]} == {"g0", "g1"}, status
    finally:
        subprocess.run([str(out / "stop-all.sh")], env=env, timeout=60, check=False)
        watcher.wait(timeout=60)
    events = _events(run_dir)
    # Nobody restarted: the same processes kept training, with every step committed once.
    assert [e["group"] for e in events if e["kind"] == "group_start"].count("g0") == 1
    assert [e["group"] for e in events if e["kind"] == "group_start"].count("g1") == 1
    committed = sorted({e["step"] for e in events if e["kind"] == "commit"})
    assert committed == list(range(committed[0], committed[-1] + 1)), "a step was lost"
    times = sorted(e["ts"] for e in events if e["kind"] == "commit" and e["group"] == "g0")
    gaps = [b - a for a, b in zip(times, times[1:]) if b > killed_at - 1]
    print(f"coordinator moved: longest gap between g0's commits {max(gaps):.1f} s "
          f"(median {sorted(gaps)[len(gaps) // 2]:.2f} s; watch interval 1 s)")


@pytest.mark.slow  # about 40 s: two groups trained until each rank's metrics answer
@pytest.mark.timeout(300)
def test_group_metrics_are_served_where_the_discovery_entries_say(tmp_path, tiny_config, slurm):
    """What a Prometheus with file_sd on state/prometheus-*.json scrapes: every group's entry
    names its node's address and the port its rank serves on, with the run's job label."""
    import urllib.request
    config = tiny_config(train={"steps": 100000}, observe={"metrics": True})
    run_dir = config.run.path
    out = generate(tmp_path, config, groups=2, python=sys.executable, slurm_cpus_per_rank=1,
                   coordinator_port=_port(), metrics_port=_free_run(2))
    env = slurm.env
    subprocess.run([str(out / "submit-all.sh"), "--no-watch"], check=True, env=env, timeout=60)
    try:
        _wait_for(lambda: all(any(e["kind"] == "commit" and e["group"] == g and e["step"] >= 3
                                  for e in _events(run_dir)) for g in ("g0", "g1")), 120,
                  "both groups to commit step 3")
        for g in ("g0", "g1"):
            (entry,) = json.loads((out / "state" / f"prometheus-{g}-node0.json").read_text())
            assert entry["labels"] == {"job": config.run.name}
            (target,) = entry["targets"]
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as answer:
                text = answer.read().decode()
            series = [line for line in text.splitlines()
                      if line.startswith("ftlm_train_steps_committed_total{")]
            assert series and f'group="{g}"' in series[0] and \
                f'job="{config.run.name}"' in series[0], text[:2000]
    finally:
        subprocess.run([str(out / "stop-all.sh")], env=env, timeout=60, check=False)


def _free_run(n: int) -> int:
    """A port p with p .. p + n - 1 all free now, below the ephemeral range (where the next
    port of a free one is often some connection's)."""
    import random
    import socket
    for _ in range(200):
        base = random.randrange(20000, 30000 - n)
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no run of {n} free ports in 20000-30000")


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
