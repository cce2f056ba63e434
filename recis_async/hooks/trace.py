"""TraceHook / TraceToOdpsHook: the rows each step traces, buffered and written in the background.

At every ``AfterStep`` that carries trace data (``add_to_trace``), the step's columns are
checked against the declared ``fields``/``types`` at once -- a bad step raises ``ValueError``
from that ``publish`` (as :class:`~recis_async.HookError`) and nothing of it is kept -- and
appended to a :class:`~recis_async.trace.buffer.ColumnBuffer`.  Traced tensors arrive as
:class:`~recis_async.hostcopy.HostCopy` s: checked by their dtype and shape, never read by the
step; their values are copied out by the bus's copy-out thread once the device has copied
them, or by the writer's worker thread.  When the buffer holds
``size_threshold`` bytes (or its oldest row is ``max_age`` seconds old) it is sealed into an
immutable batch and handed to a :class:`~recis_async.trace.service.TraceWriter` whose ``worker_num``
workers write it through the sink in worker threads.  Memory stays bounded: ``after_step``
waits only while ``worker_num + 1`` sealed batches are pending.  Leaving the bus seals the
rest and drains everything within the bus's ``flush_timeout``; what cannot be delivered is
spilled to a replayable file and reported as an error.  The sink is opened when the bus starts
and ``Start`` waits for that open, so its cost lands before the first step.

Bounds: rows wait in memory at most ``max_age`` seconds (30 by default) or ``size_threshold``
bytes before they are sealed and handed over, so a ``kill -9`` loses at most that much plus the
``worker_num + 1`` batches pending; a ``publish`` waits for room at most ``send_timeout``
seconds (then the batch is spilled), and not past a stop request (then the batch is kept for
the close to deliver: at most ``worker_num + 1`` more batches in memory); rows that can be
neither written nor spilled are reported on the next step that reaches the hook, and at close.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio.to_thread

from .._checks import one_of, positive_int
from ..events import AfterLoadCheckpoint, AfterStep, Start
from ..hook import Hook
from ..trace.base import Sink
from ..trace.buffer import ColumnBuffer
from ..trace.odps import DEFAULT_TIMEOUT as DEFAULT_ODPS_TIMEOUT
from ..trace.odps import OdpsSink
from ..trace.service import DEFAULT_SEND_TIMEOUT, TraceWriter

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["TraceHook", "TraceToOdpsHook"]

DEFAULT_SIZE_THRESHOLD = 50 * 1024 * 1024  # bytes, as in RecIS
#: seconds a buffered row waits before it is sealed and handed to a writer, whatever the size:
#: what a ``kill -9`` can lose is bounded in time as well as in bytes
DEFAULT_MAX_AGE = 30.0

logger = logging.getLogger(__name__)
_STEPS = ("all", "train", "eval")


class TraceHook(Hook):
    """Write every step's trace columns to ``sink`` in the background.

    To keep training and evaluation rows in one table and tell them apart, trace the step's
    ``is_train`` as a column.

    Args:
        sink: where batches go (:class:`~recis_async.sinks.ParquetSink`,
            :class:`~recis_async.sinks.OdpsSink`, or any :class:`~recis_async.sinks.Sink`).
        fields: the table's column names.
        types: their ODPS types (see :mod:`recis_async.trace.schema`).
        worker_num: concurrent writes.
        size_threshold: bytes buffered before a batch is sealed and handed to a writer.  A
            single step larger than this is written as one batch of its own size (a warning
            says so once): memory is bounded by ``(worker_num + 2) × (size_threshold +
            the largest step)``.
        max_age: seconds after which a non-empty buffer is sealed anyway (default 30;
            ``None``: only by size, and at close -- a ``kill -9`` then loses everything
            buffered, however old).
        retries: how many times a transient failure is retried.
        retry_backoff: the first retry's delay in seconds, doubled each time.
        spill_dir: where undeliverable batches are kept (default ``./trace_spill``), or
            several places tried in order -- name one on another disk than a Parquet root; the
            system temp dir is tried last.
        send_timeout: the longest a ``publish`` waits for room while ``worker_num + 1``
            batches are pending (default 60 s); then the batch is spilled instead.  After a
            stop request it does not wait: the batch is kept for the close to deliver within
            the bus's ``flush_timeout`` (spilled if the sink cannot take it by then).
        steps: which steps are traced: ``"all"`` (as RecIS, whose ``evaluate()`` calls
            ``after_step`` too), ``"train"`` or ``"eval"`` (e.g. one hook per table).

    Raises:
        TypeError: a ``sink`` that is not a Sink, a count of the wrong type.
        ValueError: fields and types of different lengths, an unknown type, a field the sink
            cannot take, a count or interval out of range, an unknown ``steps``, an unusable
            ``spill_dir``.
    """

    def __init__(
        self,
        sink: Sink,
        fields: Sequence[str],
        types: Sequence[str],
        worker_num: int = 1,
        size_threshold: int = DEFAULT_SIZE_THRESHOLD,
        max_age: float | None = DEFAULT_MAX_AGE,
        *,
        retries: int = 5,
        retry_backoff: float = 0.5,
        spill_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
        steps: Literal["all", "train", "eval"] = "all",
    ) -> None:
        self.steps = one_of(type(self).__name__, "steps", steps, _STEPS)
        # the is_train value of the steps left out, or None when every step is traced
        self._skip: bool | None = None if steps == "all" else steps == "eval"
        if not isinstance(sink, Sink):
            raise TypeError(
                f"{type(self).__name__}(sink=...): expected a Sink (name, open, write, close), "
                f"got {type(sink).__name__}"
            )
        positive_int(type(self).__name__, "size_threshold", size_threshold)
        try:
            self._buffer = ColumnBuffer(fields, types)
        except (TypeError, ValueError) as exc:  # name the class the user called
            raise type(exc)(f"{type(self).__name__}(fields=..., types=...): {exc}") from None
        check_fields = getattr(sink, "check_fields", None)  # e.g. ParquetSink's partition keys
        if check_fields is not None:
            check_fields(self._buffer.fields, type(self).__name__)
        self._threshold = size_threshold
        self._max_age = max_age
        self._writer = TraceWriter(
            sink,
            worker_num=worker_num,
            retries=retries,
            retry_backoff=retry_backoff,
            spill_dir=spill_dir,
            send_timeout=send_timeout,
            source=self._buffer,
            max_age=max_age,
            owner=type(self).__name__,
        )
        self.sink = sink
        self._warned_step = False
        # The traced run: stamped on every batch, kept in checkpoints.  A run resumed from a
        # checkpoint older than its last delivered rows (a crash) skips the steps the sink
        # already holds, whose ranges ``after_load_checkpoint`` asks it for.
        self._buffer.run = secrets.token_hex(8)
        self._delivered: list[tuple[int, int]] = []

    @property
    def fields(self) -> tuple[str, ...]:
        return self._buffer.fields

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._buffer.types)

    @property
    def writer(self) -> TraceWriter:
        """The background service (its ``stats()`` appear in ``bus.stats()``)."""
        return self._writer

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}[{self.sink.name}]"

    def attach(self, bus: HookBus) -> None:
        if self._writer.used:
            raise RuntimeError(
                f"{type(self).__name__}: this hook already ran on a bus that has closed (its "
                "writer was drained and closed with it); create a new hook for each bus"
            )
        self._writer.watch_stop(lambda: bus.stopping)
        bus.start_service(self._writer)

    async def start(self, event: Start) -> None:
        """Wait for the sink's open, begun when the bus started (imports, client, table and
        partition checks): it then runs before the first step instead of beside the first
        steps, taking their CPU.  A failed open was logged; the first batch retries it."""
        await self._writer.wait_open()

    def outputs(self) -> dict[str, str]:
        where = str(getattr(self.sink, "location", None) or self.sink.name)
        stats = self._writer.stats()
        if stats["batches"]:
            where += f" ({stats['rows']} rows written)"
        if stats["spill_files"]:
            spilled = f"{stats['spilled_rows']} rows: {stats['spilled_to']}"
            replay = "undelivered traces (replay: python -m recis_async.spill replay FILE)"
            return {"traces": where, replay: spilled}
        if stats["batches"]:
            return {"traces": where}
        return {
            "traces": where,
            "trace spill files (only if delivery fails)": str(self._writer.spill_dir.absolute()),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"run": self._buffer.run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run = state.get("run")
        if isinstance(run, str):
            self._buffer.run = run

    async def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        """The run continues from ``event.global_step``: find which later steps the sink
        already holds (delivered before a crash that left no newer checkpoint)."""
        delivered_steps = getattr(self.sink, "delivered_steps", None)
        run = self._buffer.run
        if delivered_steps is None or run is None:
            return
        ranges = await anyio.to_thread.run_sync(delivered_steps, run)
        self._delivered = [(a, b) for a, b in ranges if b >= event.global_step]
        if self._delivered:
            logger.info(
                "%s: steps %s of this run were delivered before it stopped; resumed at step "
                "%d, their rows are not traced again",
                type(self).__name__,
                ", ".join(f"{a}-{b}" for a, b in self._delivered),
                event.global_step,
            )

    def after_step(self, event: AfterStep) -> Awaitable[None] | None:
        """Check and buffer the step's rows at once; a coroutine only when the buffer is due
        to be sealed (handing the batch to the writer may wait for room: backpressure)."""
        writer = self._writer
        if len(writer._spills) > writer._lost_reported:  # raise_if_lost's test, without a call
            writer.raise_if_lost()  # before this step's rows are taken: they are not part of it
        trace = event.trace
        if not trace or event.is_train is self._skip:
            return None
        if self._delivered and self._already_delivered(event.global_step):
            return None
        buffer = self._buffer
        buffer.append(trace, event.global_step)
        if buffer.step_nbytes > self._threshold and not self._warned_step:
            self._warned_step = True
            logger.warning(
                "%s: step %d traced %s, more than size_threshold=%s: it is written as one "
                "batch of that size, so memory is bounded by (worker_num + 2) x the largest "
                "step, not by size_threshold (warned once)",
                type(self).__name__,
                event.global_step,
                _size(buffer.step_nbytes),
                _size(self._threshold),
            )
        if buffer.due(self._threshold, self._max_age):
            return writer.send(buffer.seal())  # a loss seen here is raised by the next step
        return None

    def _already_delivered(self, step: int) -> bool:
        """Whether ``step``'s rows were delivered before a restart (ranges in step order)."""
        while self._delivered and self._delivered[0][1] < step:
            self._delivered.pop(0)  # passed: never asked again
        return bool(self._delivered) and self._delivered[0][0] <= step

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} sink={self.sink.name} fields={list(self.fields)} "
            f"worker_num={self._writer.worker_num} size_threshold={self._threshold} "
            f"steps={self.steps}>"
        )


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


class TraceToOdpsHook(TraceHook):
    """RecIS's hook: ``TraceHook(sink=OdpsSink(config), fields, types, ...)``.

    ``config`` keys: ``access_id``, ``access_key``, ``project``, ``end_point``,
    ``table_name``; optional ``partition`` and ``tunnel_endpoint``.  Credentials may instead
    come from ``ALIBABA_CLOUD_ACCESS_KEY_ID`` / ``ALIBABA_CLOUD_ACCESS_KEY_SECRET``.

    Args:
        config: RecIS's config dict (keys above).
        fields: the table's column names.
        types: their ODPS types.
        worker_num: concurrent uploads.
        size_threshold: bytes buffered before a batch is uploaded.
        max_age: seconds after which a non-empty buffer is uploaded anyway.
        timeout: seconds the service may take to answer one call (the open, each step of a
            batch) before it counts as failed (:class:`~recis_async.sinks.OdpsSink`).
        kwargs: the other arguments of :class:`TraceHook`.

    Raises:
        ValueError: a config key missing or unknown (the message never shows the secret), and
            what :class:`TraceHook` refuses.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        fields: Sequence[str],
        types: Sequence[str],
        worker_num: int = 1,
        size_threshold: int = DEFAULT_SIZE_THRESHOLD,
        max_age: float | None = DEFAULT_MAX_AGE,
        *,
        timeout: float = DEFAULT_ODPS_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            OdpsSink(config, timeout=timeout),
            fields,
            types,
            worker_num,
            size_threshold,
            max_age,
            **kwargs,
        )
