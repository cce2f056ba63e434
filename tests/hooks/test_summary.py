"""SummarySaverHook: scalars and histograms read back with TensorBoard's event reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recis_async import HookBus, HookError, add_metric
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import SummarySaverHook

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _read(path: Path) -> object:
    acc = event_accumulator.EventAccumulator(
        str(path), size_guidance={"scalars": 0, "histograms": 0}
    )
    acc.Reload()
    return acc


async def test_scalars_and_histograms_every_save_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    snapshots: dict[int, float] = {}
    async with HookBus() as bus:
        bus.add_hook(SummarySaverHook(3, tmp_path, model=model))
        for g in range(9):
            await bus.publish(BeforeStep(global_step=g))
            loss = model(torch.randn(16, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            add_metric("loss", loss)
            add_metric("scores", torch.linspace(0, 1, 5) * g)
            snapshots[g] = float(model[0].weight.detach().sum())
            await bus.publish(AfterStep(global_step=g, samples=16))
            await bus.publish(AfterStep(is_train=False, global_step=g, metrics={"loss": 9.0}))
    acc = _read(tmp_path)
    loss = acc.Scalars("loss")  # type: ignore[attr-defined]
    assert [e.step for e in loss] == [2, 5, 8]
    assert all(e.value != 9.0 for e in loss)  # eval steps are not summarised
    scores = acc.Histograms("scores")  # type: ignore[attr-defined]
    assert [e.step for e in scores] == [2, 5, 8]
    assert scores[1].histogram_value.max == pytest.approx(5.0)
    weights = acc.Histograms("params/0.weight")  # type: ignore[attr-defined]
    assert [e.step for e in weights] == [2, 5, 8]
    for event in weights:  # the parameters as they were at that step, not at write time
        assert event.histogram_value.num == 32
        assert event.histogram_value.sum == pytest.approx(snapshots[event.step], abs=1e-4)
    assert len(acc.Histograms("params/2.bias")) == 3  # type: ignore[attr-defined]


async def test_bad_metric_fails_at_its_publish(tmp_path: Path) -> None:
    async with HookBus() as bus:
        bus.add_hook(SummarySaverHook(1, tmp_path))
        with pytest.raises(HookError, match=r"AfterStep.metrics\['name'\]: expected a number"):
            await bus.publish(AfterStep(metrics={"name": "resnet"}))
        await bus.publish(AfterStep(global_step=1, metrics={"loss": 1.0}))
    assert [e.step for e in _read(tmp_path).Scalars("loss")] == [1]  # type: ignore[attr-defined]


def test_validation(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"SummarySaverHook\(save_steps=...\): expected a positive int, got 0"
    ):
        SummarySaverHook(0, tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(
        ValueError, match=r"SummarySaverHook\(output_dir=...\): expected a writable"
    ):
        SummarySaverHook(10, blocker / "tb")
    with pytest.raises(TypeError, match="SummarySaverHook.model: expected a torch.nn.Module"):
        SummarySaverHook(10, tmp_path, model="m")  # type: ignore[arg-type]
