"""Asynchronous checkpoints: snapshot on the step, write in the background, restore on resume.

:class:`CheckpointSaverHook` takes a snapshot of the model, the optimizer (and LR scheduler), the
step and every hook's ``state_dict()`` at a save point, with tensors cloned to CPU, so training
may go on mutating its tensors at once.  A background service writes the snapshot with
``torch.save`` in a worker thread, atomically (temporary file, ``fsync``, ``os.replace``), and
keeps the newest ``max_to_keep`` files ``checkpoint-<step>.pt``.  Memory stays bounded: one
snapshot is written at a time and at most one more waits; a newer snapshot replaces a waiting
one (it holds everything the older one had); the buffers of a finished one are reused.

:func:`restore_checkpoint` loads the newest checkpoint into the model and optimizer, hands each
hook on the bus its saved state (``load_state_dict``) and publishes ``AfterLoadCheckpoint``.
``global_step`` in both checkpoint events is the number of completed steps, the step to resume
from.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, TypeVar, cast

import anyio
import anyio.to_thread
import torch

from .. import dist
from .._checks import positive_int, positive_number, writable_dir
from ..events import AfterLoadCheckpoint, AfterStep, BeforeSaveCheckpoint, End
from ..hook import Hook
from ..priority import Priority
from ..service import yield_to_services

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointSaverHook",
    "latest_checkpoint",
    "latest_checkpoint_step",
    "list_checkpoints",
    "restore_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "recis_async.checkpoint/1"
_FILE = re.compile(r"^checkpoint-(\d+)\.pt$")
_TMP_PREFIX = ".checkpoint-"
_TMP_MARK = ".pt.tmp-"
_PLAIN = (type(None), bool, int, float, str, bytes)
_SAVE_AT_END = ("ok", "preempted")  # a failed or cancelled run may hold a broken model
_COPY_THREADS = 4  # at most this many threads copy a snapshot (memory bandwidth caps the gain)
_COPY_MIN_BYTES = 4 << 20  # a thread per this many bytes: smaller copies are not worth one

A = TypeVar("A")
R = TypeVar("R")


def checkpoint_path(output_dir: str, step: int) -> str:
    """Where the checkpoint of ``step`` completed steps lives."""
    return os.path.join(output_dir, f"checkpoint-{step}.pt")


def list_checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in ``output_dir``, oldest first.

    Temporary files of unfinished writes are never listed; a missing directory has none.
    """
    root = os.fspath(output_dir)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := _FILE.match(n))]
    return sorted(found)


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> tuple[int, str] | None:
    """``(step, path)`` of the newest checkpoint in ``output_dir``, or ``None``."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def latest_checkpoint_step(output_dir: str | os.PathLike[str]) -> int | None:
    """The step of the newest checkpoint in ``output_dir``, or ``None`` (a step source for
    :class:`~recis_async.hooks.GlobalStepWaiterHook`)."""
    found = latest_checkpoint(output_dir)
    return None if found is None else found[0]


# ---------------------------------------------------------------------- snapshots
Buffers = dict[str, torch.Tensor]  # a snapshot's CPU tensors by their place in the state


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identifies a view of memory: tied weights appear under several names, copied once."""
    return (
        t.untyped_storage().data_ptr(),
        t.device,
        t.dtype,
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
    )


class _Snapshot(NamedTuple):
    step: int
    path: str
    payload: dict[str, Any]
    nbytes: int
    buffers: Buffers


class _Copier:
    """Deep copy of a state tree with tensors copied to CPU (shared storage stays shared),
    refusing what ``torch.load(weights_only=True)`` could not read back.

    ``spare`` holds the CPU tensors of a snapshot that is no longer needed (written or
    superseded): a tensor of the same place, shape and dtype is overwritten in place instead
    of allocated, which spares the step the page faults of fresh memory.

    Strided tensors are copied by :meth:`finish`, not during the walk: the copies are split
    by size over the calling thread and helper threads (``Tensor.copy_`` releases the GIL),
    so the step waits for a fraction of one thread's memory copy.
    """

    def __init__(self, spare: Buffers | None = None) -> None:
        self.nbytes = 0
        self.buffers: Buffers = {}
        self._spare = spare or {}
        self._tensors: dict[tuple[Any, ...], torch.Tensor] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, source)

    def copy(self, obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, where)
        if type(obj) in _PLAIN:  # exact: numpy.float64 is a float but not loadable
            return obj
        if type(obj) in (dict, OrderedDict):
            out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self.copy(v, f"{where}[{k!r}]")
            metadata = getattr(obj, "_metadata", None)  # module versions in a state_dict
            if metadata is not None:
                out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
            return out
        if type(obj) in (list, tuple, torch.Size):
            return type(obj)(self.copy(v, f"{where}[{i}]") for i, v in enumerate(obj))
        raise TypeError(
            f"CheckpointSaverHook: {where} is a {type(obj).__module__}.{type(obj).__qualname__}; "
            "expected tensors, numbers, strings, bytes, None, or dicts/lists/tuples of those "
            "(what torch.load(weights_only=True) reads back)"
        )

    def _tensor(self, t: torch.Tensor, where: str) -> torch.Tensor:
        t = t.detach()
        if t.layout != torch.strided:  # sparse and friends: a plain copy, no reuse
            return t.to("cpu", copy=True)
        key = _storage_key(t)
        done = self._tensors.get(key)
        if done is not None:  # the same view seen under another name (tied weights)
            return done
        spare = self._spare.pop(where, None)
        if spare is not None and spare.shape == t.shape and spare.dtype == t.dtype:
            done = spare
        else:
            done = torch.empty_like(t, device="cpu")
        self._copies.append((done, t))
        self._tensors[key] = self.buffers[where] = done
        self.nbytes += done.numel() * done.element_size()
        return done

    def finish(self) -> None:
        """Copy every tensor the walk met, using up to :data:`_COPY_THREADS` threads."""
        copies, self._copies = self._copies, []
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in copies)
        threads = max(1, min(_COPY_THREADS, os.cpu_count() or 1, nbytes // _COPY_MIN_BYTES))
        shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(threads)]
        loads = [0] * threads
        by_size = sorted(copies, key=lambda c: c[0].numel() * c[0].element_size(), reverse=True)
        for dst, src in by_size:
            i = loads.index(min(loads))  # largest first, each to the least loaded share
            shares[i].append((dst, src))
            loads[i] += dst.numel() * dst.element_size()
        errors: list[BaseException] = []

        def run(share: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            try:
                for dst, src in share:
                    dst.copy_(src)
            except BaseException as exc:
                errors.append(exc)

        helpers = [
            threading.Thread(target=run, args=(share,), name="recis-checkpoint-copy")
            for share in shares[1:]
        ]
        for helper in helpers:
            helper.start()
        run(shares[0])
        for helper in helpers:
            helper.join()
        if errors:
            raise errors[0]


Layout = dict[str, tuple[torch.Size, torch.dtype]]


def _layout(obj: Any, where: str, out: Layout, seen: set[tuple[Any, ...]]) -> None:
    """Shapes and dtypes of the strided tensors :class:`_Copier` would copy, by place."""
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided:
            key = _storage_key(obj)
            if key not in seen:
                seen.add(key)
                out[where] = (obj.shape, obj.dtype)
    elif type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            _layout(v, f"{where}[{k!r}]", out, seen)
    elif type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _layout(v, f"{where}[{i}]", out, seen)


def _allocate(layout: Layout) -> Buffers:
    """Host buffers for a snapshot, their pages touched now rather than on the step."""
    return {where: torch.zeros(shape, dtype=dtype) for where, (shape, dtype) in layout.items()}


# ---------------------------------------------------------------------- the writer
class _CheckpointWriter:
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
        self._pending: _Snapshot | None = None
        self._writing: _Snapshot | None = None
        self._wake = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._closing = False
        self._written = 0
        self._superseded = 0
        self._bytes_written = 0
        self._last_step: int | None = None
        self._last_write_s = 0.0

    def submit(self, snap: _Snapshot) -> None:
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
                        self._apart, _allocate, layout, abandon_on_cancel=True
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

    def _write(self, snap: _Snapshot) -> None:
        tmp = os.path.join(
            self.output_dir, f"{_TMP_PREFIX}{snap.step}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
        )
        sink: _ErrorKeepingFile | None = None
        try:
            with open(tmp, "wb") as f:
                sink = _ErrorKeepingFile(f)
                torch.save(snap.payload, cast(BinaryIO, sink))  # duck-typed file
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, snap.path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            cause = exc if sink is None or sink.error is None else sink.error
            raise RuntimeError(
                f"cannot write the checkpoint of step {snap.step} to {snap.path}: "
                f"{type(cause).__name__}: {cause}"
            ) from cause
        _fsync_dir(self.output_dir)
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


def _fsync_dir(path: str) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_temporaries(output_dir: str) -> None:
    """Temporary files left by a process killed mid-write."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return  # the first write will report what is wrong with the directory
    for name in names:
        if name.startswith(_TMP_PREFIX) and _TMP_MARK in name:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(output_dir, name))
                logger.info("removed unfinished checkpoint file %s", name)


# ---------------------------------------------------------------------- the hook
def _has_state(owner: str, field: str, obj: Any, *, optional: bool) -> None:
    if obj is None and optional:
        return
    if not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
        expected = "an object with state_dict() and load_state_dict()"
        expected += " or None" if optional else ""
        raise TypeError(f"{owner}({field}=...): expected {expected}, got {obj!r}")


class CheckpointSaverHook(Hook):
    """Save ``model``/``optimizer``/``lr_scheduler``, the step and every hook's state.

    Save points: the training ``AfterStep`` of every ``save_steps``-th completed step (counted
    by the global step, so a resumed run keeps the cadence) or the first one ``save_secs``
    after the previous save (at most one of the two), and ``End`` when ``save_end`` and the run
    ended ``ok`` or ``preempted`` with steps not yet saved.  At a save point during the run it
    publishes ``BeforeSaveCheckpoint``, then reads every hook's ``state_dict()``; the save at
    ``End`` runs after every other ``End`` subscriber (the hook runs at ``Priority.VERY_LOW``).

    Host memory: at most one snapshot is being written and one waits; with ``reuse_buffers``
    the CPU tensors of the last snapshot written (or superseded) are kept and overwritten in
    place by the next one, which makes the copy on the step several times cheaper than fresh
    allocations, at the price of holding one snapshot's worth of host memory between saves
    (three at most).  The copy is split by size over up to four threads (one per 4 MiB, at most
    one per CPU): the step waits for its share of the memory bandwidth, not one thread's copy.

    The write runs in a thread of its own, on Linux reniced by ``writer_nice`` (``None``: not
    reniced), so that where cores are scarce the write yields the CPU to training rather than
    stretching the steps it overlaps.

    A write that fails (unwritable directory, full disk) leaves no file behind and raises
    :class:`~recis_async.HookError` at the next ``publish`` or at close.

    Distributed runs: add the saver on every rank.  At each save point all ranks meet at a
    barrier (``barrier_timeout`` seconds at most, the error naming the rank), then rank 0
    alone snapshots and writes: in data-parallel training every rank holds the same weights,
    and the barrier guarantees every rank finished the step being saved.  One saver per
    directory: unfinished temporary files found there when the hook is added to a bus are
    removed (on rank 0).
    """

    priority = Priority.VERY_LOW

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        save_steps: int | None = None,
        save_secs: float | None = None,
        max_to_keep: int | None = 5,
        save_end: bool = True,
        *,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        writer_nice: int | None = 10,
        reuse_buffers: bool = True,
        barrier_timeout: float = 300.0,
    ) -> None:
        owner = type(self).__name__
        positive_number(owner, "barrier_timeout", barrier_timeout)
        if save_steps is not None:
            positive_int(owner, "save_steps", save_steps)
        if save_secs is not None:
            positive_number(owner, "save_secs", save_secs)
        if save_steps is not None and save_secs is not None:
            raise ValueError(
                f"{owner}: expected at most one of save_steps or save_secs, got "
                f"save_steps={save_steps!r}, save_secs={save_secs!r}"
            )
        if not isinstance(save_end, bool):
            raise TypeError(f"{owner}(save_end=...): expected a bool, got {save_end!r}")
        if save_steps is None and save_secs is None and not save_end:
            raise ValueError(
                f"{owner}: expected save_steps, save_secs or save_end=True, got none of them "
                "(nothing would ever be saved)"
            )
        if max_to_keep is not None:
            positive_int(owner, "max_to_keep", max_to_keep)
        if writer_nice is not None and (
            isinstance(writer_nice, bool)
            or not isinstance(writer_nice, int)
            or not 0 <= writer_nice <= 19
        ):
            raise ValueError(
                f"{owner}(writer_nice=...): expected an int in 0..19 or None, got {writer_nice!r}"
            )
        _has_state(owner, "model", model, optional=False)
        _has_state(owner, "optimizer", optimizer, optional=True)
        _has_state(owner, "lr_scheduler", lr_scheduler, optional=True)
        self.output_dir = writable_dir(owner, "output_dir", output_dir)
        self.save_steps = save_steps
        self.save_secs = None if save_secs is None else float(save_secs)
        self.max_to_keep = max_to_keep
        self.save_end = save_end
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.writer_nice = writer_nice
        if not isinstance(reuse_buffers, bool):
            raise TypeError(f"{owner}(reuse_buffers=...): expected a bool, got {reuse_buffers!r}")
        self.reuse_buffers = reuse_buffers
        self.barrier_timeout = float(barrier_timeout)
        self._bus: HookBus | None = None
        self._writer: _CheckpointWriter | None = None
        self._last_step: int | None = None  # completed steps at the latest training AfterStep
        self._last_saved: int | None = None
        self._last_time = 0.0
        self._prewarmed = False

    @property
    def state_key(self) -> str:
        """One saver per directory may share a bus (say, frequent local + rare remote)."""
        return f"CheckpointSaverHook:{self.output_dir}"

    def outputs(self) -> dict[str, str]:
        where = os.path.abspath(self.output_dir)
        newest = latest_checkpoint(where) if self._last_saved is not None else None
        return {"checkpoints": f"{newest[1]} (the newest)" if newest else where}

    def attach(self, bus: HookBus) -> None:
        if self._writer is not None and not self._writer.finished.is_set():
            raise RuntimeError(f"{self!r} is already attached to a bus that is still open")
        self._bus = bus
        self._last_step = self._last_saved = None
        self._last_time = time.monotonic()
        self._prewarmed = False
        if bus.rank != 0:
            return  # other ranks only meet rank 0 at the barrier of each save
        _remove_stale_temporaries(self.output_dir)
        self._writer = _CheckpointWriter(
            self.output_dir, self.max_to_keep, self.writer_nice, self.reuse_buffers
        )
        bus.start_service(self._writer)

    async def after_step(self, event: AfterStep) -> None:
        if not event.is_train:
            return
        step = self._last_step = event.global_step + 1
        if self.save_steps is not None:
            due = step % self.save_steps == 0
        elif self.save_secs is not None:
            due = time.monotonic() - self._last_time >= self.save_secs
        else:
            due = False
        if due and step != self._last_saved:
            await self._save(step)
        elif not self._prewarmed and self.reuse_buffers and self._writer is not None:
            self._prewarmed = True  # the optimizer state exists from the first step on
            layout: Layout = {}
            seen: set[tuple[Any, ...]] = set()
            for where, state in self._own_states():
                _layout(state, where, layout, seen)
            self._writer.prewarm(layout)

    async def end(self, event: End) -> None:
        step = self._last_step
        if step is None:
            return
        if event.status not in _SAVE_AT_END:
            logger.info("no checkpoint at End: the run ended %r", event.status)
            return
        if self.save_end and step != self._last_saved:
            await self._save(step, at_end=True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # rank 0 writes alone: every rank's run ends once the last checkpoint is on disk,
            # so what follows training (evaluation, a restore) finds it on every rank
            if self._writer is not None:
                with anyio.move_on_after(self.barrier_timeout):
                    await self._writer.idle()
            await self._barrier(f"the barrier after checkpoint {step} was written")

    async def _save(self, step: int, *, at_end: bool = False) -> None:
        """Barrier with the other ranks, then (rank 0) publish ``BeforeSaveCheckpoint`` and
        take the snapshot.  At ``End`` a writer that already failed (and raised then) is
        only logged, after the barrier, so the other ranks are not left waiting."""
        bus = self._require_bus()
        if dist.is_initialized() and dist.get_world_size() > 1:
            await self._barrier(f"the barrier before checkpoint {step}")
        if self._writer is None:  # not rank 0
            self._last_saved = step
            return
        if at_end and self._writer.failure is not None:
            logger.error("no checkpoint at End (step %d): an earlier write failed", step)
            return
        path = checkpoint_path(self.output_dir, step)
        await bus.publish(BeforeSaveCheckpoint(global_step=step, path=path))
        self._take(bus, step, path)
        await yield_to_services()  # the write starts now, not at the bus's next yield

    async def _barrier(self, what: str) -> None:
        await anyio.to_thread.run_sync(
            functools.partial(dist.barrier, timeout=self.barrier_timeout, what=what)
        )

    def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        self._last_saved = event.global_step  # that state is on disk already

    def _take(self, bus: HookBus, step: int, path: str) -> None:
        """Snapshot on the step (tensors cloned to CPU) and hand it to the writer."""
        assert self._writer is not None and self.model is not None
        hooks: dict[str, Any] = {}
        for hook in bus.hooks:
            if hook is self:
                continue
            try:
                hooks[hook.state_key] = hook.state_dict()
            except Exception as exc:
                raise RuntimeError(f"{hook!r}.state_dict() failed: {exc}") from exc
        copier = _Copier(self._writer.take_spare())
        own = {
            where.split(".", 1)[0]: copier.copy(state, where) for where, state in self._own_states()
        }
        payload = {
            "format": CHECKPOINT_FORMAT,
            "global_step": step,
            "model": own["model"],
            "optimizer": own.get("optimizer"),
            "lr_scheduler": own.get("lr_scheduler"),
            "hooks": {
                key: copier.copy(state, f"hook state {key!r}") for key, state in hooks.items()
            },
        }
        copier.finish()
        self._writer.submit(_Snapshot(step, path, payload, copier.nbytes, copier.buffers))
        self._last_saved = step
        self._last_time = time.monotonic()

    async def flush(self) -> None:
        """Wait until every snapshot taken so far is on disk (or superseded by a newer one);
        raise if a write failed.  Meant for tests and tools: the training loop need not."""
        if self._writer is None:
            raise RuntimeError(f"{self!r} is not attached to a bus: bus.add_hook(hook) first")
        await self._writer.wait_idle()

    def _own_states(self) -> list[tuple[str, Any]]:
        """``(place, state_dict)`` of the model, optimizer and LR scheduler given."""
        owners: list[tuple[str, Any]] = [
            ("model.state_dict()", self.model),
            ("optimizer.state_dict()", self.optimizer),
            ("lr_scheduler.state_dict()", self.lr_scheduler),
        ]
        return [(where, obj.state_dict()) for where, obj in owners if obj is not None]

    def _require_bus(self) -> HookBus:
        if self._bus is None:
            raise RuntimeError(f"{self!r} is not attached to a bus: bus.add_hook(hook) first")
        return self._bus

    def __repr__(self) -> str:
        if self.save_steps is not None:
            every = f"save_steps={self.save_steps}"
        elif self.save_secs is not None:
            every = f"save_secs={self.save_secs}"
        else:
            every = "at End only"
        return f"<CheckpointSaverHook {self.output_dir} {every} max_to_keep={self.max_to_keep}>"


# ---------------------------------------------------------------------- restore
def _load(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        payload = torch.load(f, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(
            f"restore_checkpoint: {path} is not a recis_async checkpoint "
            f"(expected format {CHECKPOINT_FORMAT!r}, got {found!r})"
        )
    return payload


async def restore_checkpoint(
    bus: HookBus,
    output_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: Any = None,
    lr_scheduler: Any = None,
) -> int | None:
    """Load the newest checkpoint of ``output_dir``; return its step, or ``None`` if none.

    Loads ``model`` (strictly), ``optimizer`` and ``lr_scheduler`` when given, calls
    ``load_state_dict`` of every hook on ``bus`` whose ``state_key`` the checkpoint holds (each
    with its own copy), then publishes ``AfterLoadCheckpoint(global_step, path, hook_states)``
    so hooks can react with their state already in place.  Reading runs in a worker thread;
    the file is read with ``torch.load(weights_only=True)``.
    """
    _has_state("restore_checkpoint", "model", model, optional=False)
    _has_state("restore_checkpoint", "optimizer", optimizer, optional=True)
    _has_state("restore_checkpoint", "lr_scheduler", lr_scheduler, optional=True)
    found = await anyio.to_thread.run_sync(latest_checkpoint, output_dir)
    if found is None:
        logger.info("no checkpoint in %s: starting from scratch", os.fspath(output_dir))
        return None
    path = found[1]
    payload = await anyio.to_thread.run_sync(_load, path)
    step = payload.get("global_step")
    if type(step) is not int:
        raise ValueError(f"restore_checkpoint: {path} has no int global_step, got {step!r}")
    model.load_state_dict(payload["model"])
    for field, target in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler)):
        if target is None:
            continue
        if payload.get(field) is None:
            raise ValueError(
                f"restore_checkpoint({field}=...): {path} holds no {field} state; "
                f"pass {field}=None to restore without it"
            )
        target.load_state_dict(payload[field])
    hook_states: dict[str, Any] = payload.get("hooks") or {}
    on_bus = {hook.state_key: hook for hook in bus.hooks}
    for key, state in hook_states.items():
        hook = on_bus.get(key)
        if hook is None:
            if state:
                logger.warning("%s holds state for %r: no such hook on the bus", path, key)
            continue
        hook.load_state_dict(copy.deepcopy(state))
    logger.info("restored %s (step %d)", path, step)
    await bus.publish(AfterLoadCheckpoint(global_step=step, path=path, hook_states=hook_states))
    return step
