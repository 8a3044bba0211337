"""The job's coordinator as a supervised process, and the supervisor's side of its HTTP API.

Responsible for: starting ``ftlm coordinator`` on its port, or on another one when that port is
taken meanwhile (or a restart asks for one), and writing where it serves to the job's address file
(``address_file``, which the groups read again at every reconnect: ``FTLM_COORDINATOR_FILE``);
keeping a warm standby (``ftlm.launch.coordinator_standby``) that
takes over within tens of milliseconds when the coordinator dies instead of the seconds a cold
start costs, waiting until it answers, killing it (chaos, a restart), and the calls the supervisor
makes with the job token: ``GET /status`` and ``POST /v1/dead``. Also the adapter that writes the
coordinator's events into the run's ``events.jsonl``.

Not responsible for: deciding when to restart it (``ftlm.launch.local`` does), or anything the
coordinator decides (``ftlm.ft.coordinator``).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ftlm.errors import FtlmError
from ftlm.ft.coordinator_address import url_of, write_address
from ftlm.observe.events import EventLog

ERROR_PREFIX = "ftlm: error: "
"""How the CLI starts the one line it prints for an ``FtlmError`` (exit status 2)."""


def _port_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (as the coordinator binds: address reuse on,
    so a port left in TIME_WAIT by the last one counts as free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_port(host: str) -> int:
    """A port on ``host`` that the operating system has just found free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class CoordinatorUnreachable(Exception):
    """The coordinator did not answer (it is down, restarting or overloaded)."""


class CoordinatorEvents:
    """Adapts the coordinator's events to the run's event log: the group an event is about is
    written as ``target`` (the record's ``group`` is the emitting process, ``coordinator``)."""

    def __init__(self, log: EventLog):
        self.log = log

    def emit(self, kind: str, **fields: Any) -> None:
        step = fields.pop("step", -1)
        if "group" in fields:
            fields["target"] = fields.pop("group")
        self.log.emit(kind, step=step if isinstance(step, int) else -1, **fields)


def error_line(log: Path, offset: int = 0) -> str:
    """The reason a process printed before it failed: its last ``ftlm: error:`` line (without
    the prefix), else its last non-empty line, read from ``offset`` of ``log``; "" if none."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in lines if line.startswith(ERROR_PREFIX)]
    if errors:
        return errors[-1][len(ERROR_PREFIX):].strip()
    text = [line.strip() for line in lines if line.strip()]
    return text[-1] if text else ""


RECORD_NAME = "coordinator_record.jsonl"
"""The coordinator's conviction record, next to the run's events.jsonl."""


class CoordinatorProcess:
    """``ftlm coordinator`` for one job, started (and restarted) by the supervisor."""

    def __init__(self, config_file: Path, port: int, token: str, events: Path, log: Path,
                 host: str = "127.0.0.1", tls: ssl.SSLContext | None = None, standby: bool = True,
                 address_file: Path | None = None, prefix: list[str] | None = None):
        self.config_file = Path(config_file)
        self.tls = tls  # the coordinator serves HTTPS (ft.tls_cert): verify it with this
        self.host = host
        self.port = port
        self.token = token
        self.events = Path(events)
        # Convictions and finished leaves, kept across restarts (``ftlm.ft.coordinator_record``).
        self.record = self.events.with_name(RECORD_NAME)
        self.log = Path(log)
        self.proc: subprocess.Popen | None = None
        self.started = 0.0  # when the current process began answering
        self.standby = standby  # keep a warm process ready to take over (see module docstring)
        self._standby: subprocess.Popen | None = None
        self.warm_starts = 0  # starts served by the standby (the others were cold)
        # Rewritten with ``url`` at every start: where the groups find it (FTLM_COORDINATOR_FILE).
        self.address_file = Path(address_file) if address_file is not None else None
        self._log_offset = 0
        # What its command (and its standby's) is started with, e.g. ``ip netns exec NS`` to run
        # it in a network namespace of its own (``ftlm.testing.netbed``); the PID is still its own.
        self.prefix = list(prefix or [])

    @property
    def url(self) -> str:
        return url_of("https" if self.tls else "http", self.host, self.port)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def start(self, ready_timeout: float, port: int | None = None) -> None:
        """Start the process (the warm standby when one is ready, else a cold one) on ``port``
        (default: its port; a free one instead when another process took that meanwhile) and
        wait (at most ``ready_timeout`` s) until ``/status`` answers; ``FtlmError`` with its own
        error line when it exits or never answers. Then write the address file and start the
        next standby."""
        if port is not None:
            self.port = port
        elif self.proc is not None and not _port_free(self.host, self.port):
            self.port = _free_port(self.host)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log.stat().st_size if self.log.is_file() else 0
        self.proc = self._take_standby()
        if self.proc is None:
            cmd = [*self.prefix, sys.executable, "-m", "ftlm.cli", "coordinator", str(self.config_file),
                   "--host", self.host, "--port", str(self.port), "--events", str(self.events),
                   "--record", str(self.record)]
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(cmd, env=self._env(), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        else:
            self.warm_starts += 1
        deadline = time.monotonic() + ready_timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                why = error_line(self.log, self._log_offset) or f"see {self.log}"
                raise FtlmError(f"the coordinator exited with status {code} at start: {why}")
            try:
                self.status(timeout=1.0)
                break
            except CoordinatorUnreachable:
                if time.monotonic() > deadline:
                    self.kill()
                    raise FtlmError(f"the coordinator did not answer on {self.url} within "
                                    f"{ready_timeout:.0f} s (ft.startup_timeout); see {self.log}")
                time.sleep(0.02)
        self.started = time.time()
        if self.address_file is not None:
            write_address(self.address_file, self.url)
        if self.standby:
            self._spawn_standby()

    def _env(self) -> dict[str, str]:
        return dict(os.environ, FTLM_TOKEN=self.token, PYTHONUNBUFFERED="1")

    def _spawn_standby(self) -> None:
        cmd = [*self.prefix, sys.executable, "-m", "ftlm.launch.coordinator_standby", str(self.config_file),
               "--host", self.host, "--port", str(self.port), "--events", str(self.events),
               "--record", str(self.record)]
        with open(self.log, "ab") as log:
            self._standby = subprocess.Popen(cmd, env=self._env(), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.PIPE)

    def _take_standby(self) -> subprocess.Popen | None:
        """The standby, told to serve; None when there is none or it died (then start cold)."""
        proc, self._standby = self._standby, None
        if proc is None or proc.poll() is not None:
            return None
        try:
            proc.stdin.write(f"serve {self.port}\n".encode())
            proc.stdin.close()
        except OSError:  # it died meanwhile
            proc.kill()
            proc.wait(timeout=10)
            return None
        return proc

    def kill(self) -> None:
        """SIGKILL the process (a coordinator failure) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (it closes its server and exits), SIGKILL after ``timeout`` s; the standby too."""
        standby, self._standby = self._standby, None
        if standby is not None and standby.poll() is None:
            standby.kill()  # it serves nothing yet: nothing to close cleanly
            standby.wait(timeout=10)
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    # -- HTTP -------------------------------------------------------------------------------------
    def status(self, timeout: float = 2.0) -> dict:
        """``GET /status``; ``CoordinatorUnreachable`` when there is no answer."""
        code, body = self._request("GET", "/status", None, timeout)
        if code != 200 or not isinstance(body, dict):
            raise CoordinatorUnreachable(f"GET /status answered {code}: {body}")
        return body

    def report_dead(self, group: str, incarnation: str, reason: str, timeout: float = 2.0) -> bool:
        """``POST /v1/dead``: the replica's process ended, drop it now instead of waiting for its
        heartbeat to expire. False when the coordinator could not be told (it is restarting: the
        new one never knew the replica, or learns from its missing heartbeat)."""
        try:
            code, _ = self._request("POST", "/v1/dead", {"group": group, "incarnation": incarnation,
                                                         "reason": reason}, timeout)
        except CoordinatorUnreachable:
            return False
        return code == 200

    def _request(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        conn = (http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self.tls)
                if self.tls else http.client.HTTPConnection(self.host, self.port, timeout=timeout))
        try:
            conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                         headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise CoordinatorUnreachable(f"{method} {path}: {e!r}") from e
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw) if raw else {}
        except ValueError:
            return resp.status, raw[:200].decode(errors="replace")
