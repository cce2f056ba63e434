"""One rank of a torchrun job evaluating with the Trainer, for tests/test_distributed.py.

    torchrun --nproc_per_node=2 dist_eval.py OUT_DIR

Rank r evaluates 2 + r batches of 2 + 2r rows (rank 0: 2 x 2 rows; rank 1: 3 x 4 rows); each
step adds its rank- and row-dependent metrics with every reduction.  Every rank writes
``OUT_DIR/rank<r>.json`` with what ``evaluate()`` returned, the ``AfterEval.metrics`` it saw
and the LoggerHook lines it logged.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
import torch.distributed as tdist

from recis_async import HookBus, Trainer, TrainingArguments, add_metric
from recis_async.events import AfterEval
from recis_async.hooks import LoggerHook


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, batch: torch.Tensor) -> dict[str, Any]:
        rank = tdist.get_rank()
        rows = len(batch)
        add_metric("value", float(batch.sum()) / rows)  # default: weighted by rows
        add_metric("rows", rows, reduce="sum")
        add_metric("biggest", float(batch.max()), reduce="max")
        add_metric("smallest", float(batch.min()), reduce="min")
        add_metric("rank_last", rank, reduce="last")
        add_metric("spread", float(batch.max()), reduce=np.ptp)
        return {"loss": self.linear(batch).pow(2).mean() * 0 + rank, "ones": torch.tensor(1.0)}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def main(out: Path) -> None:
    rank = tdist.get_rank()
    # rank 0: values 0..3 in 2 batches of 2; rank 1: values 100..111 in 3 batches of 4
    rows = 2 + 2 * rank
    data = [
        torch.arange(rows, dtype=torch.float32).unsqueeze(-1) + 100 * rank + rows * b
        for b in range(2 + rank)
    ]
    lines = Lines()
    logging.getLogger("recis_async.hooks.logger").addHandler(lines)
    logging.getLogger("recis_async.hooks.logger").setLevel(logging.INFO)
    seen: list[dict[str, Any]] = []
    trainer = Trainer(
        Model(),
        TrainingArguments(save_steps=None, log_steps=100, collective_timeout=60),
        eval_dataset=data,
        hooks=[LoggerHook(log_step=100, all_reduce=True)],
    )
    async with HookBus() as bus:
        bus.subscribe(AfterEval, lambda e: seen.append(dict(e.metrics)))
        trainer.bus = bus
        returned = await trainer.evaluate()
    (out / f"rank{rank}.json").write_text(
        json.dumps({"returned": returned, "seen": seen, "lines": lines.lines})
    )


if __name__ == "__main__":
    tdist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        anyio.run(main, Path(sys.argv[1]))
    finally:
        tdist.destroy_process_group()
