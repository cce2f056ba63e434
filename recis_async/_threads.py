"""Blocking calls in daemon threads: a call that is given up on never keeps the process alive.

``anyio.to_thread`` runs calls in worker threads that, on asyncio, are not daemon threads: a
call abandoned at a deadline (a sink that never answers) keeps the interpreter from exiting
until it returns -- minutes, for a hung server.  The calls here each get their own daemon
thread instead (they are few and slow, so a thread per call costs nothing that matters), and
run in a copy of the caller's context, as ``to_thread`` does.

* :class:`Call` -- start a function in a daemon thread; wait for it with a timeout from any
  thread (:meth:`Call.wait`, :meth:`Call.result`).
* :func:`run_sync` -- await such a call from async code, on asyncio or trio, optionally
  abandoning it when the awaiting task is cancelled.
* :func:`wait` -- await the end of a :class:`Call` started earlier, at most a given time;
  cancelling the awaiting task ends the wait at once, never the call.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["Call", "run_sync", "wait"]

T = TypeVar("T")


class Call(Generic[T]):
    """``fn(*args)`` running in a new daemon thread named ``name``, started at once."""

    def __init__(self, fn: Callable[..., T], *args: Any, name: str = "recis_async call") -> None:
        self._fn = fn
        self._args = args
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] = []
        self._value: T | None = None
        self._error: BaseException | None = None
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name=name)
        self._thread.daemon = True
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn(*self._args)
        except BaseException as exc:  # handed to whoever reads the result
            self._error = exc
        finally:
            self._fn = self._args = None  # type: ignore[assignment]  # drop references early
            with self._lock:
                self._done.set()
                callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: without limit); return whether it ended."""
        return self._done.wait(timeout)

    def result(self) -> T:
        """The function's return value, or its exception raised; waits for it to end."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set when no error was stored

    def _on_done(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once the call ended: from its thread, or now if it has."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback()


def _wake_soon(event: anyio.Event) -> Callable[[], object]:
    """A function, callable from any thread, that sets ``event`` in the current event loop
    without waiting for it (a loop that has ended meanwhile is ignored)."""
    native = anyio.lowlevel.current_token().native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        schedule: Callable[[Callable[[], object]], object] = native.call_soon_threadsafe
    else:  # trio's TrioToken
        schedule = native.run_sync_soon  # type: ignore[attr-defined]

    def wake() -> None:
        try:
            schedule(event.set)
        except RuntimeError:  # the loop is closed (trio: RunFinishedError)
            pass

    return wake


async def wait(call: Call[Any], timeout: float | None = None) -> bool:
    """Wait until ``call`` has ended, at most ``timeout`` seconds (``None``: without limit);
    return whether it has.  No thread waits: the call's own thread wakes this task.  A
    cancellation of the waiting task ends the wait at once; the call runs on."""
    if not call.done:
        done = anyio.Event()
        call._on_done(_wake_soon(done))
        with anyio.move_on_after(timeout):
            await done.wait()
    return call.done


async def run_sync(
    fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False, name: str | None = None
) -> T:
    """Run ``fn(*args)`` in a new daemon thread and return its result.

    When the awaiting task is cancelled: with ``abandon_on_cancel`` the cancellation is raised
    at once and the call runs on unattended (a daemon thread: it cannot delay the process's
    exit); without it the task waits for the call to end, then the cancellation is raised --
    as with ``anyio.to_thread.run_sync``.
    """
    done = anyio.Event()
    wake = _wake_soon(done)
    call = Call(fn, *args, name=name or f"recis_async {getattr(fn, '__name__', 'call')}")
    call._on_done(wake)
    if abandon_on_cancel:
        await done.wait()
    else:
        with anyio.CancelScope(shield=True):
            await done.wait()
        await anyio.lowlevel.checkpoint_if_cancelled()
    return call.result()
