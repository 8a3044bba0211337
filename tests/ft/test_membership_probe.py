"""Finding the group that fails every step it takes part in (a bad link, a faulty device): the
coordinator's probe (``ftlm.ft.quorum.Probe``), driven through its state machine with a hand-driven
clock and groups whose attempts fail exactly when a bad member takes part with a peer."""

from __future__ import annotations

import math
import random

import pytest

from ftlm.errors import ConfigError
from ftlm.ft.config import CoordinatorConfig, FTConfig
from ftlm.ft.history import GENESIS
from ftlm.ft.membership import Answer, Event, Issued, Membership
from ftlm.ft.quorum import Heartbeat, MemberRequest, Quorum, QuorumOptions, StaleIncarnation


class Job:
    """``n`` groups; an attempt fails for all its members when one of ``bad`` takes part with at
    least one other member (a bad link: alone, a group has nobody to talk to)."""

    def __init__(self, n: int, bad: set[str], probe_after: int = 3, min_replicas: int = 1,
                 expected: int | None = None, progress_timeout: float = 0.0) -> None:
        self.m = Membership(QuorumOptions(min_replicas, 2.0, 30.0, n if expected is None else expected, rebuild_grace=0.0,
                                          probe_after=probe_after, progress_timeout=progress_timeout), epoch="e")
        self.bad = bad
        self.now = 0.0
        self.inc = {f"g{i}": "a" for i in range(n)}
        self.state = {g: (0, GENESIS) for g in self.inc}  # committed (step, chain)
        self.last_id = {g: -1 for g in self.inc}
        self.failed = {g: False for g in self.inc}
        self.retired: list[tuple[str, str]] = []  # (replica id, error)
        self.gone: set[str] = set()  # groups whose process exited
        self.quorums: list[Quorum] = []
        self.events: list[Event] = []
        for g in self.inc:
            self.m.heartbeat(self.now, Heartbeat(self.rid(g), g, self.now, 0))

    def rid(self, g: str) -> str:
        return f"{g}:{self.inc[g]}"

    def ask(self, g: str) -> list:
        self.now += 0.01
        step, chain = self.state[g]
        req = MemberRequest(self.rid(g), g, step, self.last_id[g], self.failed[g], {"store": f"host-{g}:29500"},
                            self.now, chain)
        return self.feed(self.m.request(self.now, req))

    def feed(self, outputs: list) -> list[Quorum]:
        issued = []
        for o in outputs:
            if isinstance(o, Issued):
                issued.append(o.quorum)
                self.quorums.append(o.quorum)
            elif isinstance(o, Event):
                self.events.append(o)
            elif isinstance(o, Answer) and o.status == 409:
                assert o.body.get("convicted") is True, o.body  # its process exits with EXIT_RETIRED
                self.retired.append((o.replica_id, o.body["error"]))
                self.gone.add(o.replica_id.split(":")[0])  # its process exits
        return issued

    def stall(self, q: Quorum, failed: bool = True, told: set[str] | None = None) -> list[str]:
        """The attempt of ``q`` neither commits nor fails by a bad link: its members (those
        ``told`` of it; all by default) ask again saying whether it failed; returns the members."""
        members = [r.split(":")[0] for r in q.replica_ids()]
        for g in members:
            if told is None or g in told:
                self.last_id[g] = q.quorum_id
            self.failed[g] = failed
        return members

    def run(self, q: Quorum) -> list[str]:
        """The attempt of ``q``: every member fails or commits; returns the members."""
        members = [r.split(":")[0] for r in q.replica_ids()]
        fails = len(members) > 1 and any(g in self.bad for g in members)
        for g in members:
            self.last_id[g] = q.quorum_id
            self.failed[g] = fails
            if not fails:
                self.state[g] = (q.step + 1, q.next_chain())
        return members

    def steps(self, attempts: int, issued: list[Quorum] | None = None) -> None:
        """Every group asks (or ``issued`` was); each issued quorum runs and its members ask again."""
        if issued is None:
            issued = [q for g in sorted(self.inc) if g not in self.gone for q in self.ask(g)]
        for _ in range(attempts):
            if not issued:
                return
            q = issued.pop(0)
            for g in self.run(q):
                if g not in self.gone:
                    issued += self.ask(g)

    def restart(self, g: str, inc: str) -> None:
        """``g``'s new incarnation, having caught up with the head."""
        self.inc[g] = inc
        self.gone.discard(g)
        self.state[g] = self.m.state.head
        self.failed[g] = False
        self.m.heartbeat(self.now, Heartbeat(self.rid(g), g, self.now, self.m.state.head[0], chain=self.m.state.head[1]))


def left_out(job: Job) -> list[str]:
    """The groups each probe left out, in order ("g0,g1" for two)."""
    return [",".join(r.split(":")[0] for r in q.left_out) for q in job.quorums if q.left_out]


def failed_attempts(job: Job) -> int:
    return sum(1 for q in job.quorums if any(r.split(":")[0] in job.bad for r in q.replica_ids())
               and q.size > 1)


def test_the_group_with_the_bad_link_is_found_and_retired_and_the_others_go_on() -> None:
    job = Job(4, bad={"g2"})
    job.steps(30)
    assert [r for r, _ in job.retired] == ["g2:a"]
    error = job.retired[0][1]
    assert "attempts without it" not in error and "committed without it" in error and "must exit" in error
    dead = [e for e in job.events if e.kind == "member_dead"]
    assert [(e.fields["replica_id"], e.fields["host"]) for e in dead] == [("g2:a", "host-g2")]  # where to look
    # three failed attempts of the whole set, one without half the suspects (fails: g2 is in the
    # other half), one without g2 (commits: g2 is accused), and step 1's with g2 again (fails)
    probes = [q for q in job.quorums if q.left_out]
    assert left_out(job) == ["g0,g1", "g2"]
    assert "trying without g0, g1 (their requests wait)" in probes[0].reason
    assert failed_attempts(job) == 3 + 1 + 1
    # the others trained on without it: well past the step that failed
    assert job.m.state.head[0] > 10
    assert "g2:a" not in job.m.state.heartbeats
    with pytest.raises(StaleIncarnation, match="committed without it"):
        job.m.request(job.now, MemberRequest("g2:a", "g2", 0, -1, False, {}, job.now, GENESIS))


def test_failures_that_pass_by_themselves_convict_nobody() -> None:
    """Three attempts fail for a passing reason (a peer's hang, a burst of lost messages); the
    first one without g0 and g1 commits, which narrows the search to them, the next without g0
    commits too, which only accuses g0: the next step with it commits, and g0 is cleared, not
    restarted."""
    job = Job(4, bad=set())
    failures = {"left": 3}
    run = job.run

    def flaky(q: Quorum) -> list[str]:
        if failures["left"] > 0:
            failures["left"] -= 1
            return job.stall(q)
        return run(q)
    job.run = flaky
    job.steps(20)
    assert job.retired == [] and left_out(job) == ["g0,g1", "g0"]
    assert job.m.state.probe is None and job.m.state.head[0] > 5


def test_a_group_convicted_before_is_left_out_first() -> None:
    job = Job(4, bad={"g3"})
    job.steps(40)
    assert [r for r, _ in job.retired] == ["g3:a"]
    first = failed_attempts(job)
    assert first == 3 + 2 + 1  # g0 and g1, then g2 left out in vain first; then g3 accused, convicted
    job.restart("g3", "b")  # its link is still bad
    job.quorums.clear()
    job.steps(40)
    assert [r for r, _ in job.retired] == ["g3:a", "g3:b"]
    assert failed_attempts(job) == 3 + 1  # not 7: its history orders the search
    assert left_out(job) == ["g3"]


def test_only_the_group_convicted_last_is_left_out_alone_first() -> None:
    """g3, then g1 convicted (each restarted with a good link): when g4's link goes bad, the
    search leaves g1 alone out first (in vain), then halves (g3 in the first half), not g3 alone
    too: in a long job where every group was convicted once, each alone would cost an attempt."""
    job = Job(5, bad={"g3"})
    job.steps(40)
    job.bad = set()
    job.restart("g3", "b")
    job.steps(20)
    job.bad = {"g1"}
    job.steps(60)
    job.bad = set()
    job.restart("g1", "b")
    job.steps(20)
    assert list(job.m.state.convicted) == ["g3", "g1"]
    job.bad = {"g4"}
    job.quorums.clear()
    job.steps(60)
    assert [r for r, _ in job.retired] == ["g3:a", "g1:a", "g4:a"]
    assert left_out(job) == ["g1", "g3,g0", "g2", "g4"]


def test_two_groups_are_never_probed_and_probing_can_be_turned_off() -> None:
    """Two groups cannot tell whose link is bad (either alone commits): attempts go on with both
    (the groups give up after ``max_consecutive_failures``); ``probe_after=0`` turns it off."""
    for job in (Job(2, bad={"g1"}), Job(4, bad={"g1"}, probe_after=0)):
        job.steps(20)
        assert job.retired == [] and not any(q.left_out for q in job.quorums)
        assert job.m.state.head[0] == 0


def test_no_probe_while_steps_commit_or_who_takes_part_changes() -> None:
    job = Job(3, bad=set())
    job.steps(50)
    assert not any(q.left_out for q in job.quorums) and job.m.state.head[0] >= 40
    assert job.m.state.probe is None


def test_attempts_nobody_reports_failed_are_no_evidence() -> None:
    """Quorums issued again at the same step without a reported failure (the job's end, where
    finished groups answer quorums at the last step while late joiners catch up; a lost answer)
    never start a search."""
    job = Job(4, bad=set())

    job.run = lambda q: job.stall(q, failed=False)
    job.steps(20)
    assert len(job.quorums) > 15 and {q.step for q in job.quorums} == {0}
    assert not any(q.left_out for q in job.quorums) and job.m.state.probe is None


def test_min_replicas_bounds_who_may_be_left_out() -> None:
    job = Job(3, bad={"g1"}, min_replicas=3)
    job.steps(20)
    assert job.retired == [] and not any(q.left_out for q in job.quorums)


def test_two_bad_groups_are_found_one_after_the_other() -> None:
    """Two bad links at once (g1, g2 of four). The first round searches for one, as usual, and
    ends with no suspect left; the next one sets a member cleared by a failed attempt aside
    instead of trusting it, so its attempts take only suspects and the partners needed to make
    two, in another order: the attempt of g0 and g3 commits, g2 is accused and convicted with
    those two (g1 set aside), then g1 takes part again and the next search finds it; g0 and g3
    train on."""
    job = Job(4, bad={"g1", "g2"})
    job.steps(60)
    assert [r for r, _ in job.retired] == ["g2:a", "g1:a"]
    assert left_out(job)[:3] == ["g0,g1", "g2", "g3"]  # the first round, as with one
    reasons = [q.reason for q in job.quorums if q.left_out]
    assert not any("set aside" in r for r in reasons[:3]) and any("set aside" in r for r in reasons[3:])
    assert job.m.state.head[0] > 20 and sorted(job.m.state.heartbeats) == ["g0:a", "g3:a"]


def test_with_no_two_good_groups_the_search_starts_over_and_retires_nobody() -> None:
    """Two bad of three: no attempt of two commits, so no member is ever cleared by a commit;
    with no suspect left the search begins again over everyone in another order, and after two
    searches the evidence starts over with three attempts of every member (which count toward
    each group's own ``max_consecutive_failures``: the groups give up in the end); nobody is
    retired."""
    job = Job(3, bad={"g1", "g2"})
    job.steps(60)
    assert job.retired == [] and job.m.state.head[0] == 0
    pattern = " ".join(",".join(r.split(":")[0] for r in q.left_out) or "-" for q in job.quorums)
    assert pattern.startswith("- - - g0 g1 g2 "), pattern  # the first round by name, then others
    assert pattern.count("- - -") >= 4 and job.m.state.searches[1] >= 3


def test_a_lost_answer_that_fails_the_attempt_without_the_bad_group_clears_nobody() -> None:
    """g1 never gets the answer of the attempt without g2 (lost): g0 times out and says the
    attempt failed, g1 cannot; that clears nobody, and the next attempt leaves g2 out again."""
    job = Job(3, bad={"g2"})
    lost = {"once": True}
    run = job.run

    def run_losing(q: Quorum) -> list[str]:
        if q.left_out == ("g2:a",) and lost.pop("once", False):
            return job.stall(q, told={"g0"})
        return run(q)
    job.run = run_losing
    job.steps(20)
    assert [r for r, _ in job.retired] == ["g2:a"]
    assert left_out(job) == ["g0", "g1", "g2", "g2"]


def test_evidence_survives_a_joiner_and_ends_with_a_departure() -> None:
    """Attempts of two groups (nobody to leave out) fail with g1 in each; a third group joins:
    three attempts failed already, so the first attempt with it leaves one out (the joiner is a
    suspect too: the earlier attempts may have failed for another reason). An attempt a member
    died in clears no suspect (its death may be what failed it)."""
    job = Job(3, bad={"g1"}, expected=2)
    job.gone.add("g2")  # g2 is not there yet
    job.m.report_dead(job.now, "g2:a", "g2", "not started")
    job.steps(8)
    assert job.retired == [] and not any(q.left_out for q in job.quorums)
    probe = job.m.state.probe
    assert probe is not None and probe.suspects == {"g0:a", "g1:a"} and probe.failed >= 3
    job.restart("g2", "b")
    job.quorums.clear()
    job.steps(10)
    assert left_out(job) == ["g0", "g1"]
    assert [r for r, _ in job.retired] == ["g1:a"]
    assert job.m.state.head[0] > 1

    # the other way round: an attempt of g0 and g2 failed for another reason (a lost message),
    # then g1 joins with a bad link: it is a suspect from its first failed attempt on
    job = Job(3, bad=set(), expected=2)
    job.gone.add("g1")
    job.m.report_dead(job.now, "g1:a", "g1", "not started")
    job.bad = {"g0", "g2"}  # (both: the attempt fails)
    job.steps(1)
    job.bad = {"g1"}
    job.restart("g1", "b")
    job.quorums.clear()
    job.steps(12)
    assert [r for r, _ in job.retired] == ["g1:b"]

    job = Job(4, bad={"g1"})
    job.steps(2)  # two attempts ran and failed; the third is issued
    assert job.m.state.probe is not None and job.m.state.probe.failed == 2
    job.gone.add("g3")  # it dies in the third attempt, which fails: the fourth is without it
    job.feed(job.m.report_dead(job.now, "g3:a", "g3", "SIGKILL"))
    issued = [q for g in job.run(job.quorums[-1]) if g not in job.gone for q in job.ask(g)]
    assert len(issued) == 1 and issued[0].left_out == ("g0:a",)  # three failed: the search begins
    probe = job.m.state.probe
    assert probe is not None and probe.failed == 3 and probe.suspects >= {"g0:a", "g1:a", "g2:a"}
    job.steps(8, issued)
    assert left_out(job) == ["g0", "g1"]
    assert [r for r, _ in job.retired] == ["g1:a"]


def test_an_attempt_failed_by_a_member_that_hangs_clears_nobody() -> None:
    """The attempt without the culprit fails because another member hangs (it does not ask
    again): that clears no suspect, and the suspects not left out yet go first."""
    job = Job(4, bad={"g2"})
    hang = {"once": True}
    run = job.run

    def run_hanging(q: Quorum) -> list[str]:
        if "g2:a" in q.left_out and hang.pop("once", False):
            job.gone.add("g3")  # g3 hangs in it: it never asks again, the attempt times out
            return job.stall(q)
        return run(q)
    job.run = run_hanging
    job.steps(6)
    assert job.gone == {"g3"} and job.retired == []
    job.feed(job.m.report_dead(job.now, "g3:a", "g3", "declared dead"))  # g3 is gone for good
    job.steps(10)
    assert [r for r, _ in job.retired] == ["g2:a"]
    left = left_out(job)
    assert left[:2] == ["g0,g1", "g2"] and left[-1] == "g2", left


def test_the_next_attempt_waits_for_a_slow_member_of_the_failed_one() -> None:
    """A bad link fails some members of an attempt at once and others at their all-reduce
    timeout, later than ``join_timeout``: the next attempt waits for the slow one (a recovering
    member here; participants are waited for as unsettled), so that the failed attempt counts as
    evidence, and goes without it only once ``progress_timeout`` declares it hung."""
    job = Job(3, bad=set(), progress_timeout=5.0)
    first = [q for g in ("g0", "g1", "g2") for q in job.ask(g)]
    job.run(first[0])  # step 0 commits for everyone
    job.bad = {"g2"}
    job.inc["g1"], job.state["g1"] = "b", (0, GENESIS)  # g1 restarted from step 0: it recovers
    job.last_id["g1"], job.failed["g1"] = -1, False
    job.m.heartbeat(job.now, Heartbeat("g1:b", "g1", job.now, 0))
    issued = [q for g in ("g0", "g1", "g2") for q in job.ask(g)]
    assert len(issued) == 1 and issued[0].recovering == ["g1:b"]
    job.run(issued[0])  # it fails for everyone: g2 takes part
    assert not job.ask("g2") and not job.ask("g0")  # g1 is still in its collective
    job.now += 1.5 * job.m.options.join_timeout  # (past it, within progress_timeout)
    assert not job.feed(job.m.tick(job.now))
    assert "waiting for g1" in job.m.reason and "failed attempt of step 1" in job.m.reason
    again = job.ask("g1")
    assert len(again) == 1 and set(again[0].replica_ids()) == {"g0:a", "g1:b", "g2:a"}
    assert job.m.state.probe is not None and job.m.state.probe.failed == 1  # the attempt counted
    # A member that never asks again is waited for until progress_timeout declares it hung.
    job.run(again[0])
    stuck_since = job.now
    assert not job.ask("g2") and not job.ask("g0")
    job.now += job.m.options.join_timeout
    assert not job.feed(job.m.heartbeat(job.now, Heartbeat("g1:b", "g1", job.now, 0, progress_at=stuck_since))[1])
    assert "waiting for g1" in job.m.reason
    job.now = stuck_since + job.m.options.progress_timeout - 0.5
    assert not job.ask("g2") and not job.ask("g0")  # their long-polls ended: they ask again
    job.now = stuck_since + job.m.options.progress_timeout + 0.1
    later = job.feed(job.m.tick(job.now))
    assert len(later) == 1 and set(later[0].replica_ids()) == {"g0:a", "g2:a"}, job.m.reason


@pytest.mark.parametrize("seed", range(40))
def test_seeded_jobs_convict_exactly_the_bad_group(seed: int) -> None:
    """Any size from 3 to 16 groups, any bad group, any threshold, a bad link that starts at any
    step: the bad group (and only it) is retired after at most ``probe_after`` + log2(n) + 1
    failed attempts (each failed probe halves the suspects, a probe that commits narrows them, and
    one attempt convicts), and the job keeps committing."""
    rng = random.Random(seed)
    n = rng.randint(3, 16)
    probe_after = rng.randint(1, 5)
    bad = f"g{rng.randrange(n)}"
    job = Job(n, bad=set(), probe_after=probe_after)
    job.steps(rng.randint(0, 3 * n))
    job.bad = {bad}
    job.quorums.clear()
    job.steps(20 * n)
    assert [r.split(":")[0] for r, _ in job.retired] == [bad]
    assert failed_attempts(job) <= probe_after + math.ceil(math.log2(n)) + 1
    head = job.m.state.head[0]
    job.steps(5 * n)
    assert job.m.state.head[0] > head


@pytest.mark.parametrize("seed", range(20))
def test_seeded_jobs_with_several_bad_groups_convict_exactly_them(seed: int) -> None:
    """Two to four bad groups at once among 4 to 24, two good ones at least, bad from any step:
    every bad group (and only them) is retired, one search after another, and the job keeps
    committing with the others. Without setting cleared members aside (the first round's rule
    kept for every round) no seed here finds them all."""
    rng = random.Random(1000 + seed)
    d = rng.choice((2, 3, 4))
    n = rng.randint(d + 2, 24)
    bad = set(rng.sample([f"g{i}" for i in range(n)], d))
    job = Job(n, bad=set(), probe_after=rng.randint(1, 5))
    job.steps(rng.randint(0, 2 * n))
    job.bad = set(bad)
    job.steps(40 * n)
    assert sorted(r.split(":")[0] for r, _ in job.retired) == sorted(bad)
    head = job.m.state.head[0]
    job.steps(3 * n)
    assert job.m.state.head[0] > head


def test_probe_after_failures_is_validated() -> None:
    assert CoordinatorConfig().probe_after_failures == 3
    assert FTConfig().coordinator_config().probe_after_failures == 3
    with pytest.raises(ConfigError, match="probe_after_failures"):
        CoordinatorConfig(probe_after_failures=-1)
    with pytest.raises(ConfigError, match="below ft.max_consecutive_failures"):
        FTConfig(probe_after_failures=20, max_consecutive_failures=20)
    assert FTConfig(probe_after_failures=0).coordinator_config().probe_after_failures == 0
    assert FTConfig(max_consecutive_failures=2).probe_after_failures == 1  # unset: below it
    assert FTConfig(max_consecutive_failures=1).probe_after_failures == 0
