"""NanTensorHook: fail, or stop, when the training loss is NaN or infinite.

A loss recorded as a number is checked on its step, as is a CPU tensor's (``add_metric`` reads
it at the call: nothing to wait for).  A loss recorded as a tensor on a device is checked on its
device every step (``isfinite(...).all()``, a kernel, no read) and the one-byte flag leaves the
device through a non-blocking copy (:class:`~recis_async.lagged.
LaggedCopies`); the hook acts on it ``lag`` training steps later (2 by default), at that step's
``AfterStep``, so a NaN at step ``k`` fails or stops the run at step ``k + lag`` at the latest, on
every device.  Pending flags are also settled before a checkpoint is saved
(``BeforeSaveCheckpoint``), when training ends (``AfterTrain``) and at ``End``, so a NaN in the
last steps is never missed and never saved.  ``strict=True`` reads the flag on its own step:
the old behaviour, and on a GPU a synchronization per step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._checks import boolean
from ..errors import NanLossError
from ..events import AfterStep, AfterTrain, BeforeSaveCheckpoint, End
from ..hook import Hook
from ..lagged import LaggedCopies
from ..priority import Priority
from ..window import read_value

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["NanTensorHook"]

logger = logging.getLogger(__name__)


def _finite(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, int | float):
        return math.isfinite(value)
    return bool(np.all(np.isfinite(np.asarray(value, dtype=np.float64))))


class NanTensorHook(Hook):
    """Watch ``AfterStep.metrics[loss_key]`` of training steps.

    On a NaN or infinite loss: with ``fail_on_nan_loss`` raise :class:`NanLossError` naming the
    step and the value (the bus turns it into ``HookError`` at the ``publish`` that found it,
    before lower-priority hooks such as the checkpoint saver see that step); otherwise log a
    warning and request a stop.  A training step without the loss metric is an error too: a
    monitor that silently sees nothing protects nothing.

    A number is checked on its step.  A tensor is checked on its device and its flag read
    ``lag`` training steps later without blocking the step (see the module's docstring): the
    error or stop then comes at step ``k + lag`` for a NaN at step ``k`` (the message names
    both), and the host runs at most ``lag`` steps ahead of the device's loss.  With
    ``strict=True`` a tensor's flag is read on its own step, as for a number: on a GPU that is
    a device synchronization every step.

    Args:
        fail_on_nan_loss: raise :class:`NanLossError` (``True``) or log and request a stop.
        loss_key: the name of the loss in ``AfterStep.metrics``.
        lag: training steps after which a tensor loss's flag is acted on (>= 1).
        strict: read a tensor loss's flag on its step (a synchronization on a GPU).

    Raises:
        TypeError: a ``fail_on_nan_loss`` or ``strict`` that is not a bool (TensorFlow's loss
            tensor argument is named in the message), a ``lag`` that is not an int.
        ValueError: an empty or non-str ``loss_key``, a ``lag`` below 1.
    """

    priority = Priority.VERY_HIGH

    def __init__(
        self,
        fail_on_nan_loss: bool = True,
        *,
        loss_key: str = "loss",
        lag: int = 2,
        strict: bool = False,
    ) -> None:
        if not isinstance(fail_on_nan_loss, bool):
            hint = ""
            if isinstance(fail_on_nan_loss, str | torch.Tensor):  # TF's NanTensorHook(loss)
                hint = (
                    " (the loss is read from AfterStep.metrics: record it with "
                    "add_metric('loss', loss) and name it with loss_key=...)"
                )
            raise TypeError(
                f"NanTensorHook(fail_on_nan_loss=...): expected a bool, got "
                f"{type(fail_on_nan_loss).__name__} {fail_on_nan_loss!r:.40}{hint}"
            )
        if not isinstance(loss_key, str) or not loss_key:
            raise ValueError(
                f"NanTensorHook(loss_key=...): expected a metric name, got {loss_key!r}"
            )
        self.fail_on_nan_loss = fail_on_nan_loss
        self.loss_key = loss_key
        self.strict = boolean("NanTensorHook", "strict", strict)
        self._flags = LaggedCopies("NanTensorHook", lag, torch.bool)
        self.lag = self._flags.lag
        self._bus: HookBus | None = None

    def attach(self, bus: HookBus) -> None:
        self._bus = bus

    def after_step(self, event: AfterStep) -> Awaitable[None] | None:
        """Sync on the common path (a coroutine only when a due flag's copy is not done)."""
        if not event.is_train:
            return None
        try:
            value = event.metrics[self.loss_key]
        except KeyError:
            raise KeyError(
                f"NanTensorHook: AfterStep(global_step={event.global_step}).metrics has no "
                f"{self.loss_key!r} (got {sorted(event.metrics)}); record it with "
                f"add_metric({self.loss_key!r}, loss) or pass loss_key="
            ) from None
        flags = self._flags
        flags.tick()
        if isinstance(value, torch.Tensor):
            finite = torch.isfinite(value).all()  # on the device: no read
            if self.strict:
                if not bool(finite):  # the documented synchronization
                    self._act(event.global_step, read_value(value), event.global_step)
            else:
                flags.put(event.global_step, finite, source=value)
        elif not _finite(value):
            self._act(event.global_step, value, event.global_step)
        if not flags.pending:
            return None
        due = flags.due_now()
        if due is None:  # a copy still in flight: wait for it (polled, off the loop's back)
            return self._settle_due(event.global_step)
        self._settle(due, event.global_step)
        return None

    async def _settle_due(self, now: int) -> None:
        self._settle(await self._flags.due(), now)

    async def before_save_checkpoint(self, event: BeforeSaveCheckpoint) -> None:
        """A checkpoint of a NaN model is never written: pending flags are settled first."""
        self._settle(await self._flags.drain(), event.global_step)

    async def after_train(self, event: AfterTrain) -> None:
        self._settle(await self._flags.drain(), event.global_step)

    async def end(self, event: End) -> None:
        self._settle(await self._flags.drain(), event.global_step)

    def _settle(self, due: list[Any], now: int | None) -> None:
        for d in due:
            if not bool(d.value.all()):
                self._act(d.step, read_value(d.source), now)  # read once: the failing step

    def _act(self, step: int, value: Any, now: int | None) -> None:
        message = f"NaN/inf loss {value!r} ({self.loss_key!r}) at global_step {step}"
        if now is not None and now != step:
            message += f" (found at global_step {now})"
        if self.fail_on_nan_loss:
            raise NanLossError(f"NanTensorHook: {message}")
        logger.warning("%s: requesting a stop", message)
        if self._bus is not None:
            self._bus.request_stop(f"NanTensorHook: {message}")

    def __repr__(self) -> str:
        return (
            f"<NanTensorHook loss_key={self.loss_key!r} lag={self.lag} strict={self.strict} "
            f"fail_on_nan_loss={self.fail_on_nan_loss}>"
        )
