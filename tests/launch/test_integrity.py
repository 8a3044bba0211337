"""Silent data corruption caught while training: one bit of one group's state flips
(``FTLM_FAULT=bitflip@STEP``); the state digests the groups send every ``ft.integrity_every``
steps differ from the majority's, the coordinator retires that group (``state_mismatch``), and it
comes back recovering from a majority member: the job ends with identical replicas.

The coordinator's side of every case (a minority, no majority, a late report, quarantine) is
tested without processes in tests/ft/test_membership_integrity.py; ``test_sdc_over_seeds`` (slow
tier) repeats the default test's run over 20 seeds.
"""

from __future__ import annotations

import random

import pytest

from ftlm.errors import EXIT_RETIRED
from ftlm.launch.local import LocalLauncher
from ftlm.observe.events import read_events

from tests.launch.test_fault_tolerance import ALL_IN_FIRST_QUORUM, check_invariants, make_config

EVERY = 5


def run_flip(tmp_path, demo_data, group: str, point: str, step: int, steps: int = 30) -> None:
    """Three groups; ``point`` (bitflip or bitflip_moment) fires in ``group`` at ``step``: the
    group is named within ``EVERY`` steps, retired, restarted, and the replicas end identical."""
    config = make_config(tmp_path / "run", demo_data, steps=steps,
                         ft={**ALL_IN_FIRST_QUORUM, "integrity_every": EVERY})
    summary = LocalLauncher(config, groups=3, progress=False, faults={group: [f"{point}@{step}"]}).run()
    events = read_events(config.run.path / "events.jsonl")
    (flip,) = [e for e in events if e["kind"] == "failure_injected" and e.get("point") == point]
    assert flip["group"] == group
    (mismatch,) = [e for e in events if e["kind"] == "state_mismatch"]
    assert mismatch["target"] == group and mismatch["host"] == "127.0.0.1"
    assert flip["step"] <= mismatch["step"] < flip["step"] + EVERY, (flip, mismatch)
    digests = mismatch["digests"]
    assert len(digests) == 3 and digests[group] != mismatch["majority"]
    assert sorted(g for g, d in digests.items() if d == mismatch["majority"]) == sorted({"g0", "g1", "g2"} - {group})
    exits = [e for e in events if e["kind"] == "group_exit" and e.get("target") == group and e.get("ok") is False]
    assert [e["code"] for e in exits] == [EXIT_RETIRED] and summary["restarts"][group] == 1
    check_invariants(summary, events, 3, steps=steps)


@pytest.mark.slow  # slow: 80-100 s of real processes; by default the integrity unit tests and the simulator's corruption seeds cover the rule
def test_a_flipped_parameter_bit_is_found_and_its_group_recovers_from_the_majority(tmp_path, demo_data):
    """g2's state has one parameter bit flipped at step 7: found at the digest of step 10."""
    run_flip(tmp_path, demo_data, "g2", "bitflip", 7)


SEEDS = 20


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", range(SEEDS))
def test_sdc_over_seeds(tmp_path, demo_data, seed):
    """The default test's scenario over 20 seeds: the group, the step and whether a parameter or
    an optimizer moment is corrupted drawn from the seed (45 min on a loaded 2-core box; the
    default tier runs one of them, ``test_a_flipped_parameter_bit_...``)."""
    rng = random.Random(seed)
    run_flip(tmp_path, demo_data, rng.choice(["g1", "g2"]), rng.choice(["bitflip", "bitflip_moment"]),
             rng.randrange(3, 15))
