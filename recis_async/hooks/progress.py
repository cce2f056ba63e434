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
from ..subscription import Filters, is_train
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
    postfix shows the numeric metrics (or only ``metrics`` when given) of the step the bar is
    redrawn at: they are formatted only then (tqdm redraws at most every ``mininterval``
    seconds), not on every step.  Metrics recorded as one-element tensors are not read on the
    step: when the bar is about to redraw (at most every ``mininterval`` seconds) the latest
    ones are read in a worker thread and shown once read, so the postfix may trail the bar by a
    refresh.  At ``End`` the last step's values are read and shown before the bar closes.
    While the
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
        # the metrics of the latest step, not in the postfix yet (the bar shows them when it
        # redraws; numbers are formatted, tensors read, only then)
        self._unshown: Mapping[str, Any] | None = None
        self._next_read = 0.0  # monotonic time of the next read of tensor values
        self._ticks = 0  # steps done that the bar has not been told of yet
        self._reads = ReadQueue("ProgressBarHook.read", capacity=1, on_error=self.on_error)
        # the bar opens at the first training step; after that, BeforeStep costs nothing
        self.subscription_filters = {"before_step": Filters(once=1, when=is_train)}

    def attach(self, bus: HookBus) -> None:
        self._reads.start(bus)

    def before_step(self, event: BeforeStep) -> None:
        if self._bar is None:
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
        """Sync; a coroutine (the read handed to the worker) at a redraw with tensors.

        The bar is told of the steps only when a redraw is near (tqdm's ``update`` costs the
        step more than the count does); until then they are counted here."""
        bar = self._bar
        if not event.is_train or bar is None:
            return None
        if event.metrics:
            self._unshown = event.metrics  # a dict of this step's own: nobody changes it
        self._ticks = ticks = self._ticks + 1
        if not _redraw_near(bar, ticks):
            return None
        read = self._to_postfix(bar) if event.metrics else None
        self._ticks = 0
        bar.update(ticks)
        return read

    def _to_postfix(self, bar: Any) -> Awaitable[None] | None:
        """Put the latest step's metrics in the postfix: numbers at once, one-element tensors
        read in the worker (at most every ``mininterval`` seconds and one read at a time; else
        they wait for a later redraw, or for ``End``)."""
        metrics = self._unshown
        if metrics is None:
            return None
        postfix, tensors = self._shown(metrics)
        if tensors:  # device values (and numbers): read off the step
            now = time.monotonic()
            if now < self._next_read or self._reads.busy:
                return None
            self._next_read = now + self.mininterval
            self._unshown = None
            return self._reads.put(functools.partial(read_values, postfix), self._show)
        self._unshown = None
        if postfix:
            bar.set_postfix(postfix, refresh=False)
        return None

    def _shown(self, metrics: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """The values of ``metrics`` the postfix shows: numbers and one-element tensors (their
        shape says so: no read); whether there are tensors among them."""
        names = metrics if self.metrics is None else self.metrics
        postfix = {
            name: metrics[name] for name in names if isinstance(metrics.get(name), numbers.Real)
        }
        tensors = len(postfix) < len(names) and _tensor_scalars(metrics, names, postfix)
        return postfix, tensors

    def _show(self, values: Mapping[str, Any]) -> None:
        """Values read off the step: the postfix of the next redraw."""
        if self._bar is not None:
            self._bar.set_postfix(values, refresh=False)

    def end(self, event: End) -> Awaitable[None] | None:
        """Sync (so it still runs when an ``End`` subscriber before it overran the close
        deadline); a coroutine only while tensor values wait to be read for the last postfix."""
        bar = self._bar
        if bar is not None and self._ticks:
            bar.update(self._ticks)
            self._ticks = 0
        if bar is not None and self._unshown is not None:
            postfix, tensors = self._shown(self._unshown)
            if not tensors:  # numbers only: shown by the close's last redraw
                self._unshown = None
                if postfix:
                    bar.set_postfix(postfix, refresh=False)
        if bar is not None and (self._unshown is not None or self._reads.busy):
            return self._last_values_then_close()
        self._close()
        return None

    async def _last_values_then_close(self) -> None:
        try:
            await self._reads.wait_idle()
            metrics, self._unshown = self._unshown, None
            if metrics is not None:  # the last values, read now (the run is over)
                postfix, _ = self._shown(metrics)
                self._show(await anyio.to_thread.run_sync(read_values, postfix))
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


def _redraw_near(bar: Any, steps: int) -> bool:
    """Whether ``bar.update(steps)`` is about to redraw, by tqdm's own two tests: enough steps
    since the last redraw (``miniters``, which tqdm tunes to the steps of about one
    ``mininterval``), then enough time (``mininterval`` on tqdm's clock, ``delay`` after the
    start).  The time test is passed :data:`_REDRAW_LEAD` of ``mininterval`` early, so that
    tqdm, asking its clock a moment later, does not redraw without the postfix just set; when
    it has not redrawn yet, the next steps set it again.  A bar without these attributes (a
    disabled one, another tqdm): true, every step."""
    try:
        if bar.n + steps - bar.last_print_n < bar.miniters:
            return False
        lead = _REDRAW_LEAD * bar.mininterval
        now = bar._time() + lead
        return bool(now - bar.last_print_t >= bar.mininterval and now >= bar.start_t + bar.delay)
    except AttributeError:
        return not getattr(bar, "disable", False)


_REDRAW_LEAD = 0.1  # of mininterval: the postfix is set up to that early before a redraw


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
