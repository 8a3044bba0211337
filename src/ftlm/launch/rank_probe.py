"""The liveness probe of a multi-node group's pod: ``python -m ftlm.launch.rank_probe PORT GRACE``.

The pod's main process (PID 1) is torchrun's agent; its children are the node's trainers. When
another node of the group is lost, the agent stops its trainers and waits in the rendezvous for
the replacement pod (minutes: scheduling, image pull), with nothing serving on the metrics
port. A probe of that port alone would kill the surviving pod meanwhile, and the group would
lose a second node. This probe reflects the agent instead:

* no trainer process: the agent is alive (it is PID 1) and waits for its workers' rendezvous;
* trainers that started less than ``GRACE`` seconds ago: still loading (the metrics port opens
  once the model and data are ready);
* otherwise local rank 0's metrics port (``PORT``) must accept a connection: a trainer that no
  longer accepts there is wedged or gone. (Hangs inside a step are the coordinator's to detect.)

Exit status 0 alive, 1 not, with the reason on stdout (the kubelet records it in the pod's
events). Standard library only: it runs every probe period. Not responsible for single-node pods
(their torchrun does not restart workers: a TCP probe of the port is the whole story).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

AGENT_PID = 1


def worker_ages(proc: Path = Path("/proc"), agent: int = AGENT_PID) -> list[float]:
    """Seconds since each child process of ``agent`` started (its trainers)."""
    uptime = float((proc / "uptime").read_text().split()[0])
    ticks = os.sysconf("SC_CLK_TCK")
    ages = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        # The command name (field 2) may hold spaces and parentheses: split after its last ")".
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == agent:  # field 4: the parent's pid
            ages.append(uptime - int(fields[19]) / ticks)  # field 22: start time, in ticks
    return ages


def port_accepts(port: int, host: str = "127.0.0.1", timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def verdict(ages: list[float], accepts: bool, port: int, grace: float) -> tuple[bool, str]:
    """Whether the pod is alive, and why, from its trainers' ages and whether ``port`` accepts."""
    if not ages:
        return True, "no trainer running: the torchrun agent waits for its workers' rendezvous"
    if accepts:
        return True, f"local rank 0 serves on port {port}"
    youngest = min(ages)
    if youngest < grace:
        return True, f"trainers started {youngest:.0f} s ago (< {grace:g} s): still starting"
    return False, (f"local rank 0's metrics port {port} does not accept and its trainers started "
                   f"{youngest:.0f} s ago (>= {grace:g} s): wedged or gone")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        port, grace = int(args[0]), float(args[1])
    except (IndexError, ValueError):
        print("usage: python -m ftlm.launch.rank_probe METRICS_PORT GRACE_SECONDS", file=sys.stderr)
        return 2
    ages = worker_ages()
    alive, why = verdict(ages, bool(ages) and port_accepts(port), port, grace)
    print(why)
    return 0 if alive else 1


if __name__ == "__main__":
    sys.exit(main())
