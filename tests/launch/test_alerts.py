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
