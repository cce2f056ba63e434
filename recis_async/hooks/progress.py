"""ProgressBarHook: a tqdm bar over training steps with ETA and the latest metrics."""

from __future__ import annotations

import functools
import numbers
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import IO, TYPE_CHECKING, Any

import anyio.to_thread
import torch

from .._checks import boolean, positive_int, positive_number
from ..console import route_logging_through_bar
from ..events import AfterStep, BeforeStep, End
from ..hook import Hook
from ..reads import ReadQueue
from ..window import read_values

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["ProgressBarHook"]


class ProgressBarHook(Hook):
    """A ``tqdm`` progress bar: one tick per completed training step.

    ``total`` is the number of steps of the whole run (a ``Trainer`` fills it in from its
    ``TrainingArguments`` when left ``None``: ``train_steps``, else ``train_epoch`` passes over
    a dataset with ``len()``); with a total the bar shows the ETA.  The bar opens at the first
    training step and starts at that step, so a resumed run shows its true position.  The
    postfix shows the latest step's numeric metrics (or only ``metrics`` when given).  Metrics
    recorded as one-element tensors are not read on the step: at most every ``mininterval``
    seconds (the bar's refresh) the latest ones are read in a worker thread and shown once
    read, so the postfix may trail the bar by a refresh; at ``End`` the last values are read and
    shown before the bar closes.  While the
    bar is shown, log lines to the console (handlers of the root and ``recis_async`` loggers
    writing to stdout, stderr or ``file``) are written through tqdm, so each sits on its own
    line above the bar, in a terminal and in a redirected file alike.  Rank 0 only.
    Needs the ``progress`` extra: ``pip install 'recis_async[progress]'``.

    Args:
        total: steps of the whole run, for the ETA; the Trainer fills it in when ``None``.
        desc: the bar's label.
        metrics: the metric names shown in the postfix; default all numeric ones.
        file: where the bar is drawn; default stderr.
        leave: keep the finished bar on screen.
        mininterval: seconds between redraws.

    Raises:
        ImportError: tqdm is not installed (the ``progress`` extra).
        TypeError: a ``total`` that is not an int, ``metrics``, ``desc`` or ``file`` of the
            wrong type.
        ValueError: a ``total`` below 1.
    """

    rank_zero_only = True

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str = "Training",
        metrics: Iterable[str] | None = None,
        file: IO[str] | None = None,
        leave: bool = True,
        mininterval: float = 0.1,
    ) -> None:
        owner = type(self).__name__
        try:
            from tqdm import tqdm
        except ImportError as exc:
            raise ImportError(
                f"{owner} needs tqdm, which is not installed: pip install 'recis_async[progress]'"
            ) from exc
        self._tqdm = tqdm
        self.total = None if total is None else positive_int(owner, "total", total)
        names: list[Any] | None = None
        if metrics is not None:
            if isinstance(metrics, Iterable) and not isinstance(metrics, str):
                names = list(metrics)
            if names is None or not all(isinstance(m, str) and m for m in names):
                raise TypeError(f"{owner}(metrics=...): expected a list of names, got {metrics!r}")
        self.metrics = names
        if not isinstance(desc, str):
            raise TypeError(f"{owner}(desc=...): expected a str, got {desc!r}")
        if file is not None and not callable(getattr(file, "write", None)):
            raise TypeError(f"{owner}(file=...): expected a text stream or None, got {file!r}")
        self.desc = desc
        self.file = file
        self.leave = boolean(owner, "leave", leave)
        self.mininterval = positive_number(owner, "mininterval", mininterval)
        self._bar: Any = None
        self._unroute: Callable[[], None] | None = None
        self._latest: dict[str, Any] = {}  # shown values not read yet (device tensors)
        self._next_read = 0.0  # monotonic time of the next read of tensor values
        self._reads = ReadQueue("ProgressBarHook.read", capacity=1, on_error=self.on_error)

    def attach(self, bus: HookBus) -> None:
        self._reads.start(bus)

    def before_step(self, event: BeforeStep) -> None:
        if event.is_train and self._bar is None:
            self._bar = self._tqdm(
                total=self.total,
                initial=event.global_step,
                desc=self.desc,
                unit="step",
                file=self.file,
                leave=self.leave,
                mininterval=self.mininterval,
                dynamic_ncols=True,
            )
            self._unroute = route_logging_through_bar(self._tqdm, self.file)

    def after_step(self, event: AfterStep) -> Awaitable[None] | None:
        """Sync; a coroutine (the read handed to the worker) at a refresh with tensors."""
        bar = self._bar
        if not event.is_train or bar is None:
            return None
        metrics = event.metrics
        names = metrics if self.metrics is None else self.metrics
        postfix = {
            name: metrics[name] for name in names if isinstance(metrics.get(name), numbers.Real)
        }
        read = None
        if len(postfix) < len(names) and _tensor_scalars(metrics, names, postfix):
            self._latest = postfix  # numbers and device values: read at the next refresh
            now = time.monotonic()
            if now >= self._next_read and not self._reads.busy:
                self._next_read = now + self.mininterval
                self._latest = {}
                read = self._reads.put(functools.partial(read_values, postfix), self._show)
        elif postfix:
            self._latest = {}
            bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        return read

    def _show(self, values: Mapping[str, Any]) -> None:
        """Values read off the step: the postfix of the next redraw."""
        if self._bar is not None:
            self._bar.set_postfix(values, refresh=False)

    def end(self, event: End) -> Awaitable[None] | None:
        """Sync (so it still runs when an ``End`` subscriber before it overran the close
        deadline); a coroutine only while tensor values wait to be read for the last postfix."""
        if self._bar is not None and (self._latest or self._reads.busy):
            return self._last_values_then_close()
        self._close()
        return None

    async def _last_values_then_close(self) -> None:
        try:
            await self._reads.wait_idle()
            if self._latest:  # the last values, read now (the run is over)
                self._show(await anyio.to_thread.run_sync(read_values, self._latest))
                self._latest = {}
                self._bar.refresh()
        finally:
            self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._unroute is not None:
            self._unroute()
            self._unroute = None

    def __repr__(self) -> str:
        return f"<ProgressBarHook total={self.total}>"


def _tensor_scalars(metrics: Mapping[str, Any], names: Iterable[str], into: dict[str, Any]) -> bool:
    """Add the one-element tensors among ``names`` to ``into`` (their shape says so: no read);
    whether there were any."""
    found = False
    for name in names:
        value = metrics.get(name)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            into[name] = value
            found = True
    return found
