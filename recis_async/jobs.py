"""JobQueue: a bounded queue of jobs a background service handles one at a time.

The building block of every hook whose slow part is occasional work handed off the step -- a
profiler export, a metric report, the history CSV, a hash-table eviction: the hook queues a
job and returns; a bus service runs ``handle(job)`` for each in order.  What happens when the
queue is full is the hook's explicit choice (``overflow``), and so is what a failure does
(``on_error``, as for a subscriber).  Closing stops intake, finishes what is queued by the
bus's deadline, and says what was left.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, Literal, TypeVar, get_args

import anyio

from ._checks import on_error as check_on_error
from ._checks import one_of, positive_int
from .console import log_failure
from .errors import OnError

__all__ = ["JobQueue", "Overflow"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: What ``put`` does when ``capacity`` jobs already wait: ``"wait"`` until one is taken,
#: ``"skip"`` the new job (counted as ``skipped``), or ``"replace"`` the newest waiting job
#: with the new one (counted as ``replaced``; for jobs that supersede their predecessor).
Overflow = Literal["wait", "skip", "replace"]
_COUNTS = ("jobs", "done", "errors", "dropped", "skipped", "replaced")


class JobQueue(Generic[T]):
    """A :class:`~recis_async.Service` running ``handle(job)`` for each queued job, in order.

    Args:
        name: the service's name in logs, errors and ``bus.stats()``.
        handle: the async handler; it runs in the bus's task group (thread work inside it
            goes through ``anyio.to_thread``).
        capacity: how many jobs may wait besides the one being handled.
        overflow: what ``put`` does when ``capacity`` jobs wait (see :data:`Overflow`).
        on_error: a failing job ``"raise"`` s (the bus reports a ``HookError`` at the next
            publish or at close, and later ``put`` calls raise), is ``"log"`` ged, or
            ``"disable"`` s the queue (later jobs are dropped and counted).
        on_cancel: called (synchronously, in the event loop) with the jobs not handled when
            close is cut short by cancellation -- a last chance to keep small ones.

    Raises:
        ValueError: a ``capacity`` that is not a positive int, an unknown ``overflow`` or
            ``on_error``.
    """

    def __init__(
        self,
        name: str,
        handle: Callable[[T], Awaitable[None]],
        *,
        capacity: int = 2,
        overflow: Overflow = "wait",
        on_error: OnError = "raise",
        on_cancel: Callable[[list[T]], None] | None = None,
    ) -> None:
        self.name = name
        self._handle = handle
        self._capacity = positive_int("JobQueue", "capacity", capacity)
        self._overflow = one_of("JobQueue", "overflow", overflow, get_args(Overflow))
        self._on_error = check_on_error("JobQueue", "on_error", on_error)
        self._on_cancel = on_cancel
        self._waiting: deque[T] = deque()
        self._current: T | None = None
        self._closing = False
        self._disabled = False
        self.failure: BaseException | None = None
        self._wake = anyio.Event()
        self._room = anyio.Event()  # set when a waiting job was taken
        self._idle = anyio.Event()
        self._idle.set()
        self.finished = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self._counts = dict.fromkeys(_COUNTS, 0)

    @property
    def closing(self) -> bool:
        """Close has begun: a handler may cut optional work short."""
        return self._closing

    @property
    def current(self) -> T | None:
        """The job being handled, if any."""
        return self._current

    @property
    def waiting(self) -> tuple[T, ...]:
        """The jobs queued behind it, oldest first."""
        return tuple(self._waiting)

    def replaced(self, job: T) -> None:
        """Called with a waiting job a newer one replaced (``overflow="replace"``); a
        subclass may recycle what it holds."""

    def put_nowait(self, job: T) -> bool:
        """Queue ``job`` without waiting; return whether it was queued.

        With ``overflow="wait"`` and a full queue it raises :class:`anyio.WouldBlock`; with
        ``"skip"`` it returns ``False``; with ``"replace"`` the newest waiting job is dropped.

        Raises:
            RuntimeError: the queue failed earlier (``on_error="raise"``) or is closed.
        """
        self._check_open()
        if self._disabled:
            self._counts["dropped"] += 1
            return False
        if len(self._waiting) >= self._capacity:
            if self._overflow == "wait":
                raise anyio.WouldBlock
            if self._overflow == "skip":
                self._counts["skipped"] += 1
                return False
            self.replaced(self._waiting.pop())
            self._counts["replaced"] += 1
        self._waiting.append(job)
        self._counts["jobs"] += 1
        if self._idle.is_set():
            self._idle = anyio.Event()
        self._wake.set()
        return True

    async def put(self, job: T) -> bool:
        """Queue ``job``, waiting for room only with ``overflow="wait"``; return whether it
        was queued (see :meth:`put_nowait`)."""
        while True:
            try:
                return self.put_nowait(job)
            except anyio.WouldBlock:
                if self._room.is_set():  # every waiting put shares one event
                    self._room = anyio.Event()
                await self._room.wait()

    async def wait_idle(self) -> None:
        """Return once every queued job has been handled (or the queue stopped)."""
        await self._idle.wait()

    def _check_open(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"{self.name}: failed earlier ({self.failure!r})") from self.failure
        if self._closing:
            raise RuntimeError(f"{self.name}: put after close")

    async def run(self) -> None:
        job: T | None = None  # the job being handled
        try:
            # The bus shields services from the body's cancellation; aclose cancels this scope
            # when its deadline passes.
            with anyio.CancelScope() as self._scope:
                while True:
                    if not self._waiting:
                        self._idle.set()
                        if self._closing:
                            return
                        self._wake = anyio.Event()
                        await self._wake.wait()
                        continue
                    job = self._current = self._waiting.popleft()
                    self._room.set()
                    await self._run_one(job)
                    job = self._current = None
        except anyio.get_cancelled_exc_class():
            left = [j for j in (job, *self._waiting) if j is not None]
            self._waiting.clear()
            if left and self._on_cancel is not None:
                self._on_cancel(left)
            raise
        finally:
            self._current = None
            self.finished.set()
            self._idle.set()  # nothing more will be handled: release waiters
            self._room.set()

    async def _run_one(self, job: T) -> None:
        if self._disabled:
            self._counts["dropped"] += 1
            return
        try:
            await self._handle(job)
        except Exception as exc:
            self._counts["errors"] += 1
            if self._on_error == "raise":
                self.failure = exc
                self._counts["dropped"] += len(self._waiting)
                self._waiting.clear()
                raise
            log_failure(
                logger,
                self._counts["errors"],
                exc,
                "%s: job failed (on_error=%s)",
                self.name,
                self._on_error,
            )
            if self._on_error == "disable":
                self._disabled = True
        else:
            self._counts["done"] += 1

    async def aclose(self, deadline: float) -> None:
        """Stop intake, finish the queued jobs, return by ``deadline``.

        Raises:
            TimeoutError: jobs were still queued or running at ``deadline`` (they are
                cancelled; the message says how many).
        """
        self._closing = True
        self._wake.set()
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await self.finished.wait()
        finally:
            if not self.finished.is_set() and self._scope is not None:
                self._scope.cancel()  # stop run() whatever happened to aclose
        if self.finished.is_set():
            return
        left = len(self._waiting) + (self._current is not None)
        raise TimeoutError(f"{self.name}: {left} jobs were not finished by the close deadline")

    def stats(self) -> Mapping[str, Any]:
        return {
            **self._counts,
            "queued": len(self._waiting),
            "running": int(self._current is not None),
        }
