"""NanTensorHook: fail, or stop, when the training loss is NaN or infinite."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import NanLossError
from ..events import AfterStep
from ..hook import Hook
from ..priority import Priority

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
    step and the value (the bus turns it into ``HookError`` at that step's ``publish``, before
    lower-priority hooks such as the checkpoint saver see the step); otherwise log a warning
    and request a stop.  A training step without the loss metric is an error too: a monitor
    that silently sees nothing protects nothing.

    Args:
        fail_on_nan_loss: raise :class:`NanLossError` (``True``) or log and request a stop.
        loss_key: the name of the loss in ``AfterStep.metrics``.

    Raises:
        TypeError: a ``fail_on_nan_loss`` that is not a bool (TensorFlow's loss tensor
            argument is named in the message).
        ValueError: an empty or non-str ``loss_key``.
    """

    priority = Priority.VERY_HIGH

    def __init__(self, fail_on_nan_loss: bool = True, *, loss_key: str = "loss") -> None:
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
        self._bus: HookBus | None = None

    def attach(self, bus: HookBus) -> None:
        self._bus = bus

    def after_step(self, event: AfterStep) -> None:
        if not event.is_train:
            return
        try:
            value = event.metrics[self.loss_key]
        except KeyError:
            raise KeyError(
                f"NanTensorHook: AfterStep(global_step={event.global_step}).metrics has no "
                f"{self.loss_key!r} (got {sorted(event.metrics)}); record it with "
                f"add_metric({self.loss_key!r}, loss) or pass loss_key="
            ) from None
        if _finite(value):
            return
        message = f"NaN/inf loss {value!r} ({self.loss_key!r}) at global_step {event.global_step}"
        if self.fail_on_nan_loss:
            raise NanLossError(f"NanTensorHook: {message}")
        logger.warning("%s: requesting a stop", message)
        if self._bus is not None:
            self._bus.request_stop(f"NanTensorHook: {message}")
