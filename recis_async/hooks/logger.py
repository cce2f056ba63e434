"""LoggerHook: a progress line every ``log_step`` steps through stdlib ``logging``.

Training lines come at the steps that complete a multiple of ``log_step`` steps of the job
(counted on ``global_step`` by :class:`~recis_async.subscription.StepCadence`), so a run resumed
from a checkpoint logs at the same steps as one never stopped; evaluation lines every
``log_step`` steps of each evaluation.

``<mode=train> <gstep=..> <lstep=..> <qps=..> <sps=..> <loss=..> ...``: ``qps`` is samples/s
and ``sps`` steps/s, measured on a monotonic clock over the steps since the previous line of
the same mode.  The hook subscribes to ``AfterStep`` only (a ``BeforeStep`` subscriber would
cost every step a publish), so it times a step from the end of the one before: the first step
of a run, and the first after a switch between training and evaluation, open their window
(at their end) and are not counted in its rate.  Training and evaluation keep separate
counters, and a window only counts the time spent in its own mode, so an evaluation in the
middle of training (and the idle time around it) does not lower the training rate.  A line
whose window timed no step yet (``log_step=1``, its first line) shows ``nan`` rates.  Each
``AfterEval`` gets one summary line, ``<mode=eval_summary> <gstep=..> <steps=..> <loss=..>
...``, with the pass's aggregated metrics, and the eval counters start again for the next
evaluation.  ``<lstep=..>`` is the event's ``local_step``; a loop that never passes one
(every step says 0) gets the hook's own count of the steps of that mode instead, as RecIS's
LoggerHook counts.

When a line is written: at its step when the step's metrics are numbers.  Metrics recorded as
tensors (``add_metric("loss", loss)`` on any device) are not read on the step: at the log step
their values are handed to a worker thread that reads them (on a GPU, the one wait on the
device per window, off the step) and the line is written once they are read, a moment after its
step, in the same order as every other line of the hook.  The line shows the log step's values,
as for numbers.  With ``all_reduce=True`` the log step itself reads them (in a worker thread)
before the collective, which every rank must enter at the same point.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import msgspec
import numpy as np

from .. import dist
from .._checks import boolean, logger_or, positive_int, positive_number
from ..events import AfterEval, AfterStep
from ..hook import Hook
from ..reads import ReadQueue
from ..subscription import StepCadence
from ..window import has_tensor, read_values

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["LoggerHook", "format_value"]


def format_value(value: Any) -> str:
    """Compact text for a metric: numbers with 6 significant digits, arrays by shape and mean."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, np.ndarray):
        if value.size and np.issubdtype(value.dtype, np.number):
            return f"array{list(value.shape)}(mean={float(value.mean()):.6g})"
        return f"array{list(value.shape)}"
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Window:
    """Counters of one mode (train or eval) since its last line."""

    __slots__ = ("busy", "count", "last_end", "samples", "seg_start", "steps")

    def __init__(self) -> None:
        self.count = 0  # steps of this mode seen (eval: in this evaluation), for log_step
        self.steps = 0  # steps timed in the current window
        self.samples = 0
        self.busy = 0.0  # closed segments of this mode in the window, seconds
        self.seg_start: float | None = None  # open segment start
        self.last_end = 0.0  # time of this mode's last AfterStep


class LoggerHook(Hook):
    """Log throughput and the step's ``metrics`` every ``log_step`` steps (rank 0 by default).

    With ``all_reduce=True`` in a distributed run the hook runs on every rank and, at each log
    step, the ranks all-reduce their numbers (in a worker thread, ``timeout`` seconds at most):
    rank 0 logs the mean of each numeric metric and of ``sps``, and the sum of ``qps`` (the
    job's samples/s).  ``clock`` (seconds, monotonic) and ``logger`` may be replaced, e.g. in
    tests.

    Args:
        log_step: steps per log line (training: the steps completing ``log_step``,
            ``2 * log_step``, ... steps of the job).
        all_reduce: reduce the numbers over all ranks before rank 0 logs them.
        timeout: seconds the all-reduce may take.
        logger: where the lines go; default ``recis_async.hooks.logger``.
        clock: a monotonic clock in seconds.

    Raises:
        TypeError: a ``log_step`` that is not an int, an ``all_reduce`` that is not a bool, a
            non-callable ``clock``, a ``logger`` that is not a logger.
        ValueError: a ``log_step`` or ``timeout`` that is not positive.
    """

    rank_zero_only = True

    def __init__(
        self,
        log_step: int = 10,
        *,
        all_reduce: bool = False,
        timeout: float = dist.DEFAULT_TIMEOUT,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        owner = type(self).__name__
        self.all_reduce = boolean(owner, "all_reduce", all_reduce)
        self.rank_zero_only = not all_reduce  # reducing needs every rank
        self.timeout = positive_number(owner, "timeout", timeout)
        self.log_step = positive_int(owner, "log_step", log_step)
        self._cadence = StepCadence(self.log_step)  # training lines: on the global step
        if not callable(clock):
            raise TypeError(f"{owner}(clock=...): expected a callable, got {clock!r}")
        self.logger = logger_or(type(self).__name__, logger, "recis_async.hooks.logger")
        self._clock = clock
        self._windows = {True: _Window(), False: _Window()}
        # the mode of the last step seen and its window: only its segment can be open, so a
        # step of the same mode has nothing to close (the common case, kept to one test)
        self._mode: bool | None = None
        self._window = self._windows[True]
        # per mode: whether the publisher numbers its steps (a nonzero local_step was seen);
        # until then <lstep=..> shows the hook's own count, as RecIS's LoggerHook does
        self._numbered = {True: False, False: False}
        self._reads = ReadQueue("LoggerHook.read", on_error=self.on_error)

    def attach(self, bus: HookBus) -> None:
        self._reads.start(bus)

    def _enter(self, is_train: bool) -> _Window:
        """Switch to this mode's window, closing the other mode's segment at its last step."""
        other = self._windows[not is_train]
        if other.seg_start is not None:
            other.busy += max(0.0, other.last_end - other.seg_start)
            other.seg_start = None
        self._mode = is_train
        self._window = window = self._windows[is_train]
        return window

    def after_step(self, event: AfterStep) -> Awaitable[None] | None:
        """Sync; a coroutine only at a log step whose line waits for reads (tensor values, or
        earlier lines still being read) or for the all-reduce."""
        now = self._clock()
        is_train = event.is_train
        window = self._window if is_train is self._mode else self._enter(is_train)
        if window.seg_start is None:
            # the segment's first step: its start is unknown, so it opens the window untimed
            window.seg_start = now
        else:
            window.steps += 1
            window.samples += event.samples
        window.last_end = now
        lstep = window.count
        window.count += 1
        if event.local_step or self._numbered[is_train]:
            self._numbered[is_train] = True
            lstep = event.local_step
        due = self._cadence.due(event) if is_train else window.count % self.log_step == 0
        if not due:
            return None
        elapsed = window.busy + (now - window.seg_start)
        sps = window.steps / elapsed if elapsed > 0 else math.nan
        qps = window.samples / elapsed if elapsed > 0 else math.nan
        window.steps = window.samples = 0
        window.busy = 0.0
        window.seg_start = now
        if lstep != event.local_step:
            event = msgspec.structs.replace(event, local_step=lstep)
        tensors = has_tensor(event.metrics.values())
        if self.all_reduce and dist.is_initialized() and dist.get_world_size() > 1:
            return self._reduced_line(event, qps, sps, tensors)
        if tensors or self._reads.busy:  # read off the step; lines keep their order
            return self._reads.put(
                functools.partial(read_values, event.metrics),
                functools.partial(self._write, event, qps, sps),
            )
        self.logger.info(self.format_line(event, qps, sps))
        return None

    async def _reduced_line(self, event: AfterStep, qps: float, sps: float, tensors: bool) -> None:
        """The line of a log step with ``all_reduce``: the job-wide numbers, on rank 0."""
        if tensors:  # read here: the collective below needs the values on every rank
            metrics = await anyio.to_thread.run_sync(read_values, event.metrics)
            event = msgspec.structs.replace(event, metrics=metrics)
        event, qps, sps = await self._reduced(event, qps, sps)
        if dist.get_rank() != 0:
            return
        if self._reads.busy:  # lines keep their order
            await self._reads.put(
                functools.partial(read_values, event.metrics),
                functools.partial(self._write, event, qps, sps),
            )
        else:
            self.logger.info(self.format_line(event, qps, sps))

    def _write(self, event: AfterStep, qps: float, sps: float, metrics: dict[str, Any]) -> None:
        """A line whose metrics were read off the step."""
        self.logger.info(self._line(event, qps, sps, metrics))

    async def after_eval(self, event: AfterEval) -> None:
        """One summary line per evaluation (after the lines of its steps still being read);
        the eval counters restart for the next one."""
        self._windows[False] = _Window()
        if self._mode is False:
            self._window = self._windows[False]
        if self.all_reduce and dist.get_rank() != 0:
            return  # the metrics are reduced over ranks already: rank 0 logs them once
        parts = [
            "<mode=eval_summary>",
            f"<gstep={event.global_step}>",
            f"<steps={event.steps}>",
            *(f"<{name}={format_value(value)}>" for name, value in event.metrics.items()),
        ]
        line = " ".join(parts)
        if self._reads.busy:
            await self._reads.put(_nothing, lambda _: self.logger.info(line))
        else:
            self.logger.info(line)

    async def _reduced(
        self, event: AfterStep, qps: float, sps: float
    ) -> tuple[AfterStep, float, float]:
        """The job-wide view: metrics and sps averaged over ranks, qps summed."""
        numbers = {
            f"m/{k}": float(v)
            for k, v in event.metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        numbers.update({"qps": qps, "sps": sps})
        mean = await anyio.to_thread.run_sync(
            functools.partial(
                dist.all_reduce_mean,
                numbers,
                device=dist.collective_device(),  # read here, on the loop's thread
                timeout=self.timeout,
                what=f"LoggerHook's all-reduce at global_step {event.global_step}",
            )
        )
        metrics = {**event.metrics, **{k[2:]: v for k, v in mean.items() if k.startswith("m/")}}
        world = dist.get_world_size()
        return msgspec.structs.replace(event, metrics=metrics), mean["qps"] * world, mean["sps"]

    @staticmethod
    def format_line(event: AfterStep, qps: float, sps: float) -> str:
        """The line of ``event`` (its metrics as they are: numbers, or tensors read here)."""
        return LoggerHook._line(event, qps, sps, read_values(event.metrics))

    @staticmethod
    def _line(event: AfterStep, qps: float, sps: float, metrics: Mapping[str, Any]) -> str:
        parts = [
            f"<mode={'train' if event.is_train else 'eval'}>",
            f"<gstep={event.global_step}>",
            f"<lstep={event.local_step}>",
            f"<qps={qps:.2f}>",
            f"<sps={sps:.3f}>",
        ]
        parts.extend(f"<{name}={format_value(value)}>" for name, value in metrics.items())
        return " ".join(parts)


def _nothing() -> None:
    return None
