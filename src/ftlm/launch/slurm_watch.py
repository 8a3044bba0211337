"""The Slurm watcher script (``watch.sh``): resubmits failed replica groups, bounded.

Kept as text here, not as a data file, so that it ships with the package. ``ftlm.launch.slurm``
fills in the settings line. The script decides per job from its Slurm state: queued or running
is fine, COMPLETED ends the group, any other end (FAILED, CANCELLED, NODE_FAIL, TIMEOUT,
OUT_OF_MEMORY, PREEMPTED, or a job Slurm no longer knows) is a failure and the group is
resubmitted, at most MAX_RESTARTS times. One watcher runs per job: it holds
``state/watch.lock`` (``flock``) and records its pid and host in ``state/watch.pid`` and
``state/watch.host``, which ``stop-all.sh`` and ``submit-all.sh`` use to stop it; a second one
refuses to start. Once one group has completed the run is over: nothing is
resubmitted, groups still pending are cancelled (they would have nobody to recover from), and
the coordinator is cancelled when no group is left.

A group whose job ended because the coordinator retired its process for failing every step it
took part in (a rank exited with ``ftlm.errors.EXIT_RETIRED``, which ``node.sh`` records as
``state/<g>-<job id>.retired``: a bad link or device on one of its nodes) is resubmitted away
from the nodes that job ran on: they join ``state/exclude`` (at most MAX_EXCLUDED entries),
which every later group submission passes to ``sbatch --exclude``; Slurm would otherwise often
place it on the node it just freed, where it fails the same way.
"""

WATCH_SCRIPT = r'''#!/bin/bash
# ftlm watcher: resubmits a replica group (or the coordinator) whose Slurm job ended with a
# failure, at most MAX_RESTARTS times each; exits when the run is over (0: a group completed).
# Stop it for good with ./stop-all.sh (it writes state/STOP).
set -uo pipefail
# @SETTINGS@

log() { echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $*"; }

# One watcher per job: two would both resubmit a failed group. This one holds state/watch.lock
# (flock) for its whole life, released however it ends; one started meanwhile waits a little for
# it (stop-all.sh and submit-all.sh stop the one before), then refuses.
exec 9>>"$OUT/state/watch.lock"
if ! flock -w "${FTLM_WATCH_LOCK_WAIT:-30}" 9; then
  echo "ftlm: another watcher of this job (pid $(cat "$OUT/state/watch.pid" 2>/dev/null || echo unknown)) holds $OUT/state/watch.lock; stop it with ./stop-all.sh, or let it watch" >&2
  exit 3
fi
hostname > "$OUT/state/watch.host"
echo "$$" > "$OUT/state/watch.pid"
sleeper=
# shellcheck disable=SC2317  # called by the trap
on_term() {
  [ -n "$sleeper" ] && kill "$sleeper" 2>/dev/null
  log "watcher stopped by a signal"
  exit 143
}
trap on_term TERM INT
log "watching (pid $$)"

# The state of a job: squeue while queued or running, scontrol while Slurm remembers the end
# (MinJobAge), then sacct (needs accounting); UNKNOWN when nobody knows it.
job_state() {
  local id=$1 s
  s=$(squeue -h -j "$id" -o %T 2>/dev/null | head -n 1)
  if [ -z "$s" ]; then
    s=$(scontrol show job -o "$id" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | head -n 1 | cut -d= -f2)
  fi
  if [ -z "$s" ]; then
    s=$(sacct -n -X -P -j "$id" -o State 2>/dev/null | head -n 1 | cut -d' ' -f1)
  fi
  echo "${s:-UNKNOWN}"
}

is_active() {
  case "$1" in
    PENDING|RUNNING|REQUEUED|REQUEUE_HOLD|REQUEUE_FED|CONFIGURING|COMPLETING|RESIZING|\
SUSPENDED|STAGE_OUT|SIGNALING|RESV_DEL_HOLD|STOPPED) return 0 ;;
    *) return 1 ;;
  esac
}

# The nodes a job ran on (a Slurm hostlist such as gpu[001-002]): scontrol while Slurm remembers
# the job, then sacct.
job_nodes() {
  local id=$1 n
  n=$(scontrol show job -o "$id" 2>/dev/null | grep -o ' NodeList=[^ ]*' | head -n 1 | cut -d= -f2)
  if [ -z "$n" ] || [ "$n" = "(null)" ]; then
    n=$(sacct -n -X -P -j "$id" -o NodeList 2>/dev/null | head -n 1)
  fi
  [ "$n" = "None assigned" ] || [ "$n" = "(null)" ] && n=""
  echo "$n"
}

# avoid_nodes NAME ID: if group NAME's job ID ended because the coordinator retired its process
# for failing every step it took part in (a rank's exit status, recorded by node.sh), its nodes
# join state/exclude (bounded).
avoid_nodes() {
  local name=$1 id=$2 nodes count
  [ -e "$OUT/state/$name-$id.retired" ] || return 0
  nodes=$(job_nodes "$id")
  if [ -z "$nodes" ]; then
    log "$name: job $id was retired for failing its steps; its nodes are unknown (not avoided)"
    return 0
  fi
  count=0
  [ -f "$OUT/state/exclude" ] && count=$(wc -l < "$OUT/state/exclude")
  if grep -qxF "$nodes" "$OUT/state/exclude" 2>/dev/null; then
    return 0
  elif [ "$count" -ge "$MAX_EXCLUDED" ]; then
    log "$name: job $id was retired for failing its steps on $nodes; not avoided ($count entries in state/exclude already)"
    return 0
  fi
  echo "$nodes" >> "$OUT/state/exclude"
  log "$name: job $id was retired for failing its steps on $nodes; later group jobs avoid them (state/exclude)"
}

# resubmit NAME SCRIPT: a new job for NAME unless its restarts are used up.
resubmit() {
  local name=$1 script=$2 n id
  local args=(--parsable)
  n=$(cat "$OUT/state/$name.restarts" 2>/dev/null || echo 0)
  if [ "$n" -ge "$MAX_RESTARTS" ]; then
    log "$name: not resubmitted, $n restarts used (cluster.max_restarts=$MAX_RESTARTS)"
    return 1
  fi
  if [ "$name" != coordinator ] && [ -s "$OUT/state/exclude" ]; then
    args+=("--exclude=$(paste -sd, "$OUT/state/exclude")")
  fi
  if ! id=$(sbatch "${args[@]}" "$script"); then
    log "$name: sbatch failed; will retry"
    return 0
  fi
  echo "$((n + 1))" > "$OUT/state/$name.restarts"
  echo "${id%%;*}" > "$OUT/state/$name.jobid"
  log "$name: resubmitted as job ${id%%;*} (restart $((n + 1)) of $MAX_RESTARTS)"
}

jobid() { cut -d';' -f1 "$OUT/state/$1.jobid"; }

finished=0
while [ ! -e "$OUT/state/STOP" ]; do
  active=0
  for g in "${GROUPS_LIST[@]}"; do
    [ -e "$OUT/state/$g.done" ] && continue
    id=$(jobid "$g")
    st=$(job_state "$id")
    if [ "$st" = COMPLETED ]; then
      log "$g: job $id completed"
      touch "$OUT/state/$g.done"
      finished=1
    elif is_active "$st"; then
      if [ "$finished" = 1 ] && [ "$st" = PENDING ]; then
        log "$g: job $id cancelled, the run is over"
        scancel "$id"
        touch "$OUT/state/$g.done"
      else
        active=1
      fi
    elif [ "$finished" = 1 ]; then
      log "$g: job $id ended ($st) after the run finished; not resubmitted"
      touch "$OUT/state/$g.done"
    else
      log "$g: job $id ended with $st"
      avoid_nodes "$g" "$id"
      if resubmit "$g" "$OUT/group-$g.sbatch"; then active=1; else touch "$OUT/state/$g.done"; fi
    fi
  done
  cid=$(jobid coordinator)
  cst=$(job_state "$cid")
  if [ "$active" = 0 ]; then
    break
  elif ! is_active "$cst" && [ "$finished" = 0 ]; then
    # A new coordinator may run on another node: the groups' relays follow the address file
    # it writes (removed here so that they wait for it instead of the dead one).
    log "coordinator: job $cid ended with $cst"
    rm -f "$OUT/state/coordinator.url"
    resubmit coordinator "$OUT/coordinator.sbatch" || break
  fi
  # In the background, so that a stop request ends the watcher at once; without the lock's
  # descriptor, which would otherwise outlive the watcher for the rest of the sleep.
  sleep "$INTERVAL" 9>&- &
  sleeper=$!
  wait "$sleeper"
  sleeper=
done
scancel "$(jobid coordinator)" 2>/dev/null || true
log "watcher done (a group completed: $finished)"
[ "$finished" = 1 ]
'''
