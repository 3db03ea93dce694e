"""The forecast's own error."""

from __future__ import annotations

from ..errors import ExpectedFailure


class ForecastError(ExpectedFailure):
    """The forecast can't be made (no pilot response answered, an unreadable model list); names what to fix."""
