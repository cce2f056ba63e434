"""StepCounterHook (recis_async.hooks.step_counter): the exact steps it acts on."""

from __future__ import annotations

import logging

import anyio
import pytest
from hooks_support import Steps, loop, trainer

from recis_async import (
    HookBus,
)
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import (
    StepCounterHook,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


async def test_step_counter_rides_on_every_nth_step_and_leaves_eval_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = Steps()
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.step_counter"):
        async with HookBus() as bus:
            bus.add_hook(StepCounterHook(every_n_steps=2))
            bus.add_hook(rec)
            await loop(bus, [1.0, 1.0], pause=0.01)  # steps 0, 1
            await bus.publish(BeforeStep(is_train=False, global_step=2))
            await anyio.sleep(0.3)  # a long evaluation
            await bus.publish(AfterStep(is_train=False, global_step=2))
            await loop(bus, [1.0] * 4, first=2, pause=0.01)  # steps 2..5
    with_rates = [e.global_step for e in rec.events if "steps_per_sec" in e.metrics]
    assert with_rates == [2, 4]
    first = rec.events[2].metrics
    # steps 0 and 1 took >= 10 ms each: at most 100 steps/s; had the 0.3 s evaluation been
    # counted, at most 2 / 0.3 = 6.7
    assert 2 / 0.3 < first["steps_per_sec"] <= 100
    assert first["samples_per_sec"] == pytest.approx(8 * first["steps_per_sec"])
    assert caplog.text.count("steps/s=") == 2 and "global_step=4 steps/s=" in caplog.text


async def test_step_counter_with_the_trainer_samples_per_sec() -> None:
    rec = Steps()
    await trainer([StepCounterHook(every_n_steps=3), rec], train_steps=7).train()
    rates = {e.global_step: e.metrics for e in rec.events if "samples_per_sec" in e.metrics}
    assert sorted(rates) == [3, 6]
    for m in rates.values():
        assert m["samples_per_sec"] == pytest.approx(4 * m["steps_per_sec"])


def test_step_counter_bad_input() -> None:
    with pytest.raises(
        ValueError, match=r"StepCounterHook\(every_n_steps=...\): expected a positive int, got 0"
    ):
        StepCounterHook(every_n_steps=0)
