"""JobQueue: a bounded queue of jobs handled one at a time by a background service.

Hooks whose slow part is occasional (a profiler export, a metric report with table scans)
hand a job to the queue from the step and return; ``put`` waits only when ``capacity`` jobs
are already queued.  Failures of the handler follow ``on_error`` like a subscriber's: raise
(the bus reports a ``HookError`` at the next publish or at close), log, or disable.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..console import log_failure
from ..errors import OnError

__all__ = ["JobQueue"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class JobQueue(Generic[T]):
    """A :class:`~recis_async.Service` running ``handle(job)`` for each queued job in order."""

    def __init__(
        self,
        name: str,
        handle: Callable[[T], Awaitable[None]],
        *,
        capacity: int = 2,
        on_error: OnError = "raise",
    ) -> None:
        self.name = name
        self._handle = handle
        self._on_error = on_error
        self._send: MemoryObjectSendStream[T]
        self._receive: MemoryObjectReceiveStream[T]
        self._send, self._receive = anyio.create_memory_object_stream[T](capacity)
        self._done = anyio.Event()
        self._scope: anyio.CancelScope | None = None
        self._failure: BaseException | None = None
        self._disabled = False
        self._current: T | None = None
        self._counts = {"jobs": 0, "done": 0, "errors": 0, "dropped": 0}

    async def put(self, job: T) -> None:
        """Queue ``job``; waits while the queue is full."""
        if self._failure is not None:
            failure = self._failure
            raise RuntimeError(f"{self.name}: failed earlier ({failure!r})") from failure
        if self._disabled:
            self._counts["dropped"] += 1
            return
        try:
            await self._send.send(job)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            if self._failure is not None:
                raise RuntimeError(
                    f"{self.name}: failed earlier ({self._failure!r})"
                ) from self._failure
            raise RuntimeError(f"{self.name}: put after close") from None
        self._counts["jobs"] += 1

    async def run(self) -> None:
        try:
            # The bus shields services from the body's cancellation; aclose cancels this scope
            # when its deadline passes.
            with anyio.CancelScope() as self._scope:
                async with self._receive:
                    async for job in self._receive:
                        if self._disabled:
                            self._counts["dropped"] += 1
                            continue
                        self._current = job
                        try:
                            await self._handle(job)
                        except Exception as exc:
                            self._counts["errors"] += 1
                            if self._on_error == "raise":
                                self._failure = exc
                                raise
                            log_failure(
                                log,
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
                        finally:
                            self._current = None
        finally:
            self._done.set()

    async def aclose(self, deadline: float) -> None:
        """Stop intake, finish the queued jobs, return by ``deadline``."""
        self._send.close()
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await self._done.wait()
        finally:
            if not self._done.is_set() and self._scope is not None:
                self._scope.cancel()  # stop run() whatever happened to aclose
        if self._done.is_set():
            return
        left = self._receive.statistics().current_buffer_used
        raise TimeoutError(
            f"{self.name}: {left + (self._current is not None)} jobs were not finished by the "
            "close deadline"
        )

    def stats(self) -> Mapping[str, Any]:
        return {**self._counts, "queued": self._receive.statistics().current_buffer_used}
