"""A TCP relay to the coordinator whose address lives in a file (``python -m ftlm.launch.relay``).

On Slurm the coordinator is a job like any other: when it is restarted (its node failed, its
time limit came) it may run on another node, and it writes its new ``http://HOST:PORT`` to
``state/coordinator.url``. The trainers keep the coordinator URL they started with, so each group
job runs this relay and gives the trainers the relay's address instead: the relay reads the file
again for every new connection and pipes bytes both ways. When the old coordinator goes away its
connections close, the trainers reconnect, and the relay takes them to the new one.

It does not speak HTTP, retry, or buffer: a missing or unreadable address file closes the
connection at once (the trainers' client retries), and TLS passes through untouched (a client
that checks the coordinator's host name must then use the coordinator's URL directly).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import urllib.parse
from pathlib import Path

from ftlm.errors import ConfigError

CHUNK = 1 << 16


def read_address(url_file: Path) -> tuple[str, int] | None:
    """``(host, port)`` of the URL in ``url_file``, or None while it is missing or malformed."""
    try:
        text = url_file.read_text().strip()
    except OSError:
        return None
    parsed = urllib.parse.urlsplit(text)
    try:
        port = parsed.port
    except ValueError:
        return None
    if not parsed.hostname:
        return None
    return parsed.hostname, port or (443 if parsed.scheme == "https" else 80)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


class Relay:
    """Listens on ``host:port`` (0: any free port) and relays each connection to the address
    that ``url_file`` holds at the moment the connection arrives."""

    def __init__(self, url_file: Path, host: str = "0.0.0.0", port: int = 0,
                 connect_timeout: float = 5.0) -> None:
        self.url_file = Path(url_file)
        self.host, self.port = host, port
        self.connect_timeout = connect_timeout
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        """Start listening; returns the port."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = read_address(self.url_file)
        if address is None:  # no coordinator right now: the client retries
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*address), self.connect_timeout)
        except (OSError, asyncio.TimeoutError):
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _serve(args: argparse.Namespace) -> None:
    relay = Relay(Path(args.url_file), args.host, args.port)
    port = await relay.start()
    if args.port_file:
        tmp = Path(f"{args.port_file}.tmp.{os.getpid()}")
        tmp.write_text(f"{port}\n")
        os.replace(tmp, args.port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await relay.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftlm.launch.relay", description=__doc__.split("\n")[0])
    parser.add_argument("--url-file", required=True, help="file holding the coordinator's http://HOST:PORT")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free one)")
    parser.add_argument("--port-file", default="", help="write the chosen port here once listening")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port={args.port} must be in [0, 65535]")
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"ftlm relay: {e}", file=sys.stderr)
        sys.exit(2)
