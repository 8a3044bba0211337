"""The floor of `bench.coordinator_load` on this box: a server that does the least a coordinator can.

Run as ``python -m bench.coordinator_floor GROUPS`` (``bench.coordinator_load --floor`` starts it
in place of ``ftlm coordinator``). It speaks just enough HTTP/1.1 for the load generator, on the
same event loop (uvloop) as the coordinator: a heartbeat is answered at once with a fixed body; a
quorum request is held until all GROUPS groups asked (or 2.5 s passed since the round's first ask,
for the failure drill at the end), then every held request is answered, first asker first, with a
body carrying the fields the load generator reads. No JSON parsing, no checks, no state machine,
no membership: what is left is the event loop, the sockets and the Python of reading a request and
writing an answer. Its latencies bound what any coordinator served from one Python event loop can
reach on this box with this load generator beside it. Not a coordinator: never point a job at it.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time

_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
_STEP = re.compile(rb'"step": (\d+)')
_ROUND_SECONDS = 2.5
_CHAIN = b"ab" * 32


def _answer(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))


_BEAT = _answer(b'{"quorum_id": 1, "dead": [], "dead_quorums": [], "epoch": "floor", "rebuilding": false}')
_STATUS = _answer(b'{"members": []}')


class Floor:
    """The held quorum requests of the round in progress, and the ids issued."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.held: list[tuple[asyncio.Transport, int]] = []
        self.first_ask: float | None = None
        self.quorum_id = 0

    def ask(self, transport: asyncio.Transport, step: int) -> None:
        self.held.append((transport, step))
        if self.first_ask is None:
            self.first_ask = time.monotonic()
        if len(self.held) >= self.groups:
            self.issue()

    def issue(self) -> None:
        held, self.held, self.first_ask = self.held, [], None
        if not held:
            return
        self.quorum_id += 1
        step = max(s for _, s in held)
        body = (b'{"quorum_id": %d, "step": %d, "rank": %%d, "size": %d, "next_chain": "%s", "participant": true}'
                % (self.quorum_id, step, len(held), _CHAIN))
        for rank, (transport, _) in enumerate(held):
            if not transport.is_closing():
                transport.write(_answer(body % rank))

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            if self.first_ask is not None and time.monotonic() - self.first_ask > _ROUND_SECONDS:
                self.issue()


class _Connection(asyncio.Protocol):
    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            found = _LENGTH.search(self.buf, 0, end + 2)
            start = end + 4
            stop = start + (int(found.group(1)) if found else 0)
            if len(self.buf) < stop:
                return
            head, body, self.buf = self.buf[:end], self.buf[start:stop], self.buf[stop:]
            assert self.transport is not None
            if head.startswith(b"POST /v1/heartbeat "):
                self.transport.write(_BEAT)
            elif head.startswith(b"POST /v1/quorum ") and (step := _STEP.search(body)) is not None:
                self.floor.ask(self.transport, int(step.group(1)))
            else:
                self.transport.write(_STATUS)


async def serve(groups: int) -> None:
    floor = Floor(groups)
    server = await asyncio.get_running_loop().create_server(lambda: _Connection(floor), "127.0.0.1", 0,
                                                            backlog=512)
    port = server.sockets[0].getsockname()[1]
    print(f"floor server (not a coordinator) listening on http://127.0.0.1:{port}", flush=True)
    await floor.watch()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m bench.coordinator_floor GROUPS", file=sys.stderr)
        return 2
    from ftlm.ft.coordinator import new_event_loop

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve(int(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
