"""NvtxHook: NVTX ranges per step, per phase and around the hooks, for Nsight Systems.

Run the job under ``nsys profile`` and the timeline shows, on the training thread::

    train step 12
      hooks BeforeStep | data | hooks AfterData | forward+backward | hooks AfterBackward |
      optimizer | hooks AfterStep

(evaluation steps: ``eval step N`` with ``forward``).  The phases are the spans between the
step events a loop publishes: data = ``BeforeStep`` -> ``AfterData``, forward+backward =
``AfterData`` -> ``AfterBackward``, optimizer (and whatever else the loop does) =
``AfterBackward`` -> ``AfterStep``; each event's own hooks get a ``hooks <Event>`` range, so
what the hooks cost is on the timeline beside what they measure.  Every other event
(``AfterEval``, ``BeforeSaveCheckpoint``, a custom one...) gets its ``hooks <Event>`` range
too.  A loop that publishes only some step events gets the ranges those events bound.

Ranges are host-side markers: nothing here synchronizes the device or reads a tensor, and the
process is never exited (RecIS's ``NvtxProfileHook`` synchronized before every operator and
ended the process after its window).  NVTX ranges nest per thread: every range is pushed and
popped by a subscriber, and the bus runs every subscriber on its event loop's thread (a
publish from a worker thread goes through ``anyio.from_thread``), so the stack stays balanced
on that one thread.  Without CUDA the hook says so once and does nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..events import (
    AfterBackward,
    AfterData,
    AfterStep,
    BeforeStep,
    End,
    Error,
    Event,
    OutOfData,
)
from ..hook import Hook
from ..priority import Priority

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = ["NvtxHook", "Ranges"]

logger = logging.getLogger(__name__)


class Ranges(Protocol):
    """What pushes and pops NVTX ranges: ``torch.cuda.nvtx`` is one."""

    def range_push(self, msg: str) -> Any: ...
    def range_pop(self) -> Any: ...


# What follows each step event's hooks: the phase it opens (None: the step ends).
_NEXT_PHASE: dict[type[Event], tuple[str, str] | None] = {
    BeforeStep: ("data", "data"),
    AfterData: ("forward+backward", "forward"),
    AfterBackward: ("optimizer", "optimizer"),
    AfterStep: None,
    OutOfData: None,
}


class NvtxHook(Hook):
    """Mark steps, their phases and the hooks of every event with NVTX ranges.

    Its subscribers run first (priority ``HIGHEST - 1``) and last (``LOWEST + 1``) on every
    event, so the ``hooks <Event>`` range spans all the other hooks.

    Args:
        ranges: what pushes and pops the ranges; default ``torch.cuda.nvtx`` where CUDA is
            available, else nothing (logged once).

    Raises:
        TypeError: ``ranges`` without callable ``range_push`` and ``range_pop``.
    """

    def __init__(self, ranges: Ranges | None = None) -> None:
        if ranges is not None and not all(
            callable(getattr(ranges, m, None)) for m in ("range_push", "range_pop")
        ):
            raise TypeError(
                f"NvtxHook(ranges=...): expected an object with range_push(msg) and "
                f"range_pop() (torch.cuda.nvtx) or None, got {ranges!r}"
            )
        if ranges is None and torch.cuda.is_available():
            ranges = torch.cuda.nvtx
        self.ranges = ranges
        self._open: list[str] = []  # the ranges pushed and not popped, outermost first
        self._step_open = False  # whether _open[0] is the step's range
        self._attached = False

    def __repr__(self) -> str:
        where = (
            "off (no CUDA)"
            if self.ranges is None
            else getattr(self.ranges, "__name__", type(self.ranges).__name__)
        )
        return f"<NvtxHook ranges={where}>"

    def attach(self, bus: HookBus) -> None:
        if self._attached:
            raise RuntimeError(f"{self!r} is already attached to a bus")
        self._attached = True
        if self.ranges is None:
            logger.info("NvtxHook: CUDA is not available; no NVTX ranges")
            return
        bus.subscribe(Event, self._first, priority=Priority.HIGHEST - 1)
        bus.subscribe(Event, self._last, priority=Priority.LOWEST + 1)

    def _push(self, name: str) -> None:
        assert self.ranges is not None
        self.ranges.range_push(name)
        self._open.append(name)

    def _pop_to(self, depth: int) -> None:
        assert self.ranges is not None
        while len(self._open) > depth:
            self._open.pop()
            self.ranges.range_pop()

    def _first(self, event: Event) -> None:
        kind = type(event)
        if isinstance(event, BeforeStep):
            self._pop_to(0)  # a step that never ended (a failed hook) is closed here
            self._push(f"{'train' if event.is_train else 'eval'} step {event.global_step}")
            self._step_open = True
        elif kind in _NEXT_PHASE:
            self._pop_to(1 if self._step_open else 0)  # the phase this event ends
        elif kind is Error or kind is End:  # the run ends: a step cut short ends with it
            self._pop_to(0)
            self._step_open = False
        self._push(f"hooks {kind.__name__}")

    def _last(self, event: Event) -> None:
        kind = type(event)
        if kind is End:
            self._pop_to(0)
            self._step_open = False
            return
        if kind not in _NEXT_PHASE:
            self._pop_to(max(len(self._open) - 1, 0))  # its hooks range
            return
        self._pop_to(1 if self._step_open else 0)
        phase = _NEXT_PHASE[kind]
        if phase is None:
            self._pop_to(0)
            self._step_open = False
        elif self._step_open:
            self._push(phase[0] if event.is_train else phase[1])
