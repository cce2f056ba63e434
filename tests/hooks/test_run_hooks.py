"""The TensorFlow run hooks: StopAtStep, NanTensor, StepCounter, GlobalStepWaiter,
LoggingTensor and EarlyStopping, each with the exact steps it acts on."""

from __future__ import annotations

import logging
import math
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from toy import Model, batches

from recis_async import (
    Hook,
    HookBus,
    HookError,
    Priority,
    Trainer,
    TrainingArguments,
    add_metric,
    add_to_ml_tracker,
)
from recis_async.events import AfterEval, AfterLoadCheckpoint, AfterStep, BeforeStep
from recis_async.hooks import (
    CheckpointSaverHook,
    EarlyStoppingHook,
    GlobalStepWaiterHook,
    LoggingTensorHook,
    NanLossError,
    NanTensorHook,
    StepCounterHook,
    StopAtStepHook,
    latest_checkpoint_step,
    restore_checkpoint,
)

pytestmark = pytest.mark.anyio


class Steps(Hook):
    """Records training AfterStep events; runs last so it sees what every hook left."""

    priority = Priority.LOWEST

    def __init__(self) -> None:
        self.events: list[AfterStep] = []

    def after_step(self, event: AfterStep) -> None:
        if event.is_train:
            self.events.append(event)

    @property
    def steps(self) -> list[int]:
        return [e.global_step for e in self.events]


def trainer(hooks: list[Hook], data: Any = None, lr: float = 0.05, **kwargs: Any) -> Trainer:
    model = Model()
    args = TrainingArguments(**{"save_steps": None, **kwargs})
    return Trainer(
        model,
        args,
        train_dataset=batches(10) if data is None else data,
        eval_dataset=batches(2, seed=1),
        hooks=hooks,
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=lr), None),
    )


async def loop(
    bus: HookBus,
    losses: list[float],
    first: int = 0,
    samples: int = 8,
    pause: float = 0.0,
) -> int:
    """A hand-written loop; returns the number of steps run before a stop."""
    done = 0
    for i, loss in enumerate(losses, start=first):
        await bus.publish(BeforeStep(global_step=i))
        if pause:
            await anyio.sleep(pause)
        add_metric("loss", loss)
        await bus.publish(AfterStep(global_step=i, samples=samples))
        done += 1
        if bus.should_stop:
            break
    return done


# ---------------------------------------------------------------------- StopAtStepHook


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


# ---------------------------------------------------------------------- NanTensorHook


async def test_nan_loss_fails_the_step_before_lower_priority_hooks_see_it() -> None:
    rec = Steps()
    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.add_hook(NanTensorHook())
            bus.add_hook(rec)
            await loop(bus, [0.5, 0.4, math.nan, 0.3])
    assert isinstance(info.value.__cause__, NanLossError)
    assert "NaN/inf loss nan ('loss') at global_step 2" in str(info.value)
    assert rec.steps == [0, 1]


async def test_inf_loss_without_fail_warns_and_stops(caplog: pytest.LogCaptureFixture) -> None:
    rec = Steps()
    with caplog.at_level(logging.WARNING, logger="recis_async.hooks.nan"):
        async with HookBus() as bus:
            bus.add_hook(NanTensorHook(fail_on_nan_loss=False))
            bus.add_hook(rec)
            assert await loop(bus, [0.5, math.inf, 0.3]) == 2
            assert bus.stop_reason == "NanTensorHook: NaN/inf loss inf ('loss') at global_step 1"
    assert "NaN/inf loss inf ('loss') at global_step 1: requesting a stop" in caplog.text


async def test_nan_hook_checks_arrays_skips_eval_and_refuses_a_missing_loss() -> None:
    async with HookBus() as bus:
        bus.add_hook(NanTensorHook(loss_key="losses"))
        await bus.publish(AfterStep(is_train=False, metrics={"losses": math.nan}))
        await bus.publish(AfterStep(global_step=0, metrics={"losses": [0.1, 0.2]}))
        with pytest.raises(HookError, match=r"NaN/inf loss \[0.1, nan\]"):
            await bus.publish(AfterStep(global_step=1, metrics={"losses": [0.1, math.nan]}))
        with pytest.raises(
            HookError,
            match=r"AfterStep\(global_step=2\).metrics has no 'losses' \(got \['loss'\]\)",
        ):
            await bus.publish(AfterStep(global_step=2, metrics={"loss": 1.0}))


def test_nan_hook_bad_input() -> None:
    with pytest.raises(
        TypeError,
        match=r"fail_on_nan_loss=...\): expected a bool, got str 'loss' \(the loss is read "
        r"from AfterStep.metrics: record it with add_metric\('loss', loss\) and name it with "
        r"loss_key=...\)",
    ):
        NanTensorHook("loss")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a bool, got Tensor tensor\(1.\) \(the loss"):
        NanTensorHook(torch.tensor(1.0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fail_on_nan_loss=...\): expected a bool, got int 1$"):
        NanTensorHook(1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"loss_key=...\): expected a metric name, got ''"):
        NanTensorHook(loss_key="")


# ---------------------------------------------------------------------- StepCounterHook


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


# ---------------------------------------------------------------------- GlobalStepWaiterHook


async def test_waiter_holds_the_first_step_without_blocking_the_loop() -> None:
    shared = {"step": 0}
    ticks: list[int] = []
    calls: list[int] = []

    def source() -> int:  # sync: runs in a worker thread
        calls.append(shared["step"])
        return shared["step"]

    async def chief() -> None:  # another task on the same loop: advances the shared step
        while shared["step"] < 5:
            await anyio.sleep(0.01)
            shared["step"] += 1
            ticks.append(shared["step"])

    rec = Steps()
    async with anyio.create_task_group() as tg, HookBus() as bus:
        waiter = GlobalStepWaiterHook(5, source, poll_interval=0.005)
        bus.add_hook(waiter)
        bus.add_hook(rec)
        tg.start_soon(chief)
        with anyio.fail_after(5):
            await loop(bus, [1.0, 1.0, 1.0])
    assert ticks == [1, 2, 3, 4, 5]  # the chief ran while the step waited
    assert calls[-1] == 5 and all(c < 5 for c in calls[:-1])
    assert len(calls) >= 2 and waiter.waited_s > 0
    assert rec.steps == [0, 1, 2]  # only the first step waited; every step ran


async def test_waiter_on_a_trainers_checkpoints(tmp_path: Path) -> None:
    """An evaluator waits for a trainer's checkpoint of step >= 3, with an async source too."""

    async def trainer_writes() -> None:
        for step in (1, 2, 3):
            await anyio.sleep(0.02)
            (tmp_path / f"checkpoint-{step}.pt").write_bytes(b"")

    async def async_source() -> int | None:
        return latest_checkpoint_step(tmp_path)

    for source in (partial(latest_checkpoint_step, tmp_path), async_source):
        for p in tmp_path.iterdir():
            p.unlink()
        async with anyio.create_task_group() as tg, HookBus() as bus:
            bus.add_hook(GlobalStepWaiterHook(3, source, poll_interval=0.005))
            tg.start_soon(trainer_writes)
            with anyio.fail_after(5):
                await bus.publish(BeforeStep(global_step=0))
            assert latest_checkpoint_step(tmp_path) == 3


async def test_waiter_timeout_and_stop_request() -> None:
    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.add_hook(GlobalStepWaiterHook(10, lambda: 3, poll_interval=0.01, timeout=0.05))
            await bus.publish(BeforeStep(global_step=0))
    assert isinstance(info.value.__cause__, TimeoutError)
    assert "the step source reported 3" in str(info.value)
    assert "expected >= 10 within timeout=0.05s" in str(info.value)

    async with HookBus() as bus:
        bus.add_hook(GlobalStepWaiterHook(10, lambda: None, poll_interval=0.01))

        async def stop_soon() -> None:
            await anyio.sleep(0.05)
            bus.request_stop("preempted")

        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_soon)
            with anyio.fail_after(5):
                await bus.publish(BeforeStep(global_step=0))


async def test_waiter_refuses_a_bad_step_value() -> None:
    with pytest.raises(HookError, match=r"step_source\(\) returned '7'; expected an int or None"):
        async with HookBus() as bus:
            bus.add_hook(GlobalStepWaiterHook(3, lambda: "7"))
            await bus.publish(BeforeStep(global_step=0))


def test_waiter_bad_input() -> None:
    with pytest.raises(ValueError, match=r"wait_until_step=...\): expected an int >= 0, got -1"):
        GlobalStepWaiterHook(-1, lambda: 0)
    with pytest.raises(TypeError, match=r"step_source=...\): expected a callable, got 5"):
        GlobalStepWaiterHook(1, 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"poll_interval=...\): expected a positive number, got 0"):
        GlobalStepWaiterHook(1, lambda: 0, poll_interval=0)
    with pytest.raises(ValueError, match=r"timeout=...\): expected a positive number, got -1"):
        GlobalStepWaiterHook(1, lambda: 0, timeout=-1)


# ---------------------------------------------------------------------- LoggingTensorHook


async def test_logging_tensor_every_n_iter(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.logging_tensor"):
        async with HookBus() as bus:
            bus.add_hook(LoggingTensorHook(["loss", "auc", "emb", "nope"], every_n_iter=2))
            for i in range(5):
                await bus.publish(BeforeStep(global_step=i))
                add_metric("loss", 0.5 + i)
                add_to_ml_tracker("auc", 0.25 * i)
                add_to_ml_tracker("emb", list(range(20)))
                await bus.publish(AfterStep(global_step=i))
            await bus.publish(AfterStep(is_train=False, global_step=5, metrics={"loss": 9.0}))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert [line.split(" ")[0] for line in lines] == [
        "global_step=0",
        "global_step=2",
        "global_step=4",
    ]
    assert lines[1].startswith(
        "global_step=2 loss = 2.5, auc = 0.5, emb = [0, 1, 2, 3, 4, 5, 6, 7, ... (20 items)], "
        "nope = n/a ("
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'nope' is neither in AfterStep.metrics" in warnings[0]


async def test_logging_tensor_every_n_secs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.logging_tensor"):
        async with HookBus() as bus:
            bus.add_hook(LoggingTensorHook(["loss"], every_n_secs=0.05))
            await loop(bus, [1.0, 2.0, 3.0])  # logs step 0 only: too quick for another
            await anyio.sleep(0.06)
            await loop(bus, [4.0, 5.0], first=3)  # logs step 3
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" (")[0] for line in lines] == [
        "global_step=0 loss = 1",
        "global_step=3 loss = 4",
    ]


def test_logging_tensor_bad_input() -> None:
    with pytest.raises(
        ValueError,
        match=r"LoggingTensorHook: expected exactly one of every_n_iter or every_n_secs, "
        r"got every_n_iter=None, every_n_secs=None",
    ):
        LoggingTensorHook(["loss"])
    with pytest.raises(ValueError, match=r"got every_n_iter=1, every_n_secs=2"):
        LoggingTensorHook(["loss"], every_n_iter=1, every_n_secs=2)
    with pytest.raises(ValueError, match=r"every_n_iter=...\): expected a positive int, got 0"):
        LoggingTensorHook(["loss"], every_n_iter=0)
    with pytest.raises(ValueError, match=r"every_n_secs=...\): expected a positive number"):
        LoggingTensorHook(["loss"], every_n_secs=-1.0)
    with pytest.raises(TypeError, match=r"names=...\): expected a list of names, got 'loss'"):
        LoggingTensorHook("loss", every_n_iter=1)
    with pytest.raises(ValueError, match=r"names=...\): expected a non-empty list"):
        LoggingTensorHook([], every_n_iter=1)


# ---------------------------------------------------------------------- EarlyStoppingHook


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
