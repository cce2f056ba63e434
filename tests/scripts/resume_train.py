"""A Trainer job as a user writes it, for the restart tests: stopped, rerun, resumed.

    python resume_train.py OUT_DIR [--backend trio] [--resume] [--overwrite] [--ready STEP]

Two epochs over ``DataLoader(shuffle=True)`` of 256 ids in batches of 4 (64 steps an epoch;
the order comes from torch's global generator, seeded 0 at the start as scripts do), a linear
model trained with SGD and momentum, a checkpoint every 16 steps into ``OUT_DIR/ckpt`` (the
newest 3 kept), a log line every 10 steps, and every sample traced to the Parquet table
``OUT_DIR/trace/t`` as ``(step, epoch, id, loss)``.  Prints ``ready`` once ``--ready`` steps
are done (each step takes about 10 ms) and ``done <global_step>`` when ``train`` returns.
``--trace-bytes`` is the trace buffer's ``size_threshold`` (a step's rows take 128 bytes).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from torch.utils.data import DataLoader

from recis_async import Hook, Trainer, TrainingArguments, add_to_trace
from recis_async.events import AfterStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink

IDS = 256
BATCH = 4


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.epoch = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)  # the rest of a real step
        f = ids.to(torch.float32)
        x = torch.stack([torch.sin(f), torch.cos(f), f / IDS], dim=1)
        loss = torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), torch.sin(3 * f))
        add_to_trace("id", ids)
        add_to_trace("loss", loss.detach().expand(len(ids)))
        return loss


class Where(Hook):
    """Traces each step's number and epoch; prints ``ready`` after ``ready`` steps."""

    def __init__(self, ready: int) -> None:
        self.ready = ready

    def before_step(self, event: Any) -> None:
        if event.is_train:
            add_to_trace("step", torch.full((BATCH,), event.global_step))
            add_to_trace("epoch", torch.full((BATCH,), event.epoch))

    def after_step(self, event: AfterStep) -> None:
        if event.global_step + 1 == self.ready:
            print("ready", flush=True)


async def main(out: Path, resume: bool, overwrite: bool, ready: int, trace_bytes: int) -> None:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(torch.arange(IDS), batch_size=BATCH, shuffle=True)
    args = TrainingArguments(
        output_dir=str(out / "ckpt"),
        save_steps=16,
        max_to_keep=3,
        log_steps=10,
        train_epoch=2,
        **({"overwrite_output_dir": True} if overwrite else {}),
    )
    trace = TraceHook(
        ParquetSink(out / "trace", "t", rank=0),
        ["step", "epoch", "id", "loss"],
        ["bigint", "bigint", "bigint", "double"],
        spill_dir=out / "spill",
        size_threshold=trace_bytes,
    )
    trainer = Trainer(
        model,
        args,
        train_dataset=loader,
        hooks=[trace, Where(ready)],
        dense_optimizers=(opt, None),
    )
    await trainer.train(resume_from_checkpoint=resume)
    print(f"done {trainer.global_step}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", default="asyncio")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--ready", type=int, default=70)
    parser.add_argument("--trace-bytes", type=int, default=50 << 20)
    ns = parser.parse_args()
    anyio.run(main, ns.out, ns.resume, ns.overwrite, ns.ready, ns.trace_bytes, backend=ns.backend)
