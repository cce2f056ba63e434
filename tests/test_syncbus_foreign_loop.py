"""Built-in hooks whose ``attach`` builds a background service (and with it anyio events,
locks, limiters), added with ``bus.add_hook`` *before* entering a SyncHookBus whose event loop
is of the other library than the caller's running one: an asyncio caller (a notebook cell)
around ``SyncHookBus(backend="trio")``, and a trio caller around an asyncio one.  Each hook
runs a few steps and its effect is read back from what it wrote or changed.

(They failed with ``'NoneType' object has no attribute 'create_future'`` -- asyncio
primitives awaited on trio -- or with trio crashing inside asyncio: ``attach`` ran in the
caller's context, so its primitives belonged to the caller's loop.)"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest
import torch

from recis_async import SyncHookBus, add_metric, add_to_trace
from recis_async.checkpoint.files import latest_checkpoint
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import (
    CheckpointSaverHook,
    HashTableFilterHook,
    HistorySaverHook,
    LoggerHook,
    MLTrackerHook,
    SummarySaverHook,
    TraceHook,
)
from recis_async.nn import FilterHook, HashTable
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker, read_records

pytestmark = pytest.mark.anyio

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def foreign_bus(anyio_backend: str) -> SyncHookBus:
    """A SyncHookBus on the library the caller's running loop is not."""
    other = "trio" if anyio_backend == "asyncio" else "asyncio"
    return SyncHookBus(flush_timeout=30, handle_signals=False, backend=other)


async def test_hash_table_filter_hook(anyio_backend: str) -> None:
    table = HashTable(
        2, name="user", filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 2})
    )
    hook = HashTableFilterHook(3, tables=[table])
    bus = foreign_bus(anyio_backend)
    bus.add_hook(hook)  # before entering: attach builds the eviction service here

    async def settle(event: AfterStep) -> None:  # each eviction applied before the next step
        await hook.wait_idle()

    bus.subscribe(AfterStep, settle)
    with bus:
        for step in range(12):
            bus.publish(BeforeStep(global_step=step))
            table(torch.tensor([step, 100]))  # 100 is used every step
            bus.publish(AfterStep(global_step=step))
        stats = bus.stats()["services"]["HashTableFilterHook"]
    # anchored at step 0, evictions at 3, 6, 9: an id used at step s goes iff step - s > 2
    assert stats["evictions"] == 3 and stats["evicted"] == 1 + 3 + 3
    assert table.ids().tolist() == [7, 8, 9, 10, 11, 100]


async def test_tracker_hooks(tmp_path: Path, anyio_backend: str) -> None:
    """MLTrackerHook and SummarySaverHook: a TrackerService each (and a read queue)."""
    tracker = JsonlTracker(tmp_path / "runs")
    bus = foreign_bus(anyio_backend)
    bus.add_hook(MLTrackerHook("p", "foreign", tracker=tracker, max_buffer_bytes=256))
    bus.add_hook(SummarySaverHook(2, tmp_path / "summary"))
    with bus:
        for step in range(6):
            bus.publish(BeforeStep(global_step=step))
            add_metric("loss", torch.tensor(float(step)))
            bus.publish(AfterStep(global_step=step, tracked={"acc": step / 10}))
    assert tracker.run_dir is not None
    records = read_records(tracker.run_dir / "metrics.jsonl")
    assert [(r.step, r.values) for r in records] == [(s, {"acc": s / 10}) for s in range(6)]
    acc = event_accumulator.EventAccumulator(str(tmp_path / "summary"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (3, 3.0), (5, 5.0)]


async def test_logger_and_history_hooks(
    tmp_path: Path, anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """LoggerHook (a read queue for device values) and HistorySaverHook (a CSV writer)."""
    caplog.set_level(logging.INFO, logger="recis_async.hooks.logger")
    history = HistorySaverHook(2, tmp_path)
    bus = foreign_bus(anyio_backend)
    bus.add_hook(LoggerHook(log_step=2))
    bus.add_hook(history)
    with bus:
        for step in range(6):
            bus.publish(BeforeStep(global_step=step))
            add_metric("loss", torch.tensor(float(step)))
            bus.publish(AfterStep(global_step=step, samples=4))
    lines = [r.getMessage() for r in caplog.records if "gstep=" in r.getMessage()]
    assert [line.split("gstep=")[1].split()[0].strip("<>,") for line in lines] == ["1", "3", "5"]
    assert all("loss=" in line for line in lines)
    with open(tmp_path / "history.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(float(r["mean_losses"]), int(r["steps"])) for r in rows] == [
        (0.5, 2),
        (2.5, 4),
        (4.5, 6),
    ]


async def test_checkpoint_saver_hook(tmp_path: Path, anyio_backend: str) -> None:
    model = torch.nn.Linear(3, 2)
    bus = foreign_bus(anyio_backend)
    bus.add_hook(CheckpointSaverHook(tmp_path, save_steps=2, save_end=False, model=model))
    with bus:
        for step in range(4):
            bus.publish(BeforeStep(global_step=step))
            bus.publish(AfterStep(global_step=step, samples=1))
    newest = latest_checkpoint(tmp_path)
    assert newest is not None and newest[0] == 4


async def test_trace_hook_made_in_the_callers_loop(tmp_path: Path, anyio_backend: str) -> None:
    """TraceHook builds its writer in its constructor, in the caller's loop (bound lazily
    since the writer's own fix); added before entering too."""
    hook = TraceHook(
        ParquetSink(tmp_path / "root", "t", rank=0),
        ["id"],
        ["bigint"],
        size_threshold=8 * 8,
        spill_dir=tmp_path / "spill",
    )
    bus = foreign_bus(anyio_backend)
    bus.add_hook(hook)
    with bus:
        for step in range(4):
            bus.publish(BeforeStep(global_step=step))
            add_to_trace("id", np.arange(step * 8, step * 8 + 8))
            bus.publish(AfterStep(global_step=step, samples=8))
    ids = pads.dataset(tmp_path / "root" / "t").to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(32))
