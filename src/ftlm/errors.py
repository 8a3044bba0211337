"""Exception types shared across ftlm.

Each names a kind of user-facing problem. Messages say what is wrong and how to fix it; the CLI
prints them without a traceback.
"""


class FtlmError(Exception):
    """Base class of errors that the CLI reports as a one-line message (exit status 2)."""


class ConfigError(FtlmError, ValueError):
    """A config value is unknown, of the wrong type or out of range."""


class DataError(FtlmError):
    """Input data or prepared data is missing, empty, corrupt or does not match the run."""


class CheckpointError(FtlmError):
    """A durable checkpoint is missing, incomplete or does not match the run."""
