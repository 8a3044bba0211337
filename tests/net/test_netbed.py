"""The network test bed itself: its rules as data, what a block does to a TCP connection, and
that nothing it makes outlives it, a crashed owner's bed included."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from ftlm.testing.netbed import (NETNS_ETC, PREFIX, REGISTRY, Faults, LinkShape, NetBed, Node,
                                 remove_stale)

HOSTS = {"a": "10.0.0.2", "b": "10.0.0.3", "c": "10.0.0.4"}
NODES = {n: Node(name=n, ns=f"ns-{n}", host=h, iface=f"eth-{n}") for n, h in HOSTS.items()}


def test_ruleset_drops_a_one_way_block_at_both_ends_and_an_isolated_node_everywhere():
    faults = Faults(blocked={("a", "b")}, isolated={"c"}, loss_pct={"a": 1.0})
    a, b, c = (faults.ruleset(NODES[n], HOSTS) for n in "abc")
    assert "ip daddr 10.0.0.3 drop" in a and "ip saddr" not in a
    assert "ip saddr 10.0.0.2 drop" in b and "ip daddr" not in b
    assert 'oifname "eth-c" drop' in c and 'iifname "eth-c" drop' in c
    assert a.count("numgen random mod 10000 < 100 drop") == 2  # 1 %, both directions
    assert "drop" not in Faults().ruleset(NODES["a"], HOSTS)


@pytest.mark.parametrize("bad", [{"loss_pct": 101}, {"delay_ms": -1}, {"jitter_ms": 5},
                                 {"reorder_pct": 10}, {"rate_mbit": "fast"}])
def test_link_shape_refuses_what_netem_would(bad):
    with pytest.raises(ValueError, match="LinkShape"):
        LinkShape(**bad)


def _connect(bed: NetBed, src: str, dst: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(({bed.node(dst).host!r}, {port}), timeout=0.7)"
    return bed.exec(src, [sys.executable, "-c", code]).returncode == 0


def test_block_cuts_one_direction_and_heal_restores_it(make_bed):
    bed = make_bed(["a", "b"])
    servers = [bed.popen(n, [sys.executable, "-c", textwrap.dedent(f"""
        import socket, sys
        s = socket.create_server(({bed.node(n).host!r}, 7001))
        print("up", flush=True)
        while True:
            s.accept()[0].close()
        """)], stdout=subprocess.PIPE, text=True) for n in ("a", "b")]
    for s in servers:
        assert s.stdout.readline().strip() == "up"
    assert _connect(bed, "a", "b", 7001) and _connect(bed, "b", "a", 7001)
    bed.block("a", "b", both_ways=False)
    # A TCP connection needs both directions: a one-way block cuts it from either side.
    assert not _connect(bed, "a", "b", 7001) and not _connect(bed, "b", "a", 7001)
    bed.heal()
    assert _connect(bed, "a", "b", 7001)
    bed.isolate("b")
    assert not _connect(bed, "a", "b", 7001)
    bed.heal("b")
    assert _connect(bed, "a", "b", 7001)


def _leftovers(bed_id: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = [n for n in names if n.startswith(PREFIX + bed_id)]
    found += [w for w in links.split() if w.startswith(PREFIX + bed_id)]
    found += [str(p) for p in NETNS_ETC.glob(f"{PREFIX}{bed_id}*")]
    return found + ([str(REGISTRY / bed_id)] if (REGISTRY / bed_id).exists() else [])


def test_a_crashed_owners_bed_is_removed_by_the_next_one(make_bed, tmp_path):
    # The owner builds a bed, starts a process in it, and dies by SIGKILL: nothing cleans up.
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        from ftlm.testing.netbed import NetBed
        bed = NetBed(["x"]).__enter__()
        bed.popen("x", ["sleep", "600"])
        print(bed.id, flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        bed_id = owner.stdout.readline().strip()
        assert bed_id and _leftovers(bed_id)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
    assert _leftovers(bed_id), "the SIGKILLed owner removed its bed: nothing to test"
    make_bed(["y"])  # a new bed sweeps stale ones first
    assert _leftovers(bed_id) == []
    assert bed_id not in remove_stale()


def test_a_closed_bed_leaves_nothing(make_bed):
    bed = make_bed(["a", "b"])
    sleeper = bed.popen("a", ["sleep", "600"])
    bed.block("a", "b")
    bed.close()
    assert sleeper.poll() is not None
    assert _leftovers(bed.id) == []


def test_launcher_refuses_a_place_for_a_process_it_does_not_start(tmp_path, make_tiny_config):
    from ftlm.errors import ConfigError
    from ftlm.launch.local import LocalLauncher
    node = Node(name="g5", ns="ns-g5", host="10.0.0.9", iface="eth-g5")
    with pytest.raises(ConfigError, match=r"places names \['g5'\].*g0..g1"):
        LocalLauncher(make_tiny_config(tmp_path / "run"), groups=2, places={"g5": node})


@pytest.mark.parametrize("nodes", [[], ["a", "a"], ["a b"], ["x" * 41], ["../etc"]])
def test_bed_refuses_node_names_it_cannot_make_namespaces_of(nodes):
    with pytest.raises(ValueError, match="node names|distinct"):
        NetBed(nodes)
