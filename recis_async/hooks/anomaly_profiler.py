"""AnomalyProfilerHook: profile the next steps when a step is slow or the loss jumps.

A scheduled profile (:class:`~recis_async.hooks.ProfilerHook`) sees ordinary steps; the step
worth seeing is the one that took five times as long, usually long after the schedule ended.
This hook watches every training step and, when one is anomalous, records the next ``steps``
steps with ``torch.profiler`` and exports them as a Chrome trace off the step, through the
same background job and atomic write as ``ProfilerHook``.

Two triggers, each judged against the running median of the last ``window`` training steps
(once at least :data:`MIN_HISTORY` of them are known, so the first, slow steps of a run do not
fire it):

* ``slowdown``: a step whose host time (``BeforeStep`` -> ``AfterStep`` on ``clock``;
  without ``BeforeStep``, the time since the previous training ``AfterStep``) is more than
  ``slowdown`` times the median.  On a GPU the host runs ahead of the device until its queue
  fills, so a step slowed on the device shows up in the host time of the steps after it.
* ``loss_jump``: a loss more than ``loss_jump`` times the median loss, from
  ``AfterStep.metrics[loss_key]``: a number is judged on its step; a one-element tensor is
  not read on its step but copied to the host without blocking
  (:class:`~recis_async.lagged.LaggedCopies`) and judged :data:`LOSS_LAG` training steps later
  (the warning names the step of the spike); a step without one is not judged.

At most ``max_profiles`` profiles are taken per run (a resumed run counts those taken before:
the count is in :meth:`state_dict`).  The reason is logged at WARNING and named in the file:
``<output_dir>/<rank>-anomaly-<global_step>-<reason>.json`` with ``reason`` ``slow_step`` or
``loss_spike`` and ``global_step`` the anomalous step.  One warm-up step precedes the recorded
ones (torch's profiler skews the first step it records); steps being profiled are neither
judged nor counted in the medians.
"""

from __future__ import annotations

import logging
import numbers
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import torch

from .._checks import nonempty_str, positive_int, positive_number, writable_dir
from ..console import clear_bars
from ..events import AfterStep, BeforeStep, End
from ..hook import Hook
from ..jobs import JobQueue
from ..lagged import LaggedCopies
from .profiler import _Export, write_trace

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["LOSS_LAG", "MIN_HISTORY", "AnomalyProfilerHook"]

log = logging.getLogger(__name__)

#: Training steps seen before either trigger may fire.
MIN_HISTORY = 20

#: Training steps after which a tensor loss is judged (its copy to the host is done by then).
LOSS_LAG = 2


class AnomalyProfilerHook(Hook):
    """Profile ``steps`` training steps after a slow step or a loss spike, at most
    ``max_profiles`` times per run.

    Args:
        steps: training steps recorded per profile.
        slowdown: a step slower than this many times the median step time fires; ``None``
            turns the step-time trigger off.
        loss_jump: a loss above this many times the median loss fires; ``None`` turns the loss
            trigger off.
        max_profiles: profiles per run.
        window: training steps the medians are taken over.
        output_dir: where the Chrome traces go (created if missing).
        loss_key: the loss's name in ``AfterStep.metrics``.
        clock: a monotonic clock in seconds (replaceable in tests).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a count or factor that is not positive, a factor not above 1, both
            triggers off, an unwritable ``output_dir``.
    """

    def __init__(
        self,
        steps: int = 3,
        *,
        slowdown: float | None = 3.0,
        loss_jump: float | None = 3.0,
        max_profiles: int = 3,
        window: int = 100,
        output_dir: str | os.PathLike[str] = "./",
        loss_key: str = "loss",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        owner = type(self).__name__
        self.steps = positive_int(owner, "steps", steps)
        for field, factor in (("slowdown", slowdown), ("loss_jump", loss_jump)):
            if factor is not None and positive_number(owner, field, factor) <= 1.0:
                raise ValueError(
                    f"{owner}({field}=...): expected a number > 1 or None, got {factor!r}"
                )
        if slowdown is None and loss_jump is None:
            raise ValueError(f"{owner}: expected slowdown or loss_jump, got both None")
        self.slowdown = None if slowdown is None else float(slowdown)
        self.loss_jump = None if loss_jump is None else float(loss_jump)
        self.max_profiles = positive_int(owner, "max_profiles", max_profiles)
        self.window = positive_int(owner, "window", window)
        self.output_dir = Path(writable_dir(owner, "output_dir", output_dir))
        self.loss_key = nonempty_str(owner, "loss_key", loss_key)
        if not callable(clock):
            raise TypeError(f"{owner}(clock=...): expected a callable, got {clock!r}")
        self._clock = clock
        self.exported: list[Path] = []
        self.fired = 0  # profiles started in this run, and in the runs it resumes
        self._times: deque[float] = deque(maxlen=self.window)
        self._losses: deque[float] = deque(maxlen=self.window)
        self._lagged = LaggedCopies(owner, LOSS_LAG, torch.float32)  # tensor losses
        self._t_before: float | None = None
        self._t_after: float | None = None
        self._rank = 0
        self._prof: torch.profiler.profile | None = None
        self._name = ""  # the file name of the profile being recorded
        self._ready: list[_Export] = []
        self._jobs: JobQueue[_Export] | None = None

    def __repr__(self) -> str:
        return (
            f"<AnomalyProfilerHook steps={self.steps} slowdown={self.slowdown} "
            f"loss_jump={self.loss_jump} max_profiles={self.max_profiles} "
            f"window={self.window} output_dir={str(self.output_dir)!r}>"
        )

    def attach(self, bus: HookBus) -> None:
        if self._jobs is not None:
            raise RuntimeError(f"{self!r} is already attached to a bus")
        self._rank = bus.rank
        self._jobs = JobQueue(
            "AnomalyProfilerHook.export", self._export, capacity=2, on_error=self.on_error
        )
        bus.start_service(self._jobs)

    def outputs(self) -> dict[str, str]:
        where = str(self.output_dir.absolute())
        if self.exported:
            where += f" ({len(self.exported)} anomaly trace(s), the last {self.exported[-1].name})"
        return {"anomaly profiles": where}

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self.fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.fired = int(state.get("fired", 0))

    def before_step(self, event: BeforeStep) -> None:
        if event.is_train:
            self._t_before = self._clock()

    async def after_step(self, event: AfterStep) -> None:
        if not event.is_train:
            self._t_after = None  # an evaluation between two steps is not part of either
            return
        now = self._clock()
        start = self._t_before if self._t_before is not None else self._t_after
        self._t_before, self._t_after = None, now
        due = await self._tensor_losses(event)
        if self._prof is not None:  # profiling: this step is neither judged nor counted
            self._advance()
            await self._hand_over()
            return
        if self.fired >= self.max_profiles:
            return
        reason = why = ""
        if self.slowdown is not None and start is not None:
            took = now - start
            times = self._times
            # the median only when the step could be slow (above slowdown x the fastest)
            if len(times) >= MIN_HISTORY and took > self.slowdown * min(times):
                median = statistics.median(times)
                if took > self.slowdown * median > 0:
                    reason = "slow_step"
                    why = (
                        f"slow step at global_step {event.global_step}: {took * 1e3:.4g} ms, "
                        f"{took / median:.3g}x the median {median * 1e3:.4g} ms of the last "
                        f"{len(times)} steps"
                    )
            times.append(took)
        if self.loss_jump is not None:
            loss = event.metrics.get(self.loss_key)
            if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
                due.append((event.global_step, float(loss)))  # a number already on the host
            for step, value in due:
                spike = self._loss_spike(step, value)
                if spike and not reason:
                    reason, why = "loss_spike", spike
        if reason:
            self._fire(event.global_step, reason, why)

    async def _tensor_losses(self, event: AfterStep) -> list[tuple[int, float]]:
        """Start the copy of this step's tensor loss; the (step, loss) pairs due now."""
        if self.loss_jump is None:
            return []
        lagged = self._lagged
        lagged.tick()
        loss = event.metrics.get(self.loss_key)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and self._prof is None:
            lagged.put(event.global_step, loss)
        if not lagged.pending:
            return []
        return [(d.step, float(d.value[0])) for d in await lagged.due()]

    def _loss_spike(self, step: int, value: float) -> str:
        """Why the loss of ``step`` is a spike ("" if it is not); counted in the median."""
        losses = self._losses
        why = ""
        if len(losses) >= MIN_HISTORY and value > min(losses):
            median = statistics.median(losses)
            if median > 0 and value > self.loss_jump * median:  # type: ignore[operator]
                why = (
                    f"loss spike at global_step {step}: {value:.6g}, "
                    f"{value / median:.3g}x the median {median:.6g} of the last "
                    f"{len(losses)} steps"
                )
        losses.append(value)
        return why

    async def end(self, event: End) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            clear_bars()
            prof.stop()  # a profile cut short by the end of the run is exported as it is
        await self._hand_over()

    def _fire(self, step: int, reason: str, why: str) -> None:
        self.fired += 1
        self._name = f"{self._rank}-anomaly-{step}-{reason}.json"
        log.warning(
            "AnomalyProfilerHook: %s; profiling the next %d step(s) (profile %d of %d) into %s",
            why,
            self.steps,
            self.fired,
            self.max_profiles,
            self.output_dir / self._name,
        )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=self.steps, repeat=1),
            on_trace_ready=self._trace_ready,
            record_shapes=True,
            profile_memory=True,
            with_flops=True,
        )
        clear_bars()  # kineto prints to the terminal as it starts
        self._prof.start()

    def _advance(self) -> None:
        prof = self._prof
        assert prof is not None
        if prof.schedule(prof.step_num + 1) != prof.current_action:
            clear_bars()  # kineto prints to the terminal when recording starts or stops
        prof.step()
        if prof.current_action == torch.profiler.ProfilerAction.NONE:  # the cycle is done
            prof.stop()
            self._prof = None

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        # inside prof.step()/stop() on the training thread: only take the results
        self._ready.append(_Export(prof.profiler, self.output_dir / self._name))

    async def _hand_over(self) -> None:
        if self._ready and self._jobs is not None:
            ready, self._ready = self._ready, []
            for job in ready:
                await self._jobs.put(job)

    async def _export(self, job: _Export) -> None:
        await anyio.to_thread.run_sync(write_trace, job.profile, job.path)
        self.exported.append(job.path)
        log.info("AnomalyProfilerHook: wrote %s", job.path)
