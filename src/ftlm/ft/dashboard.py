"""The coordinator's live dashboard: what it remembers for the page, and the page itself.

Responsible for: the bounded history the page shows (issued quorums, recoveries they started,
chaos kills requested; at most ``HISTORY`` of each and ``NAMES_KEPT`` names per quorum, so the
status stays small at any job size), each member's state as the latest quorum sees it, and the
HTML page with its inline script that polls ``GET /status`` and renders the tables (no build step,
no assets).

Not responsible for: serving (``ftlm.ft.coordinator`` owns the endpoints, auth and the state),
deciding anything, or killing (``POST /v1/kill`` only marks a replica; its own manager kills it).

Token handling: when the job has a token, ``GET /`` without it answers 401 with this page but no
data; the script takes the token from the URL fragment (``http://HOST:PORT/#token=SECRET``; the
fragment never leaves the browser), or asks with a prompt, keeps it in ``sessionStorage``, removes
it from the address bar and sends it as ``Authorization: Bearer`` on every request. The kill
button POSTs ``{"group": ...}`` as ``application/json`` with that header, from the page's own
origin: what the coordinator requires of every state-changing request.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

from ftlm.ft.quorum import Quorum
from ftlm.observe.charts import CHARTS_HTML, CHARTS_SCRIPT, CHARTS_STYLE, ChartHistory

HISTORY = 50
"""Issued quorums (distinct ids), recoveries and kills remembered for the page, each."""
NAMES_KEPT = 20
"""Participants (and recovering members) of a remembered quorum listed by name; the rest counted."""
REFRESH_SECONDS = 2.0


_roles: tuple[Quorum | None, frozenset[str], frozenset[str], frozenset[str]] = (
    None, frozenset(), frozenset(), frozenset())


def member_state(replica_id: str, last: Quorum | None) -> str:
    """``participating``, ``spare`` (current, training nothing: ``ftlm.ft.quorum.spares``),
    ``recovering`` or ``joining`` (alive but not in the latest quorum).

    The roles of the latest quorum are kept as sets: a status page or a metrics scrape asks this
    for every member, which must not cost a pass over the quorum each time."""
    global _roles
    if last is None:
        return "joining"
    if _roles[0] is not last:
        _roles = (last, frozenset(last.participants), frozenset(last.recovering), frozenset(last.spares))
    if replica_id in _roles[1]:
        return "participating"
    if replica_id in _roles[3]:
        return "spare"
    if replica_id in _roles[2]:
        return "recovering"
    return "joining"


class DashboardLog:
    """Bounded memory of what happened, in the order it happened (newest last)."""

    def __init__(self, size: int = HISTORY) -> None:
        self.quorums: deque[dict[str, Any]] = deque(maxlen=size)
        self.recoveries: deque[dict[str, Any]] = deque(maxlen=size)
        self.kills: deque[dict[str, Any]] = deque(maxlen=size)
        self.charts = ChartHistory()  # the page's charts (ftlm.observe.charts)

    def quorum_issued(self, quorum: Quorum, unix: float | None = None) -> None:
        """Record an issued quorum; the same id again (the next step) only extends its step range."""
        unix = time.time() if unix is None else unix
        self.charts.record_quorum(quorum.quorum_id, quorum.step, quorum.participants, quorum.recovering, unix)
        last = self.quorums[-1] if self.quorums else None
        if last is not None and last["quorum_id"] == quorum.quorum_id:
            last["last_step"] = quorum.step
            return
        self.quorums.append({
            "quorum_id": quorum.quorum_id, "step": quorum.step, "last_step": quorum.step,
            "participants": list(quorum.participants[:NAMES_KEPT]),
            "participants_total": len(quorum.participants),
            "recovering": list(quorum.recovering[:NAMES_KEPT]),
            "recovering_total": len(quorum.recovering),
            "spares": list(quorum.spares[:NAMES_KEPT]), "spares_total": len(quorum.spares),
            "reason": quorum.reason, "unix": round(unix, 3),
        })
        for rid in quorum.recovering[-self.recoveries.maxlen:]:  # only the newest are kept anyway
            self.recoveries.append({"replica_id": rid, "source": quorum.sources.get(rid, ""),
                                    "step": quorum.step, "quorum_id": quorum.quorum_id,
                                    "unix": round(unix, 3)})

    def kill_requested(self, group: str, replica_ids: list[str], unix: float | None = None) -> None:
        self.kills.append({"group": group, "replica_ids": list(replica_ids),
                           "unix": round(time.time() if unix is None else unix, 3)})

    def to_json(self) -> dict[str, Any]:
        """Newest first, as the page lists them."""
        return {"quorums": list(reversed(self.quorums)), "recoveries": list(reversed(self.recoveries)),
                "kills": list(reversed(self.kills)), "charts": self.charts.to_json()}


def render_page(status: dict[str, Any] | None) -> str:
    """The dashboard HTML; ``status`` (the ``/status`` JSON) is embedded so the first paint needs
    no request, or None when the caller is not authorised yet (the script then asks for a token)."""
    # "<" escaped as \u003c: the JSON cannot close the script element whatever the names hold.
    initial = json.dumps(status).replace("<", "\\u003c")
    page = _PAGE.replace("__CHARTS_STYLE__", CHARTS_STYLE).replace("__CHARTS_HTML__", CHARTS_HTML)
    page = page.replace("__CHARTS_SCRIPT__", CHARTS_SCRIPT)
    return page.replace("__INITIAL__", initial).replace("__REFRESH_MS__", str(int(REFRESH_SECONDS * 1000)))


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ftlm coordinator</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1em; }
th, td { border: 1px solid #bbb; padding: 3px 8px; text-align: left; font-size: 14px; }
th { background: #eee; }
.participating { background: #e3f6e3; } .spare { background: #eef7ee; } .recovering { background: #fff3cd; } .joining { background: #e8eefc; }
#notice { color: #a40; } #updated { color: #666; font-size: 12px; }
button { color: #a00; }
__CHARTS_STYLE__</style></head>
<body>
<h1>ftlm coordinator</h1>
<p id="summary">loading...</p>
<p id="notice"></p>
__CHARTS_HTML__<h2>Members</h2>
<table id="members"><thead><tr><th>group</th><th>incarnation</th><th>state</th><th>step</th>
<th>heartbeat age (s)</th><th>asking</th><th>role in last quorum</th><th>chaos</th></tr></thead>
<tbody></tbody></table>
<h2>Quorum history</h2>
<table id="quorums"><thead><tr><th>quorum id</th><th>steps</th><th>participants</th><th>recovering</th>
<th>reason</th><th>issued</th></tr></thead><tbody></tbody></table>
<h2>Recent failures</h2><ul id="failures"></ul>
<h2>Groups convicted of failing the steps they take part in</h2><ul id="convicted"></ul>
<h2>Recoveries</h2><ul id="recoveries"></ul>
<h2>Kills requested</h2><ul id="kills"></ul>
<p id="updated"></p>
<script>
"use strict";
const REFRESH_MS = __REFRESH_MS__;
const KEY = "ftlm-token";
let asked = false;

function token() {
  const m = location.hash.match(/token=([^&]*)/);
  if (m) {  // keep it out of the address bar and history once read
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem(KEY) || "";
}

function headers() {
  const t = token();
  const h = {"Content-Type": "application/json"};
  if (t) h["Authorization"] = "Bearer " + t;
  return h;
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells, cls) {
  const tr = el("tr", undefined, cls);
  for (const c of cells) {
    const td = el("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = String(c);
    tr.appendChild(td);
  }
  return tr;
}

function fill(id, nodes, empty) {
  const box = document.getElementById(id);
  const target = box.tagName === "TABLE" ? box.tBodies[0] : box;
  target.replaceChildren(...nodes);
  if (!nodes.length && box.tagName !== "TABLE") target.appendChild(el("li", empty));
}

function clock(unix) { return new Date(unix * 1000).toLocaleTimeString(); }

function names(list, total) {  // the server lists a bounded number of names
  const more = total > list.length ? " and " + (total - list.length) + " more" : "";
  return list.join(", ") + more;
}

async function kill(group) {
  if (!confirm("Kill the running replica of group " + group + "? (chaos drill)")) return;
  const r = await fetch("/v1/kill", {method: "POST", headers: headers(), body: JSON.stringify({group})});
  const body = await r.json().catch(() => ({}));
  document.getElementById("notice").textContent =
    r.ok ? "kill sent to " + body.replica_ids.join(", ") : "kill refused (" + r.status + "): " + (body.error || "");
  refresh(false);
}

__CHARTS_SCRIPT__
function render(s) {
  const last = s.last_quorum || {};
  const sources = last.sources || {};
  document.getElementById("summary").textContent =
    "quorum id " + s.quorum_id + " at step " + (last.step === undefined ? "-" : last.step) +
    "; min_replicas " + s.min_replicas +
    (s.spares && s.spares.length ? "; spares " + s.spares.join(", ") + " (" + s.spare_promotions + " promoted)" : "") +
    "; " + s.reason + (s.hot_path ? "; hot path " + s.hot_path : "") +
    (s.members_total > s.members.length ? "; showing " + s.members.length + " of " +
     s.members_total + " members (GET /status?offset=N for the rest)" : "");
  fill("members", s.members.map(m => {
    const role = m.state === "recovering" ? "recovering from " + (m.source || sources[m.replica_id] || "?")
      : m.state === "participating" ? "participant"
      : m.state === "spare" ? "spare (current, trains nothing)" : "";
    const b = el("button", "kill");
    b.onclick = () => kill(m.group);
    return row([m.group, m.incarnation, m.state, m.step, m.heartbeat_age_seconds.toFixed(2),
                m.pending ? "yes" : "", role, b], m.state);
  }));
  fill("quorums", s.quorums.map(q => row([q.quorum_id,
    q.step === q.last_step ? q.step : q.step + "-" + q.last_step,
    names(q.participants, q.participants_total) +
      (q.spares_total ? "; spares " + names(q.spares, q.spares_total) : ""),
    names(q.recovering, q.recovering_total),
    q.reason, clock(q.unix)])));
  fill("failures", s.dead.map(d => el("li", d.replica_id + ": " + d.reason + ", " +
    d.seconds_ago.toFixed(1) + " s ago")), "none");
  fill("convicted", (s.convicted || []).map(c => el("li", c.group + ": " + c.times +
    (c.times === 1 ? " time" : " times"))), "none");
  fill("recoveries", s.recoveries.map(r => el("li", r.replica_id + " from " + r.source +
    " at step " + r.step + " (quorum " + r.quorum_id + ", " + clock(r.unix) + ")")), "none");
  fill("kills", s.kills.map(k => el("li", k.group + " (" + k.replica_ids.join(", ") + ") at " +
    clock(k.unix))), "none");
  drawCharts(s.charts);
}

async function refresh(again) {
  const note = document.getElementById("updated");
  try {
    const r = await fetch("/status", {headers: headers(), cache: "no-store"});
    if (r.status === 401) {
      if (!asked) {  // ask once; afterwards the note says how to give it
        asked = true;
        const t = window.prompt("Job token (FTLM_TOKEN) for this coordinator:");
        if (t) { sessionStorage.setItem(KEY, t); return refresh(again); }
      }
      note.textContent = "unauthorized: open the page as /#token=<job token>";
    } else if (!r.ok) {
      note.textContent = "status answered " + r.status;
    } else {
      render(await r.json());
      note.textContent = "updated " + new Date().toLocaleTimeString() + ", every " + REFRESH_MS / 1000 + " s";
    }
  } catch (e) {
    note.textContent = "coordinator unreachable: " + e;
  }
  if (again) setTimeout(() => refresh(true), REFRESH_MS);
}

const initial = __INITIAL__;
if (initial) render(initial);
token();
setTimeout(() => refresh(true), initial ? REFRESH_MS : 0);
</script>
</body></html>
"""
