"""The Hook base class: one method per lifecycle event, subscribed by ``bus.add_hook``."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import OnError
from .events import (
    AfterBackward,
    AfterData,
    AfterEpoch,
    AfterEval,
    AfterLoadCheckpoint,
    AfterOptimizerStep,
    AfterStep,
    AfterTrain,
    AfterWindow,
    BeforeEpoch,
    BeforeOptimizerStep,
    BeforeSaveCheckpoint,
    BeforeStep,
    BeforeWindow,
    End,
    Error,
    OutOfData,
    Start,
    WindowMode,
)
from .priority import Priority
from .subscription import Filters

if TYPE_CHECKING:
    from .bus import HookBus

__all__ = ["Hook"]


class Hook:
    """Base class for hooks.

    Override the methods for the events you handle; each receives the event and may be a plain
    or an ``async`` method.  ``bus.add_hook(hook)`` subscribes exactly the overridden methods
    (and methods named after custom :class:`~recis_async.events.Event` subclasses, e.g.
    ``eval_probe`` for ``EvalProbe``) with the class's ``priority`` and ``on_error``.  Hooks
    with ``rank_zero_only = True`` are added on rank 0 only.

    Slow work belongs in a background service started from :meth:`attach`.
    """

    priority: ClassVar[int | Priority] = Priority.NORMAL
    on_error: ClassVar[OnError] = "raise"
    rank_zero_only: bool = False  # an instance may override it (LoggerHook(all_reduce=True))
    #: Subscription filters by method name (``{"after_step": Filters(every=10, when=...)}``):
    #: a hook whose method runs on a plain cadence lets the bus count it, as for any
    #: subscriber, instead of counting itself.  Set it in ``__init__``; read by ``add_hook``.
    subscription_filters: Mapping[str, Filters] = MappingProxyType({})

    @property
    def state_key(self) -> str:
        """Key of this hook's state in checkpoints; unique per bus."""
        return type(self).__name__

    def attach(self, bus: HookBus) -> None:
        """Called once by ``bus.add_hook`` after subscribing; start background services here."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (plain values and tensors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def outputs(self) -> dict[str, str]:
        """Where this hook writes, ``{what: where}``: an absolute path, or a table and its
        partition; never credentials.  The bus logs each entry at INFO when the hook is added
        and again, as a summary, when it closes (called again then: it may be more precise)."""
        return {}

    # One method per event.  The base versions do nothing and are never subscribed.
    def start(self, event: Start) -> Any: ...
    def window_mode(self, event: WindowMode) -> Any: ...
    def before_epoch(self, event: BeforeEpoch) -> Any: ...
    def before_window(self, event: BeforeWindow) -> Any: ...
    def before_step(self, event: BeforeStep) -> Any: ...
    def after_data(self, event: AfterData) -> Any: ...
    def after_backward(self, event: AfterBackward) -> Any: ...
    def before_optimizer_step(self, event: BeforeOptimizerStep) -> Any: ...
    def after_optimizer_step(self, event: AfterOptimizerStep) -> Any: ...
    def after_step(self, event: AfterStep) -> Any: ...
    def out_of_data(self, event: OutOfData) -> Any: ...
    def after_train(self, event: AfterTrain) -> Any: ...
    def after_eval(self, event: AfterEval) -> Any: ...
    def after_window(self, event: AfterWindow) -> Any: ...
    def after_epoch(self, event: AfterEpoch) -> Any: ...
    def before_save_checkpoint(self, event: BeforeSaveCheckpoint) -> Any: ...
    def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> Any: ...
    def error(self, event: Error) -> Any: ...
    def end(self, event: End) -> Any: ...

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


# Attributes of Hook that are API, not event handlers, even if an event class maps onto them.
RESERVED_NAMES = frozenset(
    {
        "attach",
        "state_dict",
        "load_state_dict",
        "outputs",
        "state_key",
        "priority",
        "on_error",
        "rank_zero_only",
    }
)
