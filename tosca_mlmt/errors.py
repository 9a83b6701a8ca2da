"""User-facing errors. The CLI turns each into a clear message and exit code 2."""

from __future__ import annotations


class MlmtError(Exception):
    """Base class for errors caused by user input (config, data, arguments), not by bugs."""


class ConfigError(MlmtError):
    """A config field is unknown or has an invalid value. The message names the field."""


class DataError(MlmtError):
    """A data row is malformed. The message names ``file:line`` and the field."""

    def __init__(self, path: str, line: int, field: str, reason: str):
        self.path, self.line, self.field, self.reason = path, line, field, reason
        super().__init__(f"{path}:{line}: field '{field}': {reason}")


class SnapshotError(MlmtError):
    """A snapshot is missing, corrupt or of an unsupported format version."""


class ModelError(MlmtError):
    """A model cannot be located or loaded (e.g. the embedded package is not installed)."""
