"""The bus's dispatch cache: per concrete event type, its subscribers in call order.

The bus owns the cache (a plain dict, event type -> :class:`Route`): a route is built here on
its event type's first publish and the whole cache is dropped whenever a subscription is added
or removed, so ``publish`` does one dict lookup and then iterates a flat tuple.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .events import AfterStep, BeforeStep, End, Event, OutOfData, StepEvent
from .subscription import Subscription

__all__ = ["KIND_AFTER_STEP", "KIND_BEFORE_STEP", "KIND_END", "KIND_OUT_OF_DATA", "Route", "build"]

#: What the bus does around the subscribers of an event type (0: nothing).
KIND_PLAIN, KIND_BEFORE_STEP, KIND_AFTER_STEP, KIND_OUT_OF_DATA, KIND_END = range(5)

Entry = tuple[Subscription, Callable[[Any], Any], bool, bool, int]


class Route:
    """Cached dispatch for one concrete event type: ``(sub, fn, is_async, filtered, every)``
    rows, unpacked in the loop so the hot path loads no attribute it does not need.

    ``every``: on a step event, the subscriber's ``every_step=n`` when nothing else it filters
    on counts occurrences (:attr:`Subscription.step_every`), else 0.  ``publish`` skips a
    step whose nonzero ``global_step`` is off that cadence without calling the subscriber's
    filters (which would say no): a hook acting every ``n`` steps costs the other steps one
    test, not a call.  Steps numbered 0 still go through the filters, which count them for
    loops that never number their steps (:class:`~recis_async.subscription.StepCadence`).
    """

    __slots__ = ("entries", "kind")

    def __init__(self, subs: Iterable[Subscription], kind: int, steps: bool) -> None:
        self.entries: tuple[Entry, ...] = tuple(
            (s, s.fn, s.is_async, s.filtered, s.step_every if steps else 0) for s in subs
        )
        self.kind = kind


def build(cache: dict[type, Route], event_type: type, subs: Iterable[Subscription]) -> Route:
    """Build the route of ``event_type`` over all of a bus's ``subs`` and cache it.

    The cache is the bus's own plain dict (a dict subclass would make the lookup on every
    publish measurably slower: benchmarks/bench_dispatch.py).

    Raises:
        TypeError: ``event_type`` is not an :class:`~recis_async.events.Event` subclass
            (something other than an event was published).
    """
    if not (isinstance(event_type, type) and issubclass(event_type, Event)):
        raise TypeError(
            f"publish(event=...): expected an Event instance, got {event_type.__name__}"
        )
    ordered = sorted(
        (s for s in subs if issubclass(event_type, s.event_type)),
        key=lambda s: (s.priority, s.seq),
    )
    route = cache[event_type] = Route(ordered, _kind(event_type), issubclass(event_type, StepEvent))
    return route


def _kind(event_type: type[Event]) -> int:
    if issubclass(event_type, BeforeStep):
        return KIND_BEFORE_STEP
    if issubclass(event_type, AfterStep):
        return KIND_AFTER_STEP
    if issubclass(event_type, OutOfData):
        return KIND_OUT_OF_DATA
    if issubclass(event_type, End):
        return KIND_END
    return KIND_PLAIN
