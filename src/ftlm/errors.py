"""Exception types shared across ftlm.

Each names a kind of user-facing problem. Messages say what is wrong and how to fix it; the CLI
prints them without a traceback.
"""


class FtlmError(Exception):
    """Base class of errors that the CLI reports as a one-line message (exit status 2: fix the
    input, a restart alone would fail the same way)."""


class FaultError(FtlmError):
    """A fault of the job, not of the input (this group was declared hung or replaced, no quorum
    formed, a transfer failed): the CLI exits with status 1, as a crash, so that a supervisor
    restarts the group; its crash-loop limit stops a restart that keeps failing."""


EXIT_RETIRED = 3
"""Exit status of a group process that the coordinator retired for failing every step it took
part in (``RetiredError``): launchers tell it from a crash by the status alone (0 done, 1 a
crash or another fault, 2 bad input)."""


class RetiredError(FaultError):
    """The coordinator retired this group's process for failing every step it took part in (a
    bad link or device on its node, ``ftlm.ft.quorum.Probe``): restarted as after any fault, but
    the CLI exits with status 3 (``EXIT_RETIRED``) so that a launcher counts it retired (it gives
    up on the group, or avoids its nodes) without reading its log."""


class ConfigError(FtlmError, ValueError):
    """A config value is unknown, of the wrong type or out of range."""


class DataError(FtlmError):
    """Input data or prepared data is missing, empty, corrupt or does not match the run."""


class CheckpointError(FtlmError):
    """A durable checkpoint is missing, incomplete or does not match the run."""
