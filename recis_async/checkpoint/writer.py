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
from .files import TMP_MARK, TMP_PREFIX, list_checkpoints
from .snapshot import Buffers, Layout, Snapshot, allocate

__all__ = ["CheckpointWriter"]

logger = logging.getLogger(__name__)

A = TypeVar("A")
R = TypeVar("R")


class CheckpointWriter:
    """Background service: writes one snapshot at a time, at most one more waits."""

    def __init__(
        self, output_dir: str, max_to_keep: int | None, nice: int | None, reuse: bool
    ) -> None:
        self.name = f"CheckpointSaverHook({output_dir})"
        self.output_dir = output_dir
        self.max_to_keep = max_to_keep
        self.nice = nice
        self.reuse = reuse
        self._spare: Buffers | None = None
        self._layout: Layout | None = None  # buffers to allocate ahead of the first snapshot
        self.failure: BaseException | None = None
        self.finished = anyio.Event()
        self._pending: Snapshot | None = None
        self._writing: Snapshot | None = None
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._closing = False
        self._written = 0
        self._superseded = 0
        self._bytes_written = 0
        self._last_step: int | None = None
        self._last_write_s = 0.0

    def submit(self, snap: Snapshot) -> None:
        """Queue ``snap``; a snapshot still waiting is replaced (the newer holds all it had)."""
        if self.failure is not None:
            raise RuntimeError(
                f"checkpoint of step {snap.step} not taken: an earlier write failed "
                f"({self.failure})"
            ) from self.failure
        if self._closing:
            raise RuntimeError(f"checkpoint of step {snap.step} not taken: the writer is closed")
        if self._pending is not None:
            self._superseded += 1
            self._keep_spare(self._pending.buffers)
            logger.warning(
                "checkpoint of step %d superseded by step %d before it was written "
                "(writes are slower than save_steps/save_secs)",
                self._pending.step,
                snap.step,
            )
        self._pending = snap
        if self._idle.is_set():
            self._idle = anyio.Event()
        self._wake.set()

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
        if self.reuse and self._spare is None and not self._closing:
            self._layout = layout
            if self._idle.is_set():
                self._idle = anyio.Event()
            self._wake.set()

    async def idle(self) -> None:
        """Return once nothing is queued, written or allocated (or the writer stopped)."""
        await self._idle.wait()

    async def wait_idle(self) -> None:
        """Return once nothing is queued, written or allocated; raise if the writer failed."""
        await self.idle()
        if self.failure is not None:
            raise RuntimeError(f"checkpoint writer failed: {self.failure}") from self.failure

    async def run(self) -> None:
        try:
            while True:
                snap = self._pending
                if snap is None and self._layout is not None and not self._closing:
                    layout, self._layout = self._layout, None
                    buffers = await anyio.to_thread.run_sync(
                        self._apart, allocate, layout, abandon_on_cancel=True
                    )
                    if self._spare is None:
                        self._spare = buffers
                    continue
                if snap is None:
                    self._idle.set()
                    if self._closing:
                        return
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                self._pending = None
                self._writing = snap
                t = time.perf_counter()
                await anyio.to_thread.run_sync(
                    self._apart, self._write, snap, abandon_on_cancel=True
                )
                self._last_write_s = time.perf_counter() - t
                self._writing = None
                self._keep_spare(snap.buffers)
                self._written += 1
                self._bytes_written += snap.nbytes
                self._last_step = snap.step
        except anyio.get_cancelled_exc_class():
            # close was cut short: too big to write synchronously; older checkpoints stand
            lost = [s.step for s in (self._writing, self._pending) if s is not None]
            if lost:
                logger.error("checkpoint(s) of step %s not confirmed written: close cut", lost)
            raise
        except BaseException as exc:
            self.failure = exc
            if self._pending is not None:
                logger.error(
                    "checkpoint of step %d not written: the writer failed", self._pending.step
                )
                self._pending = None
            raise
        finally:
            self.finished.set()
            self._idle.set()  # nothing more will be written: release waiters

    async def aclose(self, deadline: float) -> None:
        self._closing = True
        self._wake.set()
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            await self.finished.wait()
        if not self.finished.is_set():
            unwritten = [s.step for s in (self._writing, self._pending) if s is not None]
            raise TimeoutError(
                f"checkpoint(s) of step {unwritten} not confirmed written within the bus's "
                "flush_timeout; an unfinished write leaves no file behind"
            )

    def stats(self) -> Mapping[str, Any]:
        return {
            "written": self._written,
            "superseded": self._superseded,
            "bytes_written": self._bytes_written,
            "last_step": self._last_step,
            "last_write_s": self._last_write_s,
            "writing_step": None if self._writing is None else self._writing.step,
            "pending_step": None if self._pending is None else self._pending.step,
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
