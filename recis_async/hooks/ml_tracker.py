"""MLTrackerHook: sends ``add_to_ml_tracker`` values and the run config to an experiment tracker.

On each training ``AfterStep`` the step's ``tracked`` values are checked (names and numbers,
so bad input fails at that publish) and buffered; a :class:`~recis_async.trackers.TrackerService`
hands them to the tracker in a worker thread, batched.  Tensors arrive as
:class:`~recis_async.hostcopy.HostCopy` s and are read in that worker thread (or by a later
step once their copy is done), never by the step: ``bfloat16`` / ``float16`` values become
the tracker's float there.  ``AfterEval`` metrics are logged
under ``eval/``.  ``End.status`` decides how the run ends (MLflow: FINISHED / FAILED /
KILLED).  Other hooks send their own values with :meth:`MLTrackerHook.log_metrics`.

The run's id is in :meth:`MLTrackerHook.state_dict`, so a job resumed from a checkpoint
continues that run (MLflow, TensorBoard, JSONL alike) instead of opening a new one, and each
step is in the run once: the tracker supersedes what the earlier attempt logged after the
checkpoint (see each tracker).
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import OnError
from ..events import AfterEval, AfterLoadCheckpoint, AfterStep, End, Start
from ..hook import Hook
from ..hostcopy import HostCopy
from ..trackers import JsonlTracker, RunSpec, StepRecord, Tracker, TrackerService
from ..trackers.base import (
    RECORD_OVERHEAD,
    VALUE_OVERHEAD,
    check_metric_name,
    flatten_params,
    to_tracked_value,
    tracker_location,
    value_nbytes,
)
from ..trackers.service import DEFAULT_SEND_TIMEOUT, check_settings, default_spill_dir

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["MLTrackerHook"]


class MLTrackerHook(Hook):
    """Log tracked values and the config of a run to ``tracker`` (a
    :class:`~recis_async.trackers.JsonlTracker` under ``./ml_tracker`` by default).

    ``project`` / ``name`` name the run (MLflow experiment / run name), ``id`` names a run
    to continue, or to create under that id (for MLflow: found again by its
    ``recis_async.id`` tag).  A checkpoint holds the run's real id (:meth:`state_dict`):
    restoring it continues that run.  ``max_buffer_bytes`` bounds what waits for the
    tracker (a step publishing into a full buffer waits: backpressure, at most
    ``send_timeout`` seconds, then its record is spilled), ``flush_interval`` is the longest
    a value waits before it is sent.  A failing tracker follows
    ``on_error``; records it could not take are kept in a spill file under ``spill_dir``
    (or the system temp folder when that cannot be written).  Rank 0 only by default.

    Args:
        project: the project (MLflow experiment).
        name: the run's name.
        config: the run's parameters, flattened to ``a.b`` names.
        id: an existing run to resume.
        tracker: where records go; default a ``JsonlTracker`` under ``./ml_tracker``.
        max_buffer_bytes: bytes that may wait for the tracker before a step waits.
        flush_interval: the longest a value waits before it is sent, in seconds.
        on_error: what a failing tracker does: ``"raise"``, ``"log"`` or ``"disable"``.
        spill_dir: where records the tracker could not take are kept.
        send_timeout: the longest a ``publish`` waits for room in a full buffer, in seconds
            (60 by default); then the step's record is spilled instead (a warning says why,
            and the close raises naming the spill file and the replay command).  A stop
            request ends the wait at once: the record is kept for the close to deliver.

    Raises:
        TypeError: a ``tracker`` that is not a Tracker, a ``config`` that is not a mapping,
            a ``send_timeout`` that is not a number.
        ValueError: an invalid project or run name, parameter name, buffer size, interval,
            ``send_timeout`` or ``on_error``.
    """

    rank_zero_only = True

    def __init__(
        self,
        project: str,
        name: str,
        config: Mapping[str, Any] | None = None,
        id: str | None = None,
        tracker: Tracker | None = None,
        *,
        max_buffer_bytes: int = 8 << 20,
        flush_interval: float = 1.0,
        on_error: OnError = "raise",
        spill_dir: str | os.PathLike[str] | None = None,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
    ) -> None:
        for field, value in (("project", project), ("name", name)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"MLTrackerHook.{field}: expected a non-empty str, got {value!r}")
        if id is not None and (not isinstance(id, str) or not id):
            raise ValueError(f"MLTrackerHook.id: expected a non-empty str or None, got {id!r}")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(
                f"MLTrackerHook.config: expected a mapping or None, got {type(config).__name__}"
            )
        check_settings(
            max_buffer_bytes,
            flush_interval,
            on_error,
            owner="MLTrackerHook",
            send_timeout=send_timeout,
        )
        if tracker is None:
            tracker = JsonlTracker()
        elif not isinstance(tracker, Tracker):
            raise TypeError(
                "MLTrackerHook.tracker: expected an object with start/log/finish, "
                f"got {type(tracker).__name__}"
            )
        self.project, self.name, self.id = project, name, id
        self.config = dict(config or {})
        self.params = flatten_params(self.config, where="MLTrackerHook.config")
        self.tracker = tracker
        self.on_error = on_error  # type: ignore[misc]  # per-instance override of the default
        self._service_args: dict[str, Any] = {
            "max_buffer_bytes": max_buffer_bytes,
            "flush_interval": flush_interval,
            "on_error": on_error,
            "spill_dir": spill_dir,
            "send_timeout": send_timeout,
        }
        self._service: TrackerService | None = None
        self._names: set[str] = set()

    def __repr__(self) -> str:
        return f"<MLTrackerHook {self.project}/{self.name} -> {self.tracker!r}>"

    @property
    def state_key(self) -> str:
        return f"MLTrackerHook[{self.project}/{self.name}]"

    @property
    def service(self) -> TrackerService | None:
        """The background service once attached (its ``stats()`` are in ``bus.stats()``)."""
        return self._service

    @property
    def accepting(self) -> bool:
        """Whether :meth:`log_metrics` can take values now (attached, not closing)."""
        return self._service is not None and self._service.accepting

    def state_dict(self) -> dict[str, Any]:
        """The run's id as the tracker knows it (MLflow's run id, the JSONL / TensorBoard
        folder), so a resumed job continues the same run."""
        service = self._service
        run_id = service.run_id if service is not None else None
        return {"run_id": run_id} if run_id is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpoint's run: the run opened at start is discarded (it holds
        nothing yet) and the checkpoint's is opened before the next batch is sent."""
        run_id = state.get("run_id")
        if run_id is None:
            return
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(
                f"{self.state_key}.load_state_dict: expected a non-empty str run_id, got {run_id!r}"
            )
        self.id = run_id
        if self._service is not None:
            self._service.continue_run(run_id)

    async def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        """Return once the checkpoint's run is open, so the first step after the restore
        logs into it."""
        if self._service is not None:
            await self._service.wait_continued()

    def outputs(self) -> dict[str, str]:
        where = {"experiment tracking": tracker_location(self.tracker, self.project)}
        service = self._service
        if (
            service is not None
            and service.run_id
            and service.run_id not in where["experiment tracking"]
        ):
            where["experiment tracking"] += f" (run {service.run_id})"  # MLflow: not in the URI
        if service is not None and service.spill_files:
            where["untracked records (see read_records)"] = ", ".join(
                os.path.abspath(path) for path in service.spill_files
            )
        elif service is None or not service.stats()["logged"]:
            spill = service.spill_dir if service is not None else self._service_args["spill_dir"]
            spill_dir = os.path.abspath(spill if spill is not None else default_spill_dir())
            where["tracker spill files (only if the tracker fails)"] = spill_dir
        return where

    def attach(self, bus: HookBus) -> None:
        if self._service is not None:
            raise RuntimeError(f"{self!r} is already attached to a bus")
        run = RunSpec(project=self.project, name=self.name, run_id=self.id, params=self.params)
        self._service = TrackerService(self.tracker, run, name=self.state_key, **self._service_args)
        self._service.watch_stop(lambda: bus.stopping)  # a full buffer gives way to a stop
        bus.start_service(self._service)

    async def start(self, event: Start) -> None:
        """Wait for the tracker's start, begun when the bus started (for MLflow: its process,
        import, store and run): it then runs before the first step instead of beside the
        first steps, taking their CPU.  A failure follows ``on_error``."""
        if self._service is not None:
            await self._service.wait_started()

    def after_step(self, event: AfterStep) -> Awaitable[None] | None:
        """Sync: the step's values are checked and buffered at once; a coroutine only when the
        buffer is full (the step then waits for room: backpressure)."""
        if not event.is_train or not event.tracked:
            return None
        service = self._service
        if service is None:
            raise RuntimeError(f"{self!r} is not attached to a bus (bus.add_hook(hook) first)")
        tracked = event.tracked
        checked: dict[str, Any] | None = None
        nbytes = 0
        if type(tracked) is dict and self._names.issuperset(tracked):
            # The common step, checked here rather than in _checked (each call runs cold on
            # the step): known names, values with nothing to convert (floats; host copies of
            # real numbers, which the service's worker resolves).  The dict is fresh from the
            # collector each step, nobody else's: kept without a copy.
            payload = 0
            for value in tracked.values():
                kind = type(value)
                if kind is float:
                    continue
                if kind is not HostCopy or value.dtype.kind not in "biuf":
                    break
                if value.size != 1:
                    payload += 8 * value.size  # the float64 array it becomes
            else:
                checked = tracked
                nbytes = RECORD_OVERHEAD + payload + len(tracked) * VALUE_OVERHEAD
                nbytes += sum(map(len, tracked))
        if checked is None:
            checked, nbytes = self._checked(tracked, "AfterStep.tracked", "")
            if not checked:
                return None
        record = StepRecord(event.global_step, time.time(), checked)
        if service.put_nowait(record, nbytes):
            return None
        return service.put(record, nbytes)

    async def after_eval(self, event: AfterEval) -> None:
        if event.metrics:
            await self._put(event.global_step, event.metrics, "AfterEval.metrics", "eval/")

    def end(self, event: End) -> None:
        if self._service is not None:
            self._service.set_status(event.status)

    async def log_metrics(self, step: int, values: Mapping[str, Any], *, prefix: str = "") -> None:
        """Log ``values`` (numbers or arrays) at ``step`` through this hook's tracker.

        For other hooks (e.g. :class:`~recis_async.hooks.MetricReportHook`); waits only when
        the buffer is full.  Names get ``prefix`` and are checked like tracked values.
        """
        if type(step) is not int:
            raise TypeError(f"MLTrackerHook.log_metrics(step=...): expected int, got {step!r}")
        await self._put(step, values, "log_metrics(values)", prefix)

    async def flush(self) -> None:
        """Send every buffered value to the tracker now and wait until it took them."""
        if self._service is not None:
            await self._service.flush()

    async def _put(self, step: int, values: Mapping[str, Any], where: str, prefix: str) -> None:
        """Check ``values`` and buffer them (waiting while the buffer is full)."""
        service = self._service
        if service is None:
            raise RuntimeError(f"{self!r} is not attached to a bus (bus.add_hook(hook) first)")
        checked, nbytes = self._checked(values, where, prefix)
        if checked:
            await service.put(StepRecord(step, time.time(), checked), nbytes)

    def _checked(
        self, values: Mapping[str, Any], where: str, prefix: str
    ) -> tuple[dict[str, Any], int]:
        """``values`` checked and converted, with the bytes they count for."""
        names = self._names
        nbytes = RECORD_OVERHEAD
        checked: dict[str, Any] = {}
        for key, value in values.items():
            full = prefix + key if prefix else key
            if full not in names:
                check_metric_name(full, where=f"{where} key")
                names.add(full)
            if type(value) is not float:  # floats (the common case) need no conversion
                # a tensor's HostCopy is kept as it is: the service's worker resolves it
                value = to_tracked_value(key, value, where=where)
                nbytes += value_nbytes(value)
            checked[full] = value
            nbytes += VALUE_OVERHEAD + len(full)
        return checked, nbytes
