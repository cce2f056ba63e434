"""Subscriptions: one subscriber with its order key, filters and counters, and the cached
per-event-type dispatch rows the bus iterates when it publishes."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .events import Event
from .hook import OnError
from .priority import priority_label

if TYPE_CHECKING:
    from .bus import HookBus

__all__ = ["Subscription"]


class Subscription:
    """One subscriber: the callable, its order key, filters and counters.

    Returned by :meth:`HookBus.subscribe`; ``remove()`` unsubscribes (idempotent) and the
    handle is a context manager that removes on exit.
    """

    __slots__ = (
        "_bus",
        "active",
        "calls",
        "count",
        "errors",
        "event_type",
        "every",
        "every_seconds",
        "filtered",
        "fn",
        "is_async",
        "last_fired",
        "max_s",
        "name",
        "on_error",
        "once",
        "priority",
        "seq",
        "total_s",
        "when",
    )

    def __init__(
        self,
        bus: HookBus,
        event_type: type[Event],
        fn: Callable[..., Any],
        name: str,
        priority: int,
        seq: int,
        every: int | None,
        once: int | None,
        every_seconds: float | None,
        when: Callable[[Any], bool] | None,
        on_error: OnError,
    ) -> None:
        self._bus = bus
        self.event_type = event_type
        self.fn = fn
        self.name = name
        self.priority = priority
        self.seq = seq
        self.is_async = _is_async_callable(fn)
        self.every = every
        self.once = once
        self.every_seconds = every_seconds
        self.when = when
        self.on_error = on_error
        self.filtered = not (
            every is None and once is None and every_seconds is None and when is None
        )
        self.active = True
        self.count = 0
        self.last_fired = -math.inf
        self.calls = 0
        self.errors = 0
        self.total_s = 0.0
        self.max_s = 0.0

    def accepts(self, event: Event, now: float) -> bool:
        """Count this occurrence (1-based) and apply every filter; all must pass."""
        self.count += 1
        n = self.count
        if self.every is not None and n % self.every:
            return False
        if self.once is not None:
            if n != self.once:
                return False
            self.remove()  # fires once, never again
        if self.when is not None and not self.when(event):
            return False
        if self.every_seconds is not None:
            if now - self.last_fired < self.every_seconds:
                return False
            self.last_fired = now
        return True

    def remove(self) -> None:
        """Unsubscribe; calling it again does nothing."""
        if self.active:
            self.active = False
            self._bus._remove(self)

    def describe(self, event_type: type[Event]) -> str:
        """One line: name, priority, filters, and the base class it came through."""
        filters = [
            f"{k}={v!r}"
            for k, v in (
                ("every", self.every),
                ("once", self.once),
                ("every_seconds", self.every_seconds),
                ("when", getattr(self.when, "__name__", self.when)),
            )
            if v is not None
        ]
        parts = [self.name, f"priority={priority_label(self.priority)}", *filters]
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


Entry = tuple["Subscription", Callable[[Any], Any], bool, bool]


class Route:
    """Cached dispatch for one concrete event type: ``(sub, fn, is_async, filtered)`` rows,
    unpacked in the loop so the hot path loads no attribute it does not need."""

    __slots__ = ("entries", "kind")

    def __init__(self, subs: list[Subscription], kind: int) -> None:
        self.entries: tuple[Entry, ...] = tuple((s, s.fn, s.is_async, s.filtered) for s in subs)
        self.kind = kind


def _is_async_callable(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async __call__ on callable objects
    )
