"""A group's side of the silent-data-corruption check: the digest of its replicated state.

Groups that committed the same state hold bitwise-equal parameters and optimizer state; a flipped
bit in memory or a faulty device breaks that silently. Every ``ft.integrity_every`` committed
steps each participant digests its state (``state_fingerprint``: xxh3-128 over every tensor's
name, dtype, shape and bytes) on a background thread while the step's forward and backward run
(they read the state but never write it; ``StateDigester``), and the manager sends the digest
with its next quorum request. With several ranks each rank digests its shard and the group's
digest combines them in rank order (``combine``). ``flip_bit`` is the fault that breaks it on
purpose (``FTLM_FAULT=bitflip@STEP``, ``ftlm.ft.faults``).

Not responsible for: comparing digests or retiring a group (the coordinator's
``ftlm.ft.quorum.integrity``), nor for the end-of-run proof of equal replicas (``state_digest``
of ``ftlm.ft.framing``, sha256 over the same bytes and the state's JSON).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping

import torch
import xxhash

from ftlm.ft.framing import tensor_bytes

log = logging.getLogger(__name__)

_MANTISSA_TOP = {torch.float64: 51, torch.float32: 22, torch.float16: 9, torch.bfloat16: 6}
"""The highest mantissa bit of each float dtype: flipping it changes a value by up to half,
keeps its sign and exponent (no inf or NaN that the non-finite check would catch instead)."""
_SAME_SIZE_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def state_fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """xxh3-128 over (name, dtype, shape, bytes) of every tensor sorted by name, as 32 hex digits.

    Tensors off the CPU are copied to it first. xxhash releases the GIL over large buffers, so
    this runs beside training on another thread."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name]
        # The descriptor fixes the length of the bytes that follow: the stream is unambiguous.
        h.update(json.dumps([name, str(t.dtype).removeprefix("torch."), list(t.shape)]).encode() + b"\n")
        if t.numel():
            h.update(tensor_bytes(t))
    return h.hexdigest()


def combine(shards: list[str]) -> str:
    """The group's digest from its ranks' digests, in rank order (one rank: its own)."""
    if len(shards) == 1:
        return shards[0]
    return xxhash.xxh3_128_hexdigest("\n".join(shards).encode())


class StateDigester:
    """Digests the state on a background thread every ``every`` steps (0: never).

    ``start`` begins the digest of the state ``(step, chain)`` from references to the live
    tensors; ``wait`` returns it, and must be called before anything writes them (the update).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self._thread: threading.Thread | None = None
        self._result: tuple[int, str, str] | None = None
        self._started: tuple[int, str] | None = None

    def due(self, step: int) -> bool:
        """Whether the state of ``step`` is digested (every ``every`` steps, never step 0)."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def start(self, tensors: Mapping[str, torch.Tensor], step: int, chain: str) -> bool:
        """Begin digesting ``tensors``, the state ``(step, chain)``, unless it was begun already
        (a group at the job's end asks again at the same state); returns whether it began."""
        if self._started == (step, chain) or self._thread is not None:
            return False
        self._started = (step, chain)
        self._result = None

        def run() -> None:
            try:
                self._result = (step, chain, state_fingerprint(tensors))
            except Exception as e:  # noqa: BLE001 - no digest this time: a check missed, not a failure
                log.warning("could not digest the state of step %d: %s", step, e)

        # At the training thread's own priority: the update waits for this thread.
        self._thread = threading.Thread(target=run, name="ftlm-integrity", daemon=True)
        self._thread.start()
        return True

    def wait(self) -> tuple[int, str, str] | None:
        """The digest begun last, ``(step, chain, digest)``, once it is done (None: none was
        begun since the last ``wait``, or it failed). Blocks until the thread no longer reads
        the state."""
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join()
        result, self._result = self._result, None
        return result


def flip_bit(tensors: Mapping[str, torch.Tensor], which: str) -> str:
    """Flip the highest mantissa bit of the first element of one tensor: the first parameter
    (``which="param"``) or the first optimizer second moment (``"moment"``) in name order, in
    place. Returns the tensor's name. For ``FTLM_FAULT=bitflip``: silent data corruption."""
    def wanted(name: str, t: torch.Tensor) -> bool:
        if t.dtype not in _MANTISSA_TOP or not t.numel():
            return False
        return name.startswith("model.") if which == "param" else name.endswith("exp_avg_sq")
    name = next((n for n in sorted(tensors) if wanted(n, tensors[n])), None)
    if name is None:
        raise ValueError(f"FTLM_FAULT=bitflip: no {'parameter' if which == 'param' else 'optimizer moment'} "
                         f"to corrupt among {len(tensors)} tensors")
    t = tensors[name]
    with torch.no_grad():
        word = t.detach().view(-1)[:1].view(_SAME_SIZE_INT[t.element_size()])
        word.bitwise_xor_(torch.ones_like(word) << _MANTISSA_TOP[t.dtype])
    return name
