"""The background writer: sealed batches -> bounded stream -> N workers -> sink, in threads.

:class:`TraceWriter` is a :class:`~recis_async.service.Service`.  ``await writer.send(batch)``
hands a sealed batch to a memory object stream with room for one; ``worker_num`` tasks take
batches from it and call the blocking :meth:`Sink.write` in worker threads, so the event loop
never blocks on I/O.  At most ``worker_num + 1`` sealed batches are pending (being written or
waiting); only then does ``send`` wait, and that wait is counted in :meth:`stats`.

A transient sink failure is retried with exponential backoff, resending the same immutable
batch (the sink uses a fresh session or file name, and settles any attempt left in doubt
first).  A permanent failure or exhausted retries spill the batch at once to a replayable
file (:mod:`recis_async.spill`).  Close delivers everything still pending by the deadline --
itself, if the bus's cancellation already stopped the workers -- then spills what is left
and raises :class:`TraceDeliveryError` with the counts, the spill files and the command that
replays them.  Close is idempotent and reports a failure once: a later ``aclose`` returns
quietly unless rows were spilled or lost since.  A close cut short by a cancellation (a second
stop signal) keeps every row safe, and hands the error it could not raise to the bus
(:meth:`TraceWriter.take_close_error`), whose own error then names the files too.

An upload abandoned at the deadline or by cancellation never commits afterwards; one that
was already committing is waited for (up to ``commit_wait`` seconds) so its outcome is known
before the batch is retried or spilled.  The sink's open, begun when the bus starts, is waited
for by close too (until its deadline, and at least :data:`_OPEN_WAIT_S`), so a slow open
ends -- its probe file removed, the sink closed -- before close returns; only an open still
running then (an endpoint that does not answer) is abandoned, with a warning naming the sink,
and its thread closes the sink if it ends later.

Nothing here waits forever or dies silently.  A ``send`` that finds no room waits at most
``send_timeout`` seconds (then the batch is spilled instead), and not past a stop request:
then the batch is kept for close, which delivers it within the bus's ``flush_timeout`` like
everything else pending (a stop says nothing about the sink: spilling there turned a Ctrl-C
that met a slow disk into a replay owed).  A spill goes to the first of the spill directories
that takes it, then to the system temp dir; if none does (a full or read-only disk), the
batch's rows are *lost*, counted, and reported by :meth:`TraceWriter.raise_if_lost` (the hook
calls it on the next step) and at close, naming the steps and each place's error.  The writer
keeps running either way.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shlex
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .. import _threads
from .._checks import (
    creatable_dir,
    non_negative_int,
    non_negative_number,
    positive_int,
    positive_number,
)
from ..errors import SinkError, TraceDeliveryError
from ..service import CloseOnce, first_of, yield_to_services
from .base import Attempt, Sink
from .buffer import Batch
from .schema import OdpsType
from .spill import SpillEntry, write_spill

__all__ = ["DEFAULT_SEND_TIMEOUT", "BatchSource", "TraceRowsLostError", "TraceWriter"]

logger = logging.getLogger(__name__)

#: seconds a publish waits for room (``worker_num + 1`` batches pending) before the batch is
#: spilled instead: a sink stalled this long is not going to take it soon
DEFAULT_SEND_TIMEOUT = 60.0
#: the folder under the system temp dir used when every spill directory refused a batch
_TEMP_SPILL = "recis_async-spill"
#: the least time close waits for a sink's open still under way, also past its deadline (as
#: the tracker service waits for an abandoned ``tracker.log`` call, ``_CALL_WAIT_S``); well
#: inside the bus's grace for a service that overruns its deadline (``_CLOSE_GRACE_S``)
_OPEN_WAIT_S = 1.0


class TraceRowsLostError(TraceDeliveryError):
    """Trace rows could be neither delivered nor spilled anywhere (a full or read-only disk
    under every spill directory and the temp dir): ``lost_rows`` of ``lost_batches`` batches
    are gone.  The message names their steps and each place's error."""

    def __init__(
        self,
        message: str,
        *,
        lost_batches: int,
        lost_rows: int,
        spilled_batches: int,
        spilled_rows: int,
        spill_files: tuple[Path, ...],
    ) -> None:
        super().__init__(
            message,
            spilled_batches=spilled_batches,
            spilled_rows=spilled_rows,
            spill_files=spill_files,
        )
        self.lost_batches = lost_batches
        self.lost_rows = lost_rows


@dataclass(frozen=True)
class _Spilled:
    """Where a group of batches went (``path``), or why nowhere (``path`` None, ``errors``)."""

    path: Path | None
    batches: int
    rows: int
    steps: tuple[int, int] | None
    errors: tuple[str, ...]


def _steps_of(batches: Iterable[Batch]) -> tuple[int, int] | None:
    ranges = [b.steps for b in batches if b.steps is not None]
    if not ranges:
        return None
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def _steps_text(steps: tuple[int, int] | None) -> str:
    if steps is None:
        return ""
    first, last = steps
    return f" of step {first}" if first == last else f" of steps {first}-{last}"


def describe_spills(records: Sequence[_Spilled]) -> str:
    """Spill files grouped by folder: ``N files in DIR (R rows of steps A-B)`` (a lone file
    by its path), so a long close names folders, not 96 paths."""
    groups: dict[Path, list[_Spilled]] = {}
    for r in records:
        if r.path is not None:
            groups.setdefault(r.path.parent, []).append(r)
    parts = []
    for folder, items in groups.items():
        rows = sum(r.rows for r in items)
        what = str(items[0].path) if len(items) == 1 else f"{len(items)} files in {folder}"
        failed = dict.fromkeys(e for r in items for e in r.errors)  # the places tried first
        instead = f"; not in: {'; '.join(failed)}" if failed else ""
        parts.append(f"{what} ({rows} rows{_steps_text(_merge(items))}{instead})")
    return "; ".join(parts)


def _merge(records: Iterable[_Spilled]) -> tuple[int, int] | None:
    ranges = [r.steps for r in records if r.steps is not None]
    if not ranges:
        return None
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def _same_file_system(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` (or their nearest existing parents) are on one file system."""

    def device(path: Path) -> int | None:
        path = path.absolute()
        while True:
            try:
                return os.stat(path).st_dev
            except FileNotFoundError:
                if path.parent == path:
                    return None
                path = path.parent
            except OSError:
                return None

    da, db = device(a), device(b)
    return da is not None and da == db


class BatchSource(Protocol):
    """Where batches are sealed upstream (a :class:`~recis_async.trace.buffer.ColumnBuffer`)."""

    fields: tuple[str, ...]
    types: tuple[OdpsType, ...]

    @property
    def rows(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def age(self) -> float: ...

    def seal(self) -> Batch | None: ...


def _write(sink: Sink, batch: Batch, attempt: Attempt) -> None:
    """Run one write in a worker thread and record how it ended on the attempt."""
    delivered = False
    try:
        sink.write(batch, attempt)
        delivered = True
    finally:
        attempt.finish(delivered)


class TraceWriter:
    """Deliver sealed :class:`~recis_async.trace.buffer.Batch` es to ``sink`` in the background.

    Args:
        sink: where batches go.
        worker_num: concurrent ``sink.write`` calls, each in a worker thread.
        retries: extra attempts per batch after a transient failure.
        retry_backoff: seconds before the first retry, doubled each time (with jitter).
        max_backoff: the longest wait between retries.
        commit_wait: how long an abandoned upload that was already committing is waited for,
            so its outcome is known before the batch is retried or spilled.
        spill_dir: where undeliverable batches go (default ``./trace_spill``), or several
            places tried in order (put one on another disk: a full disk fails the sink and a
            spill folder beside it alike); the system temp dir is tried last.
        send_timeout: the longest a ``send`` waits for room, in seconds; then the batch is
            spilled instead.  Once a stop is requested (:meth:`watch_stop`) it waits no more:
            the batch is kept for close to deliver (at most ``worker_num + 1`` so; a further
            one is spilled at once).
        source: the upstream buffer; sealed at close (and by the ``max_age`` timer once its
            oldest row is that many seconds old) and reported in :meth:`stats`.
        max_age: seconds after which ``source`` is sealed even below its threshold.
        name: the service's name (default ``trace:<sink name>``).
        owner: the class named in argument errors (the hook that builds the writer).

    Raises:
        TypeError: a count or interval of the wrong type.
        ValueError: a count or interval out of range, an unusable ``spill_dir``.
    """

    def __init__(
        self,
        sink: Sink,
        *,
        worker_num: int = 1,
        retries: int = 5,
        retry_backoff: float = 0.5,
        max_backoff: float = 30.0,
        commit_wait: float = 3.0,
        spill_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
        source: BatchSource | None = None,
        max_age: float | None = None,
        name: str | None = None,
        owner: str = "TraceWriter",
    ) -> None:
        positive_int(owner, "worker_num", worker_num)
        non_negative_int(owner, "retries", retries)
        non_negative_number(owner, "retry_backoff", retry_backoff)
        non_negative_number(owner, "max_backoff", max_backoff)
        non_negative_number(owner, "commit_wait", commit_wait)
        positive_number(owner, "send_timeout", send_timeout)
        if max_age is not None:
            positive_number(owner, "max_age", max_age)
        self.sink = sink
        self.name = name or f"trace:{sink.name}"
        self.worker_num = worker_num
        self._retries = retries
        self._backoff = float(retry_backoff)
        self._max_backoff = float(max_backoff)
        self._commit_wait = float(commit_wait)
        if spill_dir is None:
            spill_dir = "trace_spill"
        places: list[Any] = (
            list(spill_dir) if isinstance(spill_dir, list | tuple) and spill_dir else [spill_dir]
        )
        # proven writable now: a spill that cannot be written is lost data, found too late
        self._spill_dirs = tuple(Path(creatable_dir(owner, "spill_dir", p)) for p in places)
        self._spill_dir = self._spill_dirs[0]
        self._send_timeout = float(send_timeout)
        self._stopping: Callable[[], anyio.Event] | None = None  # the bus's stop event
        self._room = anyio.Event()  # set when a worker takes a batch (or the workers end)
        self._source = source
        self._max_age = None if max_age is None else float(max_age)
        self._tx: MemoryObjectSendStream[Batch]
        self._rx: MemoryObjectReceiveStream[Batch]
        self._tx, self._rx = anyio.create_memory_object_stream[Batch](1)
        self._running = anyio.Event()
        self._finished = anyio.Event()
        self._closing = False
        self._deadline = math.inf
        self._scopes: set[anyio.CancelScope] = set()
        self._open_lock = anyio.Lock()
        self._open_call: _threads.Call[None] | None = None  # the sink's open, under way or last
        self._close_lock = threading.Lock()  # between an abandoned open's thread and aclose
        self._sink_closed = False
        self._opened = False
        self._open_tried = anyio.Event()  # the open at bus start ended, either way
        self._bound = False  # the events and lock above were made again in the bus's loop
        self._pending: dict[int, Batch] = {}  # id -> batch: handed over, not yet settled
        self._kept: deque[Batch] = deque()  # found no room after a stop: queued later, or by close
        self._held: dict[int, SpillEntry] = {}  # id -> batch put aside, with its doubt
        self._spills: list[_Spilled] = []  # in order; lost ones have no path
        self._lost_reported = 0  # how many lost records raise_if_lost reported already
        self._reported = 0  # how many spill records a close error reported already
        self._closer = CloseOnce()
        self._spill_kinds: dict[str, int] = {}
        self._last_error: str | None = None
        self._wait_s = 0.0
        self._stats = {
            "batches": 0,
            "rows": 0,
            "bytes": 0,
            "retries": 0,
            "spilled": 0,
            "spilled_rows": 0,
            "lost": 0,
            "lost_rows": 0,
            "backpressure_waits": 0,
        }
        root = getattr(sink, "root", None)  # a local sink (ParquetSink)
        if isinstance(root, Path) and all(_same_file_system(d, root) for d in self._spill_dirs):
            temp = Path(tempfile.gettempdir())
            then = (
                f"the system temp dir {temp} is tried next (on the same file system too)"
                if _same_file_system(temp, root)
                else f"the system temp dir {temp} is tried next"
            )
            logger.warning(
                "%s: spill_dir %s is on the same file system as the Parquet root %s: a full "
                "disk fails both; %s. Name a folder on another disk as well: "
                "spill_dir=[%r, '/other/disk/trace_spill']",
                self.name,
                self._spill_dir,
                root,
                then,
                str(self._spill_dir),
            )

    # ------------------------------------------------------------------ intake
    async def send(self, batch: Batch | None) -> None:
        """Queue a sealed batch; waits only while ``worker_num + 1`` batches are pending.

        The wait ends after ``send_timeout`` seconds, or when the workers are gone: the batch
        is then spilled (a warning names why).  It ends as soon as a stop was requested, or is
        cancelled: the batch is then kept for close to deliver (within the bus's
        ``flush_timeout``, spilled if it cannot be).
        """
        self._bind()
        if batch is None:
            return
        if self._closing:
            raise RuntimeError(f"{self.name}: send() after close started")
        self._pending[id(batch)] = batch
        while self._kept and self._offer(self._kept[0]):  # kept at a stop: they go first
            self._kept.popleft()
        if self._offer(batch):
            # let a worker start on it now: the bus itself yields only every ~100 ms
            await yield_to_services()
            return
        t = perf_counter()
        self._stats["backpressure_waits"] += 1
        try:
            why = await self._wait_for_room(batch)
        except BaseException:
            self._hold(batch, None, "its hand-over was interrupted")
            raise
        finally:
            self._wait_s += perf_counter() - t
        if why is not None:
            logger.warning(
                "%s: batch %d (%d rows%s) spilled instead of queued: %s",
                self.name,
                batch.seq,
                batch.rows,
                _steps_text(batch.steps),
                why,
            )
            await self._spill([SpillEntry(batch, None)], "no room", why)

    def _offer(self, batch: Batch) -> bool:
        """Queue ``batch`` if the stream has room now."""
        try:
            self._tx.send_nowait(batch)
        except anyio.WouldBlock:
            return False
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False  # the workers are gone: _wait_for_room says so
        return True

    async def _wait_for_room(self, batch: Batch) -> str | None:
        """Wait until ``batch`` is queued or kept for close (None), or say why it will be
        spilled instead."""
        give_up = anyio.current_time() + self._send_timeout
        while True:
            if self._finished.is_set():
                return f"the writer's workers have stopped (last error: {self._last_error})"
            stopping = None if self._stopping is None else self._stopping()
            if stopping is not None and stopping.is_set():
                return self._keep_for_close(batch)
            left = give_up - anyio.current_time()
            if left <= 0:
                return (
                    f"waited send_timeout={self._send_timeout:g}s for room: the sink took no "
                    f"batch in that time ({len(self._pending) - 1} pending; last error: "
                    f"{self._last_error})"
                )
            if self._room.is_set():
                self._room = anyio.Event()
            with anyio.move_on_after(left):
                await first_of(self._room, self._finished, stopping)
            if self._offer(batch):
                return None

    def _keep_for_close(self, batch: Batch) -> str | None:
        """A stop was requested and ``batch`` found no room: keep it (still pending) for the
        next ``send`` or for close to deliver, so the step need not wait for the sink; None.
        Past ``worker_num + 1`` batches kept so (a loop running on after its stop request),
        why it is spilled instead: memory stays bounded."""
        if len(self._kept) > self.worker_num:
            return (
                f"a stop was requested and {len(self._kept)} batch(es) already wait for the "
                f"close to deliver them (the sink is not keeping up; last error: "
                f"{self._last_error})"
            )
        self._kept.append(batch)
        logger.info(
            "%s: batch %d (%d rows%s) kept for the close to deliver: a stop was requested "
            "while %d batch(es) were pending",
            self.name,
            batch.seq,
            batch.rows,
            _steps_text(batch.steps),
            len(self._pending) - 1,
        )
        return None

    @property
    def spill_dir(self) -> Path:
        """Where batches that cannot be delivered are kept (the first place tried)."""
        return self._spill_dir

    def watch_stop(self, stopping: Callable[[], anyio.Event]) -> None:
        """Make a ``send`` waiting for room stop waiting, and keep its batch for close, as
        soon as the event ``stopping()`` returns is set (the hook passes its bus's
        :attr:`~recis_async.HookBus.stopping`; a callable, as the bus makes its event only
        when entered)."""
        self._stopping = stopping

    def _bind(self) -> None:
        """Make the writer's events and lock again, once, in the loop that runs the writer.

        The constructor runs in the caller's context, where another event loop may be running
        (a notebook's, or an async caller's around a :class:`~recis_async.SyncHookBus` on the
        other library); an anyio ``Event`` or ``Lock`` made there belongs to that loop.  The
        first ones were never waited on nor set: that happens only in the coroutines of the
        writer, and each of them (``run``, ``send``, ``wait_open``, ``aclose``) calls this
        first."""
        if self._bound:
            return
        self._bound = True
        self._room = anyio.Event()
        self._running = anyio.Event()
        self._finished = anyio.Event()
        self._open_lock = anyio.Lock()
        self._open_tried = anyio.Event()

    @property
    def used(self) -> bool:
        """Whether a bus ran this writer already (a writer serves one bus)."""
        return self._running.is_set() or self._closing

    def raise_if_lost(self) -> None:
        """Raise :class:`TraceRowsLostError` if rows were lost since the last call: the step
        that sees it learns at once, not at close."""
        if len(self._spills) <= self._lost_reported:  # every step: nothing new can be lost
            return
        lost = [r for r in self._spills if r.path is None]
        if len(lost) > self._lost_reported:
            fresh = lost[self._lost_reported :]
            self._lost_reported = len(lost)
            raise self._lost_error(fresh, "")

    def _lost_error(self, lost: Sequence[_Spilled], tail: str) -> TraceRowsLostError:
        rows = sum(r.rows for r in lost)
        batches = sum(r.batches for r in lost)
        errors = dict.fromkeys(e for r in lost for e in r.errors)  # in order, once each
        return TraceRowsLostError(
            f"{self.name}: {rows} rows{_steps_text(_merge(lost))} ({batches} batch(es)) are "
            f"LOST: not delivered (last error: {self._last_error}) and no spill place could "
            f"be written: {'; '.join(errors)}. Free space or name a spill_dir on another "
            f"disk.{tail}",
            lost_batches=batches,
            lost_rows=rows,
            spilled_batches=self._stats["spilled"],
            spilled_rows=self._stats["spilled_rows"],
            spill_files=self._files(),
        )

    def _files(self) -> tuple[Path, ...]:
        return tuple(r.path for r in self._spills if r.path is not None)

    def stats(self) -> Mapping[str, Any]:
        """Pending (queued + in flight) and buffered sizes, delivered and spilled counts,
        retries, and the time publishers spent waiting for room."""
        source = self._source
        return {
            "queued_batches": len(self._pending),
            "queued_bytes": sum(b.nbytes for b in self._pending.values()),
            "queued_rows": sum(b.rows for b in self._pending.values()),
            "buffered_rows": source.rows if source is not None else 0,
            "buffered_bytes": source.nbytes if source is not None else 0,
            **self._stats,
            "sink_open": self._opened,
            "backpressure_wait_s": self._wait_s,
            "spill_files": [str(p) for p in self._files()],
            "spilled_to": describe_spills(self._spills),
        }

    # ------------------------------------------------------------------ service
    async def run(self) -> None:
        """Run the workers (and the ``max_age`` timer) until close has drained the stream."""
        self._bind()
        self._running.set()
        try:
            async with anyio.create_task_group() as outer:
                if self._source is not None:
                    outer.start_soon(self._open_early, name=f"{self.name}:open")
                if self._max_age is not None and self._source is not None:
                    outer.start_soon(self._age_timer, name=f"{self.name}:max_age")
                await self._work(self._rx, self.worker_num)
                outer.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # name the cause, not "unhandled errors in a
            raise _unwrap(group) from None  # TaskGroup (1 sub-exception)"
        finally:
            self._finished.set()
            self._room.set()  # a send waiting for room spills instead

    async def _work(self, rx: MemoryObjectReceiveStream[Batch], workers: int) -> None:
        async with anyio.create_task_group() as tg:
            for i in range(workers):
                tg.start_soon(self._worker, rx.clone(), name=f"{self.name}:worker{i}")
        rx.close()

    async def _age_timer(self) -> None:
        """Seal and queue the upstream buffer once its oldest row is ``max_age`` old."""
        source, max_age = self._source, self._max_age
        assert source is not None and max_age is not None
        while not self._closing:
            await anyio.sleep(min(max_age / 4, 1.0))
            if not self._closing and source.rows and source.age() >= max_age:
                await self.send(source.seal())

    async def _worker(self, rx: MemoryObjectReceiveStream[Batch]) -> None:
        async with rx:
            async for batch in rx:
                self._room.set()
                held = self._held.pop(id(batch), None)
                await self._deliver(batch, held.in_doubt if held else None)

    async def _deliver(self, batch: Batch, in_doubt: str | None) -> None:
        """Write ``batch`` with retries; spill it if that fails; on the close deadline or a
        cancellation put it aside (with its doubt) for close."""
        attempt = Attempt(in_doubt)
        submitted = False  # whether ``attempt`` was handed to a worker thread
        failures = 0
        try:
            while True:
                if anyio.current_time() >= self._deadline:
                    self._hold(batch, attempt.token, "the close deadline passed before it was sent")
                    return
                with anyio.CancelScope(deadline=self._deadline) as scope:
                    self._scopes.add(scope)
                    try:
                        await self._ensure_open(batch.fields, batch.types)
                        submitted = True
                        await _threads.run_sync(
                            _write, self.sink, batch, attempt, abandon_on_cancel=True
                        )
                    except SinkError as exc:
                        error: Exception | None = exc
                        transient = exc.transient
                    except Exception as exc:  # unclassified: do not guess, keep the batch safe
                        error, transient = exc, False
                    else:
                        error, transient = None, False
                    finally:
                        self._scopes.discard(scope)
                if scope.cancelled_caught:
                    await self._abandon(
                        batch, attempt, submitted, "the close deadline passed during its upload"
                    )
                    return
                if error is None:
                    self._delivered(batch)
                    return
                self._last_error = f"{type(error).__name__}: {error}"
                attempt = Attempt(attempt.token)  # the next try settles what is in doubt first
                submitted = False
                if not transient or failures >= self._retries:
                    why = "retries exhausted" if transient else "permanent error"
                    logger.error(
                        "%s: batch %d (%d rows) not delivered (%s): %s",
                        self.name,
                        batch.seq,
                        batch.rows,
                        why,
                        error,
                    )
                    await self._spill(
                        [SpillEntry(batch, attempt.token)], why, f"{why}: {self._last_error}"
                    )
                    return
                failures += 1
                self._stats["retries"] += 1
                delay = min(self._max_backoff, self._backoff * 2 ** (failures - 1))
                delay *= 0.5 + random.random() / 2
                logger.warning(
                    "%s: batch %d (%d rows) failed, retry %d/%d in %.2fs: %s",
                    self.name,
                    batch.seq,
                    batch.rows,
                    failures,
                    self._retries,
                    delay,
                    error,
                )
                with anyio.CancelScope(deadline=self._deadline) as wait:
                    self._scopes.add(wait)
                    try:
                        await anyio.sleep(delay)
                    finally:
                        self._scopes.discard(wait)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._abandon(batch, attempt, submitted, "the writer was cancelled")
            raise

    def _delivered(self, batch: Batch) -> None:
        self._pending.pop(id(batch), None)
        self._held.pop(id(batch), None)
        self._stats["batches"] += 1
        self._stats["rows"] += batch.rows
        self._stats["bytes"] += batch.nbytes

    async def _abandon(self, batch: Batch, attempt: Attempt, submitted: bool, why: str) -> None:
        """Stop ``attempt``; if its thread may be committing, wait for that to end; then either
        count the batch as delivered or put it aside with what is still in doubt."""
        token = attempt.abandon()
        if submitted and token is not None and not attempt.done.is_set():
            await _threads.run_sync(attempt.done.wait, self._commit_wait)
        if attempt.done.is_set() and attempt.delivered:
            self._delivered(batch)
            return
        self._hold(batch, attempt.token, why)

    def _hold(self, batch: Batch, token: str | None, why: str) -> None:
        logger.warning(
            "%s: batch %d (%d rows) put aside: %s", self.name, batch.seq, batch.rows, why
        )
        self._pending[id(batch)] = batch
        self._held[id(batch)] = SpillEntry(batch, token)
        if self._last_error is None:  # every delivery error names a cause, this one at least
            self._last_error = f"batch {batch.seq}: {why}"

    async def _open_early(self) -> None:
        """Open the sink when the bus starts: the first batch does not wait for it, and a bad
        configuration shows in the log at once.  A failure here is retried by that batch."""
        assert self._source is not None
        try:
            await self._ensure_open(self._source.fields, self._source.types)
        except Exception as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "%s: cannot open the sink yet (retried with the first batch): %s", self.name, exc
            )
        finally:
            self._open_tried.set()

    async def wait_open(self) -> bool:
        """Wait until the sink's open at bus start has ended; return whether the sink is open
        (a failure was logged and is retried by the first batch).  Without a ``source``
        nothing is opened early: returns at once."""
        self._bind()
        if self._source is not None and not self._closing:
            await self._open_tried.wait()
        return self._opened

    async def _ensure_open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        """Open the sink in a thread of its own, once.  A cancellation of the waiting task
        abandons the wait, not the open: an open still running (the open at bus start, whose
        task ends with the workers) is waited for by the next caller, never run twice at once,
        and by :meth:`aclose`."""
        if self._opened:
            return
        async with self._open_lock:
            call = self._open_call
            if call is not None and not call.done:
                await _threads.wait(call)
            if self._opened:
                return
            call = self._open_call = _threads.Call(
                self._open, fields, types, name=f"recis_async {self.name} open"
            )
            await _threads.wait(call)
            call.result()

    async def _settle_open(self, deadline: float) -> None:
        """Let an open of the sink still under way end before close marks the sink closed:
        wait until ``deadline``, and at least :data:`_OPEN_WAIT_S` (a deadline already spent
        on deliveries, or a signal's hurried close).  A cancellation of the close ends the
        wait at once.  An open still running then is abandoned, named in a warning; its
        thread closes the sink if it ends (:meth:`_open`)."""
        call = self._open_call
        if call is None or call.done:
            return
        wait = max(deadline - anyio.current_time(), _OPEN_WAIT_S)
        t0 = anyio.current_time()
        try:
            await _threads.wait(call, wait)
        finally:
            if not call.done:
                logger.warning(
                    "%s: the sink's open was still running at the close (%s), after %.1f s; "
                    "abandoned: if it ends, its thread closes the sink",
                    self.name,
                    self.sink.name,
                    anyio.current_time() - t0,
                )

    def _open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        """Open the sink in a worker thread.  Close waits for an open under way
        (:meth:`_settle_open`); one it abandons ends after it, and the thread then closes the
        sink itself, so every sink that opened is closed exactly once."""
        self.sink.open(fields, types)
        with self._close_lock:
            if not self._sink_closed:
                self._opened = True
                return
        self.sink.close()

    async def _spill(self, entries: list[SpillEntry], kind: str, reason: str) -> None:
        """Write ``entries`` to a spill file in the first place that takes it; shielded, so
        cancellation cannot lose them.  Never raises: if no place takes them their rows are
        counted as lost, logged at once and raised by :meth:`raise_if_lost` and at close."""
        if not entries:
            return
        with anyio.CancelScope(shield=True):
            path, errors = await _threads.run_sync(self._write_spill, entries, reason)
        batches = [e.batch for e in entries]
        rows = sum(b.rows for b in batches)
        record = _Spilled(path, len(entries), rows, _steps_of(batches), tuple(errors))
        self._spills.append(record)
        for entry in entries:
            self._pending.pop(id(entry.batch), None)
            self._held.pop(id(entry.batch), None)
        steps = _steps_text(record.steps)
        if path is None:
            self._stats["lost"] += len(entries)
            self._stats["lost_rows"] += rows
            logger.error(
                "%s: %d rows%s LOST: %s, and no spill place could be written: %s",
                self.name,
                rows,
                steps,
                reason,
                "; ".join(errors),
            )
            return
        self._stats["spilled"] += len(entries)
        self._stats["spilled_rows"] += rows
        self._spill_kinds[kind] = self._spill_kinds.get(kind, 0) + len(entries)
        instead = f" (instead of: {'; '.join(errors)})" if errors else ""
        logger.error(
            "%s: spilled %d batch(es) (%d rows%s) to %s%s",
            self.name,
            len(entries),
            rows,
            steps,
            path,
            instead,
        )

    def _write_spill(self, entries: list[SpillEntry], reason: str) -> tuple[Path | None, list[str]]:
        """Try each spill place in turn, the system temp dir last; blocking.  Returns the file
        written (None if none) and each place's error."""
        errors: list[str] = []
        places = [*self._spill_dirs, Path(tempfile.gettempdir()) / _TEMP_SPILL]
        for place in dict.fromkeys(places):
            try:
                return (
                    write_spill(
                        place, entries, sink_name=self.sink.name, reason=reason, prefix=self.name
                    ),
                    errors,
                )
            except OSError as exc:
                errors.append(f"{exc.strerror or exc} on {place}")
        return None, errors

    # ------------------------------------------------------------------ close
    async def aclose(self, deadline: float) -> None:
        """Seal what is buffered upstream, deliver everything pending by ``deadline``, spill
        the rest, close the sink; raise :class:`TraceDeliveryError` if anything was spilled
        (:class:`TraceRowsLostError` if rows could not be spilled either).

        Idempotent, and a failure is reported once: the close runs once; a later ``aclose``
        (or one called while the first is under way, which it waits for until ``deadline``)
        only raises what no earlier one reported -- rows spilled or lost since, which a
        close never keeps quiet about.  A close cut short by a cancellation (a second stop
        signal) still keeps every row safe before the cancellation propagates; the error it
        could not raise is then reported by :meth:`take_close_error` (the bus names it in
        its own error) or else by the next ``aclose``.  :meth:`stats` keeps the spill files
        either way."""
        self._bind()
        await self._closer(self._close, deadline, self.take_close_error)

    def take_close_error(self) -> TraceDeliveryError | None:
        """The error the close found that no ``aclose`` has raised yet, or None; it counts
        as reported from then on.  The bus calls it when it cut a close short (a second stop
        signal, or an overrun deadline): a cancelled ``aclose`` cannot raise it, and the
        user reading the bus's error must still find the spill files and how to replay
        them.  None before the close began (what the run spilled is the close's to report)."""
        if not self._closer.started or len(self._spills) <= self._reported:
            return None
        self._reported = len(self._spills)
        return self._close_error()

    def _replay_command(self) -> str:
        """How to deliver a spill file of this writer's sink from a shell."""
        root = getattr(self.sink, "root", None)
        if isinstance(root, Path):
            return f"`python -m recis_async.spill replay FILE --parquet {shlex.quote(str(root))}`"
        return (
            "`python -m recis_async.spill replay FILE --parquet ROOT` (or --odps-config cfg.json)"
        )

    def _close_error(self) -> TraceDeliveryError | None:
        """Everything spilled (and lost) so far, as the error close raises; None if nothing."""
        lost = [r for r in self._spills if r.path is None]
        if lost:
            spilled = describe_spills(self._spills)
            return self._lost_error(
                lost,
                f" Besides, {self._stats['spilled_rows']} rows were spilled: {spilled}; replay "
                f"them with {self._replay_command()}."
                if spilled
                else "",
            )
        if not self._stats["spilled"]:
            return None
        kinds = ", ".join(f"{k}: {n}" for k, n in self._spill_kinds.items())
        return TraceDeliveryError(
            f"{self.name}: {self._stats['spilled']} batch(es) ({self._stats['spilled_rows']} "
            f"rows) were not delivered ({kinds}; {self._stats['batches']} delivered) and "
            f"were spilled to {describe_spills(self._spills)}; replay them with "
            f"{self._replay_command()} or recis_async.spill.replay_spill(path, sink). Last "
            f"error: {self._last_error}",
            spilled_batches=self._stats["spilled"],
            spilled_rows=self._stats["spilled_rows"],
            spill_files=self._files(),
        )

    async def _close(self, deadline: float) -> None:
        """The close itself (once): drain, then keep the rest safe and close the sink."""
        try:
            await self._drain(deadline)
        finally:
            # also when cancelled (a second stop signal): stop every upload, let any commit
            # already under way end so its outcome is known, keep what was not delivered
            self._closing = True
            self._deadline = -math.inf
            self._tx.close()  # idle workers return instead of waiting for more batches
            for scope in list(self._scopes):
                scope.cancel()
            with anyio.CancelScope(shield=True):
                if self._running.is_set() and not self._finished.is_set():
                    with anyio.move_on_after(self._commit_wait + 1.0):
                        await self._finished.wait()
            try:
                leftovers = [
                    self._held.get(key) or SpillEntry(batch, None)
                    for key, batch in self._pending.items()
                ]
                reason = f"not delivered by the close deadline; last error: {self._last_error}"
                await self._spill(leftovers, "close deadline", reason)
            finally:
                try:
                    await self._settle_open(deadline)  # not shielded: a cancellation ends it
                finally:
                    with anyio.CancelScope(shield=True):
                        with self._close_lock:
                            self._sink_closed = True  # an open running on closes the sink
                        if self._opened:
                            try:
                                await _threads.run_sync(self.sink.close)
                            except Exception as exc:
                                logger.warning("%s: closing the sink failed: %s", self.name, exc)

    async def _drain(self, deadline: float) -> None:
        def left() -> float:
            return max(0.0, deadline - anyio.current_time())

        # Seal and register the remainder before the first await: a cancellation there (a
        # second stop signal) must find it pending, or the spill in aclose would miss it.
        remainder = self._source.seal() if self._source is not None else None
        if remainder is not None:
            self._pending[id(remainder)] = remainder  # the backlog pass below takes it if
            try:  # the workers cannot (they may be cancelled along with the bus)
                self._tx.send_nowait(remainder)
            except anyio.WouldBlock:
                pass
        self._closing = True
        with anyio.move_on_after(left()):
            await self._running.wait()  # let run() start if the bus never yielded to it
        workers_alive = self._running.is_set() and not self._finished.is_set()
        self._deadline = deadline
        for scope in list(self._scopes):
            scope.deadline = deadline
        self._tx.close()  # the workers finish what is queued, then return
        if workers_alive:
            with anyio.move_on_after(left()):
                await self._finished.wait()
            # past the deadline, workers are abandoning their uploads; one that was
            # committing is waited for (commit_wait), so let them settle before spilling
            with anyio.move_on_after(self._commit_wait + 1.0):
                await self._finished.wait()
        # Whatever is still pending (put aside, or never picked up because the workers were
        # cancelled with the bus's task group) is delivered here, within the deadline.
        self._rx.close()
        backlog = list(self._pending.values())
        if not backlog or left() <= 0:
            return
        tx, rx = anyio.create_memory_object_stream[Batch](len(backlog))
        for batch in backlog:
            tx.send_nowait(batch)
        tx.close()
        with anyio.CancelScope(deadline=deadline):
            await self._work(rx, min(self.worker_num, len(backlog)))


def _unwrap(group: BaseExceptionGroup) -> BaseException:
    """The one error inside nested task-group groups, or a RuntimeError naming each."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    if len(leaves) == 1:
        return leaves[0]
    error = RuntimeError("; ".join(f"{type(e).__name__}: {e}" for e in leaves))
    error.__cause__ = group
    return error
