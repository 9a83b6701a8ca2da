"""User-facing errors. The CLI turns each into a clear message and exit code 2."""

from __future__ import annotations


class MlmtError(Exception):
    """Base class for errors caused by user input (config, data, arguments), not by bugs."""


class ConfigError(MlmtError):
    """A config field is unknown or has an invalid value. The message names the field."""


class DataError(MlmtError):
    """A data row or file is unusable. The message names ``file:line`` and the field when
    there is one (``file:line: reason`` for a line that is not even text, ``file: reason``
    for the whole file, e.g. one that holds no problems)."""

    def __init__(self, path: str, line: int | None, field: str | None, reason: str):
        self.path, self.line, self.field, self.reason = path, line, field, reason
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: field '{field}': {reason}" if field else f"{where}: {reason}")


class SnapshotError(MlmtError):
    """A snapshot is missing, corrupt or of an unsupported format version."""


class ModelError(MlmtError):
    """A model cannot be located or loaded (e.g. the embedded package is not installed)."""


class TrainingDiverged(MlmtError):
    """The loss or the gradient norm of an optimizer step is NaN or infinite. The step is not
    applied and no checkpoint is written after it, so the last good checkpoint stays the
    latest one (resume from it with a lower learning rate or tighter clipping)."""
