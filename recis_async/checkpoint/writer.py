"""The checkpoint writer: a bus service writing one snapshot at a time with ``torch.save`` in a
worker thread, atomically (temporary file, ``fsync``, ``os.replace``, directory ``fsync``), at
a lowered CPU priority, keeping the newest ``max_to_keep`` files.  At most one more snapshot
waits; a newer one replaces it (it holds everything the older one had)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO, TypeVar, cast

import anyio
import anyio.to_thread
import torch

from .._files import atomic_path
from ..jobs import JobQueue
from .files import TMP_MARK, TMP_PREFIX, list_checkpoints
from .snapshot import Buffers, Layout, Snapshot, allocate

__all__ = ["CheckpointWriter"]

logger = logging.getLogger(__name__)

A = TypeVar("A")
R = TypeVar("R")


class CheckpointWriter(JobQueue["Snapshot | Layout"]):
    """Background service: writes one snapshot at a time; at most one more waits, and a newer
    snapshot replaces it (a :class:`~recis_async.jobs.JobQueue` with ``overflow="replace"``).

    Args:
        output_dir: where ``checkpoint-<step>.pt`` files go.
        max_to_keep: keep the newest this many files (``None``: all).
        nice: lower the writing thread's CPU priority by this much (Linux).
        reuse: keep the buffers of a written or superseded snapshot for the next one.
    """

    def __init__(
        self, output_dir: str, max_to_keep: int | None, nice: int | None, reuse: bool
    ) -> None:
        super().__init__(
            f"CheckpointSaverHook({output_dir})",
            self._handle_job,
            capacity=1,
            overflow="replace",
            on_cancel=self._cut,
        )
        self.output_dir = output_dir
        self.max_to_keep = max_to_keep
        self.nice = nice
        self.reuse = reuse
        self._spare: Buffers | None = None
        self._written = 0
        self._superseded = 0
        self._bytes_written = 0
        self._last_step: int | None = None
        self._last_write_s = 0.0

    def submit(self, snap: Snapshot) -> None:
        """Queue ``snap``; a snapshot still waiting is replaced (the newer holds all it had).

        Raises:
            RuntimeError: an earlier write failed, or the writer is closed.
        """
        if self.failure is not None:
            raise RuntimeError(
                f"checkpoint of step {snap.step} not taken: an earlier write failed "
                f"({self.failure})"
            ) from self.failure
        if self.closing:
            raise RuntimeError(f"checkpoint of step {snap.step} not taken: the writer is closed")
        for older in self.waiting:
            if isinstance(older, Snapshot):
                logger.warning(
                    "checkpoint of step %d superseded by step %d before it was written "
                    "(writes are slower than save_steps/save_secs)",
                    older.step,
                    snap.step,
                )
        self.put_nowait(snap)

    def replaced(self, job: Snapshot | Layout) -> None:
        if isinstance(job, Snapshot):
            self._superseded += 1
            if not job.ready:  # device copies may still be landing in its buffers: not reused
                self._keep_spare(job.buffers)

    def take_spare(self) -> Buffers | None:
        """CPU tensors of a snapshot no longer needed, for the next one to overwrite."""
        spare, self._spare = self._spare, None
        return spare

    def _keep_spare(self, buffers: Buffers) -> None:
        if self.reuse:
            self._spare = buffers

    def prewarm(self, layout: Layout) -> None:
        """Allocate a spare set of buffers off the step while idle, so that even the first
        snapshot overwrites memory instead of faulting fresh pages in."""
        if self.reuse and self._spare is None and not self.closing and not self.waiting:
            self.put_nowait(layout)

    async def wait_written(self) -> None:
        """Return once nothing is queued, written or allocated; raise if the writer failed."""
        await self.wait_idle()
        if self.failure is not None:
            raise RuntimeError(f"checkpoint writer failed: {self.failure}") from self.failure

    async def _handle_job(self, job: Snapshot | Layout) -> None:
        if not isinstance(job, Snapshot):  # a prewarm
            buffers = await anyio.to_thread.run_sync(
                self._apart, allocate, job, abandon_on_cancel=True
            )
            if self._spare is None:
                self._spare = buffers
            return
        t = time.perf_counter()
        await anyio.to_thread.run_sync(self._apart, self._write, job, abandon_on_cancel=True)
        self._last_write_s = time.perf_counter() - t
        self._keep_spare(job.buffers)
        self._written += 1
        self._bytes_written += job.nbytes
        self._last_step = job.step

    def _cut(self, jobs: list[Snapshot | Layout]) -> None:
        """Close was cut short: a snapshot is too big to write synchronously; the older
        checkpoints stand."""
        lost = [s.step for s in jobs if isinstance(s, Snapshot)]
        if lost:
            logger.error("checkpoint(s) of step %s not confirmed written: close cut", lost)

    async def aclose(self, deadline: float) -> None:
        unwritten: list[int] = []
        try:
            await super().aclose(deadline)
        except TimeoutError:
            unwritten = [s.step for s in (self.current, *self.waiting) if isinstance(s, Snapshot)]
        if unwritten:
            raise TimeoutError(
                f"checkpoint(s) of step {unwritten} not confirmed written within the bus's "
                "flush_timeout; an unfinished write leaves no file behind"
            )

    def stats(self) -> Mapping[str, Any]:
        writing, pending = self.current, (self.waiting or (None,))[-1]
        return {
            "written": self._written,
            "superseded": self._superseded,
            "bytes_written": self._bytes_written,
            "last_step": self._last_step,
            "last_write_s": self._last_write_s,
            "writing_step": writing.step if isinstance(writing, Snapshot) else None,
            "pending_step": pending.step if isinstance(pending, Snapshot) else None,
            "spare_bytes": sum(t.numel() * t.element_size() for t in (self._spare or {}).values()),
        }

    # -- worker threads
    def _apart(self, fn: Callable[[A], R], arg: A) -> R:
        """Run ``fn(arg)`` in a thread of our own, lowered in priority: training keeps the CPU
        when cores are scarce, and no pooled anyio thread is left reniced (that cannot be
        undone without privileges).  The calling pool thread only waits for it."""
        results: list[R] = []
        errors: list[BaseException] = []

        def target() -> None:
            try:
                _lower_priority(self.nice)
                results.append(fn(arg))
            except BaseException as exc:
                errors.append(exc)

        # daemon: a write abandoned at the close deadline must not hold the process open;
        # the temporary file it may leave is removed by the next saver on this directory
        thread = threading.Thread(target=target, name="recis-checkpoint-writer", daemon=True)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return results[0]

    def _write(self, snap: Snapshot) -> None:
        tmp = os.path.join(
            self.output_dir, f"{TMP_PREFIX}{snap.step}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        )
        sink: _ErrorKeepingFile | None = None
        try:
            snap.wait_ready()  # the device copies into its buffers, queued on the step
            with atomic_path(snap.path, tmp) as path, open(path, "wb") as f:
                sink = _ErrorKeepingFile(f)
                torch.save(snap.payload, cast(BinaryIO, sink))  # duck-typed file
        except BaseException as exc:
            cause = exc if sink is None or sink.error is None else sink.error
            raise RuntimeError(
                f"cannot write the checkpoint of step {snap.step} to {snap.path}: "
                f"{type(cause).__name__}: {cause}"
            ) from cause
        self._prune()

    def _prune(self) -> None:
        if self.max_to_keep is None:
            return
        found = list_checkpoints(self.output_dir)
        for _step, path in found[: max(0, len(found) - self.max_to_keep)]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("could not remove old checkpoint %s: %s", path, exc)


class _ErrorKeepingFile:
    """File wrapper for ``torch.save``: torch reports a failed write as an opaque
    "unexpected pos" error, so the real ``OSError`` (disk full, file too large) is kept."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self._f.flush()


def _lower_priority(nice: int | None) -> None:
    """Renice the calling thread by ``nice`` (Linux: a thread is a schedulable task; elsewhere
    ``setpriority`` would renice the whole process, so it is left alone)."""
    if not nice or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        logger.debug("could not renice the checkpoint writer: %s", exc)
