"""Prometheus alerting rules for a fault-tolerant job, from the metrics ftlm exports.

``prometheus_rule_groups`` builds the rule groups (plain data) that ``ftlm.launch.k8s`` puts in a
``PrometheusRule`` and that ``deploy/prometheus/alerts.yml`` holds for a Prometheus configured by
hand (``python -m ftlm.launch.alerts > deploy/prometheus/alerts.yml`` regenerates it; a test
checks that it is current, ``promtool check rules`` that it parses and ``promtool test rules``
that each alert fires when it should and not otherwise).

The alerts: a replica group down (seen in the last 30 minutes, no fresh heartbeat now); no
committed step for a while; the p90 stall of the healthy groups above a bound; member failures
above a rate; effective training time (ETT, the share of wall time spent in committed steps)
below a bound; the newest durable checkpoint older than a bound (``ftlm_checkpoint_age_seconds``,
which every rank computes from the checkpoint directory when scraped); and, since those compare
series that exist and go silent once none does, a job whose every rank stopped reporting
(``FtlmJobGone``; with a job named, ``FtlmJobAbsent``: ``absent()`` of its series).

``dump_yaml`` writes these rules and ``ftlm.launch.k8s``'s manifests as YAML (PyYAML).

It only writes rules: it does not evaluate them, and it reads no metric (names come from
``ftlm.observe.metrics``, so a rule never refers to a family nobody exports).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import yaml

from ftlm.errors import ConfigError
from ftlm.observe.metrics import metric_names

CHECKPOINT_AGE = "ftlm_checkpoint_age_seconds"
"""Seconds since the newest durable checkpoint, as each rank sees its checkpoint directory."""


@dataclass(frozen=True)
class AlertBounds:
    """Thresholds of the alerts; the defaults suit steps of seconds to a minute."""

    group_down_for: str = "5m"
    """How long a group may be gone (restart and recovery included) before it alerts."""
    heartbeat_stale_seconds: float = 60.0
    """A heartbeat older than this counts as no heartbeat (ft.heartbeat_timeout is usually less)."""
    no_commit_window: str = "10m"
    """No committed step in this window alerts (N steps: N x the step time)."""
    stall_seconds: float = 60.0
    """p90 stall of the healthy groups per failure over 15 minutes above this alerts."""
    failures_per_hour: float = 3.0
    """Member failures (deaths, replacements) in the last hour above this alert."""
    ett_ratio: float = 0.8
    """Effective training time over 30 minutes below this share of wall time alerts."""
    checkpoint_age_seconds: float = 3600.0
    """Newest durable checkpoint older than this alerts."""
    gone_for: str = "5m"
    """How long every rank of a job may be silent (no series at all) before it alerts."""
    gone_lookback: str = "1h"
    """A job that exported within this window and exports nothing now is gone."""

    def __post_init__(self) -> None:
        for name in ("group_down_for", "no_commit_window", "gone_for", "gone_lookback"):
            value = getattr(self, name)
            if not (isinstance(value, str) and value[:-1].isdigit() and value[-1] in "smh"):
                raise ConfigError(f"alerts.{name}={value!r} must be a duration such as 5m, 30s, 1h")
        for name in ("heartbeat_stale_seconds", "stall_seconds", "failures_per_hour",
                     "checkpoint_age_seconds"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ConfigError(f"alerts.{name}={getattr(self, name)!r} must be a number > 0")
        if not isinstance(self.ett_ratio, (int, float)) or not 0 < self.ett_ratio < 1:
            raise ConfigError(f"alerts.ett_ratio={self.ett_ratio!r} must be in (0, 1)")


def prometheus_rule_groups(bounds: AlertBounds, job: str = "") -> list[dict[str, Any]]:
    """One rule group ``ftlm`` (or ``ftlm-<job>``: only that job's series when ``job`` is set)."""
    def m(name: str, extra: str = "") -> str:
        if name not in metric_names() and name.removesuffix("_bucket").removesuffix(
                "_sum").removesuffix("_count") not in metric_names():
            raise AssertionError(f"alert refers to {name}, which ftlm does not export")
        labels = ", ".join(x for x in (f'job="{job}"' if job else "", extra) if x)
        return f"{name}{{{labels}}}" if labels else name

    def rule(name: str, expr: str, for_: str, severity: str, summary: str,
             description: str) -> dict[str, Any]:
        return {"alert": name, "expr": expr, "for": for_,
                "labels": {"severity": severity, "component": "ftlm"},
                "annotations": {"summary": summary, "description": description}}

    b = bounds
    age = m("ftlm_coordinator_heartbeat_age_seconds")
    committed = m("ftlm_train_steps_committed_total")
    rules = [
        rule("FtlmGroupDown",
             f"group by (job, group) (max_over_time({age}[30m])) "
             f"unless group by (job, group) ({age} < {b.heartbeat_stale_seconds:g})",
             b.group_down_for, "warning", "Replica group {{ $labels.group }} of {{ $labels.job }} is down",
             "The group heartbeated in the last 30 minutes but has no fresh heartbeat: it died and "
             "has not come back (restarts used up, unschedulable, or a crash loop). The other "
             "groups keep training with less data-parallel width."),
        rule("FtlmNoCommits",
             f"sum by (job) (increase({m('ftlm_train_steps_committed_total')}[{b.no_commit_window}])) == 0",
             "1m", "critical", "{{ $labels.job }} committed no step in " + b.no_commit_window,
             "Every group is stalled: coordinator unreachable, no quorum (too few groups), or all "
             "groups recovering. See the coordinator's /status and the groups' logs."),
        rule("FtlmStallHigh",
             "histogram_quantile(0.9, sum by (job, le) "
             f"(rate({m('ftlm_ft_stall_seconds_bucket')}[15m]))) > {b.stall_seconds:g}",
             "5m", "warning",
             "Failures stall the healthy groups of {{ $labels.job }} for {{ $value | humanizeDuration }}",
             "p90 over 15 minutes of how long the healthy groups waited per failure. Usually "
             "ft.heartbeat_timeout or the quorum timeout is too long for the step time, or groups "
             "are SIGKILLed instead of leaving (check the graceful-stop grace)."),
        rule("FtlmMemberFailuresHigh",
             f"sum by (job) (increase({m('ftlm_coordinator_member_failures_total')}[1h])) "
             f"> {b.failures_per_hour:g}",
             "0m", "warning", "{{ $labels.job }}: {{ $value | humanize }} member failures in the last hour",
             "Groups keep dying or being replaced: bad nodes, OOM, spot reclaims, or a crash "
             "loop. Each failure costs a recovery."),
        rule("FtlmEffectiveTrainingTimeLow",
             f"max by (job) (rate({m('ftlm_train_steps_committed_total')}[30m]) "
             f"* rate({m('ftlm_train_step_duration_seconds_sum')}[30m]) "
             f"/ rate({m('ftlm_train_step_duration_seconds_count')}[30m])) < {b.ett_ratio:g}",
             "15m", "warning", "{{ $labels.job }} trains {{ $value | humanizePercentage }} of the time",
             "Effective training time (committed steps x mean step time, per wall second) of the "
             "best group over 30 minutes: the rest goes to stalls, recoveries and failed steps."),
        # The freshest view of any rank: a group without the shared volume sees no checkpoint
        # (no series), one that wrote or can read the newest sees its true age.
        rule("FtlmCheckpointStale",
             f"min by (job) ({m(CHECKPOINT_AGE)}) > {b.checkpoint_age_seconds:g}",
             "5m", "warning",
             "The newest checkpoint of {{ $labels.job }} is {{ $value | humanizeDuration }} old",
             "No durable checkpoint recently: a loss of every group at once would cost this much "
             "training. Check checkpoint.every, the writer group's log and the volume's free "
             "space (ftlm_run_dir_free_bytes)."),
        # The rules above compare series that exist: once every rank of a job is gone (all
        # groups and their pods, or the scrape itself), they have nothing to compare and stay
        # silent. These fire on the absence itself.
        rule("FtlmJobGone",
             f"group by (job) (max_over_time({committed}[{b.gone_lookback}])) "
             f"unless group by (job) ({committed})",
             b.gone_for, "critical", "No rank of {{ $labels.job }} reports any more",
             "Every rank of the job stopped reporting (it exported in the last "
             f"{b.gone_lookback}): all groups are down, their nodes are gone, or Prometheus "
             "lost its targets. A run that finished or was stopped on purpose also ends this "
             "way: silence the alert then."),
    ]
    if job:
        # A rule group for one job: also before its first scrape (never started, or the
        # scrape config does not find its ranks), and past the look-back above.
        rules.append(rule(
            "FtlmJobAbsent", f"absent({committed})", b.gone_for, "critical",
            f"No rank of {job} is scraped",
            "Prometheus holds no committed-step series of this job: it is not running, "
            "or its ranks are not scraped (ports, PodMonitor, file_sd entries). Stop the "
            "alert by deleting these rules with the job."))
    return [{"name": f"ftlm-{job}" if job else "ftlm", "rules": rules}]


class _ManifestDumper(yaml.SafeDumper):
    """``yaml.safe_dump`` that writes multi-line text (a config file, a script) as a ``|`` block."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # PyYAML falls back to a quoted scalar on its own where a block could not keep the text exact
    # (trailing spaces on a line, control characters).
    style = "|" if "\n" in value.rstrip("\n") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _represent_str)


def dump_yaml(obj: Any) -> str:
    """One YAML document for ``obj`` (plain data): keys in their order, block style, no line
    folding (a PromQL expression stays on one line)."""
    return yaml.dump(obj, Dumper=_ManifestDumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=1 << 20)


def rules_file(bounds: AlertBounds | None = None, job: str = "") -> str:
    """A Prometheus rules file (``rule_files:``) with the alerts."""
    header = ("# Generated by `python -m ftlm.launch.alerts` (ftlm.launch.alerts); do not edit.\n"
              "# Load with rule_files: in prometheus.yml; on Kubernetes the PrometheusRule of\n"
              "# `ftlm launch k8s` (monitoring/prometheusrule.yaml) carries the same rules.\n")
    return header + dump_yaml({"groups": prometheus_rule_groups(bounds or AlertBounds(), job)})


if __name__ == "__main__":
    sys.stdout.write(rules_file(job=sys.argv[1] if len(sys.argv) > 1 else ""))
