"""The contract between the bus and its background services (writers, trackers, savers)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import anyio
from anyio.lowlevel import checkpoint

__all__ = ["CloseOnce", "Service", "first_of", "unreported_close_error", "yield_to_services"]

#: Loop passes a woken service needs to reach its worker thread: its wake-up, then anyio's
#: two checkpoints in ``to_thread.run_sync``.
_PASSES = 3


@runtime_checkable
class Service(Protocol):
    """A long-running background component owned by a :class:`~recis_async.HookBus`.

    A hook starts one from :meth:`Hook.attach` with ``bus.start_service(service)``.  The bus
    runs :meth:`run` as a task of its task group; when ``run`` raises, the error surfaces as
    :class:`~recis_async.HookError` at the next ``publish`` or at close.

    At close the bus calls :meth:`aclose` on every service in reverse order of start, shielded
    from cancellation.  ``deadline`` is an absolute time on :func:`anyio.current_time`'s clock
    shared by all services (``flush_timeout`` from the start of close).  ``aclose`` stops
    intake, finishes what it holds, and returns by ``deadline``; what it cannot deliver in time
    it keeps safe (a spill file, say) and reports by raising.  After ``aclose`` returned,
    ``run`` must return too.

    ``aclose`` may also be cancelled: when a service overruns its deadline by the bus's grace
    period, or at once when a second stop signal arrives.  A service that holds undelivered
    data must then still keep it safe before the cancellation propagates (spill in an
    ``except``/``finally`` block, synchronously or inside a shielded scope).  The error such a
    close could not raise (naming where the data went and how to replay it) is handed over by
    an optional ``take_close_error()`` method returning it (or ``None``), after which it counts
    as reported: the bus calls it when it cut the close short and names that error in its own
    (:func:`unreported_close_error`).

    ``aclose`` should be idempotent and report a failure once (the trace writer's and the
    tracker service's are): a later call returns quietly unless something new went
    undelivered since.
    """

    name: str

    async def run(self) -> None: ...

    async def aclose(self, deadline: float) -> None: ...

    def stats(self) -> Mapping[str, Any]: ...


async def yield_to_services() -> None:
    """Give the event loop the few passes a woken service needs to start its thread work.

    The bus calls it at most every 100 ms while publishing; a hook that has just handed work
    to a service calls it too, so the work starts on that step rather than at a later yield
    (with a single pass, a step longer than 100 ms delayed each stage by a step).
    """
    for _ in range(_PASSES):
        await checkpoint()


async def first_of(*events: anyio.Event | None) -> None:
    """Return as soon as one of ``events`` is set (``None`` entries are ignored): a service's
    wait for room that gives way to the bus's stop event, say."""
    waiting = [e for e in events if e is not None]
    if any(e.is_set() for e in waiting):
        return
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for event in waiting:
            tg.start_soon(wait, event)


class CloseOnce:
    """A service's close run once, its failure reported once, however often ``aclose`` is
    called (the contract of :class:`Service`): the first call runs the close; a later one,
    or one made while the first runs, waits for it until its own deadline.  Every call then
    raises what ``take_error`` says no earlier call (nor the bus) reported yet."""

    __slots__ = ("_done", "started")

    def __init__(self) -> None:
        self.started = False  # whether a close began (what the run spilled is the close's)
        self._done: anyio.Event | None = None  # made in the loop that closes

    async def __call__(
        self,
        close: Callable[[float], Awaitable[None]],
        deadline: float,
        take_error: Callable[[], Exception | None],
    ) -> None:
        if self._done is None:
            self._done = anyio.Event()
        if self.started:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await self._done.wait()
        else:
            self.started = True
            try:
                await close(deadline)
            finally:
                self._done.set()
        error = take_error()
        if error is not None:
            raise error


def unreported_close_error(service: Service) -> Exception | None:
    """What ``service``'s close, cut short by a cancellation, found and could not raise: its
    optional ``take_close_error()``'s answer (``None`` for a service without one).  Never
    raises: a failing ``take_close_error`` is returned as the error."""
    take = getattr(service, "take_close_error", None)
    if not callable(take):
        return None
    try:
        error = take()
    except Exception as exc:  # the close's report must not end the bus's close
        return exc
    return error if isinstance(error, Exception) else None
