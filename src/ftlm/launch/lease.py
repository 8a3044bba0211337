"""The coordinator's warm standby on Kubernetes: leader election over a ``Lease``, fencing, routing.

Two coordinator pods run ``ftlm coordinator --lease NAME``. Each imports everything and reads the
config at start; then one holds the ``coordination.k8s.io/v1`` Lease ``NAME`` and serves, and the
other waits to take it. A node lost under the serving one costs the job about the lease's
duration (``LeaseTiming.duration``, 10 s) instead of the node controller's grace period, the
eviction and a new pod's start (about 60-70 s with the generated tolerations).

The rules, as Kubernetes' own controllers elect their leaders (client-go's ``leaderelection``):

* The holder renews the lease every ``retry`` s. A candidate takes it when it is free (no
  holder: a holder that stopped gracefully released it) or when it has seen the same record,
  unchanged, for ``duration`` s **on its own clock**: never by the holder's timestamps, since the
  nodes' clocks differ. Writes carry the ``resourceVersion`` read, so of two candidates one wins.
* **Fencing.** The holder stops answering once ``deadline`` s (less than ``duration``) have
  passed since it *started* its last successful renewal: ``LeaseElector.hold`` ends its process
  there, and the coordinator calls it before every answer (``Coordinator.fence``). A candidate
  first sees that renewal no earlier than it was written, and waits ``duration`` s more; so the
  old holder is gone before a new one serves, even when it was only cut off from the API
  server, or frozen and resumed (a SIGSTOP, a paused VM: the clock is ``CLOCK_BOOTTIME``, which
  counts suspended time). The renewal also checks that the coordinator's event loop still
  answers: a hung coordinator loses its lease to the standby.
* **Routing.** The Service selects the pod labelled ``ftlm.dev/coordinator-leader: "true"``. A new
  holder takes the label off every other pod that carries it, then labels its own (pods are API
  objects: this works also when the old holder's node is lost, where its readiness would keep it among the
  Service's endpoints for the node controller's grace period, 40-50 s). A standby listens on the
  port and answers 503 ("a standby"; a scrape of /metrics gets ``ftlm_coordinator_standby 1``),
  so that both pods are Ready and a drain may move either.
* On SIGTERM the holder stops serving and releases the lease (empty holder): the standby takes
  over at its next try, within ``retry`` s.

The API is reached as any in-cluster client does (``KUBERNETES_SERVICE_HOST``, the service
account's token and CA under ``/var/run/secrets/kubernetes.io/serviceaccount``; the token file is
read again for every request, as the kubelet rotates it), or at ``FTLM_KUBE_API`` (a URL; tests
and the network test bed use ``ftlm.testing.kube_api``). The pod's name (``POD_NAME``) is its
identity, ``POD_NAMESPACE`` its namespace (the Downward API sets both in generated manifests).

Not responsible for: what the coordinator does once serving (``ftlm.ft.coordinator``), the
manifests (``ftlm.launch.k8s``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from ftlm.errors import ConfigError

log = logging.getLogger(__name__)

LEADER_LABEL = "ftlm.dev/coordinator-leader"
"""The label of the pod that holds the lease; the coordinator Service selects it."""
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API_ENV = "FTLM_KUBE_API"
EXIT_LEASE_LOST = 3
"""The exit status of a coordinator that lost its lease (the kubelet restarts it as a standby)."""
REQUEST_TIMEOUT = 5.0
WARN_EVERY = 30.0
"""Seconds between two warnings of a standby that cannot reach the API (it tries every retry)."""
STANDBY_ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")
METRICS_ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")
STANDBY_METRICS = (b"# HELP ftlm_coordinator_standby 1 while this coordinator process is a standby "
                   b"(it waits for the lease and serves nothing else)\n"
                   b"# TYPE ftlm_coordinator_standby gauge\nftlm_coordinator_standby 1\n")
"""What a standby answers a scrape: its target is up (not a failed scrape, which alerts such as
kube-prometheus' TargetDown count), and says what it is."""


def boottime() -> float:
    """Seconds on a clock that never goes back and counts time the machine was suspended."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


@dataclass(frozen=True)
class LeaseTiming:
    """How long a lease lasts unrenewed (``duration``), how long the holder keeps serving after
    its last successful renewal started (``deadline``, less than ``duration``: the margin covers
    the two clocks' rates) and how often it renews or a candidate tries (``retry``)."""

    duration: float = 10.0
    deadline: float = 6.0
    retry: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.retry < self.deadline < self.duration:
            raise ConfigError(f"lease timing needs 0 < retry < deadline < duration; got retry "
                              f"{self.retry:g}, deadline {self.deadline:g}, duration {self.duration:g} s "
                              "(--lease-retry, --lease-deadline, --lease-duration)")


class KubeApiError(Exception):
    """The Kubernetes API did not answer as needed (unreachable, or an unexpected status)."""


class KubeApi:
    """The few calls the election needs, over HTTPS with the service account's token."""

    def __init__(self, base_url: str, token_file: Path | None = None, ca_file: Path | None = None,
                 timeout: float = REQUEST_TIMEOUT) -> None:
        self.base_url = base_url.rstrip("/")
        self.token_file = token_file
        self.timeout = timeout
        self._ssl = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None

    @classmethod
    def from_environment(cls) -> KubeApi:
        """``FTLM_KUBE_API`` when set (no token, plain HTTP allowed), else the in-cluster API."""
        url = os.environ.get(API_ENV, "")
        if url:
            return cls(url)
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError("--lease needs the Kubernetes API: run in a pod (KUBERNETES_SERVICE_HOST "
                              f"is not set) or name it with {API_ENV}=URL")
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt")

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             content_type: str = "application/json", timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) of one request; ``KubeApiError`` when the API cannot be reached."""
        headers = {"Accept": "application/json"}
        if self.token_file is not None:
            try:
                headers["Authorization"] = "Bearer " + self.token_file.read_text().strip()
            except OSError as e:
                raise KubeApiError(f"cannot read the service account token {self.token_file}: {e}") from e
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout, context=self._ssl) as r:
                return r.status, _json(r.read())
        except urllib.error.HTTPError as e:
            return e.code, _json(e.read())
        except (OSError, ValueError) as e:  # refused, reset, timed out, TLS
            raise KubeApiError(f"{method} {self.base_url}{path}: {e}") from e


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def micro_time() -> str:
    """Now as a Kubernetes ``MicroTime`` (RFC 3339 with microseconds, UTC)."""
    return datetime.now(tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """Takes, renews and releases one Lease for ``identity``; ``hold`` fences the holder.

    Any thread may call ``hold``; ``try_acquire_or_renew`` and ``release`` are called by one thread
    at a time (the caller's, then the renewal thread's)."""

    def __init__(self, api: KubeApi, namespace: str, name: str, identity: str,
                 timing: LeaseTiming = LeaseTiming(), clock: Callable[[], float] = boottime,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.timing, self.clock = timing, clock
        self.on_lost = on_lost or _exit_lost
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.previous_holder = ""  # who held it when we took it (said in the log)
        self.holder = ""  # the holder last seen
        self._observed: tuple[Any, ...] | None = None  # the record last seen, and when (our clock)
        self._observed_at = 0.0
        self._valid_until = float("-inf")
        self._lost = False

    # ---------------------------------------------------------------------------------- holding

    @property
    def leading(self) -> bool:
        return self.clock() < self._valid_until

    def hold(self) -> None:
        """Return while this process may still answer as the holder; end it (``on_lost``) once
        its lease may have passed to another. Cheap: called before every answer."""
        if self.clock() >= self._valid_until and not self._lost:
            self._lost = True
            self.on_lost(f"lease {self.namespace}/{self.name} not renewed within "
                         f"{self.timing.deadline:g} s; a standby may hold it now")

    # -------------------------------------------------------------------------------- the API

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when we hold the lease for ``deadline`` s from its start.

        A holder whose lease lapsed never takes it again (not even a free one): its coordinator
        holds the state of an older holding, and a newer holder may have answered since. It is
        fenced instead; a new process starts afresh."""
        started = self.clock()
        if self._valid_until != float("-inf") and started >= self._valid_until:
            self.hold()
            return False
        timeout = min(REQUEST_TIMEOUT, self.timing.deadline / 2)
        status, lease = self.api.call("GET", f"{self.path}/{self.name}", timeout=timeout)
        if status == 404:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec({}, taking=True)}
            status, lease = self.api.call("POST", self.path, body, timeout=timeout)
            if status in (200, 201):
                return self._took(started, "")
            if status == 409:  # another created it first
                return False
            raise _http_error(f"creating lease {self.namespace}/{self.name}", status, lease)
        if status != 200:
            raise _http_error(f"reading lease {self.namespace}/{self.name}", status, lease)
        spec = lease.get("spec") or {}
        record = ((lease.get("metadata") or {}).get("resourceVersion"),
                  *(spec.get(k) for k in ("holderIdentity", "renewTime", "leaseTransitions")))
        now = self.clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        holder = spec.get("holderIdentity") or ""
        self.holder = holder
        mine = holder == self.identity
        if holder and not mine and now < self._observed_at + self._duration_of(spec):
            return False  # held, and renewed within its duration as far as we have seen
        body = dict(lease)
        body["spec"] = self._spec(spec, taking=not mine)
        status, updated = self.api.call("PUT", f"{self.path}/{self.name}", body, timeout=timeout)
        if status == 200:
            return self._took(started, "" if mine else holder)
        if status == 409:  # someone else wrote first
            return False
        raise _http_error(f"updating lease {self.namespace}/{self.name}", status, updated)

    def release(self) -> None:
        """Give the lease up (a graceful stop): the standby takes it at its next try."""
        if not self.leading:
            return
        try:
            status, lease = self.api.call("GET", f"{self.path}/{self.name}", timeout=2.0)
            spec = lease.get("spec") or {}
            if status != 200 or spec.get("holderIdentity") != self.identity:
                return
            lease["spec"] = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1,
                             "renewTime": micro_time()}
            status, _ = self.api.call("PUT", f"{self.path}/{self.name}", lease, timeout=2.0)
            if status == 200:
                log.info("released lease %s/%s", self.namespace, self.name)
        except KubeApiError as e:
            log.warning("could not release lease %s/%s (the standby takes it when it lapses): %s",
                        self.namespace, self.name, e)
        finally:
            self._valid_until = float("-inf")
            self._lost = True  # hold() no longer ends the process: it stops on its own

    def _spec(self, old: dict[str, Any], taking: bool) -> dict[str, Any]:
        now = micro_time()
        transitions = int(old.get("leaseTransitions") or 0)
        # Rounded up: a taker waits this long, never less than this holder serves unrenewed.
        return {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, math.ceil(self.timing.duration)),
                "acquireTime": now if taking else old.get("acquireTime", now), "renewTime": now,
                "leaseTransitions": transitions + 1 if taking and old.get("holderIdentity") else transitions}

    def _duration_of(self, spec: dict[str, Any]) -> float:
        """How long to see the record unchanged before taking it: the duration its holder states
        (whole seconds, rounded up from the holder's own, which exceeds its deadline), ours when
        it states none."""
        stated = spec.get("leaseDurationSeconds")
        return float(stated) if isinstance(stated, (int, float)) and stated > 0 else self.timing.duration

    def _took(self, started: float, previous: str) -> bool:
        first = self._valid_until == float("-inf")
        self._valid_until = started + self.timing.deadline
        self.holder = self.identity
        if first:
            self.previous_holder = previous
            self._observed = None
        return True


def _reason(body: dict[str, Any]) -> str:
    return str(body.get("message") or body.get("reason") or "")


def _http_error(what: str, status: int, body: dict[str, Any]) -> KubeApiError:
    fix = (" (the pod's service account needs the Role `ftlm launch k8s` generates: leases get, "
           "create and update; pods list and patch)" if status in (401, 403) else "")
    return KubeApiError(f"{what}: HTTP {status} {_reason(body)}{fix}")


def _exit_lost(reason: str) -> None:
    """The default fence: say why, then end the process at once (no cleanup that could answer)."""
    try:
        print(f"ftlm coordinator: {reason}; stopping so that only one coordinator answers",
              file=sys.stderr, flush=True)
    finally:
        os._exit(EXIT_LEASE_LOST)


class PodLabels:
    """The leader label on the coordinator pods: the Service's routing."""

    def __init__(self, api: KubeApi, namespace: str) -> None:
        self.api, self.namespace = api, namespace

    def set(self, pod: str, leader: bool) -> bool:
        """Label (or unlabel) ``pod``; True when done or when the pod is gone."""
        body = {"metadata": {"labels": {LEADER_LABEL: "true" if leader else None}}}
        try:
            status, answer = self.api.call("PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{pod}", body,
                                           content_type="application/merge-patch+json", timeout=2.0)
        except KubeApiError as e:
            log.warning("could not %s pod %s: %s", "label" if leader else "unlabel", pod, e)
            return False
        if status in (200, 404):
            return True
        log.warning("could not %s pod %s: %s", "label" if leader else "unlabel", pod,
                    _http_error("PATCH", status, answer))
        return False

    def labelled(self) -> list[str]:
        """The pods that carry the leader label now (``KubeApiError`` when the API cannot say)."""
        status, answer = self.api.call("GET", f"/api/v1/namespaces/{self.namespace}/pods"
                                              f"?labelSelector={LEADER_LABEL}%3Dtrue", timeout=2.0)
        if status != 200:
            raise _http_error(f"listing the pods labelled {LEADER_LABEL}", status, answer)
        return sorted(str((p.get("metadata") or {}).get("name", "")) for p in answer.get("items") or [])

    def take_over(self, me: str) -> bool:
        """Route the Service to ``me`` alone: the label off every other pod first, then on ours.
        True when done (else try again: the renewal does)."""
        try:
            others = [pod for pod in self.labelled() if pod != me]
        except KubeApiError as e:
            log.warning("%s", e)
            return False
        return all([self.set(pod, leader=False) for pod in others]) and self.set(me, leader=True)


class StandbyListener:
    """The port while this process is a standby: a scrape of /metrics gets ``STANDBY_METRICS``,
    every other request 503, so the pod is Ready (probes accept) but nothing is served from it."""

    def __init__(self, host: str, port: int, holder: Callable[[], str]) -> None:
        self.holder = holder
        try:
            self.sock = socket.create_server((host, port), backlog=16)
        except OSError as e:
            raise ConfigError(f"the standby coordinator cannot listen on {host}:{port}: {e} (another "
                              "process holds the port; choose another: --port, cluster.coordinator_port)") from e
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ftlm-standby-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(1.0)
                    first = conn.recv(1024).split(b"\r\n", 1)[0]
                    if first.startswith(b"GET /metrics"):  # a scrape: this target is up, a standby
                        conn.sendall(METRICS_ANSWER % (len(STANDBY_METRICS), STANDBY_METRICS))
                    else:
                        body = json.dumps({"error": "a standby coordinator; the leader "
                                                    f"({self.holder() or 'none yet'}) answers"}).encode()
                        conn.sendall(STANDBY_ANSWER % (len(body), body))
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()


def serve_with_lease(coordinator: Any, lease: str, timing: LeaseTiming = LeaseTiming(),
                     api: KubeApi | None = None, identity: str = "", namespace: str = "") -> int:
    """``ftlm coordinator --lease``: wait as a standby, then serve while holding ``lease``.

    ``coordinator`` is an ``ftlm.ft.coordinator.Coordinator`` not yet started. Returns the exit
    status after SIGTERM or SIGINT; a lost lease ends the process (``EXIT_LEASE_LOST``)."""
    from ftlm.until_signal import wait_until_signalled
    api = api or KubeApi.from_environment()
    identity = identity or os.environ.get("POD_NAME", "") or socket.gethostname()
    namespace = namespace or os.environ.get("POD_NAMESPACE", "") or _service_account_namespace()
    elector = LeaseElector(api, namespace, lease, identity, timing)
    labels = PodLabels(api, namespace)
    labels.set(identity, leader=False)  # a restarted holder is a standby until it holds again
    host, port = coordinator.config.host, coordinator.config.port
    stop = threading.Event()
    previous = ({sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
                if threading.current_thread() is threading.main_thread() else {})
    listener = StandbyListener(host, port, lambda: elector.holder) if port else None
    print(f"ftlm coordinator: standby for lease {namespace}/{lease} as {identity}", flush=True)
    waited = boottime()
    warn = _Every(WARN_EVERY)
    seen = None
    try:
        while not stop.is_set():
            try:
                if elector.try_acquire_or_renew():
                    break
                if elector.holder != seen:
                    seen = elector.holder
                    print(f"ftlm coordinator: lease {namespace}/{lease} held by {seen or 'nobody'}; "
                          "standing by", flush=True)
            except KubeApiError as e:
                if warn.due():
                    log.warning("lease %s/%s: %s (trying every %g s)", namespace, lease, e, timing.retry)
            stop.wait(timing.retry)
        else:
            return 0
    finally:
        if listener is not None:
            listener.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"ftlm coordinator: took lease {namespace}/{lease} after {boottime() - waited:.1f} s"
          + (f" from {elector.previous_holder}" if elector.previous_holder else ""), flush=True)
    coordinator.fence = elector.hold
    renewer = Renewer(elector, labels, coordinator)

    def start() -> None:
        coordinator.start()
        renewer.start()
        print(f"ftlm coordinator listening on {coordinator.describe()} as the holder of lease "
              f"{namespace}/{lease}", flush=True)

    def halt() -> None:
        renewer.stop()
        coordinator.stop()
        elector.release()
        labels.set(identity, leader=False)

    wait_until_signalled(lambda: coordinator.serving, halt, start)
    return 0


class Renewer:
    """The holder's thread: label the pods, then renew every ``retry`` s while the coordinator's
    event loop answers; ``elector.hold`` fences when renewals stop succeeding."""

    def __init__(self, elector: LeaseElector, labels: PodLabels, coordinator: Any) -> None:
        self.elector, self.labels, self.coordinator = elector, labels, coordinator
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftlm-lease-renewer", daemon=True)
        self.routed = False  # the Service routes to this pod alone

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.elector.timing.retry + REQUEST_TIMEOUT)

    def _run(self) -> None:
        e, timing = self.elector, self.elector.timing
        while not self._stop.is_set():
            if not self.routed:
                self.routed = self.labels.take_over(e.identity)
            if self._stop.wait(timing.retry):
                return
            if not self._loop_answers(timing.deadline / 2):
                log.error("the coordinator's event loop did not answer within %.1f s; not renewing "
                          "lease %s/%s", timing.deadline / 2, e.namespace, e.name)
            else:
                try:
                    e.try_acquire_or_renew()
                except KubeApiError as err:
                    log.warning("renewing lease %s/%s: %s (serving until %.1f s after the last "
                                "renewal began)", e.namespace, e.name, err, timing.deadline)
            e.hold()

    def _loop_answers(self, timeout: float) -> bool:
        try:
            self.coordinator.call_in_loop(lambda: None, timeout=timeout)
            return True
        except Exception:  # noqa: BLE001 - a timeout or a dead loop: either way not healthy
            return False


class _Every:
    """True at the first ``due()`` and then at most once per ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.last = seconds, float("-inf")

    def due(self) -> bool:
        now = boottime()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True


def _service_account_namespace() -> str:
    try:
        return (SERVICE_ACCOUNT / "namespace").read_text().strip()
    except OSError:
        raise ConfigError("--lease needs the pod's namespace: set POD_NAMESPACE (the generated "
                          "manifests do, through the Downward API)") from None
