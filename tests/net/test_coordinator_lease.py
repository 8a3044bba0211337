"""The Kubernetes layout's standby coordinator on the network test bed: the lease holder's node
is lost (every packet dropped, no TCP reset) while two real groups train through the Service; the
standby takes the lease after its duration, the groups train on, and the old holder, once its
node is back, ends itself instead of answering (``bench.coordinator_takeover``, one trial)."""

from __future__ import annotations

import pytest

from bench.coordinator_takeover import trial
from ftlm.launch.lease import EXIT_LEASE_LOST, LeaseTiming


@pytest.mark.slow  # slow: two coordinators and two training groups in namespaces (a minute at load)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["node-lost", "drain"])
def test_the_standby_takes_over_a_lost_node_and_the_groups_train_on(tmp_path, demo_data, netbed_reason, fault):
    if netbed_reason:
        pytest.skip(netbed_reason)
    timing = LeaseTiming()
    row = trial(fault, tmp_path / "trial", demo_data, seq_len=64, vocab=1024)
    if fault == "node-lost":
        # Not before the lease could have lapsed (the holder renewed within a retry of the cut),
        # and not long after (the standby tries every retry; a loaded box adds seconds).
        assert timing.duration - timing.retry - 0.5 <= row["takeover_s"] <= timing.duration + 15
        assert row["old_holder_exit"] == EXIT_LEASE_LOST
    else:
        assert row["takeover_s"] <= 2 * timing.retry + 5  # released: taken at the next try
        assert row["old_holder_exit"] == 0
    assert row["stall_s"] < row["takeover_s"] + 60  # the groups committed again, 5 steps each
