"""User-facing errors.

Every error a user can cause (bad config, bad data, a directory that is not a model) is a
`PrmflowError`. The CLI prints its message as one paragraph and exits with status 2; anything
else is a bug and keeps its traceback.
"""


class PrmflowError(Exception):
    """An error the user can fix; the message says what was wrong, where, and what to do."""

    exit_code = 2


class ConfigError(PrmflowError):
    """A config file, key or value is wrong."""


class DataError(PrmflowError):
    """A dataset or hand-off file is missing, malformed or inconsistent."""


class ModelLoadError(PrmflowError):
    """A model directory cannot be loaded."""


class OutputExistsError(PrmflowError):
    """An output directory already holds a result that does not match this run."""
