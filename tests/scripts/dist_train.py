"""One rank of a torchrun job driving the Trainer, for tests/test_distributed.py.

    torchrun --nproc_per_node=2 dist_train.py OUT_DIR MODE

MODE: ``stop`` (rank 1 requests a stop after step 3), ``fail`` (rank 1's model raises at
step 3), ``uneven`` (rank 0 has 5 batches, rank 1 has 8; two epochs), ``nan`` (rank 1's loss
is NaN at step 3; ``NanTensorHook(fail_on_nan_loss=False)`` on every rank), ``trace`` (every
rank traces 8 rows a step to Parquet under OUT_DIR and to the ODPS service named by the
``TEST_ODPS_*`` environment, ``StopAtStepHook(last_step=12)``, ``LoggerHook``,
``CheckpointSaverHook`` every 4 steps into OUT_DIR/ckpt), ``overlap`` (in its step 3 rank 1
waits, 30 s at most, for a file rank 0 writes in its step 4: rank 0 gets there only if the
step boundary does not wait for rank 1; then rank 1 requests a stop after step 5),
``uneven_stop`` (as ``uneven``, and rank 1 requests a stop in step 4, the last step rank 0
has data for).  Each rank writes
``OUT_DIR/rank<r>.json``: the AfterStep steps it saw, how the run ended, and any error text.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as tdist

from recis_async import Hook, HookBus, Trainer, TrainingArguments, add_metric, add_to_trace
from recis_async.events import AfterStep, End
from recis_async.hooks import (
    CheckpointSaverHook,
    LoggerHook,
    NanTensorHook,
    StopAtStepHook,
    TraceHook,
    TraceToOdpsHook,
    latest_checkpoint_step,
    restore_checkpoint,
)
from recis_async.sinks import ParquetSink

FIELDS = ["rank", "step", "row"]
TYPES = ["bigint", "bigint", "bigint"]


class Model(torch.nn.Module):
    def __init__(
        self, fail_at: int | None, nan_at: int | None, trace: bool, overlap: Path | None = None
    ) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.fail_at = fail_at
        self.nan_at = nan_at
        self.trace = trace
        self.overlap = overlap  # OUT_DIR in mode "overlap"
        self.overlapped: bool | None = None
        self.calls = 0

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        step = self.calls
        if self.overlap is not None:
            marker = self.overlap / "rank0-in-step-4"
            if tdist.get_rank() == 0 and step == 4:
                marker.write_text("")
            if tdist.get_rank() == 1 and step == 3:  # rank 0 must get past boundary 3 alone
                deadline = time.monotonic() + 30
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.overlapped = marker.exists()
        if step == self.fail_at:
            raise ValueError(f"model blew up on rank {tdist.get_rank()}")
        self.calls += 1
        if self.trace:
            add_metric("rank_metric", float(tdist.get_rank()))  # all-reduced by LoggerHook
            rows = batch.shape[0]
            add_to_trace("rank", torch.full((rows,), tdist.get_rank()))
            add_to_trace("step", torch.full((rows,), step))
            add_to_trace("row", torch.arange(rows))
        loss = self.linear(batch).pow(2).mean()
        return loss * float("nan") if step == self.nan_at else loss


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
    # torch.optim's first optimizer imports torch._dynamo, which, when imported after the
    # process group is up, keeps references to it that destroy_process_group() cannot drop:
    # the gloo group and its threads then live until interpreter teardown, where destroying
    # them now and then aborted rank 1 ("terminate called without an active exception").
    # Imported first, destroy_process_group() below frees the group and joins its threads.
    import torch._dynamo  # noqa: F401

    tdist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = tdist.get_rank()
    uneven = mode in ("uneven", "uneven_stop")
    n = 5 if uneven and rank == 0 else 8 if uneven else 20
    data = [torch.randn(8, 4) for _ in range(n)]
    stop_at = {"stop": 3, "overlap": 5, "uneven_stop": 4}.get(mode)
    record = Record(rank, stop_at if rank == 1 else None)
    on_rank1 = 3 if rank == 1 else None
    model = Model(
        on_rank1 if mode == "fail" else None,
        on_rank1 if mode == "nan" else None,
        mode == "trace",
        out if mode == "overlap" else None,
    )
    hooks: list[Hook] = [record]
    if mode == "nan":
        hooks.append(NanTensorHook(fail_on_nan_loss=False))
    if mode == "trace":
        odps = {
            "access_id": os.environ["TEST_ODPS_ACCESS_ID"],
            "access_key": os.environ["TEST_ODPS_ACCESS_KEY"],
            "project": os.environ["TEST_ODPS_PROJECT"],
            "end_point": os.environ["TEST_ODPS_ENDPOINT"],
            "tunnel_endpoint": os.environ["TEST_ODPS_TUNNEL_ENDPOINT"],
            "table_name": "dist_trace",
            "partition": "dt=20261122",
        }
        hooks += [
            TraceHook(
                ParquetSink(out / "parquet", "dist_trace", "dt=20261122"),
                FIELDS,
                TYPES,
                size_threshold=512,
                spill_dir=out / "spill",
            ),
            TraceToOdpsHook(odps, FIELDS, TYPES, size_threshold=512, spill_dir=out / "spill"),
            StopAtStepHook(last_step=12),
            LoggerHook(log_step=4, all_reduce=True, timeout=30),
            CheckpointSaverHook(out / "ckpt", save_steps=4, model=model, barrier_timeout=30),
        ]
    args = TrainingArguments(
        save_steps=None,
        train_epoch=2 if uneven else 1,
        collective_timeout=30,
    )
    trainer = Trainer(
        model,
        args,
        train_dataset=data,
        hooks=hooks,
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None),
    )
    result: dict[str, Any] = {"rank": rank}
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("recis_async.hooks.logger").addHandler(handler)
    logging.getLogger("recis_async.hooks.logger").setLevel(logging.INFO)
    try:
        await trainer.train()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    result["steps"] = record.steps
    result["status"] = record.status
    result["stop_reason_seen"] = record.bus.stop_reason
    result["log_lines"] = lines
    result["overlapped"] = model.overlapped
    if mode == "trace":
        result["checkpoint_step_seen"] = latest_checkpoint_step(out / "ckpt")
        # every rank restores rank 0's checkpoint into a fresh model
        fresh = Model(None, None, False)
        async with HookBus(handle_signals=False) as restore_bus:
            result["restored_step"] = await restore_checkpoint(restore_bus, out / "ckpt", fresh)
        result["restored_weights"] = [round(float(v), 6) for v in fresh.linear.weight.flatten()]
        result["trained_weights"] = [round(float(v), 6) for v in model.linear.weight.flatten()]
    tdist.destroy_process_group()
    result["threads_after_destroy"] = sorted(
        Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")
    )
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), sys.argv[2])
