"""Stopping a run from outside: SIGTERM/SIGINT, and the ``End`` status and exit they imply.

A preempted job gets SIGTERM (a scheduler) or SIGINT (Ctrl-C).  The first one asks the loop to
stop at the next step boundary, so the step in flight completes and every service drains
within ``flush_timeout``; leaving the bus then raises ``SystemExit(128 + signal)``, the status
a shell reports for a process killed by that signal.  A second one closes at once: services
spill what they still hold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from .events import EndStatus

__all__ = ["StopSignals", "end_status", "preempted_exit"]

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """The SIGTERM/SIGINT watcher of one bus.

    Two halves, because a signal must count even when the loop never runs: a training loop
    whose hooks are all in-band (no service) never yields to the event loop, so a receiver task
    alone would not see a Ctrl-C until the loop had ended.

    * :meth:`_on_signal`, a Python-level handler, runs in the main thread between two
      bytecodes of whatever was running.  It is the one place signals are counted, and it only
      assigns attributes (no logging, no locks): the first signal marks the stop (``stop_now``
      makes ``bus.should_stop`` true at once), the second the hurry.
    * :meth:`catch_up`, in the event loop, does what needs the loop: the log lines, and the
      second signal's cancellation.  The receiver task calls it when the loop delivers a signal;
      ``publish`` calls it when it finds :attr:`unseen` set, so a loop that never yields still
      acts at the next step boundary.

    The loop's own delivery (asyncio's wake-up socket, trio's queue) only wakes the receiver:
    it is never counted, so a signal written into the inherited wake-up socket by a forked
    child (a ``DataLoader`` worker in the terminal's process group) cannot pass for a second
    Ctrl-C.

    Args:
        flush_timeout: the bus's drain budget, named in the log line of the first signal.
        stop_now: called with a reason at the first signal, from the signal handler: it may
            only assign (the reason is logged later, by :meth:`catch_up`).
        request_stop: called with the same reason by :meth:`catch_up`, in the loop.
        hurry: called at the second signal, in the loop, to cancel the body or cut the close
            short.
    """

    def __init__(
        self,
        flush_timeout: float,
        stop_now: Callable[[str], None],
        request_stop: Callable[[str], None],
        hurry: Callable[[], None],
    ) -> None:
        self.signum: int | None = None  # the first stop signal received
        self.hurry = False  # a second one arrived: close without waiting
        self.unseen = False  # a signal arrived that catch_up has not acted on yet
        self._flush_timeout = flush_timeout
        self._stop_now = stop_now
        self._request_stop = request_stop
        self._on_hurry = hurry
        self._told = 0  # signals catch_up has acted on: 0, 1 (the stop) or 2 (the hurry)
        self._scope: anyio.CancelScope | None = None
        self._chained: dict[int, Any] = {}  # the loop's own handlers, called after ours
        self._before: dict[int, Any] = {}  # the handlers before the bus opened
        self._closed = False

    # -------------------------------------------------------------- in the signal handler
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._closed:
            _as_if_never_opened(signum, frame, self._before.get(signum))
            return
        if self.signum is None:
            self.signum = signum
            self._stop_now(f"preempted by {signal.Signals(signum).name}")
        else:
            self.hurry = True
        self.unseen = True
        chained = self._chained.get(signum)
        if callable(chained):  # trio's handler queues the signal for the receiver
            chained(signum, frame)

    # -------------------------------------------------------------- in the event loop
    def catch_up(self) -> None:
        """Act on the signals counted since the last call: log the stop, hurry the close."""
        self.unseen = False
        if self.signum is not None and self._told == 0:
            self._told = 1
            name = signal.Signals(self.signum).name
            logger.warning(
                "%s received: stopping at the next step boundary and draining "
                "(flush_timeout=%ss); send it again to close at once",
                name,
                self._flush_timeout,
            )
            self._request_stop(f"preempted by {name}")
        if self.hurry and self._told == 1:
            self._told = 2
            logger.warning("second stop signal: closing at once, spilling what is left")
            self._on_hurry()

    async def watch(self, *, task_status: TaskStatus[None]) -> None:
        """Handle the signals until :meth:`stop`; start it with ``task_group.start``.

        Shielded, so cancelling the body does not end it: the handlers stay installed until
        close is done (else a third SIGINT would raise ``KeyboardInterrupt`` and a SIGTERM
        would kill the process in the middle of spilling)."""
        previous: dict[int, Any] = {s: signal.getsignal(s) for s in _SIGNALS}
        self._before = previous
        for s in _SIGNALS:  # what the receiver hands a late signal back to (see below)
            signal.signal(s, signal.SIG_IGN)
        try:
            await self._receive(task_status)
        finally:
            # On trio, a signal taken by the receiver in its last moment (sent at the very end
            # of the close) reaches it on the loop's next pass and, the receiver closed, is
            # raised again under the handler it restored: ignored here, instead of a
            # ``KeyboardInterrupt`` out of a bus that closed cleanly.  The bus has closed; the
            # first signal decides the exit status.
            with anyio.CancelScope(shield=True):
                for _ in range(3):
                    await anyio.lowlevel.checkpoint()
            self._closed = True  # a framework may put this handler back: see below
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    async def _receive(self, task_status: TaskStatus[None]) -> None:
        with (
            anyio.CancelScope(shield=True) as self._scope,
            anyio.open_signal_receiver(*_SIGNALS) as signals,
        ):
            # The receiver installed the loop's handlers; ours goes in front of them.
            for s in _SIGNALS:
                self._chained[s] = signal.getsignal(s)
                signal.signal(s, self._on_signal)
            task_status.started()
            async for _ in signals:
                self.catch_up()

    def stop(self) -> None:
        """Stop watching (the bus has closed); the default handlers return."""
        if self._scope is not None:
            self._scope.cancel()


def _as_if_never_opened(signum: int, frame: FrameType | None, before: Any) -> None:
    """A closed bus's handler, put back by a framework that saved it while the bus was open
    (Lightning's signal connector does, at the end of a failed ``fit``): the signal does what it
    did before the bus opened, so Ctrl-C still interrupts.

    SIGINT raises ``KeyboardInterrupt`` rather than calling the saved handler, which may be an
    event loop runner's that has ended too; an ignored signal stays ignored; SIGTERM goes to
    the saved handler, or with none kills the process as the default action does.
    """
    if before == signal.SIG_IGN:
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    if callable(before):
        before(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def end_status(exc: BaseException | None, signum: int | None) -> EndStatus:
    """``End.status`` for a body that ended with ``exc`` after the stop signal ``signum``.

    A cancellation is this loop's or another's: a :class:`~recis_async.SyncHookBus`'s body
    runs in its caller's event loop (a notebook's, an async caller's), whose cancellation may
    be the other library's (``asyncio.CancelledError`` on a trio bus, say)."""
    cancelled = isinstance(exc, _cancellations())
    if signum is not None and (exc is None or cancelled):
        return "preempted"
    if exc is None:
        return "ok"
    return "cancelled" if cancelled else "failed"


def _cancellations() -> tuple[type[BaseException], ...]:
    """The cancellation exceptions of the event loops that may run here."""
    trio = sys.modules.get("trio")
    if trio is None:
        return (asyncio.CancelledError,)
    return (asyncio.CancelledError, trio.Cancelled)


def preempted_exit(
    signum: int | None, exc: BaseException | None
) -> SystemExit | KeyboardInterrupt | None:
    """What leaving the bus raises after a stop signal, or ``None``.

    ``SystemExit(128 + signal)``: the status a shell reports for a process killed by that
    signal.  In an interactive session (a notebook's kernel, IPython, ``python -i``) a SIGINT
    is the interrupt button instead: ``KeyboardInterrupt``, which ends the cell and keeps the
    kernel, where ``SystemExit`` would ask to quit.

    ``exc`` is the body's exception still propagating (``None`` if it ended or was swallowed).
    A body that failed on its own keeps its exception; one cancelled by the second signal
    exits with the signal's status.
    """
    if signum is None:
        return None
    if exc is not None and not isinstance(exc, anyio.get_cancelled_exc_class()):
        return None
    if signum == signal.SIGINT and _interactive():
        return KeyboardInterrupt()
    return SystemExit(128 + signum)


def _interactive() -> bool:
    """An interactive session: a REPL (``sys.ps1``), ``python -i``, or a running IPython."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    return callable(get_ipython) and get_ipython() is not None


def _after_fork_in_child() -> None:
    """A child forked while a bus watches the signals (a ``DataLoader`` worker, say).

    It shares the terminal's process group, so a Ctrl-C reaches it too: it must neither write
    that signal into the parent loop's wake-up socket, which it inherited (asyncio would then
    deliver one Ctrl-C twice to the parent), nor stop on it.  The parent decides when the
    job stops, and stops its workers itself.
    """
    handler = signal.getsignal(signal.SIGINT)
    if not isinstance(getattr(handler, "__self__", None), StopSignals):
        return
    try:
        signal.set_wakeup_fd(-1)
        for s in _SIGNALS:
            # a handler that does nothing, not SIG_IGN: an ignored signal stays ignored
            # across exec, and a program a child starts must get the default back
            signal.signal(s, _ignore)
    except ValueError:  # not the main thread of the main interpreter: nothing was inherited
        pass


def _ignore(signum: int, frame: FrameType | None) -> None:
    """The stop signals in a forked child: the parent decides when the job stops."""


os.register_at_fork(after_in_child=_after_fork_in_child)
