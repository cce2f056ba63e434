"""A step waiting for room in a full tracker buffer (``TrackerService.put``, through
``MLTrackerHook``) does not wait past a stop request: a real SIGINT, or a stop requested while
it waits, ends the wait at once, and the record is kept for the close, which delivers it if the
tracker catches up by ``flush_timeout`` and spills it if not; a loop that runs on after its stop
has its further records spilled at once, with the reason.  The tracker is a real JsonlTracker
whose ``log`` waits on a gate (a tracker that hangs until set); every record is counted back
from its ``metrics.jsonl`` and the spill files, after replaying those, once each."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from recis_async import HookBus, HookError, SyncHookBus
from recis_async.events import AfterStep
from recis_async.hooks import MLTrackerHook
from recis_async.trackers import JsonlTracker, StepRecord, read_records
from recis_async.trackers.replay import replay_file

# A record {"loss": float} counts 116 bytes: one fits, a second finds no room; after a stop,
# records are kept up to twice this (the one in flight and one more), the rest are spilled.
BUFFER = 150


class GatedJsonl(JsonlTracker):
    """A real JsonlTracker whose ``log`` first waits for ``gate``: a tracker that hangs until
    set (at most ``hang`` seconds, a bound on the test)."""

    def __init__(self, root: Path, gate: threading.Event, hang: float = 30.0) -> None:
        super().__init__(root)
        self.gate = gate
        self.hang = hang
        self.entered = threading.Event()  # a log call is waiting at the gate
        self.left = threading.Event()  # a log call has written and returned

    def log(self, records: Sequence[StepRecord]) -> None:
        self.entered.set()
        self.gate.wait(self.hang)
        super().log(records)
        self.left.set()


def gated_hook(tmp_path: Path, gate: threading.Event, hang: float = 30.0) -> MLTrackerHook:
    return MLTrackerHook(
        "p",
        "stop",
        tracker=GatedJsonl(tmp_path / "runs", gate, hang),
        max_buffer_bytes=BUFFER,
        flush_interval=0,
        spill_dir=tmp_path / "spill",
    )


def gated_tracker(hook: MLTrackerHook) -> GatedJsonl:
    tracker = hook.tracker
    assert isinstance(tracker, GatedJsonl)
    return tracker


async def step(bus: HookBus, n: int) -> float:
    """Publish a training step tracking ``loss``; return how long its AfterStep took."""
    t = time.monotonic()
    await bus.publish(AfterStep(global_step=n, tracked={"loss": float(n)}))
    return time.monotonic() - t


def logged_steps(hook: MLTrackerHook) -> list[int]:
    run_dir = hook.tracker.run_dir  # type: ignore[attr-defined]
    if run_dir is None:  # finished: the folder is still where it was
        run_dir = next((hook.tracker.root / "p").iterdir())  # type: ignore[attr-defined]
    return [r.step for r in read_records(run_dir / "metrics.jsonl")]


def spill_files(tmp_path: Path) -> list[Path]:
    """The spill files, records whose delivery is unknown (``.inflight``) first."""
    files = sorted((tmp_path / "spill").glob("*.jsonl"))
    return sorted(files, key=lambda p: not p.name.endswith(".inflight.jsonl"))


def spilled_steps(tmp_path: Path) -> list[int]:
    return [r.step for path in spill_files(tmp_path) for r in read_records(path)]


async def wait_in_flight(tracker: GatedJsonl) -> None:
    """Let the service take the first record into a log call (waiting at the gate)."""
    with anyio.fail_after(10):
        while not tracker.entered.is_set():
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_ctrl_c_while_the_tracker_is_slow_spills_nothing(tmp_path: Path) -> None:
    """A real SIGINT while the tracker is busy (step 0 in its log call), then a step whose
    record finds the buffer full: the stop ends that wait at once, but says nothing about the
    tracker, so the record is kept for the close, which delivers it once the tracker catches
    up.  (It waited for the tracker: up to SubprocessTracker's 300 s call bound.)"""
    gate = threading.Event()
    hook = gated_hook(tmp_path, gate)
    tracker = gated_tracker(hook)
    try:
        with pytest.raises(SystemExit) as exit_, anyio.fail_after(20):
            async with HookBus(flush_timeout=5) as bus:
                bus.add_hook(hook)
                await step(bus, 0)
                await wait_in_flight(tracker)
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, between two steps
                took = await step(bus, 1)  # no room: step 0's record is still in flight
                assert bus.should_stop
                assert not gate.is_set()  # the publish returned with the tracker still busy
                assert took < 5
                assert hook.service is not None
                stats = hook.service.stats()
                assert (stats["kept_at_stop"], stats["queued_records"], stats["spilled"]) == (
                    1,
                    2,
                    0,
                )
                gate.set()  # the slow call ends; the close delivers the rest
    finally:
        gate.set()
    assert exit_.value.code == 128 + signal.SIGINT
    assert logged_steps(hook) == [0, 1]  # each once
    assert spill_files(tmp_path) == []


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_while_the_tracker_is_slow_spills_nothing_on_the_sync_bus(
    tmp_path: Path, backend: str
) -> None:
    """The same through a SyncHookBus, as the framework adapters publish."""
    gate = threading.Event()
    hook = gated_hook(tmp_path, gate, hang=10)  # the bound on a publish that would wait
    with pytest.raises(SystemExit) as exit_:
        with SyncHookBus(flush_timeout=10, backend=backend) as bus:
            bus.add_hook(hook)
            bus.publish(AfterStep(global_step=0, tracked={"loss": 0.0}))
            signal.raise_signal(signal.SIGINT)
            t = time.monotonic()
            bus.publish(AfterStep(global_step=1, tracked={"loss": 1.0}))  # no room
            took = time.monotonic() - t
            assert bus.should_stop and not gate.is_set()
            assert took < 5
            assert hook.service is not None
            stats = hook.service.stats()
            assert (stats["kept_at_stop"], stats["spilled"]) == (1, 0)
            gate.set()
    assert exit_.value.code == 128 + signal.SIGINT
    assert logged_steps(hook) == [0, 1]
    assert spill_files(tmp_path) == []


@pytest.mark.anyio
async def test_a_stop_signal_ends_the_wait_for_room_at_once(tmp_path: Path) -> None:
    """A step already waiting for room when SIGINT arrives returns at once; the tracker never
    catches up by the close deadline, so its records are spilled -- the one in flight apart
    (its delivery unknown) -- and a replay settles both files: each step in the run once."""
    gate = threading.Event()
    hook = gated_hook(tmp_path, gate)
    tracker = gated_tracker(hook)
    try:
        with pytest.raises(SystemExit) as exit_, anyio.fail_after(20):
            async with HookBus(flush_timeout=1) as bus:
                bus.add_hook(hook)
                await step(bus, 0)
                await wait_in_flight(tracker)

                async def ctrl_c_soon() -> None:
                    await anyio.sleep(0.3)
                    os.kill(os.getpid(), signal.SIGINT)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(ctrl_c_soon)
                    took = await step(bus, 1)  # no room: waits until the signal
                assert bus.should_stop
                assert 0.2 < took < 5
        assert exit_.value.code == 128 + signal.SIGINT
        assert logged_steps(hook) == []  # the tracker never answered during the run
        assert [p.name.endswith(".inflight.jsonl") for p in spill_files(tmp_path)] == [True, False]
        assert spilled_steps(tmp_path) == [0, 1]  # step 0 in doubt, step 1 unsent
    finally:
        gate.set()
    assert tracker.left.wait(10)  # the abandoned call ends: step 0 did land after all
    assert logged_steps(hook) == [0]
    # the sidecar names the test's subclass, not JsonlTracker: name the JSONL root
    settled = [replay_file(path, root=tracker.root) for path in spill_files(tmp_path)]
    assert [(r.records, r.already, r.delivered) for r in settled] == [(1, 1, 0), (1, 0, 1)]
    assert logged_steps(hook) == [0, 1]  # each once


@pytest.mark.anyio
async def test_a_loop_running_on_after_its_stop_keeps_at_most_twice_the_buffer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Records kept for the close after a stop are bounded: a loop that runs on (ignoring
    ``should_stop``) while the tracker hangs has its further records spilled at once, with the
    reason, and the close says so; every record is delivered or spilled once."""
    gate = threading.Event()
    caplog.set_level(logging.INFO)
    hook = gated_hook(tmp_path, gate)
    tracker = gated_tracker(hook)
    try:
        with pytest.raises(HookError, match="found no room after the stop") as error:
            with anyio.fail_after(20):
                async with HookBus(flush_timeout=0.5, handle_signals=False) as bus:
                    bus.add_hook(hook)
                    await step(bus, 0)
                    await wait_in_flight(tracker)
                    bus.request_stop("test")
                    for n in range(1, 6):
                        assert await step(bus, n) < 5  # never waits for the hung tracker
                    assert hook.service is not None
                    stats = hook.service.stats()
                    assert (stats["kept_at_stop"], stats["spilled_no_room"]) == (1, 4)
                    assert stats["queued_bytes"] <= 2 * BUFFER
        assert "4 records found no room" in str(error.value)
        assert "python -m recis_async.trackers.replay" in str(error.value)
        assert sorted(spilled_steps(tmp_path)) == [0, 1, 2, 3, 4, 5]  # 0 in doubt, 1 unsent
    finally:
        gate.set()
    assert "the record of step 2 is spilled instead of buffered: a stop was requested" in (
        caplog.text
    )
    assert tracker.left.wait(10)
    for path in spill_files(tmp_path):
        replay_file(path, root=tracker.root)
    assert sorted(logged_steps(hook)) == [0, 1, 2, 3, 4, 5]  # each once


@pytest.mark.usefixtures("either_bus")  # on HookBus and on SyncHookBus
@pytest.mark.anyio
async def test_a_hung_tracker_holds_a_step_at_most_send_timeout_then_its_record_is_spilled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No stop request: a step whose record finds the buffer full while the tracker hangs
    waits ``send_timeout`` seconds, not as long as the tracker's call (300 s for a
    SubprocessTracker, forever in process); its record is then spilled with the reason, the
    close raises naming the file and the replay command, and after that replay every step is
    in the run once."""
    gate = threading.Event()
    hook = MLTrackerHook(
        "p",
        "stop",
        tracker=GatedJsonl(tmp_path / "runs", gate, hang=15),
        max_buffer_bytes=BUFFER,
        flush_interval=0,
        spill_dir=tmp_path / "spill",
        send_timeout=0.3,
    )
    tracker = gated_tracker(hook)
    try:
        with pytest.raises(HookError, match="waited send_timeout=0.3s for room") as error:
            with anyio.fail_after(30):
                async with HookBus(flush_timeout=10, handle_signals=False) as bus:
                    bus.add_hook(hook)
                    await step(bus, 0)
                    for n in (1, 2):  # no room: step 0's record waits for the hung tracker
                        assert 0.25 < await step(bus, n) < 5
                    assert tracker.entered.is_set()  # in the hung call (a sync bus's loop
                    # runs during its publishes only: no waiting for it in between)
                    assert not gate.is_set() and not bus.should_stop
                    assert hook.service is not None
                    stats = hook.service.stats()
                    assert (stats["spilled_send_timeout"], stats["spilled"]) == (2, 2)
                    gate.set()  # the tracker catches up: the next steps go through
                    for n in (3, 4):
                        await step(bus, n)
    finally:
        gate.set()
    assert "the record of step 1 is spilled instead of buffered: waited send_timeout" in (
        caplog.text
    )
    (path,) = spill_files(tmp_path)
    assert spilled_steps(tmp_path) == [1, 2]
    text = str(error.value)
    assert "2 records waited send_timeout=0.3s" in text
    assert f"spilled to {path}: replay them with python -m recis_async.trackers.replay" in text
    assert sorted(logged_steps(hook)) == [0, 3, 4]
    replay_file(path, root=tracker.root)  # the sidecar names the test's subclass
    assert sorted(logged_steps(hook)) == [0, 1, 2, 3, 4]  # each once


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_send_timeout_bounds_a_sync_bus_publish_too(tmp_path: Path, backend: str) -> None:
    """The same through a SyncHookBus's own loop on each backend, as the adapters publish."""
    gate = threading.Event()
    hook = MLTrackerHook(
        "p",
        "stop",
        tracker=GatedJsonl(tmp_path / "runs", gate, hang=15),
        max_buffer_bytes=BUFFER,
        flush_interval=0,
        spill_dir=tmp_path / "spill",
        send_timeout=0.3,
    )
    tracker = gated_tracker(hook)
    try:
        with pytest.raises(HookError, match="1 records waited send_timeout=0.3s"):
            with SyncHookBus(flush_timeout=10, backend=backend, handle_signals=False) as bus:
                bus.add_hook(hook)
                bus.publish(AfterStep(global_step=0, tracked={"loss": 0.0}))
                t = time.monotonic()
                bus.publish(AfterStep(global_step=1, tracked={"loss": 1.0}))  # no room
                assert 0.25 < time.monotonic() - t < 5
                assert tracker.entered.is_set()
                gate.set()
                bus.publish(AfterStep(global_step=2, tracked={"loss": 2.0}))
    finally:
        gate.set()
    (path,) = spill_files(tmp_path)
    replay_file(path, root=tracker.root)
    assert sorted(logged_steps(hook)) == [0, 1, 2]  # each once


@pytest.mark.parametrize(
    ("value", "error"),
    [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), ("60", TypeError)],
)
def test_send_timeout_is_checked_at_the_constructor(
    tmp_path: Path, value: object, error: type[Exception]
) -> None:
    from recis_async.hooks import SummarySaverHook
    from recis_async.trackers import RunSpec, TrackerService

    with pytest.raises(error, match=r"MLTrackerHook\(send_timeout=\.\.\.\): expected"):
        MLTrackerHook("p", "r", tracker=JsonlTracker(tmp_path), send_timeout=value)  # type: ignore[arg-type]
    with pytest.raises(error, match=r"SummarySaverHook\(send_timeout=\.\.\.\): expected"):
        SummarySaverHook(1, tmp_path / "tb", send_timeout=value)  # type: ignore[arg-type]
    with pytest.raises(error, match=r"TrackerService\(send_timeout=\.\.\.\): expected"):
        TrackerService(
            JsonlTracker(tmp_path),
            RunSpec(project="p", name="r"),
            send_timeout=value,  # type: ignore[arg-type]
        )  # type: ignore[arg-type]
