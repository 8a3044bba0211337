"""A network test bed on one Linux host: every process of a job in its own network namespace,
joined by veth pairs to a bridge, and faults injected with the kernel's own tools.

``NetBed`` (a context manager) makes one namespace per node (the coordinator, each group, each
node of a multi-node group) with its own IPv4 address on a private /24, a veth pair from it to a
bridge in the host's namespace (the bridge holds ``.1``, so the host reaches every node), the
loopback up, and ``/etc/netns/NS/hosts`` mapping this machine's host name to the node's address
(``ip netns exec`` mounts it over ``/etc/hosts``, so that gloo, which binds the address the host
name resolves to, binds the node's address and not 127.0.0.1). ``NetBed.node(name)`` is where a
process runs (``host``, ``prefix``: the ``ip netns exec NS`` a command is started with).

Faults: ``block`` (packets from one node to another dropped, one direction or both),
``isolate`` (every packet of a node dropped: a peer that vanishes without a TCP reset), ``heal``,
``flapping`` (a link cut and restored on a period) as nftables rules in the nodes' namespaces, and
``shape`` (delay, jitter, reordering, loss, rate of a node's link, both directions) with ``tc``:
netem where the kernel has it, else loss by an nftables rule and rate by tbf (delay, jitter and
reordering need netem: ``NetbedUnavailable`` says so). Every fault can be written to a run's
``events.jsonl`` (``record_to``): ``failure_injected`` with ``expect`` (``EXPECTATIONS``) and
``signal`` ``partition`` for a fault the job must detect, ``none`` for one it may ride out; a
heal is ``network_healed``.

Everything is removed by its owner on exit: processes still in a namespace (by PID), namespaces,
links, ``/etc/netns`` entries. Names carry a per-bed id (``ftnb`` + 5 hex digits), and a record
under ``/run/ftlm-netbed`` names the owning process: a new bed first removes the beds whose owner
is gone (a crash, a SIGKILL), so that nothing left behind breaks the next run.

Not responsible for: starting or judging a job (``ftlm launch local`` takes the nodes as its
places; the tests and ``bench.nemesis`` judge). Needs root, ``ip``, ``tc`` and ``nft``
(``unavailable_reason`` says which is missing).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

PREFIX = "ftnb"
"""First letters of every namespace, link and record a bed makes (stale ones are found by it)."""
REGISTRY = Path("/run/ftlm-netbed")
"""Records of live beds: one file per bed id holding its owner's PID and start time."""
NETNS_ETC = Path("/etc/netns")
SUBNETS = ipaddress.ip_network("10.213.0.0/16")
"""Beds take free /24s of this range, one each (the bridge's address routes it on the host)."""
TABLE = "ftlm_netbed"
"""The nftables table of a node's rules, in its own namespace."""
_NODE_NAME = re.compile(r"[A-Za-z0-9._-]{1,40}")
COMMAND_TIMEOUT = 30.0
"""Seconds one ``ip``/``tc``/``nft`` call may take."""


EXPECTATIONS = ("detected", "tolerated", "either")
"""What a job must make of a fault: detect it (a member declared dead, a failed step), ride it
out (nobody convicted: no member declared dead, no group exit), or either (a short cut: TCP's
retransmission back-off may stretch it past a heartbeat timeout)."""


def _check_expect(expect: str) -> None:
    if expect not in EXPECTATIONS:
        raise ValueError(f"expect={expect!r} must be one of {', '.join(EXPECTATIONS)}")


class NetbedUnavailable(RuntimeError):
    """The bed cannot be built here (not root, a missing tool, a kernel without a feature)."""


def unavailable_reason() -> str | None:
    """Why no bed can be built on this machine, or None when one can."""
    if os.geteuid() != 0:
        return "the network test bed needs root (network namespaces, veth, nftables)"
    missing = [tool for tool in ("ip", "tc", "nft") if shutil.which(tool) is None]
    if missing:
        return (f"the network test bed needs {', '.join(missing)}: install the Debian packages "
                f"iproute2 nftables as root (make system-deps)")
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (delay, jitter, reordering)."""
    name = f"{PREFIX}nm{os.getpid() % 100000}"
    if _run(["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"], check=False).returncode:
        return False
    try:
        return _run(["tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms"],
                    check=False).returncode == 0
    finally:
        _run(["ip", "link", "del", name], check=False)


@dataclass(frozen=True)
class LinkShape:
    """How a node's link misbehaves, each direction: netem's words."""

    delay_ms: float = 0.0
    """Added one-way delay."""
    jitter_ms: float = 0.0
    """Random variation of the delay (needs ``delay_ms``)."""
    loss_pct: float = 0.0
    """Packets dropped at random, in percent."""
    reorder_pct: float = 0.0
    """Packets sent at once, ahead of delayed ones, in percent (needs ``delay_ms``)."""
    rate_mbit: float = 0.0
    """Bandwidth cap in Mbit/s; 0: none."""

    def __post_init__(self) -> None:
        for name in ("delay_ms", "jitter_ms", "loss_pct", "reorder_pct", "rate_mbit"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1e9:
                raise ValueError(f"LinkShape.{name}={value!r} must be a number >= 0")
        for name in ("loss_pct", "reorder_pct"):
            if getattr(self, name) > 100:
                raise ValueError(f"LinkShape.{name}={getattr(self, name)!r} is a percentage: 0-100")
        if (self.jitter_ms or self.reorder_pct) and not self.delay_ms:
            raise ValueError(f"LinkShape jitter_ms={self.jitter_ms} / reorder_pct={self.reorder_pct} "
                             f"vary a delay: set delay_ms too")

    def needs_netem(self) -> bool:
        return bool(self.delay_ms or self.jitter_ms or self.reorder_pct)

    def describe(self) -> str:
        parts = [f"delay {self.delay_ms:g} ms" if self.delay_ms else "",
                 f"jitter {self.jitter_ms:g} ms" if self.jitter_ms else "",
                 f"loss {self.loss_pct:g}%" if self.loss_pct else "",
                 f"reorder {self.reorder_pct:g}%" if self.reorder_pct else "",
                 f"rate {self.rate_mbit:g} Mbit/s" if self.rate_mbit else ""]
        return ", ".join(p for p in parts if p) or "clean"


@dataclass(frozen=True)
class Node:
    """Where one process (or one node's processes) runs."""

    name: str
    ns: str
    host: str
    """Its IPv4 address: what it binds and tells others."""
    iface: str
    """Its end of the veth pair, inside its namespace."""

    @property
    def prefix(self) -> list[str]:
        """What a command run in the node is started with."""
        return ["ip", "netns", "exec", self.ns]


@dataclass
class Faults:
    """The nftables faults of a bed as data: which directed pairs drop, which nodes are cut off,
    which links lose packets (without netem). ``ruleset`` renders one node's table."""

    blocked: set[tuple[str, str]] = field(default_factory=set)
    isolated: set[str] = field(default_factory=set)
    loss_pct: dict[str, float] = field(default_factory=dict)

    def ruleset(self, node: Node, hosts: dict[str, str]) -> str:
        """The whole nftables table of ``node`` (replaced at once by ``nft -f``)."""
        out, inp = [], []
        if node.name in self.isolated:
            out.append(f'oifname "{node.iface}" drop')
            inp.append(f'iifname "{node.iface}" drop')
        for src, dst in sorted(self.blocked):
            if src == node.name:
                out.append(f"ip daddr {hosts[dst]} drop")
            if dst == node.name:  # both ends drop: a reply from the far side never gets in
                inp.append(f"ip saddr {hosts[src]} drop")
        loss = self.loss_pct.get(node.name, 0.0)
        if loss:
            per_10k = max(1, round(loss * 100))
            out.append(f'oifname "{node.iface}" numgen random mod 10000 < {per_10k} drop')
            inp.append(f'iifname "{node.iface}" numgen random mod 10000 < {per_10k} drop')
        chain = lambda name, hook, rules: (  # noqa: E731
            f"  chain {name} {{\n    type filter hook {hook} priority 0; policy accept;\n"
            + "".join(f"    {r}\n" for r in rules) + "  }\n")
        return (f"table inet {TABLE} {{\n{chain('input', 'input', inp)}"
                f"{chain('output', 'output', out)}}}\n")


class NetBed:
    """Namespaces for ``nodes`` joined by a bridge; faults between them. Use as a context manager."""

    def __init__(self, nodes: list[str]) -> None:
        if len(set(nodes)) != len(nodes) or not nodes:
            raise ValueError(f"nodes={nodes!r} must be distinct names, at least one")
        if len(nodes) > 200:
            raise ValueError(f"{len(nodes)} nodes: a bed holds at most 200 (one /24)")
        bad = [n for n in nodes if not (isinstance(n, str) and _NODE_NAME.fullmatch(n))]
        if bad:
            raise ValueError(f"node names {bad!r}: use 1-40 letters, digits, '.', '_' or '-' "
                             f"(they name namespaces), e.g. g0 or g1.r1")
        self.names = list(nodes)
        self.id = secrets.token_hex(3)[:5]
        self.bridge = f"{PREFIX}{self.id}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.nodes: dict[str, Node] = {}
        self.faults = Faults()
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._events_path: Path | None = None
        self.netem = False
        """Whether ``shape`` can delay (the kernel has netem); known once the bed is built."""

    # -- building and removing --------------------------------------------------------------
    def __enter__(self) -> NetBed:
        reason = unavailable_reason()
        if reason:
            raise NetbedUnavailable(reason)
        remove_stale()
        self.netem = netem_available()
        with _registry_lock():
            while (REGISTRY / self.id).exists():  # a live bed's id, drawn again
                self.id = secrets.token_hex(3)[:5]
                self.bridge = f"{PREFIX}{self.id}"
            # The record first: a concurrent bed's stale sweep must see this one as owned.
            (REGISTRY / self.id).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        with _registry_lock():  # choosing a free /24 and taking it must not interleave
            self.subnet = _free_subnet()
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{self.subnet[1]}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        hostname = socket.gethostname()
        for i, name in enumerate(self.names):
            ns, outer, inner = f"{self.bridge}-{name}", f"{self.bridge}v{i}", f"{self.bridge}n{i}"
            node = Node(name=name, ns=ns, host=str(self.subnet[i + 2]), iface=inner)
            _run(["ip", "netns", "add", ns])
            self.nodes[name] = node
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{node.host} {hostname}\n")
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{node.host}/24", "dev", inner])
            _run(["ip", "-n", ns, "link", "set", inner, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._apply(node)

    def close(self) -> None:
        """Stop the processes it started and every process left in its namespaces, then remove
        the namespaces, the bridge, the ``/etc/netns`` entries and its record."""
        for proc in self._procs:
            _stop(proc)
        _remove_bed(self.id)

    # -- where processes run ----------------------------------------------------------------
    def node(self, name: str) -> Node:
        if name not in self.nodes:
            raise KeyError(f"no node {name!r} in this bed; it has {', '.join(self.nodes)}")
        return self.nodes[name]

    def popen(self, name: str, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` in node ``name``; the bed stops it (by PID) when it closes."""
        proc = subprocess.Popen(self.node(name).prefix + cmd, **kwargs)
        self._procs.append(proc)
        return proc

    def exec(self, name: str, cmd: list[str], timeout: float = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
        """Run ``cmd`` in node ``name`` to its end (at most ``timeout`` s)."""
        return subprocess.run(self.node(name).prefix + cmd, capture_output=True, text=True,
                              timeout=timeout)

    # -- faults -----------------------------------------------------------------------------
    def record_to(self, events: Path | None) -> None:
        """Write each fault from now on to ``events`` (a run's ``events.jsonl``); None: stop."""
        self._events_path = events

    def block(self, src: str, dst: str, both_ways: bool = True, expect: str = "detected") -> None:
        """Drop every packet from ``src`` to ``dst`` (and back, unless ``both_ways`` is False).
        ``expect``: what the job must make of it (``EXPECTATIONS``), as recorded."""
        self._block(src, dst, both_ways, expect)

    def _block(self, src: str, dst: str, both_ways: bool, expect: str, **fields: object) -> None:
        _check_expect(expect)
        pairs = {(src, dst), (dst, src)} if both_ways else {(src, dst)}
        for a, b in pairs:
            self.node(a), self.node(b)
        with self._lock:
            self.faults.blocked |= pairs
            self._apply(self.node(src), self.node(dst))
        self._record(src, expect, fault="block", peer=dst, both_ways=both_ways, **fields)

    def isolate(self, name: str, expect: str = "detected") -> None:
        """Drop every packet to and from ``name``: it vanishes without a TCP reset."""
        _check_expect(expect)
        with self._lock:
            self.faults.isolated.add(name)
            self._apply(self.node(name))
        self._record(name, expect, fault="isolate")

    def heal(self, name: str | None = None) -> None:
        """Lift the blocks and isolation involving ``name`` (every one when None)."""
        with self._lock:
            if name is None:
                touched = set(self.nodes)
                self.faults.blocked.clear()
                self.faults.isolated.clear()
            else:
                touched = {name} | {x for pair in self.faults.blocked if name in pair for x in pair}
                self.faults.blocked = {p for p in self.faults.blocked if name not in p}
                self.faults.isolated.discard(name)
            self._apply(*(self.nodes[n] for n in touched))
        self._record_heal(name)

    @contextmanager
    def flapping(self, a: str, b: str, down_s: float, up_s: float,
                 expect: str = "either") -> Iterator[list[float]]:
        """While the block runs, cut the link between ``a`` and ``b`` for ``down_s`` seconds and
        restore it for ``up_s``, over and over (yields the times it went down). Healed on exit."""
        if down_s <= 0 or up_s <= 0:
            raise ValueError(f"flapping down_s={down_s} and up_s={up_s} must both be > 0 seconds")
        stop, downs = threading.Event(), []

        def flap() -> None:
            while not stop.is_set():
                downs.append(time.time())
                self._block(a, b, True, expect, flap=True)
                stop.wait(down_s)
                self.heal(a)
                stop.wait(up_s)

        thread = threading.Thread(target=flap, name=f"netbed-flap-{a}-{b}", daemon=True)
        thread.start()
        try:
            yield downs
        finally:
            stop.set()
            thread.join(timeout=down_s + up_s + COMMAND_TIMEOUT)
            self.heal(a)

    def shape(self, name: str, shape: LinkShape | None) -> None:
        """Make ``name``'s link (both directions) behave as ``shape``; None or a clean shape
        restores it. Delay, jitter and reordering need netem (``NetbedUnavailable`` without)."""
        node = self.node(name)
        shape = shape or LinkShape()
        if shape.needs_netem() and not self.netem:
            raise NetbedUnavailable(
                f"{shape.describe()}: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), "
                f"which delay, jitter and reordering need; loss and rate work without it")
        outer = f"{self.bridge}v{self.names.index(name)}"  # its veth end on the bridge
        for ns, dev in ((node.ns, node.iface), (None, outer)):
            ip = ["tc"] + (["-n", ns] if ns else [])
            _run(ip + ["qdisc", "del", "dev", dev, "root"], check=False)
            args = _qdisc_args(shape, self.netem)
            if args:
                _run(ip + ["qdisc", "add", "dev", dev, "root", *args])
        with self._lock:
            if self.netem or not shape.loss_pct:
                self.faults.loss_pct.pop(name, None)
            else:
                self.faults.loss_pct[name] = shape.loss_pct
            self._apply(node)
        if shape == LinkShape():
            self._record_heal(name)
        else:
            self._record(name, "tolerated", fault="shape", shape=shape.describe())

    # -- the shell ----------------------------------------------------------------------------
    def _apply(self, *nodes: Node) -> None:
        hosts = {n: node.host for n, node in self.nodes.items()}
        for node in nodes:
            table = f"table inet {TABLE}\ndelete table inet {TABLE}\n" + self.faults.ruleset(node, hosts)
            _run(["ip", "netns", "exec", node.ns, "nft", "-f", "-"], stdin=table)

    def _record(self, target: str, expect: str, **fields: object) -> None:
        if self._events_path is None:
            return
        from ftlm.observe.events import EventLog
        # "partition": a failure the run's failure ledger must see detected; "none": a
        # disturbance (ftlm.observe.events.NOT_FAILURES).
        with EventLog(self._events_path, group="netbed") as log:
            log.emit("failure_injected", step=-1, target=target, expect=expect,
                     signal="partition" if expect == "detected" else "none", **fields)

    def _record_heal(self, name: str | None) -> None:
        if self._events_path is None:
            return
        from ftlm.observe.events import EventLog
        with EventLog(self._events_path, group="netbed") as log:
            log.emit("network_healed", step=-1, target=name or "*")


def _qdisc_args(shape: LinkShape, netem: bool) -> list[str]:
    """``tc qdisc add ... root`` arguments of ``shape`` (empty: none needed)."""
    if netem and (shape.needs_netem() or shape.loss_pct or shape.rate_mbit):
        args = ["netem"]
        if shape.delay_ms:
            args += ["delay", f"{shape.delay_ms:g}ms"]
            args += [f"{shape.jitter_ms:g}ms"] if shape.jitter_ms else []
        args += ["loss", f"{shape.loss_pct:g}%"] if shape.loss_pct else []
        args += ["reorder", f"{shape.reorder_pct:g}%"] if shape.reorder_pct else []
        args += ["rate", f"{shape.rate_mbit:g}mbit"] if shape.rate_mbit else []
        return args
    if shape.rate_mbit:  # loss, without netem, is an nftables rule (Faults.loss_pct)
        burst = max(16, int(shape.rate_mbit * 1000 / 8 / 100))  # 10 ms of traffic, in kbyte
        return ["tbf", "rate", f"{shape.rate_mbit:g}mbit", "burst", f"{burst}kb", "latency", "200ms"]
    return []


# -- stale beds and the registry -------------------------------------------------------------
def remove_stale() -> list[str]:
    """Remove every bed whose owner process is gone; returns their ids."""
    ids = set()
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(PREFIX):
            ids.add(_bed_id(name))
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(": ")
        if len(parts) > 1 and parts[1].startswith(PREFIX):
            ids.add(_bed_id(parts[1].split("@")[0]))
    if NETNS_ETC.is_dir():
        ids |= {_bed_id(p.name) for p in NETNS_ETC.iterdir() if p.name.startswith(PREFIX)}
    if REGISTRY.is_dir():
        ids |= {p.name for p in REGISTRY.iterdir() if not p.name.startswith(".")}
    stale = sorted(i for i in ids if i and not _owner_alive(i))
    for bed in stale:
        _remove_bed(bed)
    return stale


def _bed_id(name: str) -> str:
    return name[len(PREFIX):len(PREFIX) + 5]


def _owner_alive(bed: str) -> bool:
    try:
        pid, start = (REGISTRY / bed).read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid)) == start


def _start_time(pid: int) -> str:
    """The start time of process ``pid`` (guards against a reused PID); "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return ""


def _remove_bed(bed: str) -> None:
    """Kill what runs in bed ``bed``'s namespaces, delete them and its links, entries, record."""
    prefix = f"{PREFIX}{bed}"
    spaces = [line.split()[0] for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines()
              if line.strip().startswith(prefix + "-")]
    for ns in spaces:
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _wait_gone([int(p) for p in pids if p.isdigit()], timeout=10.0)
        _run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(": ")
        if len(parts) > 1 and parts[1].split("@")[0].startswith(prefix):
            _run(["ip", "link", "del", parts[1].split("@")[0]], check=False)
    if NETNS_ETC.is_dir():
        for p in NETNS_ETC.glob(prefix + "-*"):
            shutil.rmtree(p, ignore_errors=True)
    (REGISTRY / bed).unlink(missing_ok=True)


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _start_time(p)]
        if pids:
            time.sleep(0.05)


def _stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` s; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


@contextmanager
def _registry_lock() -> Iterator[None]:
    REGISTRY.mkdir(parents=True, exist_ok=True)
    with open(REGISTRY / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of ``SUBNETS`` that no address of the host's namespace is in."""
    used = set()
    for line in _run(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines():
        for word in line.split():
            if "/" in word and word[0].isdigit():
                try:
                    used.add(ipaddress.ip_interface(word).network.supernet(new_prefix=24)
                             if ipaddress.ip_interface(word).network.prefixlen > 24
                             else ipaddress.ip_interface(word).network)
                except ValueError:
                    continue
    for net in SUBNETS.subnets(new_prefix=24):
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetbedUnavailable(f"every /24 of {SUBNETS} is in use: remove stale beds (ip netns list)")


def _run(cmd: list[str], check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=COMMAND_TIMEOUT)
    if check and proc.returncode != 0:
        raise NetbedUnavailable(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc
