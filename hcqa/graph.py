"""Graph capture and replay (being built; see issue 4)."""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["current_capture"]

_current: contextvars.ContextVar[Any] = contextvars.ContextVar("hcqa_capture", default=None)


def current_capture() -> Any:
    """The graph being captured in this context, or None."""
    return _current.get()
