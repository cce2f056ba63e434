from __future__ import annotations

from typing import Any

import pytest

from recis_async import Hook, HookBus, HookError, Priority
from recis_async.events import AfterStep, BeforeStep, End, Event, Start

pytestmark = pytest.mark.anyio


class EvalProbe(Event, frozen=True, kw_only=True):
    auc: float = 0.0


class Recording(Hook):
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def start(self, event: Start) -> None:
        self.log.append("start")

    async def after_step(self, event: AfterStep) -> None:
        self.log.append(("after_step", event.global_step))

    def eval_probe(self, event: EvalProbe) -> None:
        self.log.append(("probe", event.auc))

    def end(self, event: End) -> None:
        self.log.append(("end", event.status))


async def test_add_hook_subscribes_only_overridden_methods() -> None:
    log: list[Any] = []
    async with HookBus() as bus:
        bus.add_hook(Recording(log))
        await bus.publish(Start())
        await bus.publish(BeforeStep())  # not overridden: nothing happens
        await bus.publish(AfterStep(global_step=4))
        await bus.publish(EvalProbe(auc=0.75))
        described = bus.describe()
    assert log == ["start", ("after_step", 4), ("probe", 0.75), ("end", "ok")]
    assert "before_step" not in described
    assert bus.hooks and isinstance(bus.hooks[0], Recording)


async def test_hook_class_attributes_priority_and_on_error() -> None:
    log: list[str] = []

    class Late(Hook):
        priority = Priority.VERY_LOW

        def start(self, event: Start) -> None:
            log.append("late")

    class Early(Hook):
        priority = 5

        def start(self, event: Start) -> None:
            log.append("early")

    class Tolerant(Hook):
        on_error = "log"

        def start(self, event: Start) -> None:
            raise RuntimeError("ignored")

    async with HookBus() as bus:
        for hook in (Late(), Tolerant(), Early()):
            bus.add_hook(hook)
        await bus.publish(Start())
    assert log == ["early", "late"]


async def test_hook_error_names_the_hook_method() -> None:
    class Broken(Hook):
        def after_step(self, event: AfterStep) -> None:
            raise ValueError("bad metric")

    with pytest.raises(
        HookError, match=r"Broken.after_step failed on AfterStep: ValueError: bad metric"
    ):
        async with HookBus() as bus:
            bus.add_hook(Broken())
            await bus.publish(AfterStep())


async def test_state_key_must_be_unique_per_bus() -> None:
    class Counter(Hook):
        def __init__(self, key: str | None = None) -> None:
            self._key = key

        @property
        def state_key(self) -> str:
            return self._key or super().state_key

    async with HookBus() as bus:
        bus.add_hook(Counter())
        with pytest.raises(ValueError, match=r"state_key 'Counter'.*already used"):
            bus.add_hook(Counter())
        bus.add_hook(Counter("second"))
        assert [h.state_key for h in bus.hooks] == ["Counter", "second"]


async def test_rank_zero_only_hooks_are_skipped_on_other_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class OnlyZero(Hook):
        rank_zero_only = True

        def start(self, event: Start) -> None:
            raise AssertionError("must not run on rank 1")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    async with HookBus() as bus:
        assert (bus.rank, bus.world_size) == (1, 2)
        bus.add_hook(OnlyZero())
        await bus.publish(Start())
        assert bus.hooks == ()


async def test_attach_is_called_once_with_the_bus() -> None:
    attached: list[HookBus] = []

    class Attaching(Hook):
        def attach(self, bus: HookBus) -> None:
            attached.append(bus)

    async with HookBus() as bus:
        bus.add_hook(Attaching())
    assert attached == [bus]


def test_state_dict_defaults() -> None:
    hook = Hook()
    assert hook.state_dict() == {}
    hook.load_state_dict({})
    assert hook.state_key == "Hook"


async def test_a_hook_whose_attach_fails_is_not_half_added() -> None:
    class Fragile(Hook):
        fail = True

        def attach(self, bus: HookBus) -> None:
            if self.fail:
                raise OSError("cannot open the output directory")

        def start(self, event: Start) -> None:
            raise AssertionError("must not be subscribed")

    hook = Fragile()
    async with HookBus() as bus:
        with pytest.raises(OSError, match="cannot open"):
            bus.add_hook(hook)
        assert bus.hooks == ()
        await bus.publish(Start())
        hook.fail = False
        hook.start = lambda event: None  # type: ignore[method-assign]
        bus.add_hook(hook)  # adding it again works once attach succeeds
        assert bus.hooks == (hook,)


async def test_two_custom_events_of_one_name_both_reach_the_method_named_after_them() -> None:
    """A hook method is matched by name: an event class of the same name defined elsewhere (a
    second module, or a test's local class still alive) must not take the first one's place."""

    class Other:
        class EvalProbe(Event, frozen=True, kw_only=True):
            auc: float = 0.0

    log: list[Any] = []
    async with HookBus() as bus:
        bus.add_hook(Recording(log))
        await bus.publish(EvalProbe(auc=0.5))
        await bus.publish(Other.EvalProbe(auc=0.25))
    assert log == [("probe", 0.5), ("probe", 0.25), ("end", "ok")]
