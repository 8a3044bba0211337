"""The nemesis's ledger of network faults (``bench.nemesis.network_ledger``): which faults the
job had to detect and did not, which convictions no fault explains. Pure, on hand-made events."""

from __future__ import annotations

from bench.nemesis import SETTLE_SECONDS, network_ledger


def fault(ts: float, target: str, expect: str, **fields) -> dict:
    return {"ts": ts, "kind": "failure_injected", "group": "netbed", "target": target,
            "expect": expect, **fields}


def healed(ts: float, target: str = "*") -> dict:
    return {"ts": ts, "kind": "network_healed", "group": "netbed", "target": target}


def dead(ts: float, target: str) -> dict:
    return {"ts": ts, "kind": "member_dead", "group": "coordinator", "target": target}


def failed(ts: float, group: str) -> dict:
    return {"ts": ts, "kind": "step_failed", "group": group}


def test_a_partition_detected_while_it_lasts_is_matched():
    events = [fault(10, "g1", "detected", fault="block", peer="coordinator"), dead(12, "g1:abc"),
              healed(15)]
    assert network_ledger(events, detect_within=5) == ([], [])


def test_a_cut_between_groups_is_detected_by_a_failed_step_of_either_end():
    events = [fault(10, "g1", "detected", fault="block", peer="g0"), failed(16, "g0"), healed(17)]
    assert network_ledger(events, detect_within=5) == ([], [])


def test_an_undetected_partition_and_a_conviction_during_a_tolerated_fault_are_reported():
    cut = fault(10, "g1", "detected", fault="isolate")
    lossy = fault(30, "g2", "tolerated", fault="shape")
    conviction = dead(32, "g2:def")
    events = [cut, healed(15), lossy, conviction, healed(40, "g2")]
    undetected, unexplained = network_ledger(events, detect_within=5)
    assert undetected == [cut]
    assert [(c["kind"], c["target"], c["ts"]) for c in unexplained] == [("member_dead", "g2", 32)]


def test_a_conviction_long_after_the_fault_healed_is_unexplained():
    late = dead(15 + SETTLE_SECONDS + 1, "g1:abc")
    events = [fault(10, "g1", "either", fault="block", peer="g0"), healed(15), late]
    undetected, unexplained = network_ledger(events, detect_within=5)
    assert undetected == [] and [c["ts"] for c in unexplained] == [late["ts"]]


def test_a_node_of_a_multi_node_group_counts_for_its_group():
    events = [fault(10, "g1.r1", "detected", fault="isolate"), dead(40, "g1:abc"), healed(41)]
    assert network_ledger(events, detect_within=5) == ([], [])


def test_a_groups_own_planned_stop_explains_its_conviction():
    stop = {"ts": 10, "kind": "failure_injected", "group": "g0", "point": "during_serve",
            "signal": "SIGSTOP"}
    assert network_ledger([stop, dead(12, "g0:abc")], detect_within=5) == ([], [])
    kill = dict(stop, signal="SIGKILL")
    assert network_ledger([kill], detect_within=5)[0][0]["target"] == "g0"  # undetected
