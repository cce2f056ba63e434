"""TraceHook(steps=...): eval steps are traced as in RecIS unless the hook is told otherwise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest
import torch
from toy import Model, batches

from recis_async import HookBus, Trainer, TrainingArguments, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink

FIELDS = ["step", "is_train", "row"]
TYPES = ["bigint", "boolean", "bigint"]


def rows(root: Path, table: str) -> list[tuple[int, bool, int]]:
    data = pads.dataset(root / table).to_table()
    columns = [data.column(name).to_pylist() for name in FIELDS]
    return sorted(zip(*columns, strict=True))


def hook(root: Path, table: str, **kw: object) -> TraceHook:
    return TraceHook(ParquetSink(root, table, rank=0), FIELDS, TYPES, **kw)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_all_train_or_eval_steps_each_reach_their_table(tmp_path: Path) -> None:
    async with HookBus() as bus:
        bus.add_hook(hook(tmp_path, "all"))  # the default: as RecIS
        bus.add_hook(hook(tmp_path, "train", steps="train"))
        bus.add_hook(hook(tmp_path, "eval", steps="eval"))
        for step, is_train in enumerate([True, True, False, False, False, True]):
            await bus.publish(BeforeStep(is_train=is_train, global_step=step))
            add_to_trace("step", [step] * 3)
            add_to_trace("is_train", [is_train] * 3)  # the marker column, traced by the loop
            add_to_trace("row", list(range(3)))
            await bus.publish(AfterStep(is_train=is_train, global_step=step, samples=3))
    every = [(s, t, r) for s, t in enumerate([1, 1, 0, 0, 0, 1]) for r in range(3)]
    every = [(s, bool(t), r) for s, t, r in every]
    assert rows(tmp_path, "all") == every
    assert rows(tmp_path, "train") == [x for x in every if x[1]]
    assert rows(tmp_path, "eval") == [x for x in every if not x[1]]


class Traced(Model):
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n = len(batch["y"])
        add_to_trace("step", np.full(n, -1))
        add_to_trace("is_train", np.full(n, self.training))
        add_to_trace("row", np.arange(n))
        return super().forward(batch)


@pytest.mark.anyio
async def test_the_trainer_traces_eval_steps_by_default_and_not_with_steps_train(
    tmp_path: Path,
) -> None:
    model = Traced()
    trainer = Trainer(
        model,
        TrainingArguments(save_steps=None),
        train_dataset=batches(2),
        eval_dataset=batches(3, seed=1),
        hooks=[hook(tmp_path, "all"), hook(tmp_path, "train", steps="train")],
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None),
    )
    await trainer.train_and_evaluate()
    marks = [t for _, t, _ in rows(tmp_path, "all")]
    assert marks.count(True) == 2 * 4 and marks.count(False) == 3 * 4
    assert [t for _, t, _ in rows(tmp_path, "train")] == [True] * 8


def test_steps_is_checked(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"TraceHook\(steps=...\): expected one of 'all', 'train', 'eval', got 'test'",
    ):
        hook(tmp_path, "t", steps="test")
