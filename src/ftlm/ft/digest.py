"""The per-chunk digest of live state transfer: its wire name and how it is computed.

Apart from ``ftlm.ft.framing`` (which re-exports both names) because the snapshot server process
(``ftlm.ft.serve_child``) hashes the chunks it serves and must start without importing torch.

Not responsible for: checking a digest that arrived (``ftlm.ft.transport``) or ``state_digest``,
the proof of equal replicas (``ftlm.ft.framing``).
"""

from __future__ import annotations

import xxhash

DIGEST = "xxh3_128"
"""Name of the per-chunk digest on the wire (header field `digest`)."""


def chunk_digest(data: bytes | bytearray | memoryview) -> str:
    """The wire digest (`DIGEST`) of one chunk's bytes, as 32 lowercase hex digits.

    xxhash releases the GIL, so chunks hash on several threads at once and beside training.
    """
    return xxhash.xxh3_128_hexdigest(data)
