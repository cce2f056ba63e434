"""StepCounterHook: training steps/s and samples/s, as metrics and in the log."""

from __future__ import annotations

import logging
import time

from .._checks import positive_int
from ..collect import add_metric
from ..events import AfterStep, BeforeStep
from ..hook import Hook
from ..subscription import StepCadence

__all__ = ["StepCounterHook"]

logger = logging.getLogger(__name__)


class StepCounterHook(Hook):
    """Measure throughput over every ``every_n_steps`` completed training steps.

    Intervals end at the steps completing ``n``, ``2n``, ... steps of the job (counted on
    ``global_step`` by :class:`~recis_async.subscription.StepCadence`, so a resumed run
    measures at the same steps; its first interval is shorter).  An interval runs from the
    ``BeforeStep`` of its first step to the ``BeforeStep`` after its last one, on the monotonic
    clock, so it covers data loading, compute and hooks.  The rates are computed at that
    ``BeforeStep`` and collected with ``add_metric`` as ``steps_per_sec`` and
    ``samples_per_sec`` (from ``AfterStep.samples``), so they ride on the ``AfterStep`` of that
    step: the steps ``global_step = n, 2n, ...`` carry the rate of the steps before them.  Time
    spent in evaluation steps is not counted.  Each rate is also logged at INFO.

    Args:
        every_n_steps: completed training steps per measured interval.

    Raises:
        TypeError: an ``every_n_steps`` that is not an int.
        ValueError: one that is not positive.
    """

    def __init__(self, every_n_steps: int = 100) -> None:
        self.every_n_steps = positive_int(type(self).__name__, "every_n_steps", every_n_steps)
        self._mark: float | None = None  # when the current interval started
        self._paused: float | None = None  # when evaluation interrupted it
        self._steps = 0
        self._samples = 0
        self._cadence = StepCadence(self.every_n_steps)
        self._due = False  # the last training step ended an interval

    def before_step(self, event: BeforeStep) -> None:
        now = time.monotonic()
        if not event.is_train:
            if self._mark is not None and self._paused is None:
                self._paused = now
            return
        if self._paused is not None and self._mark is not None:
            self._mark += now - self._paused  # leave the evaluation out of the interval
        self._paused = None
        if self._mark is None:
            self._mark = now
            return
        if not (self._due and self._steps):
            return
        self._due = False
        elapsed = max(now - self._mark, 1e-9)
        steps_per_sec = self._steps / elapsed
        samples_per_sec = self._samples / elapsed
        add_metric("steps_per_sec", steps_per_sec)
        add_metric("samples_per_sec", samples_per_sec)
        logger.info(
            "global_step=%d steps/s=%.4g samples/s=%.4g",
            event.global_step,
            steps_per_sec,
            samples_per_sec,
        )
        self._mark = now
        self._steps = self._samples = 0

    def after_step(self, event: AfterStep) -> None:
        if not event.is_train:
            return
        self._due = self._cadence.due(event)
        if self._mark is not None:
            self._steps += 1
            self._samples += event.samples

    def __repr__(self) -> str:
        return f"<StepCounterHook every_n_steps={self.every_n_steps}>"
