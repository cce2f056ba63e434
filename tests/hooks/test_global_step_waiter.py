"""GlobalStepWaiterHook (recis_async.hooks.global_step_waiter): the exact steps it acts on."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import anyio
import pytest
from hooks_support import Steps, loop

from recis_async import (
    HookBus,
    HookError,
)
from recis_async.events import BeforeStep
from recis_async.hooks import (
    GlobalStepWaiterHook,
    latest_checkpoint_step,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


@pytest.mark.async_bus_only  # the chief is a task that runs while the publish waits
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


@pytest.mark.async_bus_only  # the trainer is a task that writes while the publish waits
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


async def test_waiter_timeout() -> None:
    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.add_hook(GlobalStepWaiterHook(10, lambda: 3, poll_interval=0.01, timeout=0.05))
            await bus.publish(BeforeStep(global_step=0))
    assert isinstance(info.value.__cause__, TimeoutError)
    assert "the step source reported 3" in str(info.value)
    assert "expected >= 10 within timeout=0.05s" in str(info.value)


@pytest.mark.async_bus_only  # the stop is requested by a task that runs while the publish waits
async def test_waiter_stop_request() -> None:
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
