"""Stopping a run from outside: SIGTERM/SIGINT, and the ``End`` status and exit they imply.

A preempted job gets SIGTERM (a scheduler) or SIGINT (Ctrl-C).  The first one asks the loop to
stop at the next step boundary, so the step in flight completes and every service drains
within ``flush_timeout``; leaving the bus then raises ``SystemExit(128 + signal)``, the status
a shell reports for a process killed by that signal.  A second one closes at once: services
spill what they still hold.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus

from .events import EndStatus

__all__ = ["StopSignals", "end_status", "preempted_exit"]

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """The SIGTERM/SIGINT watcher of one bus.

    Args:
        flush_timeout: the bus's drain budget, named in the log line of the first signal.
        request_stop: called with a reason at the first signal.
        hurry: called at the second signal, to cancel the body or cut the close short.
    """

    def __init__(
        self,
        flush_timeout: float,
        request_stop: Callable[[str], None],
        hurry: Callable[[], None],
    ) -> None:
        self.signum: int | None = None  # the first stop signal received
        self.hurry = False  # a second one arrived: close without waiting
        self._flush_timeout = flush_timeout
        self._request_stop = request_stop
        self._on_hurry = hurry
        self._scope: anyio.CancelScope | None = None

    async def watch(self, *, task_status: TaskStatus[None]) -> None:
        """Handle the signals until :meth:`stop`; start it with ``task_group.start``.

        Shielded, so cancelling the body does not end it: the handlers stay installed until
        close is done (else a third SIGINT would raise ``KeyboardInterrupt`` and a SIGTERM
        would kill the process in the middle of spilling)."""
        previous = {s: signal.getsignal(s) for s in _SIGNALS}
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
            for s, handler in previous.items():
                signal.signal(s, handler)

    async def _receive(self, task_status: TaskStatus[None]) -> None:
        with (
            anyio.CancelScope(shield=True) as self._scope,
            anyio.open_signal_receiver(*_SIGNALS) as signals,
        ):
            task_status.started()
            async for signum in signals:
                if self.hurry:
                    continue  # closing at once already
                name = signal.Signals(signum).name
                if self.signum is None:
                    self.signum = int(signum)
                    logger.warning(
                        "%s received: stopping at the next step boundary and draining "
                        "(flush_timeout=%ss); send it again to close at once",
                        name,
                        self._flush_timeout,
                    )
                    self._request_stop(f"preempted by {name}")
                    continue
                logger.warning("second stop signal: closing at once, spilling what is left")
                self.hurry = True
                self._on_hurry()

    def stop(self) -> None:
        """Stop watching (the bus has closed); the default handlers return."""
        if self._scope is not None:
            self._scope.cancel()


def end_status(exc: BaseException | None, signum: int | None) -> EndStatus:
    """``End.status`` for a body that ended with ``exc`` after the stop signal ``signum``."""
    cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
    if signum is not None and (exc is None or cancelled):
        return "preempted"
    if exc is None:
        return "ok"
    return "cancelled" if cancelled else "failed"


def preempted_exit(signum: int | None, exc: BaseException | None) -> SystemExit | None:
    """The ``SystemExit`` leaving the bus raises after a stop signal, or ``None``.

    ``exc`` is the body's exception still propagating (``None`` if it ended or was swallowed).
    A body that failed on its own keeps its exception; one cancelled by the second signal
    exits with the signal's status.
    """
    if signum is None:
        return None
    if exc is not None and not isinstance(exc, anyio.get_cancelled_exc_class()):
        return None
    return SystemExit(128 + signum)
