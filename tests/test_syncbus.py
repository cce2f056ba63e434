"""SyncHookBus: the HookBus's semantics from plain synchronous code, on asyncio and trio.

Each test is a plain ``def`` (no event loop of its own), as a user's training script is;
``backend`` picks the loop the bus runs inside.  The asyncio runs use asyncio's debug mode,
which raises on a loop call from the wrong thread or outside the loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pyarrow.dataset as ds
import pytest
import sniffio
from terminal import Terminal
from toy import ServiceFailsAfterFirstStep

from recis_async import (
    Hook,
    HookBus,
    HookError,
    Priority,
    SyncHookBus,
    add_metric,
    add_to_ml_tracker,
    add_to_trace,
)
from recis_async.events import AfterStep, BeforeStep, End, Error, Event, Start
from recis_async.hooks import MLTrackerHook, TraceHook
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker, read_records

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["asyncio", "trio"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def sync_bus(backend: str, **kwargs: Any) -> SyncHookBus:
    options = {"debug": True} if backend == "asyncio" else {}
    return SyncHookBus(backend=backend, backend_options=options, **kwargs)


class Recorder(Hook):
    """Records every event it gets, with the step's collected values."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def start(self, event: Start) -> None:
        self.log.append("Start")

    def before_step(self, event: BeforeStep) -> None:
        self.log.append(("BeforeStep", event.global_step))

    async def after_step(self, event: AfterStep) -> None:
        await anyio.sleep(0.001)  # a coroutine hook that really waits on the loop
        self.log.append(("AfterStep", event.global_step, dict(event.metrics)))

    def error(self, event: Error) -> None:
        self.log.append(("Error", event.exc_type))

    def end(self, event: End) -> None:
        self.log.append(("End", event.status))


def test_events_reach_hooks_in_order_with_collected_values(backend: str) -> None:
    log: list[Any] = []
    with sync_bus(backend) as bus:
        bus.add_hook(Recorder(log))
        bus.publish(Start())
        for step in range(3):
            bus.publish(BeforeStep(global_step=step))
            add_metric("loss", float(step))
            bus.publish(AfterStep(global_step=step, samples=4))
        assert log[-1] == ("AfterStep", 2, {"loss": 2.0})  # publish returned after it ran
    assert log == [
        "Start",
        *[x for s in range(3) for x in (("BeforeStep", s), ("AfterStep", s, {"loss": float(s)}))],
        ("End", "ok"),
    ]


def test_an_unreceived_before_step_still_begins_the_step(backend: str) -> None:
    """With no ``BeforeStep`` subscriber its publish does only the bus's part: values of the
    other kind of step are dropped, and a failure waiting at the boundary is still raised."""
    seen: list[tuple[bool, dict[str, Any]]] = []
    with sync_bus(backend) as bus:
        bus.subscribe(AfterStep, lambda e: seen.append((e.is_train, dict(e.metrics))))
        assert not bus.has_subscribers(BeforeStep)
        bus.publish(BeforeStep(global_step=0))
        bus.publish(AfterStep(global_step=0))
        add_metric("late_train", 1.0)  # collected after the training step ended
        bus.publish(BeforeStep(is_train=False))
        add_metric("eval_loss", 2.0)
        bus.publish(AfterStep(is_train=False))
        bus.add_hook(ServiceFailsAfterFirstStep())  # its service fails during this AfterStep
        bus.publish(AfterStep(global_step=0))
        with pytest.raises(HookError, match="the disk is full"):
            bus.publish(BeforeStep(global_step=2))
    assert seen == [(True, {}), (False, {"eval_loss": 2.0}), (True, {})]


def test_filters_priorities_and_async_subscribers(backend: str) -> None:
    calls: list[str] = []
    with sync_bus(backend) as bus:

        @bus.on(AfterStep, every=2)
        def every_second(ev: AfterStep) -> None:
            calls.append(f"every2@{ev.global_step}")

        @bus.on(AfterStep, priority=Priority.HIGHEST)
        async def first(ev: AfterStep) -> None:
            await anyio.sleep(0)
            calls.append(f"first@{ev.global_step}")

        handle = bus.subscribe(AfterStep, lambda ev: calls.append(f"last@{ev.global_step}"))
        bus.on(AfterStep, when=lambda ev: ev.global_step == 3)(
            lambda ev: calls.append(f"when@{ev.global_step}")
        )
        for step in range(4):
            bus.publish(AfterStep(global_step=step))
            if step == 1:
                handle.remove()
    assert calls == [
        "first@0",
        "last@0",
        "first@1",
        "every2@1",
        "last@1",
        "first@2",
        "first@3",
        "every2@3",
        "when@3",
    ]


def test_on_error_raise_log_and_disable(backend: str) -> None:
    calls: Counter[str] = Counter()

    def failing(name: str) -> Any:
        def fn(ev: Event) -> None:
            calls[name] += 1
            raise ValueError(name)

        return fn

    with sync_bus(backend) as bus:
        bus.subscribe(AfterStep, failing("raise"), on_error="raise")
        bus.subscribe(BeforeStep, failing("log"), on_error="log")
        bus.subscribe(BeforeStep, failing("disable"), on_error="disable")
        with pytest.raises(HookError, match="failed on AfterStep: ValueError: raise") as info:
            bus.publish(AfterStep(global_step=0))
        assert isinstance(info.value.__cause__, ValueError)
        for step in range(3):  # the bus stays usable; "log" runs on, "disable" once
            bus.publish(BeforeStep(global_step=step))
    assert calls == {"raise": 1, "log": 3, "disable": 1}


def test_end_once_even_when_published_by_hand(backend: str) -> None:
    log: list[Any] = []
    with sync_bus(backend) as bus:
        bus.add_hook(Recorder(log))
        bus.publish(End(status="ok"))
        with pytest.raises(RuntimeError, match="End was already published"):
            bus.publish(BeforeStep(global_step=0))
    assert log == [("End", "ok")]


def test_the_bodys_exception_propagates_after_error_and_end(backend: str) -> None:
    log: list[Any] = []
    with pytest.raises(KeyError, match="boom"):
        with sync_bus(backend) as bus:
            bus.add_hook(Recorder(log))
            bus.publish(BeforeStep(global_step=0))
            raise KeyError("boom")
    assert log == [("BeforeStep", 0), ("Error", "KeyError"), ("End", "failed")]


def test_a_failing_end_subscriber_surfaces_on_leaving(backend: str) -> None:
    def broken(ev: End) -> None:
        raise OSError("disk gone")

    with pytest.raises(HookError, match="broken failed on End: OSError: disk gone"):
        with sync_bus(backend) as bus:
            bus.subscribe(End, broken)


def test_close_drains_the_trace_writer_and_the_tracker(backend: str, tmp_path: Path) -> None:
    steps, rows = 40, 16
    with sync_bus(backend, flush_timeout=30) as bus:
        bus.add_hook(
            TraceHook(
                ParquetSink(tmp_path, "t", rank=0),
                ["id", "tag"],
                ["bigint", "string"],
                worker_num=2,
                size_threshold=2048,  # many small batches: some sent mid-run, some at close
            )
        )
        bus.add_hook(MLTrackerHook("p", "run", tracker=JsonlTracker(tmp_path / "ml")))
        bus.publish(Start())
        for step in range(steps):
            bus.publish(BeforeStep(global_step=step))
            add_to_trace("id", np.arange(step * rows, (step + 1) * rows))
            add_to_trace("tag", [f"s{step}"] * rows)
            add_to_ml_tracker("x", float(step))
            bus.publish(AfterStep(global_step=step, samples=rows))
    ids = ds.dataset(tmp_path / "t", format="parquet").to_table()["id"].to_pylist()
    assert sorted(ids) == list(range(steps * rows))  # every row, once
    (store,) = (tmp_path / "ml").rglob("metrics.jsonl")
    records = read_records(store)
    assert sorted(r.step for r in records) == list(range(steps))
    assert [r.values["x"] for r in sorted(records, key=lambda r: r.step)] == [
        float(s) for s in range(steps)
    ]


def test_a_hook_stop_request_and_request_stop(backend: str) -> None:
    with sync_bus(backend) as bus:
        bus.subscribe(AfterStep, lambda ev: bus.hook_bus.request_stop("enough"), once=2)
        done = 0
        for step in range(10):
            bus.publish(AfterStep(global_step=step))
            done += 1
            if bus.should_stop:
                break
        assert done == 2 and bus.stop_reason == "enough"
        bus.request_stop("again")  # the first reason is kept
        assert bus.stop_reason == "enough"
        assert bus.hook_bus.stopping.is_set()


def test_a_subscriber_publishing_nested(backend: str) -> None:
    class Ping(Event):
        pass

    class Pong(Event):
        pass

    got: list[str] = []
    with sync_bus(backend) as bus:
        bus.subscribe(Ping, lambda ev: bus.publish(Pong()))  # sync subscribers of Pong: fine
        bus.subscribe(Pong, lambda ev: got.append("pong"))
        bus.publish(Ping())
        assert got == ["pong"]

        class Later(Event):
            pass

        async def after_a_wait(ev: Later) -> None:  # then in the loop, not in the caller
            await anyio.sleep(0.001)
            bus.publish(Pong())

        bus.subscribe(Later, after_a_wait)
        bus.publish(Later())
        assert got == ["pong", "pong"]

        class Slow(Event):
            pass

        async def waits(ev: Slow) -> None:
            await anyio.sleep(0.001)

        bus.subscribe(Slow, waits)
        bus.subscribe(Pong, lambda ev: bus.publish(Slow()))
        with pytest.raises(HookError, match="a coroutine subscriber of it had to wait"):
            bus.publish(Pong())


_where: contextvars.ContextVar[str] = contextvars.ContextVar("where", default="unset")


def test_subscribers_see_the_loop_and_one_context_whether_or_not_they_wait(backend: str) -> None:
    """A publish runs in the caller until a subscriber waits, then in the loop: subscribers
    see the bus's loop either way (anyio, sniffio), and one context, whose variables hold
    across a coroutine subscriber's wait and from one publish to the next."""
    seen: list[Any] = []

    class Step(Event):
        wait: bool = False

    with sync_bus(backend) as bus:

        @bus.on(Step)
        def plain(ev: Step) -> None:
            seen.append((sniffio.current_async_library(), anyio.current_time() > 0))
            seen.append(("before", _where.get()))

        @bus.on(Step)
        async def maybe_waits(ev: Step) -> None:
            token = _where.set(f"set at {ev.wait}")
            if ev.wait:
                await anyio.sleep(0.001)
            seen.append(("after", _where.get()))
            _where.reset(token)  # a token of the same context, wait or not
            _where.set(f"left at {ev.wait}")

        bus.publish(Step())
        bus.publish(Step(wait=True))
        bus.publish(Step())
    assert _where.get() == "unset"  # the caller's own context is not the subscribers'
    assert seen == [
        (backend, True),
        ("before", "unset"),
        ("after", "set at False"),
        (backend, True),
        ("before", "left at False"),
        ("after", "set at True"),
        (backend, True),
        ("before", "left at True"),
        ("after", "set at False"),
    ]


def test_failures_before_and_after_a_wait_leave_the_bus_usable(backend: str) -> None:
    class Step(Event):
        fail: str = ""

    calls: list[str] = []
    with sync_bus(backend) as bus:

        @bus.on(Step)
        async def sometimes(ev: Step) -> None:
            if ev.fail == "waited":
                await anyio.sleep(0.001)
            if ev.fail:
                raise ValueError(ev.fail)
            calls.append("ok")

        for how in ("", "at once", "", "waited", "", "at once", "waited", ""):
            if how:
                with pytest.raises(HookError, match=f"ValueError: {how}"):
                    bus.publish(Step(fail=how))
            else:
                bus.publish(Step())
    assert calls == ["ok"] * 4


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_a_subscribers_keyboard_interrupt_or_system_exit_ends_the_run(
    backend: str, raised: type[BaseException]
) -> None:
    """Raised by a plain subscriber (in the caller) or by one that waited (in the loop): the
    body ends with it, ``Error`` and ``End`` are published, and it propagates."""
    for wait in (False, True):
        log: list[Any] = []

        async def interrupts(ev: BeforeStep, wait: bool = wait) -> None:
            if wait:
                await anyio.sleep(0.001)
            if ev.global_step == 1:
                raise raised()

        with pytest.raises(raised):
            with sync_bus(backend) as bus:
                bus.add_hook(Recorder(log))
                bus.subscribe(BeforeStep, interrupts)
                for step in range(3):
                    bus.publish(BeforeStep(global_step=step))
                log.append("not reached")
        assert log == [
            ("BeforeStep", 0),
            ("BeforeStep", 1),
            ("Error", raised.__name__),
            ("End", "failed"),
        ]
        with pytest.raises(RuntimeError, match="it is closed"):
            bus.publish(BeforeStep(global_step=3))


def test_a_subscriber_adds_a_hook_or_requests_a_stop_but_cannot_close(backend: str) -> None:
    log: list[Any] = []
    with sync_bus(backend) as bus:

        @bus.on(BeforeStep, when=lambda ev: ev.global_step == 0)
        def adds(ev: BeforeStep) -> None:
            bus.add_hook(Recorder(log))  # it gets the next events

        @bus.on(BeforeStep, priority=Priority.LOWEST, when=lambda ev: ev.global_step == 1)
        def closes(ev: BeforeStep) -> None:
            bus.close()

        @bus.on(BeforeStep, when=lambda ev: ev.global_step == 2)
        def stops(ev: BeforeStep) -> None:
            bus.request_stop("from a subscriber")

        bus.publish(BeforeStep(global_step=0))
        with pytest.raises(HookError, match="closing from inside a subscriber"):
            bus.publish(BeforeStep(global_step=1))
        bus.publish(BeforeStep(global_step=2))
        assert bus.should_stop and bus.stop_reason == "from a subscriber"
    assert log == [("BeforeStep", 1), ("BeforeStep", 2), ("End", "ok")]


def test_another_event_loop_runs_before_after_or_beside_the_block(backend: str) -> None:
    """In a plain script the bus's loop is the thread's running loop for the whole block (so
    ``asyncio.run`` there is refused, as documented); before and after the block, and in
    another thread, other event loops run as usual."""
    assert asyncio.run(asyncio.sleep(0, "before")) == "before"
    with sync_bus(backend) as bus:
        bus.publish(BeforeStep(global_step=0))
        if backend == "asyncio":
            coro = asyncio.sleep(0)
            with pytest.raises(RuntimeError, match="cannot be called from a running event loop"):
                asyncio.run(coro)
            coro.close()
        result: list[str] = []
        thread = threading.Thread(target=lambda: result.append(asyncio.run(asyncio.sleep(0, "t"))))
        thread.start()
        thread.join()
        assert result == ["t"]
        bus.publish(AfterStep(global_step=0))
    with pytest.raises(RuntimeError, match="no running event loop"):
        asyncio.get_running_loop()
    assert sniffio_library() is None
    assert anyio.run(anyio.sleep, 0, backend=backend) is None


def sniffio_library() -> str | None:
    try:
        return sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None


def test_misuse_gets_a_clear_error(backend: str) -> None:
    bus = sync_bus(backend)
    with pytest.raises(RuntimeError, match=r"publish\(\) needs the bus open, and it is new"):
        bus.publish(Start())
    with bus:
        with pytest.raises(TypeError, match="expected an Event instance, got str"):
            bus.publish("Start")  # type: ignore[arg-type]
        errors: list[BaseException] = []

        def elsewhere() -> None:
            try:
                bus.publish(Start())
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        assert "a bus is used from the thread that entered it" in str(errors[0])
        with pytest.raises(RuntimeError, match="cannot be entered twice"):
            bus.__enter__()
    with pytest.raises(RuntimeError, match="it is closed"):
        bus.publish(Start())
    bus.close()  # idempotent
    with pytest.raises(ValueError, match="SyncHookBus\\(backend=...\\)"):
        SyncHookBus(backend="curio")


def test_open_and_close_without_a_with_block(backend: str) -> None:
    log: list[Any] = []
    bus = sync_bus(backend).open()
    bus.add_hook(Recorder(log))
    bus.publish(BeforeStep(global_step=0))
    bus.close()
    bus.close()
    assert log == [("BeforeStep", 0), ("End", "ok")]
    with pytest.raises(RuntimeError, match="no HookBus open"):
        add_metric("loss", 1.0)


@pytest.mark.parametrize(
    ("outer", "inner"), [("asyncio", "asyncio"), ("asyncio", "trio"), ("trio", "asyncio")]
)
def test_inside_an_async_caller_too(outer: str, inner: str) -> None:
    """Entered from code that runs an event loop of its own (a notebook cell, an async test):
    the bus's loop runs beside it, and the caller's loop is left as it was."""

    async def caller() -> list[Any]:
        mine = asyncio.get_running_loop() if outer == "asyncio" else None
        log: list[Any] = []
        with SyncHookBus(backend=inner) as bus:
            bus.add_hook(Recorder(log))
            bus.publish(BeforeStep(global_step=0))
            assert sniffio.current_async_library() == outer
            if mine is not None:
                assert asyncio.get_running_loop() is mine
            await anyio.sleep(0)
            add_metric("loss", 1.0)
            bus.publish(AfterStep(global_step=0))
        assert sniffio.current_async_library() == outer
        return log

    log = anyio.run(caller, backend=outer)
    assert log == [("BeforeStep", 0), ("AfterStep", 0, {"loss": 1.0}), ("End", "ok")]


@pytest.mark.parametrize(
    ("outer", "inner"), [("asyncio", "asyncio"), ("asyncio", "trio"), ("trio", "asyncio")]
)
def test_the_async_callers_cancellation_propagates_and_ends_the_run_cancelled(
    outer: str, inner: str
) -> None:
    """The caller's loop cancels the code around the block: the bus ends with
    ``End(status="cancelled")`` (no ``Error``), as a HookBus's body cancelled, whichever
    library's cancellation it is, and the cancellation goes on to the caller's scope (on
    asyncio in asyncio it was swallowed: the bus took it for its own)."""

    async def caller() -> tuple[list[Any], bool, bool]:
        log: list[Any] = []
        left_normally = False
        with anyio.CancelScope() as scope:
            with SyncHookBus(backend=inner, handle_signals=False) as bus:
                bus.add_hook(Recorder(log))
                bus.publish(BeforeStep(global_step=0))
                scope.cancel()
                await anyio.sleep(10)
            left_normally = True
        return log, left_normally, scope.cancelled_caught

    log, left_normally, caught = anyio.run(caller, backend=outer)
    assert log == [("BeforeStep", 0), ("End", "cancelled")]
    assert not left_normally and caught


def test_without_signal_handling_ctrl_c_is_a_plain_keyboard_interrupt(backend: str) -> None:
    """handle_signals=False: a SIGINT raises KeyboardInterrupt where the code is, as in any
    Python program (not a cancellation of the bus's loop seen at a later publish)."""
    log: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        with sync_bus(backend, handle_signals=False) as bus:
            bus.add_hook(Recorder(log))
            bus.publish(BeforeStep(global_step=0))
            signal.raise_signal(signal.SIGINT)
            log.append("not reached")
    assert log == [("BeforeStep", 0), ("Error", "KeyboardInterrupt"), ("End", "failed")]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_hooks_see_the_hook_bus(backend: str) -> None:
    seen: list[Any] = []

    class Attaching(Hook):
        def attach(self, bus: HookBus) -> None:
            seen.append(bus)

    with sync_bus(backend) as bus:
        bus.add_hook(Attaching())
    assert seen == [bus.hook_bus] and isinstance(seen[0], HookBus)


SCRIPT = """
import os, sys, time
import numpy as np
from recis_async import SyncHookBus, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink

out, backend = sys.argv[1], sys.argv[2]
published = open(os.path.join(out, "published.txt"), "a", buffering=1)
with SyncHookBus(flush_timeout=30, backend=backend) as bus:
    bus.add_hook(TraceHook(ParquetSink(out, "t", rank=0), ["id"], ["bigint"], size_threshold=1024))
    step = 0
    while True:
        bus.publish(BeforeStep(global_step=step))
        add_to_trace("id", np.arange(step * 8, step * 8 + 8))
        bus.publish(AfterStep(global_step=step, samples=8))
        published.write(f"{step}\\n")
        if step == 10:
            print("ready", flush=True)
        if bus.should_stop:
            break
        time.sleep(0.002)
        step += 1
"""


def _owed_rows_delivered(out: Path) -> None:
    published = [int(x) for x in (out / "published.txt").read_text().split()]
    assert published == list(range(len(published))) and len(published) > 10
    ids = ds.dataset(out / "t", format="parquet").to_table()["id"].to_pylist()
    assert sorted(ids) == list(range(len(published) * 8))


def test_ctrl_c_in_a_terminal_stops_gracefully(backend: str, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(tmp_path / "job.py"), str(tmp_path), backend]
    with Terminal(argv, env=env) as term:
        term.expect(b"ready")
        term.press(b"\x03")
        rc = term.wait()
    assert rc == 128 + signal.SIGINT, term.text
    assert term.text.count("SIGINT received: stopping at the next step boundary") == 1
    assert "Traceback" not in term.text, term.text
    _owed_rows_delivered(tmp_path)


def test_sigterm_stops_gracefully_and_the_process_exits(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(tmp_path / "job.py"), str(tmp_path), "asyncio"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr.decode()
    _owed_rows_delivered(tmp_path)


@pytest.mark.parametrize("ending", ["raise", "return"])
def test_a_bus_left_open_is_closed_when_the_program_ends(
    backend: str, ending: str, tmp_path: Path
) -> None:
    """A program that opened a bus with ``open()`` and ended without ``close()`` -- dead of an
    exception, or at its end -- still exits, and its hooks deliver: the bus is closed as the
    interpreter ends (``End``: failed, with the program's exception, or ok), with a warning
    saying so.  It used to wait forever at exit on the worker thread the suspended loop never
    stopped (asyncio), a SIGTERM included; on trio it exited with the buffered rows lost."""
    script = ROOT / "tests" / "scripts" / "left_open.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), backend, ending],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == (1 if ending == "raise" else 0), done.stderr
    assert "SyncHookBus still open as the program ends" in done.stderr, done.stderr
    ids = ds.dataset(tmp_path / "t", format="parquet").to_table()["id"].to_pylist()
    assert Counter(ids) == Counter(range(20))
    (run,) = (tmp_path / "ml").rglob("run.json")
    status = "failed" if ending == "raise" else "ok"
    assert json.loads(run.read_text())["status"] == status
    (metrics,) = (tmp_path / "ml").rglob("metrics.jsonl")
    assert len(metrics.read_text().splitlines()) == 5
    assert not (tmp_path / "spill").exists() or not list((tmp_path / "spill").iterdir())
