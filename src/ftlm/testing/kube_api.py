"""A Kubernetes API server small enough to read, for testing the coordinator's lease election.

``FakeKubeApi`` serves what ``ftlm.launch.lease`` calls, with the API server's semantics where
they matter for safety: ``coordination.k8s.io/v1`` Leases (GET, POST: 409 when one exists; PUT:
409 unless the ``resourceVersion`` sent is the stored one) and Pods (GET, PATCH with a JSON merge
patch of labels: ``null`` removes one; a list by an equality ``labelSelector``). Pods are registered by the test with the address their
coordinator listens on; ``endpoints(selector)`` is what a Service with that selector routes to.
``ServiceProxy`` routes each new TCP connection to the first of those endpoints, as kube-proxy
does (open connections stay where they are).

``failing`` answers every request 503 (an API outage); ``calls`` keeps (method, path, status).
``in_process()`` gives an object with the same ``call`` as ``ftlm.launch.lease.KubeApi`` that
skips HTTP (the seeded election simulation drives thousands of schedules through it).

Not responsible for: anything of Kubernetes beyond these calls (no watch, no auth, no
admission). Standard library only: tests and ``bench`` use it; nothing at run time does.
"""

from __future__ import annotations

import copy
import json
import re
import socket
import threading
from urllib.parse import unquote
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

_LEASES = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?$")
_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/?]+)$")
_POD_LIST = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:\?labelSelector=([^&]*))?$")


class KubeState:
    """Leases and pods, and the answers to the calls on them (any thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 0
        self.failing = False
        self.calls: list[tuple[str, str, int]] = []
        self.on_write: Callable[[str, dict[str, Any]], None] | None = None  # (path, object) after a write

    def add_pod(self, name: str, host: str, port: int, namespace: str = "default",
                labels: dict[str, str] | None = None) -> None:
        with self.lock:
            self.pods[(namespace, name)] = {"metadata": {"name": name, "namespace": namespace,
                                                         "labels": dict(labels or {})},
                                            "status": {"podIP": host}, "port": port}

    def lease(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        with self.lock:
            found = self.leases.get((namespace, name))
            return copy.deepcopy(found) if found else None

    def endpoints(self, selector: dict[str, str], namespace: str = "default") -> list[tuple[str, int]]:
        """(host, port) of the pods whose labels match ``selector``, in registration order."""
        with self.lock:
            return [(p["status"]["podIP"], p["port"]) for (ns, _), p in self.pods.items()
                    if ns == namespace and all(p["metadata"]["labels"].get(k) == v for k, v in selector.items())]

    def handle(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        with self.lock:
            status, answer = self._handle(method, path, body)
            self.calls.append((method, path, status))
        return status, answer

    def _handle(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        if self.failing:
            return 503, _status(503, "ServiceUnavailable", "the API server is down (test)")
        m = _LEASES.match(path)
        if m:
            return self._lease(method, m.group(1), m.group(2), body)
        m = _PODS.match(path)
        if m:
            return self._pod(method, m.group(1), m.group(2), body)
        m = _POD_LIST.match(path)
        if m and method == "GET":
            return 200, {"kind": "PodList", "items": self._list(m.group(1), unquote(m.group(2) or ""))}
        return 404, _status(404, "NotFound", f"no route {path}")

    def _lease(self, method: str, ns: str, name: str | None, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        if method == "POST" and name is None:
            if not isinstance(body, dict):
                return 400, _status(400, "BadRequest", "a Lease object is needed")
            name = str((body.get("metadata") or {}).get("name", ""))
            if (ns, name) in self.leases:
                return 409, _status(409, "AlreadyExists", f"leases {name!r} already exists")
            return 201, self._store(ns, name, body)
        key = (ns, name or "")
        if method == "GET":
            if key not in self.leases:
                return 404, _status(404, "NotFound", f"leases {name!r} not found")
            return 200, copy.deepcopy(self.leases[key])
        if method == "PUT":
            if key not in self.leases:
                return 404, _status(404, "NotFound", f"leases {name!r} not found")
            sent = str(((body or {}).get("metadata") or {}).get("resourceVersion", ""))
            if sent != self.leases[key]["metadata"]["resourceVersion"]:
                return 409, _status(409, "Conflict", "the object has been modified; please apply "
                                                     "your changes to the latest version and try again")
            return 200, self._store(ns, name or "", body or {})
        return 405, _status(405, "MethodNotAllowed", method)

    def _store(self, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = copy.deepcopy(body)
        stored.setdefault("metadata", {}).update(name=name, namespace=ns, resourceVersion=str(self.version))
        self.leases[(ns, name)] = stored
        if self.on_write is not None:
            self.on_write(f"{ns}/{name}", copy.deepcopy(stored))
        return copy.deepcopy(stored)

    def _pod(self, method: str, ns: str, name: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        pod = self.pods.get((ns, name))
        if pod is None:
            return 404, _status(404, "NotFound", f"pods {name!r} not found")
        if method == "PATCH":
            labels = ((body or {}).get("metadata") or {}).get("labels") or {}
            for k, v in labels.items():
                if v is None:
                    pod["metadata"]["labels"].pop(k, None)
                else:
                    pod["metadata"]["labels"][k] = str(v)
        elif method != "GET":
            return 405, _status(405, "MethodNotAllowed", method)
        return 200, {k: copy.deepcopy(v) for k, v in pod.items() if k != "port"}

    def _list(self, ns: str, selector: str) -> list[dict[str, Any]]:
        """Pods matching an equality selector (``k=v,k2=v2``; what the lease's routing asks)."""
        wanted = dict(part.split("=", 1) for part in selector.split(",") if "=" in part)
        return [{k: copy.deepcopy(v) for k, v in p.items() if k != "port"}
                for (pns, _), p in self.pods.items()
                if pns == ns and all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())]

    def in_process(self) -> InProcessApi:
        return InProcessApi(self)


class InProcessApi:
    """``KubeApi.call`` straight into a ``KubeState`` (no HTTP); ``after`` runs after each call
    (a test advances its clock there: an answer that comes back late)."""

    def __init__(self, state: KubeState) -> None:
        self.state = state
        self.after: Callable[[], None] = lambda: None

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             content_type: str = "application/json", timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        answer = self.state.handle(method, path, copy.deepcopy(body))
        self.after()
        return answer


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}


class FakeKubeApi:
    """``KubeState`` served over HTTP on ``host`` (a free port); a context manager."""

    def __init__(self, host: str = "127.0.0.1", state: KubeState | None = None) -> None:
        self.state = state or KubeState()
        shared = self.state

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = None
                if length:
                    try:
                        body = json.loads(self.rfile.read(length))
                    except ValueError:
                        self._send(400, _status(400, "BadRequest", "body is not JSON"))
                        return
                self._send(*shared.handle(self.command, self.path, body))

            def _send(self, status: int, answer: dict[str, Any]) -> None:
                raw = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = do_PUT = do_PATCH = _serve

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-kube-api", daemon=True)

    def __enter__(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5.0)


class ServiceProxy:
    """A Service's virtual address: each new connection goes to the first pod that matches
    ``selector`` now (refused when none does); bytes are copied both ways until either side
    closes. A context manager; ``url`` is where clients connect."""

    def __init__(self, state: KubeState, selector: dict[str, str], host: str = "127.0.0.1",
                 namespace: str = "default", connect_timeout: float = 5.0) -> None:
        self.state, self.selector, self.namespace = state, selector, namespace
        self.connect_timeout = connect_timeout
        self.sock = socket.create_server((host, 0))
        self.sock.settimeout(0.2)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="service-proxy", daemon=True)

    def __enter__(self) -> ServiceProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.sock.close()
        with self._lock:
            for s in self._open:
                _close(s)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            # Routed in a thread of its own: a connect to a pod that no longer answers (its node
            # lost) waits, and must not hold up the connections behind it.
            threading.Thread(target=self._route, args=(client,), daemon=True).start()

    def _route(self, client: socket.socket) -> None:
        targets = self.state.endpoints(self.selector, self.namespace)
        if not targets:
            _close(client)
            return
        try:
            upstream = socket.create_connection(targets[0], timeout=self.connect_timeout)
        except OSError:
            _close(client)
            return
        upstream.settimeout(None)
        client.settimeout(None)
        with self._lock:
            self._open += [client, upstream]
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _close(s: socket.socket) -> None:
    try:
        s.close()
    except OSError:
        pass
