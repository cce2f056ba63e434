"""Issue 23, part 2: metrics recorded as tensors are read once per window, off the step.

Every consumer of ``AfterStep.metrics`` runs a loop that records its metrics as tensors
(``add_metric("loss", loss)``) under ``HostReads``, which counts every read of a tensor's value
made by the step's thread: none on any step of these loops (the reads happen in worker
threads, or at the end of the run), and the values the hooks report are the ones added.
"""

from __future__ import annotations

import io
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from host_reads import HostReads

from recis_async import HookBus, HookError, MetricAggregator, add_metric
from recis_async.compat import from_recis
from recis_async.events import AfterEval, AfterStep, AfterTrain, BeforeStep, Start
from recis_async.hooks import (
    AnomalyProfilerHook,
    EarlyStoppingHook,
    HistorySaverHook,
    LoggerHook,
    LoggingTensorHook,
    MetricReportHook,
    NanLossError,
    NanTensorHook,
    ProgressBarHook,
    StepCounterHook,
    SummarySaverHook,
)

pytestmark = pytest.mark.anyio

LOSSES = [0.5 + 0.01 * g for g in range(12)]  # recorded as float32: compared as f32(x)


async def run(
    bus: HookBus, counter: HostReads, losses: list[float], *, extra: bool = True
) -> list[int]:
    """A loop recording its loss (and a 2-element metric) as tensors; the reads per step."""
    per_step = []
    await bus.publish(Start())
    for g, value in enumerate(losses):
        before = len(counter.reads)
        counter.where = g
        await bus.publish(BeforeStep(global_step=g))
        loss = torch.tensor(value, dtype=torch.float32) * torch.ones(())  # a computed tensor
        add_metric("loss", loss)
        if extra:
            add_metric("pair", torch.tensor([value, 2 * value], dtype=torch.bfloat16))
        loss.add_(100.0)  # an in-place update after the call does not leak
        await bus.publish(AfterStep(global_step=g, samples=4))
        per_step.append(len(counter.reads) - before)
        if bus.should_stop:
            break
    counter.where = "end"
    return per_step


def f32(x: float) -> float:
    return float(np.float32(x))


async def test_logger_line_shows_the_log_steps_tensor_values_read_off_the_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counter = HostReads()
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.logger"), counter:
        async with HookBus() as bus:
            bus.add_hook(LoggerHook(log_step=4))
            reads = await run(bus, counter, LOSSES)
    assert reads == [0] * len(LOSSES), counter.reads
    lines = [r.getMessage() for r in caplog.records if "<mode=train>" in r.getMessage()]
    assert [line.split()[1] for line in lines] == ["<gstep=3>", "<gstep=7>", "<gstep=11>"]
    for line, g in zip(lines, (3, 7, 11), strict=True):
        assert f"<loss={f32(LOSSES[g]):.6g}>" in line
        pair = np.array([LOSSES[g], 2 * LOSSES[g]], dtype=np.float32)  # bfloat16 -> float32
        bf = torch.tensor(pair, dtype=torch.bfloat16).float().numpy()
        assert f"<pair=array[2](mean={float(bf.mean()):.6g})>" in line


async def test_progress_postfix_shows_the_last_tensor_values() -> None:
    out = io.StringIO()
    counter = HostReads()
    with counter:
        async with HookBus() as bus:
            bus.add_hook(ProgressBarHook(file=out, mininterval=1e-9))
            reads = await run(bus, counter, LOSSES)
    assert reads == [0] * len(LOSSES), counter.reads
    last = out.getvalue().replace("\n", "\r").split("\r")
    final = [f for f in last if f.strip()][-1]
    assert f"loss={f32(LOSSES[-1]):.3g}" in final, final


async def test_nan_tensor_fails_exactly_lag_steps_later() -> None:
    losses = [0.5, 0.4, 0.3, math.nan, 0.2, 0.1, 0.05, 0.01]
    counter = HostReads()
    seen: list[int] = []
    with counter, pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.add_hook(NanTensorHook())
            bus.subscribe(AfterStep, lambda e: seen.append(e.global_step))
            await run(bus, counter, losses, extra=False)
    assert isinstance(info.value.__cause__, NanLossError)
    assert "NaN/inf loss nan ('loss') at global_step 3 (found at global_step 5)" in str(info.value)
    assert seen == [0, 1, 2, 3, 4]  # step 5's publish failed: k + lag with lag 2
    # no read on steps 0..4; step 5 reads the failing loss once, to name it
    assert [r.where for r in counter.reads if r.where is not None] == [5]


@pytest.mark.usefixtures("device_path")
@pytest.mark.parametrize("lag", [1, 2, 3])
async def test_nan_tensor_stop_is_requested_at_step_k_plus_lag(lag: int) -> None:
    losses = [0.5, 0.4, math.inf, 0.3, 0.2, 0.1, 0.05]
    stopped_at: list[int] = []
    async with HookBus() as bus:
        bus.add_hook(NanTensorHook(fail_on_nan_loss=False, lag=lag))
        await bus.publish(Start())
        for g, value in enumerate(losses):
            add_metric("loss", torch.tensor(value))
            await bus.publish(AfterStep(global_step=g))
            if bus.should_stop:
                stopped_at.append(g)
                break
        assert bus.stop_reason == (
            f"NanTensorHook: NaN/inf loss inf ('loss') at global_step 2 (found at global_step "
            f"{2 + lag})"
        )
    assert stopped_at == [2 + lag]


async def test_nan_tensor_strict_acts_on_its_step_reading_every_step() -> None:
    counter = HostReads()
    with counter, pytest.raises(HookError, match=r"NaN/inf loss nan \('loss'\) at global_step 1$"):
        async with HookBus() as bus:
            bus.add_hook(NanTensorHook(strict=True))
            await run(bus, counter, [0.5, math.nan, 0.3], extra=False)
    steps = [r.where for r in counter.reads if r.where is not None]
    assert steps[:3] == [0, 1, 1]  # the documented synchronization, and the value named


@pytest.mark.parametrize("lag", [1, 2])
async def test_a_cpu_loss_is_read_at_the_call_and_a_nan_caught_on_its_step(lag: int) -> None:
    """A CPU tensor waits for nothing: the collector reads it, and the hook acts at once."""
    stopped_at: list[int] = []
    async with HookBus() as bus:
        bus.add_hook(NanTensorHook(fail_on_nan_loss=False, lag=lag))
        await bus.publish(Start())
        for g, value in enumerate([0.5, 0.4, math.inf, 0.3, 0.2]):
            add_metric("loss", torch.tensor(value))
            await bus.publish(AfterStep(global_step=g))
            if bus.should_stop:
                stopped_at.append(g)
                break
        assert bus.stop_reason == "NanTensorHook: NaN/inf loss inf ('loss') at global_step 2"
    assert stopped_at == [2]


@pytest.mark.usefixtures("device_path")
async def test_nan_in_the_last_steps_is_caught_when_training_ends() -> None:
    with pytest.raises(
        HookError, match=r"NaN/inf loss nan \('loss'\) at global_step 2 \(found at global_step 3\)"
    ):
        async with HookBus() as bus:
            bus.add_hook(NanTensorHook())
            for g, value in enumerate([0.5, 0.4, math.nan]):
                add_metric("loss", torch.tensor(value))
                await bus.publish(AfterStep(global_step=g))
            await bus.publish(AfterTrain(global_step=3))


async def test_early_stopping_on_tensor_step_metrics_decides_on_the_values_added() -> None:
    values = [0.9, 0.8, 0.85, 0.86, 0.87, 0.88, 0.95]
    counter = HostReads()
    hook = EarlyStoppingHook("val", patience=3, source="step")
    with counter:
        async with HookBus() as bus:
            bus.add_hook(hook)
            await bus.publish(Start())
            for g, value in enumerate(values):
                counter.where = g
                add_metric("val", torch.tensor(value))
                await bus.publish(AfterStep(global_step=g))
            counter.where = "end"
        assert bus.stop_reason is not None
        assert "did not improve for 3 evaluation(s) (best 0.800000011920929 at step 2" in (
            bus.stop_reason
        )
    assert [r for r in counter.reads if r.where != "end"] == []
    assert hook.best == pytest.approx(0.8) and hook.best_step == 2


async def test_history_rows_from_tensor_losses(tmp_path: Path) -> None:
    counter = HostReads()
    hook = HistorySaverHook(4, tmp_path)
    with counter:
        async with HookBus() as bus:
            bus.add_hook(hook)
            reads = await run(bus, counter, LOSSES)
    assert reads == [0] * len(LOSSES), counter.reads
    expected = [np.mean([f32(x) for x in LOSSES[i : i + 4]]) for i in (0, 4, 8)]
    rows = hook.history
    assert [r["steps"] for r in rows] == [4, 8, 12]
    assert [r["mean_losses"] for r in rows] == pytest.approx(expected)
    assert [r["total_losses"] for r in rows] == pytest.approx([4 * 4 * e for e in expected])
    text = (tmp_path / "history.csv").read_text().splitlines()
    assert len(text) == 4 and float(text[1].split(",")[0]) == pytest.approx(expected[0])


async def test_summary_scalars_from_tensor_metrics(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    counter = HostReads()
    with counter:
        async with HookBus() as bus:
            bus.add_hook(SummarySaverHook(4, tmp_path))
            reads = await run(bus, counter, LOSSES)
    assert reads == [0] * len(LOSSES), counter.reads
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [3, 7, 11]
    assert [e.value for e in loss] == pytest.approx([f32(LOSSES[g]) for g in (3, 7, 11)])


async def test_logging_tensor_hook_line_from_tensor_values(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counter = HostReads()
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.logging_tensor"), counter:
        async with HookBus() as bus:
            bus.add_hook(LoggingTensorHook(["loss", "pair"], every_n_iter=5))
            reads = await run(bus, counter, LOSSES)
    assert reads == [0] * len(LOSSES), counter.reads
    lines = [r.getMessage() for r in caplog.records]
    steps = [line.split()[0] for line in lines]
    assert steps == ["global_step=0", "global_step=5", "global_step=10"]
    assert f"loss = {f32(LOSSES[5]):.6g}, pair = [" in lines[1]


async def test_anomaly_profiler_judges_a_tensor_loss_spike(tmp_path: Path) -> None:
    losses = [1.0] * 25 + [10.0] + [1.0] * 6
    t = [0.0]

    def clock() -> float:
        t[0] += 0.01
        return t[0]

    counter = HostReads()
    with counter:
        async with HookBus() as bus:
            bus.add_hook(
                AnomalyProfilerHook(steps=1, slowdown=None, output_dir=tmp_path, clock=clock)
            )
            reads = await run(bus, counter, losses, extra=False)
    assert reads == [0] * len(losses), counter.reads
    # the spike at step 25 is judged two steps later, and the file names the spike's step
    assert [p.name for p in tmp_path.iterdir()] == ["0-anomaly-27-loss_spike.json"]


async def test_step_counter_and_metric_report_read_nothing_beside_tensor_metrics() -> None:
    model = torch.nn.Linear(2, 1)
    counter = HostReads()
    report = MetricReportHook(model)
    with counter:
        async with HookBus() as bus:
            bus.add_hook(StepCounterHook(every_n_steps=3))
            bus.add_hook(report)
            reads = await run(bus, counter, LOSSES)
    assert reads == [0] * len(LOSSES), counter.reads


async def test_eval_pass_accumulates_tensors_and_reads_once_at_its_end() -> None:
    counter = HostReads()
    agg = MetricAggregator()
    seen: list[AfterEval] = []
    rows = [(0.5, 4), (0.25, 2), (1.0, 2)]
    with counter:
        async with HookBus() as bus:
            bus.subscribe(AfterEval, seen.append)
            with bus.subscribe(AfterStep, agg.update, when=lambda e: not e.is_train):
                for g, (value, samples) in enumerate(rows):
                    counter.where = g
                    await bus.publish(BeforeStep(is_train=False, global_step=g))
                    add_metric("loss", torch.tensor(value))
                    add_metric("hits", torch.tensor(int(value * 4)), reduce="sum")
                    add_metric("top", torch.tensor([value, -value]), reduce="max")
                    add_metric("low", torch.tensor(value, dtype=torch.bfloat16), reduce="min")
                    add_metric("med", torch.tensor(value), reduce=np.median)
                    add_metric("last", torch.tensor(value), reduce="last")
                    await bus.publish(AfterStep(is_train=False, global_step=g, samples=samples))
            counter.where = "end"
            metrics = await agg.compute_all_ranks()
            await bus.publish(AfterEval(global_step=3, steps=agg.steps, metrics=metrics))
    assert [r for r in counter.reads if r.where != "end"] == [], counter.reads
    got = seen[0].metrics
    assert got["loss"] == pytest.approx((0.5 * 4 + 0.25 * 2 + 1.0 * 2) / 8)
    assert got["hits"] == 2 + 1 + 4 and isinstance(got["hits"], int)
    assert got["top"].tolist() == [1.0, -0.25]
    assert got["low"] == 0.25 and got["med"] == 0.5 and got["last"] == 1.0


class RecisLogEvery:
    """A RecIS-style hook that reads the loss at its own log steps only."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, float]] = []

    def after_step(self, metrics: dict[str, Any], global_step: torch.Tensor, is_train: bool):
        if int(global_step) % 5 == 4:
            self.logged.append((int(global_step), metrics["loss"].item()))


async def test_recis_hooks_get_the_device_tensors_unread() -> None:
    counter = HostReads()
    recis = RecisLogEvery()
    with counter:
        async with HookBus() as bus:
            bus.add_hook(from_recis(recis))
            reads = await run(bus, counter, LOSSES)
    # compat reads nothing: the reads are the RecIS hook's own (int(global_step), .item())
    sources = {r.source.rsplit(":", 1)[0] for r in counter.reads}
    assert all(s.endswith("test_metric_windows.py") for s in sources), sources
    assert {r.where for r in counter.reads if r.name == "item"} == {4, 9}
    assert recis.logged == [(4, pytest.approx(f32(LOSSES[4]))), (9, pytest.approx(f32(LOSSES[9])))]
    assert reads == [1 + 2 * (g % 5 == 4) for g in range(len(LOSSES))]
