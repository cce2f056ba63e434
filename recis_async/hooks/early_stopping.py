"""EarlyStoppingHook: stop when a monitored metric stops improving."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._checks import positive_int
from ..events import AfterEval, AfterStep, BeforeSaveCheckpoint
from ..hook import Hook
from ..reads import ReadQueue
from ..window import read_value

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["EarlyStoppingHook"]

logger = logging.getLogger(__name__)

_MODES = ("min", "max")
_SOURCES = ("eval", "step")


class EarlyStoppingHook(Hook):
    """Request a stop after ``patience`` evaluations in a row without improvement.

    An evaluation is an ``AfterEval`` (``source="eval"``, the default: the metric must be in
    ``AfterEval.metrics``, else it is an error naming the metrics present), or a training
    ``AfterStep`` whose ``metrics`` hold ``monitor`` (``source="step"``: steps without it are
    skipped, for metrics recorded every n steps).  ``mode="min"`` improves when the value
    drops below the best by more than ``min_delta``, ``"max"`` when it rises above it; a NaN
    never improves.  ``best``, ``best_step`` and ``wait`` are in ``state_dict`` so a resumed run
    keeps its patience.

    With ``source="step"``, a value recorded as a tensor (one element) is not read on its
    step: a worker thread reads it and the hook judges it then, in step order, so the stop
    request comes a moment (on a GPU, a step or a few) after the step that triggered it; the
    judgements still queued are finished before a checkpoint is saved.

    Args:
        monitor: the metric name to watch.
        patience: evaluations in a row without improvement before the stop request.
        mode: "min" (lower is better) or "max".
        min_delta: how much better than the best a value must be to count as an improvement.
        source: "eval" (``AfterEval.metrics``) or "step" (training ``AfterStep.metrics``).

    Raises:
        TypeError: a ``patience`` that is not an int.
        ValueError: an empty or non-str ``monitor``, a ``patience`` below 1, an unknown
            ``mode`` or ``source``, a ``min_delta`` that is not a number >= 0.
    """

    def __init__(
        self,
        monitor: str,
        patience: int,
        mode: Literal["min", "max"] = "min",
        min_delta: float = 0.0,
        *,
        source: Literal["eval", "step"] = "eval",
    ) -> None:
        owner = type(self).__name__
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"{owner}(monitor=...): expected a metric name, got {monitor!r}")
        self.patience = positive_int(owner, "patience", patience)
        if mode not in _MODES:
            raise ValueError(f"{owner}(mode=...): expected 'min' or 'max', got {mode!r}")
        if (
            isinstance(min_delta, bool)
            or not isinstance(min_delta, int | float)
            or not math.isfinite(min_delta)
            or min_delta < 0
        ):
            raise ValueError(f"{owner}(min_delta=...): expected a number >= 0, got {min_delta!r}")
        if source not in _SOURCES:
            raise ValueError(f"{owner}(source=...): expected 'eval' or 'step', got {source!r}")
        self.monitor = monitor
        self.mode = mode
        self.min_delta = float(min_delta)
        self.source = source
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0
        self._bus: HookBus | None = None
        self._reads = ReadQueue("EarlyStoppingHook.read", on_error=self.on_error)

    def attach(self, bus: HookBus) -> None:
        self._bus = bus
        if self.source == "step":
            self._reads.start(bus)

    def after_eval(self, event: AfterEval) -> None:
        if self.source != "eval":
            return
        if self.monitor not in event.metrics:
            raise KeyError(
                f"EarlyStoppingHook: AfterEval(global_step={event.global_step}).metrics has no "
                f"{self.monitor!r} (got {sorted(event.metrics)})"
            )
        self._judge(event.metrics[self.monitor], event.global_step)

    def after_step(self, event: AfterStep) -> Awaitable[None] | None:
        """Sync for numbers; a coroutine (the read handed to the worker) for a tensor."""
        if self.source == "step" and event.is_train and self.monitor in event.metrics:
            raw = event.metrics[self.monitor]
            step = event.global_step + 1
            if isinstance(raw, torch.Tensor):
                if raw.numel() != 1:  # its shape says so: no read needed
                    self._judge(raw, step)
                return self._reads.put(
                    functools.partial(read_value, raw), functools.partial(self._judge_at, step)
                )
            if self._reads.busy:  # after the values still being read
                return self._reads.put(lambda: raw, functools.partial(self._judge_at, step))
            self._judge(raw, step)
        return None

    def _judge_at(self, step: int, value: Any) -> None:
        self._judge(value, step)

    async def before_save_checkpoint(self, event: BeforeSaveCheckpoint) -> None:
        """The judgements still being read are done before ``state_dict`` is taken."""
        await self._reads.wait_idle()

    def _judge(self, raw: Any, step: int) -> None:
        try:
            if isinstance(raw, torch.Tensor):
                raise TypeError  # more than one element (one is read before it gets here)
            value = float(raw)
        except (TypeError, ValueError):
            raise TypeError(
                f"EarlyStoppingHook: {self.monitor!r} at step {step}: expected a number, "
                f"got {_shown(raw)}"
            ) from None
        if self._improved(value):
            self.best, self.best_step, self.wait = value, step, 0
            return
        self.wait += 1
        if self.wait >= self.patience and self._bus is not None:
            reason = (
                f"EarlyStoppingHook: {self.monitor!r} did not improve for {self.wait} "
                f"evaluation(s) (best {self.best!r} at step {self.best_step}, now {value!r})"
            )
            logger.info("%s", reason)
            self._bus.request_stop(reason)

    def _improved(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        self.best_step = state["best_step"]
        self.wait = int(state["wait"])

    def __repr__(self) -> str:
        return (
            f"<EarlyStoppingHook monitor={self.monitor!r} mode={self.mode} "
            f"patience={self.patience} source={self.source}>"
        )


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):  # named by its shape: its values are not read
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)
