"""Observability of a run: the structured event log, the run summary and the run report.

``events`` writes and reads ``events.jsonl``; ``summary`` turns events into ``summary.json``
(data accounting, stalls, ETT); ``report`` renders ``report.md`` and the console summary.
``metrics`` exports a rank's Prometheus families (with ``gpu``: NVML, ``live``: the live ETT,
``tracing``: OpenTelemetry spans); ``charts`` draws the coordinator page's charts.
"""

from ftlm.observe.events import KINDS, EventLog, Events, NullEvents, read_events
from ftlm.observe.report import format_summary, write_report
from ftlm.observe.summary import build_summary, write_summary

__all__ = ["KINDS", "EventLog", "Events", "NullEvents", "read_events", "build_summary",
           "write_summary", "write_report", "format_summary"]
