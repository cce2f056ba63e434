"""StopAtStepHook (recis_async.hooks.stop_at_step): the exact steps it acts on."""

from __future__ import annotations

import pytest
from hooks_support import Steps, loop, trainer

from recis_async import (
    HookBus,
)
from recis_async.events import AfterLoadCheckpoint, AfterStep, BeforeStep
from recis_async.hooks import (
    StopAtStepHook,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


async def test_stop_at_last_step_with_the_trainer() -> None:
    rec = Steps()
    t = trainer([StopAtStepHook(last_step=3), rec], train_epoch=5)
    await t.train()
    assert rec.steps == [0, 1, 2]
    assert t.global_step == 3


async def test_stop_after_num_steps_counts_from_the_first_step_seen() -> None:
    async with HookBus() as bus:
        bus.add_hook(StopAtStepHook(num_steps=2))
        assert await loop(bus, [1.0] * 10, first=5) == 2  # steps 5 and 6
        assert bus.stop_reason == "StopAtStepHook: 7 steps done (stop at 7)"


async def test_stop_at_last_step_already_reached_by_a_restore() -> None:
    async with HookBus() as bus:
        bus.add_hook(StopAtStepHook(last_step=4))
        await bus.publish(AfterLoadCheckpoint(global_step=5))
        assert bus.should_stop
    rec = Steps()
    async with HookBus() as bus:  # a loop starting past last_step is told at its first step
        bus.add_hook(StopAtStepHook(last_step=4))
        bus.add_hook(rec)
        await bus.publish(BeforeStep(global_step=6))
        assert bus.should_stop


async def test_stop_at_step_ignores_eval_steps() -> None:
    async with HookBus() as bus:
        bus.add_hook(StopAtStepHook(last_step=1))
        await bus.publish(AfterStep(is_train=False, global_step=5))
        assert not bus.should_stop
        await bus.publish(AfterStep(global_step=0))
        assert bus.should_stop


def test_stop_at_step_bad_input() -> None:
    with pytest.raises(
        ValueError,
        match=r"StopAtStepHook: expected exactly one of num_steps or last_step, "
        r"got num_steps=None, last_step=None",
    ):
        StopAtStepHook()
    with pytest.raises(ValueError, match=r"got num_steps=3, last_step=9"):
        StopAtStepHook(num_steps=3, last_step=9)
    with pytest.raises(
        ValueError, match=r"StopAtStepHook\(num_steps=...\): expected a positive int, got 0"
    ):
        StopAtStepHook(num_steps=0)
    with pytest.raises(ValueError, match=r"last_step=...\): expected a positive int, got -2"):
        StopAtStepHook(last_step=-2)
    with pytest.raises(TypeError, match=r"expected a positive int, got True"):
        StopAtStepHook(last_step=True)
