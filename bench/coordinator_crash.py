"""Stall of the healthy groups when the coordinator process dies under ``ftlm launch local``.

The local launcher restarts a dead coordinator on the same port (``LocalLauncher``); the new one
holds no state and rebuilds membership from the groups' next heartbeats (docs/design.md, 'Failure
detection'). This benchmark measures what that costs the groups: one in-process ``LocalLauncher``
per repetition (3 groups of 1 rank, the soak's tiny model on the demo data), and a thread that, once
the job has committed its first steps, SIGKILLs the coordinator every ``--every`` seconds through
``LocalLauncher.restart_coordinator`` (kill, then start a fresh process on the same port at once:
what the launcher's watch loop does for a crash, without its 0.1 s polling delay). Every kill is a
``failure_injected`` event with target ``coordinator``, so ``ftlm.observe.summary`` charges it
its stall like any other failure: the longest gap between the job's commits around it, minus the
median step time.

Each repetition is two launches: coordinator restarts cold (a new ``ftlm coordinator`` process,
as before the standby existed) then warm (the launcher's standby takes over). Reported per
launch: the coordinator's downtime (kill to the new process answering), the
stall per kill, and whether the run still proves itself (identical replicas, exactly-once data).
It does not test anything; the tests of coordinator restarts are in tests/launch and tests/ft.

``--slurm`` measures the same on a real Slurm instead (its own section): the one-node test
cluster of tests/launch/slurm_cluster.py (munged, slurmctld, slurmd as root; ``make
system-deps-cluster``), the job of ``ftlm launch slurm`` (3 groups, ``watch.sh`` with a 1 s
interval). Every ``--every`` seconds the coordinator's job is cancelled (``scancel``: its node is
gone); the watcher submits a fresh coordinator job (at another port than the first), which writes its address to
``state/coordinator.url``, and the groups' relays follow it. Per kill: the downtime (``scancel`` to
the new coordinator answering ``/status``) and the stall (``ftlm.observe.summary.stall_seconds``
over the run's events plus one in-memory ``failure_injected`` with target ``coordinator`` per kill,
as the local launcher writes for its own kills).

    python -m bench.coordinator_crash [--quick] [--reps R] [--kills K] [--every SECONDS] [--no-write]
    python -m bench.coordinator_crash --slurm [--kills K] [--every SECONDS] [--no-write]
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ensure_demo, section_header, table, write_section
from bench.soak import Settings, write_config

SECTION = "coordinator_crash"
SLURM_SECTION = "coordinator_crash_slurm"
GROUPS = 3


def _killer(launcher, kills: int, every: float, first_step: int, done: threading.Event,
            log: list[float]) -> None:
    """Kill the coordinator ``kills`` times, ``every`` seconds apart, once the job is past
    ``first_step``; stop early when the run ends."""
    while not done.is_set() and launcher._best[0] < first_step:
        done.wait(0.2)
    for _ in range(kills):
        if done.wait(every):
            return
        t0 = time.time()
        launcher.restart_coordinator()
        log.append(time.time() - t0)


def commit_gaps(events: list[dict]) -> list[float]:
    """For each coordinator kill, the longest gap between the job's commits (each step's
    earliest) that overlaps the outage, from the kill to the replacement answering: the raw
    pause, a normal step included, whatever else happened meanwhile."""
    first: dict[int, float] = {}
    for e in events:
        if e["kind"] == "commit":
            first[e["step"]] = min(first.get(e["step"], e["ts"]), e["ts"])
    times = sorted(first.values())
    restarts = sorted(e["ts"] for e in events if e["kind"] == "coordinator_restart")
    gaps = []
    for e in events:
        if e["kind"] != "failure_injected" or e.get("target") != "coordinator":
            continue
        later = restarts[bisect.bisect_left(restarts, e["ts"]):]
        back = later[0] if later else e["ts"]  # when the replacement answered
        overlapping = [b - a for a, b in zip(times, times[1:]) if b > e["ts"] and a <= back]
        if overlapping:
            gaps.append(max(overlapping))
    return gaps


def run_one(root: Path, steps: int, kills: int, every: float, standby: bool) -> dict:
    """One launch with ``kills`` coordinator crashes (replaced by the warm standby, or started
    cold); its summary figures for the table."""
    from ftlm.config import load_config
    from ftlm.launch.local import LocalLauncher
    from ftlm.observe.events import read_events
    from ftlm.observe.summary import failure_events

    run_dir = root / f"run-{time.time_ns()}"
    config = load_config(write_config(run_dir, Settings(steps=steps, mtbf=0.0)),
                         # Start-up and give-up room for a loaded shared box (group start-up
                         # is not what this measures).
                         [f"run.dir={run_dir}", "ft.startup_timeout=150", "ft.give_up_seconds=300"])
    launcher = LocalLauncher(config, groups=GROUPS, progress=False, coordinator_standby=standby)
    done, downtimes = threading.Event(), []
    killer = threading.Thread(target=_killer, args=(launcher, kills, every, 5, done, downtimes),
                              daemon=True)
    killer.start()
    try:
        summary = launcher.run()
    finally:
        done.set()
        killer.join(timeout=60)
        # A kill racing the launcher's own shutdown may have started one more coordinator.
        launcher.coordinator.stop()
    events = read_events(run_dir / "events.jsonl")
    fails = failure_events(sorted(events, key=lambda e: e["ts"]))
    stalls = [s for f, s in zip(fails, summary["stall_seconds"]) if f.group == "coordinator"]
    return {"standby": standby, "kills": len(downtimes), "downtime": downtimes, "stalls": stalls,
            "gaps": commit_gaps(events),
            "median_step": summary["median_step_seconds"], "steps": summary["steps_committed"],
            "ett": summary["ett"], "problems": summary["problems"]}


def render(results: list[dict], flags: list[str], steps: int, every: float, took: float) -> str:
    rows = []
    for i, r in enumerate(results):
        stalls = r["stalls"] or [float("nan")]
        rows.append([i // 2 + 1, "warm standby" if r["standby"] else "cold start", r["kills"],
                     f"{r['median_step']:.3f}",
                     f"{statistics.median(r['downtime']):.2f}" if r["downtime"] else "-",
                     f"{statistics.median(stalls):.3f}", f"{max(stalls):.3f}",
                     " ".join(f"{s:.2f}" for s in r["stalls"]),
                     " ".join(f"{s:.2f}" for s in r["gaps"]), r["steps"], f"{r['ett']:.3f}",
                     "; ".join(r["problems"]) or "none"])
    head = section_header("Coordinator crash under `ftlm launch local`",
                          "bench.coordinator_crash", flags)
    lines = [head.rstrip("\n"),
             f"* Method: {GROUPS} groups x 1 rank, the soak's tiny model, {steps} steps, "
             f"`ft.heartbeat_timeout=2`; from step 5 on the coordinator is SIGKILLed every "
             f"{every:g} s and the launcher starts a fresh one on the same port at once "
             "(`LocalLauncher.restart_coordinator`): cold (a new `ftlm coordinator` process) or "
             "from the warm standby (`ftlm.launch.coordinator_standby`), alternating launch by "
             "launch. Downtime: kill to the new process answering. "
             "Stall: `ftlm.observe.summary`'s stall of each kill (longest gap between the job's "
             "commits around it, minus the median step; a load-induced failure overlapping a "
             "kill takes the charge). Commit gap: the longest raw gap between the job's commits "
             "that overlaps the outage, kill to replacement answering (a normal step included).",
             f"* Took {took:.0f} s.", "",
             table(["rep", "restart", "kills", "median step s", "median downtime s", "median stall s",
                    "max stall s", "stall per kill s", "commit gap per kill s", "steps", "ETT",
                    "problems"], rows), ""]
    for standby in (False, True):
        mine = [r for r in results if r["standby"] == standby]
        stalls = [x for r in mine for x in r["stalls"]]
        down = [x for r in mine for x in r["downtime"]]
        gaps = [x for r in mine for x in r["gaps"]]
        if stalls and gaps:
            lines.append(f"* {'Warm standby' if standby else 'Cold start'}: {len(stalls)} kills, stall "
                         f"median {statistics.median(stalls):.3f} s (max {max(stalls):.3f} s), "
                         f"commit gap median {statistics.median(gaps):.2f} s (max {max(gaps):.2f} s), "
                         f"coordinator downtime median {statistics.median(down):.2f} s.")
    return "\n".join(lines) + "\n"


def _wait(cond, timeout: float, what: str, every: float = 0.2):
    """Poll ``cond`` (files and endpoints of processes under Slurm's control) until it returns
    something true, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


def _answers(url: str, token: str) -> bool:
    import urllib.request
    request = urllib.request.Request(f"{url}/status", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_slurm(root: Path, kills: int, every: float) -> dict:
    """One job under a real one-node Slurm with ``kills`` coordinator job cancellations."""
    import subprocess
    import sys

    from ftlm.config import load_config
    from ftlm.launch.cluster_config import ClusterConfig
    from ftlm.launch.slurm import generate_slurm
    from ftlm.observe.events import read_events
    from ftlm.observe.summary import failure_events, median_step_seconds, stall_seconds

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "launch"))
    from slurm_cluster import SlurmCluster, missing_reason

    reason = missing_reason()
    if reason:
        raise RuntimeError(f"no real Slurm here: {reason}")
    run_dir = root / "run"
    config = load_config(write_config(run_dir, Settings(steps=100000, mtbf=0.0)),
                         [f"run.dir={run_dir}", "train.eval_every=0", "checkpoint.every=0"])
    out = root / "slurm"
    generate_slurm(config, ClusterConfig(groups=GROUPS, python=sys.executable, slurm_cpus_per_rank=1,
                                         coordinator_port=_free_port(), watch_interval=1,
                                         grace_seconds=30),
                   out, config.to_toml(), workdir=root)
    cluster = SlurmCluster(root / "cluster")
    cluster.start()
    env = dict(cluster.env, FTLM_WATCH_INTERVAL="1")
    url_file, jobid_file = out / "state" / "coordinator.url", out / "state" / "coordinator.jobid"
    events_file = run_dir / "events.jsonl"

    def events() -> list[dict]:
        return read_events(events_file) if events_file.is_file() else []

    def steps_of_all(at_least: int) -> bool:
        got = {}
        for e in events():
            if e["kind"] == "commit":
                got[e["group"]] = max(got.get(e["group"], -1), e["step"])
        return len(got) == GROUPS and min(got.values()) >= at_least

    kill_log: list[dict] = []
    watcher = None
    try:
        subprocess.run([str(out / "submit-all.sh"), "--no-watch"], check=True, env=env, timeout=60)
        # A resubmitted coordinator listens on another port (another node, on a real cluster).
        watcher = subprocess.Popen([str(out / "watch.sh")], env=dict(env, FTLM_COORDINATOR_PORT=str(_free_port())),
                                   stdout=open(root / "watch.log", "w"), stderr=subprocess.STDOUT)
        token = (out / "token").read_text().strip()
        _wait(lambda: steps_of_all(5), 300, "every group to commit step 5")
        for _ in range(kills):
            time.sleep(every)  # the pace of the kills, not a wait for something
            job = jobid_file.read_text().strip()
            t0 = time.time()
            subprocess.run(["scancel", job], check=True, env=env, timeout=30)
            _wait(lambda: jobid_file.read_text().strip() != job, 180, "the watcher to resubmit",
                  every=0.05)
            resubmitted = time.time()
            # A new job writes its address anew (the same one when it got the same port).
            new = _wait(lambda: jobid_file.read_text().strip() != job and url_file.is_file()
                        and url_file.stat().st_mtime >= t0 and url_file.read_text().strip(), 180,
                        "the resubmitted coordinator's address")
            _wait(lambda: _answers(new, token), 120, "the new coordinator to answer", every=0.05)
            kill_log.append({"ts": t0, "downtime": time.time() - t0, "resubmitted": resubmitted - t0,
                             "started": url_file.stat().st_mtime - t0})
            top = max(e["step"] for e in events() if e["kind"] == "commit")
            _wait(lambda: steps_of_all(top + 5), 180, "every group to commit 5 more steps")
    finally:
        subprocess.run([str(out / "stop-all.sh")], env=env, timeout=60, check=False)
        if watcher is not None:
            try:
                watcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                watcher.kill()
        cluster.stop()
    recorded = sorted(events(), key=lambda e: e["ts"])
    marks = [{"ts": k["ts"], "kind": "failure_injected", "group": "bench", "target": "coordinator",
              "signal": "SIGKILL", "step": -1} for k in kill_log]
    ordered = sorted(recorded + marks, key=lambda e: (e["ts"], e["kind"] != "failure_injected"))
    median_step = median_step_seconds(recorded)
    stalls = {(f.ts, f.group): s for f, s in zip(failure_events(ordered), stall_seconds(ordered, median_step))}
    starts = [e["group"] for e in recorded if e["kind"] == "group_start"]
    committed = sorted({e["step"] for e in recorded if e["kind"] == "commit"})
    return {"kills": kill_log, "stalls": [stalls.get((k["ts"], "coordinator")) for k in kill_log],
            "median_step": median_step, "group_starts": len(starts),
            "steps": len(committed),
            "lost": (committed[-1] - committed[0] + 1 - len(committed)) if committed else 0}


def render_slurm(r: dict, kills: int, every: float, took: float) -> str:
    head = section_header("Coordinator crash on a real Slurm", "bench.coordinator_crash",
                          ["--slurm"])
    stalls = [s for s in r["stalls"] if s is not None]
    down = [k["downtime"] for k in r["kills"]]
    rows = [[i + 1, f"{k['resubmitted']:.2f}", f"{k['started']:.2f}", f"{k['downtime']:.2f}",
             "-" if s is None else f"{s:.3f}"] for i, (k, s) in enumerate(zip(r["kills"], r["stalls"]))]
    lines = [head.rstrip("\n"),
             f"* Method: the one-node Slurm of `tests/launch/slurm_cluster.py` (munged, slurmctld, "
             f"slurmd from Debian, as root; `make system-deps-cluster`), the scripts of `ftlm launch "
             f"slurm` ({GROUPS} groups x 1 rank, the soak's tiny model, no evaluation or checkpoint, "
             "`watch.sh` every 1 s). From step 5 on, every "
             f"{every:g} s the coordinator's job is cancelled (`scancel`: its node is gone); the watcher "
             "submits a fresh coordinator job at another port, and the groups' relays follow "
             "`state/coordinator.url` to it. From the `scancel`: *resubmitted* when the watcher "
             "wrote the new job id, *job started* when the new job's script wrote its address "
             "(before starting `ftlm coordinator`), *downtime* when the new coordinator answered "
             "`/status`. Stall: `ftlm.observe.summary.stall_seconds` over the run's events plus one "
             "in-memory `failure_injected` (target `coordinator`) per kill: the longest gap between "
             "the job's commits around it, minus the median step. The new coordinator starts cold "
             "(no standby on Slurm).",
             f"* Took {took:.0f} s.", "",
             table(["kill", "resubmitted s", "job started s", "downtime s", "stall s"], rows), "",
             f"* {len(r['kills'])} kills: downtime median "
             f"{statistics.median(down) if down else float('nan'):.2f} s, stall median "
             f"{statistics.median(stalls) if stalls else float('nan'):.3f} s (max "
             f"{max(stalls, default=float('nan')):.3f} s); median step {r['median_step']:.3f} s; "
             f"{r['steps']} steps committed, {r['lost']} missing in between; group starts "
             f"{r['group_starts']} (no group restarted: {r['group_starts'] == GROUPS})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coordinator_crash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one repetition, 2 kills")
    p.add_argument("--reps", type=int, default=2, help="pairs of launches, cold then warm (default 2)")
    p.add_argument("--kills", type=int, default=4, help="coordinator kills per launch (default 4)")
    p.add_argument("--every", type=float, default=10.0, help="seconds between kills (default 10)")
    p.add_argument("--steps", type=int, default=0, help="steps per launch (default: enough for the kills)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--slurm", action="store_true", help="on a real one-node Slurm (as root)")
    args = p.parse_args(argv)
    if args.slurm:
        kills = 2 if args.quick else args.kills
        ensure_demo()
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="ftlm-coordcrash-slurm-") as tmp:
            r = run_slurm(Path(tmp), kills, args.every)
        text = render_slurm(r, kills, args.every, time.monotonic() - t0)
        print(text)
        if not args.no_write:
            write_section(SLURM_SECTION, text)
        return 0 if r["lost"] == 0 and r["group_starts"] == GROUPS else 1
    reps, kills = (1, 2) if args.quick else (args.reps, args.kills)
    # About 0.1-0.3 s per step on a loaded 2-core box: room for every kill and a tail after the last.
    steps = args.steps or int((kills + 2) * args.every * 8) + 40
    ensure_demo()
    t0 = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="ftlm-coordcrash-") as tmp:
        for rep, standby in ((rep, standby) for rep in range(reps) for standby in (False, True)):
            r = run_one(Path(tmp), steps, kills, args.every, standby)
            print(f"rep {rep + 1} standby={standby}: kills {r['kills']}, stalls {r['stalls']}, downtime "
                  f"{[round(d, 2) for d in r['downtime']]}, problems {r['problems']}", flush=True)
            results.append(r)
    flags = [f for f, on in (("--quick", args.quick),) if on]
    text = render(results, flags, steps, args.every, time.monotonic() - t0)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
    return 0 if all(not r["problems"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
