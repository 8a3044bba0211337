"""How long a group waits for its quorum, and what stops the wait: a pure state machine with the
clock passed in (``Manager._request_quorum`` feeds it; the simulator's groups run it too).

Two kinds of waiting, told apart by whether the coordinator answers at all:

* It answers, but no quorum forms (504 at each long-poll's end: too few groups, a straggler):
  the group gives up after ``ft.quorum_timeout`` of that, counted from the start of the wait
  or from the coordinator's return after an outage. Giving up there is the right call: the
  coordinator is alive and says no quorum will include this group.
* It does not answer (connection refused, reset or timed out): an outage. The group keeps its
  state and waits, because its state is what the job resumes from when a coordinator is back
  (a restarted one rebuilds from the groups' heartbeats) and exiting would only throw it away;
  bringing the coordinator back is its supervisor's job (the local launcher, a Kubernetes
  Deployment, a Slurm requeue). ``ft.coordinator_outage_timeout`` bounds one outage; 0 (the
  default) waits for as long as it lasts. A stop request (SIGTERM) ends either wait.

Not responsible for: asking (``ftlm.ft.client``), logging or events (the caller acts on what
``QuorumWait`` returns), nor the stop request (the manager checks its own flag).
"""

from __future__ import annotations

from dataclasses import dataclass

PROGRESS_EVERY = 10.0
"""Seconds between the lines that say an outage goes on."""


@dataclass
class QuorumWait:
    """One wait for a quorum, started at ``started`` (a monotonic clock's seconds)."""

    quorum_timeout: float
    """``ft.quorum_timeout``: seconds of waiting while the coordinator answers without a quorum."""
    outage_timeout: float
    """``ft.coordinator_outage_timeout``: seconds one outage may last (0: no bound)."""
    started: float
    answering_since: float = 0.0
    """Start of the current stretch in which the coordinator answers."""
    down_since: float | None = None
    """When the first unanswered request of the outage in progress was sent (None: no outage)."""
    said_at: float = 0.0
    """When the outage was last reported (its start, then every ``PROGRESS_EVERY`` s)."""

    def __post_init__(self) -> None:
        self.answering_since = self.started

    def answered(self, now: float) -> float | None:
        """The coordinator answered (a quorum, a 504, any HTTP status). Returns the seconds the
        outage it ends lasted, or None when there was none."""
        if self.down_since is None:
            return None
        seconds = now - self.down_since
        self.down_since = None
        self.answering_since = now  # quorum_timeout counts again, from the coordinator's return
        return seconds

    def unreachable(self, sent_at: float, now: float) -> bool:
        """A request sent at ``sent_at`` got no answer at all. Returns True when that starts an
        outage (the caller reports it)."""
        if self.down_since is not None:
            return False
        self.down_since = min(sent_at, now)
        self.said_at = now
        return True

    def outage_seconds(self, now: float) -> float:
        """Seconds the outage in progress has lasted (0 without one)."""
        return 0.0 if self.down_since is None else now - self.down_since

    def report_due(self, now: float) -> bool:
        """Whether the outage in progress is due another line (every ``PROGRESS_EVERY`` s)."""
        if self.down_since is None or now - self.said_at < PROGRESS_EVERY:
            return False
        self.said_at = now
        return True

    def remaining(self, now: float) -> float:
        """Seconds of ``quorum_timeout`` left while the coordinator answers; during an outage,
        ``quorum_timeout`` itself (no answer has used any of it)."""
        if self.down_since is not None:
            return self.quorum_timeout
        return self.quorum_timeout - (now - self.answering_since)

    def give_up(self, now: float) -> str | None:
        """Why the group stops waiting now, or None while it keeps waiting."""
        if self.down_since is None:
            if now - self.answering_since >= self.quorum_timeout:
                return (f"no quorum within ft.quorum_timeout={self.quorum_timeout:g} s while the "
                        "coordinator answered")
            return None
        if self.outage_timeout and now - self.down_since >= self.outage_timeout:
            return (f"the coordinator was unreachable for {now - self.down_since:.0f} s, beyond "
                    f"ft.coordinator_outage_timeout={self.outage_timeout:g} s")
        return None
