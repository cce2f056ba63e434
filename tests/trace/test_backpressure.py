"""A publish waiting for buffer room (``TraceWriter.send``) never waits forever: a sink that
hangs (a real ParquetSink whose writes wait on a gate) costs at most ``send_timeout``, and a
stop request ends the wait at once; the batch is spilled, counted back with pyarrow."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pyarrow.dataset as pads
import pytest

from recis_async import HookBus, HookError, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink
from recis_async.spill import read_spill
from recis_async.trace.base import Attempt
from recis_async.trace.buffer import Batch

ROWS = 64
STEP_BYTES = ROWS * (8 + 8)  # id bigint + x double


class GatedSink(ParquetSink):
    """A ParquetSink whose writes first wait for ``gate``: a sink that hangs until set."""

    def __init__(self, root: Path, gate: threading.Event) -> None:
        super().__init__(root, "t", rank=0)
        self.gate = gate

    def write(self, batch: Batch, attempt: Attempt) -> None:
        self.gate.wait()
        super().write(batch, attempt)


def gated_hook(tmp_path: Path, gate: threading.Event, **kw: float) -> TraceHook:
    return TraceHook(
        GatedSink(tmp_path / "root", gate),
        ["id", "x"],
        ["bigint", "double"],
        size_threshold=STEP_BYTES,  # a batch per step
        spill_dir=tmp_path / "spill",
        **kw,  # type: ignore[arg-type]
    )


async def step(bus: HookBus, n: int) -> float:
    """Publish step ``n``; return how long its AfterStep took."""
    await bus.publish(BeforeStep(global_step=n))
    add_to_trace("id", np.arange(n * ROWS, (n + 1) * ROWS))
    add_to_trace("x", np.full(ROWS, float(n)))
    t = time.monotonic()
    await bus.publish(AfterStep(global_step=n, samples=ROWS))
    return time.monotonic() - t


def delivered_ids(tmp_path: Path) -> list[int]:
    table = tmp_path / "root" / "t"
    if not any(table.glob("*.parquet")):
        return []
    return list(pads.dataset(table).to_table().column("id").to_pylist())


def spilled_ids(tmp_path: Path) -> list[int]:
    ids: list[int] = []
    for path in sorted((tmp_path / "spill").glob("*.arrows")):
        for entry in read_spill(path).entries:
            ids += entry.batch.to_arrow().column("id").to_pylist()
    return ids


@pytest.mark.anyio
async def test_a_publish_blocked_by_a_hung_sink_returns_after_send_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = threading.Event()
    caplog.set_level(logging.WARNING)
    trace = gated_hook(tmp_path, gate, send_timeout=0.5)
    took: list[float] = []
    try:
        with anyio.fail_after(60):
            async with HookBus(flush_timeout=5) as bus:
                bus.add_hook(trace)
                for n in range(5):
                    took.append(await step(bus, n))
                # steps 0 (in the hung write) and 1 (queued) wait; 2, 3, 4 found no room
                assert trace.writer.stats()["spilled"] == 3
                gate.set()  # the sink answers again: close delivers what waits
    except HookError as exc:
        assert "no room: 3" in str(exc)
    finally:
        gate.set()
    assert max(took) < 10  # bounded (0.5 s each here), not forever
    assert "waited send_timeout=0.5s for room" in caplog.text
    delivered, spilled = delivered_ids(tmp_path), spilled_ids(tmp_path)
    assert sorted(delivered) == list(range(2 * ROWS))
    assert sorted(delivered + spilled) == list(range(5 * ROWS))  # each row once


@pytest.mark.anyio
async def test_a_stop_request_ends_the_wait_for_room_at_once(tmp_path: Path) -> None:
    gate = threading.Event()
    trace = gated_hook(tmp_path, gate)  # send_timeout: the default 60 s
    published = 0
    try:
        with pytest.raises(HookError, match="not delivered"), anyio.fail_after(30):
            async with HookBus(flush_timeout=1) as bus:
                bus.add_hook(trace)
                for n in range(2):
                    await step(bus, n)
                    published += ROWS

                async def stop_soon() -> None:
                    await anyio.sleep(0.3)
                    bus.request_stop("test")

                async with anyio.create_task_group() as tg:
                    tg.start_soon(stop_soon)
                    took = await step(bus, 2)  # no room: waits until the stop
                    published += ROWS
                assert took < 10
                assert bus.should_stop
    finally:
        gate.set()
    delivered, spilled = delivered_ids(tmp_path), spilled_ids(tmp_path)
    assert sorted(delivered + spilled) == list(range(published))
