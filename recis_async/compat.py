"""Run hooks written for RecIS on the bus, unchanged: ``bus.add_hook(from_recis(hook))``.

A RecIS hook (a subclass of ``recis.hooks.Hook``) has one method per point of RecIS's
``Trainer`` with variadic arguments.  :func:`from_recis` wraps it in a :class:`Hook` whose
subscribers call those methods with the arguments RecIS's ``Trainer`` passes:

==========================  ==========================================================
event                       RecIS call
==========================  ==========================================================
``Start``                   ``start(is_train=...)``
``WindowMode``              ``window_mode()``
``BeforeEpoch``             ``before_epoch(is_train=...)``
``AfterEpoch``              ``after_epoch(is_train=...)``
``BeforeWindow``            ``before_window(is_train=...)``
``AfterWindow``             ``after_window(is_train=...)``
``BeforeStep``              ``before_step(is_train=...)``
``AfterData``               ``after_data(is_train=..., data=None)``
``AfterBackward``           ``after_backward(is_train=True)``
``AfterStep``               ``after_step(metrics=..., global_step=..., is_train=...)``
                            (evaluation adds ``eval_result=None``)
``OutOfData``               ``out_off_data()``
``AfterTrain``              ``after_train()``
``AfterEval``               ``after_eval()``
``End``                     ``end(is_train=...)`` with the ``is_train`` of the last ``Start``
==========================  ==========================================================

``metrics`` is a fresh dict per call: the step's metrics with arrays as CPU tensors and
tensors as recorded, on their device and unread (as RecIS's ``Trainer`` passed its loss: a hook
that reads one at its own log steps waits for the device only there), plus ``epoch`` on training
steps (RecIS's ``Trainer`` adds it).  ``global_step`` is a 0-d int64
tensor holding the step's 0-based index -- what hooks given to RecIS's ``Trainer(hooks=...)``
see, since RecIS's checkpoint hook advances the counter after them; hooks added there later
with ``trainer.add_hook`` ran after it and saw one more.  The batch (``data``) and the model's
eval output (``eval_result``) are not on the bus (events hold plain values), so they arrive as
``None``.  ``End`` comes once per bus, where RecIS called ``end`` after each ``train()`` and
``evaluate()``.

RecIS gives hooks no way to stop training (its ``Trainer`` stops at ``train_steps`` or when
the data runs out).  The wrapped hook gets one: ``self.request_stop(reason)`` from any of its
methods asks the bus to stop at the next step boundary (``bus.request_stop``), unless the hook
defines a ``request_stop`` of its own.  An exception from a method follows ``on_error``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import OnError
from .events import (
    AfterBackward,
    AfterData,
    AfterEpoch,
    AfterEval,
    AfterStep,
    AfterTrain,
    AfterWindow,
    BeforeEpoch,
    BeforeStep,
    BeforeWindow,
    End,
    Event,
    OutOfData,
    Start,
    WindowMode,
)
from .hook import Hook
from .priority import Priority, priority_value

if TYPE_CHECKING:
    from .bus import HookBus

__all__ = ["RecisHook", "from_recis"]

_ON_ERROR = ("raise", "log", "disable")


def _is_train(event: Event) -> dict[str, Any]:
    return {"is_train": event.is_train}


def _nothing(event: Event) -> dict[str, Any]:
    return {}


def _after_data(event: Event) -> dict[str, Any]:
    return {"is_train": event.is_train, "data": None}


def _after_backward(event: Event) -> dict[str, Any]:
    return {"is_train": True}


def _tensor(value: np.ndarray) -> Any:
    """A numeric array as a CPU tensor of its own (RecIS hooks were given tensors); other
    arrays (strings, objects) stay arrays."""
    if value.dtype == np.bool_ or np.issubdtype(value.dtype, np.number):
        return torch.from_numpy(value.copy())
    return value


def _after_step(event: Event) -> dict[str, Any]:
    assert isinstance(event, AfterStep)
    metrics: dict[str, Any] = {
        name: _tensor(value) if isinstance(value, np.ndarray) else value
        for name, value in event.metrics.items()
    }
    if event.is_train:
        metrics.setdefault("epoch", event.epoch)
    kwargs: dict[str, Any] = {
        "metrics": metrics,
        "global_step": torch.tensor(event.global_step, dtype=torch.int64),
        "is_train": event.is_train,
    }
    if not event.is_train:
        kwargs["eval_result"] = None
    return kwargs


# event -> (RecIS method, the keyword arguments RecIS's Trainer passes)
_CALLS: tuple[tuple[type[Event], str, Callable[[Event], dict[str, Any]]], ...] = (
    (Start, "start", _is_train),
    (WindowMode, "window_mode", _nothing),
    (BeforeEpoch, "before_epoch", _is_train),
    (AfterEpoch, "after_epoch", _is_train),
    (BeforeWindow, "before_window", _is_train),
    (AfterWindow, "after_window", _is_train),
    (BeforeStep, "before_step", _is_train),
    (AfterData, "after_data", _after_data),
    (AfterBackward, "after_backward", _after_backward),
    (AfterStep, "after_step", _after_step),
    (OutOfData, "out_off_data", _nothing),
    (AfterTrain, "after_train", _nothing),
    (AfterEval, "after_eval", _nothing),
    (End, "end", _nothing),  # is_train added from the last Start
)
RECIS_METHODS = tuple(name for _, name, _ in _CALLS)


class RecisHook(Hook):
    """A RecIS hook on the bus; build it with :func:`from_recis`."""

    def __init__(self, hook: object, *, on_error: OnError, priority: int | Priority) -> None:
        self.hook = hook
        self._on_error: OnError = on_error
        self._priority = priority
        self._is_train = True  # of the last Start, for end(is_train=...)
        # RecIS hooks have no stop route: give one, unless the hook has its own
        self._gives_stop = not callable(getattr(hook, "request_stop", None))

    @property
    def state_key(self) -> str:
        return f"from_recis({type(self.hook).__qualname__}@{id(self.hook):x})"

    def attach(self, bus: HookBus) -> None:
        hook = self.hook
        if self._gives_stop:  # bound to the bus this run is on (a Trainer opens one per call)
            hook.request_stop = bus.request_stop  # type: ignore[attr-defined]
        cls = type(hook).__qualname__
        if callable(getattr(hook, "end", None)):  # end(is_train=...) needs the last Start's
            bus.subscribe(Start, self._remember, priority=self._priority)
        for event_type, name, arguments in _CALLS:
            method = getattr(hook, name, None)
            if not callable(method):
                continue
            call = self._caller(method, arguments, event_type is End)
            call.__qualname__ = f"{cls}.{name}"  # errors and stats name the RecIS hook
            bus.subscribe(event_type, call, priority=self._priority, on_error=self._on_error)

    def _remember(self, event: Start) -> None:
        self._is_train = event.is_train

    def _caller(
        self, method: Callable[..., Any], arguments: Callable[[Event], dict[str, Any]], end: bool
    ) -> Callable[[Event], Any]:
        if end:

            def call(event: Event) -> Any:
                return method(is_train=self._is_train)

        else:

            def call(event: Event) -> Any:
                return method(**arguments(event))

        return call

    def __repr__(self) -> str:
        return f"<from_recis {type(self.hook).__qualname__}>"


def from_recis(
    hook: object,
    *,
    on_error: OnError = "raise",
    priority: int | str | Priority = Priority.NORMAL,
) -> RecisHook:
    """Wrap ``hook``, written against RecIS's ``recis.hooks.Hook``, for ``bus.add_hook`` or
    ``Trainer(hooks=[...])``.  Its methods run in-band at ``priority``; an exception from one
    is handled as ``on_error`` says (``"raise"``: ``HookError`` naming e.g.
    ``MyHook.after_step`` from the publish that ran it)."""
    if isinstance(hook, type):
        raise TypeError(
            f"from_recis(hook=...): expected a hook instance, got the class {hook.__name__} "
            f"(write from_recis({hook.__name__}(...)))"
        )
    if isinstance(hook, Hook):
        raise TypeError(
            f"from_recis(hook=...): expected a hook written for RecIS, got {hook!r}, which is "
            "a recis_async Hook already: pass it to add_hook directly"
        )
    if not any(callable(getattr(hook, name, None)) for name in RECIS_METHODS):
        raise TypeError(
            f"from_recis(hook=...): expected an object with RecIS hook methods "
            f"({', '.join(RECIS_METHODS)}), got {type(hook).__name__} with none of them"
        )
    if on_error not in _ON_ERROR:
        raise ValueError(
            f"from_recis(on_error=...): expected one of 'raise', 'log', 'disable', got {on_error!r}"
        )
    value = priority_value(priority, field="from_recis(priority=...)")
    return RecisHook(hook, on_error=on_error, priority=value)
