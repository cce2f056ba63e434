"""JobQueue: overflow policies, failures, and close, on a real bus."""

from __future__ import annotations

import logging

import anyio
import pytest

from recis_async import HookBus, HookError
from recis_async.jobs import JobQueue


class Recorder:
    """A handler that records jobs and can be held at a gate."""

    def __init__(self) -> None:
        self.done: list[int] = []
        self.gate = anyio.Event()
        self.gate.set()
        self.started = anyio.Event()

    async def handle(self, job: int) -> None:
        self.started.set()
        await self.gate.wait()
        if job < 0:
            raise ValueError(f"bad job {job}")
        self.done.append(job)


async def started(queue: JobQueue[int], rec: Recorder) -> None:
    """Put job 0 and wait until the handler holds it (so the next puts only queue)."""
    rec.gate = anyio.Event()
    await queue.put(0)
    with anyio.fail_after(5):
        await rec.started.wait()


@pytest.mark.anyio
async def test_wait_blocks_until_there_is_room_and_keeps_every_job() -> None:
    rec = Recorder()
    queue = JobQueue("q", rec.handle, capacity=1)
    async with HookBus(handle_signals=False) as bus:
        bus.start_service(queue)
        await started(queue, rec)
        await queue.put(1)  # waits beside the running job
        with anyio.move_on_after(0.1) as scope:
            await queue.put(2)  # full: waits
        assert scope.cancelled_caught
        with pytest.raises(anyio.WouldBlock):
            queue.put_nowait(2)
        rec.gate.set()
        with anyio.fail_after(5):
            assert await queue.put(2)
            await queue.wait_idle()
    assert rec.done == [0, 1, 2]


@pytest.mark.anyio
async def test_several_waiting_puts_all_get_in() -> None:
    rec = Recorder()
    queue = JobQueue("q", rec.handle, capacity=1)
    async with HookBus(handle_signals=False) as bus:
        bus.start_service(queue)
        await started(queue, rec)
        await queue.put(1)
        with anyio.fail_after(5):  # a put left waiting would hang here
            async with anyio.create_task_group() as tg:
                for job in (2, 3, 4):
                    tg.start_soon(queue.put, job)
                await anyio.sleep(0.05)  # all three wait for room
                rec.gate.set()
    assert sorted(rec.done) == [0, 1, 2, 3, 4]


@pytest.mark.anyio
async def test_skip_drops_the_new_job_and_counts_it() -> None:
    rec = Recorder()
    queue = JobQueue("q", rec.handle, capacity=1, overflow="skip")
    async with HookBus(handle_signals=False) as bus:
        bus.start_service(queue)
        await started(queue, rec)
        assert queue.put_nowait(1)
        assert not queue.put_nowait(2)
        assert not await queue.put(3)
        stats = queue.stats()
        assert stats["skipped"] == 2 and stats["queued"] == 1 and stats["running"] == 1
        rec.gate.set()
    assert rec.done == [0, 1]


@pytest.mark.anyio
async def test_replace_keeps_the_newest_waiting_job() -> None:
    rec = Recorder()
    queue = JobQueue("q", rec.handle, capacity=1, overflow="replace")
    async with HookBus(handle_signals=False) as bus:
        bus.start_service(queue)
        await started(queue, rec)
        for job in (1, 2, 3):
            assert queue.put_nowait(job)
        assert queue.stats()["replaced"] == 2
        rec.gate.set()
    assert rec.done == [0, 3]


@pytest.mark.anyio
async def test_raise_surfaces_at_close_and_refuses_later_jobs() -> None:
    rec = Recorder()
    queue = JobQueue("q", rec.handle)
    with pytest.raises(HookError, match="service 'q' failed: bad job -1"):
        async with HookBus(handle_signals=False) as bus:
            bus.start_service(queue)
            await queue.put(-1)
            with anyio.fail_after(5):
                await queue.wait_idle()
            with pytest.raises(RuntimeError, match=r"q: failed earlier \(ValueError"):
                await queue.put(1)
    assert rec.done == []


@pytest.mark.anyio
async def test_log_goes_on_and_disable_drops_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="recis_async.jobs")
    rec_log, rec_off = Recorder(), Recorder()
    logged = JobQueue("logged", rec_log.handle, on_error="log")
    disabled = JobQueue("disabled", rec_off.handle, on_error="disable")
    async with HookBus(handle_signals=False) as bus:
        for queue in (logged, disabled):
            bus.start_service(queue)
            for job in (1, -1, 2):
                await queue.put(job)
        with anyio.fail_after(5):
            await logged.wait_idle()
            await disabled.wait_idle()
        assert disabled.stats()["dropped"] == 1 and disabled.stats()["errors"] == 1
    assert rec_log.done == [1, 2] and rec_off.done == [1]
    assert any("logged: job failed (on_error=log)" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
async def test_close_finishes_the_queued_jobs() -> None:
    rec = Recorder()
    queue = JobQueue("q", rec.handle, capacity=8)
    async with HookBus(handle_signals=False) as bus:
        bus.start_service(queue)
        await started(queue, rec)
        for job in range(1, 6):
            await queue.put(job)
        rec.gate.set()  # the body ends with five jobs queued
    assert rec.done == [0, 1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="q: put after close"):
        queue.put_nowait(6)


@pytest.mark.anyio
async def test_close_deadline_cancels_and_names_what_was_left() -> None:
    rec = Recorder()
    kept: list[int] = []
    queue = JobQueue("q", rec.handle, capacity=4, on_cancel=kept.extend)
    with pytest.raises(HookError, match="q: 3 jobs were not finished by the close deadline"):
        async with HookBus(flush_timeout=0.2, handle_signals=False) as bus:
            bus.start_service(queue)
            await started(queue, rec)  # held at the gate forever
            await queue.put(1)
            await queue.put(2)
    assert rec.done == []
    assert kept == [0, 1, 2]  # handed to on_cancel when the close deadline cut them


def test_bad_arguments_are_refused() -> None:
    async def handle(job: int) -> None: ...

    with pytest.raises(ValueError, match=r"JobQueue\(capacity=...\): expected a positive int"):
        JobQueue("q", handle, capacity=0)
    with pytest.raises(ValueError, match=r"JobQueue\(overflow=...\): expected one of 'wait'"):
        JobQueue("q", handle, overflow="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"JobQueue\(on_error=...\): expected one of 'raise'"):
        JobQueue("q", handle, on_error="ignore")  # type: ignore[arg-type]
