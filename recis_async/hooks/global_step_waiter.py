"""GlobalStepWaiterHook: hold this worker's first step until a shared step is reached."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from .._checks import positive_number
from ..events import BeforeStep
from ..hook import Hook

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["GlobalStepWaiterHook", "StepSource"]

logger = logging.getLogger(__name__)

StepSource = Callable[[], int | None] | Callable[[], Awaitable[int | None]]
"""Returns the shared step (``None`` while unknown); sync sources run in a worker thread."""

_LOG_EVERY_S = 30.0


class GlobalStepWaiterHook(Hook):
    """Before the first training step, wait until ``step_source()`` reports ``wait_until_step``.

    TensorFlow's version makes non-chief workers wait for the chief's global step (a warm-up
    before they join asynchronous training).  Here the step comes from ``step_source``, a
    callable returning the shared step or ``None`` while unknown: a key in a
    ``torch.distributed`` store, a file a trainer writes, or the newest checkpoint of a
    trainer's ``output_dir`` for an evaluator that follows it::

        from functools import partial
        from recis_async.hooks import GlobalStepWaiterHook, latest_checkpoint_step
        GlobalStepWaiterHook(1000, partial(latest_checkpoint_step, trainer_output_dir))

    Sync sources run in a worker thread (they may do I/O); ``async`` sources are awaited.
    Between polls (every ``poll_interval`` seconds) the wait sleeps, so the event loop and the
    bus's background services keep running; only the step waits.  It ends early when a stop is
    requested (the loop then stops at the step boundary), and raises ``TimeoutError`` after
    ``timeout`` seconds if given.  It waits once per run: later steps are never held.

    Do not use it between ranks of synchronous data-parallel training (DDP): every rank takes
    part in each step's collectives, so no rank can run ahead while another waits for it.

    Args:
        wait_until_step: the shared step to wait for.
        step_source: a callable (sync or ``async``) returning the shared step, or ``None`` while
            unknown.
        poll_interval: seconds between polls.
        timeout: seconds after which the wait raises ``TimeoutError``; ``None`` waits as long as
            it takes.

    Raises:
        TypeError: a ``wait_until_step`` that is not an int, a ``step_source`` that is not
            callable, an interval that is not a number.
        ValueError: a negative ``wait_until_step``, a ``poll_interval`` or ``timeout`` that is
            not positive.
    """

    def __init__(
        self,
        wait_until_step: int,
        step_source: StepSource,
        *,
        poll_interval: float = 1.0,
        timeout: float | None = None,
    ) -> None:
        owner = type(self).__name__
        if isinstance(wait_until_step, bool) or not isinstance(wait_until_step, int):
            raise TypeError(
                f"{owner}(wait_until_step=...): expected an int, got {wait_until_step!r}"
            )
        if wait_until_step < 0:
            raise ValueError(
                f"{owner}(wait_until_step=...): expected an int >= 0, got {wait_until_step!r}"
            )
        if not callable(step_source):
            raise TypeError(f"{owner}(step_source=...): expected a callable, got {step_source!r}")
        self.wait_until_step = wait_until_step
        self.step_source = step_source
        self.poll_interval = positive_number(owner, "poll_interval", poll_interval)
        self.timeout = None if timeout is None else positive_number(owner, "timeout", timeout)
        self._is_async = inspect.iscoroutinefunction(step_source) or inspect.iscoroutinefunction(
            getattr(step_source, "__call__", None)  # noqa: B004 - async __call__ on objects
        )
        self._done = False
        self._bus: HookBus | None = None
        self.waited_s = 0.0

    def attach(self, bus: HookBus) -> None:
        self._bus = bus
        self._done = False

    async def before_step(self, event: BeforeStep) -> None:
        if self._done or not event.is_train:
            return
        self._done = True
        if self.wait_until_step <= 0:
            return
        start = time.monotonic()
        logged = start
        while True:
            step = await self._read()
            if step is not None and step >= self.wait_until_step:
                break
            if self._bus is not None and self._bus.should_stop:
                logger.info("stop requested while waiting for step %d", self.wait_until_step)
                break
            now = time.monotonic()
            if self.timeout is not None and now - start >= self.timeout:
                raise TimeoutError(
                    f"GlobalStepWaiterHook: the step source reported {step!r} after "
                    f"{now - start:.1f}s; expected >= {self.wait_until_step} within "
                    f"timeout={self.timeout}s"
                )
            if now == start or now - logged >= _LOG_EVERY_S:
                logged = now
                logger.info("waiting for global step %d (now %r)", self.wait_until_step, step)
            await anyio.sleep(self.poll_interval)
        self.waited_s = time.monotonic() - start

    async def _read(self) -> int | None:
        if self._is_async:
            value = await self.step_source()  # type: ignore[misc]
        else:
            value = await anyio.to_thread.run_sync(self.step_source)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(
                f"GlobalStepWaiterHook: step_source() returned {value!r}; expected an int or None"
            )
        return value

    def __repr__(self) -> str:
        return f"<GlobalStepWaiterHook wait_until_step={self.wait_until_step}>"
