"""The coordinator page's charts: what the coordinator remembers for them, and how the page draws them.

``ChartHistory`` is fed every issued quorum (``ftlm.ft.dashboard`` calls ``record_quorum``) and
keeps, over the last ``WINDOW_SECONDS``, one point per ``BUCKET_SECONDS``: the step, the quorum's
participants and recovering members, and how many groups dropped out of the quorum; each group's
state over time (participating, recovering, absent) for up to ``TIMELINE_GROUPS`` groups; and a
live ETT estimate computed by ``ftlm.observe.summary``'s own ETT code (``LiveEtt``) from the
quorums, as described in ``record_quorum``. ``to_json`` is what ``GET /status`` carries under
``charts``; ``CHARTS_HTML`` and ``CHARTS_SCRIPT`` are the page's markup and inline script that
draw it as SVG (no external assets: the page works without internet access).

Not responsible for: serving, the rest of the page (``ftlm.ft.dashboard``), or Prometheus (the
same quantities are metrics too: ``ftlm.observe.metrics``). Everything here is bounded: a few
hundred points and at most ``TIMELINE_GROUPS`` timelines, whatever the job size; work per quorum
is constant unless the quorum's membership changed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ftlm.observe.live import LiveEtt

WINDOW_SECONDS = 600.0
"""How far back the charts go."""
BUCKET_SECONDS = 2.0
"""One point per this many seconds (300 points over the window)."""
TIMELINE_GROUPS = 32
"""Groups shown on the state timeline; a larger job shows counts only."""
ETT_EVENTS = 600
"""Events the coordinator's ETT estimate covers (the newest; about the charts' 10 minutes at a
step per second). It is computed on the coordinator's event loop at most every 5 s, so its cost
must stay small: about 10 ms for 600 events on an idle core."""


class ChartHistory:
    """Bounded history of the job as the coordinator's quorums show it (not thread-safe: the
    coordinator calls it from its event loop)."""

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self.points: deque[list[float]] = deque(maxlen=int(WINDOW_SECONDS / BUCKET_SECONDS) + 1)
        self.timeline: dict[str, list[list[Any]]] = {}  # group -> [[since, state], ...]
        self._quorum_id: int | None = None
        self._members: frozenset[str] = frozenset()
        self._states: dict[str, str] = {}
        self._cursor = 0  # participant-steps so far: the unit of the ETT estimate's "tokens"
        self._last: tuple[int, float, int] | None = None  # (step, unix, participants) of the last quorum
        self.ett = LiveEtt(clock=clock, max_events=ETT_EVENTS)

    def record_quorum(self, quorum_id: int, step: int, participants: Sequence[str],
                      recovering: Sequence[str], unix: float | None = None) -> None:
        """An issued quorum. Its issue time is the time the previous step (of the previous
        quorum) committed, which feeds the ETT estimate as a ``commit`` whose tokens are that
        quorum's participant count (every participant trains the same batch, and ETT is a ratio
        of token rates, so the unit cancels); a group dropping out of the quorum is a
        ``member_dead`` and a recovering member a ``recovery_start``, the disturbances that
        bound steady windows in ``ftlm.observe.summary``."""
        now = self._clock() if unix is None else unix
        dropped = 0
        if quorum_id != self._quorum_id:  # membership may have changed: the only O(members) work
            members = frozenset(participants) | frozenset(recovering)
            dropped = len(self._members - members)
            if dropped:
                self.ett.observe({"ts": now, "kind": "member_dead", "group": "", "step": step})
            if recovering:
                self.ett.observe({"ts": now, "kind": "recovery_start", "group": "", "step": step})
            self._quorum_id, self._members = quorum_id, members
            self._update_timeline(now, participants, recovering)
        if self._last is not None and step > self._last[0]:
            done, _, count = self._last
            self.ett.observe({"ts": now, "kind": "commit", "group": "", "step": done,
                              "samples": [self._cursor, self._cursor + count], "tokens": count})
            self._cursor += count
        self._last = (step, now, len(participants))
        self._point(now, step, len(participants), len(recovering), dropped)

    def _point(self, now: float, step: int, participants: int, recovering: int, dropped: int) -> None:
        bucket = now - now % BUCKET_SECONDS
        if self.points and self.points[-1][0] == bucket:
            last = self.points[-1]
            last[1:4] = [step, participants, recovering]
            last[4] += dropped
        else:
            self.points.append([bucket, step, participants, recovering, dropped])

    def _update_timeline(self, now: float, participants: Sequence[str], recovering: Sequence[str]) -> None:
        states = {_group(r): "recovering" for r in recovering}
        states.update({_group(p): "participating" for p in participants})
        if len(set(states) | set(self.timeline)) > TIMELINE_GROUPS:
            self.timeline.clear()  # too many groups to draw one line each: counts only
            return
        for group in set(states) | set(self.timeline):
            state = states.get(group, "absent")
            segments = self.timeline.setdefault(group, [])
            if not segments or segments[-1][1] != state:
                segments.append([round(now, 3), state])
        horizon = now - WINDOW_SECONDS
        for segments in self.timeline.values():  # drop segments that ended before the window
            while len(segments) > 1 and segments[1][0] < horizon:
                segments.pop(0)

    def to_json(self) -> dict[str, Any]:
        """The charts' data: ``points`` ``[unix, step, participants, recovering, dropped]``
        (oldest first), ``timeline`` (group -> ``[[since, state], ...]``), ``ett`` (0..1 or None
        before two steps) and the server's ``now``."""
        now = self._clock()
        ett = self.ett.value()
        return {"now": round(now, 3), "window_seconds": WINDOW_SECONDS,
                "points": [[round(p[0], 3), *p[1:]] for p in self.points if p[0] >= now - WINDOW_SECONDS],
                "timeline": {g: s for g, s in sorted(self.timeline.items())},
                "ett": None if ett is None else round(ett, 4)}


def _group(replica_id: str) -> str:
    """Replica ids are ``<group>:<incarnation>``; the timeline is per group."""
    return replica_id.partition(":")[0]


CHARTS_HTML = """<h2>Last 10 minutes</h2>
<p id="ett">live ETT: -</p>
<div id="charts" style="display:flex;flex-wrap:wrap;gap:12px"></div>
<div id="timeline"></div>
"""

CHARTS_STYLE = """.chart { border: 1px solid #ccc; background: #fcfcfc; }
.chart text { font-size: 11px; fill: #444; }
"""

# Plain SVG built with the DOM API: no library, no network. drawCharts(s.charts) is called with
# each /status; it replaces the previous drawing.
CHARTS_SCRIPT = """
const SVG_NS = "http://www.w3.org/2000/svg";
const STATE_COLORS = {participating: "#4caf50", recovering: "#f0ad00", absent: "#d9534f"};

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function lineChart(title, t0, t1, series, unit) {
  const W = 360, H = 150, L = 40, B = 20, T = 18;
  const box = svg("svg", {width: W, height: H, class: "chart", "data-title": title});
  box.appendChild(svg("text", {x: L, y: 12}, title));
  let ymax = 1;
  for (const s of series) for (const [, y] of s.values) ymax = Math.max(ymax, y);
  const x = t => L + (W - L - 8) * (t - t0) / Math.max(t1 - t0, 1);
  const y = v => H - B - (H - B - T) * v / ymax;
  box.appendChild(svg("line", {x1: L, y1: H - B, x2: W - 8, y2: H - B, stroke: "#999"}));
  box.appendChild(svg("text", {x: 2, y: T + 8}, ymax.toFixed(ymax < 10 ? 1 : 0) + (unit || "")));
  box.appendChild(svg("text", {x: 2, y: H - B}, "0"));
  box.appendChild(svg("text", {x: L, y: H - 4}, "-" + Math.round((t1 - t0) / 60) + " min"));
  box.appendChild(svg("text", {x: W - 30, y: H - 4}, "now"));
  series.forEach((s, i) => {
    if (!s.values.length) return;
    if (s.bars) {
      for (const [t, v] of s.values) if (v > 0)
        box.appendChild(svg("line", {x1: x(t), x2: x(t), y1: y(0), y2: y(v), stroke: s.color, "stroke-width": 2}));
    } else {
      const pts = s.values.map(([t, v]) => x(t).toFixed(1) + "," + y(v).toFixed(1)).join(" ");
      box.appendChild(svg("polyline", {points: pts, fill: "none", stroke: s.color, "stroke-width": 1.5}));
    }
    box.appendChild(svg("text", {x: L + 8 + i * 110, y: T + 12, style: "fill:" + s.color}, s.name));
  });
  return box;
}

function stepRate(points) {  // committed steps per minute, over about 20 s
  const out = [];
  for (let i = 0, j = 0; i < points.length; i++) {
    while (points[i][0] - points[j][0] > 20) j++;
    const dt = points[i][0] - points[j][0];
    if (dt > 0) out.push([points[i][0], 60 * (points[i][1] - points[j][1]) / dt]);
  }
  return out;
}

function timelineChart(timeline, t0, t1) {
  const groups = Object.keys(timeline);
  const W = 1104, row = 14, L = 60;
  const box = svg("svg", {width: W, height: 20 + row * groups.length, class: "chart", "data-title": "states"});
  box.appendChild(svg("text", {x: L, y: 12}, "group states (green participating, amber recovering, red absent)"));
  const x = t => L + (W - L - 8) * (Math.max(t, t0) - t0) / Math.max(t1 - t0, 1);
  groups.forEach((g, i) => {
    const y = 18 + i * row;
    box.appendChild(svg("text", {x: 2, y: y + 10}, g));
    const segs = timeline[g];
    segs.forEach(([since, state], k) => {
      const end = k + 1 < segs.length ? segs[k + 1][0] : t1;
      if (end < t0) return;
      box.appendChild(svg("rect", {x: x(since), y: y, width: Math.max(x(end) - x(since), 1), height: row - 3,
        fill: STATE_COLORS[state] || "#999", "data-group": g, "data-state": state}));
    });
  });
  return box;
}

function drawCharts(c) {
  if (!c) return;
  document.getElementById("ett").textContent = "live ETT (coordinator's estimate from its quorums): " +
    (c.ett === null ? "- (fewer than two steps)" : (100 * c.ett).toFixed(1) + "%");
  const t1 = c.now, t0 = t1 - c.window_seconds, p = c.points;
  document.getElementById("charts").replaceChildren(
    lineChart("quorum size", t0, t1, [
      {name: "participants", color: "#2e7d32", values: p.map(q => [q[0], q[2]])},
      {name: "recovering", color: "#f0ad00", values: p.map(q => [q[0], q[3]])}]),
    lineChart("committed steps / min", t0, t1, [
      {name: "steps/min", color: "#1565c0", values: stepRate(p)}]),
    lineChart("groups dropped from the quorum", t0, t1, [
      {name: "dropped", color: "#c62828", bars: true, values: p.map(q => [q[0], q[4]])}]));
  const groups = Object.keys(c.timeline || {});
  document.getElementById("timeline").replaceChildren(...(groups.length ? [timelineChart(c.timeline, t0, t1)] : []));
}
"""
