"""AnomalyProfilerHook: real torch.profiler traces taken after an injected slow step or loss
spike (the step time comes from a clock moved by hand), read back as JSON."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from recis_async import HookBus
from recis_async.events import AfterLoadCheckpoint, AfterStep, BeforeStep, Start
from recis_async.hooks import AnomalyProfilerHook
from recis_async.hooks.anomaly_profiler import MIN_HISTORY

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


async def _train(
    bus: HookBus,
    clock: Clock,
    steps: int,
    *,
    slow: dict[int, float] | None = None,
    losses: dict[int, float] | None = None,
    first: int = 0,
) -> None:
    """``steps`` real training steps; step ``g`` takes ``slow.get(g)`` seconds on ``clock``
    (else 5 ms +- 10 %) and reports loss ``losses.get(g)`` (else 1.0 +- 10 %)."""
    torch.manual_seed(0)
    noise = random.Random(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    await bus.publish(Start())
    for g in range(first, first + steps):
        await bus.publish(BeforeStep(global_step=g))
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        clock.t += (slow or {}).get(g, 0.005 * noise.uniform(0.9, 1.1))
        value = (losses or {}).get(g, noise.uniform(0.9, 1.1))
        await bus.publish(AfterStep(global_step=g, samples=8, metrics={"loss": value}))


def _trace_steps(path: Path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    names = {str(e.get("name")) for e in events}
    assert any(n.startswith("aten::") for n in names)  # real operator events
    return sorted(n for n in names if n.startswith("ProfilerStep#"))


async def test_a_slow_step_is_profiled(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="recis_async.hooks.anomaly_profiler")
    clock = Clock()
    hook = AnomalyProfilerHook(steps=2, output_dir=tmp_path, clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await _train(bus, clock, 40, slow={30: 0.05})
    (trace,) = tmp_path.glob("*.json")
    assert trace.name == "0-anomaly-30-slow_step.json"
    # the two steps after the warm-up step
    assert _trace_steps(trace) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert hook.exported == [trace] and hook.fired == 1
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "slow step at global_step 30: 50 ms" in message
    assert "the median 5" in message and "of the last 30 steps" in message
    assert "profiling the next 2 step(s) (profile 1 of 3)" in message
    assert str(trace) in message
    assert not list(tmp_path.glob(".*.tmp"))


async def test_a_loss_spike_is_profiled(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="recis_async.hooks.anomaly_profiler")
    clock = Clock()
    hook = AnomalyProfilerHook(steps=1, slowdown=None, output_dir=tmp_path, clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await _train(bus, clock, 40, slow={25: 1.0}, losses={33: 8.0})  # slow is off
    (trace,) = tmp_path.glob("*.json")
    assert trace.name == "0-anomaly-33-loss_spike.json"
    assert len(_trace_steps(trace)) == 1
    (warning,) = caplog.records
    assert "loss spike at global_step 33: 8," in warning.getMessage()


async def test_a_normal_run_is_not_profiled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="recis_async.hooks.anomaly_profiler")
    clock = Clock()
    hook = AnomalyProfilerHook(steps=1, output_dir=tmp_path, clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        # slow and high-loss steps before the history is long enough are not anomalies
        early = {g: 0.5 for g in range(MIN_HISTORY)}
        await _train(bus, clock, 80, slow=early, losses={g: 50.0 for g in range(MIN_HISTORY)})
    assert list(tmp_path.iterdir()) == []
    assert hook.fired == 0 and caplog.records == []


async def test_at_most_max_profiles_and_the_count_survives_a_resume(tmp_path: Path) -> None:
    clock = Clock()
    slow = {g: 0.1 for g in range(30, 80, 10)}  # five slow steps
    hook = AnomalyProfilerHook(steps=1, max_profiles=2, output_dir=tmp_path / "a", clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await _train(bus, clock, 80, slow=slow)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "0-anomaly-30-slow_step.json",
        "0-anomaly-40-slow_step.json",
    ]
    state = hook.state_dict()
    assert state == {"fired": 2}
    resumed = AnomalyProfilerHook(steps=1, max_profiles=2, output_dir=tmp_path / "b", clock=clock)
    async with HookBus() as bus:
        bus.add_hook(resumed)
        resumed.load_state_dict(state)
        await bus.publish(AfterLoadCheckpoint(global_step=80))
        await _train(bus, clock, 60, slow={g + 50: v for g, v in slow.items()}, first=80)
    assert list((tmp_path / "b").iterdir()) == []


async def test_the_end_of_the_run_exports_a_profile_cut_short(tmp_path: Path) -> None:
    clock = Clock()
    hook = AnomalyProfilerHook(steps=5, output_dir=tmp_path, clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await _train(bus, clock, 33, slow={30: 0.1})  # warm-up 31, then 32 recorded
    (trace,) = tmp_path.glob("*.json")
    assert trace.name == "0-anomaly-30-slow_step.json"
    # step 32, then the span from its AfterStep to End (the step that never came)
    assert _trace_steps(trace) == ["ProfilerStep#1", "ProfilerStep#2"]


async def test_eval_steps_and_steps_without_before_step(tmp_path: Path) -> None:
    """Evaluation steps are not judged; a loop without BeforeStep is timed AfterStep to
    AfterStep."""
    clock = Clock()
    hook = AnomalyProfilerHook(steps=1, loss_jump=None, output_dir=tmp_path, clock=clock)
    async with HookBus() as bus:
        bus.add_hook(hook)
        for g in range(40):
            clock.t += 0.5 if g == 35 else 0.01
            if g == 30:  # a long evaluation between two steps is not a slow step
                await bus.publish(BeforeStep(is_train=False, global_step=g))
                clock.t += 5.0
                await bus.publish(AfterStep(is_train=False, global_step=g))
                clock.t += 0.01
            await bus.publish(AfterStep(global_step=g))
    assert [p.name for p in tmp_path.iterdir()] == ["0-anomaly-35-slow_step.json"]


def test_constructor_checks(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"AnomalyProfilerHook\(steps=...\): expected a positive int, got 1.5"
    ):
        AnomalyProfilerHook(1.5, output_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"AnomalyProfilerHook\(slowdown=...\): expected a number > 1 or None, got 0.5",
    ):
        AnomalyProfilerHook(slowdown=0.5, output_dir=tmp_path)
    with pytest.raises(
        ValueError,
        match=r"AnomalyProfilerHook\(loss_jump=...\): expected a positive number, got -2",
    ):
        AnomalyProfilerHook(loss_jump=-2, output_dir=tmp_path)
    with pytest.raises(ValueError, match="expected slowdown or loss_jump, got both None"):
        AnomalyProfilerHook(slowdown=None, loss_jump=None, output_dir=tmp_path)
    with pytest.raises(
        ValueError, match=r"AnomalyProfilerHook\(max_profiles=...\): expected a positive int, got 0"
    ):
        AnomalyProfilerHook(max_profiles=0, output_dir=tmp_path)
    with pytest.raises(
        ValueError, match=r"AnomalyProfilerHook\(loss_key=...\): expected a non-empty str"
    ):
        AnomalyProfilerHook(loss_key="", output_dir=tmp_path)
    with pytest.raises(TypeError, match=r"AnomalyProfilerHook\(clock=...\): expected a callable"):
        AnomalyProfilerHook(clock=3.0, output_dir=tmp_path)  # type: ignore[arg-type]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(
        ValueError, match=r"AnomalyProfilerHook\(output_dir=...\): expected a writable directory"
    ):
        AnomalyProfilerHook(output_dir=blocker / "sub")
    hook = AnomalyProfilerHook(steps=2, output_dir=tmp_path)
    assert repr(hook) == (
        f"<AnomalyProfilerHook steps=2 slowdown=3.0 loss_jump=3.0 max_profiles=3 window=100 "
        f"output_dir={str(tmp_path)!r}>"
    )
