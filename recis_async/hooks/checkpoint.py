"""CheckpointSaverHook: when to save and what a checkpoint holds.

At a save point the hook takes a snapshot of the model, the optimizer (and LR scheduler), the
step and every hook's ``state_dict()`` into host buffers (:mod:`recis_async.checkpoint.snapshot`),
so training may go on mutating its tensors at once, and hands it to the background writer
(:mod:`recis_async.checkpoint.writer`).  The files, and :func:`restore_checkpoint` which loads
the newest one back, are in :mod:`recis_async.checkpoint.files`; ``global_step`` in both
checkpoint events is the number of completed steps, the step to resume from.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch

from .. import dist
from .._checks import positive_int, positive_number, stateful, writable_dir
from ..checkpoint.files import (
    CHECKPOINT_FORMAT,
    checkpoint_path,
    latest_checkpoint,
    remove_stale_temporaries,
)
from ..checkpoint.snapshot import Copier, Layout, Snapshot, layout_of
from ..checkpoint.writer import CheckpointWriter
from ..events import AfterLoadCheckpoint, AfterStep, BeforeSaveCheckpoint, End
from ..hook import Hook
from ..priority import Priority
from ..service import yield_to_services
from ..subscription import Filters, is_train

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["CheckpointSaverHook"]

logger = logging.getLogger(__name__)

_SAVE_AT_END = ("ok", "preempted")  # a failed or cancelled run may hold a broken model


class CheckpointSaverHook(Hook):
    """Save ``model``/``optimizer``/``lr_scheduler``, the step and every hook's state.

    Save points: the training ``AfterStep`` of every ``save_steps``-th completed step (counted
    by the global step, so a resumed run keeps the cadence) or the first one ``save_secs``
    after the previous save (at most one of the two), and ``End`` when ``save_end`` and the run
    ended ``ok`` or ``preempted`` with steps not yet saved.  At a save point during the run it
    publishes ``BeforeSaveCheckpoint``, then reads every hook's ``state_dict()``; the save at
    ``End`` runs after every other ``End`` subscriber (the hook runs at ``Priority.VERY_LOW``).
    A stop signal ends the run at a step boundary, so the save at ``End`` holds every step
    whose ``AfterStep`` ran (and whose trace rows a :class:`~recis_async.hooks.TraceHook`
    took): a run resumed from it continues at exactly the next step, with the
    :class:`~recis_async.Trainer`'s data position saved among the hooks' states.

    Host memory: at most one snapshot is being written and one waits; with ``reuse_buffers``
    the CPU tensors of the last snapshot written (or superseded) are kept and overwritten in
    place by the next one, which makes the copy on the step several times cheaper than fresh
    allocations, at the price of holding one snapshot's worth of host memory between saves
    (three at most).  CUDA tensors are copied into page-locked buffers without the step
    waiting: the copies are queued on the current stream and the writer's thread waits for
    them (an event) before it writes.  The copy is split by size over up to four threads (one
    per 4 MiB, at most one per CPU): the step waits for its share of the memory bandwidth, not
    one thread's copy.

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

    Every argument after ``output_dir`` is keyword-only: ``CheckpointSaverHook(dir, 600)``,
    ported from TensorFlow (where it means every 600 seconds), fails with a ``TypeError``
    saying so instead of saving every 600 steps.

    Args:
        output_dir: where ``checkpoint-<step>.pt`` files go (created if missing).
        positional: refused (every other argument is keyword-only; see above).
        save_steps: save every this many completed training steps.
        save_secs: or: save at the first step this many seconds after the previous save.
        max_to_keep: keep the newest this many files; ``None`` keeps all.
        save_end: save at ``End`` when the run ended ok or preempted.
        model: the model to save (required).
        optimizer: its optimizer, or ``None``.
        lr_scheduler: its LR scheduler, or ``None``.
        barrier_timeout: seconds the ranks may wait for each other at a save.
        writer_nice: how much to renice the writing thread (Linux); ``None``: not at all.
        reuse_buffers: keep a snapshot's host buffers for the next one.

    Raises:
        TypeError: an argument after ``output_dir`` given by position; a ``model``,
            ``optimizer`` or ``lr_scheduler`` without
            ``state_dict``/``load_state_dict``, a count of the wrong type.
        ValueError: both ``save_steps`` and ``save_secs``, no save point at all, a count or
            timeout out of range, an unwritable ``output_dir``.
    """

    priority = Priority.VERY_LOW

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *positional: Any,
        save_steps: int | None = None,
        save_secs: float | None = None,
        max_to_keep: int | None = 5,
        save_end: bool = True,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        writer_nice: int | None = 10,
        reuse_buffers: bool = True,
        barrier_timeout: float = 300.0,
    ) -> None:
        owner = type(self).__name__
        if positional:
            # TensorFlow's CheckpointSaverHook(dir, 600) means every 600 *seconds*; read here
            # as steps it would save 600 times more rarely or often than meant: refuse it.
            raise TypeError(
                f"{owner}(output_dir, ...): expected every argument after output_dir by "
                f"keyword (save_steps=N or save_secs=S), got {len(positional)} more "
                f"positional: {', '.join(repr(a) for a in positional)} (TensorFlow's second "
                "positional argument is save_secs)"
            )
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
        stateful(owner, "model", model, optional=False)
        stateful(owner, "optimizer", optimizer, optional=True)
        stateful(owner, "lr_scheduler", lr_scheduler, optional=True)
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
        self._writer: CheckpointWriter | None = None
        if save_steps is not None:  # the bus calls after_step at the save steps only
            self.subscription_filters = {
                "after_step": Filters(every_step=save_steps, when=is_train)
            }
        self._last_saved: int | None = None
        self._last_time = 0.0

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
        self._last_saved = None
        self._last_time = time.monotonic()
        if bus.rank != 0:
            return  # other ranks only meet rank 0 at the barrier of each save
        remove_stale_temporaries(self.output_dir)
        self._writer = CheckpointWriter(
            self.output_dir, self.max_to_keep, self.writer_nice, self.reuse_buffers
        )
        bus.start_service(self._writer)
        if self.reuse_buffers:  # the optimizer state exists from the first step on
            bus.subscribe(AfterStep, self._prewarm, once=1, when=is_train, priority=Priority.LOWEST)

    def after_step(self, event: AfterStep) -> Awaitable[None] | None:
        """Sync; the save (a coroutine) at a save step.  With ``save_steps`` the bus calls it
        at the training steps of that cadence only (``subscription_filters``), not on every
        step; with ``save_secs`` on every step, to look at the clock."""
        if self.save_steps is None and (
            self.save_secs is None
            or not event.is_train
            or time.monotonic() - self._last_time < self.save_secs
        ):
            return None
        step = event.global_step + 1
        return self._save(step) if step != self._last_saved else None

    def _prewarm(self, event: AfterStep) -> None:
        """Lay out the write buffers of the first save after the first training step, unless
        that step saved (its write comes first; it keeps its buffers for the next)."""
        if self._writer is not None and self._last_saved != event.global_step + 1:
            layout: Layout = {}
            seen: set[tuple[Any, ...]] = set()
            for where, state in self._own_states():
                layout_of(state, where, layout, seen)
            self._writer.prewarm(layout)

    async def end(self, event: End) -> None:
        step = self._require_bus().steps_done
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
                    await self._writer.wait_idle()
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
            functools.partial(
                dist.barrier,
                device=dist.collective_device(),  # read here, on the loop's thread
                timeout=self.barrier_timeout,
                what=what,
            )
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
        copier = Copier(self._writer.take_spare())
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
        self._writer.submit(
            Snapshot(step, path, payload, copier.nbytes, copier.buffers, copier.ready)
        )
        self._last_saved = step
        self._last_time = time.monotonic()

    async def flush(self) -> None:
        """Wait until every snapshot taken so far is on disk (or superseded by a newer one);
        raise if a write failed.  Meant for tests and tools: the training loop need not."""
        if self._writer is None:
            raise RuntimeError(f"{self!r} is not attached to a bus: bus.add_hook(hook) first")
        await self._writer.wait_written()

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
