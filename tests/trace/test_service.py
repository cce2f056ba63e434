"""TraceWriter (recis_async.trace.service): what it does with the sink's own lifecycle."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import anyio
import pyarrow.dataset as pads
import pytest

from recis_async import HookBus, HookError, add_to_trace
from recis_async.errors import SinkError, TraceDeliveryError
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink
from recis_async.spill import replay_spill
from recis_async.trace.base import Attempt
from recis_async.trace.buffer import Batch
from recis_async.trace.schema import OdpsType


class SlowOpenSink(ParquetSink):
    """A real Parquet sink whose ``open`` waits until the test lets it finish."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, "t", rank=0)
        self.release = threading.Event()
        self.calls: list[str] = []

    def open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        self.calls.append("open started")
        assert self.release.wait(10), "the test never released open"
        super().open(fields, types)
        self.calls.append("opened")

    def close(self) -> None:
        self.calls.append("closed")
        super().close()


@pytest.mark.anyio
async def test_an_open_still_running_at_close_closes_the_sink_when_it_ends(
    tmp_path: Path,
) -> None:
    """The bus closes while the sink's open (started at bus start) is still running in its
    thread, and goes on running past the close's bound: the open is abandoned, and when it
    ends it closes the sink itself -- a sink that opened is closed exactly once, not left
    holding clients or log filters."""
    sink = SlowOpenSink(tmp_path)
    async with HookBus(flush_timeout=0.2, handle_signals=False) as bus:
        bus.add_hook(TraceHook(sink, ["id"], ["bigint"], spill_dir=tmp_path / "spill"))
        with anyio.fail_after(5):
            while not sink.calls:  # the open at bus start is under way
                await anyio.sleep(0.01)
    assert sink.calls == ["open started"]  # the close gave up on the open at its bound
    sink.release.set()
    with anyio.fail_after(5):
        while len(sink.calls) < 3:
            await anyio.sleep(0.01)
    await anyio.sleep(0.05)
    assert sink.calls == ["open started", "opened", "closed"]


@pytest.mark.anyio
async def test_a_sink_that_opened_is_closed_once_at_close(tmp_path: Path) -> None:
    sink = SlowOpenSink(tmp_path)
    sink.release.set()
    async with HookBus(flush_timeout=5, handle_signals=False) as bus:
        bus.add_hook(TraceHook(sink, ["id"], ["bigint"], spill_dir=tmp_path / "spill"))
        with anyio.fail_after(5):
            while "opened" not in sink.calls:
                await anyio.sleep(0.01)
    assert sink.calls == ["open started", "opened", "closed"]


@pytest.mark.anyio
async def test_a_cancelled_close_stops_waiting_for_the_open_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Close waits for an open still under way, until its deadline; a cancellation of the
    close (the bus's second stop signal, or its grace for an overrunning service) ends that
    wait at once: the open is abandoned, named in a warning, and closes the sink itself."""
    sink = SlowOpenSink(tmp_path)
    writer = TraceHook(sink, ["id"], ["bigint"], spill_dir=tmp_path / "spill").writer
    caplog.set_level(logging.WARNING, "recis_async.trace.service")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.run)
            with anyio.fail_after(5):
                while not sink.calls:  # the open at the writer's start is under way
                    await anyio.sleep(0.01)
            t0 = anyio.current_time()
            with anyio.move_on_after(0.2) as scope:
                await writer.aclose(anyio.current_time() + 30)
            took = anyio.current_time() - t0
        assert scope.cancelled_caught and took < 0.2 + 1.5, f"took {took:.1f} s"
        assert sink.calls == ["open started"]
        (line,) = [m for m in caplog.messages if "open was still running at the close" in m]
        assert sink.name in line
    finally:
        sink.release.set()
    with anyio.fail_after(5):
        while "closed" not in sink.calls:
            await anyio.sleep(0.01)
    assert sink.calls == ["open started", "opened", "closed"]


class RefusingSink(ParquetSink):
    """A real Parquet sink whose every write fails for good (a schema the table refuses)."""

    def write(self, batch: Batch, attempt: Attempt) -> None:
        raise SinkError(f"{self.name}: refused", transient=False)


class HungSink(ParquetSink):
    """A real Parquet sink whose writes wait for ``gate`` (at most 10 s, a bound on the test)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, "t", rank=0)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write(self, batch: Batch, attempt: Attempt) -> None:
        self.entered.set()
        self.gate.wait(10)
        super().write(batch, attempt)  # abandoned by then: publishes nothing


async def _trace_steps(bus: HookBus, steps: range) -> None:
    for step in steps:
        await bus.publish(BeforeStep(global_step=step))
        add_to_trace("id", [2 * step, 2 * step + 1])
        await bus.publish(AfterStep(global_step=step))


def _ids(root: Path) -> list[int]:
    return sorted(pads.dataset(root / "t", format="parquet").to_table().column("id").to_pylist())


@pytest.mark.anyio
async def test_a_second_aclose_returns_quietly_after_the_first_reported(tmp_path: Path) -> None:
    """aclose is idempotent (anyio's convention) and reports a failure once: the close the
    bus ran raised the spill error; the user's own aclose after it returns without raising
    it again, and the spill files stay named in the writer's stats, replayable once."""
    hook = TraceHook(
        RefusingSink(tmp_path, "t", rank=0),
        ["id"],
        ["bigint"],
        size_threshold=1,  # a batch per step
        spill_dir=tmp_path / "spill",
    )
    writer = hook.writer
    with pytest.raises(HookError) as error:
        async with HookBus(flush_timeout=5, handle_signals=False) as bus:
            bus.add_hook(hook)
            await _trace_steps(bus, range(3))
    cause = error.value.__cause__
    assert isinstance(cause, TraceDeliveryError) and cause.spilled_rows == 6
    files = [str(p) for p in cause.spill_files]
    assert len(files) == 3 and f"3 files in {tmp_path / 'spill'}" in str(error.value)
    await writer.aclose(anyio.current_time() + 5)  # reported already: quiet
    await writer.aclose(anyio.current_time() + 5)
    assert writer.take_close_error() is None
    assert writer.stats()["spill_files"] == files  # nothing hidden: still named here
    for path in files:
        replay_spill(path, ParquetSink(tmp_path, "t", rank=0))
    assert _ids(tmp_path) == list(range(6))  # each row once


@pytest.mark.anyio
async def test_a_close_cut_short_reports_its_spill_once_through_take_close_error(
    tmp_path: Path,
) -> None:
    """A close cancelled mid-way (as the bus cuts it on a second stop signal) keeps every
    row in a spill file but cannot raise; ``take_close_error`` hands its error over (what the
    bus names in its own), once; the bus's later aclose is then quiet."""
    sink = HungSink(tmp_path)
    hook = TraceHook(sink, ["id"], ["bigint"], size_threshold=1, spill_dir=tmp_path / "spill")
    writer = hook.writer
    try:
        async with HookBus(flush_timeout=5, handle_signals=False) as bus:
            bus.add_hook(hook)
            await _trace_steps(bus, range(2))
            with anyio.fail_after(5):
                while not sink.entered.is_set():
                    await anyio.sleep(0.01)
            with anyio.move_on_after(0.2) as cut:
                await writer.aclose(anyio.current_time() + 30)
            assert cut.cancelled_caught
            error = writer.take_close_error()
            assert isinstance(error, TraceDeliveryError) and error.spilled_rows == 4
            assert writer.take_close_error() is None  # handed over once
            (path,) = error.spill_files
            assert path.exists() and str(path) in str(error)
            assert f"python -m recis_async.spill replay FILE --parquet {tmp_path}" in str(error)
        # the bus's own close (the block ended without an error) reported nothing again
    finally:
        sink.gate.set()
    replay_spill(path, ParquetSink(tmp_path, "t", rank=0))
    assert _ids(tmp_path) == list(range(4))  # each row once
