"""Slurm batch scripts for a fault-tolerant job (``ftlm launch slurm``).

``generate_slurm`` writes, into one folder on the shared file system:

* ``coordinator.sbatch``: the coordinator; it publishes its URL in ``state/coordinator.url``;
* ``group-<g>.sbatch``: one requeueable job per replica group, ``srun`` of torchrun with one
  process per rank; on ``USR2`` (sent ``grace_seconds`` before the time limit or a preemption) it
  forwards SIGTERM to the trainer, which finishes its step and saves, then requeues itself;
* ``watch.sh``: polls squeue/scontrol/sacct and resubmits a group (or the coordinator) whose job
  ended with a failure, at most ``max_restarts`` times each; ends when the job is done;
* ``submit-all.sh`` and ``stop-all.sh``; ``config.toml`` and ``token`` (mode 600).

It only writes text; it does not call Slurm (docs/slurm.md shows the commands).
"""

from __future__ import annotations

import secrets
import shlex
from pathlib import Path

from ftlm.config import RunConfig
from ftlm.launch.cluster_config import ClusterConfig
from ftlm.launch.slurm_watch import WATCH_SCRIPT


def _header(cluster: ClusterConfig, job: str, out: Path, log_name: str) -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={job}", f"#SBATCH --time={cluster.slurm_time}",
             f"#SBATCH --output={out}/logs/{log_name}-%j.log"]
    if cluster.slurm_partition:
        lines.append(f"#SBATCH --partition={cluster.slurm_partition}")
    if cluster.slurm_account:
        lines.append(f"#SBATCH --account={cluster.slurm_account}")
    return lines


def _setup(cluster: ClusterConfig, workdir: Path) -> list[str]:
    lines = ["set -uo pipefail", f"cd {shlex.quote(str(workdir))} || exit 3"]
    if cluster.slurm_setup:
        lines.append(cluster.slurm_setup.rstrip("\n"))
    return lines


def coordinator_script(run: RunConfig, cluster: ClusterConfig, out: Path, workdir: Path) -> str:
    job = cluster.job_name(run.run.name)
    q = shlex.quote
    lines = _header(cluster, f"{job}-coordinator", out, "coordinator") + [
        "#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --cpus-per-task=2",
        "#SBATCH --requeue", ""] + _setup(cluster, workdir) + [
        f"OUT={q(str(out))}",
        f"PORT={cluster.coordinator_port}",
        "# Groups read this file when they start; written before the server so that a group",
        "# started meanwhile retries its first connection instead of finding no file.",
        'echo "http://$(hostname):${PORT}" > "$OUT/state/coordinator.url.tmp"',
        'mv "$OUT/state/coordinator.url.tmp" "$OUT/state/coordinator.url"',
        f'exec {cluster.python} -m ftlm.cli coordinator "$OUT/config.toml" --host 0.0.0.0 '
        f'--port "$PORT" --set ft.token_file="$OUT/token" --set ft.groups={cluster.groups}',
    ]
    return "\n".join(lines) + "\n"


def group_script(run: RunConfig, cluster: ClusterConfig, out: Path, workdir: Path,
                 group: str) -> str:
    job = cluster.job_name(run.run.name)
    q = shlex.quote
    run_dir = run.run.path if run.run.path.is_absolute() else workdir / run.run.path
    gpus = [f"#SBATCH --gpus-per-node={cluster.gpus_per_group}"] if cluster.gpus_per_group else []
    cpus = cluster.ranks_per_group * cluster.slurm_cpus_per_rank
    lines = _header(cluster, f"{job}-{group}", out, group) + [
        "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", f"#SBATCH --cpus-per-task={cpus}",
        *gpus,
        "#SBATCH --requeue",
        # B: deliver USR2 to this batch shell, whose trap turns it into SIGTERM for the trainer.
        f"#SBATCH --signal=B:USR2@{cluster.grace_seconds}", ""] + _setup(cluster, workdir) + [
        f"OUT={q(str(out))}",
        "url_file=\"$OUT/state/coordinator.url\"",
        "# Bounded wait for the coordinator's address (the coordinator job may still be pending).",
        "for _ in $(seq 600); do [ -s \"$url_file\" ] && break; sleep 1; done",
        "if [ ! -s \"$url_file\" ]; then echo \"ftlm: no coordinator URL in $url_file after 600 s\" >&2; exit 3; fi",
        "FTLM_COORDINATOR=$(cat \"$url_file\")",
        "FTLM_TOKEN=$(cat \"$OUT/token\")",
        f"export FTLM_COORDINATOR FTLM_TOKEN FTLM_GROUP_ID={group} FTLM_GROUPS={cluster.groups}",
        "export PYTHONUNBUFFERED=1",
        "# Other groups reach this node's rendezvous store and state server at its address.",
        "FTLM_HOST=$(hostname -I 2>/dev/null | awk '{print $1}')",
        "export FTLM_HOST=\"${FTLM_HOST:-127.0.0.1}\"",
        "",
        "stopping=0",
        "child=",
        "# shellcheck disable=SC2317  # called by the trap",
        "on_usr2() {",
        "  # The time limit or a preemption is near: stop after this step, save, then requeue.",
        "  stopping=1",
        "  echo \"ftlm: USR2 received, asking the trainer to stop\" >&2",
        "  if [ -n \"$child\" ]; then kill -TERM \"$child\" 2>/dev/null || true; fi",
        "}",
        "trap on_usr2 USR2",
        "",
        f"srun --ntasks=1 --cpus-per-task={cpus} {cluster.python} -m torch.distributed.run "
        f"--standalone --nnodes=1 --nproc-per-node={cluster.ranks_per_group} "
        f"-m ftlm.cli train \"$OUT/config.toml\" --set ft.coordinator= "
        f"--set run.dir={q(str(run_dir))} --set observe.progress=false &",
        "child=$!",
        "# wait returns early (status > 128) when the trap runs: wait again for the real status.",
        "while :; do",
        "  wait \"$child\"",
        "  rc=$?",
        "  kill -0 \"$child\" 2>/dev/null || break",
        "done",
        "if [ \"$stopping\" = 1 ]; then",
        "  echo \"ftlm: stopped with status $rc; requeueing $SLURM_JOB_ID\" >&2",
        "  scontrol requeue \"$SLURM_JOB_ID\"",
        "  exit 0",
        "fi",
        "exit \"$rc\"",
    ]
    return "\n".join(lines) + "\n"


def submit_script(cluster: ClusterConfig, out: Path) -> str:
    groups = " ".join(cluster.group_names())
    return f"""#!/bin/bash
# Submit the coordinator and every replica group, then start the watcher in the background
# (pass --no-watch to run ./watch.sh yourself).
set -euo pipefail
OUT={shlex.quote(str(out))}
mkdir -p "$OUT/state" "$OUT/logs"
rm -f "$OUT/state/coordinator.url" "$OUT/state/STOP" "$OUT/state/"*.restarts
sbatch --parsable "$OUT/coordinator.sbatch" > "$OUT/state/coordinator.jobid"
for g in {groups}; do
  sbatch --parsable "$OUT/group-$g.sbatch" > "$OUT/state/$g.jobid"
done
echo "coordinator: job $(cat "$OUT/state/coordinator.jobid")"
for g in {groups}; do echo "group $g: job $(cat "$OUT/state/$g.jobid")"; done
if [ "${{1:-}}" != "--no-watch" ]; then
  nohup "$OUT/watch.sh" >> "$OUT/logs/watch.log" 2>&1 &
  echo $! > "$OUT/state/watch.pid"
  echo "watcher: pid $(cat "$OUT/state/watch.pid"), log $OUT/logs/watch.log"
fi
"""


def stop_script(cluster: ClusterConfig, out: Path) -> str:
    return f"""#!/bin/bash
# Stop the job on purpose: the watcher resubmits nothing after this, then cancel every job.
set -uo pipefail
OUT={shlex.quote(str(out))}
touch "$OUT/state/STOP"
for f in "$OUT/state/"*.jobid; do
  [ -s "$f" ] && scancel "$(cat "$f")"
done
exit 0
"""


def watch_script(cluster: ClusterConfig, out: Path) -> str:
    settings = "\n".join([
        f"OUT={shlex.quote(str(out))}",
        f"GROUPS_LIST=({' '.join(cluster.group_names())})",
        f"MAX_RESTARTS={cluster.max_restarts}",
        f"INTERVAL=${{FTLM_WATCH_INTERVAL:-{cluster.watch_interval}}}",
    ])
    return WATCH_SCRIPT.replace("# @SETTINGS@", settings)


def generate_slurm(run_config: RunConfig, cluster: ClusterConfig, out_dir: Path,
                   config_toml: str, workdir: Path | None = None) -> list[Path]:
    """Write the job's scripts under ``out_dir``; ``workdir`` (default: the current directory)
    is where relative paths of the config (data, run directory) resolve on the nodes."""
    out = Path(out_dir).resolve()
    workdir = (workdir or Path.cwd()).resolve()
    (out / "state").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    for old in out.glob("group-*.sbatch"):  # a regeneration with fewer groups
        old.unlink()
    files: dict[str, str] = {
        "config.toml": config_toml,
        "coordinator.sbatch": coordinator_script(run_config, cluster, out, workdir),
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
