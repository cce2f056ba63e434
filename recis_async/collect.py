"""Step-scoped collectors: ``add_metric``, ``add_to_trace``, ``add_to_ml_tracker``.

They write into the collector of the bus open in the current context (a contextvar set by
``async with HookBus()``).  The next published ``AfterStep`` carries what was collected and the
collector is cleared, so nothing leaks from one step (or from training into evaluation) to the
next.  There is no module-level mutable state: the RecIS global trace/metric maps are gone.

A tensor on a device (a GPU) is never read at the call: it is kept as a device copy
(``add_metric``) or copied to the host without waiting (``add_to_trace``,
``add_to_ml_tracker``; see :mod:`recis_async.hostcopy`).  A CPU tensor's values are in host
memory already -- its ops have run by the time it is passed, so reading it waits for nothing --
and it is read at the call instead: one element as its number, more as a numpy copy, which
costs the step far less than a tensor copy does here and in every hook after it
(benchmarks/README.md, "CPU tensors read at the call").
"""

from __future__ import annotations

import functools
from contextvars import ContextVar, Token
from numbers import Number
from typing import Any, Final

import msgspec
import numpy as np
import torch

from .aggregate import Reduction, check_reduction
from .events import AfterStep, TraceParts, metric_dtypes
from .hostcopy import DEFAULT_HOST_BUFFER_BYTES, HostBufferPool, HostCopy, held, resolved_dtype

__all__ = [
    "StepCollector",
    "add_metric",
    "add_to_ml_tracker",
    "add_to_trace",
    "bind",
    "current_collector",
    "unbind",
]


class StepCollector:
    """What one step collected; owned by one bus, with the pool of host buffers its tensors
    are copied into (``host``, see :mod:`recis_async.hostcopy`)."""

    __slots__ = ("host", "is_train", "metrics", "open", "reduce", "trace", "tracked")

    def __init__(self, host_buffer_bytes: int = DEFAULT_HOST_BUFFER_BYTES) -> None:
        self.metrics: dict[str, Any] = {}
        self.reduce: dict[str, Any] = {}  # only metrics added with a reduction other than mean
        self.trace: dict[str, Any] = {}
        self.tracked: dict[str, Any] = {}
        self.open = True
        self.is_train = True
        self.host = HostBufferPool(host_buffer_bytes, owner="HookBus host buffers")

    def begin_step(self, is_train: bool) -> None:
        """A step starts; values left from a step of the other kind (train vs eval) are
        dropped so evaluation never carries training values, and vice versa."""
        if is_train != self.is_train:
            self.is_train = is_train
            self.drop()

    def merged(self, event: AfterStep) -> AfterStep:
        """``event`` with the step's metrics, trace, tracked values and reductions merged in
        (a name the event carries itself keeps the event's value); the collector starts the
        next step empty.  Both sides were checked already (the event when built, the values
        by ``add_metric`` and friends), so the copy is filled in place of
        ``msgspec.structs.replace``, which would check them again.  The host copies of
        earlier steps go to the copy-out thread (see
        :meth:`~recis_async.hostcopy.HostBufferPool.next_step`)."""
        merged: AfterStep = event.__copy__()  # type: ignore[attr-defined]  # C, unstubbed
        fill = msgspec.structs.force_setattr
        # a field nothing was collected for keeps the event's own (frozen, shared) value, and
        # only what is handed over is replaced (an empty dict stays nobody else's)
        if metrics := self.metrics:
            fill(merged, "metrics", {**metrics, **event.metrics} if event.metrics else metrics)
            self.metrics = {}
        if trace := self.trace:
            fill(merged, "trace", {**trace, **event.trace} if event.trace else trace)
            self.trace = {}
        if tracked := self.tracked:
            fill(merged, "tracked", {**tracked, **event.tracked} if event.tracked else tracked)
            self.tracked = {}
        if reduce := self.reduce:
            fill(merged, "reduce", {**reduce, **event.reduce} if event.reduce else reduce)
            self.reduce = {}
        host = self.host
        if host.copies and host.busy:  # a job on the CPU never copies: nothing to hand over
            host.next_step()
        return merged

    def drop(self) -> None:
        """Forget what was collected (the step did not happen, or is of the other kind): the
        host copies nobody will see give their buffers back."""
        for values in (self.trace, self.tracked):
            for value in values.values():
                for part in value if type(value) is TraceParts else (value,):
                    if type(part) is HostCopy:
                        part.release()
        self.metrics, self.trace, self.tracked, self.reduce = {}, {}, {}, {}


#: Whether the collectors read CPU tensors at the call (see the module).  Tests that stand the
#: CPU in for a GPU, to check that the step reads no device value, set it false for their run
#: (``tests/host_reads.py``); nothing else changes it.
READ_CPU_AT_CALL: Final = True

_current: ContextVar[StepCollector | None] = ContextVar("recis_async_collector", default=None)
_STRIDED: Final = torch.strided
_METRIC_DTYPES: Final = metric_dtypes()
#: the dtypes a CPU trace column is held in as it is (add_to_trace), with numpy's for each:
#: the metric dtypes but bfloat16, which numpy lacks (it is copied as float32 at the call)
_HELD_DTYPES: Final = {
    dtype: resolved_dtype(dtype) for dtype in _METRIC_DTYPES if dtype is not torch.bfloat16
}


def bind(collector: StepCollector) -> Token[StepCollector | None]:
    """Make ``collector`` the one ``add_metric`` and friends write to in this context (the
    bus calls it when entered); :func:`unbind` with the token restores the previous one."""
    return _current.set(collector)


def unbind(token: Token[StepCollector | None]) -> None:
    """Undo the :func:`bind` that returned ``token`` (the bus calls it when left)."""
    _current.reset(token)


def current_collector(caller: str) -> StepCollector:
    """The collector of the bus open in this context, or a ``RuntimeError`` naming ``caller``."""
    collector = _current.get()
    if collector is None or not collector.open:
        raise RuntimeError(
            f"{caller}() called with no HookBus open: call it inside `async with HookBus() as bus:`"
        )
    return collector


def _check_name(caller: str, name: object) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{caller}(name=...): expected a non-empty str, got {name!r}")
    return name


def _scalar_or_array(caller: str, name: str, value: Any) -> Any:
    """Tensors and numpy values as plain numbers when they hold one element, else numpy copies."""
    if isinstance(value, torch.Tensor):
        _check_tensor(caller, name, value)
        value = value.detach()
        if value.numel() == 1:
            return value.item()
        if value.dtype in (torch.bfloat16, torch.float16):
            value = value.float()  # bfloat16 has no numpy dtype; half is kept as float32 too
        return _tensor_copy(caller, name, value)
    if isinstance(value, np.ndarray):
        return value.item() if value.size == 1 else value.copy()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _check_tensor(caller: str, name: str, value: torch.Tensor) -> None:
    """Tensors whose values cannot be read here: named, with what to do instead."""
    if value.is_meta:
        raise ValueError(
            f"{caller}({name!r}): expected a tensor holding data, got a tensor on the meta "
            f"device (shape {tuple(value.shape)}, no values to record)"
        )
    if value.is_nested:
        raise ValueError(
            f"{caller}({name!r}): expected a dense tensor, got a nested tensor "
            "(record its components, or .to_padded_tensor(0))"
        )
    if value.layout != torch.strided:
        raise ValueError(
            f"{caller}({name!r}): expected a dense tensor, got layout {value.layout} "
            "(convert it first with .to_dense())"
        )


def add_metric(name: str, value: Any, reduce: Reduction = "mean") -> None:
    """Record a metric for the current step (``AfterStep.metrics``): a number, a tensor, a
    numeric numpy array or a list of numbers.  Other plain values (a str, a non-numeric array)
    only with ``reduce="last"`` or a callable, which can combine them; anything else is
    refused here, naming the metric and the type.

    A tensor on a device is kept as ``value.detach().clone()`` on that device, of any shape
    and numeric dtype (``bfloat16``/``float16`` included): a device copy, never a read of its
    value, so later in-place updates do not leak and the step does not wait for the device.
    Hooks accumulate it on its device and read it once per window, off the step (float32 for
    the half-precision types; one element as a number, more as a numpy array).  A CPU tensor
    waits for nothing to be read, and is recorded as that number or array at the call.
    Numbers, numpy arrays and lists are kept on the host as they are.

    ``reduce`` says how the values of an evaluation pass combine into ``AfterEval.metrics``
    (Lightning's ``reduce_fx``): ``"mean"`` (weighted by ``AfterStep.samples``), ``"sum"``,
    ``"max"``, ``"min"``, ``"last"``, or a callable given every step's value as a 1-D numpy
    array; see :class:`~recis_async.aggregate.MetricAggregator`.
    """
    collector = _current.get()
    if collector is None or not collector.open:
        collector = current_collector("add_metric")  # raises, naming the call
    if type(name) is not str or not name:
        _check_name("add_metric", name)
    if reduce != "mean":
        reduce = check_reduction(f"add_metric({name!r}, reduce=...)", reduce)
    if (
        type(value) is torch.Tensor  # the common case: a loss on the CPU, read now
        and value.is_cpu
        and READ_CPU_AT_CALL
        and value.numel() == 1
        and value.dtype in _METRIC_DTYPES
        and value.layout is _STRIDED
    ):
        try:  # read here, not in a helper: every code path the step runs, it runs cold
            value = value.item()
        except NotImplementedError:  # a nested tensor, which none of the checks tells apart
            _check_tensor("add_metric", name, value)  # raises for what item() cannot read
            raise
    elif type(value) is torch.Tensor:
        if (
            value.is_meta
            or value.is_nested
            or value.layout is not _STRIDED
            or value.dtype not in _METRIC_DTYPES
        ):
            _check_metric_tensor(name, value)  # raises, naming what is wrong
        if value.is_cpu and READ_CPU_AT_CALL:  # host memory: the read waits for nothing
            value = value.item() if value.numel() == 1 else _host_array("add_metric", name, value)
        else:  # on a device: a copy, no read (``loss.detach()`` needs no second detach)
            value = (value.detach() if value.requires_grad else value).clone()
    elif type(value) is not float and type(value) is not int:  # the common case, kept cheap
        value = _metric_value(name, value, reduce)
    collector.metrics[name] = value
    if reduce != "mean":
        collector.reduce[name] = reduce
    elif collector.reduce:
        collector.reduce.pop(name, None)


def _host_array(caller: str, name: str, value: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as an owned numpy array; float32 for the half-precision types,
    as a window reads them."""
    if value.dtype in (torch.bfloat16, torch.float16):
        value = value.detach().float()
    return _tensor_copy(caller, name, value)


def _check_metric_tensor(name: str, value: torch.Tensor) -> None:
    """A tensor ``add_metric`` cannot keep: named at the call (no value is read)."""
    _check_tensor("add_metric", name, value)
    if value.dtype not in metric_dtypes():
        raise TypeError(
            f"add_metric({name!r}): expected a number, tensor, numeric numpy array or list of "
            f"numbers (a str or other array needs reduce='last' or a callable), got Tensor of "
            f"dtype {value.dtype} (shape {tuple(value.shape)}; convert it first, e.g. .float())"
        )


def _metric_value(name: str, value: Any, reduce: Reduction) -> Any:
    if isinstance(value, torch.Tensor):  # a subclass (a Parameter, say): kept as its data
        _check_metric_tensor(name, value)
        return value.detach().clone().as_subclass(torch.Tensor)
    converted = value
    if isinstance(value, list | tuple):
        try:
            converted = np.asarray(value) if value else np.zeros(0)
        except ValueError:  # ragged
            converted = None
    converted = _scalar_or_array("add_metric", name, converted)
    if isinstance(converted, np.ndarray) and converted.dtype.kind in "biuf":
        return converted
    if isinstance(converted, int | float):
        return converted
    numeric_reduce = isinstance(reduce, str) and reduce != "last"
    if not numeric_reduce and isinstance(converted, str | np.ndarray):
        return converted  # e.g. a tag kept with reduce="last"
    what = type(value).__name__
    if isinstance(value, np.ndarray | torch.Tensor):
        what = f"{what} of dtype {value.dtype}"
    raise TypeError(
        f"add_metric({name!r}): expected a number, tensor, numeric numpy array or list of "
        f"numbers (a str or other array needs reduce='last' or a callable), got {what} "
        f"({value!r:.60})"
    )


def add_to_trace(name: str, value: Any) -> None:
    """Record a trace column for the current step (``AfterStep.trace``): a tensor, numpy array
    or list, one entry per row.  The value is the one at this call: later in-place updates do
    not leak.

    A tensor on a device starts a non-blocking copy into a host buffer of the bus's pool and
    is recorded as a :class:`~recis_async.hostcopy.HostCopy` (resolved off the step; see
    :mod:`recis_async.hostcopy`).  A dense CPU tensor is cloned and recorded as a
    ``HostCopy`` of the clone, resolved off the step as well (numpy's conversion and copy
    would cost the step more than the clone); CPU tensors of other kinds (``bfloat16`` as
    ``float32``), numpy arrays and lists are copied as numpy arrays.

    A column traced again before the step's ``AfterStep`` gets the new rows after the earlier
    ones, as a step over several micro-batches (gradient accumulation; a Hugging Face
    ``Trainer`` step) traces each: its ``AfterStep.trace`` then holds a
    :class:`~recis_async.events.TraceParts` of the values in call order.  A masked numpy
    array is refused if any entry is masked (trace rows have no missing values)."""
    collector = _current.get()
    if collector is None or not collector.open:
        collector = current_collector("add_to_trace")  # raises, naming the call
    if type(name) is not str or not name:
        _check_name("add_to_trace", name)
    if name in collector.trace:  # traced again in this step: rows after the earlier ones
        _trace_again(collector.trace, name, value)
        return
    # the hot path is kept short on purpose (it runs every step, right after the model's
    # compute, when Python's code -- and numpy's -- is out of cache): a dense CPU tensor of
    # a dtype numpy has is cloned and held, read off the step (hostcopy.held); every other
    # kind (sparse, nested, bfloat16, no numpy dtype) takes the checked way below
    if (
        type(value) is torch.Tensor
        and value.is_cpu
        and READ_CPU_AT_CALL
        and (dtype := _HELD_DTYPES.get(value.dtype)) is not None
        and value.layout is _STRIDED
        and not value.is_nested
    ):
        if not value.shape:
            raise ValueError(
                f"add_to_trace({name!r}): expected one entry per row (1-D or 2-D), got a scalar"
            )
        collector.trace[name] = held(
            (value.detach() if value.requires_grad else value).clone(), dtype
        )
        return
    if isinstance(value, torch.Tensor):
        _check_tensor("add_to_trace", name, value)
        if value.dim() == 0:
            raise ValueError(
                f"add_to_trace({name!r}): expected one entry per row (1-D or 2-D), got a scalar"
            )
        if not (value.is_cpu and READ_CPU_AT_CALL):
            collector.trace[name] = _host_copy(collector, "add_to_trace", name, value)
            return
        array = _tensor_copy("add_to_trace", name, value)
    elif isinstance(value, np.ma.MaskedArray):
        array = _unmasked(name, value)
    elif isinstance(value, np.ndarray):
        array = value.copy()
    elif isinstance(value, list):
        array = _list_array(value)
    else:
        raise ValueError(
            f"add_to_trace({name!r}): expected a torch.Tensor, numpy.ndarray or list, "
            f"got {type(value).__name__}"
        )
    if array.ndim == 0:
        raise ValueError(
            f"add_to_trace({name!r}): expected one entry per row (1-D or 2-D), got a scalar"
        )
    array.setflags(write=False)  # ours alone: hooks may keep it without another copy
    collector.trace[name] = array


def _trace_again(trace: dict[str, Any], name: str, value: Any) -> None:
    """Record ``value`` as ``add_to_trace`` does, as the next part of column ``name``: the
    column becomes a :class:`~recis_async.events.TraceParts`; a value refused leaves the
    column as it was."""
    earlier = trace.pop(name)
    try:
        add_to_trace(name, value)
    except BaseException:
        trace[name] = earlier
        raise
    part = trace[name]
    trace[name] = TraceParts((*earlier, part) if type(earlier) is TraceParts else (earlier, part))


def _host_copy(collector: StepCollector, caller: str, name: str, value: torch.Tensor) -> HostCopy:
    """Start the copy of a checked tensor into the bus's host buffers (no wait, no read)."""
    try:
        return collector.host.copy(value)
    except ValueError:  # only a dtype without a numpy equivalent
        raise ValueError(
            f"{caller}({name!r}): expected a tensor of a numpy-compatible dtype, "
            f"got {value.dtype} (convert it first, e.g. .float())"
        ) from None


def _unmasked(name: str, value: np.ma.MaskedArray) -> np.ndarray:
    """A masked array's data, if nothing is masked; else refused (its mask would be dropped)."""
    masked = int(np.ma.count_masked(value))
    if masked:
        raise ValueError(
            f"add_to_trace({name!r}): expected values without missing entries, got a masked "
            f"array with {masked} of {value.size} entries masked (trace columns hold no "
            "missing values): fill them first, e.g. value.filled(0)"
        )
    return np.array(value.data)  # a plain ndarray copy


def _list_array(value: list[Any] | tuple[Any, ...]) -> np.ndarray:
    """A list as an array; ragged rows as an object array of rows.  Text stays Python
    objects: numpy's fixed-width ``U``/``S`` arrays drop trailing NUL characters."""
    try:
        array = np.asarray(value)
    except ValueError:  # ragged rows (for an array<...> column), or non-UTF-8 bytes beside str
        array = np.empty(len(value), dtype=object)
        for i, row in enumerate(value):
            array[i] = _list_array(row) if isinstance(row, (list, tuple)) else row
        return array
    if array.dtype.kind in "SU":
        array = np.array(value, dtype=object)
    return array


def _tensor_copy(caller: str, name: str, value: torch.Tensor) -> np.ndarray:
    """A numpy copy of a checked tensor (see :func:`_check_tensor`): detached, on the CPU,
    conjugation and negation resolved (``numpy(force=True)`` does all three)."""
    if value.dtype is torch.bfloat16:  # no numpy dtype: float32 holds every bfloat16 exactly
        value = value.detach().float()
    try:
        return value.numpy(force=True).copy()
    except TypeError:  # no numpy dtype (a float8 tensor, say)
        raise ValueError(
            f"{caller}({name!r}): expected a tensor of a numpy-compatible dtype, "
            f"got {value.dtype} (convert it first, e.g. .float())"
        ) from None


@functools.cache
def _resolved(dtype: torch.dtype) -> Any:
    """``resolved_dtype``, once per dtype (a pure function: the step looks it up)."""
    return resolved_dtype(dtype)


def add_to_ml_tracker(name: str, value: Any) -> None:
    """Record a value for the experiment tracker (``AfterStep.tracked``): a number, tensor,
    numpy array or list; arrays become lists.  A tensor on a device is copied to the host
    without waiting (a :class:`~recis_async.hostcopy.HostCopy`, as for :func:`add_to_trace`)
    and converted to the tracker's float off the step: one element as a number, more as an
    array; a CPU tensor (nothing to wait for) is converted at the call."""
    collector = _current.get()
    if collector is None or not collector.open:
        collector = current_collector("add_to_ml_tracker")  # raises, naming the call
    if type(name) is not str or not name:
        _check_name("add_to_ml_tracker", name)
    if type(value) is float or type(value) is int:  # the common case, kept cheap on the step
        collector.tracked[name] = value
        return
    if (
        type(value) is torch.Tensor  # the common case: a loss on the CPU, read now
        and value.is_cpu
        and READ_CPU_AT_CALL
        and value.numel() == 1
        and value.dtype in _METRIC_DTYPES
        and value.layout is _STRIDED
    ):
        try:  # as in add_metric
            collector.tracked[name] = value.item()
        except NotImplementedError:
            _check_tensor("add_to_ml_tracker", name, value)
            raise
        return
    if isinstance(value, torch.Tensor):
        _check_tensor("add_to_ml_tracker", name, value)
        resolved = _resolved(value.dtype)
        if resolved is not None and resolved.kind not in "biuf":
            raise ValueError(
                f"add_to_ml_tracker({name!r}): expected a tensor of real numbers, got {value.dtype}"
            )
        if not (value.is_cpu and READ_CPU_AT_CALL):
            collector.tracked[name] = _host_copy(collector, "add_to_ml_tracker", name, value)
            return
        if value.numel() == 1:  # the common case (a loss): its number
            collector.tracked[name] = value.item()
            return
    converted = _scalar_or_array("add_to_ml_tracker", name, value)
    if isinstance(converted, np.ndarray):
        converted = converted.tolist()
    if not isinstance(converted, Number | list):
        raise ValueError(
            f"add_to_ml_tracker({name!r}): expected a number, tensor, numpy array or list, "
            f"got {type(value).__name__}"
        )
    collector.tracked[name] = converted
