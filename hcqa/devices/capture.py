"""The capture context: which graph, if any, is recording in this context."""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["capturing", "current_capture"]

capturing: contextvars.ContextVar[Any] = contextvars.ContextVar("hcqa_capture", default=None)


def current_capture() -> Any:
    """The graph being captured in this context, or None."""
    return capturing.get()
