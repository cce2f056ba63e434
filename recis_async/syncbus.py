"""SyncHookBus: the :class:`~recis_async.HookBus` driven from plain synchronous code.

    with SyncHookBus() as bus:
        bus.add_hook(LoggerHook(log_step=100))
        bus.publish(Start())
        for step, batch in enumerate(loader):
            bus.publish(BeforeStep(global_step=step))
            loss = train_step(batch)
            add_metric("loss", loss)
            bus.publish(AfterStep(global_step=step, samples=len(batch)))
            if bus.should_stop:
                break

How it works, and why this way.  The bus needs a running event loop (its task group, its
services, the close deadline), and ``publish`` must cost about what ``await bus.publish`` costs,
so it cannot hop to another thread per event (anyio's blocking portal costs ~100 us a call
here).  So the event loop runs in a *greenlet* of the caller's own thread: ``__enter__`` starts
``anyio.run`` in it and enters a real ``HookBus`` there.  Its body task then hands control back
to the caller (a greenlet switch) and stays in the middle of its step while the caller runs:
to the event loop, that task is running all along, so from the caller's code
``asyncio.current_task()``, ``trio.lowlevel.current_task()``, anyio's cancel scopes and
``anyio.Event`` are the body task's, as inside ``async with HookBus()``.

``publish`` therefore runs ``HookBus.publish(event)``'s coroutine right in the caller: one
``send``.  Most publishes finish in it (every subscriber is a plain function, or an ``async
def`` that does not wait): no switch, no loop entry.  Only when the coroutine suspends (a
subscriber awaits something that waits, the periodic yield to services, a stop signal's
checkpoint) does ``publish`` switch into the loop's greenlet, where the body task awaits the
rest of that same coroutine, and switch back when it is done.  The code that runs is
HookBus's own: routes, filters, priorities, ``on_error``, the collector merge, the periodic
yield to services, signals, ``End`` once, the close deadline and the drain.  Every step of the
bus's code and of its subscribers, wherever it runs, runs in one :class:`contextvars.Context`
of the bus (a copy of the body task's), so a subscriber's context variables hold across its
awaits and from one publish to the next.  Between two publishes the loop is paused, as an
async loop is while its step computes: worker threads keep working, and what they finished is
picked up at the next publish that yields (every ~100 ms, as ``HookBus`` does) or at close.

The caller's thread is the loop's thread, so signal handlers are installed there (the main
thread: SIGINT/SIGTERM stop the loop gracefully, exit status 130/143), and no thread is left
behind.  Where the caller runs an event loop of its own (Jupyter runs cells inside one), that
loop stays the thread's running loop outside ``publish``, and every publish switches into the
loop's greenlet (the first ``send`` there too), where the bus's loop is the running one.  In a
plain script the bus's asyncio loop counts as the thread's running loop for the whole block
(so ``asyncio.run`` there raises; run another event loop before or after the block, or in a
thread): swapping it at every publish would cost more than the publish itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import signal
import sys
import threading
import types
import weakref
from asyncio import events as _asyncio_events
from collections.abc import Callable, Coroutine, Generator, Iterator, Mapping
from contextvars import ContextVar, Token
from types import FrameType, TracebackType
from typing import Any, TypeVar

import anyio
import greenlet

try:
    import sniffio
except ImportError:  # anyio runs without it; trio needs it
    sniffio = None  # type: ignore[assignment]

from . import collect
from ._checks import one_of
from .bus import HookBus
from .collect import StepCollector
from .errors import OnError
from .events import BeforeStep, Event
from .hook import Hook
from .priority import Priority
from .service import Service
from .subscription import Subscription

__all__ = ["SyncHookBus"]

E = TypeVar("E", bound=Event)
F = TypeVar("F", bound=Callable[..., Any])

_get_running_loop = _asyncio_events._get_running_loop
_set_running_loop = _asyncio_events._set_running_loop


class _NoLocal:
    """Stands in for ``sniffio.thread_local`` where sniffio is not installed."""

    name: str | None = None


_library: Any = sniffio.thread_local if sniffio is not None else _NoLocal()
_getcurrent = greenlet.getcurrent

logger = logging.getLogger(__name__)

#: The bus whose own context this is (see :meth:`SyncHookBus._serve`): set there only, so it
#: is the bus while its code or a subscriber runs, in whichever greenlet; how a call made from
#: a subscriber is told from the caller's.
_in_bus: ContextVar[SyncHookBus | None] = ContextVar("recis_async_syncbus", default=None)

_NOT_STARTED: Any = object()
_IDLE: Any = object()  # what a publisher yields once a publish has returned


@types.coroutine
def _publisher(
    publish: Callable[[Event], Coroutine[Any, Any, None]],
) -> Generator[Any, Any, None]:
    """Runs ``await publish(event)`` for each event sent in, then yields ``_IDLE``; what it
    yields before is the publish's own: it waits (see :func:`_drive`).  One generator for many
    publishes: a publish that returns without waiting ends in a value, not in the
    ``StopIteration`` a coroutine of its own would raise (~0.3 us less per publish)."""
    event = yield _IDLE
    while True:
        yield from publish(event)  # a coroutine: types.coroutine allows it
        event = yield _IDLE


@types.coroutine
def _drive(
    context: contextvars.Context,
    coro: Coroutine[Any, Any, Any] | Generator[Any, Any, Any],
    yielded: Any = _NOT_STARTED,
) -> Generator[Any, Any, Any]:
    """``await coro`` from the awaiting task, with every step of ``coro`` run in ``context``;
    ``yielded``: what ``coro`` yielded at its first step, taken already (by the caller's
    ``send``).  What ``yield from`` does (PEP 380), step by step through ``context.run``; a
    :func:`_publisher` is awaited until its publish has returned (it yields ``_IDLE``)."""
    run = context.run
    try:
        if yielded is _NOT_STARTED:
            yielded = run(coro.send, None)
        while yielded is not _IDLE:
            try:
                sent = yield yielded
            except GeneratorExit:
                run(coro.close)
                raise
            except BaseException as exc:  # the loop's cancellation, thrown in: to the coroutine
                yielded = run(coro.throw, exc)
            else:
                yielded = run(coro.send, sent)
    except StopIteration as stop:
        return stop.value
    return None


class _Call:
    """Run ``fn(*args, **kwargs)`` in the loop's greenlet (a call that may touch the loop)."""

    __slots__ = ("args", "fn", "kwargs")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.fn, self.args, self.kwargs = fn, args, kwargs


class _Exit:
    """Leave the bus: ``exc`` is the body's exception (or ``None``)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException | None) -> None:
        self.exc = exc


class _Continue:
    """A publish whose first step, run in the caller, suspended: the loop runs the rest
    (``coro``: the caller's :func:`_publisher`)."""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Generator[Any, Any, None], yielded: Any) -> None:
        self.coro, self.yielded = coro, yielded


class _Throw:
    """The first step of a publish, run in the caller, raised ``exc``, which is not an
    ``Exception`` (a subscriber's ``KeyboardInterrupt`` or ``SystemExit``): it ends the body
    in the loop, as it does when raised there."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Result:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _Raise:
    """A call or publish failed with an ordinary exception: raised in the caller; the bus
    stays open."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Closed:
    """The loop has ended (the greenlet returned): the bus closed, raising ``error`` (or not),
    after the body ended with ``body`` (or normally); ``swallowed``: HookBus swallowed
    ``body`` (its own cancellation, by a second stop signal)."""

    __slots__ = ("body", "error", "swallowed")

    def __init__(
        self, error: BaseException | None, swallowed: bool, body: BaseException | None
    ) -> None:
        self.error, self.swallowed, self.body = error, swallowed, body


@contextlib.contextmanager
def _outside_any_loop() -> Iterator[None]:
    """Hide the thread's running event loop (asyncio's, and the library name sniffio reports:
    trio's) for the block, as :meth:`SyncHookBus._run` starts its loop; then show it again."""
    loop, library = _get_running_loop(), _library.name
    token = sniffio.current_async_library_cvar.set(None) if sniffio is not None else None
    _set_running_loop(None)
    _library.name = None
    try:
        yield
    finally:
        _set_running_loop(loop)
        _library.name = library
        if token is not None:
            sniffio.current_async_library_cvar.reset(token)


def _keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    """Python's default SIGINT behaviour, under another name (see :meth:`SyncHookBus._run`)."""
    raise KeyboardInterrupt


def _close_at_exit(bus: SyncHookBus) -> None:
    """Have ``bus`` closed when the program ends with it still open (a loop that died before
    its ``close()``; a Hugging Face ``Trainer`` run that failed, which it tells no callback).

    Otherwise the process never exits: the interpreter waits for its non-daemon threads before
    anything else at exit, and the bus's event loop, suspended, never ends the worker
    threads it started (anyio's), so the wait has no end -- a SIGTERM included, as the bus
    handles it with a stop no loop acts on.  ``atexit`` runs after that wait; the hook
    threading itself gives ``concurrent.futures`` runs before it."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython's threading
        return
    try:
        register(functools.partial(_at_exit, weakref.ref(bus), os.getpid(), threading.get_ident()))
    except RuntimeError:  # the interpreter is exiting already
        pass


def _at_exit(ref: weakref.ReferenceType[SyncHookBus], pid: int, thread: int) -> None:
    """Close the bus if it is still open, in the process and thread that opened it (the main
    thread, where this runs; not in a forked child, such as a ``DataLoader`` worker, whose
    ``multiprocessing`` exit runs these hooks too), with the exception that ended the
    program, if one did: ``Error`` and ``End("failed")``, every service drained within
    ``flush_timeout``."""
    bus = ref()
    if bus is None or bus._state != "open" or os.getpid() != pid or threading.get_ident() != thread:
        return
    exc: BaseException | None = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    logger.warning(
        "SyncHookBus still open as the program ends%s: closing it now (End published, "
        "services drained). Close it in the program: `with SyncHookBus() as bus:` or "
        "bus.close() (a Hugging Face Trainer: `with callback: trainer.train()`)",
        "" if exc is None else f" after {type(exc).__name__}: {exc}",
    )
    try:
        if exc is None:
            bus.close()
        else:
            bus.__exit__(type(exc), exc, exc.__traceback__)
    except (SystemExit, KeyboardInterrupt):  # a stop signal's exit: the program ends anyway
        pass
    except BaseException as error:
        logger.error("closing the SyncHookBus at exit failed: %s", error)


class SyncHookBus:
    """A :class:`~recis_async.HookBus` for synchronous code: ``with SyncHookBus() as bus:``.

    ``bus.publish(event)`` returns when the event's subscribers have run; ``add_metric``,
    ``add_to_trace`` and ``add_to_ml_tracker`` work in the block; hooks and subscribers (sync
    or ``async def``) are added as on a ``HookBus`` and see that ``HookBus``
    (:attr:`hook_bus`) in ``attach``.  Leaving the block publishes ``End`` once and drains every
    service within ``flush_timeout``; errors surface at ``publish`` and on leaving, as with
    ``HookBus``.  Use the bus from the thread that entered it.

    Args:
        flush_timeout: seconds close may take to drain every background service.
        handle_signals: turn SIGTERM/SIGINT into a graceful stop (entered in the main thread):
            ``bus.should_stop`` becomes true, and leaving the block raises
            ``SystemExit(128 + signal)`` (``KeyboardInterrupt`` in a notebook).
        backend: the event loop the bus runs on, ``"asyncio"`` or ``"trio"``.
        backend_options: passed to :func:`anyio.run` (e.g. ``{"debug": True}`` for asyncio).

    Raises:
        TypeError, ValueError: as ``HookBus`` for the first two; an unknown ``backend``; a
            ``backend_options`` that is not a mapping.
    """

    def __init__(
        self,
        flush_timeout: float = 60.0,
        *,
        handle_signals: bool = True,
        backend: str = "asyncio",
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._bus = HookBus(flush_timeout, handle_signals=handle_signals)
        self._backend = one_of("SyncHookBus", "backend", backend, ("asyncio", "trio"))
        if backend_options is not None and not isinstance(backend_options, Mapping):
            raise TypeError(
                f"SyncHookBus(backend_options=...): expected a mapping or None, "
                f"got {backend_options!r}"
            )
        self._options = dict(backend_options or {})
        self._state = "new"  # new -> open -> closed
        self._outside: asyncio.AbstractEventLoop | None = None  # the thread's own asyncio loop
        self._outside_library: str | None = None  # and sniffio's thread-local name there
        self._greenlet: greenlet.greenlet | None = None  # where the loop runs
        self._caller: greenlet.greenlet | None = None  # what it switches back to
        self._switch: Callable[[Any], Any] = self._not_open
        self._token: Token[StepCollector | None] | None = None
        # publish's first step in the caller (see the module's docstring): set by the loop once
        # open, where the caller runs no event loop of its own; cleared while that step runs
        # (a subscriber publishing then takes the nested path) and once closed.
        self._ready = False
        self._run_in_bus: Callable[..., Any] = self._not_open  # the bus context's run
        self._publisher: Generator[Any, Any, None] = self._new_publisher()
        self._send: Callable[[Any], Any] = self._publisher.send

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> SyncHookBus:
        if self._state != "new":
            raise RuntimeError(f"SyncHookBus cannot be entered twice (state: {self._state})")
        self._token = collect.bind(self._bus._collector)  # add_metric & co. in the block
        self._caller = greenlet.getcurrent()
        self._outside = _get_running_loop()  # a notebook's; set again whenever the caller runs
        self._outside_library = _library.name
        loop_greenlet = greenlet.greenlet(self._run, parent=self._caller)
        loop_greenlet.gr_context = contextvars.copy_context()  # the caller's contextvars
        self._greenlet = loop_greenlet
        self._switch = loop_greenlet.switch
        self._state = "open"
        reply = self._to_loop(None)  # runs until the HookBus is entered (or failed to)
        if reply is not None:
            self._settle(reply)
        _close_at_exit(self)
        return self

    def open(self) -> SyncHookBus:
        """Enter the bus where a ``with`` block does not fit (framework callbacks); pair it
        with :meth:`close`.  Returns the bus."""
        return self.__enter__()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if self._state != "open":
            return False  # closed already (close(), or a stop signal's second arrival)
        return self._leave(exc)

    def close(self) -> None:
        """Publish ``End`` (if not yet), drain every service within ``flush_timeout`` and end
        the loop; idempotent.  Raises what leaving the ``with`` block would: the first close
        error as :class:`~recis_async.HookError`, ``SystemExit(128 + signal)`` after a stop
        signal."""
        if self._state == "new":
            raise RuntimeError("SyncHookBus.close(): the bus was never entered")
        if self._state == "open":
            self._leave(None)

    def _leave(self, exc: BaseException | None) -> bool:
        if self._in_subscriber():
            raise RuntimeError(
                "SyncHookBus: closing from inside a subscriber; request a stop instead "
                "(bus.request_stop), and leave the block in your loop"
            )
        closed = self._to_loop(_Exit(exc))
        assert isinstance(closed, _Closed), closed
        self._closed()
        if closed.error is not None and closed.error is not exc:
            raise closed.error
        return closed.swallowed

    def _run(self, _: object) -> _Closed:
        """The loop's greenlet: ``anyio.run`` until the bus closes."""
        # What says "an event loop runs in this thread" is the caller's while it runs (see
        # _serve); here it starts clean: asyncio refuses to start inside a running loop (a
        # notebook's), anyio inside a library it detects (the caller's context is copied).
        _set_running_loop(None)
        _library.name = None
        if sniffio is not None:
            sniffio.current_async_library_cvar.set(None)
        options = dict(self._options)
        if self._backend == "asyncio":
            # A loop of our own, not set as the thread's current one (asyncio.Runner would
            # otherwise replace, then clear, a notebook's).
            options.setdefault("loop_factory", asyncio.new_event_loop)
        # asyncio.Runner and trio.run take over SIGINT when Python's default handler is
        # installed (Ctrl-C would then cancel the loop's task, and reach this code as a
        # CancelledError at the next publish); the same behaviour under another name keeps
        # plain KeyboardInterrupt semantics (handle_signals=False) and the bus's own handling.
        replaced = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if replaced:
            signal.signal(signal.SIGINT, _keyboard_interrupt)
        try:
            return anyio.run(self._serve, replaced, backend=self._backend, backend_options=options)
        except BaseException as exc:  # the loop did not start, or failed to enter the bus
            return _Closed(exc, False, None)
        finally:
            if replaced and signal.getsignal(signal.SIGINT) is _keyboard_interrupt:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            _set_running_loop(self._outside)  # the greenlet returns to the caller
            _library.name = self._outside_library

    async def _serve(self, restore_sigint: bool) -> _Closed:
        """The body task: enter the HookBus, serve the caller's requests, leave it.

        Where the caller runs an event loop of its own (a notebook's, an async caller's),
        each switch to the caller sets the thread's running asyncio loop (and sniffio's
        thread-local library name, which trio sets) back to the caller's, and each switch
        back sets the bus's again.  In a plain script they are left as the bus's loop set
        them: setting the running loop costs ~0.35 us (a ``getpid`` call inside CPython), as
        much again as the switches themselves."""
        if restore_sigint and signal.getsignal(signal.SIGINT) is _keyboard_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        loop = asyncio.get_running_loop() if self._backend == "asyncio" else None
        outside, outside_library, library = self._outside, self._outside_library, _library.name
        swap = (outside is not None and loop is not None) or outside_library != library
        swap_loop = swap and outside is not loop  # (on trio both are None)
        swap_library = swap and outside_library != library
        # Where the bus's code and its subscribers run, whichever greenlet runs them: a copy of
        # this task's context (anyio.run's sniffio name in it: anyio finds the loop from the
        # caller's greenlet too), marked as the bus's own.
        context = contextvars.copy_context()
        context.run(_in_bus.set, self)
        bus = self._bus
        await _drive(context, bus.__aenter__())
        assert self._caller is not None
        to_caller = self._caller.switch
        publish = bus._publish  # always awaited here: publish()'s never-awaited check is moot
        self._run_in_bus = context.run
        # The first step of a publish runs in the caller unless the caller runs an event loop
        # of its own (a notebook's), which is the thread's running one there.
        fast = outside is None and outside_library is None
        set_loop = _set_running_loop
        exc: BaseException | None = None
        from_caller = False  # exc: the caller's, raised in its block (not in this loop)
        try:
            if swap_loop:
                set_loop(outside)
            if swap_library:
                _library.name = outside_library
            self._ready = fast
            request = to_caller(None)
            if swap_loop:
                set_loop(loop)
            if swap_library:
                _library.name = library
            while True:
                kind = type(request)
                if kind is _Continue:  # the rest of a publish the caller began
                    try:
                        await _drive(context, request.coro, request.yielded)
                    except Exception as error:
                        reply: Any = _Raise(error)
                    else:
                        reply = None
                elif kind is _Call:
                    try:
                        result = context.run(request.fn, *request.args, **request.kwargs)
                        if inspect.iscoroutine(result):
                            result = await _drive(context, result)
                        elif inspect.isawaitable(result):
                            result = await result
                    except Exception as error:
                        reply = _Raise(error)
                    else:
                        reply = _Result(result)
                elif kind is _Exit:
                    exc, from_caller = request.exc, True
                    break
                elif kind is _Throw:
                    raise request.exc  # ends the body below, as if raised in here
                else:  # an event (publish checks it is one)
                    try:
                        await _drive(context, publish(request))
                    except Exception as error:
                        reply = _Raise(error)
                    else:
                        reply = None
                if swap_loop:
                    set_loop(outside)
                if swap_library:
                    _library.name = outside_library
                request = to_caller(reply)
                if swap_loop:
                    set_loop(loop)
                if swap_library:
                    _library.name = library
        except BaseException as body:
            # The body ends here: the second stop signal's cancellation, a KeyboardInterrupt
            # or SystemExit raised by a subscriber, or the bus dropped while open.
            self._ready = False
            set_loop(loop)
            _library.name = library
            exc = body
        self._ready = False
        try:
            swallowed = await _drive(
                context,
                bus.__aexit__(
                    None if exc is None else type(exc),
                    exc,
                    None if exc is None else exc.__traceback__,
                ),
            )
        except BaseException as error:
            return _Closed(error, False, exc)
        # HookBus swallows its own cancellation only; the caller's (its event loop's, which is
        # this loop's kind in a notebook) propagates to the caller's loop.
        return _Closed(None, bool(swallowed) and not from_caller, exc)

    def _to_loop(self, request: Any) -> Any:
        """Switch into the loop's greenlet with ``request``; its reply."""
        try:
            return self._switch(request)
        except greenlet.error as exc:
            raise self._wrong_thread() from exc

    def _settle(self, reply: Any) -> Any:
        """Act on a reply other than ``None``: a result, an error to raise, the end."""
        if type(reply) is _Result:
            return reply.value
        if type(reply) is _Raise:
            raise reply.exc
        assert isinstance(reply, _Closed), reply
        # The loop ended under a request: the bus failed to open, or its body ended in the
        # loop (a second stop signal, a subscriber's KeyboardInterrupt or SystemExit) and the
        # bus has closed.
        self._closed()
        if reply.error is not None:
            raise reply.error
        if reply.body is not None and not reply.swallowed:
            raise reply.body
        raise RuntimeError("SyncHookBus: the bus has closed")

    def _closed(self) -> None:
        self._state = "closed"
        self._ready = False
        self._switch = self._not_open
        if self._token is not None:
            try:
                collect.unbind(self._token)
            except ValueError:  # entered in another context (a notebook's earlier cell)
                pass
            self._token = None

    def _not_open(self, request: Any) -> Any:
        where = "publish()" if isinstance(request, Event) else "the call"
        raise RuntimeError(
            f"SyncHookBus: {where} needs the bus open, and it is {self._state}; "
            "use it inside `with SyncHookBus() as bus:`"
        )

    def _in_subscriber(self) -> bool:
        """Whether a subscriber (or the bus's code) is what runs now: in the loop's greenlet,
        or in the first step of a publish in the caller's, in the bus's context."""
        current = _getcurrent()
        return current is self._greenlet or (current is self._caller and _in_bus.get() is self)

    def _wrong_thread(self) -> RuntimeError:
        return RuntimeError(
            f"SyncHookBus: used from thread {threading.current_thread().name!r}; a bus is used "
            "from the thread that entered it (its event loop runs there)"
        )

    # ------------------------------------------------------------------ publishing
    def publish(self, event: Event) -> None:
        """Run every subscriber of ``event`` in order; return when they all ran.

        As ``await HookBus.publish``: a failing ``on_error="raise"`` subscriber raises
        :class:`~recis_async.HookError` here, as does a background service that failed since
        the last publish.  Coroutine subscribers may wait (the loop runs until they are done).
        """
        if not (self._ready and _getcurrent() is self._caller):
            self._publish_switched(event)
            return
        if type(event) is BeforeStep and self._bus._begin_unreceived(event):
            return  # nobody receives it: the bus's part of it is done (HookBus.publish)
        # The first step in the caller, in the bus's context: most publishes end in it.
        self._ready = False  # a subscriber publishing in there takes the nested path
        try:
            yielded = self._run_in_bus(self._send, event)
        except Exception:
            self._restart()
            self._ready = True
            raise  # a subscriber's HookError, a failed service's, a bad event: as `await`
        except BaseException as exc:
            self._restart()
            request: Any = _Throw(exc)
        else:
            if yielded is _IDLE:
                self._ready = True
                return
            request = _Continue(self._publisher, yielded)  # it waits: the loop runs the rest
        self._ready = True  # before _settle, which clears it if the bus has closed
        reply = self._to_loop(request)
        if reply is not None:
            self._restart()  # the publish raised, through the publisher
            self._settle(reply)

    def _new_publisher(self) -> Generator[Any, Any, None]:
        publisher = _publisher(self._bus._publish)
        publisher.send(None)  # to its first `yield`: runs none of the bus's code
        return publisher

    def _restart(self) -> None:
        """A new publisher: the publish raised through the old one, which has ended."""
        self._publisher = self._new_publisher()
        self._send = self._publisher.send

    def _publish_switched(self, event: Event) -> None:
        """``publish`` through the loop's greenlet: the caller runs an event loop of its own
        (or the bus is not open, or this is the wrong thread); or, nested, in a subscriber."""
        if _getcurrent() is self._caller and _in_bus.get() is self:
            self._publish_nested(event)  # a subscriber, in the first step of a publish
            return
        try:
            reply = self._switch(event)
        except greenlet.error as exc:
            raise self._wrong_thread() from exc
        if reply is not None:
            if reply is event:  # switching to the running greenlet hands the value back
                self._publish_nested(event)
            else:
                self._settle(reply)

    def _publish_nested(self, event: Event) -> None:
        """A subscriber publishing: it runs inside a publish (in its first step in the caller,
        or in the loop), in a synchronous call, so the publish runs to its end there or, if a
        coroutine subscriber must wait, is refused."""
        coro = self._bus.publish(event)
        try:
            coro.send(None)
        except StopIteration:
            return
        coro.close()
        raise RuntimeError(
            f"SyncHookBus.publish({type(event).__name__}) from inside a subscriber: a "
            "coroutine subscriber of it had to wait, which a synchronous call cannot; publish "
            "it from an `async def` subscriber with `await bus.hook_bus.publish(event)`, or "
            "from your loop"
        )

    # ------------------------------------------------------------------ hooks and services
    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in the loop's greenlet, in the bus's context, when the bus is
        open (it may start a service there); directly otherwise (inside a subscriber, or once
        closed: it refuses).

        Before the bus is entered its loop does not exist yet, so ``fn`` (``add_hook``: the
        hook's ``attach``, which builds its services) runs here, with no event loop marked as
        running in this thread: the anyio events, locks and limiters it makes are then
        anyio's unbound ones, which bind in the first loop that uses them -- the bus's.  Made
        while the caller's own loop shows (a notebook cell's asyncio loop, an async caller's
        trio run), they would belong to that loop, whatever ``backend`` the bus runs on."""
        if self._state == "new":
            with _outside_any_loop():
                return fn(*args, **kwargs)
        if self._state != "open" or self._in_subscriber():
            return fn(*args, **kwargs)
        return self._settle(self._to_loop(_Call(fn, args, kwargs)))

    @property
    def hook_bus(self) -> HookBus:
        """The :class:`~recis_async.HookBus` inside: what hooks get in ``attach``."""
        return self._bus

    @property
    def hooks(self) -> tuple[Hook, ...]:
        """The hooks added to this bus, in order."""
        return self._bus.hooks

    @property
    def flush_timeout(self) -> float:
        return self._bus.flush_timeout

    def add_hook(self, hook: Hook) -> None:
        """As :meth:`HookBus.add_hook <recis_async.HookBus.add_hook>`."""
        self._call(self._bus.add_hook, hook)

    def start_service(self, service: Service) -> None:
        """As :meth:`HookBus.start_service <recis_async.HookBus.start_service>`."""
        self._call(self._bus.start_service, service)

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
        """As :meth:`HookBus.subscribe <recis_async.HookBus.subscribe>`: ``fn`` may be sync
        or ``async def``."""
        return self._bus.subscribe(
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
        return self._bus.on(
            event_type,
            priority=priority,
            every=every,
            every_step=every_step,
            once=once,
            every_seconds=every_seconds,
            when=when,
            first=first,
            on_error=on_error,
        )

    def unsubscribe(self, subscription: Subscription) -> None:
        """Stop calling ``subscription``; idempotent."""
        self._bus.unsubscribe(subscription)

    # ------------------------------------------------------------------ control
    def request_stop(self, reason: str = "") -> None:
        """Ask the loop to stop at the next step boundary; the first reason is kept."""
        if not isinstance(reason, str):
            raise TypeError(f"request_stop(reason=...): expected a str, got {reason!r}")
        self._call(self._bus.request_stop, reason)

    @property
    def should_stop(self) -> bool:
        return self._bus._stop_reason is not None  # HookBus.should_stop, without its call

    @property
    def stop_reason(self) -> str | None:
        return self._bus.stop_reason

    def has_subscribers(self, event_type: type[Event]) -> bool:
        """As :meth:`HookBus.has_subscribers <recis_async.HookBus.has_subscribers>`."""
        return self._bus.has_subscribers(event_type)

    def _begin_step(self, is_train: bool) -> bool:
        """As ``HookBus._begin_step``; false too wherever :meth:`publish` would not run in the
        caller (another thread, inside a subscriber, a loop of the caller's own)."""
        return self._ready and _getcurrent() is self._caller and self._bus._begin_step(is_train)

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict[str, Any]:
        """As :meth:`HookBus.stats <recis_async.HookBus.stats>`."""
        return self._bus.stats()

    def describe(self) -> str:
        """As :meth:`HookBus.describe <recis_async.HookBus.describe>`."""
        return self._bus.describe()

    def __repr__(self) -> str:
        return f"<SyncHookBus {self._state} backend={self._backend} bus={self._bus!r}>"
