"""Error types that separate a user's mistake from a bug.

A :class:`UserError` is caught by the CLI, printed as one message, and turned into exit
code 2 (no traceback unless ``--debug``). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: names what is wrong, what is allowed, and (optionally) a hint."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class CheckpointError(UserError):
    """The input checkpoint cannot be found, read or is not supported."""


class RecipeError(UserError):
    """A recipe file or flag combination is invalid."""


class CalibrationError(UserError):
    """Calibration data cannot be read or does not hold enough tokens."""


class QuantizationError(UserError):
    """A layer cannot be quantized with the requested scheme."""


class ArtifactError(UserError):
    """An artifact cannot be written, read or verified."""
