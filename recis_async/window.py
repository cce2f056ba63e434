"""Metrics kept on their device over a window and read once, off the step.

``add_metric(name, tensor)`` keeps a device copy; nothing on an ordinary step reads it (on a GPU
a read drains the device's queue).  The pieces here are what every consumer of
``AfterStep.metrics`` uses instead:

- the combining helpers (:func:`plus`, :func:`scaled`, :func:`larger`, :func:`smaller`): a sum,
  weighted sum, max or min of numbers, numpy arrays or tensors, computed on the tensor's device
  (one kernel launch, no read);
- :class:`MetricWindow`: per metric its step count, summed weight, weighted sum, min, max and
  last value over a window; :meth:`MetricWindow.take` hands the window over as a
  :class:`WindowSnapshot` and starts the next one;
- :func:`read_value` / :func:`read_values`: the one read of a window, to be called in a worker
  thread (or at a boundary that may wait): a tensor becomes a number (one element) or a numpy
  array, ``bfloat16``/``float16`` as float32;
- :class:`~recis_async.reads.ReadQueue` (``reads.py``) reads them in a worker thread, in
  order, and hands each result to the hook in the event loop.

Numbers stay Python numbers throughout (their fast path costs nothing more than before).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = [
    "STATS",
    "MetricWindow",
    "Stats",
    "WindowSnapshot",
    "has_tensor",
    "larger",
    "plus",
    "read_value",
    "read_values",
    "scaled",
    "smaller",
]

STATS = ("sum", "min", "max", "last")
"""What a :class:`MetricWindow` can keep per metric (count and weight are always kept)."""

_HALF = (torch.float16, torch.bfloat16)


def has_tensor(values: Iterable[Any]) -> bool:
    """Whether any of ``values`` is a tensor (a value to read off the step)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return True
    return False


def _summable(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype its sums keep: half precision as float32, bool as int64."""
    if t.dtype in _HALF:
        return t.float()
    if t.dtype is torch.bool:
        return t.long()
    return t


def _floating(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a floating dtype a weighted sum keeps (float32 for half, float64 for ints)."""
    if t.is_floating_point():
        return t.float() if t.dtype in _HALF else t
    return t.double() if t.device.type != "mps" else t.float()  # MPS has no float64


def _on(value: Any, like: torch.Tensor) -> torch.Tensor:
    """A numpy array as a tensor on ``like``'s device (a host-to-device copy, no read)."""
    return torch.as_tensor(value, device=like.device)


def scaled(value: Any, weight: float) -> Any:
    """``value * weight``; a tensor stays on its device (in a floating dtype)."""
    if isinstance(value, torch.Tensor):
        value = _floating(value)
        return value if weight == 1.0 else value * weight
    return value * weight


def plus(a: Any, b: Any) -> Any:
    """``a + b`` for numbers, arrays and tensors (on the tensor's device)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            a, b = b, a
        if isinstance(b, np.ndarray):
            b = _on(b, a)
        return torch.add(_summable(a), _summable(b) if isinstance(b, torch.Tensor) else b)
    return a + b


def larger(a: Any, b: Any) -> Any:
    """The element-wise max of two values (NaN wins, as ``numpy.maximum``)."""
    return _extreme(a, b, torch.maximum, np.maximum, "min")


def smaller(a: Any, b: Any) -> Any:
    """The element-wise min of two values (NaN wins, as ``numpy.minimum``)."""
    return _extreme(a, b, torch.minimum, np.minimum, "max")


def _extreme(a: Any, b: Any, on_device: Any, on_host: Any, bound: str) -> Any:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            a, b = b, a
        a = _summable(a)
        if isinstance(b, torch.Tensor):
            return on_device(a, _summable(b))
        if isinstance(b, np.ndarray):
            return on_device(a, _summable(_on(b, a)))
        return torch.clamp(a, **{bound: b})  # a number: no copy to the device
    return on_host(a, b)


def read_value(value: Any) -> Any:
    """``value`` on the host: a tensor as a number (one element) or a numpy array of its own
    (``bfloat16``/``float16`` as float32); anything with ``__array__`` that is not an array
    (a host copy still in flight) as a numpy array; other values unchanged.

    Blocking: on a GPU it waits for the device.  Call it in a worker thread, or at a boundary
    that may wait (the end of an evaluation pass, a save)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.dtype in _HALF:
            t = t.float()
        array = t.numpy(force=True)
        return array.reshape(()).item() if array.size == 1 else np.array(array)
    if not isinstance(value, np.ndarray | int | float | str) and hasattr(value, "__array__"):
        return np.asarray(value)
    return value


def read_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`read_value` of every value (blocking, as it is)."""
    return {name: read_value(value) for name, value in values.items()}


class Stats(NamedTuple):
    """One metric over a window, read: ``steps`` carried it, ``weight`` their summed
    weights (``AfterStep.samples``, 1 for a step without), ``sum`` the weighted sum,
    ``min`` / ``max`` / ``last`` as named (``None`` when the window did not keep them)."""

    steps: int
    weight: float
    sum: Any
    min: Any
    max: Any
    last: Any

    @property
    def mean(self) -> Any:
        """The weighted mean (``sum / weight``)."""
        return self.sum / self.weight


class _Stat:
    """One metric's running values; tensors stay on their device."""

    __slots__ = ("count", "last", "max", "min", "sum", "weight")

    def __init__(self) -> None:
        self.count = 0
        self.weight = 0.0
        self.sum: Any = None
        self.min: Any = None
        self.max: Any = None
        self.last: Any = None


class WindowSnapshot:
    """A window handed over by :meth:`MetricWindow.take` (or one step's values,
    :meth:`of`): its values may be device tensors until :meth:`read`."""

    __slots__ = ("_stats", "samples", "steps")

    def __init__(self, stats: dict[str, _Stat], steps: int, samples: int) -> None:
        self._stats = stats
        self.steps = steps
        self.samples = samples

    @classmethod
    def of(cls, metrics: Mapping[str, Any]) -> WindowSnapshot:
        """One step's metrics as a window of one step (its values as ``last``)."""
        stats = {}
        for name, value in metrics.items():
            stat = stats[name] = _Stat()
            stat.count, stat.weight, stat.last = 1, 1.0, value
        return cls(stats, 1, 0)

    def __bool__(self) -> bool:
        return bool(self._stats)

    @property
    def names(self) -> list[str]:
        return list(self._stats)

    def read(self) -> dict[str, Stats]:
        """Every metric's :class:`Stats` on the host (blocking: a worker thread's job)."""
        return {
            name: Stats(
                s.count,
                s.weight,
                read_value(s.sum),
                read_value(s.min),
                read_value(s.max),
                read_value(s.last),
            )
            for name, s in self._stats.items()
        }

    def read_last(self) -> dict[str, Any]:
        """Every metric's last value on the host (blocking)."""
        return {name: read_value(s.last) for name, s in self._stats.items()}


class MetricWindow:
    """Per metric, over the steps since the last :meth:`take`: the count, summed weight and
    what ``keep`` names of ``"sum"`` (weighted), ``"min"``, ``"max"``, ``"last"``.

    Numbers are combined in Python, tensors on their device (a kernel per kept statistic and
    step, never a read); :meth:`take` returns the window and starts the next, so its values
    can be read off the step (:meth:`WindowSnapshot.read` in a worker thread).  Values that
    are not numeric (a str kept with ``reduce="last"``) keep only ``last``.
    """

    __slots__ = ("_keep", "_samples", "_stats", "_steps")

    def __init__(self, keep: Iterable[str] = STATS) -> None:
        self._keep = frozenset(keep)
        unknown = self._keep - set(STATS)
        if unknown:
            raise ValueError(
                f"MetricWindow(keep=...): expected names among {STATS}, got {sorted(unknown)}"
            )
        self._stats: dict[str, _Stat] = {}
        self._steps = 0
        self._samples = 0

    @property
    def steps(self) -> int:
        """Steps added to the open window."""
        return self._steps

    def add(self, metrics: Mapping[str, Any], samples: int = 0) -> None:
        """Add one step's ``metrics`` (weighted by ``samples``; a step without counts 1)."""
        self._steps += 1
        self._samples += samples
        weight = float(samples) if samples > 0 else 1.0
        keep = self._keep
        for name, value in metrics.items():
            stat = self._stats.get(name)
            if stat is None:
                stat = self._stats[name] = _Stat()
            numeric = isinstance(value, int | float | np.ndarray | torch.Tensor)
            if numeric and "sum" in keep:
                w = scaled(value, weight)
                stat.sum = w if stat.sum is None else plus(stat.sum, w)
            if numeric and "min" in keep:
                stat.min = value if stat.min is None else smaller(stat.min, value)
            if numeric and "max" in keep:
                stat.max = value if stat.max is None else larger(stat.max, value)
            if "last" in keep:
                stat.last = value
            stat.count += 1
            stat.weight += weight

    def peek(self) -> WindowSnapshot:
        """The open window as it is now, left open (read it before the next :meth:`add`)."""
        return WindowSnapshot(dict(self._stats), self._steps, self._samples)

    def take(self) -> WindowSnapshot:
        """The open window (to read off the step); a new one starts empty."""
        snapshot = WindowSnapshot(self._stats, self._steps, self._samples)
        self._stats, self._steps, self._samples = {}, 0, 0
        return snapshot
