"""NanTensorHook (recis_async.hooks.nan): the exact steps it acts on."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hooks_support import Steps, loop

from recis_async import (
    HookBus,
    HookError,
)
from recis_async.events import AfterStep
from recis_async.hooks import (
    NanLossError,
    NanTensorHook,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


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
