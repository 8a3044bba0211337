"""A real Prometheus scrapes a real 2-group fault-tolerant run through the launcher's targets file."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from ftlm.launch.local import LocalLauncher

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "observe"))
from test_fault_tolerance import make_config  # noqa: E402
from test_prometheus import Prometheus, by_group  # noqa: E402


def test_prometheus_scrapes_a_two_group_run(tmp_path, demo_data):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package 'prometheus'; `make system-deps`)")
    config = make_config(tmp_path / "run", demo_data, steps=300)
    config.observe.metrics = True
    targets = config.run.path / "prometheus_targets.json"
    config.run.path.mkdir(parents=True)
    targets.write_text("[]")
    prom = Prometheus(binary, tmp_path, {}, coordinator_port=0, file_sd=targets)
    try:
        summary = LocalLauncher(config, groups=2, progress=False).run()
        assert summary["replicas_identical"]
        # Series outlive the scraped processes in Prometheus's storage: look back over the run.
        steps = prom.wait_for("max_over_time(ftlm_train_steps_committed_total[10m])",
                              lambda r: len(r) == 2)
        values = by_group(steps)
        assert set(values) == {"g0", "g1"} and all(v > 0 for v in values.values())
        for r in steps:
            assert r["metric"]["job"] == config.run.name and r["metric"]["rank"] == "0"
        quorum = by_group(prom.query("max_over_time(ftlm_ft_quorum_id[10m])"))
        assert set(quorum) == {"g0", "g1"} and all(v >= 1 for v in quorum.values())
        # (a gauge reads 0 before the first commit, so look at the largest value seen)
        loss = by_group(prom.query("max_over_time(ftlm_train_loss[10m])"))
        assert all(0 < v < 10 for v in loss.values()), loss
        # Wired by the job: the manager's all-reduce bytes and the live ETT from the group's events.
        sent = by_group(prom.query("max_over_time(ftlm_ft_allreduce_bytes_total[10m])"))
        assert set(sent) == {"g0", "g1"} and all(v > 0 for v in sent.values()), sent
        ett = by_group(prom.query("max_over_time(ftlm_train_ett_ratio[10m])"))
        assert set(ett) == {"g0", "g1"} and all(0 < v <= 1 for v in ett.values()), ett
        # Storage: every group's loader read its data shards (ftlm.observe.iostats).
        read = by_group(prom.query("max_over_time(ftlm_data_read_bytes_total[10m])"))
        assert set(read) == {"g0", "g1"} and all(v > 0 for v in read.values()), read
    finally:
        prom.stop()
