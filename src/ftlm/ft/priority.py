"""CPU priority of the threads that move a snapshot, so that serving never slows training.

A source serves its snapshot while it trains, and a recovering group pulls one while the others
wait for nobody: the bytes are moved by threads of their own (the server's connection threads, the
puller's workers), and on a host short of cores they compete with the training
thread, whose step every healthy group waits for. ``background_priority`` lowers the calling
thread's priority (its nice value, per thread on Linux) so that the scheduler gives the training
thread the CPU first and the transfer the rest. It never raises a priority (that needs
privileges), and it is a no-op where threads have no priority of their own.

Not here: how many bytes a transfer may send per second (``SnapshotServer``'s throttle), and the
source's snapshot copy, which keeps the training thread's priority: the update waits for it.
"""

from __future__ import annotations

import os
import threading

MAX_NICE = 19
"""The lowest CPU priority (POSIX nice values run from -20, the highest, to 19)."""


def background_priority(nice: int) -> None:
    """Give the calling thread nice value ``nice`` (0-19) unless it already runs at that or lower."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()  # Linux: PRIO_PROCESS with a thread id sets that thread only
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, min(nice, MAX_NICE))
    except OSError:  # no such thread id on this system: leave the priority as it is
        pass
