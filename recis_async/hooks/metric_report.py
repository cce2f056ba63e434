"""MetricReportHook: a periodic health report of the training job.

At the steps completing ``interval_step``, ``2 * interval_step``, ... training steps of the job
(counted on ``global_step``, so a resumed run reports at the same steps) it reports training
throughput (``samples_per_sec``: what RecIS calls "qps"; ``steps_per_sec``), where a step's time
went (waiting for data, ``BeforeStep`` -> ``AfterData``, versus computing, ``AfterData`` ->
``AfterStep``), the FLOPs of a step, the FLOPs achieved per second and the model FLOPs
utilization (``mfu``: achieved / the device's peak), the model's parameter counts and, for every
dynamic hash table in the model, its id count and memory.  A hash table is any submodule with
``ids_count() -> int`` and ``memory_bytes() -> int`` (``recis_async.nn.HashTable`` has both).
After each evaluation pass (``AfterEval``) it reports that pass's throughput apart
(``eval_samples_per_sec``, ``eval_steps_per_sec``, ``eval_step_ms``).

FLOPs per step are given (``ReportArguments.flops_per_step``) or measured once, on the
training step ``flops_step`` of this process (the first by default, slow anyway with its
one-time work), under ``torch.utils.flop_counter.FlopCounterMode`` (entered at its
``BeforeStep``, left at its ``AfterStep``): that step is slower, so it is left out of the
window's timing.  Everything the thread runs in between counts, forward and backward (the
optimizer's elementwise updates have no FLOPs in the counter's table).  The peak comes from
a table of dense peaks by device and dtype (:func:`peak_flops`; float32 matmuls with TF32
allowed count at the TF32 peak), or from ``ReportArguments.peak_flops``, which wins; without
either (a CPU) no ``mfu`` is reported.

Timing is taken on the step: on the CPU a host clock read per event; on a GPU the window's time
comes from CUDA events recorded on the current stream at its ends (never a synchronize: the
report's job polls the closing event).  Counting parameters and scanning hash
tables runs in a worker thread of a background job, which then logs the report and sends it to
every :class:`~recis_async.hooks.MLTrackerHook` on the bus.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import msgspec
import torch

from .._checks import logger_or, non_negative_int, one_of, positive_number
from ..events import AfterData, AfterEval, AfterStep, BeforeStep, End, Error
from ..hook import Hook
from ..jobs import JobQueue
from ..subscription import StepCadence
from .logger import format_value
from .optim import send_to_trackers

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["MetricReportHook", "ReportArguments", "peak_flops"]

# Dense peak FLOP/s per device by dtype (vendors' data sheets; the sparse figures are twice
# these).  Matched by substring of torch.cuda.get_device_name(), first match wins.
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    (
        "H100 PCIe",
        {
            "float64": 51.2e12,
            "float32": 51.2e12,
            "tf32": 378e12,
            "bfloat16": 756e12,
            "float16": 756e12,
            "float8": 1513e12,
        },
    ),
    (
        "H100",  # SXM (H100 80GB HBM3)
        {
            "float64": 66.9e12,
            "float32": 66.9e12,
            "tf32": 494.7e12,
            "bfloat16": 989.4e12,
            "float16": 989.4e12,
            "float8": 1978.9e12,
        },
    ),
    (
        "H200",
        {
            "float64": 66.9e12,
            "float32": 66.9e12,
            "tf32": 494.7e12,
            "bfloat16": 989.4e12,
            "float16": 989.4e12,
            "float8": 1978.9e12,
        },
    ),
    (
        "A100",
        {
            "float64": 19.5e12,
            "float32": 19.5e12,
            "tf32": 156e12,
            "bfloat16": 312e12,
            "float16": 312e12,
        },
    ),
    (
        "L40S",
        {
            "float32": 91.6e12,
            "tf32": 183e12,
            "bfloat16": 362.05e12,
            "float16": 362.05e12,
            "float8": 733e12,
        },
    ),
    (
        "L4",
        {
            "float32": 30.3e12,
            "tf32": 60e12,
            "bfloat16": 121e12,
            "float16": 121e12,
            "float8": 242.5e12,
        },
    ),
    ("V100", {"float64": 7.8e12, "float32": 15.7e12, "float16": 125e12}),
)
_DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8")


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The dense peak FLOP/s of the device named ``device_name`` (as
    ``torch.cuda.get_device_name()`` says) computing in ``dtype`` (``"float32"``, ``"tf32"``,
    ``"bfloat16"``, ``"float16"``, ``"float8"``, ``"float64"``); ``None`` when unknown."""
    for key, table in _PEAKS:
        if key in device_name:
            return table.get(dtype)
    return None


class ReportArguments(msgspec.Struct, frozen=True, kw_only=True):
    """What and how often :class:`MetricReportHook` reports.

    ``interval_step``: training steps between reports; ``log``: write a log line;
    ``to_trackers``: send to the MLTrackerHooks on the bus; ``prefix``: metric name prefix.
    ``flops_per_step``: the FLOPs of one training step, if known (no measurement then);
    ``flops_step``: otherwise, which training step of this process (0-based) is measured
    with ``FlopCounterMode`` (``None``: none, no FLOPs reported); ``peak_flops``: the peak
    FLOP/s of one device for MFU (wins over the table); ``dtype``: the compute dtype to look
    the peak up by (``None``: the model's first floating parameter's, ``"tf32"`` for float32
    on CUDA when TF32 matmuls are allowed).
    """

    interval_step: int = 100
    log: bool = True
    to_trackers: bool = True
    prefix: str = "report/"
    flops_per_step: float | None = None
    flops_step: int | None = 0
    peak_flops: float | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        value = self.interval_step
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(
                f"ReportArguments.interval_step: expected a positive int, got {value!r}"
            )
        owner = "ReportArguments"
        if self.flops_per_step is not None:
            positive_number(owner, "flops_per_step", self.flops_per_step)
        if self.peak_flops is not None:
            positive_number(owner, "peak_flops", self.peak_flops)
        if self.flops_step is not None:
            non_negative_int(owner, "flops_step", self.flops_step)
        if self.dtype is not None:
            one_of(owner, "dtype", self.dtype, _DTYPES)


class _Report(NamedTuple):
    step: int
    values: dict[str, float]
    scan: bool = True  # add the model scan (training reports)
    window: tuple[Any, Any, int] | None = None  # CUDA events (start, end) and the steps


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
        self._seen = 0  # training steps this process ran (flops_step counts them)
        self._counter: Any = None  # the FlopCounterMode of the step being measured
        self.flops_per_step: float | None = report_args.flops_per_step
        self._events = False  # time windows with CUDA events (a model on a GPU)
        self._start_event: Any = None
        self._eval_start: float | None = None
        self._eval_t: float | None = None
        self._eval_steps = 0
        self._eval_samples = 0
        self._eval_compute = 0.0

    def attach(self, bus: HookBus) -> None:
        if self._jobs is not None:
            raise RuntimeError("MetricReportHook is already attached to a bus")
        self._bus = bus
        self._jobs = JobQueue(
            "MetricReportHook.report", self._report, capacity=2, on_error=self.on_error
        )
        bus.start_service(self._jobs)
        self._events = torch.cuda.is_available() and any(p.is_cuda for p in self.model.parameters())

    def peak(self) -> float | None:
        """The peak FLOP/s MFU is measured against: ``ReportArguments.peak_flops``, else the
        table's for this device and dtype (``None`` off a known GPU)."""
        if self.args.peak_flops is not None:
            return float(self.args.peak_flops)
        if not self._events:
            return None
        device = next(p.device for p in self.model.parameters() if p.is_cuda)
        return peak_flops(torch.cuda.get_device_name(device), self._dtype())

    def _dtype(self) -> str:
        if self.args.dtype is not None:
            return self.args.dtype
        dtype = next(
            (p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32
        )
        name = str(dtype).removeprefix("torch.")
        if name.startswith("float8"):
            return "float8"
        if name == "float32" and torch.get_float32_matmul_precision() != "highest":
            return "tf32"
        if name == "float32" and torch.backends.cuda.matmul.allow_tf32:
            return "tf32"
        return name

    def before_step(self, event: BeforeStep) -> None:
        now = self._clock()
        if not event.is_train:
            self._eval_t = now
            if self._eval_start is None:
                self._eval_start = now
            return
        self._t_before, self._t_data = now, None
        if self._window_start is None:
            self._window_start = now
            if self._events:
                self._start_event = _record_event()
        if (
            self.flops_per_step is None
            and self.args.flops_step is not None
            and self._seen == self.args.flops_step
        ):
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def after_data(self, event: AfterData) -> None:
        if not event.is_train or self._t_before is None:
            return
        now = self._clock()
        self._data_wait += now - self._t_before
        self._t_data = now

    async def after_step(self, event: AfterStep) -> None:
        now = self._clock()
        if not event.is_train:
            if self._eval_t is not None:
                self._eval_compute += now - self._eval_t
                self._eval_steps += 1
                self._eval_samples += event.samples
                self._eval_t = None
            return
        self._seen += 1
        start = self._t_data if self._t_data is not None else self._t_before
        if self._counter is not None:  # the measured step: slower, left out of the window
            self._stop_counting()
            self._window_start = now
            self._steps = self._samples = 0
            self._data_wait = self._compute = 0.0
            if self._events:
                self._start_event = _record_event()
        elif self._window_start is None or start is None:
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
        window = None
        if self._events and self._start_event is not None:
            end = _record_event()
            window = (self._start_event, end, steps)  # the times are read off the step
            self._start_event = end
        else:
            self._add_flops(values, elapsed, steps)
        self._window_start = now
        self._steps = self._samples = 0
        self._data_wait = self._compute = 0.0
        if self._jobs is not None:
            await self._jobs.put(_Report(event.global_step, values, window=window))

    def _add_flops(self, values: dict[str, float], elapsed: float, steps: int) -> None:
        """FLOPs per step, achieved FLOP/s and MFU over a window of ``elapsed`` seconds."""
        flops = self.flops_per_step
        if flops is None:
            return
        p = self.args.prefix
        achieved = flops * steps / elapsed if elapsed > 0 else 0.0
        values[f"{p}flops_per_step"] = float(flops)
        values[f"{p}flops_per_sec"] = achieved
        peak = self.peak()
        if peak is not None:
            values[f"{p}mfu"] = achieved / peak

    def _stop_counting(self) -> None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.flops_per_step = float(counter.get_total_flops())

    def error(self, event: Error) -> None:
        self._stop_counting()  # a step that failed while measured

    def end(self, event: End) -> None:
        self._stop_counting()

    async def after_eval(self, event: AfterEval) -> None:
        start, steps = self._eval_start, self._eval_steps
        self._eval_start, self._eval_t = None, None
        compute, samples = self._eval_compute, self._eval_samples
        self._eval_steps = self._eval_samples = 0
        self._eval_compute = 0.0
        if start is None or not steps:
            return
        elapsed = self._clock() - start
        p = self.args.prefix
        values = {
            f"{p}eval_samples_per_sec": samples / elapsed if elapsed > 0 else 0.0,
            f"{p}eval_steps_per_sec": steps / elapsed if elapsed > 0 else 0.0,
            f"{p}eval_step_ms": 1000.0 * compute / steps,
        }
        if self._jobs is not None:
            await self._jobs.put(_Report(event.global_step, values, scan=False))

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
        if report.window is not None:  # a GPU window: wait for its end here, off the step
            start, end, steps = report.window
            seconds = await _elapsed(start, end)
            p = self.args.prefix
            values[f"{p}step_ms"] = 1000.0 * seconds / steps if steps else 0.0
            values[f"{p}steps_per_sec"] = steps / seconds if seconds > 0 else 0.0
            self._add_flops(values, seconds, steps)
        if report.scan:
            values.update(await anyio.to_thread.run_sync(self.scan_model))
        self.last_report = (report.step, values)
        if self.args.log:
            self.logger.info(
                "report <gstep=%d> %s",
                report.step,
                " ".join(f"<{k}={format_value(v)}>" for k, v in values.items()),
            )
        if self.args.to_trackers:
            await send_to_trackers(self, self._bus, report.step, values, self.logger)


def _record_event() -> Any:
    """A timing CUDA event recorded on the current stream (no synchronization)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


async def _elapsed(start: Any, end: Any) -> float:
    """Seconds between two recorded CUDA events, once ``end`` has passed (polled: no
    synchronize, which ``torch.cuda.set_sync_debug_mode`` would flag)."""
    while not end.query():
        await anyio.sleep(0.001)
    return float(start.elapsed_time(end)) / 1000.0
