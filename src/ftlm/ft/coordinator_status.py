"""What the coordinator shows about the job: the ``GET /status`` JSON and the Prometheus metrics.

Responsible for: a page of the members with their state, step and heartbeat age, the last quorum
(its lists cut to ``STATUS_LIMIT``), the spares standing by and how many were promoted, the
recent deaths, departures and convictions
(``status_json``), and the coordinator's metrics in a registry of its own
(``CoordinatorMetrics``).

Not responsible for: serving them (``ftlm.ft.coordinator``), the dashboard page
(``ftlm.ft.dashboard``), or the metric names and help texts (``ftlm.observe.metrics``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ftlm import native
from ftlm.ft.dashboard import DashboardLog, member_state
from ftlm.ft.membership import MAX_DEAD_LISTED, Membership
from ftlm.ft.quorum import Quorum, spare_groups
from ftlm.observe.metrics import make_metric

STATUS_LIMIT = 1000
"""Most members one ``GET /status`` lists (page with ``?offset=``), and most entries of each list
of its ``last_quorum``: a status stays well under a megabyte at any job size."""


def status_json(membership: Membership, dashboard: DashboardLog, min_replicas: int, now: float,
                offset: int = 0, limit: int = STATUS_LIMIT) -> dict[str, Any]:
    """The ``GET /status`` answer: members ``offset`` to ``offset + limit`` (by group), and the rest
    of the state."""
    state = membership.state
    prev: Quorum | None = state.prev_quorum
    ordered = sorted(state.heartbeats.items(), key=lambda kv: (kv[1].group, kv[0]))
    page = ordered[offset:offset + limit]
    members = []
    for rid, hb in page:
        role = member_state(rid, prev)
        member = {"group": hb.group, "replica_id": rid, "incarnation": rid.partition(":")[2],
                  "state": role, "step": hb.step,
                  "heartbeat_age_seconds": round(now - hb.last_seen, 3),
                  "pending": rid in state.pending}
        if role == "recovering" and prev is not None:
            member["source"] = prev.sources.get(rid, "")
        members.append(member)
    dead = membership.recent_dead(now)
    end = offset + len(page)
    return {
        "quorum_id": state.quorum_id,
        "reason": membership.reason,
        "head_step": state.max_step,
        "members": members,
        "members_total": len(ordered),
        "next_offset": end if end < len(ordered) else None,
        "last_quorum": quorum_view(prev, STATUS_LIMIT) if prev is not None else None,
        "dead": [
            {"replica_id": rid, "group": g, "reason": why, "seconds_ago": round(now - t, 3)}
            for t, rid, g, why in dead[-MAX_DEAD_LISTED:]
        ],
        "dead_total": len(dead),
        "left": [
            {"replica_id": rid, "group": g, "reason": why, "seconds_ago": round(now - t, 3)}
            for t, rid, g, why in membership.recent_departed(now)
        ],
        "convicted": [{"group": g, "times": n} for g, n in state.convicted.items()],
        "spares": spare_groups(prev)[:STATUS_LIMIT],
        "spare_promotions": membership.promotions,
        "min_replicas": min_replicas,
        "hot_path": native.STATUS,
        **dashboard.to_json(),
    }


def quorum_view(quorum: Quorum, limit: int) -> dict[str, Any]:
    """``quorum.to_json()``, with each list cut to ``limit`` entries (and the totals) when longer."""
    if max(len(quorum.members), len(quorum.sources)) <= limit:
        return quorum.to_json()
    cut = dataclasses.replace(quorum, members=quorum.members[:limit],
                              participants=quorum.participants[:limit],
                              recovering=quorum.recovering[:limit], spares=quorum.spares[:limit],
                              sources=dict(list(quorum.sources.items())[:limit]))
    return {**cut.to_json(), "truncated": True, "members_total": len(quorum.members),
            "participants_total": len(quorum.participants), "recovering_total": len(quorum.recovering),
            "spares_total": len(quorum.spares)}


class CoordinatorMetrics:
    """The coordinator's Prometheus metrics, in a registry of its own (several may share a process).

    Names and help texts live in ``ftlm.observe.metrics``; members by state are one gauge per
    state because the design allows no labels but job, group and rank.
    """

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.quorum_id = make_metric("ftlm_coordinator_quorum_id", r)
        self.members = make_metric("ftlm_coordinator_members", r)
        self.by_state = {state: make_metric(f"ftlm_coordinator_members_{state}", r)
                         for state in ("participating", "spare", "recovering", "joining", "dead")}
        self.promotions = make_metric("ftlm_coordinator_spare_promotions_total", r)
        self.promotion_seconds = make_metric("ftlm_coordinator_spare_promotion_seconds", r)
        self.participants = make_metric("ftlm_coordinator_participants", r)
        self.heartbeat_age = make_metric("ftlm_coordinator_heartbeat_age_seconds", r, ("group",))
        self.quorums = make_metric("ftlm_coordinator_quorums_issued_total", r)
        self.member_failures = make_metric("ftlm_coordinator_member_failures_total", r)
        self.kill_requests = make_metric("ftlm_coordinator_kill_requests_total", r)
        self.state_mismatches = make_metric("ftlm_coordinator_state_mismatches_total", r)
        self.latency = make_metric("ftlm_coordinator_quorum_latency_seconds", r)

    def quorum_issued(self, quorum: Quorum, latency: float) -> None:
        self.quorums.inc()
        self.latency.observe(max(latency, 0.0))
        self.quorum_id.set(quorum.quorum_id)
        self.participants.set(len(quorum.participants))

    def spare_promoted(self, seconds: float) -> None:
        """A spare took a participant's place ``seconds`` after the coordinator knew it was gone."""
        self.promotions.inc()
        self.promotion_seconds.set(seconds)

    def refresh(self, now: float, state: Any, dead: int) -> None:
        """Set the gauges that derive from the state (called on each scrape); ``dead``: recent deaths."""
        self.members.set(len(state.heartbeats))
        counts = {"participating": 0, "spare": 0, "recovering": 0, "joining": 0}
        for rid in state.heartbeats:
            counts[member_state(rid, state.prev_quorum)] += 1
        for name, n in counts.items():
            self.by_state[name].set(n)
        self.by_state["dead"].set(dead)
        self.heartbeat_age.clear()  # groups that left must not linger as stale series
        for hb in state.heartbeats.values():
            self.heartbeat_age.labels(group=hb.group).set(max(now - hb.last_seen, 0.0))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
