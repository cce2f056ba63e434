"""Exceptions raised by the bus."""

from __future__ import annotations

__all__ = ["HookError"]


class HookError(Exception):
    """A subscriber or background service failed.

    ``subscriber`` names the hook method, function or service; ``event`` names the event being
    handled (``None`` for a service failing outside any event).  The original exception is the
    ``__cause__``.
    """

    def __init__(self, message: str, *, subscriber: str, event: str | None = None) -> None:
        super().__init__(message)
        self.subscriber = subscriber
        self.event = event
