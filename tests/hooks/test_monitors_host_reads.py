"""The monitoring hooks of issue 24 (device stats, OOM observer, NVTX, anomaly profiler, timer)
read no tensor value on the host: counted with a TorchFunctionMode over a real training loop,
window steps and a profiled anomaly included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from host_reads import HostReads

from recis_async import HookBus
from recis_async.events import AfterBackward, AfterData, AfterStep, BeforeStep, Start
from recis_async.hooks import (
    AnomalyProfilerHook,
    DeviceStatsHook,
    MLTrackerHook,
    NvtxHook,
    OOMObserverHook,
    TimerHook,
)
from recis_async.trackers import JsonlTracker

pytestmark = pytest.mark.anyio


class Ranges:
    def range_push(self, msg: str) -> None: ...
    def range_pop(self) -> None: ...


async def test_no_host_read_with_every_monitoring_hook(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = [0.0]
    hooks = [
        MLTrackerHook("p", "reads", tracker=JsonlTracker(tmp_path / "t")),
        DeviceStatsHook(every_n_steps=5),
        OOMObserverHook(tmp_path / "oom"),
        NvtxHook(Ranges()),
        AnomalyProfilerHook(steps=2, output_dir=tmp_path / "prof", clock=lambda: t[0]),
        TimerHook(3600, clock=lambda: t[0]),
    ]
    counter = HostReads()
    with counter:
        float(torch.tensor(1.0))  # the counter sees a read
        assert [r.name for r in counter.reads] == ["__float__"]
        counter.reads.clear()
        per_step: list[int] = []
        async with HookBus() as bus:
            for hook in hooks:
                bus.add_hook(hook)
            await bus.publish(Start())
            for g in range(40):
                before = len(counter.reads)
                await bus.publish(BeforeStep(global_step=g))
                await bus.publish(AfterData(global_step=g))
                loss = model(torch.randn(8, 16)).pow(2).mean()
                loss.backward()
                await bus.publish(AfterBackward(global_step=g))
                opt.step()
                opt.zero_grad()
                t[0] += 0.5 if g == 30 else 0.005  # step 30 is slow: 31..33 are profiled
                await bus.publish(AfterStep(global_step=g, samples=8))
                per_step.append(len(counter.reads) - before)
    assert per_step == [0] * 40, counter.reads
    assert [p.name for p in (tmp_path / "prof").iterdir()] == ["0-anomaly-30-slow_step.json"]
    assert hooks[1].last is not None and hooks[1].last[0] == 39  # type: ignore[attr-defined]
