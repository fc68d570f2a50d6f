"""The exceptions jaxloop raises where a user can catch them, in one module that imports no jax, tyro or
torch. `python -m jaxloop.train` ends with the exit status beside each (EXIT_*).

    ConfigError           a config value that is not allowed (field, value, what is allowed)   exit 2
      RecordError         a malformed record or an empty split (split, record index, key)        exit 2
      RunDirInUse         another run holds the run_dir (who holds it)                           exit 2
    UsageError            a command line that cannot be parsed                                   exit 2
    NonFiniteError        too many consecutive updates skipped for a non-finite loss or gradient exit 1
    CheckpointWriteError  a checkpoint could not be written (a full disk): the last good one named exit 3
    OutOfMemoryError      the update fits the device's memory in no plan left to try              exit 4
    Interrupted           SIGINT / SIGTERM: the loop saved and stopped                           exit 130 / 143
"""

from jaxloop.config.errors import (
    EXIT_BAD_INPUT,
    EXIT_CHECKPOINT_WRITE,
    EXIT_NONFINITE,
    EXIT_OUT_OF_MEMORY,
    EXIT_SIGNAL,
    CheckpointWriteError,
    ConfigError,
    Interrupted,
    NonFiniteError,
    OutOfMemoryError,
    UsageError,
)
from jaxloop.data.sources import RecordError
from jaxloop.rundir.lock import RunDirInUse

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_CHECKPOINT_WRITE",
    "EXIT_NONFINITE",
    "EXIT_OUT_OF_MEMORY",
    "EXIT_SIGNAL",
    "CheckpointWriteError",
    "ConfigError",
    "Interrupted",
    "NonFiniteError",
    "OutOfMemoryError",
    "RecordError",
    "RunDirInUse",
    "UsageError",
]
