"""Settings of the fault-tolerant runtime: the coordinator's own section.

Only the dataclasses and their validation live here; the coordinator, client and manager read them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ftlm.errors import ConfigError

_COORDINATOR = "coordinator"  # prefix of field names in error messages


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require_number(section: str, name: str, value: object, *, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:  # inf and nan are no durations (nan passes every comparison check silently)
        ok = ok and math.isfinite(float(value))
    except OverflowError:  # an int beyond the float range
        ok = False
    if ok and (value > 0 if positive else value >= 0):
        return
    bound = "> 0" if positive else ">= 0"
    raise ConfigError(f"{section}.{name}={value!r} must be a finite number of seconds {bound}")


@dataclass
class CoordinatorConfig:
    """The coordinator server: where it listens, when it issues a quorum, what it accepts."""

    host: str = "127.0.0.1"
    """Address to bind; 127.0.0.1 keeps it on this machine, 0.0.0.0 exposes it (set a token then)."""
    port: int = 0
    """TCP port to listen on; 0 lets the operating system choose a free one."""
    min_replicas: int = 1
    """Fewest replica groups a quorum may have; fewer asking means the step waits."""
    join_timeout: float = 2.0
    """Seconds to wait for stragglers after a round's first request when membership changed."""
    heartbeat_timeout: float = 1.0
    """Seconds without a heartbeat after which a group is declared dead."""
    token: str = ""
    """Shared job token required as ``Authorization: Bearer <token>``; empty disables auth."""
    max_request_bytes: int = 65536
    """Largest request body accepted; bigger ones get 413."""
    tick_interval: float = 0.05
    """Seconds between re-evaluations without traffic (fires join and heartbeat timeouts)."""
    expected_groups: int = 0
    """Groups the job starts with; the first quorum waits up to join_timeout for all of them."""
    max_participants: int = 0
    """Most groups that train data in one step; the other up-to-date groups are hot spares that
    follow every step and replace a failed one at once (``ft.spares``); 0: every group trains."""
    progress_timeout: float = 0.0
    """Seconds a heartbeating group may make no protocol progress before it is declared hung
    (0: never; ``ft.progress_timeout`` sets it for a job)."""
    suspect_window: float = 0.0
    """Seconds after a member reports its quorum's step failed within which the other members
    must be heard from, or be declared dead (no supervisor needed); 0: off, below heartbeat_timeout."""
    probe_after_failures: int = 3
    """Failed attempts of one step by three or more groups after which the coordinator tries the
    step without half the suspected groups at a time, to find the group whose link (or device)
    fails every step it takes part in, and retires it (it is restarted); 0: never
    (``ft.probe_after_failures``)."""
    read_timeout: float = 5.0
    """Seconds a client may take to send a whole request (headers, then body) and the longest an
    idle connection stays open; slower clients are disconnected (slowloris)."""
    max_connections: int = 4096
    """Most connections open at once; beyond it a new connection gets 503 and is closed at once,
    while members already connected keep their keep-alive connections."""
    insecure: bool = False
    """Allow a non-loopback ``host`` without a token (anyone reaching the port can then steer the
    job); ``ftlm coordinator --insecure``. Without it such a configuration is refused."""
    tls_cert: str = ""
    """PEM certificate the coordinator presents (serves https://); empty: plain HTTP."""
    tls_key: str = ""
    """PEM private key of ``tls_cert``; set both or neither."""

    def __post_init__(self) -> None:
        s = _COORDINATOR
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"{s}.host={self.host!r} must be a non-empty address such as 127.0.0.1")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ConfigError(f"{s}.port={self.port!r} must be an integer in [0, 65535] (0: any free port)")
        if not isinstance(self.min_replicas, int) or isinstance(self.min_replicas, bool) or self.min_replicas < 1:
            raise ConfigError(f"{s}.min_replicas={self.min_replicas!r} must be an integer >= 1")
        _require_number(s, "join_timeout", self.join_timeout, positive=False)
        _require_number(s, "heartbeat_timeout", self.heartbeat_timeout, positive=True)
        _require_number(s, "tick_interval", self.tick_interval, positive=True)
        if self.tick_interval >= self.heartbeat_timeout:
            raise ConfigError(
                f"{s}.tick_interval={self.tick_interval!r} must be below "
                f"{s}.heartbeat_timeout={self.heartbeat_timeout!r}, or dead groups are noticed late"
            )
        if not isinstance(self.token, str):
            raise ConfigError(f"{s}.token must be a string (empty disables auth), got {type(self.token).__name__}")
        _require_number(s, "progress_timeout", self.progress_timeout, positive=False)
        _require_number(s, "suspect_window", self.suspect_window, positive=False)
        if self.suspect_window >= self.heartbeat_timeout:
            raise ConfigError(f"{s}.suspect_window={self.suspect_window!r} must be below {s}.heartbeat_timeout="
                              f"{self.heartbeat_timeout!r} (0 turns it off)")
        paf = self.probe_after_failures
        if not isinstance(paf, int) or isinstance(paf, bool) or paf < 0:
            raise ConfigError(f"{s}.probe_after_failures={paf!r} must be an integer >= 0 (0: never probe)")
        mp = self.max_participants
        if not isinstance(mp, int) or isinstance(mp, bool) or mp < 0:
            raise ConfigError(f"{s}.max_participants={mp!r} must be an integer >= 0 (0: every group trains)")
        mrb = self.max_request_bytes
        if not isinstance(mrb, int) or isinstance(mrb, bool) or mrb < 1024:
            raise ConfigError(f"{s}.max_request_bytes={mrb!r} must be an integer >= 1024")
        _require_number(s, "read_timeout", self.read_timeout, positive=True)
        mc = self.max_connections
        if not isinstance(mc, int) or isinstance(mc, bool) or mc < 8:
            raise ConfigError(f"{s}.max_connections={mc!r} must be an integer >= 8")
        if not isinstance(self.insecure, bool):
            raise ConfigError(f"{s}.insecure={self.insecure!r} must be true or false")
        for name in ("tls_cert", "tls_key"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{s}.{name}={getattr(self, name)!r} must be the path of a PEM "
                                  f"file, or empty for plain HTTP")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(f"{s}.tls_cert={self.tls_cert!r} and {s}.tls_key={self.tls_key!r}: "
                              f"set both (the certificate and its private key) or neither")
        if not self.token and not self.insecure and not is_loopback(self.host):
            raise ConfigError(
                f"{s}.host={self.host!r} is reachable from other machines but no job token is set: "
                f"anyone who reaches the port could kill groups and steer the job; set FTLM_TOKEN "
                f"(or ft.token_file), bind 127.0.0.1, or pass --insecure on a trusted network")


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address or ``localhost``) is reachable only from this machine."""
    import ipaddress
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to any interface


LR_POLICIES = ("none", "linear", "sqrt")
SNAPSHOT_SERVERS = ("process", "thread")
SYNC_MODES = ("every_step", "diloco")
WIRE_DTYPES = ("float32", "bfloat16", "int8")
FRAGMENT_SPLITS = ("contiguous", "strided")


@dataclass
class FTConfig:
    """The ``[ft]`` section: fault tolerance across replica groups (off without a coordinator)."""

    coordinator: str = ""
    """Coordinator URL; empty means the ``FTLM_COORDINATOR`` environment variable, or no FT."""
    token_file: str = ""
    """File holding the job token when ``FTLM_TOKEN`` is not set; empty means no token."""
    groups: int = 0
    """Replica groups the job is meant to have (N of the degraded-mode LR); the launcher sets it."""
    spares: int = 0
    """Hot spare groups beyond ``groups``: up to date with every step but training no data, each
    takes a failed group's place in the next step without a catch-up (the launcher sets it from
    ``cluster.spares`` or ``--spares``). The job's groups train ``groups`` at a time."""
    min_replicas: int = 1
    """Fewest groups that may form a quorum."""
    heartbeat_interval: float = 0.1
    """Seconds between a group leader's heartbeats."""
    heartbeat_timeout: float = 1.0
    """Seconds without a heartbeat after which a group is declared dead."""
    suspect_window: float = 0.0
    """Seconds after a group reports a failed step (a peer's transport error) within which its
    quorum's other groups must be heard from, or be declared dead before heartbeat_timeout.
    0 means two heartbeat intervals (at most halfway to heartbeat_timeout); must lie between
    heartbeat_interval and heartbeat_timeout."""
    join_timeout: float = 2.0
    """Seconds a changed quorum waits for stragglers before forming without them."""
    allreduce_timeout: float = 10.0
    """Seconds a cross-group collective (or joining its group) may take before the step fails."""
    progress_timeout: float = 0.0
    """Seconds a group may go without reaching a protocol point (asking, training, voting,
    committing) while its heartbeat lives before it is declared hung: catches a hung non-leader
    rank or a wedged training thread. Must exceed the longest step (forward, backward, save).
    0 means halfway between ``allreduce_timeout`` and ``quorum_timeout``."""
    quorum_timeout: float = 60.0
    """Seconds a group waits for a quorum before giving up (the supervisor then restarts it),
    counted while the coordinator answers without one; time it does not answer at all is
    ``coordinator_outage_timeout``'s."""
    coordinator_outage_timeout: float = 0.0
    """Seconds a group waits, keeping its state, while the coordinator does not answer at all
    (refused, reset, timed out) before it gives up and exits; 0 waits for as long as the outage
    lasts: the coordinator's supervisor brings it back, and a group that exited would only lose
    its state (a SIGTERM still stops it at once)."""
    give_up_seconds: float = 300.0
    """Seconds without any committed step after which the local launcher ends the job."""
    max_consecutive_failures: int = 20
    """Failed steps in a row after which a group exits with an error."""
    probe_after_failures: int | None = None
    """Failed attempts of one step by three or more groups after which the coordinator retries it
    without half the suspected groups at a time (they wait) to find the group that fails every
    step it takes part in (a bad link, a faulty device), and retires that group: its process
    exits and is restarted; a group found so before is tried without first. 0: never (every
    group then gives up after ``max_consecutive_failures``). Must be below
    ``max_consecutive_failures``; unset: 3, or one below ``max_consecutive_failures``."""
    lr_policy: str = "sqrt"
    """LR scaling with P of N groups participating: none, linear (P/N) or sqrt (sqrt(P/N))."""
    catchup_max_steps: int = 64
    """Averaged updates a recovering group buffers before it asks for a fresher snapshot."""
    catchup_max_bytes: int = 4 << 30
    """Host memory (bytes, per rank) the catch-up buffer may hold; each buffered step costs one
    gradient shard. Checked at start: it must hold at least one step of the real shard."""
    bucket_bytes: int = 25 << 20
    """Size of the flat buckets of the gradient all-reduce."""
    transfer_parallel: int = 4
    """Parallel connections of a live state transfer from a source on another host."""
    transfer_parallel_local: int = 1
    """Parallel connections of a live state transfer from a source on this host (groups launched
    side by side): there more connections buy no bandwidth, only the cores the other groups train
    on (at 82M, part 3's plan of ``bench.ft_vs_torchft`` run by hand: a rejoin stalled the others
    0.57-0.82 s with one connection, 1.19-1.35 s with four)."""
    transfer_chunk_bytes: int = 4 << 20
    """Chunk size of a live state transfer (each chunk is checksummed)."""
    snapshot_server: str = "process"
    """Where a source serves its snapshots from: ``process``, a child process at CPU priority
    ``serve_nice`` reading the snapshot from shared memory (Linux), so that serving shares no
    interpreter lock with training; or ``thread``, threads of the training process at
    ``transfer_nice`` (``ftlm.ft.serve_process``)."""
    serve_nice: int = 19
    """CPU priority (nice value, 0-19) of the snapshot server process (``snapshot_server =
    'process'``); 19, the lowest, lets training run first where cores are short, and the transfer
    gets the cores training leaves idle (``bench.serve_impact`` on 2 cores: a source's step
    +0.5-5% while it serves, against +220-370% at 0). Unlike serving threads at 19, the process
    never stalls the group's heartbeat (``bench.transfer_priority``: ticks at most 12 ms late
    against 287 ms)."""
    snapshot_reserve: bool = False
    """Keep the memory of the next snapshot allocated ahead (one more host copy of this rank's
    parameters and optimizer state, prepared on a background thread while no peer recovers): a
    source's snapshot copy then writes into pages that exist instead of faulting in new ones,
    3.5x less CPU on the step every healthy group waits for (``ftlm.ft.snapshot_reserve``). For
    hosts with idle CPU cores (GPU nodes), where preparing it costs training nothing. Off by
    default: where every core trains (the 2-core CPU box) the preparation takes the same CPU at
    another moment, and the rejoin stall measured no better (BENCHMARKS, transfer section)."""
    integrity_every: int = 100
    """Every this many committed steps each participant digests its replicated state (parameters
    and optimizer state, on a background thread while the step's forward and backward run) and
    sends the digest with its next quorum request: a group whose state differs from the
    majority's is retired and recovers from a majority member (silent data corruption,
    ``ftlm.ft.integrity``). 0 turns it off. The default costs under 1% of a step (BENCHMARKS,
    'State integrity')."""
    transfer_nice: int = 0
    """CPU priority (nice value, 0-19) of the threads of the training process that move a
    snapshot: the pulling threads, and the serving threads with ``snapshot_server = 'thread'``;
    0 (the default) gives them the training thread's priority. Above 0, where cores are short, a
    transfer thread preempted while it holds the interpreter lock stalls the group's heartbeat
    and training threads (``bench.transfer_priority``: ticks up to 0.6-2.4 s late at 19, beyond
    the 1 s heartbeat timeout; pulls 18x slower), so peers declare a healthy group dead."""
    host: str = "127.0.0.1"
    """Address a group binds its rendezvous store and state server to and tells other groups;
    on a cluster, the pod or node IP (the ``FTLM_HOST`` environment variable overrides it)."""
    tls_cert: str = ""
    """PEM certificate the group's state server and ``ftlm coordinator`` present (they serve
    https://); empty: plain HTTP."""
    tls_key: str = ""
    """PEM private key of ``tls_cert``; set both or neither."""
    tls_ca: str = ""
    """PEM CA that must have signed a peer's certificate before this group pulls state from it,
    and the coordinator's before this group talks to an https:// coordinator."""
    restart_delay: float = 1.0
    """Seconds the local supervisor waits before restarting a group whose process died."""
    startup_timeout: float = 120.0
    """Seconds a started group process may take to register with the coordinator (first
    heartbeat) before the supervisor declares it hung, kills and restarts it."""
    startup_stall_timeout: float = 15.0
    """Seconds a starting group process (any of its ranks) may show no sign of life before the
    local supervisor declares it hung: each rank rewrites a start-up beacon from a thread of its
    own from its first instant, whatever it is doing (importing, loading data, joining its
    ranks), until its group has made progress; a beacon that stops means the process stopped
    (``ftlm.startup_beacon``). Catches a start-up hang in seconds where ``startup_timeout`` would
    take minutes. 0: off (as is any value above ``startup_timeout``, which ends the start first)."""
    crash_loop_restarts: int = 5
    """A group whose processes exit this many times within ``crash_loop_seconds`` without ever
    committing a step is crash-looping: the local launcher stops the job with its error."""
    crash_loop_seconds: float = 120.0
    """Window of ``crash_loop_restarts``."""
    coordinator_max_connections: int = 4096
    """Most connections the job's coordinator keeps open at once. Each group's leader holds two
    (its quorum requests' and its heartbeats'), so the default serves about 2,000 groups; raise
    it (and the coordinator host's ``ulimit -n``) for more."""
    sync: str = "every_step"
    """How groups synchronise: ``every_step`` (average every gradient, every step) or ``diloco``
    (each group takes ``diloco_inner_steps`` optimizer steps alone, then the groups average the
    pseudo-gradient and apply it with an outer optimizer; docs/diloco.md). With ``diloco`` one
    ``train.steps`` is one synchronisation (of the model, or of one fragment)."""
    diloco_inner_steps: int = 100
    """H: inner optimizer steps between two synchronisations of the same parameters."""
    diloco_outer_lr: float = 0.7
    """Learning rate of the outer optimizer (SGD) applied to the averaged pseudo-gradient."""
    diloco_outer_momentum: float = 0.9
    """Momentum of the outer SGD (0: plain averaging when ``diloco_outer_lr`` is 1)."""
    diloco_nesterov: bool = True
    """Nesterov momentum for the outer SGD (needs ``diloco_outer_momentum`` > 0)."""
    diloco_fragments: int = 1
    """Streaming DiLoCo: the parameters are cut into this many fragments, synchronised in turn,
    one every ``diloco_inner_steps / diloco_fragments`` inner steps (which must be whole)."""
    diloco_fragment_split: str = "strided"
    """How parameters are assigned to fragments: ``strided`` (parameter i to fragment i mod F:
    every fragment spans the depth of the model) or ``contiguous`` (runs of consecutive
    parameters of about equal bytes)."""
    diloco_overlap_steps: int = 0
    """Inner steps a fragment's outer all-reduce overlaps with (0: the sync blocks); below the
    inner steps between two synchronisations."""
    diloco_merge_alpha: float = 0.5
    """With overlap: weight of the local parameters when the outer update is merged into them
    (``alpha * local + (1 - alpha) * outer``); without overlap the outer state replaces them."""
    diloco_wire_dtype: str = "float32"
    """Dtype of the outer gradient between groups: ``float32``, ``bfloat16`` or ``int8``
    (quantised per 4096 values against the participants' summed range, with error feedback)."""

    def __post_init__(self) -> None:
        s = "ft"
        _require_number(s, "progress_timeout", self.progress_timeout, positive=False)
        _require_number(s, "suspect_window", self.suspect_window, positive=False)
        if self.suspect_window == 0 and _is_number(self.heartbeat_interval) and _is_number(self.heartbeat_timeout):
            self.suspect_window = min(2 * self.heartbeat_interval, (self.heartbeat_interval + self.heartbeat_timeout) / 2)
        if self.progress_timeout == 0 and _is_number(self.allreduce_timeout) and _is_number(self.quorum_timeout):
            self.progress_timeout = (self.allreduce_timeout + self.quorum_timeout) / 2
        for name in ("heartbeat_interval", "heartbeat_timeout", "allreduce_timeout",
                     "progress_timeout", "quorum_timeout", "give_up_seconds", "startup_timeout",
                     "crash_loop_seconds"):
            _require_number(s, name, getattr(self, name), positive=True)
        _require_number(s, "join_timeout", self.join_timeout, positive=False)
        _require_number(s, "restart_delay", self.restart_delay, positive=False)
        _require_number(s, "coordinator_outage_timeout", self.coordinator_outage_timeout, positive=False)
        _require_number(s, "startup_stall_timeout", self.startup_stall_timeout, positive=False)
        for name, low in (("groups", 0), ("spares", 0), ("min_replicas", 1), ("max_consecutive_failures", 1),
                          ("catchup_max_steps", 1), ("catchup_max_bytes", 1), ("bucket_bytes", 1),
                          ("transfer_parallel", 1), ("transfer_parallel_local", 1), ("integrity_every", 0),
                          ("crash_loop_restarts", 1), ("coordinator_max_connections", 8),
                          ("transfer_chunk_bytes", 1024)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{s}.{name}={value!r} must be an integer >= {low}")
        if self.spares and not self.groups:
            raise ConfigError(f"{s}.spares={self.spares} needs {s}.groups (the groups that train; the "
                              "spares stand by beside them): set ft.groups, or launch with --groups")
        if self.probe_after_failures is None:
            self.probe_after_failures = min(3, self.max_consecutive_failures - 1)
        paf = self.probe_after_failures
        if not isinstance(paf, int) or isinstance(paf, bool) or paf < 0:
            raise ConfigError(f"{s}.probe_after_failures={paf!r} must be an integer >= 0 (0: never probe)")
        if paf and paf >= self.max_consecutive_failures:
            raise ConfigError(f"{s}.probe_after_failures={paf} must be below {s}.max_consecutive_failures="
                              f"{self.max_consecutive_failures}: the groups would give up before the "
                              "coordinator looks for the one that fails the steps (0 turns probing off)")
        if not isinstance(self.snapshot_reserve, bool):
            raise ConfigError(f"{s}.snapshot_reserve={self.snapshot_reserve!r} must be true or "
                              "false")
        for name in ("transfer_nice", "serve_nice"):
            nice = getattr(self, name)
            if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= 19:
                raise ConfigError(f"{s}.{name}={nice!r} must be an integer from 0 (the "
                                  "training thread's priority) to 19 (the lowest)")
        if self.snapshot_server not in SNAPSHOT_SERVERS:
            raise ConfigError(f"{s}.snapshot_server={self.snapshot_server!r}; valid: "
                              f"{', '.join(SNAPSHOT_SERVERS)} ('process': a child process "
                              f"serves from shared memory, Linux only; 'thread': threads of "
                              f"the training process)")
        self._check_diloco()
        if self.lr_policy not in LR_POLICIES:
            raise ConfigError(f"{s}.lr_policy={self.lr_policy!r}; valid: {', '.join(LR_POLICIES)}")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, name)
            if not isinstance(value, str) or (value and not os.path.isfile(value)):
                raise ConfigError(f"{s}.{name}={value!r} must be the path of an existing PEM "
                                  f"file, or empty for no TLS")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(f"{s}.tls_cert={self.tls_cert!r} and {s}.tls_key={self.tls_key!r}: "
                              f"set both (the certificate and its private key) or neither")
        if not self.heartbeat_interval < self.suspect_window < self.heartbeat_timeout:
            raise ConfigError(
                f"{s}.suspect_window={self.suspect_window} must lie between {s}.heartbeat_interval="
                f"{self.heartbeat_interval} (a healthy group must have time to speak) and "
                f"{s}.heartbeat_timeout={self.heartbeat_timeout} (or 0: two heartbeat intervals)")
        chain = [("heartbeat_interval", self.heartbeat_interval),
                 ("heartbeat_timeout", self.heartbeat_timeout),
                 ("allreduce_timeout", self.allreduce_timeout),
                 ("progress_timeout", self.progress_timeout),
                 ("quorum_timeout", self.quorum_timeout),
                 ("give_up_seconds", self.give_up_seconds)]
        for (a, va), (b, vb) in zip(chain, chain[1:]):
            if not va < vb:
                raise ConfigError(
                    f"timeout chain broken: {s}.{a}={va} must be below {s}.{b}={vb} "
                    "(heartbeat interval < heartbeat timeout < all-reduce timeout < progress "
                    "timeout < quorum timeout < give-up; docs/design.md, 'Failure detection')")

    def _check_diloco(self) -> None:
        s = "ft"
        if self.sync not in SYNC_MODES:
            raise ConfigError(f"{s}.sync={self.sync!r}; valid: every_step (average every step's "
                              "gradient), diloco (sync every ft.diloco_inner_steps steps)")
        for name, low in (("diloco_inner_steps", 1), ("diloco_fragments", 1),
                          ("diloco_overlap_steps", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"{s}.{name}={value!r} must be an integer >= {low}")
        h, f = self.diloco_inner_steps, self.diloco_fragments
        if h % f:
            raise ConfigError(f"{s}.diloco_inner_steps={h} must be a multiple of "
                              f"{s}.diloco_fragments={f}: one fragment is synchronised every "
                              f"inner_steps/fragments steps (e.g. diloco_inner_steps={h - h % f or f})")
        if self.diloco_overlap_steps >= h // f:
            raise ConfigError(f"{s}.diloco_overlap_steps={self.diloco_overlap_steps} must be below "
                              f"the {h // f} inner steps between two synchronisations "
                              f"(diloco_inner_steps / diloco_fragments); 0 turns overlap off")
        for name, low, high in (("diloco_outer_lr", 0.0, math.inf),
                                ("diloco_outer_momentum", 0.0, 1.0),
                                ("diloco_merge_alpha", 0.0, 1.0)):
            value = getattr(self, name)
            ok = _is_number(value) and math.isfinite(float(value))
            if not ok or not (low < value if name == "diloco_outer_lr" else low <= value) \
                    or not (value < high if name == "diloco_outer_momentum" else value <= high):
                bounds = {"diloco_outer_lr": "> 0", "diloco_outer_momentum": "in [0, 1)",
                          "diloco_merge_alpha": "in [0, 1]"}[name]
                raise ConfigError(f"{s}.{name}={value!r} must be a number {bounds}")
        if not isinstance(self.diloco_nesterov, bool):
            raise ConfigError(f"{s}.diloco_nesterov={self.diloco_nesterov!r} must be true or false")
        if self.diloco_nesterov and self.diloco_outer_momentum == 0:
            raise ConfigError(f"{s}.diloco_nesterov=true needs {s}.diloco_outer_momentum > 0 "
                              "(set diloco_nesterov=false for plain SGD)")
        if self.diloco_fragment_split not in FRAGMENT_SPLITS:
            raise ConfigError(f"{s}.diloco_fragment_split={self.diloco_fragment_split!r}; valid: "
                              f"{', '.join(FRAGMENT_SPLITS)}")
        if self.diloco_wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"{s}.diloco_wire_dtype={self.diloco_wire_dtype!r}; valid: "
                              f"{', '.join(WIRE_DTYPES)}")

    @property
    def inner_steps_per_sync(self) -> int:
        """Inner steps between two protocol steps: 1 every step, else H / fragments."""
        return 1 if self.sync == "every_step" else self.diloco_inner_steps // self.diloco_fragments

    def read_token(self) -> str:
        """The job token from ``token_file`` (empty when none is configured)."""
        if not self.token_file:
            return ""
        from pathlib import Path
        path = Path(self.token_file)
        if not path.is_file():
            raise ConfigError(f"ft.token_file={self.token_file!r} does not exist")
        return path.read_text().strip()

    def coordinator_config(self, host: str = "127.0.0.1", port: int = 0,
                           token: str = "", insecure: bool = False) -> CoordinatorConfig:
        """Settings for a coordinator serving this job (https:// when ``tls_cert`` is set)."""
        return CoordinatorConfig(host=host, port=port, min_replicas=self.min_replicas,
                                 join_timeout=self.join_timeout,
                                 expected_groups=self.groups + self.spares if self.groups else 0,
                                 max_participants=self.groups if self.spares else 0,
                                 heartbeat_timeout=self.heartbeat_timeout,
                                 progress_timeout=self.progress_timeout,
                                 suspect_window=self.suspect_window,
                                 probe_after_failures=self.probe_after_failures or 0,
                                 token=token or self.read_token(), insecure=insecure,
                                 tls_cert=self.tls_cert, tls_key=self.tls_key,
                                 max_connections=self.coordinator_max_connections)
