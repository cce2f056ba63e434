"""ProfilerHook: real torch.profiler cycles exported as Chrome traces, parsed back as JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from recis_async import HookBus, HookError
from recis_async.events import AfterStep, BeforeStep, Start
from recis_async.hooks import ProfilerHook

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


async def _train(bus: HookBus, steps: int, *, eval_every: int = 0) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    await bus.publish(Start())
    for step in range(steps):
        await bus.publish(BeforeStep(global_step=step))
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        await bus.publish(AfterStep(global_step=step, samples=8))
        if eval_every and step % eval_every == 0:  # eval steps do not advance the schedule
            await bus.publish(BeforeStep(is_train=False, global_step=step))
            await bus.publish(AfterStep(is_train=False, global_step=step))


def _events(path: Path) -> list[dict[str, object]]:
    trace = json.loads(path.read_text())
    return list(trace["traceEvents"])


async def test_schedule_and_chrome_traces(tmp_path: Path) -> None:
    hook = ProfilerHook(wait=1, warmup=1, active=2, repeat=2, output_dir=tmp_path / "tl")
    async with HookBus() as bus:
        bus.add_hook(hook)
        await _train(bus, 12, eval_every=3)
    files = sorted(p.name for p in (tmp_path / "tl").iterdir())
    # cycles of 4 steps (wait, warmup, 2 active) end after steps 3 and 7; repeat=2 stops there
    assert files == ["0-timeline-3.json", "0-timeline-7.json"]
    for name in files:
        events = _events(tmp_path / "tl" / name)
        names = {str(e.get("name")) for e in events}
        steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
        assert len(steps) == 2  # the two active steps
        assert any(n.startswith("aten::") for n in names)  # real operator events
    assert sorted(p.name for p in hook.exported) == files


async def test_end_exports_a_cycle_cut_short(tmp_path: Path) -> None:
    hook = ProfilerHook(wait=0, warmup=1, active=5, repeat=1, output_dir=tmp_path)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await _train(bus, 4)  # stops during the active phase
    (trace,) = list(tmp_path.glob("*-timeline-*.json"))
    assert trace.name == "0-timeline-3.json"
    assert any(str(e.get("name")).startswith("aten::") for e in _events(trace))
    assert not list(tmp_path.glob(".*.tmp"))


async def test_rank_in_file_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    async with HookBus() as bus:
        bus.add_hook(ProfilerHook(wait=0, warmup=0, active=1, repeat=1, output_dir=tmp_path))
        await _train(bus, 2)
    assert [p.name for p in tmp_path.glob("*.json")] == ["3-timeline-0.json"]


async def test_export_failure_surfaces_as_hook_error(tmp_path: Path) -> None:
    out = tmp_path / "gone"
    hook = ProfilerHook(wait=0, warmup=0, active=1, repeat=1, output_dir=out)
    with pytest.raises(HookError, match="ProfilerHook.export"):
        async with HookBus() as bus:
            bus.add_hook(hook)
            shutil.rmtree(out)  # the directory disappears under the running job
            await _train(bus, 3)
    assert hook.exported == []


def test_constructor_validation(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(
        ValueError, match=r"ProfilerHook\(output_dir=...\): expected a writable directory"
    ):
        ProfilerHook(output_dir=blocker / "sub")
    with pytest.raises(ValueError, match="ProfilerHook.active: expected a positive int, got 0"):
        ProfilerHook(active=0, output_dir=tmp_path)
    with pytest.raises(ValueError, match="ProfilerHook.wait: expected an int >= 0, got -1"):
        ProfilerHook(wait=-1, output_dir=tmp_path)
    with pytest.raises(ValueError, match="ProfilerHook.repeat: expected an int >= 0, got 1.5"):
        ProfilerHook(repeat=1.5, output_dir=tmp_path)  # type: ignore[arg-type]
