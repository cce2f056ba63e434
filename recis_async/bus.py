"""HookBus: ordered in-band dispatch of lifecycle events plus background services.

``await bus.publish(event)`` runs every subscriber of the event's type (and of its base
classes) in order of priority, then registration, and returns when they all ran, so a hook that
requests a stop acts before the next step.  The per-type subscriber list is computed once and
cached; publishing spawns no task and does not yield per handler.

Slow work runs in services (:class:`~recis_async.service.Service`) started in the bus's task
group.  Leaving ``async with`` publishes ``End`` once (after ``Error`` if the body raised), then
closes every service in reverse order under one ``flush_timeout`` deadline, shielded from
cancellation.  The body's own exception propagates unchanged.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextvars import Token
from time import perf_counter
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from . import collect, dist, routes
from ._checks import boolean, positive_int, positive_number
from ._checks import on_error as check_on_error
from .collect import StepCollector
from .console import TRACEBACKS_LOGGED, log_failure
from .errors import HookError, OnError
from .events import LIFECYCLE, BeforeStep, End, Error, Event, method_name
from .hook import RESERVED_NAMES, Hook
from .hostcopy import DEFAULT_HOST_BUFFER_BYTES
from .priority import Priority, priority_value
from .routes import KIND_AFTER_STEP, KIND_BEFORE_STEP, KIND_OUT_OF_DATA, Route
from .service import Service, unreported_close_error, yield_to_services
from .stopping import StopSignals, end_status, preempted_exit
from .subscription import Filters, Subscription, filters

__all__ = ["HookBus", "Subscription"]

logger = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)
F = TypeVar("F", bound=Callable[..., Any])

# While publishing, hand the loop to background services at most this often: a loop pass at
# every step costs training measurably, and a hook that hands work over yields itself
# (figures: benchmarks/README.md, "Bus yields").
_YIELD_EVERY_S = 0.1
_CLOSE_GRACE_S = 5.0  # a service that ignores its deadline is abandoned this much later
_RECURSION_HINT = " (does a subscriber publish the event type it subscribes to?)"


class HookBus:
    """The event bus around a training loop: ``async with HookBus() as bus: ...``.

    ``flush_timeout`` bounds, in seconds, how long close may take to drain every background
    service after ``End``.

    With ``handle_signals`` (the default) and the bus entered in the main thread, SIGTERM and
    SIGINT become a stop request: the loop stops at the next step boundary, ``End(status=
    "preempted")`` is published, every service drains within ``flush_timeout``, and leaving the
    block raises ``SystemExit(128 + signal)`` (143 for SIGTERM, 130 for SIGINT).  A second
    signal cancels the body and closes at once: services spill what they still hold.

    Tensors given to ``add_to_trace`` / ``add_to_ml_tracker`` are copied to host buffers
    without waiting for the device (:mod:`recis_async.hostcopy`); ``host_buffer_bytes``
    bounds those buffers: a step that fills them waits at its ``publish(AfterStep)`` until the
    device has finished the oldest copies.

    Args:
        flush_timeout: seconds close may take to drain every background service.
        handle_signals: turn SIGTERM/SIGINT into a graceful stop (see above).
        host_buffer_bytes: the bound of the host buffers tensors are copied into (default
            64 MiB, pinned when CUDA is available).

    Raises:
        TypeError: a ``flush_timeout`` that is not a number, a ``handle_signals`` that is not a
            bool, a ``host_buffer_bytes`` that is not an int.
        ValueError: a ``flush_timeout`` that is not finite and positive, a
            ``host_buffer_bytes`` below 1.
    """

    def __init__(
        self,
        flush_timeout: float = 60.0,
        *,
        handle_signals: bool = True,
        host_buffer_bytes: int = DEFAULT_HOST_BUFFER_BYTES,
    ) -> None:
        self.flush_timeout = positive_number("HookBus", "flush_timeout", flush_timeout)
        self._handle_signals = boolean("HookBus", "handle_signals", handle_signals)
        self._subs: list[Subscription] = []
        self._routes: dict[type, Route] = {}  # built by routes.build, cleared on (un)subscribe
        self._generation = 0  # counts those changes: a loop may keep has_subscribers' answers
        self._seq = 0
        self._hooks: list[Hook] = []
        self._services: list[Service] = []
        self._failures: list[HookError] = []
        self._tg: TaskGroup | None = None
        self._state = "new"  # new -> open [-> ended: End published by hand] -> closing -> closed
        self._end_published = False
        self._unawaited: Coroutine[Any, Any, None] | None = None  # see publish()
        positive_int("HookBus", "host_buffer_bytes", host_buffer_bytes)
        self._collector = StepCollector(host_buffer_bytes)
        self._token: Token[StepCollector | None] | None = None
        self._stop_reason: str | None = None
        self._signals = StopSignals(
            self.flush_timeout, self._stop_now, self.request_stop, self._hurry_up
        )
        self._stopping: anyio.Event | None = None  # made on enter: an Event needs the loop
        self._close_scope: anyio.CancelScope | None = None
        self._loop: object = None  # the event loop run the bus was entered in
        self._service_scopes: list[anyio.CancelScope] = []
        self._last_yield = 0.0
        self._steps_done: int | None = None  # see steps_done
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> HookBus:
        if self._state != "new":
            raise RuntimeError(f"HookBus cannot be entered twice (state: {self._state})")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._state = "open"
        self._loop = anyio.lowlevel.current_token()
        self._stopping = anyio.Event()
        if self._stop_reason is not None:
            self._stopping.set()
        self._token = collect.bind(self._collector)
        if self._handle_signals and threading.current_thread() is threading.main_thread():
            await tg.start(self._signals.watch, name="recis_async:signals")
        for service in self._services:
            tg.start_soon(self._run_service, service, name=f"service:{service.name}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        tg = self._tg
        assert tg is not None
        cancelled_exc = anyio.get_cancelled_exc_class()
        # The cancellation of a scope around the bus, seen while leaving it; see below.
        outer: BaseException | None = None
        swallowed = False
        try:
            errors = await self._close(exc)
        finally:
            for scope in self._service_scopes:  # every service returned already, normally
                scope.cancel()
            self._signals.stop()
            tg.cancel_scope.cancel()
            try:
                if isinstance(exc, cancelled_exc):
                    # Our own cancel scope (a second signal) swallows its cancellation here;
                    # an outer cancellation is raised again (below).
                    swallowed = bool(await tg.__aexit__(exc_type, exc, tb))
                else:
                    await tg.__aexit__(None, None, None)
                    # Whether the task group's exit waited (and so saw an outer
                    # cancellation) depends on whether a service's task had ended yet: ask
                    # once more, so what leaves the block does not depend on that.
                    await anyio.lowlevel.checkpoint_if_cancelled()
            except cancelled_exc as cancellation:
                outer = cancellation
            finally:
                if self._token is not None:
                    collect.unbind(self._token)
                    self._token = None
        body_failed = exc is not None and not swallowed
        exit_ = preempted_exit(self._signals.signum, exc if body_failed else None)
        # The body's exception, the signal's exit status, or the cancellation of a scope
        # around the bus (the body was cancelled, or is about to be: the block must end as
        # its canceller asked) outranks errors of the close: they are logged instead.
        raised = body_failed or exit_ is not None or outer is not None
        for extra in errors[0 if raised else 1 :]:
            logger.error("failed while closing the bus: %s", extra)
        if exit_ is not None:
            raise exit_
        if body_failed:
            return False  # the body's exception propagates (an outer cancellation included)
        if outer is not None:
            raise outer
        if errors:
            raise errors[0]
        return swallowed

    async def aclose(self) -> None:
        """Publish ``End`` (if not yet) and drain every service; idempotent.  Raises the
        first close error as :class:`HookError`."""
        if self._state == "new":
            raise RuntimeError("HookBus.aclose(): the bus was never entered")
        errors = await self._close(None)
        if errors:
            raise errors[0]

    async def _close(self, exc: BaseException | None) -> list[HookError]:
        if self._state in ("closing", "closed"):
            return []
        self._check_loop("close")
        if self._signals.unseen:  # a stop signal the loop has not delivered yet: log it now
            self._signals.catch_up()
        self._state = "closing"
        errors: list[HookError] = []
        if self._unawaited is not None:
            lost, event_name = self._unawaited_error("leaving the bus")
            errors.append(HookError(str(lost), subscriber="publish", event=event_name))
        with anyio.CancelScope(shield=True):
            deadline = anyio.current_time() + (0.0 if self._signals.hurry else self.flush_timeout)
            if not self._end_published:
                await self._publish_end(exc, deadline, errors)
            for service in reversed(self._services):
                await self._close_service(service, deadline, errors)
        self._log_close_summary()
        errors.extend(self._failures)
        self._failures.clear()
        self._collector.open = False
        self._collector.host.close()  # the copy-out thread copies out the last ones and ends
        self._state = "closed"
        return errors

    async def _publish_end(
        self, exc: BaseException | None, deadline: float, errors: list[HookError]
    ) -> None:
        """``Error`` (if the body raised) then ``End``, both under the close deadline."""
        status = end_status(exc, self._signals.signum)
        end = End(status=status)
        reached: list[Subscription] = []  # the End subscribers the dispatch got to
        with anyio.CancelScope(deadline=deadline) as scope:
            if status == "failed":
                assert exc is not None
                error = Error(exc_type=type(exc).__qualname__, message=str(exc))
                await self._dispatch(error, errors)
            await self._dispatch(end, errors, reached)
        if scope.cancelled_caught:
            errors.append(
                HookError(
                    f"End subscribers did not finish within flush_timeout={self.flush_timeout}s",
                    subscriber="End",
                    event="End",
                )
            )
            # The synchronous End subscribers after the one that overran still get End:
            # they cannot hold up the close, and they release what the run held (a progress
            # bar and the log handlers routed through it, say).
            route = self._routes.get(End) or self._route(End)
            for sub, fn, is_async, filtered, _ in route.entries:
                if is_async or not sub.active or sub in reached:
                    continue
                try:
                    if filtered and not sub.accepts(end, perf_counter()):
                        continue
                    result = fn(end)
                    if inspect.iscoroutine(result):
                        result.close()  # no time left to await it
                except Exception as exc:
                    self._failed(sub, end, exc, errors)

    async def _close_service(
        self, service: Service, deadline: float, errors: list[HookError]
    ) -> None:
        grace = _CLOSE_GRACE_S
        if self._signals.hurry:
            deadline, grace = anyio.current_time(), 0.0
        with anyio.CancelScope(deadline=deadline + grace) as scope:
            self._close_scope = scope
            try:
                await service.aclose(deadline)
            except Exception as exc:
                err = HookError(
                    f"service {service.name!r} failed while closing: {exc}",
                    subscriber=service.name,
                )
                err.__cause__ = exc
                errors.append(err)
        self._close_scope = None
        if scope.cancelled_caught:
            why = (
                "a second stop signal arrived"
                if self._signals.hurry
                else f"it did not close within flush_timeout={self.flush_timeout}s "
                f"(+{_CLOSE_GRACE_S}s grace)"
            )
            # The cancelled aclose could not raise what it found (spill files, the replay
            # command): the service hands it over, so the error that reaches the user names it.
            kept = unreported_close_error(service)
            err = HookError(
                f"service {service.name!r} was cancelled: {why}" + (f"; {kept}" if kept else ""),
                subscriber=service.name,
            )
            err.__cause__ = kept
            errors.append(err)

    def _hurry_up(self) -> None:
        """A second stop signal: cancel the body, or cut a close under way short."""
        if self._state in ("open", "ended") and self._tg is not None:
            self._tg.cancel_scope.cancel()  # cancels the body (not the shielded watcher)
        elif self._close_scope is not None:
            self._close_scope.deadline = -math.inf

    def _check_loop(self, where: str) -> None:
        """Refuse a bus entered in one event loop run and used in another (two ``anyio.run``
        calls): its task group and services died with the first."""
        if self._loop is None:
            return
        try:
            same = anyio.lowlevel.current_token() == self._loop
        except Exception:  # no event loop running in this thread at all
            same = False
        if not same:
            raise RuntimeError(
                f"HookBus.{where}(): the bus was entered in another event loop run (an earlier "
                "anyio.run or asyncio.run?), which has ended with its background services; "
                "a bus lives inside one `async with HookBus()` in one run"
            )

    async def _run_service(self, service: Service) -> None:
        """Run a service shielded from outer cancellation: when the body is cancelled the
        service must live on until close drains it.  Close cancels it explicitly after
        ``aclose`` (it normally returned by then)."""
        try:
            with anyio.CancelScope(shield=True) as scope:
                self._service_scopes.append(scope)
                await service.run()
        except Exception as exc:
            err = HookError(f"service {service.name!r} failed: {exc}", subscriber=service.name)
            err.__cause__ = exc
            logger.error("%s", err)
            self._failures.append(err)

    # ------------------------------------------------------------------ hooks and services
    @property
    def hooks(self) -> tuple[Hook, ...]:
        """The hooks added to this bus, in order."""
        return tuple(self._hooks)

    def add_hook(self, hook: Hook) -> None:
        """Subscribe every event method ``hook``'s class overrides, then ``hook.attach(self)``.

        Hooks with ``rank_zero_only`` are skipped on ranks other than 0.
        """
        if not isinstance(hook, Hook):
            raise TypeError(f"add_hook(hook=...): expected a Hook instance, got {hook!r}")
        if self._state in ("closing", "closed"):
            raise RuntimeError("add_hook(): the bus is closed")
        self._check_loop("add_hook")
        if any(h is hook for h in self._hooks):
            raise ValueError(f"add_hook(): {hook!r} was already added to this bus")
        key = hook.state_key
        for other in self._hooks:
            if other.state_key == key:
                raise ValueError(
                    f"add_hook(): state_key {key!r} of {hook!r} is already used by {other!r}; "
                    "give one of them a distinct state_key"
                )
        if hook.rank_zero_only and self.rank != 0:
            return
        priority = priority_value(hook.priority, field=f"{type(hook).__name__}.priority")
        on_error = check_on_error(type(hook).__name__, "on_error", hook.on_error)
        cls = type(hook)
        # Method name -> the event types it handles: usually one; two custom events of one
        # class name (in two modules) both reach the method named after them.
        methods: dict[str, list[type[Event]]] = {}
        for event_type in _event_types():
            name = method_name(event_type)
            if name in RESERVED_NAMES:
                continue
            impl = getattr(cls, name, None)
            if impl is None or impl is getattr(Hook, name, None) or not callable(impl):
                continue
            types = methods.setdefault(name, [])
            if not any(issubclass(event_type, t) for t in types):  # a base covers it already
                types.append(event_type)
        for name, value in hook.subscription_filters.items():
            if name not in methods:
                raise ValueError(
                    f"add_hook(): {cls.__name__}.subscription_filters names {name!r}, which is "
                    f"not an event method it overrides (it overrides {sorted(methods)})"
                )
            if not isinstance(value, Filters):
                raise TypeError(
                    f"add_hook(): {cls.__name__}.subscription_filters[{name!r}]: expected a "
                    f"Filters, got {value!r}"
                )
        added: list[Subscription] = []
        for name, event_types in methods.items():
            for event_type in event_types:
                sub = self._add(
                    event_type,
                    getattr(hook, name),
                    f"{cls.__name__}.{name}",
                    priority,
                    hook.subscription_filters.get(name),
                    on_error,
                )
                added.append(sub)
        self._hooks.append(hook)
        try:
            hook.attach(self)
        except BaseException:
            # A hook that failed to attach is not half-added (services it already started
            # stay: close drains them like any other).
            for sub in added:
                sub.remove()
            self._hooks.remove(hook)
            raise
        for what, where in _outputs(hook).items():
            logger.info("%s writes %s to %s", type(hook).__name__, what, where)

    def start_service(self, service: Service) -> None:
        """Run ``service`` in the bus's task group until close (started at enter if not open)."""
        if not isinstance(service, Service):
            raise TypeError(f"start_service(service=...): expected a Service, got {service!r}")
        if self._state in ("closing", "closed"):
            raise RuntimeError("start_service(): the bus is closed")
        self._check_loop("start_service")
        self._services.append(service)
        if self._tg is not None:
            self._tg.start_soon(self._run_service, service, name=f"service:{service.name}")

    # ------------------------------------------------------------------ subscribing
    def subscribe(
        self,
        event_type: type[E],
        fn: Callable[[E], Any],
        *,
        priority: int | str | Priority = Priority.NORMAL,
        every: int | None = None,
        every_step: int | None = None,
        once: int | None = None,
        every_seconds: float | None = None,
        when: Callable[[E], bool] | None = None,
        first: bool = False,
        on_error: OnError = "raise",
    ) -> Subscription:
        """Subscribe ``fn`` (sync or async) to ``event_type`` and its subclasses.

        Filters count this subscriber's occurrences, 1-based: ``every=3`` fires on the 3rd,
        6th, ...; ``every_step=3`` on the steps completing a multiple of 3 counted on the
        event's ``global_step`` (the same steps after a resume); ``once=2`` only on the 2nd;
        ``every_seconds`` at most once per interval (the first occurrence fires); ``when(event)``
        must return true.  All given must pass.  ``first=True`` also fires on the first
        occurrence whatever ``every`` / ``every_step`` say (TensorFlow's "first, then every
        n-th").
        """
        if not (isinstance(event_type, type) and issubclass(event_type, Event)):
            raise TypeError(
                f"subscribe(event_type=...): expected an Event subclass, got {event_type!r}"
            )
        if not callable(fn):
            raise TypeError(f"subscribe(fn=...): expected a callable, got {fn!r}")
        return self._add(
            event_type,
            fn,
            _callable_name(fn),
            priority_value(priority, field="subscribe(priority=...)"),
            filters("subscribe", every, once, every_seconds, when, every_step, first),
            check_on_error("subscribe", "on_error", on_error),
        )

    def on(
        self,
        event_type: type[E],
        *,
        priority: int | str | Priority = Priority.NORMAL,
        every: int | None = None,
        every_step: int | None = None,
        once: int | None = None,
        every_seconds: float | None = None,
        when: Callable[[E], bool] | None = None,
        first: bool = False,
        on_error: OnError = "raise",
    ) -> Callable[[F], F]:
        """Decorator form of :meth:`subscribe`; returns the function unchanged."""

        def decorate(fn: F) -> F:
            self.subscribe(
                event_type,
                fn,
                priority=priority,
                every=every,
                every_step=every_step,
                once=once,
                every_seconds=every_seconds,
                when=when,
                first=first,
                on_error=on_error,
            )
            return fn

        return decorate

    def _add(
        self,
        event_type: type[Event],
        fn: Callable[..., Any],
        name: str,
        priority: int,
        filters: Filters | None,
        on_error: OnError,
    ) -> Subscription:
        if self._state in ("closing", "closed"):
            raise RuntimeError("subscribe(): the bus is closed")
        self._seq += 1
        sub = Subscription(self, event_type, fn, name, priority, self._seq, filters, on_error)
        self._subs.append(sub)
        self._routes.clear()
        self._generation += 1
        return sub

    def unsubscribe(self, subscription: Subscription) -> None:
        """Stop calling ``subscription``; idempotent (``Subscription.remove()`` calls it)."""
        if not isinstance(subscription, Subscription):
            raise TypeError(
                f"unsubscribe(subscription=...): expected a Subscription, got {subscription!r}"
            )
        if not subscription.active:
            return
        subscription.active = False
        try:
            self._subs.remove(subscription)
        except ValueError:
            return  # another bus's subscription: nothing of it is here
        self._routes.clear()
        self._generation += 1

    def _route(self, event_type: type) -> Route:
        return routes.build(self._routes, event_type, self._subs)

    def has_subscribers(self, event_type: type[Event]) -> bool:
        """Whether an event of ``event_type`` would reach a subscriber now (one of that type or
        of a base class).  A loop may skip building and publishing an event nobody receives;
        the events the bus itself acts on (``AfterStep``, ``OutOfData``, ``End``) are published
        whatever this says; a ``BeforeStep`` nobody receives costs its publish only the bus's
        own part of it (see :meth:`publish`)."""
        route = self._routes.get(event_type) or self._route(event_type)
        return bool(route.entries)

    def _begin_step(self, is_train: bool) -> bool:
        """What the bus does on a ``BeforeStep`` (values of the other kind of step dropped),
        for the library's loops, which build and publish one only where a subscriber receives
        it: a publish nobody receives costs the step the bus's whole publish all the same.

        False, doing nothing, when the step boundary has something to raise or deliver (a
        service's failure, a stop signal not acted on yet, a bus that is not open): the loop
        then publishes its ``BeforeStep`` after all, which raises or delivers it before the
        step runs, as it always did."""
        if self._failures or self._signals.unseen or self._state != "open":
            return False
        self._collector.begin_step(is_train)
        return True

    # ------------------------------------------------------------------ publishing
    def publish(self, event: Event) -> Coroutine[Any, Any, None]:
        """Run every subscriber of ``event`` in order; ``await`` it: it returns when all ran.

        A failing ``on_error="raise"`` subscriber raises :class:`HookError` here, as does a
        background service that failed since the last publish.  A ``publish`` called without
        ``await`` delivers nothing; the next ``publish`` (or leaving the bus) raises
        ``RuntimeError`` naming its event, instead of Python only warning when it is
        collected.
        """
        # A plain method returning the coroutine, so that the call itself is seen: the
        # coroutine clears the mark when it starts.  One call more per publish, no task.
        if self._unawaited is not None:
            raise self._unawaited_error("publish()")[0]
        if type(event) is BeforeStep and self._begin_unreceived(event):
            self._unawaited = coro = self._published(event)
        else:
            self._unawaited = coro = self._publish(event)
        return coro

    def _begin_unreceived(self, event: BeforeStep) -> bool:
        """A ``BeforeStep`` no subscriber receives (most hook sets: the logger times steps from
        ``AfterStep``): the bus's part of it done now, as :meth:`_begin_step`, and true; false
        where the publish must run (a subscriber, something to raise or deliver, or the
        services' turn to run, which every publish gives them at least every 100 ms)."""
        route = self._routes.get(BeforeStep) or self._route(BeforeStep)
        if route.entries or (self._services and perf_counter() - self._last_yield > _YIELD_EVERY_S):
            return False
        return self._begin_step(event.is_train)

    async def _published(self, event: Event) -> None:
        """The publish of ``event``, whose delivery is done already: clears the mark only
        (``event`` is kept for the error naming a publish never awaited)."""
        self._unawaited = None

    def _unawaited_error(self, where: str) -> tuple[RuntimeError, str]:
        """The error for the publish never awaited, and its event's name."""
        coro, self._unawaited = self._unawaited, None
        frame = getattr(coro, "cr_frame", None)  # an unstarted coroutine holds its arguments
        event = frame.f_locals.get("event") if frame is not None else None
        if coro is not None:
            coro.close()  # Python's own "never awaited" warning would only repeat this
        return RuntimeError(
            f"{where}: an earlier publish({type(event).__name__}) was never awaited, so it "
            f"delivered nothing ({event!r:.120}); write `await bus.publish(event)`"
        ), type(event).__name__

    async def _publish(self, event: Event) -> None:
        self._unawaited = None
        if self._state != "open" and self._state != "closing":  # End handlers may publish
            if self._state == "ended":
                raise RuntimeError(
                    f"publish({type(event).__name__}): End was already published on this bus, "
                    "and nothing after End reaches the hooks (their writers have flushed); "
                    "publish End last, or leave `async with HookBus()`, which publishes it"
                )
            raise RuntimeError(
                f"publish(): the bus is {self._state}; publish inside `async with HookBus()`"
            )
        if self._failures:
            raise self._failures.pop(0)
        if self._signals.unseen:  # a stop signal the loop has not delivered yet (no service)
            self._signals.catch_up()
            await anyio.lowlevel.checkpoint()  # a second one cancelled the body: raised here
        route = self._routes.get(type(event)) or self._route(type(event))
        kind = route.kind
        if kind:
            if kind == KIND_AFTER_STEP:
                collector = self._collector
                if collector.metrics or collector.trace or collector.tracked:
                    event = collector.merged(event)  # type: ignore[arg-type]
                    host = collector.host
                    if host.copies and host.full:  # back-pressure: the device is behind
                        await host.make_room(self._stopping)
            elif kind == KIND_BEFORE_STEP:
                self._collector.begin_step(event.is_train)
            elif kind == KIND_OUT_OF_DATA:
                self._collector.drop()  # the step did not happen: drop what it collected
            else:  # End: every subscriber receives it, even when one fails
                if self._end_published:
                    raise RuntimeError("publish(End): End was already published on this bus")
                errors: list[HookError] = []
                await self._dispatch(event, errors)
                if self._state == "open":
                    self._state = "ended"
                if errors:
                    raise errors[0]
                return
        # The hot path: keep it flat (no helper coroutine, no per-handler checkpoint).
        t = perf_counter()
        for sub, fn, is_async, filtered, every in route.entries:
            if not sub.active:
                continue
            if every:  # a numbered step off the subscriber's cadence: skipped (see Route)
                step = event.global_step  # type: ignore[attr-defined]
                if step and (step + 1) % every:
                    continue
            try:
                if filtered and not sub.accepts(event, t):
                    continue
                if is_async:
                    await fn(event)
                elif (result := fn(event)) is not None and inspect.isawaitable(result):
                    await result  # a lambda or partial around a coroutine function
            except Exception as exc:
                self._failed(sub, event, exc, None)
            now = perf_counter()
            elapsed = now - t
            sub.calls += 1
            sub.total_s += elapsed
            if elapsed > sub.max_s:
                sub.max_s = elapsed
            t = now
        if kind == KIND_AFTER_STEP and event.is_train:
            # every subscriber has run (a failure raised above): the step is done, for a save
            # at End that must hold no step a trace writer did not receive
            self._steps_done = event.global_step + 1  # type: ignore[attr-defined]
        if self._services and t - self._last_yield > _YIELD_EVERY_S:
            self._last_yield = t
            await yield_to_services()

    async def _dispatch(
        self, event: Event, errors: list[HookError], reached: list[Subscription] | None = None
    ) -> None:
        """Deliver to every subscriber, collecting ``on_error="raise"`` failures in ``errors``
        instead of stopping at the first (``End`` and ``Error``, and everything at close).

        ``publish`` keeps its own copy of this loop on purpose: calling through here would
        add a coroutine to every publish (benchmarks/README.md, "Publish without a helper").
        """
        if isinstance(event, End):
            self._end_published = True
        route = self._routes.get(type(event)) or self._route(type(event))
        t = perf_counter()
        for sub, fn, is_async, filtered, _ in route.entries:
            if not sub.active:
                continue
            if reached is not None:
                reached.append(sub)
            try:
                if filtered and not sub.accepts(event, t):
                    continue
                if is_async:
                    await fn(event)
                elif (result := fn(event)) is not None and inspect.isawaitable(result):
                    await result  # a lambda or partial around a coroutine function
            except Exception as exc:
                self._failed(sub, event, exc, errors)
            now = perf_counter()
            sub.calls += 1
            sub.total_s += now - t
            sub.max_s = max(sub.max_s, now - t)
            t = now

    def _failed(
        self,
        sub: Subscription,
        event: Event,
        exc: Exception,
        errors: list[HookError] | None,
    ) -> None:
        sub.errors += 1
        event_name = type(event).__name__
        if sub.on_error == "raise":
            if isinstance(exc, HookError) and (exc.subscriber, exc.event) == (sub.name, event_name):
                # It published the event it handles, and failed in there: one failure, not a
                # message repeated once per level of the recursion.
                err = exc
            else:
                err = HookError(
                    f"{sub.name} failed on {event_name}: {type(exc).__name__}: {exc}"
                    + (_RECURSION_HINT if isinstance(exc, RecursionError) else ""),
                    subscriber=sub.name,
                    event=event_name,
                )
                err.__cause__ = exc
            if errors is None:
                sub.calls += 1  # the publish loop, which counts the other calls, ends here
                raise err
            errors.append(err)
            return
        if sub.on_error == "disable":
            logger.error(
                "%s failed on %s (on_error=disable): unsubscribed",
                sub.name,
                event_name,
                exc_info=exc,
            )
            sub.remove()
        else:
            log_failure(
                logger, sub.errors, exc, "%s failed on %s (on_error=log)", sub.name, event_name
            )

    def _log_close_summary(self) -> None:
        """Subscribers whose failures were only counted, and where every hook wrote."""
        for sub in self._subs:
            if sub.on_error == "log" and sub.errors > TRACEBACKS_LOGGED:
                logger.warning(
                    "%s failed %d times on %s (on_error=log)",
                    sub.name,
                    sub.errors,
                    sub.event_type.__name__,
                )
        lines = [
            f"  {what} ({type(hook).__name__}): {where}"
            for hook in self._hooks
            for what, where in _outputs(hook).items()
        ]
        if lines:
            logger.info("outputs of this run:\n%s", "\n".join(lines))

    # ------------------------------------------------------------------ control
    def request_stop(self, reason: str = "") -> None:
        """Ask the loop to stop at the next step boundary; the first reason is kept."""
        if not isinstance(reason, str):
            raise TypeError(f"request_stop(reason=...): expected a str, got {reason!r}")
        if self._stop_reason is None:
            self._stop_reason = reason
            logger.info("stop requested%s", f": {reason}" if reason else "")
        if self._stopping is not None:
            self._stopping.set()

    def _stop_now(self, reason: str) -> None:
        """The first stop signal, from its handler: only an assignment (see StopSignals)."""
        if self._stop_reason is None:
            self._stop_reason = reason

    @property
    def should_stop(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    @property
    def steps_done(self) -> int | None:
        """The training steps completed as of the latest training ``AfterStep`` whose every
        subscriber ran (its ``global_step + 1``; a publish that raised does not count it),
        ``None`` before the first: what a hook acting
        every ``n`` steps (``Filters(every_step=n)``) knows at ``End`` without being called
        on every step."""
        return self._steps_done

    @property
    def stopping(self) -> anyio.Event:
        """Set once a stop is requested (a hook, a stop signal, another rank): a service or
        hook waiting on something slow (buffer room, say) races it to give way."""
        if self._stopping is None:
            raise RuntimeError("HookBus.stopping: the bus was never entered")
        return self._stopping

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict[str, Any]:
        """Per subscriber calls, errors, total and max seconds; per service its own stats; the
        host buffer pool's (``host_buffers``: bytes held, copies, waits for room)."""
        subscribers: dict[str, dict[str, Any]] = {}
        for sub in sorted(self._subs, key=lambda s: s.seq):
            subscribers[_unique(subscribers, sub.name)] = {
                "event": sub.event_type.__name__,
                "calls": sub.calls,
                "errors": sub.errors,
                "total_s": sub.total_s,
                "max_s": sub.max_s,
            }
        services: dict[str, Mapping[str, Any]] = {}
        for service in self._services:
            services[_unique(services, service.name)] = dict(service.stats())
        host = self._collector.host.stats()
        return {"subscribers": subscribers, "services": services, "host_buffers": host}

    def describe(self) -> str:
        """The effective order of subscribers for every event type that has any."""
        lines: list[str] = []
        for event_type in _event_types():
            subs = sorted(
                (s for s in self._subs if issubclass(event_type, s.event_type)),
                key=lambda s: (s.priority, s.seq),
            )
            if not subs:
                continue
            lines.append(f"{event_type.__name__}:")
            lines.extend(f"  {i}. {s.describe(event_type)}" for i, s in enumerate(subs, 1))
        if self._services:
            lines.append("services (closed in reverse order):")
            lines.extend(f"  {i}. {s.name}" for i, s in enumerate(self._services, 1))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<HookBus {self._state} hooks={len(self._hooks)} subscribers={len(self._subs)} "
            f"services={len(self._services)}>"
        )


def _event_types() -> Iterator[type[Event]]:
    """The lifecycle events in reference order, then every other Event subclass."""
    seen: set[type] = set(LIFECYCLE)
    yield from LIFECYCLE
    stack: list[type[Event]] = [Event]
    while stack:
        cls = stack.pop()
        stack.extend(reversed(cls.__subclasses__()))
        if cls not in seen:
            seen.add(cls)
            yield cls


def _outputs(hook: Hook) -> dict[str, str]:
    """``hook.outputs()``; a failing one is logged, never breaks the run."""
    try:
        return dict(hook.outputs())
    except Exception as exc:
        logger.warning("%r.outputs() failed: %s: %s", hook, type(exc).__name__, exc)
        return {}


def _callable_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", repr(fn))
    return str(name)


def _unique(existing: Mapping[str, Any], name: str) -> str:
    if name not in existing:
        return name
    n = 2
    while f"{name}#{n}" in existing:
        n += 1
    return f"{name}#{n}"
