"""ReadQueue: the reads of device values a hook makes once per window, off the step.

A hook hands a window's values (device tensors, see ``window.py``) to :meth:`ReadQueue.put`
with what to do once they are read; a worker thread reads them (the one wait on the device),
in order, and the hook's callback runs in the event loop with the host values: a log line, a
progress-bar postfix, a history row, a decision.  It is the pattern ``hooks/optim.py`` uses,
as one building block.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio.to_thread

from .errors import OnError
from .jobs import JobQueue, Overflow

if TYPE_CHECKING:
    from .bus import HookBus

__all__ = ["ReadQueue"]


class _Read(NamedTuple):
    read: Callable[[], Any]
    then: Callable[[Any], Awaitable[None] | None]


class ReadQueue:
    """Reads off the step, in order: ``put(read, then)`` runs ``read()`` in a worker thread
    (the one wait on the device) and then ``then(result)`` in the event loop.

    A bus service built on :class:`~recis_async.jobs.JobQueue` (the pattern of
    ``hooks/optim.py``); ``capacity`` reads may wait before ``put`` waits for room (or, with
    ``overflow="replace"``, replaces the newest waiting one: for a display that only needs the
    latest values).  Closing the bus finishes the queued reads by its deadline.
    """

    def __init__(
        self,
        name: str,
        *,
        capacity: int = 8,
        overflow: Overflow = "wait",
        on_error: OnError = "raise",
    ) -> None:
        self.name = name
        self._capacity = capacity
        self._overflow = overflow
        self._on_error: OnError = on_error
        self._jobs: JobQueue[_Read] | None = None

    def start(self, bus: HookBus) -> None:
        """Start a fresh queue on ``bus`` (a hook calls it from ``attach``)."""
        if self._jobs is not None and not self._jobs.finished.is_set():
            raise RuntimeError(f"{self.name}: already started on a bus that is still open")
        self._jobs = JobQueue(
            self.name,
            self._handle,
            capacity=self._capacity,
            overflow=self._overflow,
            on_error=self._on_error,
        )
        bus.start_service(self._jobs)

    @property
    def started(self) -> bool:
        return self._jobs is not None and not self._jobs.closing

    @property
    def busy(self) -> bool:
        """Reads are queued or running (a result written now would overtake them)."""
        jobs = self._jobs
        return jobs is not None and (jobs.current is not None or bool(jobs.waiting))

    async def put(self, read: Callable[[], Any], then: Callable[[Any], Any]) -> None:
        """Queue a read; without a started queue (a hook used off a bus) run it here."""
        if self._jobs is None or self._jobs.finished.is_set():
            await self._handle(_Read(read, then))
            return
        await self._jobs.put(_Read(read, then))

    async def wait_idle(self) -> None:
        """Return once every queued read was handled."""
        if self._jobs is not None:
            await self._jobs.wait_idle()

    @staticmethod
    async def _handle(job: _Read) -> None:
        result = await anyio.to_thread.run_sync(job.read)
        done = job.then(result)
        if inspect.isawaitable(done):
            await done
