"""A Trainer run with checkpoints and a CSV history, for the preemption tests.

    python preempt_train.py OUT_DIR [--backend trio] [--resume]

Trains a small model on an endless stream with ``save_steps`` far away, so the only checkpoint
is the one taken at ``End``; prints ``ready`` once 5 steps are done and ``done <global_step>``
when ``train`` returns.  With ``--resume`` it restores from ``OUT_DIR/ckpt`` first.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import torch

from recis_async import Hook, Trainer, TrainingArguments
from recis_async.events import AfterStep
from recis_async.hooks import HistorySaverHook


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(0.005)  # the rest of a real step
        return torch.nn.functional.mse_loss(self.linear(batch["x"]).squeeze(-1), batch["y"])


class Stream:
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(0)
        for _ in itertools.count():
            x = torch.randn(4, 3, generator=gen)
            yield {"x": x, "y": x.sum(dim=1)}


class Ready(Hook):
    def __init__(self) -> None:
        self.told = False

    def after_step(self, event: AfterStep) -> None:
        if not self.told and event.local_step >= 4:
            self.told = True
            print("ready", flush=True)


async def main(out: Path, resume: bool, steps: int | None) -> None:
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    args = TrainingArguments(
        output_dir=str(out / "ckpt"), save_steps=10**9, max_to_keep=2, train_steps=steps
    )
    hooks: list[Any] = [HistorySaverHook(every_n_step=3, output_dir=out), Ready()]
    trainer = Trainer(
        model, args, train_dataset=Stream(), hooks=hooks, dense_optimizers=(opt, None)
    )
    await trainer.train(resume_from_checkpoint=resume)
    print(f"done {trainer.global_step}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", default="asyncio")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    ns = parser.parse_args()
    anyio.run(main, ns.out, ns.resume, ns.steps, backend=ns.backend)
