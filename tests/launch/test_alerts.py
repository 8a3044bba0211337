"""The Prometheus alerts: current in deploy/, valid for promtool, firing when they should.

``promtool test rules`` feeds synthetic series to the rules (deploy/prometheus/alerts_test.yml)
and checks which alerts fire at which time; skipped, saying why, where promtool is missing
(`make system-deps` installs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ftlm.errors import ConfigError
from ftlm.launch.alerts import AlertBounds, dump_yaml, prometheus_rule_groups, rules_file
from ftlm.launch.cluster_config import ClusterConfig
from ftlm.launch.k8s import build_manifests
from ftlm.observe.metrics import metric_names

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed: run `make system-deps`")


def test_repository_rules_file_is_current():
    assert (PROMETHEUS / "alerts.yml").read_text() == rules_file(), \
        "regenerate: python -m ftlm.launch.alerts > deploy/prometheus/alerts.yml"


def test_rules_refer_only_to_exported_metrics():
    names = metric_names()
    exprs = [r["expr"] for g in prometheus_rule_groups(AlertBounds()) for r in g["rules"]]
    assert len(exprs) >= 5
    for expr in exprs:
        for name in re.findall(r"\bftlm_[a-z0-9_]+", expr):
            assert name in names or re.sub(r"_(bucket|sum|count)$", "", name) in names, name


@needs_promtool
def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    r = subprocess.run(["promtool", "check", "rules", str(PROMETHEUS / "alerts.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(["promtool", "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # The tests can fail: a bound that no test scenario crosses makes them fail.
    for a, b in (("> 60", "> 600"), ("< 0.8", "< 0.01"), ("> 3600", "> 360000")):
        (tmp_path / "alerts.yml").write_text((PROMETHEUS / "alerts.yml").read_text().replace(a, b))
        (tmp_path / "alerts_test.yml").write_text((PROMETHEUS / "alerts_test.yml").read_text())
        r = subprocess.run(["promtool", "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0, f"the tests pass with {b!r} instead of {a!r}"


@needs_promtool
def test_kubernetes_prometheus_rule_is_valid_and_selects_the_job(tmp_path, tiny_config):
    config = tiny_config()
    docs = build_manifests(config, ClusterConfig(namespace="ml"), config.to_toml(), "0" * 64)
    rule = docs["monitoring/prometheusrule.yaml"]
    assert rule["kind"] == "PrometheusRule" and rule["metadata"]["namespace"] == "ml"
    groups = rule["spec"]["groups"]
    for r in groups[0]["rules"]:
        for selector in re.findall(r"\bftlm_[a-z0-9_]+(\{[^}]*\})?", r["expr"]):
            assert selector == f'{{job="{config.run.name}"}}', r["expr"]
    path = tmp_path / "rules.yml"
    path.write_text(dump_yaml({"groups": groups}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert yaml.safe_load(path.read_text())["groups"] == groups


@pytest.mark.parametrize("text", [
    "a script\nof two lines\n", "no final newline\nhere", "two final newlines\n\n",
    " leading space\nx\n", "trailing space \nx\n", "tab\tand\r\ncarriage return\n",
    "yes", "true", "null", "0123", "1e3", "", "- dash", "a: colon", "#hash", "{{ $labels.job }}",
    "ünïcode ✓\n\u2028line separator\n", "\x00\x07 control"])
def test_yaml_keeps_any_text_exact(text):
    doc = {"key": text, "list": [text, {"nested": text}], text or "empty": 1}
    assert yaml.safe_load(dump_yaml(doc)) == doc


def test_yaml_keeps_key_order_and_writes_blocks():
    text = dump_yaml({"z": 1, "a": {"script": "set -e\nrun\n"}, "m": [True, None, 1.5]})
    assert text == "z: 1\na:\n  script: |\n    set -e\n    run\nm:\n- true\n- null\n- 1.5\n"


@pytest.mark.parametrize("field,value", [("ett_ratio", 1.5), ("no_commit_window", "ten"),
                                         ("stall_seconds", 0)])
def test_bad_bounds_are_refused(field, value):
    with pytest.raises(ConfigError, match=f"alerts.{field}"):
        AlertBounds(**{field: value})


def _expected(name: str, job: str, rules_job: str = "") -> dict:
    """The alert ``name`` of job ``job`` as promtool reports it, annotations filled in."""
    (rule,) = [r for g in prometheus_rule_groups(AlertBounds(), job=rules_job)
               for r in g["rules"] if r["alert"] == name]
    return {"exp_labels": {**rule["labels"], "job": job},
            "exp_annotations": {k: v.replace("{{ $labels.job }}", job)
                                for k, v in rule["annotations"].items()}}


def _promtool_test(tmp_path, rules: str, tests: list[dict]) -> subprocess.CompletedProcess:
    (tmp_path / "rules.yml").write_text(rules)
    (tmp_path / "rules_test.yml").write_text(dump_yaml({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run(["promtool", "test", "rules", "rules_test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)


@needs_promtool
def test_a_job_whose_every_series_disappears_alerts(tmp_path):
    """Every rank and the coordinator of job "tiny" vanish at minute 10 (their pods deleted, the
    nodes gone): FtlmNoCommits and FtlmGroupDown then compare nothing. Some critical alert
    fires all the same, and none while the job reports."""
    series = [{"series": 'ftlm_train_steps_committed_total{job="tiny", group="g0", rank="0"}',
               "values": "0+10x10 stale"},
              {"series": 'ftlm_coordinator_heartbeat_age_seconds{job="tiny", group="g0"}',
               "values": "1x10 stale"}]
    firing = [{"eval_time": "8m", "alertname": "FtlmJobGone", "exp_alerts": []},
              {"eval_time": "20m", "alertname": "FtlmJobGone",
               "exp_alerts": [_expected("FtlmJobGone", "tiny")]},
              # Past the look-back nothing is left to compare: the alert ends by itself.
              {"eval_time": "80m", "alertname": "FtlmJobGone", "exp_alerts": []}]
    r = _promtool_test(tmp_path, rules_file(), [
        {"interval": "1m", "input_series": series, "alert_rule_test": firing}])
    assert r.returncode == 0, r.stdout + r.stderr
    # One job's rules (the PrometheusRule of `ftlm launch k8s`): also when it was never scraped.
    absent = [{"eval_time": "10m", "alertname": "FtlmJobAbsent",
               "exp_alerts": [_expected("FtlmJobAbsent", "tiny", rules_job="tiny")]}]
    other = [{"series": 'ftlm_train_steps_committed_total{job="other", group="g0", rank="0"}',
              "values": "0+10x20"}]
    r = _promtool_test(tmp_path, rules_file(job="tiny"), [
        {"interval": "1m", "input_series": other, "alert_rule_test": absent}])
    assert r.returncode == 0, r.stdout + r.stderr
