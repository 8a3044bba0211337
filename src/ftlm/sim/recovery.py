"""How a simulated group gets back to the job's state: a live pull from a peer, the replay of its
backlog, and a reload of a newer durable checkpoint.

``Recovery`` pulls a peer's published snapshot (slow now and then, failing when the source dies
or drops it), loads it once it arrived, replays the buffered updates behind it over one or more
steps (checked by the real ``ftlm.ft.group.check_replay`` against each step's head, as the
trainer does) and reports the head after the vote of the step it reached it in
(``GroupProtocol.caught_up``). Told that no live group holds the head, a group loads the newest
durable checkpoint newer than its state (the session's ``_reload_checkpoint``).

Not responsible for when a recovery starts (the quorum's role, ``ftlm.sim.group``), nor for what
is on disk (``ftlm.sim.durable``). The catch-up buffer is unbounded here: its overflow rule
(``ftlm.train.catchup``) is not modelled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftlm.ft.group import REPLAY_AT_LEAST, check_replay
from ftlm.ft.history import extend_chain
from ftlm.ft.quorum import Quorum
from ftlm.sim.job import Incarnation, copy_state

if TYPE_CHECKING:
    from ftlm.sim.world import Simulation



class Recovery:
    """Live recovery and reloads from disk in one ``Simulation``."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.c = sim.c

    # -- a newer durable checkpoint ----------------------------------------------------------------
    def told_to_reload(self, inc: Incarnation, head: int) -> None:
        """``Manager._request_quorum`` raises ReloadCheckpoint, which the trainer's step handles
        (after the update, for a request sent early)."""
        inc.polling = False
        if inc.phase == "updating":
            inc.reload_head = head
        else:
            self.reload(inc, head)

    def reload(self, inc: Incarnation, head: int) -> None:
        """The session's ``_reload_checkpoint``: no live group holds the head, so load the newest
        durable checkpoint if it is newer than this group's state, dropping a pull in flight or a
        snapshot being replayed; then ask again (saying it looked: ``disk_checked``)."""
        sim = self.sim
        disk = sim.storage.disk
        newer = [s for s in disk if s > inc.state.step]
        inc.phase = "reloading"
        if not newer:
            sim.log(f"{inc.replica_id} finds no checkpoint newer than step {inc.state.step} (head {head})")
            self.reload_done(inc)
            return
        pick = max(newer)
        lo, hi = self.c.reload_seconds

        def loaded() -> None:
            if not inc.alive or inc.left or inc.phase != "reloading" or inc.hung_training:
                return
            before = inc.state.step
            inc.state = copy_state(disk[pick])
            inc.writer = False
            inc.catching, inc.buffer = False, {}
            if inc.fetch is not None or inc.proto.fetching:
                inc.fetch = None
                inc.proto.fetch_finished()
            sim.log(f"{inc.replica_id} loaded the checkpoint of step {pick} (was at {before}, head {head})")
            if not inc.running:
                inc.update_pending = True  # SIGSTOPped while loading: it asks after SIGCONT
                return
            self.reload_done(inc)
        sim.at(sim.rng.uniform(lo, hi), loaded, f"reload {inc.replica_id}")

    def reload_done(self, inc: Incarnation) -> None:
        inc.phase = "idle"
        self.sim.group_model.next_step(inc)

    # -- a live pull -------------------------------------------------------------------------------
    def start_fetch(self, inc: Incarnation, q: Quorum, source: str) -> None:
        sim = self.sim
        if inc.catching:  # its pull arrived and is being replayed: a second one is wasted work
            sim.fail(f"{inc.replica_id} started a second pull while replaying the snapshot it loaded")
        fetch = {"source": source, "step": q.step, "done": False, "result": None}
        inc.fetch = fetch
        seconds = sim.faults.transfer_seconds(sim.rng.uniform(0.05, 0.5))
        src = sim.incarnation(source)
        if src is not None:
            sim.faults.transfer_started(src, seconds)

        def arrive() -> None:
            s = sim.incarnation(source)
            if s is not None and s.running and not s.left and q.step in s.published:
                fetch["result"] = copy_state(s.published[q.step])
            fetch["done"] = True
        sim.at(seconds, arrive, f"transfer to {inc.replica_id}")

    def load_snapshot(self, inc: Incarnation) -> None:
        """The trainer loads the pulled snapshot once it arrived (``poll_recovery``); its backlog
        of buffered updates is then replayed over one or more steps (``replay_backlog``)."""
        fetch = inc.fetch
        if inc.catching or fetch is None or not fetch["done"]:
            return
        inc.fetch = None
        if fetch["result"] is None:
            inc.proto.fetch_finished()
            return  # the pull failed: the next quorum assigns a source again
        inc.state = fetch["result"]
        inc.catching = True
        self.sim.log(f"{inc.replica_id} loaded the snapshot of step {inc.state.step}")

    def replay_backlog(self, inc: Incarnation, q: Quorum, until_head: bool) -> bool:
        """The session's ``Recovery._replay``: the buffered updates from the state's step on
        (``CatchUpBuffer.run_from``) must lead to the head of ``q`` (``check_replay``); then at
        least ``REPLAY_AT_LEAST`` are applied, more while the all-reduce waits (a random number
        here), all of them with ``until_head``. False (and the pull starts over) when they do not
        lead there."""
        sim = self.sim
        st = inc.state
        inc.buffer = {s: r for s, r in inc.buffer.items() if s >= st.step}
        later = sorted(inc.buffer)
        records = ([(s, *inc.buffer[s]) for s in later]
                   if later == list(range(st.step, st.step + len(later))) else None)
        check = (check_replay(st.step, st.chain, [(s, qi, p) for s, qi, p, _ in records], q, False)
                 if records is not None else None)
        if check is None or not check.ok:
            inc.catching = False  # the snapshot stays loaded; the group reports its step and recovers again
            inc.proto.fetch_finished()  # the manager's restart_recovery
            inc.buffer = {}
            sim.log(f"{inc.replica_id} replay rejected: {check.reason if check else 'a buffered update is missing'}")
            return False
        n = (check.apply if until_head
             else min(check.apply, max(REPLAY_AT_LEAST, sim.rng.randint(0, check.apply))))
        for s, qid, parts, samples in records[:n]:
            st = st.after(extend_chain(st.chain, s, qid, parts), samples)
            del inc.buffer[s]
        if n == check.apply:
            sim.invariants.check_replayed(inc, st, q)
        inc.state = st
        sim.invariants.remember(st)
        sim.log(f"{inc.replica_id} replayed to step {st.step} (head {q.step})")
        return True

    def finish_catch_up(self, inc: Incarnation, q: Quorum, committed: bool) -> None:
        """The trainer's ``_finish_catch_up``: after the vote of the step the group caught up to,
        apply that step's average if it committed here, and report the state from now on."""
        inc.catching = False
        inc.buffer = {}
        st = inc.state
        if committed:
            samples = len(q.participants) * self.c.batch
            before, st = st, st.after(q.next_chain(), samples)
            self.sim.invariants.record_commit(inc, q, before, st)
            inc.state = st
            self.sim.invariants.remember(st)
        inc.proto.caught_up(st.step, st.chain)
        self.sim.log(f"{inc.replica_id} caught up to step {st.step}")
