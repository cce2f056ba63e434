"""What used to be silently wrong or unclear in the trace pipeline, refused or said plainly:
a column traced again in a step (its rows appended), a masked array, partition values that name other folders,
steps after ``End``, a hook reused on a second bus, a replay of a batch already present,
a close listing every spill file, ``.tmp`` files left by ``kill -9``, a step larger than
``size_threshold``, and ``max_age``'s default."""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads
import pytest
import torch

from recis_async import HookBus, HookError, add_to_trace
from recis_async.events import AfterStep, BeforeStep, TraceParts
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink
from recis_async.spill import SpillEntry, write_spill
from recis_async.trace.base import Attempt
from recis_async.trace.buffer import ColumnBuffer

ROOT = Path(__file__).resolve().parents[2]
FIELDS, TYPES = ["id", "x"], ["bigint", "double"]


def hook(tmp_path: Path, **kw: object) -> TraceHook:
    kw.setdefault("spill_dir", tmp_path / "spill")
    kw.setdefault("retry_backoff", 0.01)
    return TraceHook(ParquetSink(tmp_path / "root", "t", rank=0), FIELDS, TYPES, **kw)  # type: ignore[arg-type]


async def step(bus: HookBus, n: int, rows: int = 4) -> None:
    await bus.publish(BeforeStep(global_step=n))
    add_to_trace("id", np.arange(n * rows, (n + 1) * rows))
    add_to_trace("x", np.full(rows, float(n)))
    await bus.publish(AfterStep(global_step=n, samples=rows))


def table_ids(root: Path) -> list[int]:
    return sorted(pads.dataset(root / "t").to_table().column("id").to_pylist())


@pytest.mark.anyio
async def test_a_column_traced_again_in_a_step_holds_the_rows_of_every_call(
    tmp_path: Path,
) -> None:
    """A step over several micro-batches (gradient accumulation) traces each: the column's
    rows are those of every call, in call order, whatever each call was given (an array, a
    CPU tensor, a list); the step's other columns must match their total.  A value refused
    on the second call leaves the column as the first call made it."""
    seen: list[object] = []
    async with HookBus() as bus:
        bus.add_hook(hook(tmp_path))
        bus.subscribe(AfterStep, lambda event: seen.append(event.trace["id"]), priority=0)
        await bus.publish(BeforeStep(global_step=0))
        add_to_trace("id", np.arange(4))
        add_to_trace("x", np.zeros(4))
        add_to_trace("id", torch.arange(4, 6))
        with pytest.raises(ValueError, match=r"add_to_trace\('id'\): .*got a scalar"):
            add_to_trace("id", torch.tensor(99))
        add_to_trace("id", [6, 7])
        add_to_trace("x", torch.ones(4, dtype=torch.float64))
        await bus.publish(AfterStep(global_step=0, samples=8))
        await step(bus, 2)  # the next step starts with one call per column again
        await bus.publish(BeforeStep(global_step=3))
        add_to_trace("id", np.arange(12, 16))
        add_to_trace("id", np.arange(16, 20))
        add_to_trace("x", np.zeros(4))
        with pytest.raises(HookError, match=r"expected 8 rows \(from 'id'\) .* got id=8, x=4"):
            await bus.publish(AfterStep(global_step=3, samples=8))
    assert isinstance(seen[0], TraceParts) and len(seen[0]) == 3
    assert type(seen[1]) is np.ndarray  # traced once: the value itself
    table = pads.dataset(tmp_path / "root" / "t").to_table().to_pylist()
    rows = sorted((r["id"], r["x"]) for r in table)
    assert rows == [(i, 0.0) for i in range(4)] + [(i, 1.0) for i in range(4, 8)] + [
        (i, 2.0) for i in range(8, 12)
    ]


@pytest.mark.anyio
async def test_a_masked_array_is_refused_when_an_entry_is_masked(tmp_path: Path) -> None:
    async with HookBus() as bus:
        bus.add_hook(hook(tmp_path))
        await bus.publish(BeforeStep(global_step=0))
        masked = np.ma.masked_array(np.arange(4), mask=[0, 1, 0, 0])
        with pytest.raises(ValueError, match=r"masked array with 1 of 4 entries masked"):
            add_to_trace("id", masked)
        add_to_trace("id", np.ma.masked_array(np.arange(4), mask=False))  # nothing masked
        add_to_trace("x", np.ma.masked_array(np.arange(4.0)))
        await bus.publish(AfterStep(global_step=0, samples=4))
    assert table_ids(tmp_path / "root") == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        ({"dt": None}, "value of 'dt' must be a value, got None"),
        ("dt=None", "value of 'dt' must be a value, got 'None'"),
        ("dt=%2F..%2F", r"must be non-empty without / \\ , = % or quotes, got '%2F..%2F'"),
        ({"dt": "%2e%2e"}, "got '%2e%2e'"),
    ],
)
def test_partition_values_naming_other_folders_are_refused(
    tmp_path: Path, partition: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ParquetSink(tmp_path, "t", partition)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.anyio
async def test_a_hook_reused_on_a_second_bus_says_so_at_add_hook(tmp_path: Path) -> None:
    trace = hook(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(trace)
        await step(bus, 0)
    async with HookBus() as bus:
        with pytest.raises(RuntimeError, match="already ran on a bus that has closed"):
            bus.add_hook(trace)
    assert table_ids(tmp_path / "root") == [0, 1, 2, 3]


def test_a_replay_counts_a_batch_already_present_apart(tmp_path: Path) -> None:
    """A batch spilled in doubt whose commit had in fact happened: the replay says
    "1 already present", not "delivered 2"."""
    buffer = ColumnBuffer(FIELDS, TYPES)
    buffer.append({"id": np.arange(4), "x": np.zeros(4)}, 0)
    first = buffer.seal()
    buffer.append({"id": np.arange(4, 8), "x": np.ones(4)}, 1)
    second = buffer.seal()
    assert first is not None and second is not None
    sink = ParquetSink(tmp_path / "root", "t", rank=0)
    sink.open(first.fields, first.types)
    attempt = Attempt()
    sink.write(first, attempt)  # committed; its answer "lost": the token stays in doubt
    path = write_spill(
        tmp_path / "spill",
        [SpillEntry(first, attempt.token), SpillEntry(second, None)],
        sink_name=sink.name,
        reason="test",
    )
    done = subprocess.run(
        [sys.executable, "-m", "recis_async.spill", "replay", str(path), "--parquet"]
        + [str(tmp_path / "root")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "delivered 1 batch(es) (4 rows)" in done.stdout
    assert ", 1 already present;" in done.stdout
    assert table_ids(tmp_path / "root") == list(range(8))


@pytest.mark.anyio
async def test_close_groups_many_spill_files_by_folder_with_their_steps(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "t").write_text("not a folder")  # every batch fails: permanent
    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.add_hook(hook(tmp_path, size_threshold=64))  # a batch per step
            for n in range(12):
                await step(bus, n)
    files = sorted((tmp_path / "spill").glob("*.arrows"))
    assert len(files) == 12
    message = str(info.value)
    assert f"12 files in {tmp_path / 'spill'} (48 rows of steps 0-11)" in message
    assert not any(f.name in message for f in files)


def test_kill_9_leftover_tmp_files_are_removed_by_the_next_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = tmp_path / "t"
    table.mkdir()
    mine = table / ".part-0-0123456789abcdef.parquet.tmp"
    theirs = table / ".part-1-0123456789abcdef.parquet.tmp"  # another rank's: may be live
    mine.write_bytes(b"PAR1 half a file")
    theirs.write_bytes(b"PAR1")
    caplog.set_level(logging.WARNING)
    ParquetSink(tmp_path, "t", rank=0).open(("id",), ColumnBuffer(["id"], ["bigint"]).types)
    assert not mine.exists() and theirs.exists()
    assert "removed 1 temporary file(s) left by an interrupted run: " + mine.name in caplog.text


@pytest.mark.anyio
async def test_a_step_larger_than_size_threshold_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with HookBus() as bus:
        bus.add_hook(hook(tmp_path, size_threshold=1024))
        for n in range(3):
            await step(bus, n, rows=1000)  # 16,000 bytes a step
    assert table_ids(tmp_path / "root") == list(range(3000))
    assert caplog.text.count("more than size_threshold") == 1
    assert "step 0 traced 15.6 KiB, more than size_threshold=1.0 KiB" in caplog.text
    assert "memory is bounded by (worker_num + 2) x the largest step" in caplog.text


def test_max_age_bounds_what_a_kill_9_loses_by_default() -> None:
    assert inspect.signature(TraceHook).parameters["max_age"].default == 30.0


KILL_JOB = textwrap.dedent(
    """
    import sys, time
    import anyio, numpy as np
    from recis_async import HookBus, add_to_trace
    from recis_async.events import AfterStep, BeforeStep
    from recis_async.hooks import TraceHook
    from recis_async.sinks import ParquetSink

    async def main():
        hook = TraceHook(ParquetSink(sys.argv[1], "t", rank=0), ["id"], ["bigint"],
                         max_age=0.5, spill_dir=sys.argv[2])  # size_threshold: 50 MiB
        async with HookBus() as bus:
            bus.add_hook(hook)
            for step in range(100000):
                await bus.publish(BeforeStep(global_step=step))
                add_to_trace("id", np.arange(step * 10, step * 10 + 10))
                await bus.publish(AfterStep(global_step=step, samples=10))
                print(step, time.monotonic(), flush=True)
                await anyio.sleep(0.02)

    anyio.run(main)
    """
)


def test_kill_9_loses_only_the_last_max_age_seconds(tmp_path: Path) -> None:
    """A job far below its size threshold, killed with SIGKILL: rows older than ``max_age``
    (plus a write) were on disk; before, with no max_age, every row was lost."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_JOB, str(tmp_path / "root"), str(tmp_path / "spill")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.stdout is not None
    lines: list[tuple[int, float]] = []
    try:
        start = None
        for line in proc.stdout:
            n, at = line.split()
            lines.append((int(n), float(at)))
            start = start or time.monotonic()
            if time.monotonic() - start > 5:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = lines[-1][1]
    ids = table_ids(tmp_path / "root")
    assert sorted(set(ids)) == ids  # none twice
    old_enough = [n for n, at in lines if at < killed_at - 3.0]  # max_age 0.5 s + slack
    assert old_enough and set(range(old_enough[-1] * 10 + 10)) <= set(ids)
    print(json.dumps({"published_rows": len(lines) * 10, "on_disk": len(ids)}))
