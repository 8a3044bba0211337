"""What one simulated job is made of: its shape (``SimConfig``, the kinds of fault), the state of
its groups' processes as far as the invariants care, and what a run found (``SimResult``).

Not responsible for running it: ``ftlm.sim.world`` and the parts it composes drive these through
the real protocol code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from ftlm.ft.group import GroupProtocol
from ftlm.ft.history import GENESIS
from ftlm.ft.membership import Answer
from ftlm.ft.quorum import MemberRequest, Quorum
from ftlm.ft.quorum_wait import QuorumWait

FAULTS = ("crash", "hang", "hang_resume", "hang_training", "crash_starting", "hang_starting", "coordinator_crash",
          "lag", "slow_transfer", "source_crash_mid_transfer", "bogus_claim", "partition_drop",
          "old_checkpoint", "leave", "bad_link", "coordinator_pause", "hang_restarting")
"""Kinds of fault the simulator injects (a seed picks which, where and when). ``bad_link``: every
all-reduce the struck process takes part in with a peer fails (for every member, at once or at
the timeout) until the process exits; now and then its group's next process has one too (the
node's link): the coordinator must find the group (``quorum.Probe``). At most
``SimConfig.bad_links`` at a time, and only while two groups without one remain in the job and
three or more groups are in it (a link heals when groups leave for good below that): with no
two good groups no attempt can commit, and the groups give up after
``max_consecutive_failures`` (which the 30 s progress bound does not allow for).
``coordinator_pause``: the coordinator process is stopped (SIGSTOP) for 2-6 heartbeat timeouts
(a share ``long_outages`` of pauses and crashes: 1.2-2.5 ``quorum_seconds``, through which the
groups must wait, not give up) and resumed; the messages sent to it meanwhile wait and are handled on resumption, before or
after its first tick. ``hang_restarting``: a group is killed and its next process hangs before
it registers (a wedged start-up), found only by the supervisor's start-up timeout."""


@dataclass
class SimConfig:
    """One simulated job: its size, timing, and how often faults strike."""

    groups: int = 3
    spares: int = 0
    """Of ``groups``, how many train no data while the others can (hot spares: the coordinator's
    ``max_participants`` is ``groups - spares``); faults strike a current spare half the time."""
    steps: int = 200
    batch: int = 4
    fault_mtbf: float = 4.0
    """Mean simulated seconds between injected faults (0: none)."""
    faults: tuple[str, ...] = FAULTS
    faults_until_step: float = 0.8
    """Faults stop once the job reached this fraction of its steps (then liveness is judged)."""
    endgame_faults: float = 1.0
    """Probability that one more fault strikes around the end of the job: within a second of a
    group committing the third-last step, so before, while or after groups finish and leave."""
    late_faults: float = 1.0
    """Probability that one more fault (a SIGTERM or SIGKILL) strikes a group still in the job after
    the first group finished: within ``drain_seconds + quorum_seconds + startup_timeout`` of it,
    when a group restarted after the others left may wait for a quorum that never comes."""
    loss: float = 0.01
    """Probability that one message is lost."""
    latency: tuple[float, float] = (0.001, 0.02)
    step_seconds: tuple[float, float] = (0.02, 0.06)
    """One step's compute; a DiLoCo phase is one long step (``ftlm sim check --long-steps``)."""
    abandon_doomed_steps: bool = True
    """A group told its step is doomed (a member of its quorum reported dead) abandons the step's
    compute at once, as ``ftlm train``'s single-rank groups do; False: it computes to the end and
    fails in the collective, as a sharded group does."""
    startup_seconds: tuple[float, float] = (0.2, 1.0)
    reload_seconds: tuple[float, float] = (0.05, 1.5)
    """Loading a newer durable checkpoint while no live group holds the head (the trainer's
    ``_reload_checkpoint``): sometimes longer than what is left of the rollback grace."""
    reload_checkpoints: bool = True
    """Groups told that no live group holds the head look for a newer durable checkpoint; False:
    they ignore it (as before session 8), so the coordinator waits ``reload_seconds`` for each
    and then rolls back to a live state, perhaps older than the newest checkpoint."""
    checkpoint_every: int | None = None
    """``checkpoint.every`` (0: no periodic checkpoints; the last step is saved all the same);
    None: 10, and 0 on every third seed (those whose remainder by 3 is 2)."""
    drain_seconds: float = 10.0
    """How long a finished group keeps serving for the groups not yet up to date (the manager's
    ``ft.quorum_timeout``)."""
    quorum_seconds: float = 10.0
    """A group that waited this long for a quorum while the coordinator answered gives up and
    exits (``ft.quorum_timeout``); time the coordinator did not answer at all does not count."""
    long_outages: float = 0.3
    """Share of coordinator crashes and pauses that last 1.2-2.5 ``quorum_seconds`` (drawn from a
    random source of their own, so the main one's schedule stays that of the seed)."""
    heartbeat_interval: float = 0.1
    heartbeat_timeout: float = 0.5
    suspect_window: float = 0.2
    """Members silent this long after a peer reported their quorum's step failed are declared dead."""
    supervisor_reports: str = "odd"
    """Which seeds' supervisor reports a process's death to the coordinator: "all", "none", or
    "odd" (odd seeds; the others run as on Kubernetes/Slurm, where only the peers' reports and
    the heartbeat timeout detect a death)."""
    join_timeout: float = 1.0
    allreduce_timeout: float = 2.0
    progress_timeout: float = 3.0
    poll_timeout: float = 2.5
    restart_delay: float = 0.3
    startup_timeout: float = 12.0
    """A process not registered this long after its start is hung (``ft.startup_timeout``): longer
    than ``quorum_seconds``, as production's 120 s is longer than its 60 s ``ft.quorum_timeout``,
    so a start-up hang near the end is found after the finished groups left."""
    max_consecutive_failures: int = 50
    probe_after: int = 3
    """``ft.probe_after_failures``: failed attempts of a step before the
    coordinator tries without half the suspects at a time (0: never)."""
    bad_links: int = 1
    """Groups with a bad link at once (more than one: the search sets cleared members aside)."""
    sticky_link: float = 0.3
    """Probability that a group whose process had a bad link starts its next process with one too."""
    liveness_seconds: float = 120.0
    """After the last fault, the job must finish within this many simulated seconds."""
    progress_seconds: float = 30.0
    """Whatever the faults, some group commits a step at least this often (every fault here is
    detected and healed well within it: a livelock shows as a violation); with ``bad_links``
    above one, this many seconds per bad link (the search finds them one after the other, each
    failed attempt taking up to ``allreduce_timeout``). Faults that strike during a search add
    what they may cost it (``Invariants.fault_during_search``): a coordinator crash a whole search,
    any other one failed attempt."""
    max_seconds: float = 3600.0
    early_ask: bool = True
    """A participant asks for the next quorum right after its commit vote and applies its update
    while the request waits (``Manager.ask``), as in production; False: it asks after the update."""
    update_seconds: tuple[float, float] = (0.002, 0.02)
    """Applying the optimizer update after the vote."""
    exit_seconds: tuple[float, float] = (0.1, 3.0)
    """From a group's leave to its process's exit (it writes its model and summary first): its
    connections stay open meanwhile, so peers waiting on it are not reset."""
    leave_restart: float = 0.7
    """Probability that the launcher starts a group that left again (0.5-8 s later); otherwise
    it is gone for good, as long as another group remains."""
    checkpoint_on_stop: bool = True
    """``checkpoint.on_stop``: a group stopped by SIGTERM that was participant 0 of its last
    committed step saves that step before it leaves (unless it is due, hence on disk)."""
    stop_save_seconds: tuple[float, float] = (0.01, 0.3)
    """How long that save takes (a crash meanwhile leaves nothing valid on disk)."""
    integrity_every: int = 5
    """``ft.integrity_every``: participants report their state's digest every this many steps."""
    sdc: float = 0.5
    """Probability that one group's state is silently corrupted once (a flipped bit: its digest
    differs from then on, and it spreads with the snapshots and checkpoints made of it); drawn
    from a random source of its own, so the other faults of a seed stay as they were."""
    leave_bound: float = 0.5
    """Liveness of a graceful leave: every other healthy group gets a quorum without the leaver
    within this many simulated seconds of the leave reaching the coordinator (5 heartbeat
    intervals: below the heartbeat, join and all-reduce timeouts a leave must not wait for)."""
    coordinator_record: bool = True
    """A restarted coordinator takes in its record (convictions, finished leaves), as under
    ``ftlm launch local`` and Slurm (``ftlm.ft.coordinator_record``); False: it starts empty, as on
    Kubernetes, and the end-of-job bound is not judged after it restarted with a group finished."""
    end_bound: float = 6.0
    """Liveness at the end: a running group at the final state, every other group finished with
    that state, finishes within this many simulated seconds (coordinator outages not counted;
    two lost answers cost it ``poll_timeout`` each). Nobody can join it, so it must not wait
    ``drain_seconds`` (10 s here, ``ft.quorum_timeout`` in the runtime) for joiners."""


class Violation(AssertionError):
    """An invariant failed; the message names it, the seed and the recent events."""


@dataclass
class State:
    """A group's replicated state as far as the invariants care."""

    step: int = 0
    chain: str = GENESIS
    cursor: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    corruption: int = 0
    """0: the bits the history says; else which silent corruption they hold (``Faults.corrupt``)."""

    def after(self, chain: str, samples: int) -> State:
        """The state one committed step later: history ``chain``, the next ``samples`` trained
        (a corruption stays: every group applies the same update to its own bits)."""
        return State(self.step + 1, chain, self.cursor + samples,
                     self.ranges + ((self.cursor, self.cursor + samples),), self.corruption)

    def digest(self) -> str:
        """The state digest a group reports (``ftlm.ft.integrity``): of its history and its bits."""
        return hashlib.blake2b(f"{self.step}:{self.chain}:{self.corruption}".encode(), digest_size=16).hexdigest()


@dataclass
class Incarnation:
    """One process of one group (one rank: the group is the unit of failure)."""

    group: str
    inc: str
    proto: GroupProtocol
    state: State
    alive: bool = True
    hung: bool = False  # SIGSTOP: nothing runs
    hung_training: bool = False  # the heartbeat thread lives, the training thread does not
    registered: bool = False
    started_at: float = 0.0
    injected: bool = False  # a fault was injected into this process
    finished: bool = False
    phase: str = "starting"
    request: MemberRequest | None = None
    request_seq: int = 0
    quorum: Quorum | None = None
    buffer: dict[int, tuple[int, list[str], int]] = field(default_factory=dict)
    published: dict[int, State] = field(default_factory=dict)
    fetch: dict[str, Any] | None = None
    draining_since: float | None = None
    lag_once: bool = False
    lagged: bool = False
    abort_pending: bool = False
    progress_at: float = 0.0  # the last protocol point the training thread reached
    asked_at: float = float("-inf")  # when it last sent a quorum request (which is a heartbeat)
    absent_since: float | None = None  # not a live member of the coordinator since
    asking_since: float = 0.0  # when its current wait for a quorum began
    wait: QuorumWait | None = None  # that wait, as ``Manager._request_quorum`` keeps it
    polling: bool = False  # a quorum request is outstanding (the manager's long-poll)
    asked_next: bool = False  # asked for the next quorum right after its vote: that step is owed
    held: Answer | None = None  # an answer that came while the update was applied (``Manager._asked``)
    poll_stopped: bool = False  # the early request's long-poll ended on a stop request
    update_pending: bool = False  # SIGSTOPped while applying the update
    catching: bool = False  # recovering: a snapshot is loaded, its backlog replayed step by step
    stopping: bool = False  # SIGTERM: finish (or abort) the step, then leave
    left: bool = False  # told the coordinator it leaves; the process exits a moment later
    request_lost: bool = False  # its current quorum request or the answer to it was lost
    reload_head: int | None = None  # told to reload while applying its update: done at its next step
    reload_hint: tuple[int | None, int] = (None, 0)  # the last heartbeat answer's ``reload`` and round
    writer: bool = False  # participant 0 of the last step it committed as a participant
    bad_link: bool = False  # every all-reduce it takes part in with a peer fails
    integrity: tuple[int, str, str] | None = None  # the state digest its next quorum request carries

    @property
    def replica_id(self) -> str:
        return f"{self.group}:{self.inc}"

    @property
    def running(self) -> bool:
        return self.alive and not self.hung


@dataclass
class LeaveWatch:
    """A graceful leave under judgement: the healthy groups that must get a quorum without the
    leaver by ``deadline`` (``SimConfig.leave_bound``)."""

    leaver: str
    at: float
    deadline: float
    waiting: set[str]


@dataclass
class Collective:
    """One all-reduce of one quorum: who entered with what, and how it ends."""

    quorum: Quorum
    entered: dict[str, tuple[int | None, int, str]] = field(default_factory=dict)  # rid -> (slice, step, chain)
    done: bool = False
    failed_members: set[str] = field(default_factory=set)


@dataclass
class SimResult:
    seed: int
    ok: bool
    steps: int
    faults: dict[str, int]
    restores: int
    seconds: float
    error: str = ""
    trace: list[str] = field(default_factory=list)
    leaves_judged: int = 0
    """Graceful leaves whose liveness was judged (those in quiet times, ``watch_leave``)."""
    restores_past_checkpoint: int = 0
    """Rollbacks to a state older than the newest durable checkpoint at that moment that the next
    quorum acted on (one a later restore undid first gave nothing up). Not a violation: progress
    on disk the job gave up; ``tests/sim`` requires none where groups look on disk first, and
    checks the count with ``reload_checkpoints=False``."""
    steps_past_checkpoint: int = 0
    """Steps between those quorums' steps and the newest durable checkpoint, summed."""
    convictions: int = 0
    """Groups the coordinator retired for failing every step they took part in (``quorum.Probe``)."""
    wrong_convictions: int = 0
    promotions: int = 0
    """Spares that became participants (``SimConfig.spares``): each held the head when promoted."""
    spare_quorums: int = 0
    """Quorums issued with at least one spare standing by."""
    """Of those, groups whose link was good (allowed only after another fault or a lost message
    may have failed the same attempts: ``check_conviction``)."""


def copy_state(st: State) -> State:
    return State(st.step, st.chain, st.cursor, st.ranges, st.corruption)
