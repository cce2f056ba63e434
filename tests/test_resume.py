"""Trainer resume in one process: the data continues where the checkpoint was taken (plain
iterables, shuffled DataLoaders, windows), and a rerun without resume is refused or, with
``overwrite_output_dir``, starts again in a folder holding one run's checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from recis_async import Hook, Trainer, TrainingArguments
from recis_async.checkpoint import list_checkpoints
from recis_async.events import Start

pytestmark = pytest.mark.anyio


class Model(torch.nn.Module):
    """Records the ids of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append([int(i) for i in ids])
        return self.linear(ids.to(torch.float32).reshape(-1, 1)).pow(2).mean()


class Started(Hook):
    def __init__(self) -> None:
        self.count = 0

    def start(self, event: Start) -> None:
        self.count += 1


def trainer(out: Path, data: Any, hooks: list[Hook] | None = None, **args: Any) -> Trainer:
    model = Model()
    defaults: dict[str, Any] = {"output_dir": str(out), "save_steps": 4, "max_to_keep": 3}
    return Trainer(
        model,
        TrainingArguments(**{**defaults, **args}),
        train_dataset=data,
        hooks=hooks,
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None),
    )


def seen(t: Trainer) -> list[list[int]]:
    assert isinstance(t.model, Model)
    return t.model.seen


def loaders() -> dict[str, Any]:
    ids = torch.arange(40)
    return {
        "list": [ids[i : i + 4] for i in range(0, 40, 4)],
        "shuffle": DataLoader(ids, batch_size=4, shuffle=True),
        "own generator": DataLoader(
            ids, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
        ),
    }


@pytest.mark.parametrize("kind", ["list", "shuffle", "own generator"])
async def test_resume_reads_the_batches_an_uninterrupted_run_reads(
    tmp_path: Path, kind: str
) -> None:
    """Three epochs of 10 batches; stopped after 13 steps (epoch 1, batch 3), resumed by a
    trainer whose global generator is elsewhere (a new process): the batches it trains on are
    those the uninterrupted run trained on from step 13, each epoch holding every id once."""
    torch.manual_seed(0)
    whole = trainer(tmp_path / "whole", loaders()[kind], train_epoch=3)
    await whole.train()
    assert len(seen(whole)) == 30

    torch.manual_seed(0)
    first = trainer(tmp_path / "job", loaders()[kind], train_epoch=3, train_steps=13)
    await first.train()
    torch.manual_seed(1234)
    resumed = trainer(tmp_path / "job", loaders()[kind], train_epoch=3)
    await resumed.train(resume_from_checkpoint=True)
    assert resumed.global_step == 30
    assert seen(first) + seen(resumed) == seen(whole)
    for epoch in range(3):
        ids = sum(seen(whole)[epoch * 10 : epoch * 10 + 10], [])
        assert sorted(ids) == list(range(40))


async def test_ignore_data_skip_reads_the_pass_from_its_start(tmp_path: Path) -> None:
    data = loaders()["list"]
    first = trainer(tmp_path, data, train_epoch=2, train_steps=13)
    await first.train()
    resumed = trainer(tmp_path, data, train_epoch=2, ignore_data_skip=True)
    await resumed.train(resume_from_checkpoint=True)
    assert resumed.global_step == 23  # epoch 1 read whole again, epoch 0 not
    assert seen(resumed) == [b.tolist() for b in data]


class Windows:
    """Two windows of three batches an epoch (RecIS window IO)."""

    def windows(self) -> list[list[torch.Tensor]]:
        return [[torch.tensor([w * 3 + b]) for b in range(3)] for w in range(2)]


async def test_windowed_data_resumes_in_its_window(tmp_path: Path) -> None:
    first = trainer(tmp_path, Windows(), train_epoch=2, train_steps=4)  # window 1, batch 1
    await first.train()
    resumed = trainer(tmp_path, Windows(), train_epoch=2)
    await resumed.train(resume_from_checkpoint=True)
    assert seen(first) + seen(resumed) == [[i] for i in range(6)] * 2


async def test_a_plain_rerun_is_refused_before_anything_runs(tmp_path: Path) -> None:
    await trainer(tmp_path, loaders()["list"]).train()
    before = list_checkpoints(tmp_path)
    assert before[-1][0] == 10
    started = Started()
    again = trainer(tmp_path, loaders()["list"], hooks=[started])
    message = (
        rf"Trainer.train\(resume_from_checkpoint=False\): expected an output directory without "
        rf"checkpoints, got {tmp_path} holding [23] checkpoint\(s\) of an earlier run \(the newest "
        r"checkpoint-10.pt\); pass resume_from_checkpoint=True to continue that run, or "
        r"TrainingArguments\(overwrite_output_dir=True\)"
    )
    with pytest.raises(ValueError, match=message):
        await again.train()
    with pytest.raises(ValueError, match="expected an output directory without checkpoints"):
        await again.train(resume_from_checkpoint=tmp_path / "elsewhere")
    assert started.count == 0 and list_checkpoints(tmp_path) == before
    # resuming continues that run; a trainer that trained in this process continues its own
    await again.train(resume_from_checkpoint=str(tmp_path))
    assert started.count == 1
    await again.train()
    assert started.count == 2


async def test_overwrite_output_dir_removes_the_earlier_run(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    await trainer(tmp_path, loaders()["list"]).train()
    earlier = list_checkpoints(tmp_path)  # a save may be superseded by a newer one
    assert earlier[-1][0] == 10
    again = trainer(tmp_path, loaders()["list"], train_steps=6, overwrite_output_dir=True)
    with pytest.raises(ValueError, match=r"expected TrainingArguments\(overwrite_output_dir=False"):
        await again.train(resume_from_checkpoint=True)
    assert list_checkpoints(tmp_path) == earlier  # refused: nothing removed
    await again.train()
    kept = [s for s, _ in list_checkpoints(tmp_path)]
    assert kept[-1] == 6 and set(kept) <= {4, 6}  # this run's only
    assert sorted(os.listdir(tmp_path)) == [*(f"checkpoint-{s}.pt" for s in kept), "notes.txt"]


def test_new_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match=r"overwrite_output_dir=...\): expected a bool"):
        TrainingArguments(overwrite_output_dir="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ignore_data_skip=...\): expected a bool"):
        TrainingArguments(ignore_data_skip=1)  # type: ignore[arg-type]
