"""The adapters' driver on a real SyncHookBus, without a framework: the step events the bus
does not act on are published to their subscribers in the reference order, and are not built
at all when nothing subscribes to them (a hook added during the run gets them from then on)."""

from __future__ import annotations

from typing import Any

import pytest
from toy import ServiceFailsAfterFirstStep

from recis_async import HookError, add_metric
from recis_async.adapters import _core
from recis_async.adapters._core import Driver
from recis_async.events import (
    AfterBackward,
    AfterData,
    AfterOptimizerStep,
    AfterStep,
    BeforeOptimizerStep,
    BeforeStep,
    Event,
)
from recis_async.hook import Hook
from recis_async.syncbus import SyncHookBus

STEP_EVENTS = (BeforeStep, AfterData, AfterBackward, BeforeOptimizerStep, AfterOptimizerStep)


class Seen(Hook):
    """Records the step events it subscribes to, as (name, global_step)."""

    def __init__(self, *kinds: type[Event]) -> None:
        self.kinds = kinds
        self.seen: list[tuple[str, int]] = []

    @property
    def state_key(self) -> str:
        return f"Seen{id(self)}"

    def attach(self, bus: Any) -> None:
        for kind in self.kinds:
            bus.subscribe(kind, self._record)

    def _record(self, event: Any) -> None:
        self.seen.append((type(event).__name__, event.global_step))

    def after_step(self, event: AfterStep) -> None:
        self.seen.append(("AfterStep", event.global_step))


def one_step(driver: Driver, step: int, *, after_optimizer: bool = True) -> bool:
    driver.begin_step(True, step, step, 0)
    driver.after_backward(sync=True)
    driver.before_optimizer_step(())
    if after_optimizer:
        driver.after_optimizer_step(())
    return driver.end_step(4, 0.5)


def test_subscribed_step_events_are_published_in_the_reference_order() -> None:
    hook = Seen(*STEP_EVENTS)
    driver = Driver("test", [hook], None, 10.0, False)
    driver.start()
    one_step(driver, 0)
    one_step(driver, 1, after_optimizer=False)  # AfterOptimizerStep comes from end_step
    driver.close()
    names = [n.__name__ for n in STEP_EVENTS]
    assert hook.seen == [(n, 0) for n in [*names, "AfterStep"]] + [
        (n, 1) for n in [*names, "AfterStep"]
    ]


def test_an_after_optimizer_step_subscriber_alone_still_gets_its_event() -> None:
    """BeforeOptimizerStep is not published (nobody subscribes), yet the step is known to
    have optimized: AfterOptimizerStep follows, once, from either callback."""
    hook = Seen(AfterOptimizerStep)
    driver = Driver("test", [hook], None, 10.0, False)
    driver.start()
    one_step(driver, 0)
    one_step(driver, 1, after_optimizer=False)
    driver.close()
    assert hook.seen == [
        ("AfterOptimizerStep", 0),
        ("AfterStep", 0),
        ("AfterOptimizerStep", 1),
        ("AfterStep", 1),
    ]


BUILT: list[str] = []


def _counted(kind: type[Any]) -> type[Any]:
    """A subclass of ``kind`` that counts its instances (it reaches ``kind``'s subscribers)."""

    def __post_init__(self: Any) -> None:
        BUILT.append(kind.__name__)
        kind.__post_init__(self)

    return type(
        f"Counted{kind.__name__}",
        (kind,),
        {"__post_init__": __post_init__},
        frozen=True,
        kw_only=True,
    )


def test_unsubscribed_step_events_are_not_built_until_a_hook_wants_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    BUILT.clear()
    for kind in (AfterData, AfterBackward, BeforeOptimizerStep, AfterOptimizerStep):
        monkeypatch.setattr(_core, kind.__name__, _counted(kind))
    hook = Seen()
    with SyncHookBus(handle_signals=False) as bus:
        driver = Driver("test", [hook], bus, 10.0, False)
        driver.start()
        for step in range(3):
            one_step(driver, step)
        assert BUILT == []
        late = Seen(AfterData)
        bus.add_hook(late)
        one_step(driver, 3)
        assert BUILT == ["AfterData"]
        assert late.seen == [("CountedAfterData", 3), ("AfterStep", 3)]
    assert hook.seen == [("AfterStep", s) for s in range(4)]


def test_a_before_step_nobody_receives_is_not_published_yet_the_bus_acts_on_it() -> None:
    """As in the Trainer: with no ``BeforeStep`` subscriber the driver publishes none, and the
    bus still does its part: a value collected after an evaluation step, before the next
    training step, is dropped rather than merged into that step."""
    hook = Seen()
    published: list[str] = []
    with SyncHookBus(handle_signals=False) as bus:
        publish = bus.publish

        def recording(event: Event) -> None:
            published.append(type(event).__name__)
            publish(event)

        bus.publish = recording  # type: ignore[method-assign]
        metrics: list[list[str]] = []
        bus.subscribe(AfterStep, lambda e: metrics.append(sorted(e.metrics)))
        driver = Driver("test", [hook], bus, 10.0, False)
        driver.start()
        driver.begin_step(False, 0, 0, 0)  # an evaluation step
        driver.end_step(4)
        add_metric("stray", 1.0)  # between the steps: belongs to neither
        one_step(driver, 0)
        assert "BeforeStep" not in published and metrics == [[], ["loss"]]
        late = Seen(BeforeStep)
        bus.add_hook(late)
        one_step(driver, 1)
        assert late.seen == [("BeforeStep", 1), ("AfterStep", 1)]
        assert published.count("BeforeStep") == 1


def test_a_failure_waiting_at_a_step_boundary_is_raised_when_the_next_step_begins() -> None:
    """With no ``BeforeStep`` subscriber, a service's failure recorded during a step is still
    raised by the next ``begin_step``, before the framework runs that step."""
    with SyncHookBus(handle_signals=False) as bus:
        driver = Driver("test", [ServiceFailsAfterFirstStep()], bus, 10.0, False)
        driver.start()
        one_step(driver, 0)
        with pytest.raises(HookError, match="the disk is full"):
            driver.begin_step(True, 1, 1, 0)


def test_a_whole_step_publishes_its_after_step_and_a_before_step_only_if_received() -> None:
    """A step the adapter sees only at its end (its framework's callbacks inside the step not
    followed): ``AfterStep`` with the loss and the step's own values; ``BeforeStep`` first
    only once a hook receives it."""
    hook = Seen()
    with SyncHookBus(handle_signals=False) as bus:
        got: list[tuple[int, int, int, int, dict[str, Any]]] = []
        bus.subscribe(
            AfterStep,
            lambda e: got.append((e.global_step, e.local_step, e.epoch, e.samples, e.metrics)),
        )
        driver = Driver("test", [hook], bus, 10.0, False)
        driver.start()
        add_metric("lr", 0.1)
        assert driver.whole_step(True, 7, 2, 1, 4, 0.5, {"acc": 0.75}) is False
        assert got == [(7, 2, 1, 4, {"lr": 0.1, "loss": 0.5, "acc": 0.75})]
        late = Seen(BeforeStep)
        bus.add_hook(late)
        driver.whole_step(True, 8, 3, 1, 4)
        assert late.seen == [("BeforeStep", 8), ("AfterStep", 8)]
    assert hook.seen == [("AfterStep", 7), ("AfterStep", 8)]


def test_follows_says_whether_a_hook_receives_an_event_from_inside_a_step() -> None:
    """``Driver.follows``: false without a bus and while only ``AfterStep`` is received; true
    from the moment a hook subscribes to any event from inside a step, false again once it
    unsubscribes."""
    driver = Driver("test", [Seen()], None, 10.0, False)
    assert driver.follows() is False  # no bus yet
    with SyncHookBus(handle_signals=False) as bus:
        driver = Driver("test", [Seen()], bus, 10.0, False)
        driver.start()
        assert driver.follows() is False
        for kind in (BeforeStep, AfterData, AfterBackward, BeforeOptimizerStep):
            subscription = bus.subscribe(kind, lambda e: None)
            assert driver.follows() is True, kind
            bus.unsubscribe(subscription)
            assert driver.follows() is False, kind


def test_a_whole_step_raises_a_failure_its_publish_recorded_before_another_step_runs() -> None:
    """With no callback at a step's beginning, a service's failure recorded while the step
    was published is raised at that step's end: the framework runs no further step."""
    with SyncHookBus(handle_signals=False) as bus:
        steps: list[int] = []
        bus.subscribe(AfterStep, lambda e: steps.append(e.global_step))
        driver = Driver("test", [ServiceFailsAfterFirstStep()], bus, 10.0, False)
        driver.start()
        with pytest.raises(HookError, match="the disk is full"):
            driver.whole_step(True, 0, 0, 0, 4)
        assert steps == [0]


def test_training_steps_after_an_evaluation_carry_none_of_its_values() -> None:
    """Evaluation steps are begun by a callback; when the evaluation ends, values it left are
    dropped, so a training step published whole (no callback at its beginning to switch
    the bus back) carries only its own."""
    with SyncHookBus(handle_signals=False) as bus:
        metrics: list[tuple[bool, list[str]]] = []
        bus.subscribe(AfterStep, lambda e: metrics.append((e.is_train, sorted(e.metrics))))
        driver = Driver("test", [Seen()], bus, 10.0, False)
        driver.start()
        driver.begin_step(False, 0, 0, 0)  # an evaluation step
        add_metric("eval_acc", 1.0)
        driver.end_step(4)
        add_metric("stray", 1.0)  # after the last evaluation step: belongs to no step
        driver.after_eval(0, 1, {})
        add_metric("lr", 0.1)  # the training step's own
        driver.whole_step(True, 0, 0, 0, 4, 0.5)
        assert metrics == [(False, ["eval_acc"]), (True, ["loss", "lr"])]
