"""Block a server's command until the user stops it (SIGINT, SIGTERM) or the server stops alone.

Shared by ``ftlm coordinator`` and ``ftlm serve``: with the handlers in place, each starts its
server thread and prints what it serves, then waits here. Standard library only. Not here: how
a server starts or stops (the callbacks it passes).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.5
"""How often the wait looks whether the server thread is still alive."""


def wait_until_signalled(alive: Callable[[], bool], stop: Callable[[], None],
                         start: Callable[[], None]) -> None:
    """Call ``start`` (start the server, print where it serves), then wait until SIGINT or
    SIGTERM arrives (handled only from the main thread, and restored after) or ``alive()`` turns
    false, then call ``stop``. The handlers are in place before ``start``: a SIGTERM sent as soon
    as the printed address answers stops the server cleanly instead of killing it."""
    stopping = threading.Event()
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stopping.set())
    try:
        start()
        while not stopping.wait(POLL_SECONDS) and alive():
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop()
