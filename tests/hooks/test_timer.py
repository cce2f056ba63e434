"""TimerHook: the step it stops at, on a clock moved by hand; with the Trainer, its final
checkpoint and a resume that carries the elapsed time."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hooks_support import Steps, trainer

from recis_async import Hook, HookBus
from recis_async.events import AfterData, AfterLoadCheckpoint, AfterStep, BeforeStep, Start
from recis_async.hooks import TimerHook, latest_checkpoint_step

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Tick(Hook):
    """Every training step takes ``seconds`` on ``clock``."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def after_data(self, event: AfterData) -> None:
        if event.is_train:
            self.clock.t += self.seconds


async def _loop(
    bus: HookBus, clock: Clock, steps: int, seconds: float = 1.0, eval_at: int = -1
) -> int:
    """Steps of ``seconds`` each until the bus should stop; returns the steps run."""
    await bus.publish(Start())
    for g in range(steps):
        await bus.publish(BeforeStep(global_step=g))
        clock.t += seconds
        await bus.publish(AfterStep(global_step=g))
        if g == eval_at:  # a 100 s evaluation
            await bus.publish(BeforeStep(is_train=False, global_step=g))
            clock.t += 100.0
            await bus.publish(AfterStep(is_train=False, global_step=g))
        if bus.should_stop:
            return g + 1
    return steps


async def test_stops_when_one_more_step_would_pass_the_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="recis_async.hooks.timer")
    clock = Clock()
    hook = TimerHook(10.5, clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        # after step 9: 10 s elapsed + 1 s would pass 10.5 s; after step 8, 9 + 1 would not
        assert await _loop(bus, clock, 100) == 10
        assert bus.stop_reason == (
            "TimerHook: 10.0s elapsed + 1s for one more step would pass the 10.5s budget at "
            "global_step 9"
        )
    assert hook.elapsed == pytest.approx(10.0) and hook.remaining == pytest.approx(0.5)
    (record,) = caplog.records
    assert record.getMessage() == f"{bus.stop_reason}: requesting a stop"


async def test_an_evaluation_is_not_part_of_the_step_estimate() -> None:
    clock = Clock()
    async with HookBus() as bus:
        bus.add_hook(TimerHook("00:00:20:00", clock=clock))  # 1200 s
        # 100 s of evaluation after step 100; steps of 10 s: 1200 s are reached after step
        # 109 (counted in the estimate, the evaluation would stop it a step early)
        assert await _loop(bus, clock, 1000, seconds=10.0, eval_at=100) == 110
        assert bus.stop_reason == (
            "TimerHook: 0:20:00 elapsed + 10s for one more step would pass the 0:20:00 budget "
            "at global_step 109"
        )


async def test_with_the_trainer_final_checkpoint_and_resume(tmp_path: Path) -> None:
    clock = Clock()
    rec = Steps()
    timer = TimerHook(timedelta(seconds=5.5), clock=clock)
    t = trainer([timer, rec, Tick(clock, 1.0)], output_dir=str(tmp_path), save_steps=100)
    await t.train()
    assert rec.steps == [0, 1, 2, 3, 4]  # after step 4: 5 s + 1 s > 5.5 s
    assert latest_checkpoint_step(tmp_path) == 5  # the Trainer saved at the stop
    # the resumed run starts with the 5 s spent: its first step leaves no room for another
    clock2, rec2 = Clock(), Steps()
    timer2 = TimerHook({"seconds": 5.5}, clock=clock2)
    t2 = trainer([timer2, rec2, Tick(clock2, 1.0)], output_dir=str(tmp_path), save_steps=100)
    await t2.train(resume_from_checkpoint=True)
    assert rec2.steps == [5]
    assert timer2.elapsed == pytest.approx(6.0)
    assert latest_checkpoint_step(tmp_path) == 6


async def test_a_restore_with_the_budget_spent_stops_before_the_first_step() -> None:
    clock = Clock()
    hook = TimerHook(60, clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await bus.publish(Start())
        hook.load_state_dict({"elapsed": 61.0})
        await bus.publish(AfterLoadCheckpoint(global_step=50))
        assert bus.stop_reason == (
            "TimerHook: 0:01:01 elapsed + 0s for one more step would pass the 0:01:00 budget "
            "at global_step 50"
        )


async def test_eval_steps_alone_never_stop() -> None:
    clock = Clock()
    async with HookBus() as bus:
        bus.add_hook(TimerHook(1, clock=clock))
        await bus.publish(BeforeStep(is_train=False))
        clock.t += 10
        await bus.publish(AfterStep(is_train=False))
        assert not bus.should_stop


@pytest.mark.parametrize(
    ("duration", "seconds"),
    [
        (90, 90.0),
        (0.5, 0.5),
        ("00:01:30:00", 5400.0),
        ("1:00:00:01", 86401.0),
        (timedelta(minutes=2), 120.0),
        ({"hours": 1, "minutes": 1}, 3660.0),
    ],
)
def test_durations(duration: Any, seconds: float) -> None:
    assert TimerHook(duration).duration == seconds


@pytest.mark.parametrize(
    ("duration", "error"),
    [
        ("1:30", ValueError),
        ("01:00:00:xx", ValueError),
        (0, ValueError),
        (-5, ValueError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        (timedelta(0), ValueError),
        ({"parsecs": 1}, ValueError),
        (True, TypeError),
        (None, TypeError),
        ([60], TypeError),
    ],
)
def test_bad_durations(duration: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"TimerHook\(duration=...\): expected seconds > 0, a 'DD:HH"):
        TimerHook(duration)


def test_clock_check_and_repr() -> None:
    with pytest.raises(TypeError, match=r"TimerHook\(clock=...\): expected a callable, got 1"):
        TimerHook(10, clock=1)  # type: ignore[arg-type]
    assert repr(TimerHook("00:04:00:00")) == "<TimerHook duration=4:00:00>"
