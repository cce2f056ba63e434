"""One rank of a torchrun job driving the Trainer, for tests/test_distributed.py.

    torchrun --nproc_per_node=2 dist_train.py OUT_DIR MODE

MODE: ``stop`` (rank 1 requests a stop after step 3), ``fail`` (rank 1's model raises at
step 3), ``uneven`` (rank 0 has 5 batches, rank 1 has 8; two epochs).  Each rank writes
``OUT_DIR/rank<r>.json``: the AfterStep steps it saw, how the run ended, and any error text.
"""

from __future__ import annotations

import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as tdist

from recis_async import Hook, HookBus, Trainer, TrainingArguments
from recis_async.events import AfterStep, End


class Model(torch.nn.Module):
    def __init__(self, fail_at: int | None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.calls == self.fail_at:
            raise ValueError(f"model blew up on rank {tdist.get_rank()}")
        self.calls += 1
        return self.linear(batch).pow(2).mean()


class Record(Hook):
    def __init__(self, rank: int, stop_at: int | None) -> None:
        self.rank = rank
        self.stop_at = stop_at
        self.steps: list[tuple[int, int]] = []
        self.status = ""

    def attach(self, bus: HookBus) -> None:
        self.bus = bus

    def after_step(self, event: AfterStep) -> None:
        self.steps.append((event.epoch, event.global_step))
        if event.global_step == self.stop_at:
            self.bus.request_stop(f"rank {self.rank} asked")

    def end(self, event: End) -> None:
        self.status = event.status


async def main(out: Path, mode: str) -> None:
    tdist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = tdist.get_rank()
    n = {"uneven": 5 if rank == 0 else 8}.get(mode, 20)
    data = [torch.randn(8, 4) for _ in range(n)]
    record = Record(rank, 3 if (mode == "stop" and rank == 1) else None)
    model = Model(3 if (mode == "fail" and rank == 1) else None)
    args = TrainingArguments(
        save_steps=None,
        train_epoch=2 if mode == "uneven" else 1,
        collective_timeout=30,
    )
    trainer = Trainer(
        model,
        args,
        train_dataset=data,
        hooks=[record],
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None),
    )
    result: dict[str, Any] = {"rank": rank}
    try:
        await trainer.train()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    result["steps"] = record.steps
    result["status"] = record.status
    result["stop_reason_seen"] = record.bus.stop_reason
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    tdist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), sys.argv[2])
