"""HistorySaverHook: rows, the CSV read back with csv and pandas, restore without duplicates."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from hooks_support import Reg, loop

from recis_async import Hook, HookBus, HookError, Trainer, TrainingArguments, add_metric
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import (
    CheckpointSaverHook,
    HistorySaverHook,
    restore_checkpoint,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


async def test_history_rows_and_csv_read_back(tmp_path: Path) -> None:
    hook = HistorySaverHook(every_n_step=2, output_dir=tmp_path)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await loop(bus, [1.0, 2.0, 3.0, 4.0, 5.0])
        await bus.publish(AfterStep(is_train=False, global_step=5, metrics={"loss": 99.0}))
    expected = [
        {"mean_losses": 1.5, "total_losses": 24.0, "steps": 2},
        {"mean_losses": 3.5, "total_losses": 56.0, "steps": 4},
        {"mean_losses": 5.0, "total_losses": 40.0, "steps": 5},  # the partial interval, at End
    ]
    assert hook.history == expected
    assert hook.path == str(tmp_path / "history.csv")
    rows = read_csv(tmp_path / "history.csv")
    assert [
        {
            "mean_losses": float(r["mean_losses"]),
            "total_losses": float(r["total_losses"]),
            "steps": int(r["steps"]),
        }
        for r in rows
    ] == expected
    frame = pd.read_csv(tmp_path / "history.csv")
    assert list(frame.columns) == ["mean_losses", "total_losses", "steps"]
    assert frame.to_dict("records") == expected
    assert pd.DataFrame(hook.history).equals(frame)


async def test_history_weights_by_samples_and_aligns_to_the_global_step() -> None:
    hook = HistorySaverHook(every_n_step=3)
    async with HookBus() as bus:
        bus.add_hook(hook)
        # a run resumed at step 4 without restored state: its first interval is steps 4, 5
        for step, (loss, n) in enumerate([(1.0, 2), (4.0, 6), (2.0, 0)], start=4):
            await bus.publish(BeforeStep(global_step=step))
            add_metric("loss", loss)
            await bus.publish(AfterStep(global_step=step, samples=n))
    assert hook.history == [
        {"mean_losses": (2 * 1.0 + 6 * 4.0) / 8, "total_losses": 26.0, "steps": 6},
        {"mean_losses": 2.0, "total_losses": 2.0, "steps": 7},  # no samples: counts as one
    ]


async def test_history_from_the_trainer() -> None:
    hook = HistorySaverHook(every_n_step=2)

    class Losses(Hook):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def after_step(self, event: AfterStep) -> None:
            self.losses.append(event.metrics["loss"])

    seen = Losses()
    model = Reg()
    await Trainer(
        model,
        TrainingArguments(save_steps=None),
        train_dataset=[{"x": torch.randn(4, 3), "y": torch.randn(4)} for _ in range(4)],
        hooks=[hook, seen],
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
    ).train()
    l0, l1, l2, l3 = seen.losses
    assert hook.history == [
        {
            "mean_losses": pytest.approx((l0 + l1) / 2),
            "total_losses": pytest.approx(4 * (l0 + l1)),
            "steps": 2,
        },
        {
            "mean_losses": pytest.approx((l2 + l3) / 2),
            "total_losses": pytest.approx(4 * (l2 + l3)),
            "steps": 4,
        },
    ]


@pytest.mark.async_bus_only  # awaits the hook's own coroutines from the test
async def test_history_restored_from_a_checkpoint_rewrites_the_csv_without_duplicates(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(2, 1)
    out = tmp_path / "hist"
    with pytest.raises(RuntimeError, match="crash"):
        async with HookBus() as bus:
            bus.add_hook(HistorySaverHook(every_n_step=2, output_dir=out))
            saver = CheckpointSaverHook(tmp_path / "ckpt", save_steps=3, model=model)
            bus.add_hook(saver)
            await loop(bus, [1.0, 2.0, 3.0])  # checkpoint at step 3: rows [2], step 3 pending
            await saver.flush()
            await loop(bus, [4.0, 5.0], first=3)  # rows 4 and 5 (at End) after it
            raise RuntimeError("crash")
    assert [r["steps"] for r in read_csv(out / "history.csv")] == ["2", "4", "5"]

    hook = HistorySaverHook(every_n_step=2, output_dir=out)
    async with HookBus() as bus:
        bus.add_hook(hook)
        assert await restore_checkpoint(bus, tmp_path / "ckpt", model) == 3
        assert hook.history == [{"mean_losses": 1.5, "total_losses": 24.0, "steps": 2}]
        await loop(bus, [14.0, 15.0], first=3)  # steps 3 (restored half) + 4, then 5 at End
    expected = [
        {"mean_losses": 1.5, "total_losses": 24.0, "steps": 2},
        {"mean_losses": 8.5, "total_losses": 136.0, "steps": 4},  # (3 + 14) / 2
        {"mean_losses": 15.0, "total_losses": 120.0, "steps": 5},
    ]
    assert hook.history == expected
    assert pd.read_csv(out / "history.csv").to_dict("records") == expected


async def test_a_fresh_run_replaces_an_old_csv_even_without_rows(tmp_path: Path) -> None:
    (tmp_path / "history.csv").write_text("mean_losses,total_losses,steps\n9,9,9\n")
    async with HookBus() as bus:
        bus.add_hook(HistorySaverHook(every_n_step=5, output_dir=tmp_path))
    assert read_csv(tmp_path / "history.csv") == []
    assert sorted(os.listdir(tmp_path)) == ["history.csv"]


async def test_history_csv_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    async with HookBus() as bus:
        bus.add_hook(HistorySaverHook(every_n_step=1, output_dir=tmp_path))
        await loop(bus, [1.0])
    assert os.listdir(tmp_path) == ["history-rank1.csv"]


async def test_history_writer_failure_surfaces(tmp_path: Path) -> None:
    out = tmp_path / "hist"
    with pytest.raises(HookError, match=r"HistorySaverHook\(.*history.csv\)' failed"):
        async with HookBus() as bus:
            bus.add_hook(HistorySaverHook(every_n_step=1, output_dir=out))
            out.rmdir()
            out.write_text("now a file")
            await loop(bus, [1.0, 2.0])
    assert os.listdir(tmp_path) == ["hist"]


async def test_history_refuses_a_step_without_loss() -> None:
    with pytest.raises(HookError, match=r"metrics has no 'loss' \(got \['acc'\]\)"):
        async with HookBus() as bus:
            bus.add_hook(HistorySaverHook(every_n_step=1))
            await bus.publish(AfterStep(global_step=0, metrics={"acc": 1.0}))


def test_history_bad_input(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"HistorySaverHook\(every_n_step=...\): expected a positive int, got 0"
    ):
        HistorySaverHook(every_n_step=0)
    a_file = tmp_path / "f"
    a_file.write_text("")
    with pytest.raises(ValueError, match=r"output_dir=...\): expected a writable directory, got"):
        HistorySaverHook(every_n_step=1, output_dir=a_file)
