"""HostCopy and HostBufferPool: the values at the call, converted exactly, buffers reused and
bounded, a full pool back-pressuring the step (issue 23, part 1)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import anyio
import numpy as np
import pytest
import torch

from recis_async import HookBus, add_to_ml_tracker, add_to_trace
from recis_async.events import AfterStep
from recis_async.hostcopy import HostBufferPool, HostCopy, resolved_dtype

# A GPU's path: the collectors copy CPU tensors through the pool as they would a device's.
pytestmark = pytest.mark.usefixtures("device_path")


def test_a_copy_knows_its_metadata_and_holds_the_value_at_the_call() -> None:
    pool = HostBufferPool(1 << 20)
    src = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    copy = pool.copy(src)
    src.add_(100)  # after the call: not in the copy
    assert (copy.dtype, copy.shape, copy.size, copy.nbytes) == (np.dtype(np.int64), (3, 4), 12, 96)
    assert copy.source_dtype is torch.int64 and copy.device == torch.device("cpu")
    assert len(copy) == 3 and copy.ndim == 2
    assert copy.ready() and not copy.resolved  # a CPU copy is done at once, not yet read
    values = copy.resolve()
    assert values.tolist() == np.arange(12).reshape(3, 4).tolist()
    assert values.flags.owndata and not values.flags.writeable
    assert copy.resolve() is values  # resolved once
    assert np.asarray(copy) is values
    writable = np.array(copy)
    assert writable.flags.writeable and not np.shares_memory(writable, values)
    assert np.asarray(copy, dtype=np.float32).dtype == np.float32


def test_bfloat16_becomes_float32_exactly_and_float16_stays_float16() -> None:
    pool = HostBufferPool()
    special = [1.5, -0.0078125, 3.0e38, -3.3895e38, 1e-40, 0.0, -0.0, float("inf"), float("nan")]
    bf = torch.tensor(special, dtype=torch.bfloat16)
    copy = pool.copy(bf)
    assert copy.dtype == np.float32 and copy.source_dtype is torch.bfloat16
    got = copy.resolve()
    want = bf.float().numpy()
    assert got.dtype == np.float32 and got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    half = torch.tensor([0.5, 65504.0, -6.1e-5], dtype=torch.float16)
    got = pool.copy(half).resolve()
    assert got.dtype == np.float16 and got.tolist() == half.numpy().tolist()
    assert resolved_dtype(torch.float8_e4m3fn) is None and not pool.accepts(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"expected a numpy-compatible dtype, got torch.float8"):
        pool.copy(torch.ones(2, dtype=torch.float8_e4m3fn))


def test_views_grad_conjugate_and_empty_tensors_are_copied_as_their_values() -> None:
    pool = HostBufferPool()
    weights = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    assert pool.copy(weights).resolve().tolist() == [1.0, 2.0]
    assert pool.copy(torch.arange(6).reshape(2, 3).t()).resolve().tolist() == [
        [0, 3],
        [1, 4],
        [2, 5],
    ]
    assert pool.copy(torch.tensor([1 + 2j]).conj()).resolve().tolist() == [1 - 2j]
    empty = pool.copy(torch.zeros(0, 3))
    assert empty.resolved and empty.resolve().shape == (0, 3)
    assert pool.copy(torch.tensor(2.5)).resolve().shape == ()


def test_buffers_are_reused_across_steps_and_given_back_on_resolve_or_release() -> None:
    pool = HostBufferPool(1 << 20)
    for step in range(5):
        a = pool.copy(torch.full((64,), float(step)))
        b = pool.copy(torch.full((64,), float(-step)))
        pool.next_step()
        assert a.resolve()[0] == step and b.resolve()[0] == -step
    stats = pool.stats()
    assert stats["allocated"] == 2 and stats["reused"] == 8
    assert stats["held_bytes"] == 2 * 64 * 4 and stats["in_use_bytes"] == 0
    released = pool.copy(torch.ones(64))
    assert pool.stats()["in_use_bytes"] == 256
    released.release()
    released.release()  # idempotent
    assert pool.stats()["in_use_bytes"] == 0
    with pytest.raises(RuntimeError, match=r"released before it was resolved"):
        released.resolve()


def test_without_a_copy_out_thread_next_step_resolves_the_copies_of_earlier_steps_only() -> None:
    pool = HostBufferPool(1 << 20, copy_out_interval=None)
    first = pool.copy(torch.ones(4))
    pool.next_step()  # the step of ``first`` is handed over: it is not read yet
    assert not first.resolved
    second = pool.copy(torch.ones(4))
    pool.next_step()
    assert first.resolved and not second.resolved
    assert pool.stats()["resolved_on_step"] == 1
    assert pool._thread is None


def _copy_out_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that copy values out of the pool's buffers, in order."""
    import recis_async.hostcopy as hostcopy

    names: list[str] = []
    copy_out = hostcopy._copy_out

    def recorded(view: np.ndarray, dtype: np.dtype) -> np.ndarray:
        names.append(threading.current_thread().name)
        return copy_out(view, dtype)

    monkeypatch.setattr(hostcopy, "_copy_out", recorded)
    return names


def _wait_for(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 10
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_the_copy_out_thread_resolves_the_copies_of_finished_steps_off_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = _copy_out_threads(monkeypatch)
    pool = HostBufferPool(1 << 20, copy_out_interval=0.0)  # a hand-over every step
    first = pool.copy(torch.full((4,), 1.0))
    pool.next_step()
    second = pool.copy(torch.full((4,), 2.0))  # after the hand-over: still this step's
    assert _wait_for(lambda: first.resolved)
    assert not second.resolved
    pool.next_step()
    assert _wait_for(lambda: second.resolved)
    assert set(names) == {"recis_async copy-out (HostBufferPool)"}  # never this thread
    assert first.resolve().tolist() == [1.0] * 4 and second.resolve().tolist() == [2.0] * 4
    stats = pool.stats()
    assert stats["copied_out_off_step"] == 2 and stats["resolved_on_step"] == 0
    assert stats["in_use_bytes"] == 0
    third = pool.copy(torch.zeros(4))
    stats = pool.stats()  # the buffers came back (``second`` may have had ``first``'s already)
    assert stats["reused"] >= 1 and stats["allocated"] + stats["reused"] == 3
    pool.close()
    assert pool._thread is not None and not pool._thread.is_alive()  # close waited for it
    assert _wait_for(lambda: third.resolved)  # the last step's copies too
    assert pool._thread is not None and _wait_for(lambda: not pool._thread.is_alive())
    pool.close()  # idempotent


def test_copies_wait_for_the_interval_or_a_quarter_of_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = _copy_out_threads(monkeypatch)
    pool = HostBufferPool(1024, copy_out_interval=3600.0)
    small = [pool.copy(torch.zeros(16)) for _ in range(3)]  # 3 x 64 bytes < 256
    pool.next_step()
    pool.next_step()
    time.sleep(0.05)
    assert not any(c.resolved for c in small) and pool._thread is None and names == []
    big = pool.copy(torch.zeros(64))  # 256 more bytes: a quarter of the pool is waiting
    pool.next_step()
    assert _wait_for(lambda: all(c.resolved for c in [*small, big]))
    assert len(names) == 4
    released = pool.copy(torch.ones(64))
    released.release()  # a released copy is skipped, not an error
    pool.close()
    assert pool._thread is not None and _wait_for(lambda: not pool._thread.is_alive())
    assert pool.stats()["copied_out_off_step"] == 4 and pool.stats()["in_use_bytes"] == 0


def test_copy_out_interval_is_checked() -> None:
    for bad in (-1, "0.1", True):
        with pytest.raises(ValueError, match=r"copy_out_interval=...\): expected a number >= 0"):
            HostBufferPool(copy_out_interval=bad)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_bus_copies_values_out_off_its_thread_and_gets_every_buffer_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = _copy_out_threads(monkeypatch)
    seen: list[AfterStep] = []
    async with HookBus() as bus:
        bus.subscribe(AfterStep, seen.append)
        for step in range(12):
            add_to_trace("x", torch.full((8,), float(step)))
            add_to_ml_tracker("y", torch.tensor(float(step)))
            await bus.publish(AfterStep(global_step=step))
            await anyio.sleep(0.03)  # 12 steps over ~0.36 s: a few hand-overs
        loop_thread = threading.current_thread().name
        stats = bus.stats()["host_buffers"]
        assert stats["copied_out_off_step"] > 0 and stats["resolved_on_step"] == 0
        assert stats["reused"] > 0  # buffers came back while the loop ran
    assert loop_thread not in names and names
    host = bus._collector.host
    assert _wait_for(lambda: host.stats()["in_use_bytes"] == 0)  # after close: every one
    assert [float(np.asarray(e.trace["x"])[0]) for e in seen] == [float(s) for s in range(12)]
    assert [float(np.asarray(e.tracked["y"])) for e in seen] == [float(s) for s in range(12)]


def test_the_pool_never_keeps_more_than_its_bound() -> None:
    pool = HostBufferPool(1000)
    held = []
    for n in (50, 60, 70, 80, 90, 100):  # new shapes: least recently used free ones dropped
        copy = pool.copy(torch.zeros(n))
        copy.resolve()
        held.append(pool.held_bytes)
    assert max(held) <= 1000 and pool.stats()["allocated"] == 6
    copies = [pool.copy(torch.zeros(100)) for _ in range(4)]  # 1600 bytes in use
    assert pool.full and pool.stats()["over_bound"] >= 1
    for copy in copies:
        copy.resolve()
    assert not pool.full and pool.held_bytes <= 1000  # buffers over the bound are freed


def test_a_tensor_larger_than_the_pool_gets_a_one_off_buffer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = HostBufferPool(100)
    with caplog.at_level(logging.WARNING, logger="recis_async.hostcopy"):
        big = pool.copy(torch.arange(1000))
        pool.copy(torch.arange(1000)).resolve()
    assert [r.getMessage() for r in caplog.records if "one-off buffer" in r.getMessage()] != []
    assert len(caplog.records) == 1  # warned once
    assert pool.full
    assert big.resolve().tolist() == list(range(1000))
    assert pool.held_bytes == 0 and not pool.full


def test_resolve_is_safe_from_several_threads_at_once() -> None:
    pool = HostBufferPool(1 << 20)
    copies = [pool.copy(torch.full((1000,), float(i))) for i in range(50)]
    results: list[list[float]] = [[] for _ in copies]

    def read(k: int) -> None:
        for i, copy in enumerate(copies):
            results[i].append(float(copy.resolve()[0]))

    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[float(i)] * 4 for i in range(50)]
    assert pool.stats()["in_use_bytes"] == 0


class _Event:
    """Stands in for a CUDA event (none exists on this machine): done once ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.done.wait()


def _pending(pool: HostBufferPool, n: int) -> tuple[HostCopy, _Event]:
    """A copy whose device work is still running: the pool's code path on a GPU."""
    copy = pool.copy(torch.zeros(n))
    event = _Event()
    copy._event = event
    return copy, event


def test_a_copy_released_before_the_device_finished_keeps_its_buffer_until_then() -> None:
    pool = HostBufferPool(1 << 20)
    copy, event = _pending(pool, 10)
    assert not copy.ready()
    copy.release()
    again = pool.copy(torch.zeros(10))  # not the parked buffer: a new one
    assert pool.stats()["allocated"] == 2
    event.done.set()
    again.resolve()
    pool.next_step()  # takes the parked buffer back
    pool.copy(torch.zeros(10))
    assert pool.stats()["reused"] == 1


@pytest.mark.anyio
async def test_a_full_pool_makes_the_step_wait_for_the_device() -> None:
    pool = HostBufferPool(100)
    copy, event = _pending(pool, 50)  # 200 bytes: over the bound
    assert pool.full
    waited = False

    async def device() -> None:
        nonlocal waited
        await anyio.sleep(0.05)
        waited = True
        event.done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(device)
        await pool.make_room()
    assert waited and copy.resolved and not pool.full
    assert pool.stats()["backpressure_waits"] == 1


@pytest.mark.anyio
async def test_the_wait_for_room_is_bounded_and_gives_way_to_a_stop() -> None:
    pool = HostBufferPool(100, wait_timeout=0.05)
    _pending(pool, 50)
    with pytest.raises(TimeoutError, match=r"holds 200 bytes, over its bound of 100"):
        await pool.make_room()
    stopping = anyio.Event()
    stopping.set()
    await pool.make_room(stopping)  # returns at once: the run is ending
    assert pool.full


def test_host_buffer_bytes_is_checked_by_the_bus() -> None:
    with pytest.raises(ValueError, match=r"HookBus\(host_buffer_bytes=...\): expected a positive"):
        HookBus(host_buffer_bytes=0)
    with pytest.raises(TypeError, match=r"HookBus\(host_buffer_bytes=...\): expected a positive"):
        HookBus(host_buffer_bytes=1.5)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_bus_with_a_small_pool_back_pressures_and_loses_nothing() -> None:
    seen: list[AfterStep] = []
    async with HookBus(host_buffer_bytes=256) as bus:
        bus.subscribe(AfterStep, seen.append)
        for step in range(20):
            add_to_trace("x", torch.full((40,), float(step)))  # 160 bytes
            add_to_trace("z", torch.full((40,), step, dtype=torch.int32))  # 160 more: over
            add_to_ml_tracker("y", torch.tensor(float(step), dtype=torch.bfloat16))
            await bus.publish(AfterStep(global_step=step))
            assert bus.stats()["host_buffers"]["held_bytes"] <= 256
        stats = bus.stats()["host_buffers"]
    assert stats["over_bound"] > 0 and stats["max_bytes"] == 256
    assert stats["backpressure_waits"] > 0
    assert [float(np.asarray(e.trace["x"])[0]) for e in seen] == [float(s) for s in range(20)]
    assert [int(np.asarray(e.trace["z"])[-1]) for e in seen] == list(range(20))
    assert [float(np.asarray(e.tracked["y"])) for e in seen] == [float(s) for s in range(20)]


@pytest.mark.anyio
async def test_copies_of_a_step_that_did_not_happen_give_their_buffers_back() -> None:
    from recis_async.events import BeforeStep, OutOfData

    async with HookBus() as bus:
        await bus.publish(BeforeStep(global_step=0))
        add_to_trace("x", torch.zeros(8))
        add_to_ml_tracker("y", torch.zeros(8))
        await bus.publish(OutOfData(global_step=0))
        assert bus.stats()["host_buffers"]["in_use_bytes"] == 0
