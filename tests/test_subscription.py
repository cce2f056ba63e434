"""Subscriptions: the filters value, and removal through the bus's public call."""

from __future__ import annotations

import anyio
import pytest

from recis_async import Hook, HookBus
from recis_async.events import AfterStep, BeforeStep
from recis_async.subscription import Filters, filters


def test_no_filter_given_means_no_filters_value() -> None:
    assert filters("subscribe") is None


def test_filters_are_one_frozen_value() -> None:
    f = filters("subscribe", every=2, every_seconds=1)
    assert f == Filters(every=2, every_seconds=1.0)
    with pytest.raises(AttributeError):
        f.every = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"every": 0}, ValueError, r"subscribe\(every=...\): expected a positive int, got 0"),
        ({"once": True}, TypeError, r"subscribe\(once=...\): expected a positive int, got True"),
        (
            {"every_seconds": -1},
            ValueError,
            r"subscribe\(every_seconds=...\): expected a positive number, got -1",
        ),
        ({"when": 3}, TypeError, r"subscribe\(when=...\): expected a callable, got 3"),
    ],
)
def test_bad_filters_are_refused_naming_the_argument(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        filters("subscribe", **kwargs)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_unsubscribe_stops_the_calls_and_is_idempotent() -> None:
    seen: list[int] = []
    async with HookBus(handle_signals=False) as bus:
        sub = bus.subscribe(AfterStep, lambda e: seen.append(e.global_step))
        await bus.publish(AfterStep(global_step=0))
        bus.unsubscribe(sub)
        assert not sub.active
        await bus.publish(AfterStep(global_step=1))
        bus.unsubscribe(sub)  # again: nothing happens
        sub.remove()  # the handle's own call goes through the bus too
        assert "AfterStep" not in bus.describe()
    assert seen == [0]


@pytest.mark.anyio
async def test_unsubscribe_refuses_what_is_not_a_subscription() -> None:
    async with HookBus(handle_signals=False) as bus:
        with pytest.raises(TypeError, match=r"unsubscribe\(subscription=...\): expected"):
            bus.unsubscribe("x")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_another_bus_ignores_a_foreign_subscription() -> None:
    seen: list[int] = []
    async with HookBus(handle_signals=False) as one, HookBus(handle_signals=False) as other:
        sub = one.subscribe(AfterStep, lambda e: seen.append(e.global_step))
        other.unsubscribe(sub)  # marks it removed; one's list is untouched but skips it
        await one.publish(AfterStep(global_step=0))
        await anyio.lowlevel.checkpoint()
    assert seen == []


@pytest.mark.anyio
async def test_only_events_when_accepts_are_counted() -> None:
    """``every=2, when=is_train``: every second *training* step, eval steps in between or
    not -- the cadence the built-in hooks declare."""
    from recis_async.subscription import is_train

    seen: list[int] = []
    async with HookBus(handle_signals=False) as bus:
        bus.subscribe(AfterStep, lambda e: seen.append(e.global_step), every=2, when=is_train)
        for step in range(6):
            await bus.publish(AfterStep(global_step=step))
            await bus.publish(AfterStep(global_step=step, is_train=False))  # an eval step
    assert seen == [1, 3, 5]


class EveryOther(Hook):
    def __init__(self) -> None:
        self.subscription_filters = {"after_step": Filters(every=2)}
        self.seen: list[int] = []

    def after_step(self, event: AfterStep) -> None:
        self.seen.append(event.global_step)

    def before_step(self, event: BeforeStep) -> None:
        self.seen.append(-1)  # no filter declared: every occurrence


@pytest.mark.anyio
async def test_a_hook_declares_the_filters_of_its_methods() -> None:
    hook = EveryOther()
    async with HookBus(handle_signals=False) as bus:
        bus.add_hook(hook)
        for step in range(4):
            await bus.publish(BeforeStep(global_step=step))
            await bus.publish(AfterStep(global_step=step))
        assert "every=2" in bus.describe()
    assert hook.seen == [-1, -1, 1, -1, -1, 3]


@pytest.mark.anyio
async def test_hook_filters_must_name_a_method_it_overrides() -> None:
    hook = EveryOther()
    hook.subscription_filters = {"after_stpe": Filters(every=2)}
    async with HookBus(handle_signals=False) as bus:
        with pytest.raises(ValueError, match=r"EveryOther.subscription_filters names 'after_stpe'"):
            bus.add_hook(hook)
        hook.subscription_filters = {"after_step": 2}  # type: ignore[dict-item]
        with pytest.raises(
            TypeError, match=r"subscription_filters\[.after_step.\]: expected a Filters"
        ):
            bus.add_hook(hook)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"every": 0}, ValueError, r"^Filters\(every=...\): expected a positive int, got 0$"),
        ({"every_step": -2}, ValueError, r"^Filters\(every_step=...\): expected a positive int"),
        ({"once": 1.0}, TypeError, r"^Filters\(once=...\): expected a positive int, got 1.0$"),
        ({"every_seconds": 0}, ValueError, r"^Filters\(every_seconds=...\): expected a positive"),
        ({"when": "yes"}, TypeError, r"^Filters\(when=...\): expected a callable"),
        ({"first": 1}, TypeError, r"^Filters\(first=...\): expected a bool, got 1$"),
    ],
)
def test_filters_built_directly_are_checked_when_built(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    """Before: Filters(every=0) was built and failed at the first publish, as a
    ZeroDivisionError in Subscription.accepts."""
    with pytest.raises(error, match=message):
        Filters(**kwargs)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_first_then_every_nth_step() -> None:
    """TensorFlow's timers: the first step seen, then the steps completing every n-th; a run
    resumed at step 7 fires on its first step, then on the same cadence steps."""
    fired: dict[str, list[int]] = {"fresh": [], "resumed": []}
    for run, start in (("fresh", 0), ("resumed", 7)):
        async with HookBus() as bus:
            bus.subscribe(
                AfterStep,
                lambda e, run=run: fired[run].append(e.global_step),
                every_step=3,
                first=True,
            )
            for g in range(start, 12):
                await bus.publish(AfterStep(global_step=g))
    assert fired["fresh"] == [0, 2, 5, 8, 11]
    assert fired["resumed"] == [7, 8, 11]


@pytest.mark.anyio
async def test_a_step_cadence_skips_the_other_steps_without_asking_its_filters() -> None:
    """``every_step=n`` alone (or with ``when``): the numbered steps off the cadence are
    passed over before the filters run (``when`` is not asked, no call is counted), and the
    steps it fires on are those the filters would pick.  A filter counting occurrences
    (``first``) keeps every step going through the filters."""
    asked: list[int] = []
    fired: dict[str, list[int]] = {"cadence": [], "first": []}

    def when(event: AfterStep) -> bool:
        asked.append(event.global_step)
        return event.is_train

    async with HookBus(handle_signals=False) as bus:
        cadence = bus.subscribe(
            AfterStep, lambda e: fired["cadence"].append(e.global_step), every_step=4, when=when
        )
        bus.subscribe(
            AfterStep, lambda e: fired["first"].append(e.global_step), every_step=4, first=True
        )
        for g in range(10):
            await bus.publish(AfterStep(global_step=g))
        await bus.publish(AfterStep(global_step=7, is_train=False))  # refused by when
        assert fired == {"cadence": [3, 7], "first": [0, 3, 7, 7]}
        assert asked == [0, 3, 7, 7]  # step 0 is asked: it may be a loop that numbers none
        assert bus.stats()["subscribers"][cadence.name]["calls"] == 2


@pytest.mark.anyio
async def test_a_step_cadence_in_a_loop_that_numbers_no_step_counts_calls() -> None:
    """Every step says ``global_step=0``: no step is skipped early, the filters count them."""
    fired: list[int] = []
    async with HookBus(handle_signals=False) as bus:
        bus.subscribe(AfterStep, lambda e: fired.append(len(fired)), every_step=3)
        for _ in range(7):
            await bus.publish(AfterStep())
    assert len(fired) == 2


@pytest.mark.anyio
async def test_steps_done_follows_the_training_steps() -> None:
    async with HookBus(handle_signals=False) as bus:
        assert bus.steps_done is None
        await bus.publish(AfterStep(global_step=4))
        await bus.publish(AfterStep(global_step=9, is_train=False))  # evaluation: not counted
        assert bus.steps_done == 5
