"""LoggingTensorHook: log chosen metrics / tracked values every N steps or N seconds."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._checks import exactly_one, positive_int, positive_number
from ..events import AfterStep
from ..hook import Hook
from ..reads import ReadQueue
from ..subscription import Filters, is_train
from ..window import read_values

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["LoggingTensorHook"]

logger = logging.getLogger(__name__)

_MAX_ITEMS = 8  # longer lists/arrays are shortened in the log line


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list) and len(value) > _MAX_ITEMS:
        head = ", ".join(_format(v) for v in value[:_MAX_ITEMS])
        return f"[{head}, ... ({len(value)} items)]"
    if isinstance(value, list):
        return "[" + ", ".join(_format(v) for v in value) + "]"
    return repr(value)


def _plain(value: Any) -> bool:
    """A value on the host already (not a tensor, not a host copy still in flight)."""
    return isinstance(value, int | float | str | list | tuple | np.ndarray | np.generic)


class LoggingTensorHook(Hook):
    """Log the values named in ``names`` from training steps, TensorFlow style.

    Each name is looked up in ``AfterStep.metrics`` (``add_metric``), then in
    ``AfterStep.tracked`` (``add_to_ml_tracker``).  Give exactly one of ``every_n_iter``
    (the first training step, then every n-th) or ``every_n_secs`` (the first, then the first
    step at least that long after the previous line).  A name missing from a logged step shows
    as ``n/a`` and is warned about once.  One INFO line per log::

        global_step=99 loss = 0.6931, auc = 0.71 (1.52 sec)

    Values recorded as tensors (or host copies still in flight) are not read on the step: a
    worker thread reads them and the line is written once they are read, in order.

    Args:
        names: metric names to log, looked up in ``metrics`` then ``tracked``.
        every_n_iter: log the training steps whose ``global_step`` is a multiple of n (the
            first step, then every n-th, counted on the global step).
        every_n_secs: log the first training step, then at most once every that many seconds
            (counted by the bus's ``every_seconds`` filter).

    Raises:
        TypeError: ``names`` not a list of names.
        ValueError: an empty ``names``, both or neither of ``every_n_iter`` / ``every_n_secs``,
            a non-positive interval.
    """

    def __init__(
        self,
        names: Iterable[str],
        every_n_iter: int | None = None,
        every_n_secs: float | None = None,
    ) -> None:
        owner = type(self).__name__
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise TypeError(f"{owner}(names=...): expected a list of names, got {names!r}")
        self.names = list(names)
        if not self.names or not all(isinstance(n, str) and n for n in self.names):
            raise ValueError(
                f"{owner}(names=...): expected a non-empty list of metric names, got {self.names!r}"
            )
        exactly_one(owner, every_n_iter=every_n_iter, every_n_secs=every_n_secs)
        self.every_n_iter = (
            None if every_n_iter is None else positive_int(owner, "every_n_iter", every_n_iter)
        )
        self.every_n_secs = (
            None if every_n_secs is None else positive_number(owner, "every_n_secs", every_n_secs)
        )
        if self.every_n_secs is not None:  # the first training step, then every S seconds
            self.subscription_filters = {
                "after_step": Filters(every_seconds=self.every_n_secs, when=is_train)
            }
        self._last: float = -math.inf
        self._warned: set[str] = set()
        self._reads = ReadQueue("LoggingTensorHook.read", on_error=self.on_error)

    def attach(self, bus: HookBus) -> None:
        self._reads.start(bus)

    def after_step(self, event: AfterStep) -> Awaitable[None] | None:
        """Sync; a coroutine (the read handed to the worker) when a value is a tensor."""
        if not event.is_train:
            return None  # (with every_n_secs the bus's filter passes training steps only)
        now = time.monotonic()
        if self.every_n_iter is not None:
            # TensorFlow's rule (the first step, then every n-th) counted on the global step,
            # so a resumed run logs the same steps as an uninterrupted one
            if event.global_step % self.every_n_iter:
                return None
        found: dict[str, Any] = {}
        for name in self.names:
            if name in event.metrics:
                found[name] = event.metrics[name]
            elif name in event.tracked:
                found[name] = event.tracked[name]
            elif name not in self._warned:
                self._warned.add(name)
                logger.warning(
                    "LoggingTensorHook: %r is neither in AfterStep.metrics %s nor in "
                    "AfterStep.tracked %s at global_step %d",
                    name,
                    sorted(event.metrics),
                    sorted(event.tracked),
                    event.global_step,
                )
        since = "" if self._last == -math.inf else f" ({now - self._last:.3f} sec)"
        self._last = now
        write = functools.partial(self._write, event.global_step, since)
        if self._reads.busy or not all(_plain(v) for v in found.values()):
            return self._reads.put(functools.partial(read_values, found), write)
        write(found)
        return None

    def _write(self, step: int, since: str, values: dict[str, Any]) -> None:
        parts = [
            f"{name} = {_format(values[name])}" if name in values else f"{name} = n/a"
            for name in self.names
        ]
        logger.info("global_step=%d %s%s", step, ", ".join(parts), since)

    def __repr__(self) -> str:
        every = (
            f"every_n_iter={self.every_n_iter}"
            if self.every_n_iter is not None
            else f"every_n_secs={self.every_n_secs}"
        )
        return f"<LoggingTensorHook {self.names} {every}>"
