"""Anonymous shared memory that another process can map: the snapshot server process's bytes.

A `SharedBuffer` is a Linux memfd (``os.memfd_create``): a file with no name in any file system,
mapped into this process. Its descriptor travels to the snapshot server process over a Unix
socket (``socket.send_fds``), which maps the same pages: the snapshot is written once, by the
training process, and never copied again. The memory is freed by the kernel when the last
descriptor and the last mapping are gone, in whichever process, however the processes end
(SIGKILL included): there is no name to leak, unlike a file in /dev/shm. It is not limited by
the size of /dev/shm either (64 MiB in a default Docker container); it counts against the
memory cgroup like any other memory.

Not responsible for: what the bytes are (``ftlm.ft.transport.snapshot_state`` fills them) or
sending the descriptor (``ftlm.ft.serve_process``).
"""

from __future__ import annotations

import mmap
import os
import weakref

from ftlm.errors import ConfigError

__all__ = ["SharedBuffer", "supported"]

NAME = "ftlm-snapshot"
"""The memfd's name as ``/proc/<pid>/maps`` and ``/proc/<pid>/fd`` show it (``memfd:ftlm-snapshot``)."""


def supported() -> bool:
    """Whether this platform has anonymous shared memory files (Linux 3.17+)."""
    return hasattr(os, "memfd_create")


class SharedBuffer:
    """``nbytes`` of anonymous shared memory, mapped read-write into this process.

    ``memory`` is the mapping (a buffer: wrap it with ``torch.frombuffer``); ``fd`` the
    descriptor to pass to another process. The descriptor is closed when this object is
    garbage-collected (or by ``close_fd``); the mapping lives while anything views it.
    ``prefault``: allocate every page now (``posix_fallocate``) and map them all
    (``MAP_POPULATE``), so that a later write costs no page faults
    (``ftlm.ft.snapshot_reserve``).
    """

    def __init__(self, nbytes: int, *, prefault: bool = False) -> None:
        if not supported():
            raise ConfigError("anonymous shared memory (os.memfd_create) needs Linux; on this "
                              "platform set ft.snapshot_server = 'thread'")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        self.fd = os.memfd_create(NAME, os.MFD_CLOEXEC)
        self._closer = weakref.finalize(self, os.close, self.fd)
        try:
            os.ftruncate(self.fd, nbytes)
            flags = mmap.MAP_SHARED
            if prefault and nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)  # ENOSPC/ENOMEM here, not at the copy
                flags |= getattr(mmap, "MAP_POPULATE", 0)
            # mmap cannot map 0 bytes: an empty snapshot has a descriptor and nothing mapped.
            self.memory: mmap.mmap | bytearray = (mmap.mmap(self.fd, nbytes, flags=flags) if nbytes
                                                  else bytearray())
        except BaseException:
            self._closer()
            raise

    def close_fd(self) -> None:
        """Close the descriptor now (the mapping stays valid)."""
        self._closer()
