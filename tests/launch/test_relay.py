"""The coordinator relay of Slurm groups: each new connection goes where the address file says now."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ftlm.launch.relay import Relay, main, read_address
from ftlm.errors import ConfigError


async def _server(tag: bytes) -> asyncio.AbstractServer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.readline()
        writer.write(tag + data)
        await writer.drain()
        writer.close()
    return await asyncio.start_server(answer, "127.0.0.1", 0)


async def _ask(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"ping\n")
    await writer.drain()
    try:
        data = await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:  # closed by the relay before it read our bytes
        data = b""
    writer.close()
    return data


def test_relay_follows_the_address_file(tmp_path: Path):
    url_file = tmp_path / "coordinator.url"

    async def scenario() -> None:
        a, b = await _server(b"A:"), await _server(b"B:")
        relay = Relay(url_file, host="127.0.0.1")
        port = await relay.start()
        try:
            assert await _ask(port) == b""  # no address yet: closed at once, the client retries
            url_file.write_text(f"http://127.0.0.1:{a.sockets[0].getsockname()[1]}\n")
            assert await _ask(port) == b"A:ping\n"
            # The coordinator moved (a new job on another node): the next connection follows.
            url_file.write_text(f"http://127.0.0.1:{b.sockets[0].getsockname()[1]}\n")
            assert await _ask(port) == b"B:ping\n"
            b.close()
            await b.wait_closed()
            assert await _ask(port) == b""  # nobody there: closed, not hung
        finally:
            await relay.close()
            a.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize("text,expected", [
    ("http://node7:29510\n", ("node7", 29510)), ("https://c.example:443", ("c.example", 443)),
    ("http://node7", ("node7", 80)), ("garbage", None), ("http://h:99999", None)])
def test_read_address(tmp_path: Path, text: str, expected):
    f = tmp_path / "url"
    f.write_text(text)
    assert read_address(f) == expected
    assert read_address(tmp_path / "absent") is None


def test_bad_port_is_refused():
    with pytest.raises(ConfigError, match="--port=70000"):
        main(["--url-file", "x", "--port", "70000"])
