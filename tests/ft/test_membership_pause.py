"""A coordinator that processed nothing for a while (SIGSTOP, a starved or swapped-out process)
tells its own stall from the members' silence: driven through the state machine with a
hand-driven clock."""

from __future__ import annotations

from ftlm.ft.history import GENESIS
from ftlm.ft.membership import Event, Issued, Membership
from ftlm.ft.quorum import Heartbeat, MemberRequest, Quorum, QuorumOptions

HB_TIMEOUT = 1.0
TICK = 0.05
GROUPS = ("g0", "g1", "g2")


def job(**options: float) -> tuple[Membership, Quorum]:
    """Three groups heartbeating from 0.0, ticked every ``TICK``, in one quorum issued at 0.1."""
    m = Membership(QuorumOptions(1, 2.0, HB_TIMEOUT, len(GROUPS), rebuild_grace=0.0, **options),
                   epoch="e", tick_interval=TICK)
    for g in GROUPS:
        m.heartbeat(0.0, Heartbeat(f"{g}:a", g, 0.0, 0))
    issued = [o.quorum for g in GROUPS
              for o in m.request(0.1, MemberRequest(f"{g}:a", g, 0, -1, False, {}, 0.1, GENESIS))
              if isinstance(o, Issued)]
    assert len(issued) == 1
    return m, issued[0]


def beat(m: Membership, group: str, now: float, step: int = 1, chain: str = "",
         progress_at: float | None = None) -> list:
    return m.heartbeat(now, Heartbeat(f"{group}:a", group, now, step, chain=chain, progress_at=progress_at))[1]


def dead(outputs: list) -> list[tuple[str, str]]:
    return [(o.fields["replica_id"], o.fields["reason"]) for o in outputs
            if isinstance(o, Event) and o.kind == "member_dead"]


def stalls(outputs: list) -> list[float]:
    return [o.fields["seconds"] for o in outputs if isinstance(o, Event) and o.kind == "coordinator_stalled"]


def run_ticks(m: Membership, start: float, stop: float) -> list:
    out, t = [], start
    while t <= stop + 1e-9:
        out += m.tick(t)
        t += TICK
    return out


def test_a_coordinator_resumed_after_a_pause_gives_every_member_a_heartbeat_timeout_to_speak() -> None:
    """Stopped from 0.2 s to 3.2 s (three heartbeat timeouts): on resumption it declares nobody
    dead, whatever comes first (its tick or a member's queued heartbeat); the members whose
    heartbeats come in stay, and the one that really went silent is declared dead one heartbeat
    timeout after the resumption, not at once."""
    m, q = job()
    chain = q.next_chain()
    for g in GROUPS:
        beat(m, g, 0.2, chain=chain)
    out = m.tick(3.2)
    assert dead(out) == [] and stalls(out) == [3.0]
    out = beat(m, "g0", 3.21, chain=chain) + beat(m, "g1", 3.22, chain=chain)  # queued while it was stopped
    deaths: list[tuple[float, str, str]] = []
    for i in range(1, 24):  # g0 and g1 heartbeat on; g2 never speaks after the resumption at 3.2
        t = 3.2 + i * TICK
        out = m.tick(t) + (beat(m, "g0", t, chain=chain) + beat(m, "g1", t, chain=chain) if i % 2 else [])
        deaths += [(round(t, 2), r, why) for r, why in dead(out)]
    assert deaths == [(4.2, "g2:a", "heartbeat timeout")]
    m2, _ = job()
    out = beat(m2, "g0", 3.2)  # a member's heartbeat is the first input after the pause
    assert dead(out) == [] and stalls(out) == [3.1] and dead(m2.tick(3.25)) == []


def test_ordinary_gaps_between_ticks_change_nothing() -> None:
    """Ticked every ``TICK`` (with a late tick now and then), a silent member is declared dead one
    heartbeat timeout after it was last heard, as ever, and no stall is reported; nor by a
    caller that does not tick on a timer (a hand-driven clock may jump)."""
    m, _ = job()
    out = run_ticks(m, 0.15, 0.95) + m.tick(1.05)  # one tick 0.1 s late: well within 4 ticks
    assert dead(out) == [] and stalls(out) == []
    out = m.tick(1.1)
    assert sorted(r for r, _ in dead(out)) == ["g0:a", "g1:a", "g2:a"] and stalls(out) == []
    hand = Membership(QuorumOptions(1, 2.0, HB_TIMEOUT, 1, rebuild_grace=0.0), epoch="e")
    hand.heartbeat(0.0, Heartbeat("g0:a", "g0", 0.0, 0))
    out = hand.tick(5.0)
    assert dead(out) == [("g0:a", "heartbeat timeout")] and stalls(out) == []


def test_progress_and_suspicion_deadlines_count_from_the_resumption() -> None:
    """A member not waiting for a quorum whose progress deadline passed while the coordinator was
    stopped is not retired on resumption (its queued heartbeat may report progress); a suspicion
    opened before the pause expires nobody on resumption; each gets a heartbeat timeout."""
    m, q = job(progress_timeout=2.0, suspect_window=0.2)
    chain = q.next_chain()
    for g in ("g0", "g1"):
        m.request(0.3, MemberRequest(f"{g}:a", g, 0, q.quorum_id, True, {}, 0.3, GENESIS))  # report: g2 suspect
    assert m.state.suspicion is not None
    out = m.tick(3.3)  # stopped from 0.3 s: g2's progress (0.1) and the window (0.5) passed meanwhile
    assert dead(out) == [] and stalls(out) == [3.0] and m.state.suspicion is None
    out = beat(m, "g2", 3.35, chain=chain, progress_at=3.3)  # it made progress meanwhile
    for i in range(1, 24):
        t = 3.3 + i * TICK
        out += m.tick(t) + beat(m, "g0", t) + beat(m, "g1", t) + beat(m, "g2", t, chain=chain, progress_at=3.3)
    assert dead(out) == [] and set(m.state.heartbeats) == {"g0:a", "g1:a", "g2:a"}
    m2, q2 = job(progress_timeout=2.0)
    assert dead(m2.tick(3.0)) == []
    out = beat(m2, "g2", 3.1, chain=q2.next_chain(), progress_at=0.1)  # its own word: no progress since 0.1
    assert [(r, "no progress" in why) for r, why in dead(out)] == [("g2:a", True)]
