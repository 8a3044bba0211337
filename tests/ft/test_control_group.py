"""Control traffic inside a multi-rank replica group stays on gloo when the data group is NCCL.

NCCL refuses CPU tensors, so a quorum broadcast or commit vote on the NCCL default group crashes a
multi-rank GPU group at start-up. Two real processes stand in for one group: their default group
is gloo made to refuse CPU tensors the way NCCL does (and to report itself as "nccl"), and the
manager's control collectives must still work.
"""

from __future__ import annotations

import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    rank, path = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
    from ftlm.ft import group_control
    real_get_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is None else real_get_backend(group)

    def refuse_cpu(fn):
        def wrapped(*args, group=None, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a]
            if group is None and any(t.device.type == "cpu" for t in tensors):
                raise RuntimeError("NCCL: CPU tensors are not supported")
            return fn(*args, group=group, **kwargs)
        return wrapped

    control = group_control.control_group()
    for name in ("broadcast", "all_reduce", "all_gather"):
        setattr(dist, name, refuse_cpu(getattr(dist, name)))
    quorum = group_control.broadcast_json({"quorum_id": 7} if rank == 0 else None, 2, control)
    urls = group_control.gather_strings(f"http://127.0.0.1:{rank}", 2, control)
    vote = group_control.group_all(rank == 0, 2, control)
    print(json.dumps({"quorum": quorum, "urls": urls, "vote": vote,
                      "backend": real_get_backend(control)}))
    dist.destroy_process_group()
""")


def test_control_collectives_run_on_gloo_beside_an_nccl_data_group(two_ranks) -> None:
    results = two_ranks(_SCRIPT)
    for r in results:
        assert r["backend"] == "gloo"
        assert r["quorum"] == {"quorum_id": 7}
        assert r["urls"] == ["http://127.0.0.1:0", "http://127.0.0.1:1"]
        assert r["vote"] is False


_MANAGER = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    rank, path = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
    from ftlm.ft.config import FTConfig
    from ftlm.ft.manager import Manager
    # No FTLM_INCARNATION (as under torchrun on a cluster): each rank passes nothing.
    m = Manager(FTConfig(), "g0", "", "http://127.0.0.1:9")
    print(json.dumps({"replica_id": m.replica_id, "urls": m.transfer_urls}))
    m.close()
    dist.destroy_process_group()
""")


def test_the_ranks_of_a_group_share_one_incarnation(two_ranks) -> None:
    """Each rank drew its own incarnation id, so every rank but 0 was not in its own quorum."""
    a, b = two_ranks(_MANAGER)
    assert a["replica_id"] == b["replica_id"] and a["replica_id"].startswith("g0:")
    assert len(a["replica_id"]) > len("g0:") and a["urls"] == b["urls"]


_END_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    rank, path = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2)
    from ftlm.ft.manager import Manager
    from ftlm.ft.protocol import ReloadCheckpoint
    from ftlm.ft.quorum import Convicted, StaleIncarnation

    m = Manager.__new__(Manager)  # only what _next_quorum reads: the leader asks, the others follow
    m.rank, m.ranks, m.control = rank, 2, None

    def told(*_): raise __ERROR__
    m._request_quorum = told
    try:
        m._next_quorum()
        got = {"raised": None}
    except (ReloadCheckpoint, StaleIncarnation) as e:
        got = {"raised": type(e).__name__, "head": getattr(e, "head", None), "why": str(e),
               "suspect": getattr(e, "suspect_state", None)}
    print(json.dumps(got))
    dist.destroy_process_group()
""")


def test_every_rank_of_a_group_is_told_to_reload_when_its_leader_is(two_ranks) -> None:
    """A leader told that no live group holds the head raises ``ReloadCheckpoint``; the other
    ranks, waiting for its quorum answer, raise it too (with the head), so every rank loads the
    checkpoint together instead of hanging in the broadcast."""
    results = two_ranks(_END_SCRIPT.replace("__ERROR__", 'ReloadCheckpoint(41, "no live group holds step 41")'))
    assert results == [{"raised": "ReloadCheckpoint", "head": 41, "why": "no live group holds step 41",
                        "suspect": None}] * 2


@pytest.mark.parametrize("error, suspect", [("StaleIncarnation", None), ("Convicted", None),
                                            ("Convicted", [12, "c" * 64])])
def test_every_rank_of_a_group_exits_when_the_coordinator_retires_it(two_ranks, error, suspect) -> None:
    """A leader whose incarnation the coordinator retired (replaced, or ``Convicted``: a bad link
    found, ``quorum.Probe``, or a state suspect of a corrupt group's bits with the state whose
    checkpoint it sets aside) raises that error; the other ranks raise the same one (every rank
    of a convicted group exits with EXIT_RETIRED) instead of waiting in the broadcast for an
    answer that never comes."""
    why = "replica g0:x was retired: its link fails the steps it takes part in; this process must exit"
    args = f"{why!r}" if suspect is None else f"{why!r}, {tuple(suspect)!r}"
    results = two_ranks(_END_SCRIPT.replace("__ERROR__", f"{error}({args})"))
    got = [{**r, "suspect": r["suspect"] and list(r["suspect"])} for r in results]
    assert got == [{"raised": error, "head": None, "why": why, "suspect": suspect}] * 2


_WAIT_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    rank, path = int(sys.argv[1]), sys.argv[2]
    # The group's collective timeout, short: a leader silent past it leaves its ranks failing.
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))
    from ftlm.ft.config import FTConfig
    from ftlm.ft.manager import Manager
    from ftlm.ft.protocol import StopRequested

    m = Manager.__new__(Manager)  # only what _next_quorum reads: the leader asks, the others follow
    m.rank, m.ranks, m.control = rank, 2, None
    m.config = FTConfig(heartbeat_interval=0.05, heartbeat_timeout=0.3, allreduce_timeout=0.5,
                        quorum_timeout=1.0, give_up_seconds=60.0)

    def wait_out_an_outage(keepalive):  # the coordinator unreachable for 6 s, then a SIGTERM
        until = time.monotonic() + 6.0
        while time.monotonic() < until:
            keepalive()
            time.sleep(0.1)
        raise StopRequested("asked to stop while waiting for a quorum")
    m._request_quorum = wait_out_an_outage
    try:
        m._next_quorum()
        got = {"raised": None}
    except StopRequested as e:
        got = {"raised": type(e).__name__}
    print(json.dumps(got))
    dist.destroy_process_group()
""")


def test_the_other_ranks_wait_with_their_leader_through_a_coordinator_outage(two_ranks) -> None:
    """A leader waiting out a coordinator outage three times the group's collective timeout
    keeps its ranks waiting with it (a word every ``_rank_keepalive_every`` s), and they end as
    it does; without that word their broadcast failed at the timeout and every rank but the
    leader crashed."""
    assert two_ranks(_WAIT_SCRIPT, timeout=90) == [{"raised": "StopRequested"}] * 2
