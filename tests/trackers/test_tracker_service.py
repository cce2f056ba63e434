"""TrackerService: every record is delivered or spilled (counted back from files), on both
backends, under backpressure, tracker failures in each on_error mode, and a close deadline."""

from __future__ import annotations

import shlex
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from recis_async.trackers import (
    JsonlTracker,
    RunSpec,
    StepRecord,
    TrackerError,
    TrackerService,
    read_records,
)
from recis_async.trackers.replay import replay_file

pytestmark = pytest.mark.anyio


class FaultyTracker(JsonlTracker):
    """A real JsonlTracker with injected faults and an optional gate on ``log``."""

    def __init__(
        self,
        root: Path,
        *,
        fail_calls: Sequence[int] = (),
        fail_start: bool = False,
        gate: threading.Event | None = None,
    ) -> None:
        super().__init__(root)
        self.fail_calls = set(fail_calls)
        self.fail_start = fail_start
        self.gate = gate
        self.entered = threading.Event()
        self.calls = 0
        self.finished: list[str] = []

    def start(self, run: RunSpec) -> None:
        if self.fail_start:
            raise ConnectionError("tracking server unreachable")
        super().start(run)

    def log(self, records: Sequence[StepRecord]) -> None:
        self.calls += 1
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        if self.calls in self.fail_calls:
            raise OSError(f"disk full on call {self.calls}")
        super().log(records)

    def finish(self, status: Any) -> None:
        self.finished.append(status)
        super().finish(status)


def _record(step: int) -> StepRecord:
    return StepRecord(step, time.time(), {"loss": float(step)})


def _delivered(tracker: JsonlTracker) -> list[int]:
    assert tracker.run_dir is not None
    return [r.step for r in read_records(tracker.run_dir / "metrics.jsonl")]


def _spilled(service: TrackerService, suffix: str = "") -> list[int]:
    if service.spill_path is None:
        return []
    path = service.spill_path.with_suffix(f"{suffix}.jsonl") if suffix else service.spill_path
    return [r.step for r in read_records(path)] if path.exists() else []


async def _until(cond: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not cond():
            await anyio.sleep(0.005)


def _service(tracker: JsonlTracker, tmp_path: Path, **kw: Any) -> TrackerService:
    kw.setdefault("flush_interval", 0)
    return TrackerService(
        tracker,
        RunSpec(project="p", name="n", params={"lr": 0.1}),
        spill_dir=tmp_path / "spill",
        **kw,
    )


async def test_delivers_everything_in_order(tmp_path: Path) -> None:
    tracker = FaultyTracker(tmp_path)
    service = _service(tracker, tmp_path, flush_interval=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        for step in range(500):
            await service.put(_record(step))
        service.set_status("ok")
        await service.aclose(anyio.current_time() + 10)
    assert _delivered(tracker) == list(range(500))
    assert tracker.finished == ["ok"]
    stats = service.stats()
    assert stats["logged"] == stats["records"] == 500 and stats["queued_bytes"] == 0
    assert stats["batches"] < 500  # batched, not one call per record
    assert service.spill_path is None


async def test_put_waits_when_buffer_full(tmp_path: Path) -> None:
    gate = threading.Event()
    tracker = FaultyTracker(tmp_path, gate=gate)
    service = _service(tracker, tmp_path, max_buffer_bytes=1000)  # ~7 records of ~130 B
    produced = 0

    async def produce() -> None:
        nonlocal produced
        for step in range(100):
            await service.put(_record(step))
            produced += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        tg.start_soon(produce)
        await anyio.to_thread.run_sync(tracker.entered.wait, 10)
        await _until(lambda: service.stats()["queued_bytes"] + 130 > 1000)
        await anyio.sleep(0.05)  # give the producer the chance it must not take
        held = service.stats()["queued_bytes"]
        assert held <= 1000 and produced < 100
        assert produced == service.stats()["records"]
        gate.set()
        await _until(lambda: produced == 100)
        service.set_status("ok")
        await service.aclose(anyio.current_time() + 10)
    assert _delivered(tracker) == list(range(100))


@pytest.mark.parametrize("mode", ["raise", "log", "disable"])
async def test_tracker_failure_modes(tmp_path: Path, mode: str) -> None:
    tracker = FaultyTracker(tmp_path, fail_calls=[2])
    service = _service(tracker, tmp_path, on_error=mode)
    errors: list[BaseException] = []

    async def run() -> None:
        try:
            await service.run()
        except TrackerError as exc:
            errors.append(exc)

    total = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        for batch in range(4):
            for i in range(10):
                try:
                    await service.put(_record(batch * 10 + i))
                    total += 1
                except TrackerError as exc:
                    assert mode == "raise" and "disk full on call 2" in str(exc)
                    assert str(service.spill_path) in str(exc)
            await _until(lambda: service.stats()["queued_records"] == 0)
        service.set_status("ok")
        await service.aclose(anyio.current_time() + 10)

    delivered, spilled = _delivered(tracker), _spilled(service)
    stats = service.stats()
    assert stats["errors"] == 1
    assert spilled == list(range(10, 20))  # the refused batch, kept
    if mode == "raise":
        assert len(errors) == 1 and isinstance(errors[0].__cause__, OSError)
        assert "tracker.log failed" in str(errors[0])
        assert delivered == list(range(10)) and total == 20
        assert tracker.finished == ["failed"]
    elif mode == "log":
        assert not errors and delivered == list(range(10)) + list(range(20, 40))
        assert tracker.finished == ["ok"] and total == 40
    else:
        assert not errors and delivered == list(range(10))
        assert stats["dropped"] == 20 and total == 40  # dropped after disable, counted
        assert tracker.finished == ["failed"]
    assert len(delivered) + len(spilled) + stats["dropped"] == total


async def test_start_failure_raise_spills_buffered(tmp_path: Path) -> None:
    tracker = FaultyTracker(tmp_path, fail_start=True)
    service = _service(tracker, tmp_path)
    for step in range(5):  # buffered before the service runs
        await service.put(_record(step))
    with pytest.raises(TrackerError, match="tracker.start failed.*unreachable"):
        await service.run()
    assert _spilled(service) == list(range(5))
    with pytest.raises(TrackerError, match="failed earlier"):
        await service.put(_record(6))
    await service.aclose(anyio.current_time() + 1)  # already reported: no second error
    assert tracker.finished == []


async def test_close_deadline_spills_unsent_and_inflight(tmp_path: Path) -> None:
    gate = threading.Event()
    tracker = FaultyTracker(tmp_path, gate=gate)
    service = _service(tracker, tmp_path)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(service.run)
            await service.put(_record(0))
            await anyio.to_thread.run_sync(tracker.entered.wait, 10)
            for step in range(1, 30):
                await service.put(_record(step))
            started = anyio.current_time()
            with pytest.raises(
                TimeoutError,
                match=r"29 unsent records spilled .*1 in-flight records \(delivery unknown\)",
            ):
                await service.aclose(anyio.current_time() + 0.2)
            assert anyio.current_time() - started < 2
    finally:
        gate.set()
    assert _spilled(service) == list(range(1, 30))
    assert _spilled(service, ".inflight") == [0]
    assert tracker.finished == []


async def test_spill_file_replays_into_a_tracker(tmp_path: Path) -> None:
    tracker = FaultyTracker(tmp_path, fail_calls=[1])
    service = _service(tracker, tmp_path, on_error="log")
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        for step in range(7):
            await service.put(_record(step))
        service.set_status("ok")
        await service.aclose(anyio.current_time() + 10)
    assert service.spill_path is not None
    replay = JsonlTracker(tmp_path / "replay")
    replay.start(RunSpec(project="p", name="replayed"))
    replay.log(read_records(service.spill_path))
    replay.finish("ok")
    assert sorted(_delivered(replay) + _delivered(tracker)) == list(range(7))
    assert msgspec.json.decode(service.spill_path.read_bytes().splitlines()[0])["values"]


def test_constructor_validates(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    run = RunSpec(project="p", name="n")
    with pytest.raises(ValueError, match="max_buffer_bytes: expected a positive int, got 0"):
        TrackerService(tracker, run, max_buffer_bytes=0)
    with pytest.raises(ValueError, match="flush_interval: expected seconds >= 0, got -1"):
        TrackerService(tracker, run, flush_interval=-1)
    with pytest.raises(
        ValueError, match=r"on_error=...\): expected one of 'raise', 'log', 'disable', got 'x'"
    ):
        TrackerService(tracker, run, on_error="x")  # type: ignore[arg-type]


async def test_flush_sends_now(tmp_path: Path) -> None:
    tracker = FaultyTracker(tmp_path)
    service = _service(tracker, tmp_path, flush_interval=3600)  # would otherwise wait an hour
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        for step in range(10):
            await service.put(_record(step))
        with anyio.fail_after(10):
            await service.flush()
        assert _delivered(tracker) == list(range(10))
        assert service.stats()["batches"] == 1
        service.set_status("ok")
        await service.aclose(anyio.current_time() + 10)


async def test_a_hurried_close_names_only_the_spill_files_it_wrote(tmp_path: Path) -> None:
    gate = threading.Event()
    tracker = FaultyTracker(tmp_path, gate=gate)
    service = _service(tracker, tmp_path)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(service.run)
            await service.put(_record(0))
            await anyio.to_thread.run_sync(tracker.entered.wait, 10)
            with pytest.raises(TimeoutError, match=r"1 in-flight records") as info:
                await service.aclose(anyio.current_time() + 0.2)
    finally:
        gate.set()
    assert [p.name.endswith(".inflight.jsonl") for p in service.spill_files] == [True]
    assert all(path.exists() for path in service.spill_files)
    assert str(service.spill_files[0]) in str(info.value) and "unsent" not in str(info.value)
    assert service.spill_path is None  # no file of unsent records was written


async def test_a_close_cut_short_hands_its_error_over_once_and_aclose_is_idempotent(
    tmp_path: Path,
) -> None:
    """A close cancelled mid-way (the bus cuts it on a second stop signal) spills what it
    holds but cannot raise; ``take_close_error`` hands over its error naming each file and
    the replay command, once; a later aclose returns quietly.  Replaying the files named
    puts each step in the run once."""
    gate = threading.Event()
    tracker = FaultyTracker(tmp_path, gate=gate)
    service = _service(tracker, tmp_path)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(service.run)
            await service.put(_record(0))
            await anyio.to_thread.run_sync(tracker.entered.wait, 10)
            await service.put(_record(1))  # buffered behind the hung call
            with anyio.move_on_after(0.2) as cut:
                await service.aclose(anyio.current_time() + 30)
            assert cut.cancelled_caught
            error = service.take_close_error()
            assert isinstance(error, TrackerError) and "the close was cut short" in str(error)
            assert service.take_close_error() is None  # handed over once
            await service.aclose(anyio.current_time() + 1)  # reported: quiet
            await service.aclose(anyio.current_time() + 1)
    finally:
        gate.set()
    files = sorted(service.spill_files)
    assert len(files) == 2
    for path in files:
        assert path.exists()
        assert f"python -m recis_async.trackers.replay {shlex.quote(str(path))}" in str(error)
    assert await anyio.to_thread.run_sync(lambda: _wait_delivered(tracker, [0]))
    for path in files:
        replay_file(path, root=tmp_path)
    assert sorted(_delivered(tracker)) == [0, 1]  # each once


def _wait_delivered(tracker: JsonlTracker, steps: list[int]) -> bool:
    """Wait (at most 10 s) until the abandoned call has written ``steps``."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if tracker.run_dir is not None and (tracker.run_dir / "metrics.jsonl").exists():
            if _delivered(tracker) == steps:
                return True
        time.sleep(0.02)
    return False


async def test_a_second_aclose_does_not_raise_the_first_ones_error_again(tmp_path: Path) -> None:
    """aclose is idempotent and reports a failure once: the first close raises that records
    were spilled (they found no room after a stop request), a second returns quietly; the
    spill file stays named in ``spill_files`` and replays each step once."""
    gate = threading.Event()
    tracker = FaultyTracker(tmp_path, gate=gate)
    service = _service(tracker, tmp_path, max_buffer_bytes=150)  # one record fits
    stop = anyio.Event()
    service.watch_stop(lambda: stop)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(service.run)
            await service.put(_record(0))
            await anyio.to_thread.run_sync(tracker.entered.wait, 10)
            stop.set()
            for step in range(1, 4):  # 1 kept for the close, 2 and 3 spilled at once
                await service.put(_record(step))
            gate.set()
            with pytest.raises(TrackerError, match="2 records found no room after the stop"):
                await service.aclose(anyio.current_time() + 10)
            await service.aclose(anyio.current_time() + 10)  # reported once: quiet
            assert service.take_close_error() is None
    finally:
        gate.set()
    assert _delivered(tracker) == [0, 1]
    (path,) = service.spill_files
    replay_file(path, root=tmp_path)
    assert sorted(_delivered(tracker)) == [0, 1, 2, 3]  # each once
