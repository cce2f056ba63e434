"""SummarySaverHook: TensorBoard summaries every ``save_steps`` training steps.

Numeric metrics of the step (``AfterStep.metrics``) become scalars, array metrics
histograms, and, when a model is given, every parameter a histogram under ``params/``.  The
values are copied on the step (parameters to CPU arrays, so later updates do not leak into
the summary) and written by a :class:`~recis_async.trackers.TrackerService` driving a
:class:`~recis_async.trackers.TensorBoardTracker` in a worker thread.  Metrics recorded as
tensors are not read on the step: the save step's values are read in a worker thread and the
record is handed to the writer once read.
"""

from __future__ import annotations

import functools
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._checks import positive_int, writable_dir
from ..events import AfterStep, End
from ..hook import Hook
from ..reads import ReadQueue
from ..subscription import Filters, is_train
from ..trackers import RunSpec, StepRecord, TrackerService
from ..trackers.base import check_metric_name, to_tracked_value
from ..trackers.service import DEFAULT_SEND_TIMEOUT, check_settings
from ..trackers.tensorboard import TensorBoardTracker
from ..window import has_tensor, read_values

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["SummarySaverHook"]


class SummarySaverHook(Hook):
    """Write scalars and histograms to TensorBoard event files in ``output_dir`` (rank 0).

    Args:
        save_steps: write at the steps completing ``save_steps``, ``2 * save_steps``, ...
            steps of the job (the bus's ``every_step`` filter: a resumed run keeps them).
        output_dir: where the event files go.
        model: also write a histogram of every parameter.
        max_buffer_bytes: bytes of summaries that may wait for the writer.
        send_timeout: the longest a save step waits for room when ``max_buffer_bytes`` wait
            already, in seconds (60 by default); then its summary is spilled instead (a
            warning says why, and the close raises naming the spill file and the replay
            command).  A stop request ends the wait at once: the summary is kept for the
            close to write.

    Raises:
        TypeError: a ``save_steps`` that is not an int, a ``model`` that is not a module, a
            ``send_timeout`` that is not a number.
        ValueError: a ``save_steps`` below 1, an unwritable ``output_dir``, a bad buffer size
            or ``send_timeout``.
    """

    rank_zero_only = True

    def __init__(
        self,
        save_steps: int,
        output_dir: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None = None,
        max_buffer_bytes: int = 64 << 20,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
    ) -> None:
        positive_int(type(self).__name__, "save_steps", save_steps)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                "SummarySaverHook.model: expected a torch.nn.Module or None, "
                f"got {type(model).__name__}"
            )
        check_settings(
            max_buffer_bytes, 0.0, "raise", owner="SummarySaverHook", send_timeout=send_timeout
        )
        path = writable_dir("SummarySaverHook", "output_dir", output_dir)
        self.tracker = TensorBoardTracker(path, subdir=False)
        self.save_steps = save_steps
        self.model = model
        self.max_buffer_bytes = max_buffer_bytes
        self.send_timeout = float(send_timeout)
        # the steps completing save_steps, 2 * save_steps, ... steps, counted by the bus
        self.subscription_filters = {"after_step": Filters(every_step=save_steps, when=is_train)}
        self._names: set[str] = set()
        self._service: TrackerService | None = None
        self._reads = ReadQueue("SummarySaverHook.read", on_error=self.on_error)

    @property
    def service(self) -> TrackerService | None:
        return self._service

    def outputs(self) -> dict[str, str]:
        return {"TensorBoard summaries": str(self.tracker.log_dir.absolute())}

    def attach(self, bus: HookBus) -> None:
        if self._service is not None:
            raise RuntimeError("SummarySaverHook is already attached to a bus")
        self._service = TrackerService(
            self.tracker,
            RunSpec(project="summary", name="summary"),
            name="SummarySaverHook",
            max_buffer_bytes=self.max_buffer_bytes,
            flush_interval=0.0,
            on_error=self.on_error,
            send_timeout=self.send_timeout,
        )
        self._service.watch_stop(lambda: bus.stopping)  # a full buffer gives way to a stop
        bus.start_service(self._service)
        self._reads.start(bus)

    async def after_step(self, event: AfterStep) -> None:
        if self._service is None:
            return
        for key in event.metrics:
            if key not in self._names:
                check_metric_name(key, where="AfterStep.metrics key")
                self._names.add(key)
        params: dict[str, Any] = {}
        if self.model is not None:
            # a float32 copy on the parameter's device (the next optimizer step must not
            # reach it), read with the metrics in a worker thread: no read on the step
            for name, param in self.model.named_parameters():
                params[f"params/{name}"] = param.detach().to(dtype=torch.float32, copy=True)
        if params or has_tensor(event.metrics.values()) or self._reads.busy:  # off the step
            await self._reads.put(
                functools.partial(_read, params, event.metrics),
                functools.partial(self._record_read, event.global_step, time.time()),
            )
        else:
            await self._record(event.global_step, time.time(), params, event.metrics)

    async def _record_read(
        self, step: int, when: float, read: tuple[dict[str, Any], dict[str, Any]]
    ) -> None:
        await self._record(step, when, *read)

    async def _record(
        self, step: int, when: float, params: dict[str, Any], metrics: dict[str, Any]
    ) -> None:
        assert self._service is not None
        values: dict[str, Any] = {
            key: to_tracked_value(key, value, where="AfterStep.metrics")
            for key, value in metrics.items()
        }
        values.update(params)
        values = {
            k: v for k, v in values.items() if not (isinstance(v, np.ndarray) and v.size == 0)
        }
        if values:
            await self._service.put(StepRecord(step, when, values))

    def end(self, event: End) -> None:
        if self._service is not None:
            self._service.set_status(event.status)


def _read(
    params: dict[str, torch.Tensor], metrics: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parameters' copies as numpy arrays of their shape, and the metrics, on the host
    (blocking: the worker thread's job)."""
    return {k: v.numpy(force=True) for k, v in params.items()}, read_values(metrics)
