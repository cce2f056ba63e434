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

A ``put`` that finds the buffer full waits for room at most ``send_timeout`` seconds (60 by
default, as the trace writer's ``send``): a tracker hung that long (a ``SubprocessTracker``
call runs up to its ``call_timeout``, 300 s; an in-process one forever) is not going to take
it soon, so the record is spilled instead, with the reason in a warning, and close raises
naming the spill file and the replay command.  Nothing is dropped.

A ``put`` waiting for room does not wait past a stop request (:meth:`TrackerService.watch_stop`:
the hooks pass their bus's stop event): its record is then kept for the close, which delivers
it within the bus's ``flush_timeout`` like everything buffered (a stop says nothing about the
tracker: spilling there would turn a Ctrl-C that met a slow tracker into a replay owed).  What
is kept so is bounded: past one more ``max_buffer_bytes`` (a loop running on after its stop
while the tracker hangs) a record is spilled at once, with the reason, and close reports it.

Close is idempotent and reports a failure once: a later ``aclose`` returns quietly.  A close
cut short by a cancellation (a second stop signal) spills what it holds before the
cancellation propagates, and the error it could not raise -- which names the spill files and
how to replay them -- is handed to the bus by :meth:`TrackerService.take_close_error`, so the
bus's own error names them too.
"""

from __future__ import annotations

import logging
import os
import secrets
import shlex
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

from .._checks import on_error as check_on_error
from .._checks import positive_number
from ..console import log_failure
from ..errors import OnError, TrackerError
from ..events import EndStatus
from ..service import CloseOnce, first_of
from .base import (
    RunSpec,
    StepRecord,
    Tracker,
    encode_value,
    record_nbytes,
    resolve_records,
    tracker_location,
    tracker_target,
)
from .jsonl import write_whole

__all__ = ["DEFAULT_SEND_TIMEOUT", "TrackerService", "check_settings"]

logger = logging.getLogger(__name__)

_CALL_WAIT_S = 1.0  # how long close waits for an abandoned tracker.log call to end
#: seconds a ``put`` waits for room in a full buffer before its record is spilled instead (the
#: trace writer's ``send_timeout`` default too): a tracker stalled this long is not going to
#: take it soon
DEFAULT_SEND_TIMEOUT = 60.0
_REPLAY = "python -m recis_async.trackers.replay"


def check_settings(
    max_buffer_bytes: object,
    flush_interval: object,
    on_error: object,
    *,
    owner: str,
    send_timeout: object = DEFAULT_SEND_TIMEOUT,
) -> None:
    """Validate service settings, naming ``owner`` in the error (used by hooks' constructors).

    ``send_timeout`` is checked as the trace writer's is: a finite number of seconds > 0
    (``TypeError`` for another type, ``ValueError`` out of range)."""
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
    positive_number(owner, "send_timeout", send_timeout)


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
        send_timeout: the longest a :meth:`put` waits for room in a full buffer, in seconds;
            then the record is spilled instead (a warning says why; close raises naming the
            file).  Once a stop is requested (:meth:`watch_stop`) it waits no more: the record
            is kept for close to deliver.

    Raises:
        TypeError: a ``send_timeout`` that is not a number.
        ValueError: a buffer size, interval, ``send_timeout`` or ``on_error`` out of range.
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
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
    ) -> None:
        check_settings(
            max_buffer_bytes,
            flush_interval,
            on_error,
            owner="TrackerService",
            send_timeout=send_timeout,
        )
        self.name = name
        self.tracker = tracker
        self.run_spec = run
        self.max_buffer_bytes = max_buffer_bytes
        self.flush_interval = float(flush_interval)
        self.send_timeout = float(send_timeout)
        self.on_error: OnError = on_error
        self.spill_dir = Path(spill_dir) if spill_dir is not None else default_spill_dir()
        self.spill_path: Path | None = None
        #: spill files written so far (unsent records; ``*.inflight.jsonl``: delivery unknown)
        self.spill_files: list[Path] = []
        #: the tracker's own id of the run once started (MLflow's run id, the JSONL folder)
        self.run_id: str | None = None
        self._spill_name = ""
        self._reopen: str | None = None  # a run to continue instead of the one started
        self._reopened: anyio.Event | None = None
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
        self._stopping: Callable[[], anyio.Event] | None = None  # the bus's stop event
        self._kept_at_stop = 0  # records kept for the close past the buffer's bound
        self._no_room: list[Path] = []  # where records that found no room after a stop went
        self._timed_out: list[Path] = []  # where records that waited send_timeout went
        self._closer = CloseOnce()
        self._unreported: Exception | None = None  # what a close cut short could not raise
        self._counts = {
            "records": 0,
            "logged": 0,
            "batches": 0,
            "errors": 0,
            "spilled": 0,
            "dropped": 0,
            "lost": 0,
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

        The wait ends after ``send_timeout`` seconds: the record is then spilled instead (a
        warning says why, and close raises naming the file and the replay command).  It ends
        as soon as a stop was requested (:meth:`watch_stop`), and the record is then kept for
        the close to deliver: the step need not wait for the tracker.  Records kept so are
        bounded by another ``max_buffer_bytes``; past it a record is spilled at once (a
        warning says why, and close raises naming the file).

        ``nbytes`` is the record's :func:`~recis_async.trackers.base.record_nbytes` when the
        caller computed it already."""
        if nbytes is None:
            nbytes = record_nbytes(record)
        if self.put_nowait(record, nbytes):
            return
        give_up = anyio.current_time() + self.send_timeout
        while True:
            stopping = None if self._stopping is None else self._stopping()
            if stopping is not None and stopping.is_set():
                await self._keep_for_close(record, nbytes)
                return
            left = give_up - anyio.current_time()
            if left <= 0:
                held = self._pending_bytes + self._inflight_bytes
                why = (
                    f"waited send_timeout={self.send_timeout:g}s for room: the tracker took "
                    f"nothing in that time ({held} bytes wait for it, "
                    f"max_buffer_bytes={self.max_buffer_bytes})"
                )
                await self._spill_instead(record, why, self._timed_out)
                return
            if self._wakeup is None:
                self._wakeup = anyio.Event()
            with anyio.move_on_after(left):
                await first_of(self._wakeup, stopping)
            if self.put_nowait(record, nbytes):
                return

    def watch_stop(self, stopping: Callable[[], anyio.Event]) -> None:
        """Make a :meth:`put` waiting for room stop waiting, and keep its record for close, as
        soon as the event ``stopping()`` returns is set (a hook passes its bus's
        :attr:`~recis_async.HookBus.stopping`; a callable, as the bus makes its event only
        when entered)."""
        self._stopping = stopping

    async def _keep_for_close(self, record: StepRecord, nbytes: int) -> None:
        """A stop was requested and ``record`` found no room: buffer it beyond the bound for
        the close to deliver, up to another ``max_buffer_bytes``; past that, spill it now."""
        held = self._pending_bytes + self._inflight_bytes
        if held + nbytes <= 2 * self.max_buffer_bytes:
            if not self._kept_at_stop:
                logger.info(
                    "%s: a stop was requested while the tracker's buffer was full (%d bytes "
                    "wait for it): records that find no room are kept for the close to deliver",
                    self.name,
                    held,
                )
            self._kept_at_stop += 1
            self._append(record, nbytes)
            return
        why = (
            f"a stop was requested and {held} bytes already wait for the close to deliver "
            f"them (max_buffer_bytes={self.max_buffer_bytes}, and as much again kept at the "
            "stop): the tracker is not keeping up"
        )
        await self._spill_instead(record, why, self._no_room)

    async def _spill_instead(self, record: StepRecord, why: str, into: list[Path]) -> None:
        """Spill ``record``, which found no room, now (shielded: a cancellation cannot lose
        it); log why; note its file in ``into`` for close to report."""
        logger.warning(
            "%s: the record of step %d is spilled instead of buffered: %s",
            self.name,
            record.step,
            why,
        )
        self._counts["records"] += 1
        with anyio.CancelScope(shield=True):  # counted once it is in the file
            path = await self._spill([record])
        if path is not None:
            into.append(path)

    def put_nowait(self, record: StepRecord, nbytes: int) -> bool:
        """:meth:`put` when there is room: buffer the record (or drop it, once disabled) and
        return true; false, buffering nothing, while the buffer is too full (then
        ``await put``).  Raises as :meth:`put` does."""
        if self._failure is not None or self._closing:
            self._check_open()  # raises
        if self._disabled:
            self._counts["dropped"] += 1
            return True
        held = self._pending_bytes + self._inflight_bytes
        if held and held + nbytes > self.max_buffer_bytes:
            return False
        self._append(record, nbytes)
        return True

    def _append(self, record: StepRecord, nbytes: int) -> None:
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
                f"undelivered records are in {self._spill_text()}"
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

    def continue_run(self, run_id: str) -> None:
        """Continue the run ``run_id`` (a resumed job's, from its checkpoint) instead of the
        one opened at start: before the next batch is sent, the run opened at start is
        discarded (or finished, if the tracker cannot discard) and ``run_id`` is opened."""
        if run_id == self.run_id and self._started:
            return
        self._reopen = run_id
        if self._reopened is None or self._reopened.is_set():
            self._reopened = anyio.Event()
        self._flush_requested = True
        self._notify()

    async def wait_continued(self) -> None:
        """Wait until :meth:`continue_run` took effect (or the service stopped)."""
        while self._reopen is not None and not self._stopped():
            await self._wait()

    def _stopped(self) -> bool:
        return bool(
            self._failure or self._disabled or (self._done is not None and self._done.is_set())
        )

    async def _open(self, run: RunSpec) -> bool:
        """``tracker.start(run)``; a failure follows ``on_error`` (returns False to stop)."""
        try:
            await self._in_thread(self.tracker.start, run)
        except Exception as exc:
            self._counts["errors"] += 1
            self._started = False
            assert self._start_tried is not None
            self._start_tried.set()
            await self._give_up(exc, "start")
            if self.on_error == "raise":
                raise TrackerError(f"{self.name}: tracker.start failed: {exc!r}") from exc
            return False
        self.run_spec = run
        run_id = getattr(self.tracker, "run_id", None)
        self.run_id = run_id if isinstance(run_id, str) else run.run_id
        self._started = True
        assert self._start_tried is not None
        self._start_tried.set()
        logger.info(
            "%s: tracking run %s (%s) in %s",
            self.name,
            self.run_id or "?",
            "continued" if run.run_id else "new",
            tracker_location(self.tracker, run.project),
        )
        return True

    async def _switch_run(self) -> bool:
        """Handle :meth:`continue_run`: leave the run opened at start, open the asked one."""
        run_id, self._reopen = self._reopen, None
        assert run_id is not None
        if self._started and run_id != self.run_id:
            discard = getattr(self.tracker, "discard", None)
            try:
                if callable(discard):
                    await self._in_thread(discard)
                else:
                    await self._in_thread(self.tracker.finish, "cancelled")
            except Exception:
                logger.warning(
                    "%s: leaving run %s for %s failed",
                    self.name,
                    self.run_id,
                    run_id,
                    exc_info=True,
                )
            self._started = False
        run = msgspec.structs.replace(self.run_spec, run_id=run_id)
        ok = self._started or await self._open(run)
        if self._reopened is not None:
            self._reopened.set()
        self._notify()
        return ok

    async def _serve(self) -> None:
        if self._start_tried is None:
            self._start_tried = anyio.Event()
        if not await self._open(self.run_spec):
            return
        while True:
            while not self._pending and not self._closing and self._reopen is None:
                await self._wait()
            if self._reopen is not None:
                if not await self._switch_run():
                    return
                continue
            if not self._pending:
                break
            if not self._urgent() and self.flush_interval > 0:
                with anyio.move_on_after(self.flush_interval):
                    while not self._urgent():
                        await self._wait()
            if self._reopen is not None:
                continue
            self._flush_requested = False
            batch = [record for record, _ in self._pending]
            self._inflight, self._inflight_bytes = batch, self._pending_bytes
            self._pending.clear()
            self._pending_bytes = 0
            self._call = call = _Call(self._log)
            try:
                await self._in_thread(call, batch)
            except Exception as exc:
                self._counts["errors"] += 1
                # A tracker that kept a whole prefix of the batch says how many records.
                kept = getattr(exc, "delivered", 0)
                kept = kept if type(kept) is int and 0 < kept <= len(batch) else 0
                self._counts["logged"] += kept
                batch = batch[kept:]
                doubt = ".inflight" if getattr(exc, "in_doubt", False) is True else ""
                if self.on_error == "log":
                    await self._spill(batch, doubt)
                    self._clear_inflight()
                    log_failure(
                        logger,
                        self._counts["errors"],
                        exc,
                        "%s: tracker.log failed; %d records kept in %s",
                        self.name,
                        len(batch),
                        self._spill_text(),
                    )
                    continue
                await self._give_up(exc, "log", batch, doubt)
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

    def _log(self, records: Sequence[StepRecord]) -> None:
        """``tracker.log``, in the worker thread, of the records with their host copies
        resolved (waiting for the device there, never on the step)."""
        self.tracker.log(resolve_records(records))

    def _urgent(self) -> bool:
        """Send now rather than wait for more records."""
        return (
            self._closing
            or self._flush_requested
            or self._reopen is not None
            or self._pending_bytes >= self.max_buffer_bytes // 2
        )

    async def flush(self) -> None:
        """Send everything buffered now and return once the tracker has taken it (or the
        service stopped: failures are reported as usual)."""
        target = self._counts["records"]
        self._flush_requested = True
        self._notify()
        while (
            self._counts["logged"] + self._counts["spilled"] + self._counts["lost"] < target
            and not self._stopped()
        ):
            await self._wait()

    def _clear_inflight(self) -> None:
        self._inflight, self._inflight_bytes = [], 0
        self._notify()

    async def _give_up(
        self, exc: Exception, call: str, failed: Sequence[StepRecord] = (), doubt: str = ""
    ) -> None:
        """The tracker is unusable: stop accepting records, then keep the failed batch
        (spilled with the suffix ``doubt`` when its delivery is unknown) and what is
        buffered safe.  The state changes before the first await, so no record published
        after the failure was counted can slip into the buffer."""
        if self.on_error == "raise":
            self._failure = exc
        else:
            self._disabled = True
        rest = [record for record, _ in self._pending]
        self._pending.clear()
        self._pending_bytes = 0
        if doubt:
            await self._spill(list(failed), doubt)
        else:
            rest[:0] = failed
        await self._spill(rest)
        if self.on_error != "raise":
            logger.error(
                "%s: tracker.%s failed; tracking is disabled, buffered records are in %s and "
                "later records are dropped",
                self.name,
                call,
                self._spill_text(),
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

    def _spill_text(self) -> str:
        if not self.spill_files:
            return "no spill file"
        return ", ".join(str(path) for path in self.spill_files)

    def _spill_places(self) -> list[Path]:
        """Where a spill may go: ``spill_dir``, then the system temp folder's spill dir."""
        places = [self.spill_dir]
        fallback = default_spill_dir()
        if fallback.resolve() != self.spill_dir.resolve():
            places.append(fallback)
        return places

    def _run_meta(self) -> bytes:
        """The sidecar a replay reads to find the run (never a credential)."""
        return msgspec.json.encode(
            {
                "tracker": type(self.tracker).__name__,
                "project": self.run_spec.project,
                "name": self.run_spec.name,
                "run_id": self.run_id,
                **tracker_target(self.tracker),
            }
        )

    async def _spill(self, records: list[StepRecord], suffix: str = "") -> Path | None:
        """Append ``records`` to the spill file (``suffix``: ``.inflight`` for records whose
        delivery is unknown), in ``spill_dir`` or else the system temp folder; a place that
        fails is left as it was (no partial or empty file).  Records no place took are
        counted ``lost`` and logged at once with their steps and the reasons."""
        if not records:
            return None
        if not self._spill_name:
            self._spill_name = f"{self.name.replace('/', '_')}-{os.getpid()}-{secrets.token_hex(4)}"
        meta = self._run_meta()
        name = f"{self._spill_name}{suffix}.jsonl"

        def write() -> tuple[Path | None, list[str]]:
            # encoded here, in the worker thread: host copies are resolved by the encoder
            encoder = msgspec.json.Encoder(enc_hook=encode_value)
            buf = bytearray()
            for record in records:
                encoder.encode_into(record, buf, -1)
                buf += b"\n"
            data = bytes(buf)
            reasons = []
            for place in self._spill_places():
                path = place / name
                try:
                    place.mkdir(parents=True, exist_ok=True)
                    _write_spill(path, data, place / f"{self._spill_name}.run.json", meta)
                except OSError as exc:
                    reasons.append(f"{exc.strerror or exc!r} on {path}")
                    continue
                return path, reasons
            return None, reasons

        # Our own limiter is held by an abandoned tracker call after a timeout; use the default.
        path, reasons = await anyio.to_thread.run_sync(write)
        if path is None:
            self._counts["lost"] += len(records)
            steps = sorted({record.step for record in records})
            logger.error(
                "%s: %d tracker records of steps %d-%d are LOST: no spill file could be "
                "written (%s)",
                self.name,
                len(records),
                steps[0],
                steps[-1],
                "; ".join(reasons),
            )
            return None
        if reasons:
            logger.warning("%s: spilling elsewhere: %s", self.name, "; ".join(reasons))
        if path not in self.spill_files:
            self.spill_files.append(path)
        if not suffix:
            self.spill_path = path
        self._counts["spilled"] += len(records)
        logger.warning("%s: %d tracker records written to %s", self.name, len(records), path)
        return path

    async def aclose(self, deadline: float) -> None:
        """Deliver what is buffered, finish the run, and return by ``deadline``.

        At the deadline a tracker call still running is cut (``tracker.abort()`` where the
        tracker has one: a child process is killed), so nothing outlives the close.
        Cancelled (a second stop signal), it still spills what it holds before the
        cancellation propagates; the error it could not raise is kept for
        :meth:`take_close_error` (the bus names it in its own error) or the next ``aclose``.

        Idempotent, and a failure is reported once: the close runs once; a later ``aclose``
        (or one called while the first is under way, which it waits for until ``deadline``)
        raises only what no earlier one reported."""
        await self._closer(self._close, deadline, self.take_close_error)

    def take_close_error(self) -> Exception | None:
        """The error the close found that no ``aclose`` has raised yet, or None; it counts
        as reported from then on.  The bus calls it when it cut a close short (a second stop
        signal, or an overrun deadline): a cancelled ``aclose`` cannot raise it, and the
        user reading the bus's error must still find the spill files and how to replay
        them."""
        error, self._unreported = self._unreported, None
        return error

    async def _close(self, deadline: float) -> None:
        self._closing = True
        self._notify()
        if self._done is None:
            self._done = anyio.Event()
        cancelled = False
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await self._done.wait()
        except anyio.get_cancelled_exc_class():
            cancelled = True
            raise
        finally:
            if not self._done.is_set():
                abort = getattr(self.tracker, "abort", None)
                if callable(abort):
                    try:
                        abort()
                    except Exception:
                        logger.warning("%s: tracker.abort failed", self.name, exc_info=True)
                if self._scope is not None:
                    self._scope.cancel()  # stop run() whatever happened to aclose
            with anyio.CancelScope(shield=True):
                self._unreported = await self._keep_leftovers(cancelled)

    async def _keep_leftovers(self, cancelled: bool = False) -> Exception | None:
        """Spill what run() did not deliver; return the error close reports, if any."""
        assert self._done is not None
        timed_out = not self._done.is_set()
        pending = [record for record, _ in self._pending]
        inflight = list(self._inflight)
        if not timed_out and not pending and not inflight:
            if self._no_room or self._timed_out:
                return TrackerError(f"{self.name}:{self._no_room_text()}")
            return None
        self._pending.clear()
        self._pending_bytes = 0
        self._inflight, self._inflight_bytes = [], 0
        unsent = await self._spill(pending)
        call = self._call
        if inflight and call is not None:
            # The abandoned tracker call may be writing right now: let it end (briefly) so
            # its records are known delivered, rather than spilled and then also stored.
            await anyio.to_thread.run_sync(call.done.wait, _CALL_WAIT_S)
            if call.done.is_set() and call.ok:
                self._counts["logged"] += len(inflight)
                inflight = []
        # Records in a tracker call cut short may have landed: keep them apart so a replay
        # checks them against the store instead of duplicating them blindly.
        in_doubt = await self._spill(inflight, suffix=".inflight")
        if cancelled:
            what = "the close was cut short before the tracker finished"
        elif timed_out:
            what = "the tracker did not finish by the close deadline"
        else:
            what = "the tracker stopped early"
        error = TimeoutError if timed_out and not cancelled else TrackerError
        text = f"{self.name}: {what}"
        if unsent is not None:
            text += (
                f"; {len(pending)} unsent records spilled to {unsent}: replay them with "
                f"{_REPLAY} {shlex.quote(str(unsent))}"
            )
        if in_doubt is not None:
            text += (
                f"; {len(inflight)} in-flight records (delivery unknown) in {in_doubt}: "
                f"settle them with {_REPLAY} {shlex.quote(str(in_doubt))}"
            )
        if self._no_room or self._timed_out:
            text += f";{self._no_room_text()}"
        if self._counts["lost"]:
            text += f"; {self._counts['lost']} records LOST (no spill file could be written)"
        return error(text)

    def _no_room_text(self) -> str:
        parts = []
        if self._no_room:
            files = ", ".join(str(path) for path in dict.fromkeys(self._no_room))
            parts.append(
                f" {len(self._no_room)} records found no room after the stop request (the "
                f"tracker was not keeping up) and were spilled to {files}: replay them with "
                f"{_REPLAY} FILE"
            )
        if self._timed_out:
            files = ", ".join(str(path) for path in dict.fromkeys(self._timed_out))
            parts.append(
                f" {len(self._timed_out)} records waited send_timeout={self.send_timeout:g}s "
                f"for room (the tracker took nothing in that time) and were spilled to "
                f"{files}: replay them with {_REPLAY} FILE"
            )
        return ";".join(parts)

    def stats(self) -> Mapping[str, Any]:
        return {
            **self._counts,
            "queued_bytes": self._pending_bytes + self._inflight_bytes,
            "queued_records": len(self._pending) + len(self._inflight),
            "kept_at_stop": self._kept_at_stop,
            "spilled_no_room": len(self._no_room),
            "spilled_send_timeout": len(self._timed_out),
            "spill_path": str(self.spill_path) if self.spill_path else None,
        }


def _write_spill(path: Path, data: bytes, meta_path: Path, meta: bytes) -> None:
    """Append ``data`` to ``path`` durably (whole or not at all; a file this call created is
    removed again on failure), and write the run's sidecar beside it once."""
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        write_whole(fd, data)
        os.fsync(fd)
    except OSError:
        os.close(fd)
        if created:
            path.unlink(missing_ok=True)
        raise
    os.close(fd)
    if not meta_path.exists():
        try:
            meta_path.write_bytes(meta)
        except OSError:
            meta_path.unlink(missing_ok=True)
            logger.warning("tracker spill: could not write %s (replay needs --run-id)", meta_path)
