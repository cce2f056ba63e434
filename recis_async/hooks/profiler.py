"""ProfilerHook: ``torch.profiler`` on a wait/warmup/active/repeat schedule over training steps.

The profiler starts at the first training step and advances on every training ``AfterStep``.
When a cycle's active steps end, the recorded trace is handed to a background job that writes
``<output_dir>/<rank>-timeline-<global_step>.json`` (Chrome trace format, open it in
``chrome://tracing`` or Perfetto) in a worker thread, through a temporary name so no partial
file is ever visible.  ``End`` stops the profiler, exporting a cycle cut short.

Each cycle has its own profile object, so exporting cycle *n* in the background never races
with recording cycle *n+1*.  Note that kineto's writer holds the GIL while it serialises, so
the training thread still pauses for roughly the export time (milliseconds per MB of trace)
once per cycle; the step itself never waits on the file system.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import torch

from .._checks import writable_dir
from ..console import clear_bars
from ..events import AfterStep, BeforeStep, End
from ..hook import Hook
from ..jobs import JobQueue

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["ProfilerHook"]

log = logging.getLogger(__name__)

_RECORDING = (
    torch.profiler.ProfilerAction.RECORD,
    torch.profiler.ProfilerAction.RECORD_AND_SAVE,
)


class _Export(NamedTuple):
    profile: Any  # torch.autograd.profiler.profile of one finished cycle
    path: Path


class ProfilerHook(Hook):
    """Profile training steps with ``torch.profiler`` and export Chrome traces off the step.

    ``wait``, ``warmup``, ``active`` and ``repeat`` are ``torch.profiler.schedule``'s
    (``repeat=0`` repeats until the run ends).  CPU activity is always recorded, CUDA too
    when available, with shapes, memory and FLOPs as in RecIS.

    Args:
        wait: steps skipped at the start of each cycle.
        warmup: steps profiled but discarded.
        active: steps recorded and exported.
        repeat: cycles; 0 repeats until the run ends.
        output_dir: where the Chrome traces go (created if missing).

    Raises:
        ValueError: a schedule value that is not an int >= 0 (``active``: >= 1), an
            unwritable ``output_dir``.
    """

    def __init__(
        self,
        wait: int = 1,
        warmup: int = 48,
        active: int = 1,
        repeat: int = 4,
        output_dir: str | os.PathLike[str] = "./",
    ) -> None:
        for field, value, low in (
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active", active, 1),
            ("repeat", repeat, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                expected = "a positive int" if low else "an int >= 0"
                raise ValueError(f"ProfilerHook.{field}: expected {expected}, got {value!r}")
        path = Path(writable_dir("ProfilerHook", "output_dir", output_dir))
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.output_dir = path
        self.exported: list[Path] = []
        self._rank = 0
        self._prof: torch.profiler.profile | None = None
        self._running = False
        self._step = 0
        self._ready: list[_Export] = []
        self._jobs: JobQueue[_Export] | None = None

    def attach(self, bus: HookBus) -> None:
        if self._jobs is not None:
            raise RuntimeError("ProfilerHook is already attached to a bus")
        self._rank = bus.rank
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat
            ),
            on_trace_ready=self._trace_ready,
            record_shapes=True,
            profile_memory=True,
            with_flops=True,
        )
        self._jobs = JobQueue(
            "ProfilerHook.export", self._export, capacity=2, on_error=self.on_error
        )
        bus.start_service(self._jobs)

    def outputs(self) -> dict[str, str]:
        where = str(self.output_dir.absolute())
        if self.exported:
            where += f" ({len(self.exported)} timeline file(s), the last {self.exported[-1].name})"
        return {"profiler timelines": where}

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        # Called inside prof.step()/stop() on the training thread: only take the cycle's
        # results; the file is written by the background job.
        path = self.output_dir / f"{self._rank}-timeline-{self._step}.json"
        self._ready.append(_Export(prof.profiler, path))

    def before_step(self, event: BeforeStep) -> None:
        if event.is_train and not self._running and self._prof is not None:
            clear_bars()  # kineto prints to the terminal as it starts
            self._prof.start()
            self._running = True
        elif event.is_train and self._prof is not None and self._prof.current_action in _RECORDING:
            clear_bars()  # torch may print allocator warnings while it records this step

    async def after_step(self, event: AfterStep) -> None:
        if not event.is_train or self._prof is None:
            return
        self._step = event.global_step
        if not self._running:  # the loop publishes no BeforeStep: start after this step
            clear_bars()
            self._prof.start()
            self._running = True
            return
        prof = self._prof
        if prof.schedule(prof.step_num + 1) != prof.current_action:
            clear_bars()  # kineto prints to the terminal when recording starts or stops
        prof.step()
        await self._hand_over()

    async def end(self, event: End) -> None:
        if self._running and self._prof is not None:
            self._running = False
            clear_bars()
            self._prof.stop()
        await self._hand_over()

    async def _hand_over(self) -> None:
        if self._ready and self._jobs is not None:
            ready, self._ready = self._ready, []
            for job in ready:
                await self._jobs.put(job)

    async def _export(self, job: _Export) -> None:
        await anyio.to_thread.run_sync(write_trace, job.profile, job.path)
        self.exported.append(job.path)
        log.info("ProfilerHook: wrote %s", job.path)


def write_trace(profile: Any, path: Path) -> None:
    """Export ``profile`` (a finished cycle's ``torch.autograd.profiler.profile``) to ``path``
    as a Chrome trace, through a temporary name so no partial file is ever visible.  Blocking:
    run it in a worker thread."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        profile.export_chrome_trace(str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
