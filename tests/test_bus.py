from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pyarrow.parquet as pq
import pytest

from recis_async import Hook, HookBus, HookError, Priority, add_to_trace
from recis_async.events import AfterStep, BeforeStep, End, Error, Event, Start
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink

pytestmark = pytest.mark.anyio


class Custom(Event, frozen=True, kw_only=True):
    n: int = 0


class CustomChild(Custom, frozen=True, kw_only=True):
    pass


async def test_priority_then_registration_order() -> None:
    seen: list[str] = []
    async with HookBus() as bus:
        bus.subscribe(Start, lambda e: seen.append("normal-1"))
        bus.subscribe(Start, lambda e: seen.append("low"), priority=Priority.LOW)
        bus.subscribe(Start, lambda e: seen.append("highest"), priority="HIGHEST")
        bus.subscribe(Start, lambda e: seen.append("normal-2"))
        bus.subscribe(Start, lambda e: seen.append("int-45"), priority=45)
        await bus.publish(Start())
    assert seen == ["highest", "int-45", "normal-1", "normal-2", "low"]


async def test_sync_and_async_subscribers_and_decorator() -> None:
    seen: list[tuple[str, int]] = []
    async with HookBus() as bus:

        @bus.on(Custom)
        async def coro(event: Custom) -> None:
            await anyio.lowlevel.checkpoint()
            seen.append(("async", event.n))

        @bus.on(Custom)
        def plain(event: Custom) -> None:
            seen.append(("sync", event.n))

        await bus.publish(Custom(n=1))
        assert coro.__name__ == "coro"  # the decorator returns the function unchanged
    assert seen == [("async", 1), ("sync", 1)]


async def test_publish_returns_after_every_subscriber_ran() -> None:
    done: list[int] = []
    async with HookBus() as bus:

        async def slow(event: Custom) -> None:
            await anyio.sleep(0.01)
            done.append(event.n)

        bus.subscribe(Custom, slow)
        await bus.publish(Custom(n=5))
        assert done == [5]


async def test_base_class_subscription_receives_subclasses() -> None:
    seen: list[str] = []
    async with HookBus() as bus:
        bus.subscribe(Event, lambda e: seen.append(type(e).__name__))
        bus.subscribe(Custom, lambda e: seen.append("custom:" + type(e).__name__))
        await bus.publish(CustomChild(n=1))
        await bus.publish(Start())
    assert seen == ["CustomChild", "custom:CustomChild", "Start", "End"]


async def test_every_once_when_and_combination() -> None:
    every: list[int] = []
    once: list[int] = []
    when: list[int] = []
    both: list[int] = []
    async with HookBus() as bus:
        bus.subscribe(Custom, lambda e: every.append(e.n), every=3)
        bus.subscribe(Custom, lambda e: once.append(e.n), once=2)
        bus.subscribe(Custom, lambda e: when.append(e.n), when=lambda e: e.n % 2 == 0)
        bus.subscribe(Custom, lambda e: both.append(e.n), every=2, when=lambda e: e.n > 4)
        for n in range(1, 11):
            await bus.publish(Custom(n=n))
    assert every == [3, 6, 9]
    assert once == [2]
    assert when == [2, 4, 6, 8, 10]
    assert both == [6, 8, 10]


async def test_filters_count_per_subscriber_from_its_subscription() -> None:
    seen: list[int] = []
    async with HookBus() as bus:
        await bus.publish(Custom(n=1))
        bus.subscribe(Custom, lambda e: seen.append(e.n), every=2)
        for n in range(2, 6):
            await bus.publish(Custom(n=n))
    assert seen == [3, 5]


async def test_every_seconds_fires_first_then_at_most_once_per_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]  # the bus's clock, moved by hand: a loaded machine cannot stretch a window
    monkeypatch.setattr("recis_async.bus.perf_counter", lambda: clock[0])
    seen: list[int] = []
    async with HookBus() as bus:
        bus.subscribe(Custom, lambda e: seen.append(e.n), every_seconds=3600)
        for n in range(5):
            await bus.publish(Custom(n=n))
    assert seen == [0]

    seen.clear()
    async with HookBus() as bus:
        bus.subscribe(Custom, lambda e: seen.append(e.n), every_seconds=0.05)
        await bus.publish(Custom(n=0))
        clock[0] += 0.049
        await bus.publish(Custom(n=1))
        clock[0] += 0.002
        await bus.publish(Custom(n=2))
        clock[0] += 0.01
        await bus.publish(Custom(n=3))
    assert seen == [0, 2]


async def test_handle_remove_and_context_manager() -> None:
    seen: list[str] = []
    async with HookBus() as bus:
        handle = bus.subscribe(Custom, lambda e: seen.append("a"))
        with bus.subscribe(Custom, lambda e: seen.append("b")):
            await bus.publish(Custom())
        await bus.publish(Custom())
        handle.remove()
        handle.remove()  # idempotent
        await bus.publish(Custom())
    assert seen == ["a", "b", "a"]


async def test_subscriber_removed_during_dispatch_is_skipped() -> None:
    seen: list[str] = []
    async with HookBus() as bus:
        later = bus.subscribe(Custom, lambda e: seen.append("later"), priority=Priority.LOW)
        bus.subscribe(Custom, lambda e: later.remove(), priority=Priority.HIGH)
        await bus.publish(Custom())
    assert seen == []


async def test_has_subscribers_follows_subscriptions_of_a_type_and_its_bases() -> None:
    async with HookBus() as bus:
        assert not bus.has_subscribers(Custom) and not bus.has_subscribers(Start)
        with bus.subscribe(Event, lambda e: None):  # a base: every event type reaches it
            assert bus.has_subscribers(Custom) and bus.has_subscribers(Start)
        assert not bus.has_subscribers(Custom)
        once = bus.subscribe(Custom, lambda e: None, once=1)
        assert bus.has_subscribers(Custom) and not bus.has_subscribers(Start)
        await bus.publish(Custom())  # a once-subscriber removes itself
        assert not once.active and not bus.has_subscribers(Custom)


async def test_on_error_raise_names_subscriber_and_event() -> None:
    boom = KeyError("nope")

    def broken(event: Custom) -> None:
        raise boom

    after: list[int] = []
    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.subscribe(Custom, broken)
            bus.subscribe(Custom, lambda e: after.append(1), priority=Priority.LOW)
            await bus.publish(Custom())
    assert "broken" in str(info.value) and "Custom" in str(info.value)
    assert info.value.__cause__ is boom
    assert info.value.event == "Custom"
    assert after == []  # the failing publish stops there


async def test_on_error_log_counts_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []

    def broken(event: Custom) -> None:
        raise RuntimeError("flaky")

    async with HookBus() as bus:
        bus.subscribe(Custom, broken, on_error="log")
        bus.subscribe(Custom, lambda e: seen.append(e.n))
        with caplog.at_level(logging.ERROR, logger="recis_async.bus"):
            await bus.publish(Custom(n=1))
            await bus.publish(Custom(n=2))
        stats = bus.stats()["subscribers"]
    key = next(k for k in stats if "broken" in k)
    assert stats[key]["errors"] == 2
    assert seen == [1, 2]
    assert "flaky" in caplog.text


async def test_on_error_log_shows_three_tracebacks_then_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A subscriber failing on every step does not flood the log: the first 3 failures with
    their traceback, then one line at the 10th, 100th, ... and a count when the bus closes."""

    def broken(event: Custom) -> None:
        raise RuntimeError(f"flaky {event.n}")

    caplog.set_level(logging.INFO, logger="recis_async.bus")
    async with HookBus() as bus:
        bus.subscribe(Custom, broken, on_error="log")
        for n in range(1, 251):
            await bus.publish(Custom(n=n))
        assert bus.stats()["subscribers"][next(iter(bus.stats()["subscribers"]))]["errors"] == 250
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING]
    with_traceback = [r for r in logged if r.exc_info]
    assert [r.exc_info[1].args[0] for r in with_traceback] == ["flaky 1", "flaky 2", "flaky 3"]
    assert "logged at the 10th, 100th" in with_traceback[2].getMessage()
    counts = [r.getMessage() for r in logged if not r.exc_info]
    assert counts == [
        "test_on_error_log_shows_three_tracebacks_then_counts.<locals>.broken failed on Custom "
        "(on_error=log): 10 failures so far, the last RuntimeError: flaky 10",
        "test_on_error_log_shows_three_tracebacks_then_counts.<locals>.broken failed on Custom "
        "(on_error=log): 100 failures so far, the last RuntimeError: flaky 100",
        "test_on_error_log_shows_three_tracebacks_then_counts.<locals>.broken failed 250 times "
        "on Custom (on_error=log)",
    ]


async def test_on_error_disable_unsubscribes() -> None:
    calls: list[int] = []

    def broken(event: Custom) -> None:
        calls.append(event.n)
        raise RuntimeError("once is enough")

    async with HookBus() as bus:
        bus.subscribe(Custom, broken, on_error="disable")
        await bus.publish(Custom(n=1))
        await bus.publish(Custom(n=2))
        assert "broken" not in bus.describe()
    assert calls == [1]


async def test_body_exception_propagates_unchanged_and_end_failed() -> None:
    seen: list[Any] = []
    original = ZeroDivisionError("in the body")
    with pytest.raises(ZeroDivisionError) as info:
        async with HookBus() as bus:
            bus.subscribe(Error, lambda e: seen.append(("error", e.exc_type, e.message)))
            bus.subscribe(End, lambda e: seen.append(("end", e.status)))
            raise original
    assert info.value is original
    assert seen == [("error", "ZeroDivisionError", "in the body"), ("end", "failed")]


async def test_cancellation_publishes_end_cancelled_and_drains() -> None:
    seen: list[str] = []
    drained: list[bool] = []
    with anyio.move_on_after(0.05):
        async with HookBus() as bus:
            bus.subscribe(End, lambda e: seen.append(e.status))
            bus.start_service(_Recorder("svc", drained))
            await anyio.sleep(10)
    assert seen == ["cancelled"]
    assert drained == [True]


async def test_end_exactly_once_and_close_idempotent() -> None:
    seen: list[str] = []
    async with HookBus() as bus:
        bus.subscribe(End, lambda e: seen.append(e.status))
        await bus.publish(End(status="ok"))
        with pytest.raises(RuntimeError, match="End was already published"):
            await bus.publish(End())
        await bus.aclose()
        await bus.aclose()
        with pytest.raises(RuntimeError, match="publish"):
            await bus.publish(Start())
    assert seen == ["ok"]


async def test_a_step_published_after_a_manual_end_is_refused(tmp_path: Path) -> None:
    """Once End was published by hand, the trace writer has flushed: a step after it was
    taken silently and its rows were never written."""
    async with HookBus() as bus:
        bus.add_hook(TraceHook(ParquetSink(tmp_path, "t", rank=0), ["id"], ["bigint"]))
        await bus.publish(BeforeStep(global_step=0))
        add_to_trace("id", np.arange(4))
        await bus.publish(AfterStep(global_step=0))
        await bus.publish(End(status="ok"))
        with pytest.raises(
            RuntimeError, match=r"publish\(BeforeStep\): End was already published on this bus"
        ):
            await bus.publish(BeforeStep(global_step=1))
    table = pq.read_table(tmp_path / "t")
    assert table["id"].to_pylist() == [0, 1, 2, 3]


async def test_a_subscriber_that_publishes_its_own_event_fails_with_one_short_message() -> None:
    async with HookBus() as bus:

        async def again(event: BeforeStep) -> None:
            await bus.publish(event)

        bus.subscribe(BeforeStep, again)
        with pytest.raises(HookError) as caught:
            await bus.publish(BeforeStep(global_step=0))
    message = str(caught.value)
    assert len(message) < 400, message  # was 25 KB: the message once per level
    assert message.count("failed on BeforeStep") == 1
    assert "RecursionError" in message and "publish the event type it subscribes to" in message


async def test_end_reaches_every_subscriber_even_if_one_fails() -> None:
    seen: list[str] = []

    def broken(event: End) -> None:
        raise RuntimeError("end failed")

    with pytest.raises(HookError, match="end failed"):
        async with HookBus() as bus:
            bus.subscribe(End, broken, priority=Priority.HIGHEST)
            bus.subscribe(End, lambda e: seen.append(e.status))
    assert seen == ["ok"]


async def test_body_error_wins_over_close_errors(caplog: pytest.LogCaptureFixture) -> None:
    def broken(event: End) -> None:
        raise RuntimeError("end failed too")

    with caplog.at_level(logging.ERROR, logger="recis_async.bus"):
        with pytest.raises(ValueError, match="body"):
            async with HookBus() as bus:
                bus.subscribe(End, broken)
                raise ValueError("body")
    assert "end failed too" in caplog.text


async def test_request_stop() -> None:
    async with HookBus() as bus:
        assert not bus.should_stop
        bus.subscribe(AfterStep, lambda e: bus.request_stop("enough"), once=2)
        steps = 0
        for step in range(10):
            await bus.publish(AfterStep(global_step=step))
            steps += 1
            if bus.should_stop:
                break
        bus.request_stop("second reason is ignored")
        assert bus.stop_reason == "enough"
    assert steps == 2


async def test_stats_count_calls_and_time() -> None:
    async with HookBus() as bus:

        async def slow(event: Custom) -> None:
            await anyio.sleep(0.02)

        bus.subscribe(Custom, slow)
        for _ in range(3):
            await bus.publish(Custom())
        stats = bus.stats()["subscribers"]
    (entry,) = [v for k, v in stats.items() if "slow" in k]
    assert entry["calls"] == 3
    assert entry["errors"] == 0
    assert entry["total_s"] >= 0.06
    assert 0.02 <= entry["max_s"] <= entry["total_s"]


async def test_stats_count_a_call_that_raised_as_a_call() -> None:
    def broken(event: Custom) -> None:
        raise RuntimeError("always")

    async with HookBus() as bus:
        bus.subscribe(Custom, broken)  # on_error="raise"
        for _ in range(3):
            with pytest.raises(HookError):
                await bus.publish(Custom())
        stats = bus.stats()["subscribers"]
    (entry,) = [v for k, v in stats.items() if "broken" in k]
    assert (entry["calls"], entry["errors"]) == (3, 3)


async def test_a_publish_never_awaited_is_named_by_the_next_publish() -> None:
    seen: list[Event] = []
    async with HookBus() as bus:
        bus.subscribe(Event, seen.append)
        bus.publish(BeforeStep(global_step=7))  # type: ignore[unused-coroutine]
        with pytest.raises(
            RuntimeError,
            match=r"publish\(\): an earlier publish\(BeforeStep\) was never awaited, so it "
            r"delivered nothing \(BeforeStep\(is_train=True, global_step=7.*\); write "
            r"`await bus.publish\(event\)`",
        ):
            await bus.publish(AfterStep(global_step=7))
        await bus.publish(AfterStep(global_step=8))  # reported once, then publishing goes on
    assert [type(e).__name__ for e in seen] == ["AfterStep", "End"]


async def test_an_unreceived_before_step_never_awaited_is_named_too() -> None:
    """A ``BeforeStep`` nobody subscribes to is not published through the subscribers' loop
    (the bus only does its own part of it), but a missing ``await`` is still reported."""
    async with HookBus() as bus:
        assert not bus.has_subscribers(BeforeStep)
        bus.publish(BeforeStep(global_step=3))  # type: ignore[unused-coroutine]
        with pytest.raises(
            RuntimeError,
            match=r"an earlier publish\(BeforeStep\) was never awaited.*global_step=3",
        ):
            await bus.publish(AfterStep(global_step=3))


async def test_a_publish_never_awaited_before_leaving_the_bus_is_an_error() -> None:
    with pytest.raises(
        HookError,
        match=r"leaving the bus: an earlier publish\(Custom\) was never awaited",
    ) as info:
        async with HookBus() as bus:
            bus.publish(Custom(n=5))  # type: ignore[unused-coroutine]
    assert info.value.event == "Custom"


async def test_a_sync_subscriber_returning_a_coroutine_is_awaited() -> None:
    seen: list[int] = []

    async def record(event: Custom) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append(event.n)

    async with HookBus() as bus, HookBus(handle_signals=False) as other:
        bus.subscribe(Custom, lambda e: record(e))
        other.subscribe(Custom, record)
        bus.subscribe(Custom, other.publish)  # forwarding to another bus
        await bus.publish(Custom(n=1))
    assert seen == [1, 1]


async def test_describe_shows_effective_order() -> None:
    class Probe(Hook):
        priority = Priority.LOW

        def after_step(self, event: AfterStep) -> None:
            pass

    async with HookBus() as bus:
        bus.add_hook(Probe())
        bus.subscribe(Event, print, priority=Priority.HIGH)
        bus.subscribe(AfterStep, print, every=100)
        text = bus.describe()
    section = text[text.index("AfterStep:") :].splitlines()
    assert (
        "print" in section[1] and "HIGH(30)" in section[1] and "subscribed to Event" in section[1]
    )
    assert "every=100" in section[2]
    assert "Probe.after_step" in section[3] and "LOW(70)" in section[3]


class _Recorder:
    """A service that records whether it was drained."""

    def __init__(self, name: str, drained: list[bool], fail_run: bool = False) -> None:
        self.name = name
        self.drained = drained
        self.fail_run = fail_run
        self._stop = anyio.Event()

    async def run(self) -> None:
        if self.fail_run:
            await anyio.lowlevel.checkpoint()
            raise OSError("disk gone")
        await self._stop.wait()

    async def aclose(self, deadline: float) -> None:
        self.in_time = anyio.current_time() < deadline
        self._stop.set()
        self.drained.append(True)

    def stats(self) -> Mapping[str, Any]:
        return {"drained": bool(self.drained)}


async def test_services_close_in_reverse_order_shielded() -> None:
    order: list[str] = []

    class Svc(_Recorder):
        async def aclose(self, deadline: float) -> None:
            await anyio.sleep(0.01)  # needs the shield when closing after cancellation
            order.append(self.name)
            await super().aclose(deadline)

    with anyio.move_on_after(0.05):
        async with HookBus() as bus:
            bus.start_service(Svc("first", []))
            bus.start_service(Svc("second", []))
            assert bus.stats()["services"] == {
                "first": {"drained": False},
                "second": {"drained": False},
            }
            await anyio.sleep(10)
    assert order == ["second", "first"]


async def test_service_error_surfaces_at_next_publish() -> None:
    with pytest.raises(HookError, match="service 'broken' failed: disk gone"):
        async with HookBus() as bus:
            bus.start_service(_Recorder("broken", [], fail_run=True))
            await anyio.sleep(0.01)
            await bus.publish(Start())


async def test_service_error_surfaces_at_close() -> None:
    with pytest.raises(HookError, match="disk gone"):
        async with HookBus() as bus:
            bus.start_service(_Recorder("broken", [], fail_run=True))
            await anyio.sleep(0.01)


async def test_service_ignoring_its_deadline_is_reported_not_hung(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Stubborn(_Recorder):
        async def aclose(self, deadline: float) -> None:
            await anyio.sleep_forever()

    import recis_async.bus as bus_module

    monkeypatch.setattr(bus_module, "_CLOSE_GRACE_S", 0.01)
    with anyio.fail_after(5):
        with pytest.raises(HookError, match="did not close within flush_timeout"):
            async with HookBus(flush_timeout=0.01) as bus:
                bus.start_service(Stubborn("stubborn", []))


async def test_service_started_before_enter_runs_at_enter() -> None:
    drained: list[bool] = []
    bus = HookBus()
    bus.start_service(_Recorder("early", drained))
    async with bus:
        pass
    assert drained == [True]


async def test_bad_input_is_refused_at_the_call() -> None:
    async with HookBus() as bus:
        with pytest.raises(
            ValueError,
            match=r"on_error=...\): expected one of 'raise', 'log', 'disable', got 'ignore'",
        ):
            bus.subscribe(Start, print, on_error="ignore")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"expected an Event subclass, got <class 'int'>"):
            bus.subscribe(int, print)  # type: ignore[arg-type]
        with pytest.raises(
            ValueError, match=r"subscribe\(every=...\): expected a positive int, got 0"
        ):
            bus.subscribe(Start, print, every=0)
        with pytest.raises(
            ValueError, match=r"subscribe\(once=...\): expected a positive int, got -1"
        ):
            bus.subscribe(Start, print, once=-1)
        with pytest.raises(ValueError, match=r"every_seconds"):
            bus.subscribe(Start, print, every_seconds=0)
        with pytest.raises(ValueError, match="priority"):
            bus.subscribe(Start, print, priority="URGENT")
        with pytest.raises(
            TypeError, match=r"publish\(event=...\): expected an Event instance, got dict"
        ):
            await bus.publish({"global_step": 1})  # type: ignore[arg-type]
        hook = Hook()
        bus.add_hook(hook)
        with pytest.raises(ValueError, match="already added"):
            bus.add_hook(hook)
        with pytest.raises(TypeError, match="expected a Hook instance"):
            bus.add_hook(print)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"HookBus\(flush_timeout=...\): expected a positive number, got 0"
    ):
        HookBus(flush_timeout=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"handle_signals": "no"},
            TypeError,
            r"HookBus\(handle_signals=...\): expected a bool, got 'no'",
        ),
        (
            {"handle_signals": 0},
            TypeError,
            r"HookBus\(handle_signals=...\): expected a bool, got 0",
        ),
        ({"handle_signals": None}, TypeError, r"expected a bool, got None"),
        (
            {"flush_timeout": "60"},
            TypeError,
            r"HookBus\(flush_timeout=...\): expected a positive number, got '60'",
        ),
        ({"flush_timeout": math.nan}, ValueError, r"expected a positive number, got nan"),
        ({"flush_timeout": math.inf}, ValueError, r"expected a positive number, got inf"),
        ({"flush_timeout": True}, TypeError, r"expected a positive number, got True"),
        ({"flush_timeout": -1}, ValueError, r"expected a positive number, got -1"),
    ],
)
def test_constructor_arguments_are_checked(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        HookBus(**kwargs)


async def test_request_stop_takes_a_str_reason() -> None:
    async with HookBus() as bus:
        with pytest.raises(TypeError, match=r"request_stop\(reason=...\): expected a str, got 3"):
            bus.request_stop(3)  # type: ignore[arg-type]
        assert not bus.should_stop


async def test_publish_outside_the_block_is_refused() -> None:
    bus = HookBus()
    with pytest.raises(RuntimeError, match="publish inside `async with HookBus\\(\\)`"):
        await bus.publish(Start())


async def test_background_service_gets_loop_time_while_publishing_without_awaits() -> None:
    """Sync subscribers never yield; the bus still lets services progress."""
    progressed: list[int] = []

    class Ticker(_Recorder):
        async def run(self) -> None:
            while not self._stop.is_set():
                progressed.append(1)
                await anyio.lowlevel.checkpoint()

    async with HookBus() as bus:
        bus.start_service(Ticker("ticker", []))
        bus.subscribe(AfterStep, lambda e: None)
        with anyio.fail_after(5):
            while len(progressed) < 3:
                await bus.publish(AfterStep())
    assert len(progressed) >= 3


async def test_a_woken_service_starts_its_thread_work_within_one_long_step() -> None:
    """With steps longer than the yield interval the loop runs once per step: that one yield
    must take a woken service as far as its worker thread, not one stage a step."""
    started = threading.Event()

    class Handoff(_Recorder):
        wake = anyio.Event()

        async def run(self) -> None:
            await self.wake.wait()
            await anyio.to_thread.run_sync(started.set)
            await self._stop.wait()

    service = Handoff("handoff", [])
    async with HookBus() as bus:
        bus.start_service(service)
        await anyio.sleep(0.01)  # run() is waiting
        time.sleep(0.15)  # a long step: no loop pass
        service.wake.set()
        await bus.publish(AfterStep())  # the step's only yield
        assert started.wait(5), "the worker thread was not reached within the step's yield"


async def test_body_error_inside_publish_is_hook_error_unwrapped() -> None:
    """A HookError raised by publish in the body is the body's exception: not a group."""

    def broken(event: BeforeStep) -> None:
        raise ValueError("bad step")

    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.subscribe(BeforeStep, broken)
            bus.start_service(_Recorder("svc", []))
            await bus.publish(BeforeStep())
    assert isinstance(info.value.__cause__, ValueError)


async def test_a_hanging_end_subscriber_cannot_hang_close() -> None:
    drained: list[bool] = []

    async def forever(event: End) -> None:
        await anyio.sleep_forever()

    with anyio.fail_after(5):
        with pytest.raises(
            HookError, match=r"End subscribers did not finish within flush_timeout=0.05s"
        ):
            async with HookBus(flush_timeout=0.05) as bus:
                bus.subscribe(End, forever)
                bus.start_service(_Recorder("svc", drained))
    assert drained == [True]  # the service was still closed (and told its deadline passed)


async def test_services_outlive_an_outer_cancellation_until_drained() -> None:
    """The body is cancelled; the service's worker must still be running when close drains."""
    delivered: list[int] = []

    class Worker(_Recorder):
        def __init__(self) -> None:
            super().__init__("worker", [])
            self.send, self.receive = anyio.create_memory_object_stream[int](100)

        async def run(self) -> None:
            async with self.receive:
                async for item in self.receive:
                    await anyio.sleep(0.001)  # a checkpoint: an unshielded worker dies here
                    delivered.append(item)

        async def aclose(self, deadline: float) -> None:
            await self.send.aclose()
            with anyio.fail_after(max(deadline - anyio.current_time(), 0)):
                while len(delivered) < 50:
                    await anyio.sleep(0.001)

    with anyio.move_on_after(0.02):
        async with HookBus() as bus:
            worker = Worker()
            bus.start_service(worker)
            for i in range(50):
                worker.send.send_nowait(i)
            await anyio.sleep_forever()
    assert delivered == list(range(50))


@pytest.mark.parametrize("body_saw_it", [False, True])
@pytest.mark.parametrize("task_left", [False, True])
async def test_a_close_error_under_an_outer_cancellation_is_logged_and_the_block_cancelled(
    caplog: pytest.LogCaptureFixture, body_saw_it: bool, task_left: bool
) -> None:
    """A scope around the bus is cancelled (the body saw it or not yet) and a service's close
    fails (it spilled, say): the block ends with that cancellation, which its scope absorbs,
    and the close's error is logged.  Before, the error escaped into the scope (in an
    exception group) when the bus's task group had no task left to wait for at exit, and
    vanished, not even logged, when it had."""

    class FailingClose(_Recorder):
        async def run(self) -> None:
            if task_left:  # the service's task is still running when the block is left
                await super().run()

        async def aclose(self, deadline: float) -> None:
            await super().aclose(deadline)
            raise OSError("1 batch spilled")

    drained: list[bool] = []
    after: list[str] = []
    with anyio.CancelScope() as outer:
        async with HookBus(handle_signals=False) as bus:
            bus.start_service(FailingClose("svc", drained))
            await anyio.sleep(0.01)  # the service's task ran (and, without task_left, ended)
            outer.cancel()
            if body_saw_it:
                await anyio.sleep(1)
        after.append("not cancelled")  # the block must end with the cancellation
    assert outer.cancelled_caught and after == [] and drained == [True]
    closing = [r for r in caplog.records if "failed while closing the bus" in r.getMessage()]
    assert len(closing) == 1 and "1 batch spilled" in closing[0].getMessage()
    assert closing[0].levelno == logging.ERROR


def test_a_bus_used_in_a_second_event_loop_run_says_so() -> None:
    """Entered in one ``anyio.run`` and closed in another: its task group died with the first
    (on asyncio the second run got anyio's own error; trio refuses the first run's end
    itself, a nursery left open)."""
    bus = HookBus()

    async def enter() -> None:
        await bus.__aenter__()

    async def close() -> None:
        await bus.aclose()

    anyio.run(enter, backend="asyncio")
    with pytest.raises(RuntimeError, match=r"HookBus.close\(\): the bus was entered in another"):
        anyio.run(close, backend="asyncio")


async def test_every_step_counts_on_the_global_step_so_a_resumed_run_fires_alike() -> None:
    fired: dict[int, list[int]] = {}
    for first in (0, 4):  # a run from the start, and one resumed at step 4
        seen = fired.setdefault(first, [])
        async with HookBus() as bus:
            bus.on(AfterStep, every_step=3)(lambda e, seen=seen: seen.append(e.global_step))
            for step in range(first, 12):
                await bus.publish(AfterStep(global_step=step))
    assert fired[0] == [2, 5, 8, 11]
    assert fired[4] == [5, 8, 11]
    with pytest.raises(ValueError, match=r"subscribe\(every_step=...\)|every_step"):
        HookBus().subscribe(AfterStep, print, every_step=0)
