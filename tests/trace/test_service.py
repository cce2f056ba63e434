"""TraceWriter (recis_async.trace.service): what it does with the sink's own lifecycle."""

from __future__ import annotations

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
    thread: the open is abandoned, and when it ends it closes the sink itself -- a sink that
    opened is closed exactly once, not left holding clients or log filters."""
    sink = SlowOpenSink(tmp_path)
    async with HookBus(flush_timeout=5, handle_signals=False) as bus:
        bus.add_hook(TraceHook(sink, ["id"], ["bigint"], spill_dir=tmp_path / "spill"))
        with anyio.fail_after(5):
            while not sink.calls:  # the open at bus start is under way
                await anyio.sleep(0.01)
    assert sink.calls == ["open started"]  # closed the bus without waiting for the open
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
