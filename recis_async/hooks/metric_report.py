"""MetricReportHook: a periodic health report of the training job.

At the steps completing ``interval_step``, ``2 * interval_step``, ... training steps of the job
(counted on ``global_step``, so a resumed run reports at the same steps) it reports throughput
(samples/s, steps/s), where a step's time went (waiting for data, ``BeforeStep`` ->
``AfterData``, versus computing, ``AfterData`` -> ``AfterStep``), the model's parameter counts
and, for every dynamic hash table in the model, its id count and memory.  A hash table is any
submodule with ``ids_count() -> int`` and ``memory_bytes() -> int``
(``recis_async.nn.HashTable`` has both).

Timing is taken on the step (a clock read per event); counting parameters and scanning hash
tables runs in a worker thread of a background job, which then logs the report and sends it
to every :class:`~recis_async.hooks.MLTrackerHook` on the bus.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import anyio
import msgspec
import torch

from .._checks import logger_or
from ..events import AfterData, AfterStep, BeforeStep
from ..hook import Hook
from ..jobs import JobQueue
from ..subscription import StepCadence
from .logger import format_value
from .ml_tracker import MLTrackerHook

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["MetricReportHook", "ReportArguments"]


class ReportArguments(msgspec.Struct, frozen=True, kw_only=True):
    """What and how often :class:`MetricReportHook` reports.

    ``interval_step``: training steps between reports; ``log``: write a log line;
    ``to_trackers``: send to the MLTrackerHooks on the bus; ``prefix``: metric name prefix.
    """

    interval_step: int = 100
    log: bool = True
    to_trackers: bool = True
    prefix: str = "report/"

    def __post_init__(self) -> None:
        value = self.interval_step
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"ReportArguments.interval_step: expected a positive int, got {value!r}"
            )


class _Report(NamedTuple):
    step: int
    values: dict[str, float]


class MetricReportHook(Hook):
    """Report throughput, step-time split, parameter counts and hash-table sizes of ``model``.

    ``clock`` (seconds, monotonic) may be replaced, e.g. in tests.

    Args:
        model: the model whose parameters and hash tables are counted.
        report_args: what to report and how often (:class:`ReportArguments`).
        logger: where the report lines go.
        clock: a monotonic clock in seconds.

    Raises:
        TypeError: a ``model`` that is not a ``torch.nn.Module``, ``report_args`` of another
            type, a non-callable ``clock``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        report_args: ReportArguments | None = None,
        *,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"MetricReportHook.model: expected a torch.nn.Module, got {type(model).__name__}"
            )
        if report_args is None:
            report_args = ReportArguments()
        if not isinstance(report_args, ReportArguments):
            raise TypeError(
                "MetricReportHook.report_args: expected ReportArguments, "
                f"got {type(report_args).__name__}"
            )
        self.model = model
        self.args = report_args
        self.logger = logger_or(type(self).__name__, logger, "recis_async.hooks.metric_report")
        self.last_report: tuple[int, dict[str, float]] | None = None
        self._clock = clock
        self._bus: HookBus | None = None
        self._jobs: JobQueue[_Report] | None = None
        self._cadence = StepCadence(self.args.interval_step)
        self._window_start: float | None = None
        self._t_before: float | None = None
        self._t_data: float | None = None
        self._steps = 0
        self._samples = 0
        self._data_wait = 0.0
        self._compute = 0.0

    def attach(self, bus: HookBus) -> None:
        if self._jobs is not None:
            raise RuntimeError("MetricReportHook is already attached to a bus")
        self._bus = bus
        self._jobs = JobQueue(
            "MetricReportHook.report", self._report, capacity=2, on_error=self.on_error
        )
        bus.start_service(self._jobs)

    def before_step(self, event: BeforeStep) -> None:
        if not event.is_train:
            return
        now = self._clock()
        self._t_before, self._t_data = now, None
        if self._window_start is None:
            self._window_start = now

    def after_data(self, event: AfterData) -> None:
        if not event.is_train or self._t_before is None:
            return
        now = self._clock()
        self._data_wait += now - self._t_before
        self._t_data = now

    async def after_step(self, event: AfterStep) -> None:
        if not event.is_train:
            return
        now = self._clock()
        start = self._t_data if self._t_data is not None else self._t_before
        if self._window_start is None or start is None:
            self._window_start = now  # no BeforeStep: this step only opens the window
        else:
            self._compute += now - start
            self._steps += 1
            self._samples += event.samples
        self._t_before = self._t_data = None
        if not self._cadence.due(event):
            return
        elapsed = now - self._window_start
        steps = self._steps
        p = self.args.prefix
        values = {
            f"{p}samples_per_sec": self._samples / elapsed if elapsed > 0 else 0.0,
            f"{p}steps_per_sec": steps / elapsed if elapsed > 0 else 0.0,
            f"{p}step_ms": 1000.0 * elapsed / steps if steps else 0.0,
            f"{p}data_wait_ms": 1000.0 * self._data_wait / steps if steps else 0.0,
            f"{p}compute_ms": 1000.0 * self._compute / steps if steps else 0.0,
        }
        self._window_start = now
        self._steps = self._samples = 0
        self._data_wait = self._compute = 0.0
        if self._jobs is not None:
            await self._jobs.put(_Report(event.global_step, values))

    def scan_model(self) -> dict[str, float]:
        """Parameter counts and hash-table sizes (blocking: runs in a worker thread)."""
        p = self.args.prefix
        total = trainable = 0
        for param in self.model.parameters():
            n = param.numel()
            total += n
            if param.requires_grad:
                trainable += n
        values: dict[str, float] = {
            f"{p}params": float(total),
            f"{p}trainable_params": float(trainable),
        }
        ids_total = mem_total = 0
        tables = 0
        for name, module in self.model.named_modules():
            ids_count = getattr(module, "ids_count", None)
            memory_bytes = getattr(module, "memory_bytes", None)
            if not (callable(ids_count) and callable(memory_bytes)):
                continue
            ids, mem = int(ids_count()), int(memory_bytes())
            label = name or "model"
            values[f"{p}hashtable/{label}/ids"] = float(ids)
            values[f"{p}hashtable/{label}/memory_bytes"] = float(mem)
            ids_total += ids
            mem_total += mem
            tables += 1
        if tables:
            values[f"{p}hashtable/ids"] = float(ids_total)
            values[f"{p}hashtable/memory_bytes"] = float(mem_total)
        return values

    async def _report(self, report: _Report) -> None:
        values = dict(report.values)
        values.update(await anyio.to_thread.run_sync(self.scan_model))
        self.last_report = (report.step, values)
        if self.args.log:
            self.logger.info(
                "report <gstep=%d> %s",
                report.step,
                " ".join(f"<{k}={format_value(v)}>" for k, v in values.items()),
            )
        if self.args.to_trackers and self._bus is not None:
            for hook in self._bus.hooks:
                if not isinstance(hook, MLTrackerHook):
                    continue
                if hook.accepting:
                    await hook.log_metrics(report.step, values)
                else:
                    # Services close in reverse order of start: a tracker added before this
                    # hook is still open here, one added after it may already be closed.
                    self.logger.warning(
                        "MetricReportHook: %r is closed; report of step %d not tracked "
                        "(add MetricReportHook after MLTrackerHook)",
                        hook,
                        report.step,
                    )
