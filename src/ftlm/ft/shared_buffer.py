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

import ctypes
import mmap
import os
import weakref

from ftlm.errors import ConfigError

__all__ = ["SharedBuffer", "supported"]

NAME = "ftlm-snapshot"
"""The memfd's name as ``/proc/<pid>/maps`` and ``/proc/<pid>/fd`` show it (``memfd:ftlm-snapshot``)."""


MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault every page of a range in for writing, in one call."""


def _populate(memory: mmap.mmap, nbytes: int) -> None:
    """Map every page of ``memory`` into this process now, or nothing where the kernel cannot.

    Through ctypes, which releases the interpreter lock for the call: ``mmap``'s own
    ``MAP_POPULATE`` keeps holding it while the kernel maps the pages, and a thread of the
    training process doing that (0.3 s per GiB here) stopped its heartbeat and training threads
    for as long, 40 s when the thread ran at nice 19 on busy cores."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    anchor = ctypes.c_char.from_buffer(memory)  # the mapping's address (an export, released below)
    try:
        madvise(ctypes.addressof(anchor), nbytes, MADV_POPULATE_WRITE)  # EINVAL before 5.14: faults later
    finally:
        del anchor


def supported() -> bool:
    """Whether this platform has anonymous shared memory files (Linux 3.17+)."""
    return hasattr(os, "memfd_create")


class SharedBuffer:
    """``nbytes`` of anonymous shared memory, mapped read-write into this process.

    ``memory`` is the mapping (a buffer: wrap it with ``torch.frombuffer``); ``fd`` the
    descriptor to pass to another process. The descriptor is closed when this object is
    garbage-collected (or by ``close_fd``); the mapping lives while anything views it.
    ``prefault``: allocate every page now (``posix_fallocate``) and map them all
    (``MADV_POPULATE_WRITE``), so that a later write costs no page faults
    (``ftlm.ft.snapshot_reserve``). Both release the interpreter lock while the kernel works.
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
            if prefault and nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)  # ENOSPC/ENOMEM here, not at the copy
            # mmap cannot map 0 bytes: an empty snapshot has a descriptor and nothing mapped.
            self.memory: mmap.mmap | bytearray = mmap.mmap(self.fd, nbytes) if nbytes else bytearray()
            if prefault and nbytes:
                _populate(self.memory, nbytes)
        except BaseException:
            self._closer()
            raise

    def close_fd(self) -> None:
        """Close the descriptor now (the mapping stays valid)."""
        self._closer()
