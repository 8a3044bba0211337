"""A real Prometheus scrapes two groups' TrainingMetrics and the coordinator; promtool lints them;
the Grafana dashboard only queries metrics that are exported."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ftlm.ft.client import CoordinatorClient, Heartbeater
from ftlm.ft.config import CoordinatorConfig
from ftlm.ft.coordinator import Coordinator
from ftlm.observe.metrics import COORDINATOR_METRICS, TRAINING_METRICS, TrainingMetrics, metric_names

TOKEN = "s3cret"
JOB = "chaos"
REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"


def http_text(url: str, token: str = "") -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
        return resp.read().decode()


def free_port() -> int:
    # Prometheus cannot listen on port 0 and report it; the tiny race with another process is
    # acceptable on a loopback test port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def job():
    """A coordinator with a token, two heartbeating groups with one quorum, and each group's rank 0
    exporting training metrics fed directly."""
    coord = Coordinator(CoordinatorConfig(token=TOKEN, heartbeat_timeout=5.0, join_timeout=3.0, expected_groups=2))
    coord.start()
    clients = [CoordinatorClient(coord.url, g, "a", token=TOKEN) for g in ("g0", "g1")]
    beats = [Heartbeater(c, 0.2, lambda: (0, 0)) for c in clients]
    for hb in beats:
        hb.beat()
        hb.start()
    exporters = {g: TrainingMetrics(JOB, g, 0) for g in ("g0", "g1")}
    try:
        with ThreadPoolExecutor(2) as pool:
            quorums = [f.result(10) for f in [pool.submit(c.quorum, 0, 0, False, {}, 10.0) for c in clients]]
        for i, (group, m) in enumerate(exporters.items()):
            m.start()
            m.on_quorum(quorums[0].quorum_id, participants=2, recovering=0, wait_seconds=0.01)
            for step in range(4):
                m.on_commit(step, loss=3.0 - 0.1 * step + i, tokens=512, step_seconds=0.25, lr=1e-3,
                            grad_norm=0.5, mfu=0.3, data_wait_seconds=0.01)
                m.on_allreduce(0.02)
            m.sample_memory()
        yield coord, exporters
    finally:
        for m in exporters.values():
            m.stop()
        for hb in beats:
            hb.stop()
        for c in clients:
            c.close()
        coord.stop()


def test_promtool_accepts_every_endpoint(job) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'; `make system-deps` installs it)")
    coord, exporters = job
    for url, token in [(f"{coord.url}/metrics", TOKEN), *[(f"http://127.0.0.1:{m.port}/metrics", "")
                                                          for m in exporters.values()]]:
        text = http_text(url, token)
        out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{url}: {out.stdout}{out.stderr}"
        assert "ftlm_" in text


class Prometheus:
    def __init__(self, binary: str, tmp: Path, targets: dict[str, int], coordinator_port: int,
                 file_sd: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        # honor_labels keeps the exported job label; the coordinator's scrape job is named after
        # the ftlm job, since the coordinator exports no job label of its own (docs/observability.md).
        text = (
            "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n"
            "scrape_configs:\n"
            "  - job_name: ftlm-ranks\n    honor_labels: true\n    static_configs:\n"
            f"      - targets: [{', '.join(f'127.0.0.1:{p}' for p in targets.values())}]\n"
        )
        if coordinator_port:
            text += (f"  - job_name: {JOB}\n    authorization:\n      credentials: {TOKEN}\n"
                     f"    static_configs:\n      - targets: ['127.0.0.1:{coordinator_port}']\n")
        if file_sd is not None:  # the local launcher's targets file (rewritten on restarts)
            text += ("  - job_name: ftlm-launched\n    honor_labels: true\n    file_sd_configs:\n"
                     f"      - files: ['{file_sd}']\n        refresh_interval: 1s\n")
        config.write_text(text)
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, promql: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            answer = json.loads(http_text(url))
        except OSError:
            return []  # not listening yet
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def wait_for(self, promql: str, pred, timeout: float = 15.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, "prometheus exited; see prometheus.log in the test's tmp dir"
            result = self.query(promql)
            if pred(result):
                return result
            assert time.monotonic() < deadline, f"{promql}: not as expected in {timeout} s, last {result}"
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


def by_group(result: list[dict]) -> dict[str, float]:
    return {r["metric"]["group"]: float(r["value"][1]) for r in result}


def test_prometheus_scrapes_training_and_ft_series_across_a_group_restart(job, tmp_path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package 'prometheus'; `make system-deps` installs it)")
    coord, exporters = job
    prom = Prometheus(binary, tmp_path, {g: m.port for g, m in exporters.items()}, coord.port)
    try:
        loss = prom.wait_for("ftlm_train_loss", lambda r: len(r) == 2)
        assert {r["metric"]["group"] for r in loss} == {"g0", "g1"}
        for r in loss:
            labels = r["metric"]
            assert (labels["job"], labels["rank"], labels["__name__"]) == (JOB, "0", "ftlm_train_loss")
        assert by_group(loss) == pytest.approx({"g0": 2.7, "g1": 3.7})
        assert by_group(prom.query("ftlm_train_steps_committed_total")) == {"g0": 4, "g1": 4}
        assert by_group(prom.query("ftlm_train_tokens_per_second")) == {"g0": 2048, "g1": 2048}
        assert by_group(prom.query("ftlm_ft_participants")) == {"g0": 2, "g1": 2}
        rss = by_group(prom.query("ftlm_process_resident_memory_bytes"))
        assert all(10e6 < v < 1e12 for v in rss.values()), rss
        assert by_group(prom.query("ftlm_train_step_duration_seconds_count")) == {"g0": 4, "g1": 4}
        # Fault-tolerance series from the coordinator, under the job's name.
        members = prom.wait_for(f'ftlm_coordinator_members_participating{{job="{JOB}"}}', lambda r: len(r) == 1)
        assert float(members[0]["value"][1]) == 2
        ages = by_group(prom.query(f'ftlm_coordinator_heartbeat_age_seconds{{job="{JOB}"}}'))
        assert set(ages) == {"g0", "g1"} and all(0 <= a < 5 for a in ages.values())
        assert float(prom.query("ftlm_coordinator_quorum_id")[0]["value"][1]) >= 1

        # g0 restarts: its new process serves the same labels on the same port, counters from 0.
        old = exporters["g0"]
        port = old.port
        old.stop()
        new = exporters["g0"] = TrainingMetrics(JOB, "g0", 0, port=port)
        new.start()
        new.on_commit(4, loss=2.5, tokens=512, step_seconds=0.25, lr=1e-3)
        series = prom.wait_for('ftlm_train_steps_committed_total{group="g0"}',
                               lambda r: len(r) == 1 and float(r[0]["value"][1]) == 1)
        assert len(series) == 1  # one series, not one per incarnation
        resets = prom.query('resets(ftlm_train_steps_committed_total{group="g0"}[5m])')
        assert float(resets[0]["value"][1]) >= 1
        assert len(prom.query('ftlm_train_loss{group="g0"}[5m]')) == 1
    finally:
        prom.stop()


# ------------------------------------------------------------------------------------- Grafana


def _exprs(dashboard: dict) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return out


def test_grafana_dashboard_queries_only_exported_metrics() -> None:
    dashboards = sorted((GRAFANA / "dashboards").glob("*.json"))
    assert dashboards, "no Grafana dashboard in deploy/grafana/dashboards"
    datasource_yaml = (GRAFANA / "provisioning" / "datasources" / "ftlm.yaml").read_text()
    provider_yaml = (GRAFANA / "provisioning" / "dashboards" / "ftlm.yaml").read_text()
    assert "apiVersion: 1" in datasource_yaml and "type: prometheus" in datasource_yaml
    assert "apiVersion: 1" in provider_yaml and "type: file" in provider_yaml
    known = metric_names()
    used: set[str] = set()
    for path in dashboards:
        dash = json.loads(path.read_text())
        assert dash["uid"] and dash["title"]
        graphs = [p for p in dash["panels"] if p["type"] != "row"]
        assert len(graphs) >= 10
        for p in graphs:
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
            # Each panel uses the dashboard's datasource variable (the provisioned one by default).
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert {"job", "group"} <= set(variables) and variables["group"]["includeAll"]
        assert [p for p in dash["panels"] if p["type"] == "row" and p.get("repeat") == "group"]
        for expr in _exprs(dash):
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            for name in re.findall(r"\bftlm_[a-z0-9_]+", expr):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert name in known or base in known, f"{path.name}: {name} is not exported ({expr})"
                used.add(name if name in known else base)
    # The overview covers the headline figures: loss, tokens/s, MFU, participants, recoveries,
    # stalls, memory, GPU;
    for needed in ("ftlm_train_loss", "ftlm_train_tokens_total", "ftlm_train_mfu_ratio",
                   "ftlm_coordinator_members_participating", "ftlm_ft_recoveries_total", "ftlm_ft_stall_seconds",
                   "ftlm_process_resident_memory_bytes", "ftlm_gpu_utilization_ratio",
                   # and live ETT, checkpoint age, GPU health, network and storage
                   "ftlm_train_ett_ratio", "ftlm_checkpoint_age_seconds", "ftlm_gpu_temperature_celsius",
                   "ftlm_ft_allreduce_bytes_total", "ftlm_checkpoint_write_seconds", "ftlm_run_dir_free_bytes",
                   # and GB/s of every state transfer and storage read (bytes over seconds)
                   "ftlm_ft_transfer_received_bytes_total", "ftlm_ft_transfer_received_seconds_total",
                   "ftlm_ft_transfer_sent_bytes_total", "ftlm_ft_transfer_sent_seconds_total",
                   "ftlm_checkpoint_read_bytes_total", "ftlm_checkpoint_read_seconds_total",
                   "ftlm_data_read_bytes_total", "ftlm_data_read_seconds_total"):
        assert needed in used, needed
    assert used <= set(TRAINING_METRICS) | set(COORDINATOR_METRICS)
