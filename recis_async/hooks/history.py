"""HistorySaverHook: mean and total training loss per interval, kept as rows and in a CSV."""

from __future__ import annotations

import csv
import math
import os
import uuid
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .._checks import positive_int, writable_dir
from .._files import atomic_path
from ..events import AfterLoadCheckpoint, AfterStep, End
from ..hook import Hook
from ..jobs import JobQueue

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["HistorySaverHook"]

COLUMNS = ("mean_losses", "total_losses", "steps")
_QUEUE = 64  # writes waiting before the step waits (each a few rows)

_Op = tuple[str, list[dict[str, Any]]]  # ("rewrite" | "append", rows)


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
        kind, rows = op
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
        self._rows: list[dict[str, Any]] = []
        self._total = 0.0  # loss summed over the samples of the open interval
        self._samples = 0
        self._last_step: int | None = None
        self._writer: JobQueue[_Op] | None = None
        self._synced = False  # the file holds exactly self._rows (else: rewrite it whole)

    @property
    def history(self) -> list[dict[str, Any]]:
        """One dict per closed interval: ``mean_losses``, ``total_losses``, ``steps``."""
        return [dict(row) for row in self._rows]

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

    async def after_step(self, event: AfterStep) -> None:
        if not event.is_train:
            return
        try:
            loss = float(event.metrics[self.loss_key])
        except KeyError:
            raise KeyError(
                f"HistorySaverHook: AfterStep(global_step={event.global_step}).metrics has no "
                f"{self.loss_key!r} (got {sorted(event.metrics)}); record it with "
                f"add_metric({self.loss_key!r}, loss) or pass loss_key="
            ) from None
        except TypeError:
            raise TypeError(
                f"HistorySaverHook: metrics[{self.loss_key!r}] at global_step "
                f"{event.global_step}: expected a number, got {event.metrics[self.loss_key]!r}"
            ) from None
        samples = event.samples if event.samples > 0 else 1
        self._total += loss * samples
        self._samples += samples
        self._last_step = event.global_step + 1
        if self._last_step % self.every_n_step == 0:
            await self._close_interval()

    async def end(self, event: End) -> None:
        if self._samples:
            await self._close_interval()
        elif not self._synced:
            await self._send("rewrite", [])

    async def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        self._synced = False  # drop rows the file may hold from after the checkpoint
        await self._send("rewrite", [])

    def state_dict(self) -> dict[str, Any]:
        return {
            "rows": [dict(row) for row in self._rows],
            "total": self._total,
            "samples": self._samples,
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rows = [dict(row) for row in state["rows"]]
        self._total = float(state["total"])
        self._samples = int(state["samples"])
        self._last_step = state["last_step"]
        self._synced = False

    async def _close_interval(self) -> None:
        row = {
            "mean_losses": self._total / self._samples if self._samples else math.nan,
            "total_losses": self._total,
            "steps": self._last_step,
        }
        self._rows.append(row)
        self._total, self._samples = 0.0, 0
        await self._send("append", [dict(row)])

    async def _send(self, kind: str, rows: list[dict[str, Any]]) -> None:
        if self._writer is None:
            return
        if not self._synced:  # the first write of a run, or after a restore: the whole history
            kind, rows = "rewrite", [dict(r) for r in self._rows]
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
