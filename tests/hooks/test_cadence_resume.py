"""Step cadences count on the global step: a run resumed at step 23 acts at the same steps as a
run from step 0 (issue: LoggerHook logged ``<gstep=185>`` after a resume at 176).

Each built-in hook whose cadence is "every N training steps" runs on a real bus twice: steps
0..39, then a fresh hook on a fresh bus for steps 23..39, as after a restore at step 23.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from recis_async import Hook, HookBus, add_metric
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import (
    LoggerHook,
    MetricReportHook,
    ReportArguments,
    StepCounterHook,
    SummarySaverHook,
)
from recis_async.subscription import Filters, StepCadence, is_train

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]

RESTORED, END = 23, 40


class Every10(Hook):
    """A user hook declaring ``Filters(every_step=10)``."""

    def __init__(self) -> None:
        self.subscription_filters = {"after_step": Filters(every_step=10, when=is_train)}
        self.steps: list[int] = []

    def after_step(self, event: AfterStep) -> None:
        self.steps.append(event.global_step)


class RatesSeen(Hook):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def after_step(self, event: AfterStep) -> None:
        if "steps_per_sec" in event.metrics:
            self.steps.append(event.global_step)


async def steps(hooks: list[Hook], first: int) -> None:
    async with HookBus() as bus:
        for hook in hooks:
            bus.add_hook(hook)
        for g in range(first, END):
            await bus.publish(BeforeStep(global_step=g))
            add_metric("loss", float(g))
            await bus.publish(AfterStep(global_step=g, samples=4))
            await bus.publish(AfterStep(is_train=False, global_step=g))  # never counted


def logged(caplog: pytest.LogCaptureFixture, name: str, marker: str) -> list[int]:
    found = []
    for record in caplog.records:
        text = record.getMessage()
        if record.name == name and marker in text:
            found.append(int(text.split(marker, 1)[1].split(">")[0].split(" ")[0]))
    caplog.clear()
    return found


def hooks_of(kind: str) -> list[Hook]:
    if kind == "logger":
        return [LoggerHook(log_step=10)]
    if kind == "step_counter":
        return [StepCounterHook(every_n_steps=10), RatesSeen()]
    if kind == "metric_report":
        return [MetricReportHook(torch.nn.Linear(2, 1), ReportArguments(interval_step=10))]
    return [Every10()]


def acted(kind: str, hooks: list[Hook], caplog: pytest.LogCaptureFixture) -> list[int]:
    """The steps the hook acted at: its log lines, or the steps its subscriber saw."""
    if kind == "logger":
        return logged(caplog, "recis_async.hooks.logger", "<mode=train> <gstep=")
    if kind == "metric_report":
        return logged(caplog, "recis_async.hooks.metric_report", "<gstep=")
    seen = hooks[-1]
    assert isinstance(seen, RatesSeen | Every10)
    return seen.steps


@pytest.mark.parametrize("kind", ["logger", "step_counter", "metric_report", "every_step"])
async def test_resumed_run_acts_at_the_steps_of_an_uninterrupted_one(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    runs = []
    for first in (0, RESTORED):
        hooks = hooks_of(kind)
        await steps(hooks, first)
        runs.append(acted(kind, hooks, caplog))
    whole, resumed = runs
    if kind == "step_counter":  # the rate rides on the step after the interval's last
        assert whole == [10, 20, 30]
    else:
        assert whole == [9, 19, 29, 39]  # the steps completing 10, 20, 30, 40 steps
    assert resumed == [s for s in whole if s >= RESTORED]


async def test_summary_saver_writes_at_the_same_steps_after_a_resume(tmp_path: Path) -> None:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    written = []
    for first, folder in ((0, tmp_path / "whole"), (RESTORED, tmp_path / "resumed")):
        await steps([SummarySaverHook(10, folder)], first)
        acc = accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        written.append([e.step for e in acc.Scalars("loss")])
    assert written == [[9, 19, 29, 39], [29, 39]]


def test_step_cadence_counts_calls_when_the_loop_does_not_number_its_steps() -> None:
    class Step:
        def __init__(self, global_step: int) -> None:
            self.global_step = global_step

    unnumbered = StepCadence(3)
    assert [unnumbered.due(Step(0)) for _ in range(7)] == [False, False, True] * 2 + [False]
    numbered = StepCadence(3)
    assert [numbered.due(Step(g)) for g in range(7)] == [False, False, True] * 2 + [False]
    resumed = StepCadence(3)
    assert [resumed.due(Step(g)) for g in range(4, 9)] == [False, True, False, False, True]
    assert StepCadence(3).due(object()) is False  # no global_step at all: counted


def test_every_step_is_checked_and_described() -> None:
    from recis_async.subscription import filters

    with pytest.raises(ValueError, match=r"subscribe\(every_step=...\): expected a positive int"):
        filters("subscribe", every_step=0)
    assert filters("subscribe", every_step=5) == Filters(every_step=5)


async def test_describe_shows_every_step() -> None:
    async with HookBus() as bus:
        bus.add_hook(Every10())
        assert "every_step=10" in bus.describe()
