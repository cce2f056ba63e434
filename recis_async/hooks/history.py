"""HistorySaverHook: mean and total training loss per interval, kept as rows and in a CSV."""

from __future__ import annotations

import csv
import math
import os
import uuid
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch

from .._checks import positive_int, writable_dir
from .._files import atomic_path
from ..events import AfterLoadCheckpoint, AfterStep, End
from ..hook import Hook
from ..jobs import JobQueue
from ..window import MetricWindow, WindowSnapshot

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["HistorySaverHook"]

COLUMNS = ("mean_losses", "total_losses", "steps")
_QUEUE = 64  # writes waiting before the step waits (each a few rows)


class _Row:
    """One interval's row; its loss sum may be a device value until first asked for (read
    then, once: in the writer's worker thread, or where ``history``/``state_dict`` runs)."""

    __slots__ = ("_carried", "_samples", "_snapshot", "_values", "steps")

    def __init__(self, steps: int | None, snapshot: WindowSnapshot, samples: int, carried: float):
        self.steps = steps
        self._snapshot: WindowSnapshot | None = snapshot
        self._samples = samples
        self._carried = carried  # the interval's sum restored from a checkpoint
        self._values: dict[str, Any] | None = None

    @classmethod
    def plain(cls, values: dict[str, Any]) -> _Row:
        row = cls(values.get("steps"), WindowSnapshot({}, 0, 0), 0, 0.0)
        row._values = dict(values)
        return row

    def values(self) -> dict[str, Any]:
        """The row on the host (reads a device sum the first time)."""
        if self._values is None:
            snapshot = self._snapshot
            assert snapshot is not None
            total = self._carried + sum(float(s.sum) for s in snapshot.read().values())
            self._values = {
                "mean_losses": total / self._samples if self._samples else math.nan,
                "total_losses": total,
                "steps": self.steps,
            }
            self._snapshot = None
        return dict(self._values)


_Op = tuple[str, list[_Row]]  # ("rewrite" | "append", rows)


class _CsvFile:
    """The history CSV, written off the step: a job appends rows or rewrites it atomically."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def write(self, op: _Op) -> None:
        await anyio.to_thread.run_sync(self.apply, op)

    def keep(self, ops: list[_Op]) -> None:
        """Close was cut short (a second stop signal): the queued rows are a few bytes, so
        write them here and now rather than lose them."""
        for op in ops:
            self.apply(op)

    def apply(self, op: _Op) -> None:
        kind, rows = op[0], [row.values() for row in op[1]]  # a device sum is read here
        if kind == "rewrite":
            tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:12]}"
            with atomic_path(self.path, tmp), open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS)
                writer.writeheader()
                writer.writerows(rows)
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=COLUMNS).writerows(rows)


class HistorySaverHook(Hook):
    """Record the training loss per interval of ``every_n_step`` steps, TensorFlow style.

    For each interval (closed at the completed steps ``n, 2n, ...`` of the global step, and at
    ``End`` for a partial one) a row ``{"mean_losses", "total_losses", "steps"}``:
    ``mean_losses`` is the per-sample mean loss over the interval and ``total_losses`` the loss
    summed over its samples (each step's ``metrics[loss_key]`` is taken as the mean over its
    ``AfterStep.samples`` rows; a step without ``samples`` counts as one), ``steps`` the
    completed steps at the end of the interval.  ``.history`` returns the rows (for
    ``pandas.DataFrame(hook.history)``).

    A loss recorded as a tensor (one element, any device) is summed on its device
    (:class:`~recis_async.window.MetricWindow`) and an interval's sum is read once, off the
    step: by the CSV writer's worker thread, or when ``.history`` or ``state_dict()`` is asked
    for (a checkpoint save).

    With ``output_dir`` the rows also go to ``<output_dir>/history.csv``
    (``history-rank<r>.csv`` when several ranks run), written by a background service, never on
    the step.  A fresh run replaces the file; a restored run rewrites it from the restored
    history, so rows of steps after the checkpoint are not duplicated.

    Args:
        every_n_step: completed training steps per interval (one row each).
        output_dir: where ``history.csv`` goes; ``None`` keeps the rows in memory only.
        loss_key: the name of the loss in ``AfterStep.metrics``.

    Raises:
        TypeError: an ``every_n_step`` that is not an int.
        ValueError: an ``every_n_step`` below 1, an unwritable ``output_dir``, an empty
            ``loss_key``.
    """

    def __init__(
        self,
        every_n_step: int,
        output_dir: str | os.PathLike[str] | None = None,
        *,
        loss_key: str = "loss",
    ) -> None:
        owner = type(self).__name__
        self.every_n_step = positive_int(owner, "every_n_step", every_n_step)
        self.output_dir = (
            None if output_dir is None else writable_dir(owner, "output_dir", output_dir)
        )
        if not isinstance(loss_key, str) or not loss_key:
            raise ValueError(f"{owner}(loss_key=...): expected a metric name, got {loss_key!r}")
        self.loss_key = loss_key
        self.path: str | None = None
        self._rows: list[_Row] = []
        self._window = MetricWindow(keep=("sum",))  # the open interval's loss x samples
        self._carried = 0.0  # the open interval's host sum (numbers, a restored state)
        self._samples = 0
        self._last_step: int | None = None
        self._writer: JobQueue[_Op] | None = None
        self._synced = False  # the file holds exactly self._rows (else: rewrite it whole)

    @property
    def history(self) -> list[dict[str, Any]]:
        """One dict per closed interval: ``mean_losses``, ``total_losses``, ``steps`` (a sum
        still on the device is read here)."""
        return [row.values() for row in self._rows]

    def outputs(self) -> dict[str, str]:
        if self.output_dir is None:
            return {}
        return {"loss history": os.path.abspath(self.path or self.output_dir)}

    def attach(self, bus: HookBus) -> None:
        if self.output_dir is None:
            return
        name = "history.csv" if bus.world_size <= 1 else f"history-rank{bus.rank}.csv"
        self.path = os.path.join(self.output_dir, name)
        file = _CsvFile(self.path)
        self._writer = JobQueue(
            f"HistorySaverHook({self.path})", file.write, capacity=_QUEUE, on_cancel=file.keep
        )
        self._synced = False
        bus.start_service(self._writer)

    def after_step(self, event: AfterStep) -> Awaitable[None] | None:
        """Sync on most steps; the interval's close is awaited (its row queued)."""
        if not event.is_train:
            return None
        try:
            loss = event.metrics[self.loss_key]
        except KeyError:
            raise KeyError(
                f"HistorySaverHook: AfterStep(global_step={event.global_step}).metrics has no "
                f"{self.loss_key!r} (got {sorted(event.metrics)}); record it with "
                f"add_metric({self.loss_key!r}, loss) or pass loss_key="
            ) from None
        samples = event.samples if event.samples > 0 else 1
        if type(loss) is not float:
            loss = self._checked(loss, event.global_step)
        if type(loss) is float:
            self._carried += loss * samples
        else:  # a tensor: summed on its device
            self._window.add({self.loss_key: loss}, samples)
        self._samples += samples
        self._last_step = event.global_step + 1
        if self._last_step % self.every_n_step == 0:
            return self._close_interval()
        return None

    def _checked(self, loss: Any, step: int) -> Any:
        """A one-element tensor as it is (read later), else the loss as a float."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:  # its shape: no read
            return loss
        try:
            if isinstance(loss, torch.Tensor):
                raise TypeError
            return float(loss)
        except TypeError:
            shown = (
                f"a tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else repr(loss)
            )
            raise TypeError(
                f"HistorySaverHook: metrics[{self.loss_key!r}] at global_step "
                f"{step}: expected a number, got {shown}"
            ) from None

    async def end(self, event: End) -> None:
        if self._samples:
            await self._close_interval()
        elif not self._synced:
            await self._send("rewrite", [])

    async def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        self._synced = False  # drop rows the file may hold from after the checkpoint
        await self._send("rewrite", [])

    def state_dict(self) -> dict[str, Any]:
        """The rows and the open interval (a device sum is read here: a save boundary)."""
        open_sum = self._carried + sum(
            float(s.sum) for s in self._window.peek().read().values()
        )
        return {
            "rows": self.history,
            "total": open_sum,
            "samples": self._samples,
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rows = [_Row.plain(row) for row in state["rows"]]
        self._window = MetricWindow(keep=("sum",))
        self._carried = float(state["total"])
        self._samples = int(state["samples"])
        self._last_step = state["last_step"]
        self._synced = False

    async def _close_interval(self) -> None:
        row = _Row(self._last_step, self._window.take(), self._samples, self._carried)
        self._rows.append(row)
        self._carried, self._samples = 0.0, 0
        await self._send("append", [row])

    async def _send(self, kind: str, rows: list[_Row]) -> None:
        if self._writer is None:
            return
        if not self._synced:  # the first write of a run, or after a restore: the whole history
            kind, rows = "rewrite", list(self._rows)
        try:
            await self._writer.put((kind, rows))
        except RuntimeError as exc:
            raise RuntimeError(
                f"HistorySaverHook: the writer of {self.path} is gone (it failed earlier or "
                "the bus is closing); rows not written"
            ) from exc
        self._synced = True

    def __repr__(self) -> str:
        return f"<HistorySaverHook every_n_step={self.every_n_step} path={self.path}>"
