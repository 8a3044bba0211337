"""Fixtures of the network test-bed tests: a bed per test, skipped (saying why) where none can be
built (not root, no ``ip``/``tc``/``nft``: ``make system-deps`` installs them)."""

from __future__ import annotations

import pytest

from ftlm.testing.netbed import NetBed, unavailable_reason


@pytest.fixture(scope="session")
def netbed_reason() -> str | None:
    """Why no bed can be built on this machine (None: one can)."""
    return unavailable_reason()


@pytest.fixture
def make_bed(netbed_reason):
    """``make_bed(nodes)``: a fresh ``NetBed`` of ``nodes``, removed after the test."""
    if netbed_reason:
        pytest.skip(netbed_reason)
    beds: list[NetBed] = []

    def make(nodes: list[str]) -> NetBed:
        bed = NetBed(nodes).__enter__()
        beds.append(bed)
        return bed

    yield make
    for bed in beds:
        bed.close()
