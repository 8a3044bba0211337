"""The supervised coordinator comes back from a crash through its warm standby."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ftlm.config import build_config, save_config
from ftlm.launch.coordinator_process import CoordinatorProcess
from ftlm.launch.group_process import free_port


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.toml"
    save_config(build_config({"run": {"dir": str(tmp_path / "run")}}), path)
    return path


def test_a_killed_coordinator_is_replaced_by_the_standby_on_the_same_port(config_file, tmp_path):
    coordinator = CoordinatorProcess(config_file, free_port(), "tok", tmp_path / "events.jsonl",
                                     tmp_path / "coordinator.log")
    try:
        coordinator.start(ready_timeout=120)
        first = coordinator.pid
        standby = coordinator._standby
        assert standby is not None and standby.poll() is None and coordinator.warm_starts == 0
        coordinator.kill()
        coordinator.start(ready_timeout=120)  # served by the standby, which is the process now
        assert coordinator.warm_starts == 1 and coordinator.pid == standby.pid != first
        assert coordinator.status()["members"] == []  # a fresh coordinator: no state
        assert coordinator._standby is not None and coordinator._standby.pid != standby.pid
    finally:
        spare = coordinator._standby
        coordinator.stop()
    assert coordinator.exit_code() is not None and spare.poll() is not None  # nothing left behind


def test_a_standby_the_supervisor_never_needed_exits_on_eof(config_file, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ftlm.launch.coordinator_standby", str(config_file),
                             "--port", str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    out, _ = proc.communicate(b"", timeout=120)  # EOF at once: it loads, reads EOF, exits
    assert proc.returncode == 0, out.decode()[-2000:]


def test_a_coordinator_whose_port_was_taken_comes_back_on_another_and_says_where(config_file, tmp_path):
    """Its port taken while it was down (another process bound it): the standby serves on a
    free port, and the address file the groups read names the new URL."""
    import socket

    from ftlm.ft.coordinator_address import CoordinatorAddress

    address = tmp_path / "coordinator.url"
    coordinator = CoordinatorProcess(config_file, free_port(), "tok", tmp_path / "events.jsonl",
                                     tmp_path / "coordinator.log", address_file=address)
    squatter = socket.socket()
    try:
        coordinator.start(ready_timeout=120)
        old = coordinator.url
        assert CoordinatorAddress(old, address).current() == old
        coordinator.kill()
        squatter.bind(("127.0.0.1", coordinator.port))
        squatter.listen()
        coordinator.start(ready_timeout=120)  # the standby, told "serve PORT"
        assert coordinator.warm_starts == 1 and coordinator.url != old
        assert CoordinatorAddress(old, address).current() == coordinator.url
        assert coordinator.status()["members"] == []
    finally:
        squatter.close()
        coordinator.stop()
