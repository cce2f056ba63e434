"""LoggerHook: rates from an injected clock (no sleeping), modes apart, metrics optional."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from recis_async import HookBus, add_metric
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import LoggerHook

pytestmark = pytest.mark.usefixtures("either_bus")

_FIELD = re.compile(r"<([\w/.]+)=([^>]*)>")


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def after_step(hook: LoggerHook, event: AfterStep) -> None:
    """Run the handler to completion: without all_reduce it never suspends (and returns a
    coroutine only when a line waits for reads)."""
    coro = hook.after_step(event)
    if coro is None:
        return
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise AssertionError("LoggerHook.after_step suspended without all_reduce")


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    return [
        dict(_FIELD.findall(r.getMessage()))
        for r in caplog.records
        if r.name == "recis_async.hooks.logger"
    ]


def _step(
    hook: LoggerHook,
    clock: Clock,
    gstep: int,
    *,
    dt: float,
    is_train: bool = True,
    samples: int = 32,
    metrics: dict[str, object] | None = None,
    lstep: int | None = None,
) -> None:
    local = gstep if lstep is None else lstep
    clock.t += dt
    after_step(
        hook,
        AfterStep(
            is_train=is_train,
            global_step=gstep,
            local_step=local,
            samples=samples,
            metrics=metrics or {},
        ),
    )


def test_rates_timed_from_the_end_of_the_first_step(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock(0.0)
    hook = LoggerHook(log_step=5, clock=clock)
    clock.t = 100.0  # a long setup after construction must not dilute the first line
    for g in range(10):
        _step(hook, clock, g, dt=0.1, metrics={"loss": 1.0 / (g + 1)})
        clock.t += 0.1 if g >= 5 else 0.0  # the second window also has 0.1 s between steps
    first, second = _lines(caplog)
    assert first["mode"] == "train" and first["gstep"] == "4" and first["lstep"] == "4"
    assert float(first["sps"]) == pytest.approx(10.0)  # steps 1-4 in 0.4 s (0 opened it)
    assert float(first["qps"]) == pytest.approx(320.0)  # samples/s, not steps/s
    assert first["loss"] == "0.2"
    assert float(second["sps"]) == pytest.approx(5 / 0.9, rel=1e-3)  # gaps count, from line 1
    assert float(second["qps"]) == pytest.approx(160 / 0.9, rel=1e-3)


def test_train_and_eval_counted_apart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    hook = LoggerHook(log_step=4, clock=clock)
    for g in range(2):
        _step(hook, clock, g, dt=0.1)
    for i in range(4):  # evaluation in the middle of a training window
        _step(hook, clock, 2, dt=0.05, is_train=False, samples=100, lstep=i, metrics={"auc": 0.5})
    clock.t += 7.0  # idle between eval and training resumes: belongs to neither
    for g in range(2, 4):
        _step(hook, clock, g, dt=0.1)
    ev, train = _lines(caplog)
    assert ev["mode"] == "eval" and ev["lstep"] == "3" and ev["auc"] == "0.5"
    assert float(ev["sps"]) == pytest.approx(20.0) and float(ev["qps"]) == pytest.approx(2000.0)
    assert train["mode"] == "train" and train["gstep"] == "3"
    assert float(train["sps"]) == pytest.approx(10.0)  # only the 0.4 s spent training
    assert "auc" not in train


def test_no_metrics_and_odd_values(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    hook = LoggerHook(log_step=1, clock=clock)
    _step(hook, clock, 0, dt=0.5)
    _step(
        hook,
        clock,
        1,
        dt=0.5,
        metrics={"n": 3, "flag": True, "vec": np.array([1.0, 3.0]), "note": "x" * 100},
    )
    plain, odd = _lines(caplog)
    assert set(plain) == {"mode", "gstep", "lstep", "qps", "sps"}
    assert odd["n"] == "3" and odd["flag"] == "True"
    assert odd["vec"] == "array[2](mean=2)" and odd["note"].endswith("...")


@pytest.mark.anyio
async def test_no_before_step_subscriber() -> None:
    """The hook times steps from AfterStep alone: a loop that skips the BeforeStep nobody
    receives (the Trainer, the adapters) loses nothing, and a published one costs no call."""
    async with HookBus() as bus:
        bus.add_hook(LoggerHook())
        assert not bus.has_subscribers(BeforeStep)
        assert bus.has_subscribers(AfterStep)


def test_zero_elapsed_is_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    hook = LoggerHook(log_step=1, clock=Clock())
    after_step(hook, AfterStep(global_step=0))
    (line,) = _lines(caplog)
    assert line["sps"] == "nan" and line["qps"] == "nan"


@pytest.mark.anyio
async def test_on_a_bus_with_add_metric(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    async with HookBus() as bus:
        bus.add_hook(LoggerHook(log_step=2, clock=clock))
        for g in range(4):
            await bus.publish(BeforeStep(global_step=g, local_step=g))
            clock.t += 0.25
            add_metric("loss", 0.5)
            await bus.publish(AfterStep(global_step=g, local_step=g, samples=4))
    lines = _lines(caplog)
    assert [line["gstep"] for line in lines] == ["1", "3"]
    assert all(float(line["sps"]) == pytest.approx(4.0) for line in lines)
    assert all(line["loss"] == "0.5" for line in lines)


def test_log_step_validation() -> None:
    """A wrong value is a ValueError, a wrong type (``"a"``, ``True``, ``2.5``) a TypeError."""
    for bad, error in ((0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(
            error, match=rf"LoggerHook\(log_step=...\): expected a positive int, got {bad!r}"
        ):
            LoggerHook(log_step=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"LoggerHook\(log_step=...\): .* got 'a'"):
        LoggerHook(log_step="a")  # type: ignore[arg-type]
    assert LoggerHook.rank_zero_only is True
    with pytest.raises(
        TypeError, match=r"LoggerHook\(logger=...\): expected a logging.Logger or None, got 'x'"
    ):
        LoggerHook(logger="x")  # type: ignore[arg-type]
