"""Slurm batch scripts for a fault-tolerant job (``ftlm launch slurm``).

``generate_slurm`` writes, into one folder on the shared file system:

* ``coordinator.sbatch``: the coordinator, on its own partition and time limit; it publishes its
  URL in ``state/coordinator.url`` (and a Prometheus file_sd entry), and on ``USR2`` withdraws it
  and stops so that the watcher starts a fresh one;
* ``group-<g>.sbatch``: one requeueable job per replica group of ``nodes_per_group`` nodes. It
  starts a relay (``ftlm.launch.relay``) that follows ``state/coordinator.url``, then ``srun`` of
  ``node.sh`` on every node; on ``USR2`` (sent ``grace_seconds`` before the time limit or a
  preemption) it signals the step's tasks with SIGTERM (never ``srun`` itself), the trainers
  finish their step, leave the quorum and exit, and the job requeues itself, appending to its log;
* ``node.sh``: torchrun on one node (``--standalone``, or c10d rendezvous on the first node of a
  multi-node group) with ``--shutdown-timeout`` inside the grace; it records a rank the
  coordinator retired for failing its steps (``EXIT_RETIRED``) as ``state/<g>-<job id>.retired``
  for the watcher; with ``observe.metrics`` on it gives each local rank its metrics port and
  publishes them in ``state/prometheus-<g>-node<n>.json`` (Prometheus file_sd);
* ``watch.sh``: polls squeue/scontrol/sacct and resubmits a group (or the coordinator) whose job
  ended with a failure, at most ``max_restarts`` times each; ends when the job is done;
* ``submit-all.sh`` (forgets a previous run's state in the folder) and ``stop-all.sh``; both
  stop the job's watcher if one runs (one watcher per job: ``state/watch.lock``);
  ``config.toml`` and ``token`` (mode 600).

It only writes text; it does not call Slurm (docs/slurm.md shows the commands).
"""

from __future__ import annotations

import json
import secrets
import shlex
from pathlib import Path

from ftlm.config import RunConfig
from ftlm.errors import EXIT_RETIRED, ConfigError
from ftlm.launch.cluster_config import ClusterConfig
from ftlm.launch.slurm_watch import WATCH_SCRIPT

MAX_EXCLUDED = 16
"""Entries (hostlists of retired groups' jobs) the watcher's ``state/exclude`` keeps at most: past
that a bad cluster would exclude so many nodes that the groups could not be placed."""


def _header(cluster: ClusterConfig, job: str, out: Path, log_name: str, *, partition: str,
            time_limit: str) -> list[str]:
    # %j, not %j-%r: a requeued job keeps its id, and --open-mode=append keeps the log of the
    # incarnations before it (Slurm truncates the file by default).
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job}", f"#SBATCH --time={time_limit}",
             f"#SBATCH --output={out}/logs/{log_name}-%j.log", "#SBATCH --open-mode=append"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if cluster.slurm_account:
        lines.append(f"#SBATCH --account={cluster.slurm_account}")
    return lines


def _setup(cluster: ClusterConfig, workdir: Path) -> list[str]:
    lines = ["set -uo pipefail", f"cd {shlex.quote(str(workdir))} || exit 3"]
    if cluster.slurm_setup:
        lines.append(cluster.slurm_setup.rstrip("\n"))
    return lines


def _sd_entry(job: str) -> str:
    """Shell words that print a Prometheus file_sd entry for this host's coordinator port."""
    before, after = json.dumps([{"targets": ["@HOST@"], "labels": {"job": job}}]).split("@HOST@")
    return f'{shlex.quote(before)}"$(hostname):${{PORT}}"{shlex.quote(after)}'


def coordinator_script(run: RunConfig, cluster: ClusterConfig, out: Path, workdir: Path) -> str:
    """The coordinator job: its own partition and time limit, and on USR2 (near its time limit
    or a preemption) it withdraws its address, stops, and leaves the restart to the watcher
    (a fresh job starts at once; a requeued one would wait Slurm's credential lifetime)."""
    job = cluster.job_name(run.run.name)
    q = shlex.quote
    lines = _header(cluster, f"{job}-coordinator", out, "coordinator",
                    partition=cluster.slurm_coordinator_partition or cluster.slurm_partition,
                    time_limit=cluster.slurm_coordinator_time or cluster.slurm_time) + [
        "#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --cpus-per-task=2",
        "#SBATCH --requeue", "#SBATCH --signal=B:USR2@60", ""] + _setup(cluster, workdir) + [
        f"OUT={q(str(out))}",
        "# FTLM_COORDINATOR_PORT (in the environment of sbatch) overrides the configured port.",
        f"PORT=${{FTLM_COORDINATOR_PORT:-{cluster.coordinator_port}}}",
        "url_file=\"$OUT/state/coordinator.url\"",
        "child=",
        "# shellcheck disable=SC2317  # called by the trap",
        "on_usr2() {",
        "  # Withdraw the address first: the groups' relays stop connecting here and wait for the",
        "  # next coordinator, which rebuilds its state from their heartbeats.",
        "  echo \"ftlm: USR2 received, the coordinator stops; the watcher starts another\" >&2",
        "  [ \"$(cat \"$url_file\" 2>/dev/null)\" = \"$url\" ] && rm -f \"$url_file\"",
        "  if [ -n \"$child\" ]; then kill -TERM \"$child\" 2>/dev/null || true; fi",
        "}",
        "trap on_usr2 USR2",
        "url=\"http://$(hostname):${PORT}\"",
        "# Written before the server starts: a group's relay retries until it answers.",
        "echo \"$url\" > \"$url_file.tmp.$SLURM_JOB_ID\"",
        "mv \"$url_file.tmp.$SLURM_JOB_ID\" \"$url_file\"",
        "# Prometheus file-based discovery of the coordinator (follows it when it moves).",
        f"printf '%s\\n' {_sd_entry(run.run.name)} "
        "> \"$OUT/state/prometheus-coordinator.json.tmp\"",
        "mv \"$OUT/state/prometheus-coordinator.json.tmp\" \"$OUT/state/prometheus-coordinator.json\"",
        f'{cluster.python} -m ftlm.cli coordinator "$OUT/config.toml" --host 0.0.0.0 '
        f'--port "$PORT" --record "$OUT/state/coordinator_record.jsonl" --set ft.token_file="$OUT/token" '
        f'{" ".join(f"--set {s}" for s in cluster.ft_settings())} &',
        "child=$!",
        "while :; do",
        "  wait \"$child\"",
        "  rc=$?",
        "  kill -0 \"$child\" 2>/dev/null || break",
        "done",
        "exit \"$rc\"",
    ]
    return "\n".join(lines) + "\n"


def group_metrics(run: RunConfig, cluster: ClusterConfig) -> bool:
    """Whether the group scripts place the trainers' metrics: the config turns them on
    (``observe.metrics``) and ``cluster.metrics_port`` gives their ports."""
    return bool(run.observe.metrics and cluster.metrics_port)


def _torchrun(run: RunConfig, cluster: ClusterConfig, run_dir: Path) -> str:
    """The command each node of a group runs (one srun task per node)."""
    q = shlex.quote
    if cluster.nodes_per_group == 1:
        placement = "--standalone --nnodes=1"
    else:  # every node meets at the first node's c10d store; a new id per (re)start
        placement = (f"--nnodes={cluster.nodes_per_group} --rdzv-backend=c10d "
                     f"--rdzv-endpoint=\"$FTLM_HEAD:{cluster.rendezvous_port}\" "
                     "--rdzv-id=\"$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}\"")
    train = (f"-m ftlm.cli train \"$OUT/config.toml\" --set ft.coordinator= "
             f"--set run.dir={q(str(run_dir))} --set observe.progress=false")
    metrics = ""
    if group_metrics(run, cluster):
        # Each process serves on its node's base port + LOCAL_RANK (the ports node.sh publishes);
        # global ranks come in c10d's arrival order, so they cannot name the port.
        metrics = "export FTLM_METRICS_PORT=$((FTLM_METRICS_BASE + LOCAL_RANK)); "
        train += " --set observe.metrics_host=0.0.0.0"
    # A rank that the coordinator retired for failing its steps exits with EXIT_RETIRED, but
    # torchrun exits 1 whatever its ranks' status: sh records it in state/ for the watcher
    # (``avoid_nodes``). Its trap defers the SIGTERM that torchrun sends the rank's process
    # group (the trainer gets it too and stops) until the trainer has exited.
    record = (f"trap : TERM; \"$0\" \"$@\"; rc=$?; if [ \"$rc\" = {EXIT_RETIRED} ]; then "
              ": > \"$OUT/state/$FTLM_GROUP_ID-$SLURM_JOB_ID.retired\"; fi; exit \"$rc\"")
    program = f"--no-python sh -c '{metrics}{record}' {cluster.python} {train}"
    return (f"{cluster.python} -m torch.distributed.run {placement} "
            f"--nproc-per-node={cluster.ranks_per_node} "
            f"--shutdown-timeout={cluster.shutdown_timeout} {program}")


def _metrics_lines(run: RunConfig, cluster: ClusterConfig) -> list[str]:
    """node.sh lines that pick this node's metrics ports and publish them for Prometheus
    (file-based discovery, next to the coordinator's entry)."""
    if not group_metrics(run, cluster):
        return []
    labels, rpn = shlex.quote(json.dumps({"job": run.run.name})), cluster.ranks_per_node
    return [
        "# Metrics: local rank l of group g<i> serves on metrics_port + i x ranks_per_node + l,",
        "# so that groups sharing a node do not collide; this node's entry tells Prometheus.",
        f"export FTLM_METRICS_BASE=$(({cluster.metrics_port} + ${{FTLM_GROUP_ID#g}} * {rpn}))",
        "sd_file=\"$OUT/state/prometheus-$FTLM_GROUP_ID-node${SLURM_NODEID:-0}.json\"",
        "targets=",
        f"for l in $(seq 0 {rpn - 1}); do",
        "  targets=\"$targets${targets:+, }\\\"$FTLM_HOST:$((FTLM_METRICS_BASE + l))\\\"\"",
        "done",
        f"printf '[{{\"targets\": [%s], \"labels\": %s}}]\\n' \"$targets\" {labels} > \"$sd_file.tmp\"",
        "mv \"$sd_file.tmp\" \"$sd_file\"",
    ]


def node_script(run: RunConfig, cluster: ClusterConfig, workdir: Path) -> str:
    """``node.sh``: what ``srun`` runs on each node of a group: torchrun, at this node's address.

    On SIGTERM (the batch shell's stop request reaches every process of the step, torchrun's
    too, once: node.sh does not pass it on) torchrun passes it to the trainers and, once they
    have finished their step and left, exits with an error of its own; a stop that was asked
    for ends the task with 0 instead, so that ``--kill-on-bad-exit`` does not SIGKILL the
    group's other nodes still saving.
    """
    run_dir = run.run.path if run.run.path.is_absolute() else workdir / run.run.path
    return "\n".join([
        "#!/bin/bash",
        "# One node of a replica group (started by group-<g>.sbatch through srun, which passes",
        "# OUT, FTLM_COORDINATOR, FTLM_GROUP_ID, FTLM_GROUPS, FTLM_TOKEN and FTLM_HEAD).",
        "set -uo pipefail",
        # Other groups reach this node's rendezvous store and state server at its address.
        "FTLM_HOST=$(hostname -I 2>/dev/null | awk '{print $1}')",
        "export FTLM_HOST=\"${FTLM_HOST:-127.0.0.1}\"",
        *_metrics_lines(run, cluster),
        "stopped=0",
        "# Slurm signals every process of the step (scancel --signal=TERM), torchrun included:",
        "# passed on a second time, the SIGTERM would hit torchrun while it shuts down.",
        "trap 'stopped=1' TERM",
        "# shellcheck disable=SC2016  # sh expands it in each rank's process",
        _torchrun(run, cluster, run_dir) + " &",
        "pid=$!",
        "while :; do wait \"$pid\"; rc=$?; kill -0 \"$pid\" 2>/dev/null || break; done",
        *(["rm -f \"$sd_file\"  # nothing serves there any more"] if group_metrics(run, cluster) else []),
        "if [ \"$stopped\" = 1 ]; then",
        "  echo \"ftlm: trainers stopped on request (torchrun: $rc)\" >&2",
        "  exit 0",
        "fi",
        "exit \"$rc\"",
    ]) + "\n"


def group_script(run: RunConfig, cluster: ClusterConfig, out: Path, workdir: Path,
                 group: str) -> str:
    job = cluster.job_name(run.run.name)
    q = shlex.quote
    nodes = cluster.nodes_per_group
    gpus = [f"#SBATCH --gpus-per-node={cluster.gpus_per_node}"] if cluster.gpus_per_node else []
    cpus = cluster.ranks_per_node * cluster.slurm_cpus_per_rank
    lines = _header(cluster, f"{job}-{group}", out, group, partition=cluster.slurm_partition,
                    time_limit=cluster.slurm_time) + [
        f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", f"#SBATCH --cpus-per-task={cpus}",
        *gpus,
        "#SBATCH --requeue",
        # B: deliver USR2 to this batch shell, whose trap signals the training step.
        f"#SBATCH --signal=B:USR2@{cluster.grace_seconds}", ""] + _setup(cluster, workdir) + [
        f"OUT={q(str(out))}",
        "url_file=\"$OUT/state/coordinator.url\"",
        "# Bounded wait for the coordinator's first address (its job may still be pending).",
        "for _ in $(seq 600); do [ -s \"$url_file\" ] && break; sleep 1; done",
        "if [ ! -s \"$url_file\" ]; then",
        "  echo \"ftlm: no coordinator URL in $url_file after 600 s\" >&2",
        "  exit 3",
        "fi",
        "FTLM_HEAD=$(scontrol show hostnames \"${SLURM_JOB_NODELIST:-$(hostname)}\" 2>/dev/null | head -n 1)",
        "FTLM_HEAD=${FTLM_HEAD:-$(hostname)}",
        "# The coordinator may move to another node: a relay on this node re-reads its address",
        "# file for every connection, so the trainers keep one URL for their whole life.",
        "relay_port_file=\"$OUT/state/relay-$SLURM_JOB_ID.port\"",
        "rm -f \"$relay_port_file\"",
        f"{cluster.python} -m ftlm.launch.relay --url-file \"$url_file\" --port-file \"$relay_port_file\" &",
        "relay=$!",
        "for _ in $(seq 300); do",
        "  [ -s \"$relay_port_file\" ] && break",
        "  kill -0 \"$relay\" 2>/dev/null || break",
        "  sleep 0.2",
        "done",
        "if [ ! -s \"$relay_port_file\" ]; then",
        "  echo \"ftlm: the coordinator relay did not start\" >&2",
        "  exit 3",
        "fi",
        "FTLM_COORDINATOR=\"http://$FTLM_HEAD:$(cat \"$relay_port_file\")\"",
        "FTLM_TOKEN=$(cat \"$OUT/token\")",
        "export OUT FTLM_COORDINATOR FTLM_TOKEN FTLM_HEAD",
        f"export FTLM_GROUP_ID={group} FTLM_GROUPS={cluster.groups}",
        "export PYTHONUNBUFFERED=1",
        "# One incarnation id for every rank of this start of the group, on every node (a",
        "# process that drew its own would not find itself in the quorum's member list).",
        "FTLM_INCARNATION=\"$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}.$(date +%s%N)\"",
        "export FTLM_INCARNATION",
        "",
        "stopping=0",
        "child=",
        "# shellcheck disable=SC2317  # called by the trap",
        "on_usr2() {",
        "  # The time limit or a preemption is near: the trainers finish their step, leave the",
        "  # quorum and exit; then requeue. Signal the step's tasks, never srun itself (a",
        "  # signalled srun ends the step at once and its tasks die with SIGKILL).",
        "  stopping=1",
        "  echo \"ftlm: USR2 received, asking the trainers to stop\" >&2",
        "  scancel --signal=TERM \"$SLURM_JOB_ID\" 2>/dev/null || true",
        "}",
        "trap on_usr2 USR2",
        "",
        f"srun --nodes={nodes} --ntasks-per-node=1 --cpus-per-task={cpus} --kill-on-bad-exit=1 "
        "bash \"$OUT/node.sh\" &",
        "child=$!",
        "# wait returns early (status > 128) when the trap runs: wait again for the real status.",
        "while :; do",
        "  wait \"$child\"",
        "  rc=$?",
        "  kill -0 \"$child\" 2>/dev/null || break",
        "done",
        "kill \"$relay\" 2>/dev/null",
        "rm -f \"$relay_port_file\"",
        "if [ \"$stopping\" = 1 ]; then",
        "  echo \"ftlm: stopped with status $rc; requeueing $SLURM_JOB_ID\" >&2",
        "  scontrol requeue \"$SLURM_JOB_ID\"",
        "  exit 0",
        "fi",
        "exit \"$rc\"",
    ]
    return "\n".join(lines) + "\n"


STOP_WATCHER = """\
# Stop this job's watcher, if one runs: it holds state/watch.lock and wrote its pid and host in
# state/watch.pid and state/watch.host (a free lock means none runs, whatever the files say; a
# pid is only signalled on its own host).
if [ -s "$OUT/state/watch.pid" ] && ! flock -n "$OUT/state/watch.lock" true 2>/dev/null; then
  watcher=$(cat "$OUT/state/watch.pid")
  where=$(cat "$OUT/state/watch.host" 2>/dev/null)
  if [ "$where" = "$(hostname)" ]; then
    kill -TERM "$watcher" 2>/dev/null || true
  else
    echo "ftlm: the watcher runs on $where (pid $watcher): stop it there" >&2
  fi
  for _ in $(seq 100); do kill -0 "$watcher" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$watcher" 2>/dev/null; then
    echo "ftlm: the watcher (pid $watcher) did not stop within 10 s" >&2
  fi
fi
"""


def submit_script(cluster: ClusterConfig, out: Path) -> str:
    groups = " ".join(cluster.group_names())
    return f"""#!/bin/bash
# Submit the coordinator and every replica group, then start the watcher in the background
# (pass --no-watch to run ./watch.sh yourself).
set -euo pipefail
OUT={shlex.quote(str(out))}
mkdir -p "$OUT/state" "$OUT/logs"
{STOP_WATCHER}# A new job in an old folder: forget the last one's addresses, restarts and finished groups
# (a stale g<i>.done would make the watcher end at once and cancel the coordinator).
rm -f "$OUT/state/coordinator.url" "$OUT/state/STOP" "$OUT/state/"*.restarts "$OUT/state/exclude" \\
  "$OUT/state/"*.done "$OUT/state/"*.retired "$OUT/state/"relay-*.port "$OUT/state/"prometheus-g*.json
sbatch --parsable "$OUT/coordinator.sbatch" > "$OUT/state/coordinator.jobid"
for g in {groups}; do
  sbatch --parsable "$OUT/group-$g.sbatch" > "$OUT/state/$g.jobid"
done
echo "coordinator: job $(cat "$OUT/state/coordinator.jobid")"
for g in {groups}; do echo "group $g: job $(cat "$OUT/state/$g.jobid")"; done
if [ "${{1:-}}" != "--no-watch" ]; then
  nohup "$OUT/watch.sh" >> "$OUT/logs/watch.log" 2>&1 &
  echo "watcher: pid $!, log $OUT/logs/watch.log"
fi
"""


def stop_script(cluster: ClusterConfig, out: Path) -> str:
    return f"""#!/bin/bash
# Stop the job on purpose: the watcher resubmits nothing after this (and is stopped), then
# cancel every job.
set -uo pipefail
OUT={shlex.quote(str(out))}
touch "$OUT/state/STOP"
{STOP_WATCHER}for f in "$OUT/state/"*.jobid; do
  [ -s "$f" ] && scancel "$(cat "$f")"
done
exit 0
"""


def watch_script(cluster: ClusterConfig, out: Path) -> str:
    settings = "\n".join([
        f"OUT={shlex.quote(str(out))}",
        f"GROUPS_LIST=({' '.join(cluster.group_names())})",
        f"MAX_RESTARTS={cluster.max_restarts}",
        f"MAX_EXCLUDED={MAX_EXCLUDED}",
        f"INTERVAL=${{FTLM_WATCH_INTERVAL:-{cluster.watch_interval}}}",
    ])
    return WATCH_SCRIPT.replace("# @SETTINGS@", settings)


def generate_slurm(run_config: RunConfig, cluster: ClusterConfig, out_dir: Path,
                   config_toml: str, workdir: Path | None = None) -> list[Path]:
    """Write the job's scripts under ``out_dir``; ``workdir`` (default: the current directory)
    is where relative paths of the config (data, run directory) resolve on the nodes."""
    if group_metrics(run_config, cluster):
        last = cluster.metrics_port + len(cluster.group_names()) * cluster.ranks_per_node - 1
        if last > 65535:
            raise ConfigError(f"cluster.metrics_port={cluster.metrics_port}: the groups' metrics "
                              f"ports would run to {last} (one per group x rank of a node); "
                              "pick a lower port")
    out = Path(out_dir).resolve()
    workdir = (workdir or Path.cwd()).resolve()
    (out / "state").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    for old in out.glob("group-*.sbatch"):  # a regeneration with fewer groups
        old.unlink()
    files: dict[str, str] = {
        "config.toml": config_toml,
        "coordinator.sbatch": coordinator_script(run_config, cluster, out, workdir),
        "node.sh": node_script(run_config, cluster, workdir),
        "submit-all.sh": submit_script(cluster, out),
        "stop-all.sh": stop_script(cluster, out),
        "watch.sh": watch_script(cluster, out),
    }
    for g in cluster.group_names():
        files[f"group-{g}.sbatch"] = group_script(run_config, cluster, out, workdir, g)
    written = []
    for name, text in files.items():
        path = out / name
        path.write_text(text)
        path.chmod(0o755 if name.endswith((".sh", ".sbatch")) else 0o644)
        written.append(path)
    token = out / "token"
    if not token.exists():  # keep the token of a job that may still be running
        token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    written.append(token)
    return written
