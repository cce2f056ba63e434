"""The exceptions recis_async raises, under one base class.

``except RecisAsyncError`` catches every one of them; each also keeps the built-in base it
had before the family existed (``RuntimeError``, ``FloatingPointError``), so existing
``except`` clauses keep working.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

__all__ = [
    "HookError",
    "NanLossError",
    "OnError",
    "RecisAsyncError",
    "SinkError",
    "TraceDeliveryError",
    "TrackerError",
]


#: What a subscriber's (or a background job's) failure does: ``"raise"`` it as
#: :class:`HookError` at the publish (or the next one, for background work), ``"log"`` it and
#: go on, or ``"disable"``: log it once and stop calling the failing part.
OnError = Literal["raise", "log", "disable"]


class RecisAsyncError(Exception):
    """Base class of every exception recis_async defines."""


class HookError(RecisAsyncError):
    """A subscriber or background service failed.

    ``subscriber`` names the hook method, function or service; ``event`` names the event being
    handled (``None`` for a service failing outside any event).  The original exception is the
    ``__cause__``.
    """

    def __init__(self, message: str, *, subscriber: str, event: str | None = None) -> None:
        super().__init__(message)
        self.subscriber = subscriber
        self.event = event


class SinkError(RecisAsyncError):
    """A sink could not deliver a batch.

    ``transient``: retrying the same batch may succeed (network errors, 5xx, throttling);
    otherwise the batch is spilled at once.
    """

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class TraceDeliveryError(RecisAsyncError, RuntimeError):
    """Batches could not be delivered and were spilled; raised by ``TraceWriter.aclose``.

    ``spill_files`` are replayable with ``python -m recis_async.spill replay``.
    """

    def __init__(
        self,
        message: str,
        *,
        spilled_batches: int,
        spilled_rows: int,
        spill_files: tuple[Path, ...],
    ) -> None:
        super().__init__(message)
        self.spilled_batches = spilled_batches
        self.spilled_rows = spilled_rows
        self.spill_files = spill_files


class TrackerError(RecisAsyncError, RuntimeError):
    """A tracker call failed in the background (the original error is ``__cause__``)."""


class NanLossError(RecisAsyncError, FloatingPointError):
    """The training loss was NaN or infinite (raised by ``NanTensorHook``)."""
