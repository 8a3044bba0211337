"""A throwaway one-node Slurm cluster (munged, slurmctld, slurmd) for the Slurm launcher tests.

It runs as root from the Debian packages (``make system-deps-cluster``) with its own config,
munge socket, ports and state under a temporary folder, so it touches nothing of the machine's
own Slurm or munge. Without systemd or cgroups it uses proctrack/linuxproc and task/none.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


def missing_reason() -> str | None:
    """Why a real Slurm cannot start here, or None."""
    absent = [t for t in TOOLS if not shutil.which(t) and not Path(f"/usr/sbin/{t}").exists()]
    if absent:
        return f"Slurm/munge not installed ({', '.join(absent)}): run `make system-deps-cluster`"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root (SlurmUser=root)"
    if not Path("/etc/munge/munge.key").is_file():
        return "no /etc/munge/munge.key (the munge package creates it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """Start with ``start()``, stop with ``stop()``; ``env`` points Slurm commands at it."""

    def __init__(self, root: Path, cpus: int = 16, cred_expire: int = 10):
        self.root = root
        self.cpus = cpus
        # Also how long a requeued job waits before it may start again (default 120 s).
        self.cred_expire = cred_expire
        self.host = socket.gethostname()
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))

    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        shutil.copy("/etc/munge/munge.key", r / "munge.key")
        (r / "munge.key").chmod(0o600)
        ctld, slurmd = _free_port(), _free_port()
        (r / "slurm.conf").write_text(f"""ClusterName=ftlmtest
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge.sock,cred_expire={self.cred_expire}
CredType=cred/munge
SlurmctldPort={ctld}
SlurmdPort={slurmd}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=10
MpiDefault=none
NodeName={self.host} CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self, timeout: float = 30.0) -> None:
        self._write_config()
        r = self.root
        subprocess.run([_binary("munged"), "--force", f"--socket={r}/munge.sock",
                        f"--key-file={r}/munge.key", f"--pid-file={r}/run/munged.pid",
                        f"--log-file={r}/munged.log", f"--seed-file={r}/munge.seed"],
                       check=True, timeout=30, env=self.env)
        subprocess.run([_binary("slurmctld")], check=True, timeout=30, env=self.env)
        subprocess.run([_binary("slurmd")], check=True, timeout=30, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                 timeout=10, env=self.env).stdout.strip()
            if out in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.2)  # polling a daemon we do not own the events of
        raise RuntimeError(f"slurm node not up after {timeout} s: {out!r}; see {r}/slurmd.log")

    def stop(self) -> None:
        subprocess.run(["scancel", "--user=root"], timeout=30, env=self.env, check=False)
        deadline = time.monotonic() + 30  # let slurmd end the jobs' processes before it goes
        while time.monotonic() < deadline and subprocess.run(
                ["squeue", "-h"], capture_output=True, text=True, timeout=10,
                env=self.env).stdout.strip():
            time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / "run" / f"{name}.pid"
            if not pid_file.is_file():
                continue
            pid = int(pid_file.read_text().split()[0])
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
        # What the cluster started and did not end (a test killed by its timeout mid-job): every
        # slurmstepd and job process carries this cluster's SLURM_CONF, a path of its own.
        for pid in self._started_by_us():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _started_by_us(self) -> list[int]:
        """PIDs of live processes whose environment names this cluster's slurm.conf."""
        marker = f"SLURM_CONF={self.root / 'slurm.conf'}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            if marker in environ.split(b"\0"):
                found.append(int(entry.name))
        return found
