"""EarlyStoppingHook (recis_async.hooks.early_stopping): the exact steps it acts on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hooks_support import Steps, loop, trainer
from toy import Model, batches

from recis_async import (
    Hook,
    HookBus,
    HookError,
)
from recis_async.events import AfterEval, AfterStep
from recis_async.hooks import (
    CheckpointSaverHook,
    EarlyStoppingHook,
    restore_checkpoint,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


async def evals(bus: HookBus, values: list[float], key: str = "auc") -> list[bool]:
    """Publish one AfterEval per value; whether a stop was requested after each."""
    stopped = []
    for i, value in enumerate(values):
        await bus.publish(AfterEval(global_step=10 * (i + 1), metrics={key: value}))
        stopped.append(bus.should_stop)
    return stopped


async def test_early_stopping_min_with_patience() -> None:
    async with HookBus() as bus:
        hook = EarlyStoppingHook("auc", patience=2)
        bus.add_hook(hook)
        assert await evals(bus, [1.0, 0.9, 0.95, 0.91]) == [False, False, False, True]
        assert (hook.best, hook.best_step, hook.wait) == (0.9, 20, 2)
        assert bus.stop_reason == (
            "EarlyStoppingHook: 'auc' did not improve for 2 evaluation(s) "
            "(best 0.9 at step 20, now 0.91)"
        )


async def test_early_stopping_max_min_delta_and_nan() -> None:
    async with HookBus() as bus:
        bus.add_hook(EarlyStoppingHook("auc", patience=3, mode="max", min_delta=0.05))
        # 0.72 and 0.74 are within min_delta of 0.7; 0.8 improves; NaN never does
        stopped = await evals(bus, [0.7, 0.72, 0.74, 0.8, math.nan, 0.81, 0.84])
        assert stopped == [False] * 6 + [True]


async def test_early_stopping_on_step_metrics() -> None:
    rec = Steps()
    async with HookBus() as bus:
        bus.add_hook(EarlyStoppingHook("loss", patience=2, source="step"))
        bus.add_hook(rec)
        # the eval value is not looked at with source="step"
        await bus.publish(AfterEval(metrics={"loss": 0.0}))
        assert await loop(bus, [3.0, 2.0, 2.5, 2.0, 1.0, 9.0]) == 4
    assert rec.steps == [0, 1, 2, 3]


async def test_early_stopping_stops_train_and_evaluate() -> None:
    """lr=0: the eval loss never improves; patience=2 stops after the third evaluation."""
    seen: list[int] = []

    class EvalSteps(Hook):
        def after_eval(self, event: AfterEval) -> None:
            seen.append(event.global_step)

    t = trainer([EarlyStoppingHook("loss", patience=2), EvalSteps()], lr=0.0, train_epoch=10)
    t.train_dataset = batches(2)
    await t.train_and_evaluate()
    assert seen == [2, 4, 6]
    assert t.global_step == 6


async def test_early_stopping_state_survives_a_checkpoint(tmp_path: Path) -> None:
    model = Model()
    async with HookBus() as bus:
        bus.add_hook(EarlyStoppingHook("auc", patience=3))
        bus.add_hook(CheckpointSaverHook(tmp_path, save_steps=1, model=model))
        await evals(bus, [0.5, 0.6])
        await bus.publish(AfterStep(global_step=0))
    restored = EarlyStoppingHook("auc", patience=3)
    async with HookBus() as bus:
        bus.add_hook(restored)
        assert await restore_checkpoint(bus, tmp_path, model) == 1
        assert (restored.best, restored.best_step, restored.wait) == (0.5, 10, 1)
        assert await evals(bus, [0.7, 0.8]) == [False, True]  # the patience carried over


async def test_early_stopping_refuses_an_eval_without_the_monitor() -> None:
    with pytest.raises(
        HookError, match=r"AfterEval\(global_step=0\).metrics has no 'auc' \(got \['loss'\]\)"
    ):
        async with HookBus() as bus:
            bus.add_hook(EarlyStoppingHook("auc", patience=1))
            await bus.publish(AfterEval(metrics={"loss": 1.0}))


def test_early_stopping_bad_input() -> None:
    with pytest.raises(
        ValueError, match=r"EarlyStoppingHook\(mode=...\): expected 'min' or 'max', got 'avg'"
    ):
        EarlyStoppingHook("auc", 1, mode="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"patience=...\): expected a positive int, got 0"):
        EarlyStoppingHook("auc", 0)
    with pytest.raises(ValueError, match=r"min_delta=...\): expected a number >= 0, got -0.1"):
        EarlyStoppingHook("auc", 1, min_delta=-0.1)
    with pytest.raises(ValueError, match=r"source=...\): expected 'eval' or 'step', got 'x'"):
        EarlyStoppingHook("auc", 1, source="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"monitor=...\): expected a metric name, got ''"):
        EarlyStoppingHook("", 1)
