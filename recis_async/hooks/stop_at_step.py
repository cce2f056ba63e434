"""StopAtStepHook: request a stop once the run has done a given number of steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._checks import exactly_one, positive_int
from ..events import AfterLoadCheckpoint, AfterStep, BeforeStep
from ..hook import Hook
from ..priority import Priority

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["StopAtStepHook"]


class StopAtStepHook(Hook):
    """Stop training after ``num_steps`` more steps, or once ``last_step`` steps are done.

    Give exactly one.  Steps are counted as completed training steps (``global_step + 1`` at
    ``AfterStep``).  ``num_steps`` counts from the first training step this hook sees, so
    ``num_steps=10`` runs exactly 10 steps even in a resumed run.  The stop is requested at the
    ``AfterStep`` of the last step, so the loop stops at that boundary.  A run restored at or
    past ``last_step`` is stopped at ``AfterLoadCheckpoint``, before its first step; a loop
    that starts past it without a restore is told at its first ``BeforeStep``.

    Args:
        num_steps: training steps to run from the first one this hook sees.
        last_step: completed training steps after which to stop.

    Raises:
        TypeError: a step count that is not an int.
        ValueError: both or neither given, or a count that is not positive.
    """

    priority = Priority.HIGH  # decide before hooks that act on the stop at the same step

    def __init__(self, num_steps: int | None = None, last_step: int | None = None) -> None:
        owner = type(self).__name__
        exactly_one(owner, num_steps=num_steps, last_step=last_step)
        if num_steps is not None:
            positive_int(owner, "num_steps", num_steps)
        if last_step is not None:
            positive_int(owner, "last_step", last_step)
        self.num_steps = num_steps
        self.last_step = last_step
        self._stop_at = last_step
        self._bus: HookBus | None = None

    def attach(self, bus: HookBus) -> None:
        self._bus = bus
        self._stop_at = self.last_step

    def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        if self.last_step is not None:
            self._check(event.global_step)

    def before_step(self, event: BeforeStep) -> None:
        if not event.is_train:
            return
        if self._stop_at is None and self.num_steps is not None:
            self._stop_at = event.global_step + self.num_steps  # steps done so far + num_steps
        self._check(event.global_step)  # a run that starts past last_step stops at once

    def after_step(self, event: AfterStep) -> None:
        if event.is_train:
            self._check(event.global_step + 1)

    def _check(self, done: int) -> None:
        if self._stop_at is not None and done >= self._stop_at and self._bus is not None:
            self._bus.request_stop(
                f"{type(self).__name__}: {done} steps done (stop at {self._stop_at})"
            )

    def __repr__(self) -> str:
        what = (
            f"num_steps={self.num_steps}"
            if self.num_steps is not None
            else f"last_step={self.last_step}"
        )
        return f"<StopAtStepHook {what}>"
