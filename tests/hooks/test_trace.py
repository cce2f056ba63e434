from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pyarrow.dataset as pads
import pytest
import torch
from odps_server import TEST_SECRET, OdpsServer, read_with_pyodps, sink_config
from trace_data import ALL_FIELDS, ALL_TYPES, all_types_step, expected_row

from recis_async import HookBus, HookError, add_to_trace
from recis_async.events import AfterLoadCheckpoint, AfterStep, BeforeStep, Start
from recis_async.hooks import TraceHook, TraceToOdpsHook
from recis_async.sinks import OdpsSink, ParquetSink
from recis_async.spill import read_spill, replay_spill
from recis_async.trace.service import _OPEN_WAIT_S

pytestmark = pytest.mark.usefixtures("either_bus")

FIELDS = ["id", "emb"]
TYPES = ["bigint", "array<float>"]
ROWS = 32  # per step; one step holds 32 * 8 + 32 * 8 * 4 = 1280 bytes (raw arrays, no offsets)


@pytest.fixture
def server() -> Iterator[OdpsServer]:
    with OdpsServer("trace_proj") as srv:
        yield srv


async def run_steps(bus: HookBus, steps: range, *, rows: int = ROWS) -> None:
    for step in steps:
        await bus.publish(BeforeStep(global_step=step))
        add_to_trace("id", np.arange(step * rows, (step + 1) * rows))
        add_to_trace("emb", np.full((rows, 8), step, np.float32))
        await bus.publish(AfterStep(global_step=step, samples=rows))


def parquet_ids(root: Path, table: str = "t") -> list[int]:
    if not any((root / table).rglob("*.parquet")):  # the sink makes its folder at start
        return []
    return sorted(pads.dataset(root / table).to_table().column("id").to_pylist())


def odps_ids(
    server: OdpsServer, table: str = "t", partition: str | None = "dt=20261122"
) -> list[int]:
    return sorted(row["id"] for row in read_with_pyodps(server, table, partition))


def parquet_hook(root: Path, **kw: Any) -> TraceHook:
    kw.setdefault("size_threshold", 4096)
    kw.setdefault("retry_backoff", 0.01)
    kw.setdefault("spill_dir", root / "spill")
    return TraceHook(ParquetSink(root, "t", rank=0), FIELDS, TYPES, **kw)


def odps_hook(server: OdpsServer, root: Path, **kw: Any) -> TraceToOdpsHook:
    kw.setdefault("size_threshold", 4096)
    kw.setdefault("retry_backoff", 0.01)
    kw.setdefault("spill_dir", root / "spill")
    return TraceToOdpsHook(sink_config(server, "t", "dt=20261122"), FIELDS, TYPES, **kw)


# ----------------------------------------------------------------------------- delivery


@pytest.mark.anyio
async def test_clean_end_writes_every_row_once_in_size_bounded_files(tmp_path: Path) -> None:
    hook = parquet_hook(tmp_path, worker_num=2)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await run_steps(bus, range(40))
    assert parquet_ids(tmp_path) == list(range(40 * ROWS))
    files = list((tmp_path / "t").glob("part-0-*.parquet"))
    assert len(files) == 10  # 4 steps (5120 bytes) per sealed batch
    stats = hook.writer.stats()
    assert stats["batches"] == 10 and stats["rows"] == 40 * ROWS and stats["spilled"] == 0
    assert stats["queued_batches"] == 0 and stats["buffered_rows"] == 0


@pytest.mark.anyio
async def test_every_type_goes_through_the_hook_to_parquet_and_odps(
    tmp_path: Path, server: OdpsServer
) -> None:
    parquet = TraceHook(
        ParquetSink(tmp_path, "all", rank=0), ALL_FIELDS, ALL_TYPES, size_threshold=2000
    )
    odps = TraceToOdpsHook(
        sink_config(server, "all", "dt=1"), ALL_FIELDS, ALL_TYPES, size_threshold=2000
    )
    async with HookBus() as bus:
        bus.add_hook(parquet)
        bus.add_hook(odps)
        for step in range(5):
            await bus.publish(BeforeStep(global_step=step))
            for name, value in all_types_step(4, start=step * 4).items():
                add_to_trace(
                    name, value if not isinstance(value, list) else np.array(value, dtype=object)
                )
            await bus.publish(AfterStep(global_step=step))
    expected = [expected_row(i) for i in range(20)]
    table = pads.dataset(tmp_path / "all").to_table()
    assert sorted(table.to_pylist(), key=lambda r: r["c_int"]) == sorted(
        expected, key=lambda r: r["c_int"]
    )
    assert sorted(read_with_pyodps(server, "all", "dt=1"), key=lambda r: r["c_int"]) == sorted(
        expected, key=lambda r: r["c_int"]
    )


@pytest.mark.anyio
async def test_body_raising_keeps_every_row(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        async with HookBus() as bus:
            bus.add_hook(parquet_hook(tmp_path))
            await run_steps(bus, range(7))
            raise RuntimeError("boom")
    assert parquet_ids(tmp_path) == list(range(7 * ROWS))


@pytest.mark.anyio
async def test_cancellation_keeps_every_row(tmp_path: Path) -> None:
    published = 0
    with anyio.CancelScope() as scope:
        async with HookBus() as bus:
            bus.add_hook(parquet_hook(tmp_path, worker_num=2))
            for step in range(1000):
                await run_steps(bus, range(step, step + 1))
                published += 1
                if step == 9:
                    scope.cancel()
                await anyio.sleep(0)  # the cancellation lands here
    assert scope.cancelled_caught
    assert published == 10
    assert parquet_ids(tmp_path) == list(range(10 * ROWS))


@pytest.mark.anyio
async def test_steps_without_trace_write_nothing(tmp_path: Path) -> None:
    hook = parquet_hook(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(hook)
        for step in range(3):
            await bus.publish(BeforeStep(global_step=step))
            await bus.publish(AfterStep(global_step=step))
    assert not (tmp_path / "t").exists() or not list((tmp_path / "t").iterdir())
    assert hook.writer.stats()["batches"] == 0


class SlowProbeSink(ParquetSink):
    """A real Parquet sink whose ``open`` stops between touching its writability probe
    (``.probe-<rank>-<hex>.tmp``) and removing it until ``gate`` is set: an open that is
    merely slow (a loaded machine, a slow disk), or hung while the gate stays shut."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, "t", rank=0)
        self.touched = threading.Event()  # the probe is on disk, the open waits at the gate
        self.gate = threading.Event()
        self.calls: list[str] = []
        sink = self

        class GatedPath(type(Path())):  # type: ignore[misc]  # PosixPath or WindowsPath
            def unlink(self, missing_ok: bool = False) -> None:
                if self.name.startswith(".probe-"):
                    sink.touched.set()
                    assert sink.gate.wait(30), "the test never opened the gate"
                super().unlink(missing_ok)

        self._gated = GatedPath

    @property
    def directory(self) -> Path:
        return self._gated(super().directory)

    def open(self, fields: tuple[str, ...], types: tuple[Any, ...]) -> None:
        self.calls.append("open started")
        super().open(fields, types)
        self.calls.append("opened")

    def close(self) -> None:
        self.calls.append("closed")
        super().close()

    def leftovers(self) -> list[str]:
        """Files in the sink's folder: the probe or a temporary file left behind."""
        folder = self._root / "t"
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


async def steps_until_the_open_waits(bus: HookBus, sink: SlowProbeSink) -> None:
    """Publish empty steps until the sink's open (begun at bus start) has touched its probe
    and waits at the gate (on a SyncHookBus the bus's loop runs only inside a publish)."""
    with anyio.fail_after(10):
        step = 0
        while not sink.touched.is_set():
            await bus.publish(BeforeStep(global_step=step))
            await bus.publish(AfterStep(global_step=step))
            step += 1
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_the_close_waits_for_a_slow_open_so_no_probe_file_is_left(tmp_path: Path) -> None:
    """The bus closes while the sink's open, begun at bus start, is merely slow: the close
    waits for it (within its deadline), so once the ``async with`` returns the open has
    ended, its probe file is gone and the sink that opened was closed -- by the close, not by
    a thread that a process exiting right after the close would kill mid-open."""
    sink = SlowProbeSink(tmp_path)
    hook = TraceHook(sink, FIELDS, TYPES, size_threshold=4096, spill_dir=tmp_path / "spill")
    try:
        async with HookBus(flush_timeout=30, handle_signals=False) as bus:
            bus.add_hook(hook)
            await steps_until_the_open_waits(bus, sink)
            (probe,) = sink.leftovers()  # on disk while the open waits at the gate
            assert probe.startswith(".probe-0-") and probe.endswith(".tmp")
            # the open ends 0.5 s into the close: slow, not hung
            threading.Timer(0.5, sink.gate.set).start()
        assert sink.calls == ["open started", "opened", "closed"]
        assert sink.leftovers() == []
        assert hook.writer.stats()["batches"] == 0
    finally:
        sink.gate.set()  # without the fix: let the abandoned open end before the next test
        with anyio.fail_after(10):
            while "closed" not in sink.calls:
                await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_a_hung_open_is_abandoned_at_the_close_deadline_naming_the_sink(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An open that does not end (an ODPS open on a dead server) costs the close no more than
    its deadline; it is abandoned with a warning naming the sink, and closes the sink itself
    if it ends later."""
    sink = SlowProbeSink(tmp_path)
    hook = TraceHook(sink, FIELDS, TYPES, size_threshold=4096, spill_dir=tmp_path / "spill")
    caplog.set_level(logging.WARNING, "recis_async.trace.service")
    try:
        async with HookBus(flush_timeout=0.5, handle_signals=False) as bus:
            bus.add_hook(hook)
            await steps_until_the_open_waits(bus, sink)
            t0 = time.monotonic()
        took = time.monotonic() - t0
        bound = max(0.5, _OPEN_WAIT_S)  # the deadline, and at least _OPEN_WAIT_S
        assert took < bound + 1.5, f"the close took {took:.1f} s (bound {bound} s)"
        assert sink.calls == ["open started"]
        (line,) = [m for m in caplog.messages if "open was still running at the close" in m]
        assert sink.name in line and "abandoned" in line
    finally:
        sink.gate.set()
    with anyio.fail_after(10):
        while "closed" not in sink.calls:
            await anyio.sleep(0.01)
    await anyio.sleep(0.05)
    assert sink.calls == ["open started", "opened", "closed"]  # closed once, by its thread
    assert sink.leftovers() == []


@pytest.mark.async_bus_only  # awaits the max_age timer's seal between publishes
@pytest.mark.anyio
async def test_max_age_seals_a_small_buffer_while_training_idles(tmp_path: Path) -> None:
    async with HookBus() as bus:
        bus.add_hook(parquet_hook(tmp_path, size_threshold=10**9, max_age=0.2))
        await run_steps(bus, range(2))
        with anyio.fail_after(5):
            while not parquet_ids(tmp_path):
                await anyio.sleep(0.05)
        assert parquet_ids(tmp_path) == list(range(2 * ROWS))
        await run_steps(bus, range(2, 3))
    assert parquet_ids(tmp_path) == list(range(3 * ROWS))


# ----------------------------------------------------------------------------- validation


@pytest.mark.anyio
async def test_a_bad_step_fails_its_publish_and_buffers_nothing(tmp_path: Path) -> None:
    hook = parquet_hook(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await run_steps(bus, range(2))
        await bus.publish(BeforeStep(global_step=2))
        add_to_trace("id", np.arange(5))
        add_to_trace("emb", np.ones((4, 8), np.float32))
        with pytest.raises(HookError) as info:
            await bus.publish(AfterStep(global_step=2))
        assert "TraceHook.after_step failed on AfterStep" in str(info.value)
        assert "expected 5 rows (from 'id') in every field, got id=5, emb=4" in str(info.value)
        assert isinstance(info.value.__cause__, ValueError)
        await bus.publish(BeforeStep(global_step=3))
        add_to_trace("id", np.arange(4))
        add_to_trace("emb", np.ones(4))
        with pytest.raises(HookError, match=r"field 'emb' \(array<float>\): expected a 2-D"):
            await bus.publish(AfterStep(global_step=3))
        await bus.publish(BeforeStep(global_step=4))
        add_to_trace("id", np.arange(4))
        with pytest.raises(HookError, match="missing 'emb'"):
            await bus.publish(AfterStep(global_step=4))
        await run_steps(bus, range(5, 6))
    assert parquet_ids(tmp_path) == list(range(2 * ROWS)) + list(range(5 * ROWS, 6 * ROWS))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"fields": ["a", "b"], "types": ["bigint"]},
            ValueError,
            "TraceHook(fields=..., types=...): fields and types must have the same length: got 2",
        ),
        (
            {"types": ["bigint", "array<bool>"]},
            ValueError,
            "field 'emb': unknown ODPS type 'array<bool>'",
        ),
        (
            {"worker_num": 0},
            ValueError,
            "TraceHook(worker_num=...): expected a positive int, got 0",
        ),
        (
            {"worker_num": 1.5},
            TypeError,
            "TraceHook(worker_num=...): expected a positive int, got 1.5",
        ),
        (
            {"size_threshold": 0},
            ValueError,
            "TraceHook(size_threshold=...): expected a positive int, got 0",
        ),
        (
            {"max_age": -1},
            ValueError,
            "TraceHook(max_age=...): expected a positive number, got -1",
        ),
        (
            {"sink": object()},
            TypeError,
            "TraceHook(sink=...): expected a Sink (name, open, write, close), got object",
        ),
        (
            {"spill_dir": 3},
            ValueError,
            "TraceHook(spill_dir=...): expected a directory path, got 3",
        ),
    ],
)
def test_constructor_arguments_are_checked(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    args: dict[str, Any] = {"sink": ParquetSink(tmp_path, "t"), "fields": FIELDS, "types": TYPES}
    args.update(kwargs)
    with pytest.raises(error) as info:
        TraceHook(**args)
    assert message in str(info.value)


def test_a_spill_dir_that_cannot_be_written_is_refused_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(
        ValueError,
        match=r"TraceHook\(spill_dir=...\): expected a writable directory, got .*file/spill.* "
        r"\(NotADirectoryError",
    ):
        TraceHook(ParquetSink(tmp_path, "t"), FIELDS, TYPES, spill_dir=blocker / "spill")


def test_trace_to_odps_hook_is_trace_hook_on_an_odps_sink(server: OdpsServer) -> None:
    hook = TraceToOdpsHook(sink_config(server, "t", "dt=1"), FIELDS, TYPES, worker_num=2)
    assert isinstance(hook, TraceHook) and isinstance(hook.sink, OdpsSink)
    assert hook.writer.worker_num == 2 and hook.types == tuple(TYPES)
    with pytest.raises(ValueError, match="config: missing required key"):
        TraceToOdpsHook({"project": "p"}, FIELDS, TYPES)
    assert TEST_SECRET not in repr(hook)


# ----------------------------------------------------------------------------- ODPS faults


@pytest.mark.anyio
async def test_transient_odps_faults_are_retried_and_deliver_exactly_once(
    server: OdpsServer, tmp_path: Path
) -> None:
    server.inject("put_block", "503", times=3)
    server.inject("put_block", "reset", times=2, after=4)
    server.inject("commit", "lost", times=2, after=1)
    hook = odps_hook(server, tmp_path, worker_num=2)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await run_steps(bus, range(30))
    assert odps_ids(server) == list(range(30 * ROWS))
    stats = hook.writer.stats()
    assert stats["retries"] == 5 and stats["spilled"] == 0
    assert sum("fault lost response commit" in line for line in server.log_lines) == 2


@pytest.mark.async_bus_only  # awaits the sink's open between publishes
@pytest.mark.anyio
async def test_the_sink_opens_when_the_bus_starts(server: OdpsServer, tmp_path: Path) -> None:
    hook = odps_hook(server, tmp_path)
    async with HookBus() as bus:
        bus.add_hook(hook)
        with anyio.fail_after(10):
            while not hook.writer.stats()["sink_open"]:
                await anyio.sleep(0.01)
        # before any step: the table and its partition exist, nothing was uploaded
        assert "dt=20261122" in server.state.partitions["t"]
        assert server.counts("put_block") == 0
        await run_steps(bus, range(4))
    assert odps_ids(server) == list(range(4 * ROWS))


@pytest.mark.anyio
async def test_start_returns_once_the_sink_is_open(server: OdpsServer, tmp_path: Path) -> None:
    """What the sink needs to start (imports, client, table and partition checks) happens
    before the first step, not beside the first steps: ``Start`` waits for the open."""
    server.inject("any", "slow:0.3")  # the first request of the open takes a while
    hook = odps_hook(server, tmp_path)
    async with HookBus() as bus:
        bus.add_hook(hook)
        with anyio.fail_after(30):
            await bus.publish(Start(is_train=True))
        assert hook.writer.stats()["sink_open"]
        assert "dt=20261122" in server.state.partitions["t"]
        await run_steps(bus, range(4))
    assert odps_ids(server) == list(range(4 * ROWS))


@pytest.mark.anyio
async def test_start_after_a_failed_open_returns_and_the_first_batch_retries(
    server: OdpsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server.inject("table_meta", "4xx", times=1)
    hook = odps_hook(server, tmp_path)
    with caplog.at_level(logging.WARNING, logger="recis_async.trace.service"):
        async with HookBus() as bus:
            bus.add_hook(hook)
            with anyio.fail_after(30):
                await bus.publish(Start(is_train=True))
            assert "cannot open the sink yet" in caplog.text
            assert not hook.writer.stats()["sink_open"]
            await run_steps(bus, range(4))
    assert odps_ids(server) == list(range(4 * ROWS))


@pytest.mark.async_bus_only  # awaits the sink's open between publishes
@pytest.mark.anyio
async def test_a_sealed_batch_is_being_written_when_its_step_ends(tmp_path: Path) -> None:
    """The hand-over itself takes a sealed batch as far as the writer's thread: the bus
    yields at most every 100 ms, and here it has just done so (a long step's BeforeStep),
    so the AfterStep publish that seals the batch does not; nothing else runs the loop."""
    hook = parquet_hook(tmp_path, size_threshold=1)  # every step seals a batch
    async with HookBus() as bus:
        bus.add_hook(hook)
        with anyio.fail_after(10):
            while not hook.writer.stats()["sink_open"]:
                await anyio.sleep(0.01)
        time.sleep(0.15)
        await bus.publish(BeforeStep(global_step=0))  # the bus's yield
        add_to_trace("id", np.arange(ROWS))
        add_to_trace("emb", np.zeros((ROWS, 8), np.float32))
        await bus.publish(AfterStep(global_step=0, samples=ROWS))  # no bus yield
        for _ in range(500):  # blocking: the loop gets no pass while we wait
            if list((tmp_path / "t").glob("part-0-*.parquet")):
                break
            time.sleep(0.01)
        assert parquet_ids(tmp_path) == list(range(ROWS)), "the write had not started"


@pytest.mark.async_bus_only  # awaits the open's failure between publishes
@pytest.mark.anyio
async def test_an_early_open_that_fails_is_logged_and_retried_by_the_first_batch(
    server: OdpsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server.inject("table_meta", "4xx", times=1)
    hook = odps_hook(server, tmp_path)
    with caplog.at_level(logging.WARNING, logger="recis_async.trace.service"):
        async with HookBus() as bus:
            bus.add_hook(hook)
            with anyio.fail_after(10):
                while "cannot open the sink yet" not in caplog.text:
                    await anyio.sleep(0.01)
            assert not hook.writer.stats()["sink_open"]
            await run_steps(bus, range(4))
    assert odps_ids(server) == list(range(4 * ROWS))
    assert hook.writer.stats()["spilled"] == 0


@pytest.mark.anyio
async def test_a_permanent_error_spills_raises_at_close_and_replays_exactly_once(
    server: OdpsServer, tmp_path: Path
) -> None:
    server.inject("put_block", "4xx", after=2)  # the third batch is refused
    hook = odps_hook(server, tmp_path)
    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.add_hook(hook)
            await run_steps(bus, range(20))
    message = str(info.value)
    assert (
        "1 batch(es) (128 rows) were not delivered (permanent error: 1; 4 delivered) and were spilled to"
        in message
    )
    assert "NoPermission" in message
    (path,) = (tmp_path / "spill").glob("*.arrows")
    assert str(path) in message
    assert read_spill(path).rows == 4 * ROWS
    assert len(odps_ids(server)) == 16 * ROWS
    report = replay_spill(path, OdpsSink(sink_config(server, "t", "dt=20261122")))
    assert report.rows == 4 * ROWS
    assert odps_ids(server) == list(range(20 * ROWS))


@pytest.mark.anyio
async def test_retries_exhausted_spill_the_batch(server: OdpsServer, tmp_path: Path) -> None:
    server.inject("put_block", "503", times=3)
    hook = odps_hook(server, tmp_path, retries=2, size_threshold=10**9)
    with pytest.raises(HookError, match="retries exhausted"):
        async with HookBus() as bus:
            bus.add_hook(hook)
            await run_steps(bus, range(4))
    assert hook.writer.stats()["retries"] == 2 and odps_ids(server) == []
    (path,) = (tmp_path / "spill").glob("*.arrows")
    replay_spill(path, OdpsSink(sink_config(server, "t", "dt=20261122")))
    assert odps_ids(server) == list(range(4 * ROWS))


@pytest.mark.anyio
async def test_the_close_deadline_abandons_slow_uploads_and_spills_them(
    server: OdpsServer, tmp_path: Path
) -> None:
    server.inject("put_block", "slow:1.5", times=10)
    hook = odps_hook(server, tmp_path, worker_num=2, size_threshold=10**9)
    with pytest.raises(HookError, match="were not delivered") as info:
        async with HookBus(flush_timeout=0.3) as bus:
            bus.add_hook(hook)
            await run_steps(bus, range(5))
    assert "close deadline" in str(info.value.__cause__)
    (path,) = (tmp_path / "spill").glob("*.arrows")
    await anyio.sleep(1.6)  # the abandoned upload finishes; it must not commit
    assert server.counts("commit") == 0
    server.clear_faults()
    replay_spill(path, OdpsSink(sink_config(server, "t", "dt=20261122")))
    assert odps_ids(server) == list(range(5 * ROWS))


@pytest.mark.anyio
async def test_a_commit_under_way_at_the_deadline_is_waited_for_not_spilled(
    server: OdpsServer, tmp_path: Path
) -> None:
    # The deadline leaves the close's upload time to reach the commit on a loaded machine (at
    # 0.5 s it sometimes had not, and the rows were spilled); the commit ends after it.
    server.inject("commit", "slow:3.0")
    hook = odps_hook(server, tmp_path, size_threshold=10**9)
    async with HookBus(flush_timeout=2.0) as bus:
        bus.add_hook(hook)
        await run_steps(bus, range(3))
    assert odps_ids(server) == list(range(3 * ROWS))
    assert hook.writer.stats()["spilled"] == 0 and not (tmp_path / "spill").exists()


@pytest.mark.anyio
async def test_backpressure_bounds_pending_batches_and_shows_in_stats(
    server: OdpsServer, tmp_path: Path
) -> None:
    server.inject("put_block", "slow:0.05", times=100)
    hook = odps_hook(server, tmp_path, worker_num=2, size_threshold=1000)  # a batch per step
    peak = 0
    async with HookBus() as bus:
        bus.add_hook(hook)
        for step in range(12):
            await run_steps(bus, range(step, step + 1))
            peak = max(peak, hook.writer.stats()["queued_batches"])
        stats = bus.stats()["services"][hook.writer.name]
        assert stats["backpressure_waits"] > 0 and stats["backpressure_wait_s"] > 0
    assert peak == 3  # worker_num + 1
    assert odps_ids(server) == list(range(12 * ROWS))


# ----------------------------------------------------------------------------- credentials


@pytest.mark.anyio
async def test_the_secret_appears_in_no_output(
    server: OdpsServer,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    server.inject("put_block", "503")
    server.inject("commit", "lost", after=1)
    server.inject("put_block", "4xx", after=3)
    hook = odps_hook(server, tmp_path)
    texts = [repr(hook), repr(hook.sink), hook.state_key]
    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.add_hook(hook)
            await run_steps(bus, range(16))  # 4 batches
            texts.append(repr(bus.stats()))
    texts += ["".join(traceback.format_exception(info.value)), repr(info.value)]
    spills = list((tmp_path / "spill").glob("*"))
    assert spills
    out, err = capsys.readouterr()
    texts += [caplog.text, out, err, *server.log_lines]
    blobs = [p.read_bytes() for p in spills]
    assert "Authorization" in caplog.text  # pyodps's DEBUG request logs were captured
    for text in texts:
        assert TEST_SECRET not in text
    for blob in blobs:
        assert TEST_SECRET.encode() not in blob


# ----------------------------------------------------------------------------- SIGTERM


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_stops_at_a_step_boundary_and_keeps_every_row(tmp_path: Path, backend: str) -> None:
    script = Path(__file__).resolve().parents[1] / "scripts" / "trace_loop.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), backend],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    steps = int((tmp_path / "steps.txt").read_text())
    assert steps > 20
    assert parquet_ids(tmp_path) == list(range(steps * 64))


@pytest.mark.async_bus_only  # awaits the writer's own aclose from the test
@pytest.mark.anyio
async def test_a_cancelled_close_waits_for_a_commit_under_way_then_spills_nothing_twice(
    server: OdpsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As on a second stop signal: close is cancelled while a commit is in flight, then the
    scope around the bus is cancelled.  The commit under way is waited for (delivered), the
    batch not yet sent is spilled once; the block ends with the cancellation, which its
    scope absorbs, and the close's error naming the spill file is logged."""
    # One worker: batch 0's slow commit holds step 2's publish until batch 1 is taken; batch
    # 1's commit is the one under way when the close is cancelled; batch 2 waits behind it.
    server.inject("commit", "slow:1.0", times=2)
    hook = odps_hook(server, tmp_path, size_threshold=1000)  # a batch per step
    writer = hook.writer
    async with anyio.create_task_group() as tg:
        async with HookBus(handle_signals=False) as bus:
            bus.add_hook(hook)
            await run_steps(bus, range(3))
            with anyio.fail_after(10):
                while server.counts("commit") < 2:  # batch 1's commit has begun (1 s long)
                    await anyio.sleep(0.01)
            with anyio.move_on_after(0.1):  # cancels writer.aclose mid-way
                await writer.aclose(anyio.current_time() + 60)
            tg.cancel_scope.cancel()
    assert tg.cancel_scope.cancelled_caught
    spills = list((tmp_path / "spill").glob("*.arrows"))
    assert sum(read_spill(p).rows for p in spills) == ROWS  # batch 2, once
    assert server.counts("commit") == 2  # nothing committed after the cancellation
    assert odps_ids(server) == list(range(2 * ROWS))  # batch 1's commit was waited for
    (logged,) = [r for r in caplog.records if "failed while closing the bus" in r.getMessage()]
    assert logged.levelno == logging.ERROR and str(spills[0]) in logged.getMessage()
    for path in spills:
        replay_spill(path, OdpsSink(sink_config(server, "t", "dt=20261122")))
    assert odps_ids(server) == list(range(3 * ROWS))  # and never both


async def _traced_run(
    root: Path, steps: range, *, state: dict[str, Any] | None, resume_at: int | None
) -> dict[str, Any]:
    """A run tracing 2 rows a step (a batch per step) into ``root/t``; ``state``: the run's
    TraceHook state from a checkpoint; ``resume_at``: the restored checkpoint's step."""
    hook = TraceHook(ParquetSink(root, "t", rank=0), ["step"], ["bigint"], size_threshold=1)
    if state is not None:
        hook.load_state_dict(state)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await bus.publish(Start())
        if resume_at is not None:
            await bus.publish(AfterLoadCheckpoint(global_step=resume_at))
        for step in steps:
            await bus.publish(BeforeStep(global_step=step))
            add_to_trace("step", [step, step])
            await bus.publish(AfterStep(global_step=step))
    return hook.state_dict()


@pytest.mark.anyio
async def test_a_run_resumed_after_a_crash_traces_each_step_once(tmp_path: Path) -> None:
    """Restored at step 5 of a run whose rows reached step 9 (a crash left no newer
    checkpoint): steps 5-9 are trained again but not traced again; another run writing into
    the same table is not mistaken for this one."""
    state = await _traced_run(tmp_path, range(10), state=None, resume_at=None)
    await _traced_run(tmp_path, range(5, 13), state=state, resume_at=5)  # this run, resumed
    table = pads.dataset(tmp_path / "t", format="parquet").to_table()
    counts = Counter(table["step"].to_pylist())
    assert counts == {s: 2 for s in range(13)}
    await _traced_run(tmp_path, range(5, 7), state=None, resume_at=5)  # another run
    table = pads.dataset(tmp_path / "t", format="parquet").to_table()
    assert Counter(table["step"].to_pylist())[5] == 4


@pytest.mark.anyio
async def test_bfloat16_and_float16_tensors_are_traced_exactly(tmp_path: Path) -> None:
    """GPU training's dtypes: converted to the column's type, every value kept."""
    bf = torch.tensor([1.5, -0.0078125, 3.0e38, float("nan")], dtype=torch.bfloat16)
    half = torch.tensor([0.5, 65504.0, -2.0, 1e-3], dtype=torch.float16)
    hook = TraceHook(
        ParquetSink(tmp_path, "t", rank=0), ["bf", "half", "emb"], ["float", "double", "array<float>"]
    )
    async with HookBus() as bus:
        bus.add_hook(hook)
        await bus.publish(BeforeStep(global_step=0))
        add_to_trace("bf", bf)
        add_to_trace("half", half)
        add_to_trace("emb", torch.stack([bf, bf]).T)
        await bus.publish(AfterStep(global_step=0))
    table = pads.dataset(tmp_path / "t", format="parquet").to_table()
    np.testing.assert_array_equal(table["bf"].to_numpy(), bf.float().numpy())
    np.testing.assert_array_equal(table["half"].to_numpy(), half.double().numpy())
    assert table["emb"].to_pylist()[0] == [1.5, 1.5]
