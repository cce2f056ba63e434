"""TraceWriter (recis_async.trace.service): what it does with the sink's own lifecycle."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import anyio
import pytest

from recis_async import HookBus
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink
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
