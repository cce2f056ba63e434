"""Subscriptions: one subscriber with its order key, filters and counters."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ._checks import boolean, positive_int, positive_number
from .errors import OnError
from .events import Event
from .priority import priority_label

if TYPE_CHECKING:
    from .bus import HookBus

__all__ = ["Filters", "StepCadence", "Subscription", "filters", "is_train"]


class Filters(msgspec.Struct, frozen=True, kw_only=True):
    """Which occurrences of its event a subscriber is called for; all given must pass.

    ``when(event)`` must return true, and only the events it accepts are counted (so
    ``every=3, when=is_train`` is every third training step).  Occurrences are counted per
    subscriber, 1-based: ``every=3`` fires on the 3rd, 6th, ...; ``once=2`` only on the 2nd
    (then the subscription removes itself); ``every_seconds`` at most once per interval (the
    first occurrence fires).  ``every_step=n`` counts on the event's ``global_step`` instead
    (:class:`StepCadence`): it fires on the steps that complete ``n``, ``2n``, ... steps, so a
    run resumed from a checkpoint fires at the same steps as one never interrupted.
    ``first=True`` also fires on the first occurrence the subscriber is called for, whatever
    ``every`` / ``every_step`` say (TensorFlow's timers: the first step, then every ``n``-th).
    The values are checked when a ``Filters`` is built (directly or by :func:`filters`); a
    hook declares them for its methods in ``Hook.subscription_filters``.

    Raises:
        ValueError: ``every``/``once``/``every_step`` below 1, ``every_seconds`` not a
            positive number.
        TypeError: a count that is not an int, ``when`` not callable, ``first`` not a bool.
    """

    every: int | None = None
    once: int | None = None
    every_seconds: float | None = None
    when: Callable[[Any], bool] | None = None
    every_step: int | None = None
    first: bool = False

    def __post_init__(self) -> None:
        _check("Filters", self.every, self.once, self.every_seconds, self.when, self.every_step)
        boolean("Filters", "first", self.first)


class StepCadence:
    """Every ``n`` training steps, counted on the global step: the one rule of the built-in
    hooks' step cadences and of ``Filters(every_step=n)``.

    :meth:`due` is true for the step whose ``global_step + 1`` (the steps completed once it
    ends) is a multiple of ``n``: the ``n``-th, ``2n``-th, ... step of the job, whatever step
    the process started at.  A loop that never numbers its steps (every event says
    ``global_step=0``) is counted per call instead, 1-based, as ``every=n`` would; a nonzero
    ``global_step`` seen once marks the loop as numbering them.
    """

    __slots__ = ("count", "n", "numbered")

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0  # calls, for loops that do not number their steps
        self.numbered = False

    def due(self, event: Any) -> bool:
        """Count this step event and say whether the cadence fires on it."""
        self.count += 1
        step = getattr(event, "global_step", 0)
        if step or self.numbered:
            self.numbered = True
            return (step + 1) % self.n == 0
        return self.count % self.n == 0


def is_train(event: Any) -> bool:
    """``when=is_train``: training steps only (events without ``is_train`` pass)."""
    return getattr(event, "is_train", True) is True


def filters(
    caller: str,
    every: int | None = None,
    once: int | None = None,
    every_seconds: float | None = None,
    when: Callable[[Any], bool] | None = None,
    every_step: int | None = None,
    first: bool = False,
) -> Filters | None:
    """Checked :class:`Filters`, or ``None`` when none is given (the subscriber is called for
    every occurrence, with no counting on the publish path).

    Raises:
        ValueError: ``every``/``once``/``every_step`` not a positive int, ``every_seconds``
            not a positive number; the message names ``caller`` and the argument.
        TypeError: ``when`` not callable.
    """
    given = (every, once, every_seconds, when, every_step)
    boolean(caller, "first", first)
    if all(value is None for value in given):
        return None  # first=True alone: every occurrence fires anyway
    _check(caller, every, once, every_seconds, when, every_step)
    return Filters(
        every=every,
        once=once,
        every_seconds=None if every_seconds is None else float(every_seconds),
        when=when,
        every_step=every_step,
        first=first,
    )


def _check(
    caller: str,
    every: int | None,
    once: int | None,
    every_seconds: float | None,
    when: Callable[[Any], bool] | None,
    every_step: int | None,
) -> None:
    if every is not None:
        positive_int(caller, "every", every)
    if every_step is not None:
        positive_int(caller, "every_step", every_step)
    if once is not None:
        positive_int(caller, "once", once)
    if every_seconds is not None:
        positive_number(caller, "every_seconds", every_seconds)
    if when is not None and not callable(when):
        raise TypeError(f"{caller}(when=...): expected a callable, got {when!r}")


class Subscription:
    """One subscriber: the callable, its order key, filters and counters.

    Returned by :meth:`HookBus.subscribe`; ``remove()`` unsubscribes (idempotent) and the
    handle is a context manager that removes on exit.
    """

    __slots__ = (
        "_bus",
        "_cadence",
        "active",
        "calls",
        "count",
        "errors",
        "event_type",
        "filtered",
        "filters",
        "fn",
        "is_async",
        "last_fired",
        "max_s",
        "name",
        "on_error",
        "priority",
        "seq",
        "step_every",
        "total_s",
    )

    def __init__(
        self,
        bus: HookBus,
        event_type: type[Event],
        fn: Callable[..., Any],
        name: str,
        priority: int,
        seq: int,
        filters: Filters | None,
        on_error: OnError,
    ) -> None:
        self._bus = bus
        self.event_type = event_type
        self.fn = fn
        self.name = name
        self.priority = priority
        self.seq = seq
        self.is_async = _is_async_callable(fn)
        self.filters = filters
        self.on_error = on_error
        self.filtered = filters is not None
        every_step = None if filters is None else filters.every_step
        self._cadence = None if every_step is None else StepCadence(every_step)
        # ``every_step=n`` (n > 1) with no filter that counts occurrences: the bus skips a
        # numbered step off the cadence before calling :meth:`accepts` (see ``Route``)
        self.step_every = (
            every_step
            if filters is not None
            and every_step is not None
            and every_step > 1
            and filters.every is None
            and filters.once is None
            and not filters.first
            else 0
        )
        self.active = True
        self.count = 0
        self.last_fired = -math.inf
        self.calls = 0
        self.errors = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def accepts(self, event: Event, now: float) -> bool:
        """Apply ``when``, count the occurrence (1-based), then the other filters; all must
        pass."""
        f = self.filters
        if f is None:
            return True
        if f.when is not None and not f.when(event):
            return False
        self.count += 1
        n = self.count
        due = self._cadence is None or self._cadence.due(event)  # counts every step
        if not (f.first and n == 1):
            if f.every is not None and n % f.every:
                return False
            if not due:
                return False
        if f.once is not None:
            if n != f.once:
                return False
            self.remove()  # fires once, never again
        if f.every_seconds is not None:
            if now - self.last_fired < f.every_seconds:
                return False
            self.last_fired = now
        return True

    def remove(self) -> None:
        """Unsubscribe (``bus.unsubscribe(self)``); calling it again does nothing."""
        self._bus.unsubscribe(self)

    def describe(self, event_type: type[Event]) -> str:
        """One line: name, priority, filters, and the base class it came through."""
        f = self.filters or Filters()
        shown = [
            f"{k}={v!r}"
            for k, v in (
                ("every", f.every),
                ("once", f.once),
                ("every_seconds", f.every_seconds),
                ("when", getattr(f.when, "__name__", f.when)),
                ("every_step", f.every_step),
                ("first", f.first or None),
            )
            if v is not None
        ]
        parts = [self.name, f"priority={priority_label(self.priority)}", *shown]
        if self.on_error != "raise":
            parts.append(f"on_error={self.on_error}")
        if self.event_type is not event_type:
            parts.append(f"(subscribed to {self.event_type.__name__})")
        return "  ".join(parts)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<Subscription {self.name} on {self.event_type.__name__}>"


def _is_async_callable(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async __call__ on callable objects
    )
