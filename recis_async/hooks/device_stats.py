"""DeviceStatsHook: memory and CPU of the process and the CUDA allocator, once per window;
OOMObserverHook: a CUDA memory snapshot when the run dies of an out-of-memory error.

Neither reads a tensor or synchronizes the device: ``torch.cuda.memory_stats`` returns the
caching allocator's host-side counters, and ``torch.cuda.memory._dump_snapshot`` its history.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import torch

from .._checks import nonempty_str, positive_int, writable_dir
from ..errors import OnError
from ..events import AfterStep, BeforeStep, End, Error, Start
from ..hook import Hook
from ..jobs import JobQueue
from ..subscription import Filters
from .ml_tracker import MLTrackerHook

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["DeviceStatsHook", "OOMObserverHook"]

logger = logging.getLogger(__name__)

# torch.cuda.memory_stats() keys and the names they are reported under (after the prefix)
_CUDA_STATS = (
    ("allocated_bytes.all.current", "cuda/allocated_bytes"),
    ("allocated_bytes.all.peak", "cuda/allocated_peak_bytes"),
    ("reserved_bytes.all.current", "cuda/reserved_bytes"),
    ("reserved_bytes.all.peak", "cuda/reserved_peak_bytes"),
    ("num_alloc_retries", "cuda/alloc_retries"),
    ("num_ooms", "cuda/ooms"),
)
_MIB = float(1 << 20)


class _Window(NamedTuple):
    step: int  # the global_step of the window's last step
    wall: float  # seconds since the previous window (monotonic)
    cpu: float  # process CPU seconds since the previous window
    cpu_total: float  # process CPU seconds since it started
    rss: float  # resident bytes now
    peak_rss: float  # resident bytes at the peak so far
    cuda: dict[str, float]  # the allocator's counters, renamed


def _rss_bytes() -> float:
    """The process's resident set now (``/proc/self/statm``), or its peak where there is no
    ``/proc`` (``getrusage``: KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


class DeviceStatsHook(Hook):
    """Every ``every_n_steps`` training steps, counted on ``global_step`` (the steps ``n - 1``,
    ``2n - 1``, ...: after a resume the same steps as in an uninterrupted run), record:

    * ``host/rss_bytes``, ``host/peak_rss_bytes``: the process's resident memory now and its
      peak so far;
    * ``host/cpu_seconds`` (since the process started) and ``host/cpu_percent`` (CPU time
      over wall time since the previous window; above 100 with several busy threads);
    * where CUDA is available, the current device's allocator counters:
      ``cuda/allocated_bytes``, ``cuda/reserved_bytes`` and their peaks over the window (the
      peaks are reset at every window), ``cuda/alloc_retries`` (``cudaMalloc`` retries after
      freeing the cache: memory pressure) and ``cuda/ooms``, both counted since the start.

    Names get ``prefix``.  At the window's last step the hook reads the clocks, the
    allocator's host-side counters (no device synchronization, no tensor) and
    ``/proc/self/statm`` (kernel memory, not a disk; about 10 us once a window); a background
    job logs the line at INFO and sends the values to every
    :class:`~recis_async.hooks.MLTrackerHook` on the bus, as
    :class:`~recis_async.hooks.MetricReportHook` does (add this hook after the tracker hook).
    ``last`` holds the latest values.

    Args:
        every_n_steps: training steps per window.
        prefix: metric name prefix.

    Raises:
        TypeError: an ``every_n_steps`` that is not an int, a ``prefix`` that is not a str.
        ValueError: an ``every_n_steps`` that is not positive, an empty ``prefix``.
    """

    def __init__(self, every_n_steps: int = 100, *, prefix: str = "device/") -> None:
        owner = type(self).__name__
        self.every_n_steps = positive_int(owner, "every_n_steps", every_n_steps)
        self.prefix = nonempty_str(owner, "prefix", prefix)
        # the bus calls after_step at the windows' last steps only
        self.subscription_filters = {"after_step": Filters(when=self._window_ends)}
        self.last: tuple[int, dict[str, float]] | None = None
        self._cuda = torch.cuda.is_available()
        self._bus: HookBus | None = None
        self._jobs: JobQueue[_Window] | None = None
        self._wall = time.monotonic()
        self._cpu = time.process_time()

    def __repr__(self) -> str:
        return f"<DeviceStatsHook every_n_steps={self.every_n_steps} prefix={self.prefix!r}>"

    def attach(self, bus: HookBus) -> None:
        if self._jobs is not None:
            raise RuntimeError(f"{self!r} is already attached to a bus")
        self._bus = bus
        self._jobs = JobQueue(
            "DeviceStatsHook.report", self._report, capacity=2, on_error=self.on_error
        )
        bus.start_service(self._jobs)
        self._start_window()

    def start(self, event: Start) -> None:
        self._start_window()

    def _start_window(self) -> None:
        self._wall, self._cpu = time.monotonic(), time.process_time()
        if self._cuda and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def _window_ends(self, event: AfterStep) -> bool:
        return event.is_train and not (event.global_step + 1) % self.every_n_steps

    async def after_step(self, event: AfterStep) -> None:
        wall, cpu = time.monotonic(), time.process_time()
        cuda: dict[str, float] = {}
        if self._cuda and torch.cuda.is_initialized():  # never create a CUDA context here
            stats = torch.cuda.memory_stats()  # host-side counters: no synchronization
            cuda = {name: float(stats.get(key, 0)) for key, name in _CUDA_STATS}
            torch.cuda.reset_peak_memory_stats()
        rss = _rss_bytes()
        peak = max(rss, _peak_rss_bytes())  # the kernel's high-water mark lags a little
        window = _Window(
            event.global_step, wall - self._wall, cpu - self._cpu, cpu, rss, peak, cuda
        )
        self._wall, self._cpu = wall, cpu
        if self._jobs is not None:
            await self._jobs.put(window)

    async def _report(self, window: _Window) -> None:
        rss, peak = window.rss, window.peak_rss
        p = self.prefix
        values = {
            f"{p}host/rss_bytes": rss,
            f"{p}host/peak_rss_bytes": peak,
            f"{p}host/cpu_seconds": window.cpu_total,
            f"{p}host/cpu_percent": 100.0 * window.cpu / window.wall if window.wall > 0 else 0.0,
            **{p + name: value for name, value in window.cuda.items()},
        }
        self.last = (window.step, values)
        line = (
            f"rss={rss / _MIB:.1f}MiB peak_rss={peak / _MIB:.1f}MiB "
            f"cpu={values[f'{p}host/cpu_percent']:.0f}%"
        )
        if window.cuda:
            c = window.cuda
            line += (
                f" cuda_allocated={c['cuda/allocated_bytes'] / _MIB:.1f}MiB"
                f" (peak {c['cuda/allocated_peak_bytes'] / _MIB:.1f}MiB)"
                f" cuda_reserved={c['cuda/reserved_bytes'] / _MIB:.1f}MiB"
                f" (peak {c['cuda/reserved_peak_bytes'] / _MIB:.1f}MiB)"
                f" alloc_retries={c['cuda/alloc_retries']:.0f} ooms={c['cuda/ooms']:.0f}"
            )
        logger.info("device stats <gstep=%d> %s", window.step, line)
        if self._bus is None:
            return
        for hook in self._bus.hooks:
            if not isinstance(hook, MLTrackerHook):
                continue
            if hook.accepting:
                await hook.log_metrics(window.step, values)
            else:  # services close in reverse order of start: the tracker closed first
                logger.warning(
                    "DeviceStatsHook: %r is closed; stats of step %d not tracked "
                    "(add DeviceStatsHook after MLTrackerHook)",
                    hook,
                    window.step,
                )


class OOMObserverHook(Hook):
    """Write a CUDA memory snapshot when the run fails with an out-of-memory error.

    At ``Start`` it turns on the allocator's history
    (``torch.cuda.memory._record_memory_history(max_entries=...)``: every allocation and free
    with its stack, kept on the host); when the body of the bus raises
    ``torch.OutOfMemoryError`` (the ``Error`` event, also when a hook's ``HookError`` wraps
    one) it writes ``<output_dir>/<rank>-oom-<global_step>.pickle`` with
    ``torch.cuda.memory._dump_snapshot`` in a worker thread and logs where; drag the file
    into https://pytorch.org/memory_viz to see what held the memory.  The error goes on as
    it was.  ``End`` turns the history off.  Without CUDA it says so once, at ``Start``, and
    does nothing.

    The history keeps the Python stack of each allocation (``context="alloc"``,
    ``stacks="python"``): what a snapshot needs to say who holds the memory.  torch's default
    (the stacks of frees too, with C++ frames) cost ~1.1 ms of the step thread's time on every
    step of ``benchmarks/bench_gpu.py`` on an H200; this one's cost was within that run's
    noise.  It is host time on every ``malloc``/``free`` of the caching allocator, never a
    synchronization.

    Args:
        output_dir: where the snapshots go (created if missing).
        max_entries: allocation events the history keeps.

    Raises:
        TypeError: a ``max_entries`` that is not an int.
        ValueError: one that is not positive, an unwritable ``output_dir``.
    """

    on_error: OnError = "log"  # type: ignore[misc]  # never hide the error being reported

    def __init__(
        self, output_dir: str | os.PathLike[str] = "./", *, max_entries: int = 100_000
    ) -> None:
        owner = type(self).__name__
        self.output_dir = Path(writable_dir(owner, "output_dir", output_dir))
        self.max_entries = positive_int(owner, "max_entries", max_entries)
        self.snapshots: list[Path] = []
        self._memory: Any = torch.cuda.memory  # the recorder; replaceable in tests
        self._cuda = torch.cuda.is_available()
        self._recording = False
        self._told = False
        self._step = 0
        self._rank = 0

    def __repr__(self) -> str:
        return f"<OOMObserverHook output_dir={str(self.output_dir)!r}>"

    def attach(self, bus: HookBus) -> None:
        self._rank = bus.rank

    def outputs(self) -> dict[str, str]:
        return {"CUDA memory snapshots on out-of-memory": str(self.output_dir.absolute())}

    def start(self, event: Start) -> None:
        if self._recording or self._told:
            return
        if not self._cuda:
            logger.info("OOMObserverHook: CUDA is not available; no memory snapshots")
            self._told = True  # said once: stay silent
            return
        self._memory._record_memory_history(
            context="alloc", stacks="python", max_entries=self.max_entries
        )
        self._recording = True

    def before_step(self, event: BeforeStep) -> None:
        self._step = event.global_step

    async def error(self, event: Error) -> None:
        oom = event.exc_type == "OutOfMemoryError" or "CUDA out of memory" in event.message
        if not (oom and self._recording):
            return
        path = self.output_dir / f"{self._rank}-oom-{self._step}.pickle"
        await anyio.to_thread.run_sync(self._memory._dump_snapshot, str(path))
        self.snapshots.append(path)
        logger.error(
            "OOMObserverHook: out of memory at global_step %d; memory snapshot in %s "
            "(open it in https://pytorch.org/memory_viz)",
            self._step,
            path,
        )

    def end(self, event: End) -> None:
        if self._recording:
            self._recording = False
            self._memory._record_memory_history(enabled=None)
