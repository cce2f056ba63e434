"""TimerHook: stop cleanly before a wall-clock budget runs out."""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..events import AfterLoadCheckpoint, AfterStep, BeforeStep, Start
from ..hook import Hook
from ..priority import Priority

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["TimerHook"]

logger = logging.getLogger(__name__)

_DHMS = re.compile(r"(\d+):(\d+):(\d+):(\d+)")
_EXPECTED = (
    "seconds > 0, a 'DD:HH:MM:SS' str, a timedelta or a dict of timedelta arguments "
    "(e.g. {'hours': 4})"
)
_STEPS_AVERAGED = 20  # training steps the step-time estimate is the mean of


def _seconds(value: Any) -> float:
    """``duration`` in seconds, or a ``ValueError``/``TypeError`` in the house style."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, str):
        match = _DHMS.fullmatch(value.strip())
        if match is None:
            raise ValueError(f"TimerHook(duration=...): expected {_EXPECTED}, got {value!r}")
        d, h, m, s = (int(g) for g in match.groups())
        seconds = timedelta(days=d, hours=h, minutes=m, seconds=s).total_seconds()
    elif isinstance(value, Mapping):
        try:
            seconds = timedelta(**value).total_seconds()
        except TypeError as exc:
            raise ValueError(
                f"TimerHook(duration=...): expected {_EXPECTED}, got {value!r} ({exc})"
            ) from None
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"TimerHook(duration=...): expected {_EXPECTED}, got {value!r}")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"TimerHook(duration=...): expected {_EXPECTED}, got {value!r}")
    return seconds


def _hms(seconds: float) -> str:
    return f"{seconds:.1f}s" if abs(seconds) < 60 else str(timedelta(seconds=round(seconds)))


class TimerHook(Hook):
    """Request a stop when one more training step would run past ``duration``.

    The time counts from ``Start`` (or the first step of a loop that publishes no ``Start``)
    on ``clock``, plus the time of the runs this one resumes: the elapsed time is in
    :meth:`state_dict`, so with checkpoints the budget covers the whole training across
    restarts, as Lightning's ``Timer`` does.  After each training step the hook requests a
    stop when the elapsed time plus one more step (the mean of the last training steps, from
    one ``AfterStep`` to the next, evaluations left out) would exceed the budget; the loop
    then stops at that step boundary, the ``Trainer`` saves its final checkpoint and every
    writer flushes.  In a distributed run the ``Trainer`` agrees the stop across ranks at the
    step boundary, so every rank stops at the same step.  The reason is logged at INFO.
    Leave room below a hard limit for what follows the stop (the last checkpoint, the
    flushes).  A run restored with its budget spent stops before its first step.

    Args:
        duration: the budget: seconds, ``"DD:HH:MM:SS"``, a ``timedelta`` or a dict of
            ``timedelta`` arguments (``{"hours": 4}``).
        clock: a monotonic clock in seconds (replaceable in tests).

    Raises:
        TypeError: a ``duration`` of another type, a non-callable ``clock``.
        ValueError: a ``duration`` that is not positive or not ``DD:HH:MM:SS``.
    """

    priority = Priority.HIGH  # decide before hooks that act on the stop at the same step

    def __init__(
        self,
        duration: float | str | timedelta | Mapping[str, float],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.duration = _seconds(duration)
        if not callable(clock):
            raise TypeError(f"TimerHook(clock=...): expected a callable, got {clock!r}")
        self._clock = clock
        self._before = 0.0  # seconds spent in the runs this one resumes
        self._started: float | None = None
        self._last_step: float | None = None  # when the previous training step ended
        self._steps: deque[float] = deque(maxlen=_STEPS_AVERAGED)
        self._bus: HookBus | None = None
        self._stopped = False

    def __repr__(self) -> str:
        return f"<TimerHook duration={_hms(self.duration)}>"

    def attach(self, bus: HookBus) -> None:
        self._bus = bus

    @property
    def elapsed(self) -> float:
        """Seconds of the budget used: this run's and those of the runs it resumes."""
        now = self._clock()
        return self._before + (now - self._started if self._started is not None else 0.0)

    @property
    def remaining(self) -> float:
        """Seconds of the budget left (negative once overrun)."""
        return self.duration - self.elapsed

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._before = float(state.get("elapsed", 0.0))

    def start(self, event: Start) -> None:
        if self._started is None:
            self._started = self._clock()

    def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        self._check(event.global_step, 0.0)

    def before_step(self, event: BeforeStep) -> None:
        if self._started is None:
            self._started = self._clock()
        if not event.is_train:
            self._last_step = None  # the evaluation is not part of the next step's time

    def after_step(self, event: AfterStep) -> None:
        if not event.is_train:
            return
        now = self._clock()
        if self._started is None:
            self._started = now
        if self._last_step is not None:
            self._steps.append(now - self._last_step)
        self._last_step = now
        steps = self._steps
        self._check(event.global_step, sum(steps) / len(steps) if steps else 0.0)

    def _check(self, step: int, next_step: float) -> None:
        if self._stopped or self._bus is None:
            return
        elapsed = self.elapsed
        if elapsed + next_step <= self.duration:
            return
        self._stopped = True
        reason = (
            f"TimerHook: {_hms(elapsed)} elapsed + {next_step:.3g}s for one more step would "
            f"pass the {_hms(self.duration)} budget at global_step {step}"
        )
        logger.info("%s: requesting a stop", reason)
        self._bus.request_stop(reason)
