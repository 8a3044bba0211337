"""How long a job stalls when its coordinator's node is lost, with the Kubernetes layout's warm
standby (``ftlm coordinator --lease``), measured on the network test bed.

Each trial builds a bed (``ftlm.testing.netbed``: network namespaces as nodes) with two
coordinator nodes and two group nodes. A Kubernetes API stand-in (``ftlm.testing.kube_api``:
Leases with resourceVersion conflicts, pods and their labels) and the coordinator Service (a
proxy to the pod labelled leader, as kube-proxy routes) run on the host. Both coordinators run
``ftlm coordinator --lease`` with the product's timing (``LeaseTiming()``); the two groups are
real ``ftlm train`` processes placed as the generated pods place them (``FTLM_COORDINATOR`` the
Service, ``FTLM_HOST`` the node's address). Once both groups commit, the holder's node gets one
fault:

* ``node-lost``: every packet of the holder's node dropped (no TCP reset): it can reach neither
  the API nor the groups, and they cannot reach it;
* ``crash``: the holder's process SIGKILLed (the lease is not released);
* ``drain``: the holder SIGTERMed (a drain or a rolling update: it releases the lease).

Measured per trial: the **takeover** (the fault to the standby's write of the lease) and the
**stall** (the longest time either group went without a commit, from its last commit before the
fault to its fifth after the takeover, less the median step time before the fault: what the
fault cost). Intervals are 95 % t-intervals over the trials, each an
independent bed and job. Not modelled: the real Service's endpoint update (about a second on a
cluster; here the label is read at every new connection) and the API server's latency.

    sudo python -m bench.coordinator_takeover [--trials 5] [--faults node-lost,crash,drain]
        [--json bench/results/coordinator_takeover.json] [--workdir runs/takeover] [--no-write]

Needs root, ``ip`` and ``nft`` (as the bed); ``make system-deps`` installs them.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import (DEMO_SEQ_LEN, DEMO_VOCAB, REPO_ROOT, ensure_demo, publish, repo_relative,
                          section_header, t_interval)

FAULTS = ("node-lost", "crash", "drain")
PORT = 29510
LEADER = {"ftlm.dev/coordinator-leader": "true"}
METHOD = (
    "each trial is a fresh network test bed (`ftlm.testing.netbed`: a namespace per node) with two "
    "coordinator nodes running `ftlm coordinator --lease` (the generated Kubernetes layout's "
    "command, the product's lease timing) and two `ftlm train` groups (the soak's 100k-parameter "
    "model) placed as the generated pods are (`FTLM_COORDINATOR` the Service, `FTLM_HOST` the "
    "node). The Kubernetes API (Leases with resourceVersion conflicts, pods and labels) and the "
    "Service (a proxy to the pod labelled leader, chosen per new connection as kube-proxy does) "
    "are stand-ins on the host (`ftlm.testing.kube_api`). Once both groups commit, the lease "
    "holder gets one fault: *node-lost* (every packet of its node dropped, no TCP reset), *crash* "
    "(SIGKILL, the lease not released) or *drain* (SIGTERM: it releases the lease). Takeover: the "
    "fault to the standby's write of the lease. Stall: the longest time either group went "
    "without a commit, from its last before the fault to its fifth after the takeover, less the "
    "median step before the fault. ± is the 95 % t-interval over the trials (independent beds and "
    "jobs). Not modelled: a real cluster's endpoint update (about a second) and API latency.")
START_TIMEOUT = 300.0
"""Seconds for both coordinators and both groups to start and the groups to commit (a loaded box)."""
AFTER_TIMEOUT = 180.0


def _events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def _commits(events: list[dict]) -> dict[str, list[float]]:
    by: dict[str, list[float]] = {}
    for e in events:
        if e.get("kind") == "commit" and not e.get("replayed"):
            by.setdefault(str(e["group"]), []).append(float(e["ts"]))
    return by


def _wait(what: str, condition, timeout: float, procs: dict[str, subprocess.Popen]):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None and not n.startswith("coord")}
        if dead:
            raise RuntimeError(f"{what}: processes exited {dead}")
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not within {timeout:.0f} s")


def trial(fault: str, workdir: Path, data_dir: Path, seq_len: int = DEMO_SEQ_LEN,
          vocab: int = DEMO_VOCAB) -> dict:
    """One bed, one job, one fault on the lease holder; what it cost. ``data_dir``: a prepared
    dataset of ``seq_len`` and ``vocab`` (the demo's)."""
    from bench.nemesis import job_config
    from ftlm.testing.kube_api import FakeKubeApi, ServiceProxy
    from ftlm.testing.netbed import NetBed
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    config = job_config(workdir / "run", data_dir, 100_000, seq_len=seq_len, vocab=vocab, checkpoint_every=0)
    config_file = workdir / "config.toml"
    config_file.write_text(config.to_toml())
    token = secrets.token_hex(16)
    with NetBed(["coord-a", "coord-b", "g0", "g1"]) as bed:
        host = str(bed.subnet[1])  # the bridge: the host's address on the bed
        with FakeKubeApi(host=host) as api, ServiceProxy(api.state, LEADER, host=host) as service:
            state = api.state
            written: list[tuple[float, str]] = []
            state.on_write = lambda _, lease: written.append((time.time(), lease["spec"]["holderIdentity"]))
            procs: dict[str, subprocess.Popen] = {}
            base = {**os.environ, "FTLM_TOKEN": token, "PYTHONUNBUFFERED": "1"}
            for name in ("coord-a", "coord-b"):
                state.add_pod(name, bed.node(name).host, PORT)
                env = {**base, "FTLM_KUBE_API": api.url, "POD_NAME": name, "POD_NAMESPACE": "default"}
                procs[name] = bed.popen(name, [sys.executable, "-m", "ftlm.cli", "coordinator", str(config_file),
                                               "--host", "0.0.0.0", "--port", str(PORT), "--lease",
                                               "job-coordinator"],
                                        env=env, stdout=open(workdir / f"{name}.log", "w"),
                                        stderr=subprocess.STDOUT)
            _wait("a coordinator labelled leader", lambda: state.endpoints(LEADER), START_TIMEOUT, procs)
            for g in ("g0", "g1"):
                env = {**base, "FTLM_COORDINATOR": service.url, "FTLM_GROUP_ID": g, "FTLM_GROUPS": "2",
                       "FTLM_HOST": bed.node(g).host, "FTLM_INCARNATION": secrets.token_hex(4)}
                procs[g] = bed.popen(g, [sys.executable, "-m", "ftlm.cli", "train", str(config_file),
                                         "--set", "ft.coordinator="],
                                     env=env, stdout=open(workdir / f"{g}.log", "w"), stderr=subprocess.STDOUT)
            events = workdir / "run" / "events.jsonl"
            _wait("both groups committing", lambda: all(len(v) >= 10 for v in _commits(_events(events)).values())
                  and len(_commits(_events(events))) == 2, START_TIMEOUT, procs)
            holder = state.lease("job-coordinator")["spec"]["holderIdentity"]
            before = _commits(_events(events))
            gaps = [b - a for ts in before.values() for a, b in zip(ts[-8:], ts[-7:])]
            step = statistics.median(gaps)
            t0 = time.time()
            if fault == "node-lost":
                bed.isolate(holder)
            elif fault == "crash":
                procs[holder].send_signal(signal.SIGKILL)
            else:
                procs[holder].send_signal(signal.SIGTERM)
            other = "coord-b" if holder == "coord-a" else "coord-a"
            _wait("the standby taking the lease", lambda: any(t > t0 and h == other for t, h in written),
                  AFTER_TIMEOUT, procs)
            took = min(t for t, h in written if t > t0 and h == other) - t0
            taken = t0 + took

            def committed_past_takeover() -> bool:
                c = _commits(_events(events))
                return all(sum(t > taken for t in c.get(g, [])) >= 5 for g in ("g0", "g1"))
            _wait("both groups committing 5 steps after the takeover", committed_past_takeover,
                  AFTER_TIMEOUT, procs)
            after = _commits(_events(events))
            # The longest time without a commit, per group, from the last commit before the fault
            # to the fifth after the takeover (the groups may commit a while on their quorum).
            longest = 0.0
            for g in ("g0", "g1"):
                ts = sorted(after[g])
                start = max(i for i, t in enumerate(ts) if t <= t0)
                longest = max(longest, max(b - a for a, b in zip(ts[start:], ts[start + 1:])))
            old = procs[holder]
            if fault == "node-lost":
                bed.heal(holder)  # the node returns: its coordinator must end itself, not answer
            try:
                code = old.wait(60)
            except subprocess.TimeoutExpired:
                code = None
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    return {"fault": fault, "holder": holder, "takeover_s": round(took, 3),
            "stall_s": round(longest - step, 3), "step_s": round(step, 3),
            "old_holder_exit": code}


def table(rows: list[dict]) -> str:
    lines = [f"| fault | trials | takeover, s | stall, s | longest stall, s | old holder's exit |",
             "|---|---|---|---|---|---|"]
    for fault in FAULTS:
        got = [r for r in rows if r["fault"] == fault]
        if not got:
            continue
        tm, th = t_interval([r["takeover_s"] for r in got])
        sm, sh = t_interval([r["stall_s"] for r in got])
        exits = sorted({str(r["old_holder_exit"]) for r in got})
        lines.append(f"| {fault} | {len(got)} | {tm:.1f} ± {th:.1f} | {sm:.1f} ± {sh:.1f} | "
                     f"{max(r['stall_s'] for r in got):.1f} | {', '.join(exits)} |")
    return "\n".join(lines)


def _timing() -> str:
    from ftlm.launch.lease import LeaseTiming
    t = LeaseTiming()
    return (f"Lease timing: duration {t.duration:g} s, deadline {t.deadline:g} s, retry {t.retry:g} s "
            "(the defaults). The old holder's exit: 3, it ended itself on finding its lease lapsed "
            "(node-lost: once its node was back); -9, SIGKILLed; 0, stopped after releasing.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coordinator_takeover", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--workdir", default=str(REPO_ROOT / "runs" / "takeover"))
    p.add_argument("--json", default=str(REPO_ROOT / "bench" / "results" / "coordinator_takeover.json"),
                   help="write the rows and the section here (default %(default)s)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    from ftlm.testing.netbed import unavailable_reason
    reason = unavailable_reason()
    if reason:
        print(f"coordinator takeover: the network test bed is unavailable: {reason}", file=sys.stderr)
        return 2
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        p.error(f"--faults {sorted(unknown)}: valid are {', '.join(FAULTS)}")
    # SIGTERM unwinds like Ctrl-C: the bed's exit stops its processes and removes its namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data_dir = ensure_demo()
    rows = []
    started = time.time()
    for i in range(args.trials):
        for fault in faults:
            row = trial(fault, Path(args.workdir) / f"{fault}-{i}", data_dir)
            rows.append(row)
            print(f"[{time.time() - started:5.0f} s] trial {i + 1}/{args.trials} {fault}: takeover "
                  f"{row['takeover_s']:.2f} s, stall {row['stall_s']:.2f} s (step {row['step_s']:.2f} s), "
                  f"old holder exited {row['old_holder_exit']}", flush=True)
    flags = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--no-write"]
    body = (section_header("Coordinator takeover: the Kubernetes standby on the network test bed",
                           "bench.coordinator_takeover", flags)
            + "* Method: " + METHOD + f" {_timing()}"
            + (f" Each trial's figures: `{repo_relative(args.json)}`." if args.json else "")
            + f"\n* Took {time.time() - started:.0f} s.\n\n" + table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows, "section": body}, indent=1) + "\n")
    return publish("coordinator_takeover", body, not args.no_write)


if __name__ == "__main__":
    raise SystemExit(main())
