"""LoggingTensorHook (recis_async.hooks.logging_tensor): the exact steps it acts on."""

from __future__ import annotations

import logging

import pytest
from hooks_support import loop

from recis_async import (
    HookBus,
    add_metric,
    add_to_ml_tracker,
)
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import (
    LoggingTensorHook,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


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


async def test_logging_tensor_every_n_secs(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]  # the bus's clock, moved by hand: a loaded machine cannot stretch a window
    monkeypatch.setattr("recis_async.bus.perf_counter", lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.logging_tensor"):
        async with HookBus() as bus:
            bus.add_hook(LoggingTensorHook(["loss"], every_n_secs=0.05))
            await loop(bus, [1.0, 2.0, 3.0])  # logs step 0 only: no time passed
            clock[0] += 0.06
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


async def test_logging_tensor_every_n_iter_counts_on_the_global_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run resumed at step 7 logs the steps an uninterrupted run logs (it logged its 1st,
    6th, ... step: 7 and 12)."""
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.logging_tensor"):
        async with HookBus() as bus:
            bus.add_hook(LoggingTensorHook(["loss"], every_n_iter=5))
            await loop(bus, [float(i) for i in range(7, 16)], first=7)
    steps = [r.getMessage().split(" ")[0] for r in caplog.records]
    assert steps == ["global_step=10", "global_step=15"]
