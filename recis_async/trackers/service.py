"""TrackerService: feeds a blocking :class:`Tracker` from the event loop without blocking it.

Hooks ``await service.put(record)``; records wait in a buffer bounded in bytes (``put``
waits when it is full: that is the backpressure) and a background task hands everything
buffered to ``tracker.log`` in a worker thread, at most every ``flush_interval`` seconds
or sooner when the buffer is half full.  The tracker is started in the worker thread when
the service runs and finished with the run's status when the bus closes.

Failures follow ``on_error``: ``"raise"`` ends the service with :class:`TrackerError`
(the bus reports it as ``HookError`` at the next publish or at close, and later ``put``
calls raise); ``"log"`` logs and carries on; ``"disable"`` logs and stops tracking.  A batch
the tracker refused, or that is still buffered when the close deadline passes, is written
to a spill file of :class:`StepRecord` lines (readable with
:func:`~recis_async.trackers.read_records`, replayable with ``tracker.log``), never dropped.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

from .._checks import on_error as check_on_error
from ..console import log_failure
from ..errors import OnError, TrackerError
from ..events import EndStatus
from .base import RunSpec, StepRecord, Tracker, encode_value, record_nbytes

__all__ = ["TrackerService", "check_settings"]

logger = logging.getLogger(__name__)

_CALL_WAIT_S = 1.0  # how long close waits for an abandoned tracker.log call to end


def check_settings(
    max_buffer_bytes: object, flush_interval: object, on_error: object, *, owner: str
) -> None:
    """Validate service settings, naming ``owner`` in the error (used by hooks' constructors)."""
    if type(max_buffer_bytes) is not int or max_buffer_bytes <= 0:
        raise ValueError(
            f"{owner}.max_buffer_bytes: expected a positive int, got {max_buffer_bytes!r}"
        )
    if (
        isinstance(flush_interval, bool)
        or not isinstance(flush_interval, int | float)
        or not flush_interval >= 0
    ):
        raise ValueError(f"{owner}.flush_interval: expected seconds >= 0, got {flush_interval!r}")
    check_on_error(owner, "on_error", on_error)


class _Call:
    """A tracker call run in a worker thread, whose outcome close can still learn after
    abandoning it (``done`` is set when it ended, ``ok`` when it returned)."""

    __slots__ = ("fn", "done", "ok")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.ok = False

    def __call__(self, *args: Any) -> Any:
        try:
            result = self.fn(*args)
            self.ok = True
            return result
        finally:
            self.done.set()


def default_spill_dir() -> Path:
    """Where tracker records that could not be delivered go unless ``spill_dir`` is given."""
    return Path(tempfile.gettempdir(), "recis_async_spill")


class TrackerService:
    """Background flusher between hooks and one tracker (implements the bus's ``Service``).

    Args:
        tracker: where records go.
        run: the run to start (:class:`~recis_async.trackers.RunSpec`).
        name: the service's name.
        max_buffer_bytes: bytes that may wait before ``put`` waits (backpressure).
        flush_interval: the longest a record waits before it is sent, in seconds.
        on_error: what a failing tracker does: ``"raise"``, ``"log"`` or ``"disable"``.
        spill_dir: where records the tracker could not take are kept.
        default_status: the run's status at close if ``End`` never came.

    Raises:
        ValueError: a buffer size, interval or ``on_error`` out of range.
    """

    def __init__(
        self,
        tracker: Tracker,
        run: RunSpec,
        *,
        name: str = "tracker",
        max_buffer_bytes: int = 8 << 20,
        flush_interval: float = 1.0,
        on_error: OnError = "raise",
        spill_dir: str | os.PathLike[str] | None = None,
        default_status: EndStatus = "cancelled",
    ) -> None:
        check_settings(max_buffer_bytes, flush_interval, on_error, owner="TrackerService")
        self.name = name
        self.tracker = tracker
        self.run_spec = run
        self.max_buffer_bytes = max_buffer_bytes
        self.flush_interval = float(flush_interval)
        self.on_error: OnError = on_error
        self.spill_dir = Path(spill_dir) if spill_dir is not None else default_spill_dir()
        self.spill_path: Path | None = None
        self._status: EndStatus = default_status
        self._pending: deque[tuple[StepRecord, int]] = deque()
        self._pending_bytes = 0
        self._inflight: list[StepRecord] = []
        self._inflight_bytes = 0
        self._wakeup: anyio.Event | None = None
        self._done: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        self._closing = False
        self._flush_requested = False
        self._started = False
        self._start_tried: anyio.Event | None = None  # set once tracker.start has ended
        self._failure: BaseException | None = None
        self._disabled = False
        self._limiter = anyio.CapacityLimiter(1)
        self._call: _Call | None = None  # the latest tracker.log call
        self._encoder = msgspec.json.Encoder(enc_hook=encode_value)
        self._counts = {
            "records": 0,
            "logged": 0,
            "batches": 0,
            "errors": 0,
            "spilled": 0,
            "dropped": 0,
        }

    # ----------------------------------------------------------------- producer side

    def set_status(self, status: EndStatus) -> None:
        """The status the run finishes with (from ``End.status``)."""
        self._status = status

    @property
    def accepting(self) -> bool:
        """Whether :meth:`put` takes records (not closing, not failed)."""
        return not self._closing and self._failure is None

    async def put(self, record: StepRecord, nbytes: int | None = None) -> None:
        """Buffer one record; waits while the buffer holds ``max_buffer_bytes``.

        ``nbytes`` is the record's :func:`~recis_async.trackers.base.record_nbytes` when the
        caller computed it already."""
        if nbytes is None:
            nbytes = record_nbytes(record)
        while True:
            self._check_open()
            if self._disabled:
                self._counts["dropped"] += 1
                return
            held = self._pending_bytes + self._inflight_bytes
            if held == 0 or held + nbytes <= self.max_buffer_bytes:
                break
            await self._wait()
        was_empty = not self._pending
        self._pending.append((record, nbytes))
        self._pending_bytes += nbytes
        self._counts["records"] += 1
        # Wake the sender only when it has something new to decide: the first record of a
        # batch, or a half-full buffer.  Waking it for every record would cost the step a
        # task switch each time while the batch fills.
        if was_empty or self._pending_bytes >= self.max_buffer_bytes // 2:
            self._notify()

    def _check_open(self) -> None:
        if self._failure is not None:
            raise TrackerError(
                f"{self.name}: the tracker failed earlier ({self._failure!r}); "
                f"undelivered records are in {self.spill_path}"
            ) from self._failure
        if self._closing:
            raise RuntimeError(f"{self.name}: put after close")

    def _notify(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    async def _wait(self) -> None:
        if self._wakeup is None:
            self._wakeup = anyio.Event()
        await self._wakeup.wait()

    # ----------------------------------------------------------------- service side

    async def run(self) -> None:
        if self._done is None:
            self._done = anyio.Event()
        try:
            # The bus shields services from the body's cancellation; aclose cancels this scope
            # when its deadline passes.
            with anyio.CancelScope() as self._scope:
                await self._serve()
        finally:
            self._done.set()
            self._notify()

    async def wait_started(self) -> bool:
        """Wait until ``tracker.start`` (run when the service starts) has ended; return whether
        it succeeded (a failure follows ``on_error`` as usual).  Returns at once once closing."""
        if self._start_tried is None:
            self._start_tried = anyio.Event()
        if not self._closing:
            await self._start_tried.wait()
        return self._started

    async def _serve(self) -> None:
        if self._start_tried is None:
            self._start_tried = anyio.Event()
        try:
            await self._in_thread(self.tracker.start, self.run_spec)
        except Exception as exc:
            self._counts["errors"] += 1
            self._start_tried.set()
            await self._give_up(exc, "start")
            if self.on_error == "raise":
                raise TrackerError(f"{self.name}: tracker.start failed: {exc!r}") from exc
            return
        self._started = True
        self._start_tried.set()
        while True:
            while not self._pending and not self._closing:
                await self._wait()
            if not self._pending:
                break
            if not self._urgent() and self.flush_interval > 0:
                with anyio.move_on_after(self.flush_interval):
                    while not self._urgent():
                        await self._wait()
            self._flush_requested = False
            batch = [record for record, _ in self._pending]
            self._inflight, self._inflight_bytes = batch, self._pending_bytes
            self._pending.clear()
            self._pending_bytes = 0
            self._call = call = _Call(self.tracker.log)
            try:
                await self._in_thread(call, batch)
            except Exception as exc:
                self._counts["errors"] += 1
                if self.on_error == "log":
                    await self._spill(batch)
                    self._clear_inflight()
                    log_failure(
                        logger,
                        self._counts["errors"],
                        exc,
                        "%s: tracker.log failed; %d records spilled to %s",
                        self.name,
                        len(batch),
                        self.spill_path,
                    )
                    continue
                await self._give_up(exc, "log", batch)
                self._clear_inflight()
                if self.on_error == "raise":
                    raise TrackerError(f"{self.name}: tracker.log failed: {exc!r}") from exc
                return
            self._counts["logged"] += len(batch)
            self._counts["batches"] += 1
            self._clear_inflight()
        try:
            await self._in_thread(self.tracker.finish, self._status)
        except Exception as exc:
            self._counts["errors"] += 1
            if self.on_error == "raise":
                raise TrackerError(f"{self.name}: tracker.finish failed: {exc!r}") from exc
            logger.error("%s: tracker.finish failed", self.name, exc_info=exc)

    def _urgent(self) -> bool:
        """Send now rather than wait for more records."""
        return (
            self._closing
            or self._flush_requested
            or self._pending_bytes >= self.max_buffer_bytes // 2
        )

    async def flush(self) -> None:
        """Send everything buffered now and return once the tracker has taken it (or the
        service stopped: failures are reported as usual)."""
        target = self._counts["records"]
        self._flush_requested = True
        self._notify()
        while self._counts["logged"] + self._counts["spilled"] < target and not (
            self._failure or self._disabled or (self._done is not None and self._done.is_set())
        ):
            await self._wait()

    def _clear_inflight(self) -> None:
        self._inflight, self._inflight_bytes = [], 0
        self._notify()

    async def _give_up(self, exc: Exception, call: str, failed: Sequence[Any] = ()) -> None:
        """The tracker is unusable: stop accepting records, then keep the failed batch and
        what is buffered safe.  The state changes before the first await, so no record
        published after the failure was counted can slip into the buffer."""
        if self.on_error == "raise":
            self._failure = exc
        else:
            self._disabled = True
        rest = [*failed, *(record for record, _ in self._pending)]
        self._pending.clear()
        self._pending_bytes = 0
        if rest:
            await self._spill(rest)
        if self.on_error != "raise":
            logger.error(
                "%s: tracker.%s failed; tracking is disabled, buffered records are in %s and "
                "later records are dropped",
                self.name,
                call,
                self.spill_path,
                exc_info=exc,
            )
        self._notify()
        if self._started:
            try:
                await self._in_thread(self.tracker.finish, "failed")
            except Exception:
                logger.warning(
                    "%s: tracker.finish after a failure also failed", self.name, exc_info=True
                )

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(
            fn, *args, abandon_on_cancel=True, limiter=self._limiter
        )

    async def _spill(self, records: list[StepRecord], suffix: str = "") -> None:
        if not records:
            return
        if self.spill_path is None:
            self.spill_path = self.spill_dir / (
                f"{self.name.replace('/', '_')}-{os.getpid()}-{secrets.token_hex(4)}.jsonl"
            )
        path = self.spill_path.with_suffix(f"{suffix}.jsonl") if suffix else self.spill_path
        buf = bytearray()
        for record in records:
            self._encoder.encode_into(record, buf, -1)
            buf += b"\n"

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as fh:
                fh.write(buf)
                fh.flush()
                os.fsync(fh.fileno())

        # Our own limiter is held by an abandoned tracker call after a timeout; use the default.
        await anyio.to_thread.run_sync(write)
        self._counts["spilled"] += len(records)
        logger.warning("%s: %d tracker records written to %s", self.name, len(records), path)

    async def aclose(self, deadline: float) -> None:
        """Deliver what is buffered, finish the run, and return by ``deadline``.

        Cancelled (a second stop signal), it still spills what it holds before the
        cancellation propagates."""
        self._closing = True
        self._notify()
        if self._done is None:
            self._done = anyio.Event()
        error: Exception | None = None
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await self._done.wait()
        finally:
            if not self._done.is_set() and self._scope is not None:
                self._scope.cancel()  # stop run() whatever happened to aclose
            with anyio.CancelScope(shield=True):
                error = await self._keep_leftovers()
        if error is not None:
            raise error

    async def _keep_leftovers(self) -> Exception | None:
        """Spill what run() did not deliver; return the error close reports, if any."""
        assert self._done is not None
        timed_out = not self._done.is_set()
        pending = [record for record, _ in self._pending]
        inflight = list(self._inflight)
        if not timed_out and not pending and not inflight:
            return None
        self._pending.clear()
        self._pending_bytes = 0
        self._inflight, self._inflight_bytes = [], 0
        await self._spill(pending)
        call = self._call
        if inflight and call is not None:
            # The abandoned tracker call may be writing right now: let it end (briefly) so
            # its records are known delivered, rather than spilled and then also stored.
            await anyio.to_thread.run_sync(call.done.wait, _CALL_WAIT_S)
            if call.done.is_set() and call.ok:
                self._counts["logged"] += len(inflight)
                inflight = []
        # Records in a tracker call still running may yet land: keep them apart so a replay
        # can be checked against the store instead of duplicating them blindly.
        await self._spill(inflight, suffix=".inflight")
        reason = "did not finish by the close deadline" if timed_out else "stopped early"
        error = TimeoutError if timed_out else TrackerError
        return error(
            f"{self.name}: the tracker {reason}; {len(pending)} unsent records spilled to "
            f"{self.spill_path}"
            + (
                f", {len(inflight)} in-flight records (delivery unknown) beside it"
                if inflight
                else ""
            )
        )

    def stats(self) -> Mapping[str, Any]:
        return {
            **self._counts,
            "queued_bytes": self._pending_bytes + self._inflight_bytes,
            "queued_records": len(self._pending) + len(self._inflight),
            "spill_path": str(self.spill_path) if self.spill_path else None,
        }
