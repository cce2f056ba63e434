"""Lifecycle events: one frozen ``msgspec.Struct`` per mount point.

Each event maps 1:1 to a :class:`~recis_async.hook.Hook` method named as the class in
snake_case (``AfterStep`` -> ``Hook.after_step``).  Events hold plain values (ints, floats,
strings, dicts of those, and numpy arrays in ``AfterStep.trace``, tensors on their way to the
host as :class:`~recis_async.hostcopy.HostCopy` s in ``trace`` and ``tracked``); no tensors
are shared between hooks.  Users define their own events by subclassing :class:`Event`.

``LIFECYCLE`` lists the built-in events in the order a run publishes them; ``EndStatus`` is
how a run ended (``End.status``); ``NonNegativeInt`` is the checked ``int >= 0`` of steps,
epochs and counts.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal, get_args

import msgspec
import numpy as np

from .hostcopy import HostCopy

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
    "AfterOptimizerStep",
    "BeforeEpoch",
    "BeforeOptimizerStep",
    "BeforeSaveCheckpoint",
    "BeforeStep",
    "BeforeWindow",
    "End",
    "EndStatus",
    "Error",
    "Event",
    "NonNegativeInt",
    "OutOfData",
    "Start",
    "StepEvent",
    "TraceParts",
    "WindowMode",
    "method_name",
]

EndStatus = Literal["ok", "failed", "cancelled", "preempted"]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
"""An ``int >= 0`` (steps, epochs, counts); checked when an event is built."""


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every event.  Subclass it for custom events; subscribers of a base class
    receive its subclasses.

    Every field is checked against its annotation when the event is built (msgspec
    validates the fields of subclasses, including ``msgspec.Meta`` constraints such as
    ``Annotated[int, Meta(ge=0)]``): a bad value raises ``TypeError`` or ``ValueError``
    naming the event, the field, what was expected and what arrived.  A subclass that
    defines ``__post_init__`` calls ``super().__post_init__()`` first.
    """

    is_train: bool = True

    def __post_init__(self) -> None:
        _validate(self, Event)


class StepEvent(Event, frozen=True, kw_only=True):
    """An event inside a step; the trainer owns ``global_step`` and ``epoch``."""

    global_step: NonNegativeInt = 0
    local_step: NonNegativeInt = 0
    epoch: NonNegativeInt = 0

    def __post_init__(self) -> None:
        # Several of these are built every step: the checks are written out (cheaper than a
        # call per field or a generic msgspec check: benchmarks/README.md, "Event checks").
        v: Any = self.is_train
        if v is not True and v is not False:
            raise _bad(self, "is_train", "bool", v)
        v = self.global_step
        if type(v) is not int or v < 0:
            raise _bad(self, "global_step", "int >= 0", v)
        v = self.local_step
        if type(v) is not int or v < 0:
            raise _bad(self, "local_step", "int >= 0", v)
        v = self.epoch
        if type(v) is not int or v < 0:
            raise _bad(self, "epoch", "int >= 0", v)
        if type(self) not in _PLAIN_STEP_EVENTS:  # a subclass with fields of its own
            _validate(self, StepEvent)


class Start(Event, frozen=True, kw_only=True):
    """The run starts (published once by the trainer, or by the user's loop)."""


class WindowMode(Event, frozen=True, kw_only=True):
    """The dataset is consumed window by window (RecIS window IO mode)."""


class BeforeEpoch(Event, frozen=True, kw_only=True):
    epoch: NonNegativeInt = 0


class BeforeWindow(Event, frozen=True, kw_only=True):
    epoch: NonNegativeInt = 0
    window: NonNegativeInt = 0


class BeforeStep(StepEvent, frozen=True, kw_only=True):
    """A step begins; data loading for the step follows."""


class AfterData(StepEvent, frozen=True, kw_only=True):
    """The step's batch has been loaded (BeforeStep -> AfterData is the data wait)."""


class AfterBackward(StepEvent, frozen=True, kw_only=True):
    """Gradients of the step are computed.

    ``sync``: an optimizer step follows this micro-step (with gradient accumulation over
    ``k`` micro-steps, only every ``k``-th backward is followed by one; the gradients of the
    others are partial).  Hooks acting on final gradients subscribe to
    :class:`BeforeOptimizerStep` instead.
    """

    sync: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sync is not True and self.sync is not False:
            raise _bad(self, "sync", "bool", self.sync)


class BeforeOptimizerStep(StepEvent, frozen=True, kw_only=True):
    """The gradients are final: accumulated over the micro-steps and, under AMP, unscaled
    (``scaler.unscale_(optimizer)`` has run); clipping and ``optimizer.step()`` follow.

    Published once per optimizer step.  ``optimizers``: the optimizers about to step;
    ``scaler``: the ``torch.amp.GradScaler`` if any.  A loop of its own publishes it after
    ``scaler.unscale_(optimizer)`` and before ``scaler.step(optimizer)``::

        scaler.scale(loss).backward()
        await bus.publish(AfterBackward(global_step=g, sync=True))
        scaler.unscale_(optimizer)
        await bus.publish(BeforeOptimizerStep(global_step=g, optimizers=(optimizer,),
                                              scaler=scaler))
        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()
        await bus.publish(AfterOptimizerStep(global_step=g, optimizers=(optimizer,),
                                             scaler=scaler))

    The objects are shared, not copied: a hook may change the gradients (clipping does),
    nothing else.
    """

    optimizers: tuple[Any, ...] = ()
    scaler: Any = None


class AfterOptimizerStep(StepEvent, frozen=True, kw_only=True):
    """``optimizer.step()`` (and the scaler's update, the LR scheduler's step) ran; fields
    as in :class:`BeforeOptimizerStep`."""

    optimizers: tuple[Any, ...] = ()
    scaler: Any = None


class TraceParts(tuple[Any, ...]):
    """An ``AfterStep.trace`` column recorded by several ``add_to_trace`` calls in its step
    (each micro-batch of a step that accumulates gradients over several): what each call
    recorded, in call order; the column's rows are theirs, one after the other.  A column
    traced once is its value itself."""

    __slots__ = ()


class AfterStep(StepEvent, frozen=True, kw_only=True):
    """A step finished.

    ``metrics``, ``trace`` and ``tracked`` are filled by the bus from the step collectors
    (:func:`~recis_async.add_metric` and friends) merged with what the publisher passed;
    ``samples`` is the batch size, so throughput is samples/s.  ``metrics`` values are
    numbers, str, lists, numpy arrays or dense numeric tensors on any device (kept there:
    hooks accumulate them on the device and read them once per window, off the step, never
    on an ordinary step); ``tracked`` values numbers, lists or
    :class:`~recis_async.hostcopy.HostCopy` s (tensors on their way to the host); ``trace``
    values arrays, lists or ``HostCopy`` s of one entry per row (checked against the table by
    the trace hooks), or a :class:`TraceParts` of them for a column traced in parts.  A
    ``HostCopy`` is read with ``np.asarray(value)``, which waits for the device: do it in a
    worker thread, or once ``value.ready()``.  ``reduce`` maps a metric to how an evaluation
    pass combines it (``add_metric(..., reduce=...)``); metrics not named there are averaged,
    weighted by ``samples``.
    """

    samples: NonNegativeInt = 0
    metrics: dict[str, Any] = msgspec.field(default_factory=dict)
    trace: dict[str, Any] = msgspec.field(default_factory=dict)
    tracked: dict[str, Any] = msgspec.field(default_factory=dict)
    reduce: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Built once a step: written out as in StepEvent (whose checks are repeated here to
        # spare a call).  The bus merges the collectors' values without building it again.
        v: Any = self.is_train
        if v is not True and v is not False:
            raise _bad(self, "is_train", "bool", v)
        v = self.global_step
        if type(v) is not int or v < 0:
            raise _bad(self, "global_step", "int >= 0", v)
        v = self.local_step
        if type(v) is not int or v < 0:
            raise _bad(self, "local_step", "int >= 0", v)
        v = self.epoch
        if type(v) is not int or v < 0:
            raise _bad(self, "epoch", "int >= 0", v)
        v = self.samples
        if type(v) is not int or v < 0:
            raise _bad(self, "samples", "int >= 0", v)
        # the dicts: the common values inline, anything else through the slow check
        v = self.metrics
        if type(v) is not dict:
            _check_values(self, "metrics", v, _is_metric, _METRIC)
        elif v:
            for k, x in v.items():
                if type(k) is not str or (type(x) is not float and type(x) is not int):
                    if type(k) is str and _is_tensor(x) and _is_metric_tensor(x):
                        continue  # a device value, read off the step by the hooks
                    _check_values(self, "metrics", v, _is_metric, _METRIC)
                    break
        v = self.trace
        if type(v) is not dict:
            _check_values(self, "trace", v, _is_trace, _TRACE)
        elif v:
            for k, x in v.items():
                if type(k) is not str or (type(x) is not np.ndarray and type(x) is not HostCopy):
                    _check_values(self, "trace", v, _is_trace, _TRACE)
                    break
        v = self.tracked
        if type(v) is not dict:
            _check_values(self, "tracked", v, _is_tracked, _TRACKED)
        elif v:
            for k, x in v.items():
                if type(k) is not str or (
                    type(x) is not float and type(x) is not int and type(x) is not HostCopy
                ):
                    _check_values(self, "tracked", v, _is_tracked, _TRACKED)
                    break
        v = self.reduce
        if type(v) is not dict or v:  # rare: only add_metric(..., reduce=...) fills it
            _check_values(self, "reduce", v, _is_reduction, _REDUCE, ValueError)
        if type(self) is not AfterStep:
            _validate(self, AfterStep)


class OutOfData(StepEvent, frozen=True, kw_only=True):
    """The data iterator ran out after ``BeforeStep``: that step did not happen."""


class AfterTrain(Event, frozen=True, kw_only=True):
    global_step: NonNegativeInt = 0
    epoch: NonNegativeInt = 0


class AfterEval(Event, frozen=True, kw_only=True):
    """Evaluation finished.  ``metrics``: every metric of the pass's steps combined over the
    pass (and over ranks) as :class:`~recis_async.MetricAggregator` does (numbers or
    arrays); ``steps``: the evaluation steps this rank ran."""

    is_train: bool = False
    global_step: NonNegativeInt = 0
    steps: NonNegativeInt = 0
    metrics: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self, Event)
        if not _metrics_ok(self.metrics):
            _check_values(self, "metrics", self.metrics, _is_plain_metric, _PLAIN_METRIC)


class AfterWindow(Event, frozen=True, kw_only=True):
    epoch: NonNegativeInt = 0
    window: NonNegativeInt = 0


class AfterEpoch(Event, frozen=True, kw_only=True):
    epoch: NonNegativeInt = 0
    global_step: NonNegativeInt = 0


class BeforeSaveCheckpoint(Event, frozen=True, kw_only=True):
    global_step: NonNegativeInt = 0
    path: str = ""


class AfterLoadCheckpoint(Event, frozen=True, kw_only=True):
    """A checkpoint was restored; ``hook_states`` maps each hook's ``state_key`` to its state."""

    global_step: NonNegativeInt = 0
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
    global_step: NonNegativeInt | None = None


_PLAIN_STEP_EVENTS: Final = frozenset({StepEvent, BeforeStep, AfterData, AfterBackward, OutOfData})


# ---------------------------------------------------------------------------------------
# field checks


def _bad(event: object, field: str, expected: str, value: object) -> Exception:
    """``Owner(field=...): expected X, got Y``: a ``TypeError`` for a value of the wrong
    type, a ``ValueError`` for one of the right type out of range."""
    owner = type(event).__name__
    wrong_type = expected.split()[0] not in (type(value).__name__, "one")
    got = f"{type(value).__name__} {value!r:.80}" if wrong_type else f"{value!r:.80}"
    return (TypeError if wrong_type else ValueError)(
        f"{owner}({field}=...): expected {expected}, got {got}"
    )


_METRIC = "a dict of str -> number, str, list, numpy array or dense numeric tensor"
_PLAIN_METRIC = "a dict of str -> number, str, list or numpy array (values read already)"
_TRACE = "a dict of str -> numpy array, list or HostCopy (one entry per row), or TraceParts of them"
_TRACKED = "a dict of str -> number, list or HostCopy"
_REDUCE = "a dict of str -> 'mean', 'sum', 'max', 'min', 'last' or a callable"


def _is_plain_metric(value: object) -> bool:
    # whether a value suits its reduction is add_metric's and the aggregator's concern
    return isinstance(value, int | float | str | list | tuple | np.ndarray | np.generic)


def _is_metric(value: object) -> bool:
    if _is_tensor(value):
        return _is_metric_tensor(value)
    return _is_plain_metric(value)


def _is_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor.  torch is not imported here: a tracker's child
    process imports this module and must not pay for torch (where torch was never imported,
    nothing is a tensor)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


@functools.cache
def metric_dtypes() -> frozenset[Any]:
    """Tensor dtypes a metric may have (what a window can sum and compare, and numpy can hold
    once read; float8 and complex are not among them)."""
    import torch

    return frozenset(
        {
            torch.bool,
            torch.uint8,
            torch.int8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
        }
    )


def _is_metric_tensor(value: Any) -> bool:
    """A dense tensor holding numbers (checked without reading a value)."""
    return (
        not value.is_meta
        and not value.is_nested
        and value.layout is sys.modules["torch"].strided
        and value.dtype in metric_dtypes()
    )


def _is_reduction(value: object) -> bool:
    from .aggregate import REDUCTIONS  # aggregate imports this module

    return (isinstance(value, str) and value in REDUCTIONS) or (
        callable(value) and not isinstance(value, str)
    )


def _is_trace(value: object) -> bool:
    if type(value) is TraceParts:
        return all(isinstance(part, np.ndarray | list | HostCopy) for part in value)
    return isinstance(value, np.ndarray | list | HostCopy)


def _is_tracked(value: object) -> bool:
    return isinstance(value, int | float | list | HostCopy)


def _metrics_ok(values: dict[str, Any]) -> bool:
    """The common case, fast: str keys, float or int values."""
    for k, v in values.items():
        if type(k) is not str or (type(v) is not float and type(v) is not int):
            return False
    return True


def _check_values(
    event: Event,
    field: str,
    values: object,
    accepts: Callable[[object], bool],
    expected: str,
    error: type[Exception] = TypeError,
) -> None:
    """The slow path of a dict field: find the offending key or value and name it."""
    if not isinstance(values, dict):
        raise _bad(event, field, expected, values)
    for k, v in values.items():
        if not isinstance(k, str):
            raise TypeError(
                f"{type(event).__name__}({field}=...): expected {expected}, got key "
                f"{k!r} ({type(k).__name__})"
            )
        if not accepts(v):
            detail = f"{v.dtype} array" if isinstance(v, np.ndarray) else type(v).__name__
            shown = f"{v!r:.60}"
            if _is_tensor(v):  # named by what it is: its values are not read
                detail = f"{v.dtype} tensor"
                shown = f"(layout {v.layout}, device {v.device}, shape {tuple(v.shape)})"
            raise error(
                f"{type(event).__name__}({field}=...): expected {expected}, got {detail} "
                f"{shown} for {k!r}"
            )


def _validate(event: Event, since: type[Event]) -> None:
    """Check the fields ``type(event)`` declares beyond ``since``'s with msgspec.

    The check is a ``msgspec.convert`` into a plain Struct of those fields, built once per
    class on first use (annotations may name classes defined after the event).
    """
    cls = type(event)
    shadow = cls.__dict__.get("__event_shadow__", _UNBUILT)
    if shadow is _UNBUILT:
        shadow = _shadow(cls, since)
        type.__setattr__(cls, "__event_shadow__", shadow)
    if shadow is None:
        return
    try:
        msgspec.convert(event, shadow, from_attributes=True)
    except msgspec.ValidationError as exc:
        raise _translate(event, exc) from None


_UNBUILT: Final = object()


def _shadow(cls: type[Event], since: type[Event]) -> type[msgspec.Struct] | None:
    known = {f.name for f in msgspec.structs.fields(since)} if since is not Event else set()
    try:
        fields = msgspec.structs.fields(cls)
    except (NameError, TypeError) as exc:
        raise TypeError(f"{cls.__name__}: cannot resolve its field annotations ({exc})") from None
    own = [(f.name, f.type) for f in fields if f.name not in known]
    if not own:
        return None
    return msgspec.defstruct(f"{cls.__name__}Fields", own, kw_only=True)


_AT = re.compile(r" - at `(?P<path>.*)`$")
_FIELD = re.compile(r"\$\.(?P<field>\w+)")


def _translate(event: Event, exc: msgspec.ValidationError) -> Exception:
    """msgspec's ``Expected `int`, got `str` - at `$.count``` in the house style."""
    text = str(exc)
    at = _AT.search(text)
    path = at.group("path").replace("`", "") if at else ""
    message = text[: at.start()] if at else text
    found = _FIELD.search(path)
    owner = type(event).__name__
    if found is None:
        return ValueError(f"{owner}: {message}")
    field = found.group("field")
    value = getattr(event, field)
    where = "" if path == f"$.{field}" else f" at {path}"
    if message.startswith("Invalid enum value"):
        allowed = _literal_values(type(event), field)
        return ValueError(f"{owner}({field}=...): expected one of {allowed}, got {value!r:.80}")
    detail = message.replace("`", "")
    if not detail.startswith("Expected "):
        return ValueError(f"{owner}({field}=...): {detail}{where}, got {value!r:.80}")
    expected, wrong_type, got = detail[len("Expected ") :].partition(", got ")
    expected = _JSON_NAMES.get(expected, expected)
    if not wrong_type:  # the right type, out of range
        return ValueError(f"{owner}({field}=...): expected {expected}{where}, got {value!r:.80}")
    if where:
        got = f"{_JSON_NAMES.get(got, got)}{where} in {value!r:.80}"
    else:
        got = f"{type(value).__name__} {value!r:.80}"
    return TypeError(f"{owner}({field}=...): expected {expected}, got {got}")


# msgspec names JSON's kinds; the user wrote Python
_JSON_NAMES: Final = {"object": "dict", "array": "list"}


def _literal_values(cls: type[Event], field: str) -> str:
    for f in msgspec.structs.fields(cls):
        if f.name == field:
            args = [a for a in get_args(f.type) if a is not type(None)]
            flat = [x for a in args for x in (get_args(a) or (a,))]
            return ", ".join(repr(x) for x in flat)
    return "?"


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
    BeforeOptimizerStep,
    AfterOptimizerStep,
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
