"""A publish waiting for buffer room (``TraceWriter.send``) never waits forever: a sink that
hangs (a real ParquetSink whose writes wait on a gate) costs at most ``send_timeout`` (the
batch is spilled), and a stop request ends the wait at once (the batch is kept for the close,
which delivers it if the sink catches up by ``flush_timeout`` and spills it if not); rows
counted back with pyarrow."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pyarrow.dataset as pads
import pytest

from recis_async import HookBus, HookError, SyncHookBus, add_to_trace
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


@pytest.mark.anyio
async def test_ctrl_c_while_the_sink_is_slow_spills_nothing(tmp_path: Path) -> None:
    """A real SIGINT while the sink is busy (step 0 in its write, step 1 queued), then a step
    whose batch finds no room: the stop ends that wait at once, but says nothing about the
    sink, so the batch is kept for the close, which delivers it once the sink catches up.
    (It was spilled at once: Ignite's Ctrl-C test found steps 8-11 in a spill file instead of
    Parquet whenever the disk was slower than its steps.)"""
    gate = threading.Event()
    trace = gated_hook(tmp_path, gate)  # a batch per step, one worker
    published = 0
    try:
        with pytest.raises(SystemExit) as exit_, anyio.fail_after(30):
            async with HookBus(flush_timeout=10) as bus:
                bus.add_hook(trace)
                for n in range(2):
                    await step(bus, n)
                    published += 1
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, between two steps
                await step(bus, 2)  # seals a batch: no room
                published += 1
                assert bus.should_stop
                assert not gate.is_set()  # the publish returned with the sink still busy
                stats = trace.writer.stats()
                assert (stats["queued_batches"], stats["spilled"]) == (3, 0)
                gate.set()  # the slow write ends; the close delivers the rest
    finally:
        gate.set()
    assert exit_.value.code == 128 + signal.SIGINT
    assert sorted(delivered_ids(tmp_path)) == list(range(published * ROWS))  # each row once
    assert spilled_ids(tmp_path) == [] and trace.writer.stats()["spilled"] == 0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_while_the_sink_is_slow_spills_nothing_on_the_sync_bus(
    tmp_path: Path, backend: str
) -> None:
    """The same through a SyncHookBus, as the framework adapters publish."""
    gate = threading.Event()
    trace = gated_hook(tmp_path, gate)
    published = 0

    def sync_step(bus: SyncHookBus, n: int) -> None:
        bus.publish(BeforeStep(global_step=n))
        add_to_trace("id", np.arange(n * ROWS, (n + 1) * ROWS))
        add_to_trace("x", np.full(ROWS, float(n)))
        bus.publish(AfterStep(global_step=n, samples=ROWS))

    def open_gate_later() -> None:  # a bound on the test, should the close wait for the gate
        if not gate.wait(30):
            gate.set()

    watchdog = threading.Thread(target=open_gate_later, daemon=True)
    watchdog.start()
    try:
        with pytest.raises(SystemExit) as exit_:
            with SyncHookBus(flush_timeout=10, backend=backend) as bus:
                bus.add_hook(trace)
                for n in range(2):
                    sync_step(bus, n)
                    published += 1
                signal.raise_signal(signal.SIGINT)
                sync_step(bus, 2)
                published += 1
                assert bus.should_stop and not gate.is_set()
                assert trace.writer.stats()["spilled"] == 0
                gate.set()
    finally:
        gate.set()
        watchdog.join(5)
    assert exit_.value.code == 128 + signal.SIGINT
    assert sorted(delivered_ids(tmp_path)) == list(range(published * ROWS))
    assert spilled_ids(tmp_path) == []


@pytest.mark.anyio
async def test_a_loop_running_on_after_its_stop_keeps_at_most_worker_num_plus_one_batches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Batches kept for the close after a stop are bounded: a loop that runs on (ignoring
    ``should_stop``) while the sink hangs has its further batches spilled at once, with the
    reason; every row is delivered or spilled once."""
    gate = threading.Event()
    caplog.set_level(logging.WARNING)
    trace = gated_hook(tmp_path, gate)  # worker_num=1: 2 batches may be kept
    try:
        with pytest.raises(HookError, match="not delivered"), anyio.fail_after(30):
            async with HookBus(flush_timeout=0.5, handle_signals=False) as bus:
                bus.add_hook(trace)
                for n in range(2):
                    await step(bus, n)
                bus.request_stop("test")
                for n in range(2, 6):
                    assert await step(bus, n) < 10  # never waits for the hung sink
                stats = trace.writer.stats()
                assert (stats["queued_batches"], stats["spilled"]) == (4, 2)  # 0-1, 2-3 kept
    finally:
        gate.set()
    assert "2 batch(es) already wait for the close to deliver them" in caplog.text
    delivered, spilled = delivered_ids(tmp_path), spilled_ids(tmp_path)
    assert sorted(delivered + spilled) == list(range(6 * ROWS))
