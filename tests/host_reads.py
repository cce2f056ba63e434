"""Count host reads of tensor values: every call that makes the Python thread wait for a
tensor's value (on a GPU, a synchronization).

``HostReads`` is a ``torch.overrides.TorchFunctionMode``: inside ``with HostReads() as reads``
each ``item``, ``tolist``, ``numpy``, ``cpu``, ``to`` onto the CPU (from another device, or on a
CPU-only machine any ``to("cpu")``), ``__float__``, ``__int__``, ``__bool__``, ``__index__``,
``__array__`` and ``__format__`` of a tensor is recorded with the label set in ``reads.where``
(say, the step being run), and the call's place in the source.  The mode is per thread: reads in
a worker thread (a window read off the step) are not counted, as they do not hold the step.
While recording, the collectors (``add_metric`` and friends) treat CPU tensors as a GPU's: kept
unread, copied off the step (``recis_async.collect.READ_CPU_AT_CALL``), so that a CPU-only
machine checks the path a GPU takes.

Usage::

    with HostReads() as reads:
        for g in range(10):
            reads.where = g
            await one_step(g)
    assert reads.at(3) == []          # no read on an ordinary step
    assert len(reads.at(4)) == 1      # one on a log boundary
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from recis_async import collect

__all__ = ["HostReads", "Read"]

_READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "cpu",
        "__float__",
        "__int__",
        "__bool__",
        "__index__",
        "__array__",
        "__format__",
    }
)


class Read(NamedTuple):
    name: str
    where: Any
    source: str  # the innermost frame outside torch and this file, "file:line"
    callers: tuple[str, ...] = ()  # the frames around it, innermost first ("file:line func")


class HostReads(TorchFunctionMode):
    """Records the host reads of tensor values made in its ``with`` block (this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[Read] = []
        self.where: Any = None
        self._read_cpu_at_call: list[bool] = []

    def __enter__(self) -> HostReads:
        self._read_cpu_at_call.append(collect.READ_CPU_AT_CALL)
        setattr(collect, "READ_CPU_AT_CALL", False)  # noqa: B010  # a Final, patched for the test
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            setattr(collect, "READ_CPU_AT_CALL", self._read_cpu_at_call.pop())  # noqa: B010

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS or (name == "to" and _to_cpu(args, kwargs)):
            self.reads.append(Read(name, self.where, *_caller()))
        return func(*args, **kwargs)

    def at(self, where: Any) -> list[Read]:
        """The reads recorded under the label ``where``."""
        return [r for r in self.reads if r.where == where]


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device")
    if target is None:
        target = next((a for a in args[1:] if isinstance(a, str | torch.device)), None)
    if target is None:
        target = next((a.device for a in args[1:] if isinstance(a, torch.Tensor)), None)
    if target is None:
        return False
    return torch.device(target).type == "cpu"


def _caller() -> tuple[str, tuple[str, ...]]:
    """The innermost frame outside torch and this file, and the three frames around it."""
    frames = [
        f
        for f in reversed(traceback.extract_stack()[:-2])
        if "/torch/" not in f.filename and not f.filename.endswith("host_reads.py")
    ]
    if not frames:
        return "?", ()
    outer = tuple(f"{f.filename}:{f.lineno} {f.name}" for f in frames[1:4])
    return f"{frames[0].filename}:{frames[0].lineno}", outer
