"""Lifecycle events: one frozen ``msgspec.Struct`` per mount point.

Each event maps 1:1 to a :class:`~recis_async.hook.Hook` method named as the class in
snake_case (``AfterStep`` -> ``Hook.after_step``).  Events hold plain values (ints, floats,
strings, dicts of those, and numpy arrays in ``AfterStep.trace``); no tensors are shared
between hooks.  Users define their own events by subclassing :class:`Event`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

__all__ = [
    "LIFECYCLE",
    "AfterBackward",
    "AfterData",
    "AfterEpoch",
    "AfterEval",
    "AfterLoadCheckpoint",
    "AfterStep",
    "AfterTrain",
    "AfterWindow",
    "BeforeEpoch",
    "BeforeSaveCheckpoint",
    "BeforeStep",
    "BeforeWindow",
    "End",
    "EndStatus",
    "Error",
    "Event",
    "OutOfData",
    "Start",
    "StepEvent",
    "WindowMode",
    "method_name",
]

EndStatus = Literal["ok", "failed", "cancelled", "preempted"]
_END_STATUSES = ("ok", "failed", "cancelled", "preempted")


def _check_int(event: object, field: str) -> None:
    value = getattr(event, field)
    if type(value) is not int:  # bool and tensors are refused on purpose
        raise TypeError(
            f"{type(event).__name__}.{field}: expected int, got {type(value).__name__} ({value!r})"
        )


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every event.  Subclass it for custom events; subscribers of a base class
    receive its subclasses."""

    is_train: bool = True


class StepEvent(Event, frozen=True, kw_only=True):
    """An event inside a step; the trainer owns ``global_step`` and ``epoch``."""

    global_step: int = 0
    local_step: int = 0
    epoch: int = 0

    def __post_init__(self) -> None:
        _check_int(self, "global_step")
        _check_int(self, "local_step")
        _check_int(self, "epoch")


class Start(Event, frozen=True, kw_only=True):
    """The run starts (published once by the trainer, or by the user's loop)."""


class WindowMode(Event, frozen=True, kw_only=True):
    """The dataset is consumed window by window (RecIS window IO mode)."""


class BeforeEpoch(Event, frozen=True, kw_only=True):
    epoch: int = 0


class BeforeWindow(Event, frozen=True, kw_only=True):
    epoch: int = 0
    window: int = 0


class BeforeStep(StepEvent, frozen=True, kw_only=True):
    """A step begins; data loading for the step follows."""


class AfterData(StepEvent, frozen=True, kw_only=True):
    """The step's batch has been loaded (BeforeStep -> AfterData is the data wait)."""


class AfterBackward(StepEvent, frozen=True, kw_only=True):
    """Gradients of the step are computed."""


class AfterStep(StepEvent, frozen=True, kw_only=True):
    """A step finished.

    ``metrics``, ``trace`` and ``tracked`` are filled by the bus from the step collectors
    (:func:`~recis_async.add_metric` and friends) merged with what the publisher passed;
    ``samples`` is the batch size, so throughput is samples/s.  ``reduce`` maps a metric to
    how an evaluation pass combines it (``add_metric(..., reduce=...)``); metrics not named
    there are averaged, weighted by ``samples``.
    """

    samples: int = 0
    metrics: dict[str, Any] = msgspec.field(default_factory=dict)
    trace: dict[str, Any] = msgspec.field(default_factory=dict)
    tracked: dict[str, Any] = msgspec.field(default_factory=dict)
    reduce: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        StepEvent.__post_init__(self)
        _check_int(self, "samples")


class OutOfData(StepEvent, frozen=True, kw_only=True):
    """The data iterator ran out after ``BeforeStep``: that step did not happen."""


class AfterTrain(Event, frozen=True, kw_only=True):
    global_step: int = 0
    epoch: int = 0


class AfterEval(Event, frozen=True, kw_only=True):
    """Evaluation finished.  ``metrics``: every metric of the pass's steps combined over the
    pass (and over ranks) as :class:`~recis_async.MetricAggregator` does; ``steps``: the
    evaluation steps this rank ran."""

    is_train: bool = False
    global_step: int = 0
    steps: int = 0
    metrics: dict[str, Any] = msgspec.field(default_factory=dict)


class AfterWindow(Event, frozen=True, kw_only=True):
    epoch: int = 0
    window: int = 0


class AfterEpoch(Event, frozen=True, kw_only=True):
    epoch: int = 0
    global_step: int = 0


class BeforeSaveCheckpoint(Event, frozen=True, kw_only=True):
    global_step: int = 0
    path: str = ""


class AfterLoadCheckpoint(Event, frozen=True, kw_only=True):
    """A checkpoint was restored; ``hook_states`` maps each hook's ``state_key`` to its state."""

    global_step: int = 0
    path: str = ""
    hook_states: dict[str, Any] = msgspec.field(default_factory=dict)


class Error(Event, frozen=True, kw_only=True):
    """The body of ``async with HookBus()`` raised; published just before
    ``End(status="failed")``."""

    exc_type: str
    message: str


class End(Event, frozen=True, kw_only=True):
    """The run ends; published exactly once per bus."""

    status: EndStatus = "ok"
    global_step: int | None = None

    def __post_init__(self) -> None:
        if self.status not in _END_STATUSES:
            raise ValueError(
                f"End.status: expected one of {', '.join(_END_STATUSES)}, got {self.status!r}"
            )


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def method_name(event_type: type[Event]) -> str:
    """The :class:`Hook` method for ``event_type``: ``AfterStep`` -> ``"after_step"``."""
    return _CAMEL.sub("_", event_type.__name__).lower()


LIFECYCLE: tuple[type[Event], ...] = (
    Start,
    WindowMode,
    BeforeEpoch,
    BeforeWindow,
    BeforeStep,
    AfterData,
    AfterBackward,
    AfterStep,
    OutOfData,
    AfterTrain,
    AfterEval,
    AfterWindow,
    AfterEpoch,
    BeforeSaveCheckpoint,
    AfterLoadCheckpoint,
    Error,
    End,
)
"""The built-in events in the reference order of a run."""
