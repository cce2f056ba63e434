"""LaggedCopies: small device values copied to the host without blocking, read a few steps
later.

A per-step check of a device value (is the loss finite? did it jump?) cannot read it on the
step without draining the device's queue.  :meth:`LaggedCopies.put` instead starts a
non-blocking copy of the value into a row of a page-locked host buffer (allocated once, when
the first CUDA value comes, and reused)
and, on a CUDA device, records an event after it on the current stream; the value is resolved
``lag`` training steps later (:meth:`LaggedCopies.due`), when the device has usually finished
it long before.  If it has not, ``due`` waits for that event, polling it without blocking the
event loop: so the host runs at most ``lag`` steps ahead of the checked value, and the pipeline
keeps ``lag`` steps of work queued.  On the CPU the copy is a plain copy and there is no event:
the same code path, so the CPU tests exercise what a GPU runs.  Other devices (MPS, XPU) copy
synchronously.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import anyio
import numpy as np
import torch

from ._checks import positive_int

__all__ = ["Due", "LaggedCopies"]

_POLL = 0.0005  # seconds between two queries of a pending event


class Due(NamedTuple):
    """A value put ``lag`` steps ago, on the host: ``step`` as given to ``put``, ``value``
    the copied elements (a numpy array of the buffer's dtype), ``source`` the device tensor
    (to read in full when acting on it)."""

    step: int
    value: np.ndarray
    source: torch.Tensor


class _Pending(NamedTuple):
    tick: int
    step: int
    array: np.ndarray  # the host row's view (keeps its buffer alive)
    event: Any
    source: torch.Tensor


class LaggedCopies:
    """A ring of ``lag + 1`` host rows of ``width`` elements of ``dtype``.

    Call :meth:`tick` once per checked step, :meth:`put` with that step's value (any shape
    whose ``numel()`` is ``width``), then ``await`` :meth:`due` for the values put ``lag``
    ticks ago or earlier; :meth:`drain` resolves everything still pending (at the end of a
    run, before a save).
    """

    def __init__(self, owner: str, lag: int, dtype: torch.dtype, width: int = 1) -> None:
        self.lag = positive_int(owner, "lag", lag)
        self._dtype = dtype
        self._width = width
        self._pinned = False
        self._allocate(pinned=False)  # page-locked once a CUDA value comes (no context before)
        self._pending: deque[_Pending] = deque()
        self._ticks = 0

    def _allocate(self, pinned: bool) -> None:
        host = torch.empty((self.lag + 1, self._width), dtype=self._dtype, pin_memory=pinned)
        self._rows = list(host)
        self._arrays = list(host.numpy())  # the host view of each row, made once
        self._pinned = pinned

    def tick(self) -> None:
        """A checked step begins (values put now are due ``lag`` ticks later)."""
        self._ticks += 1

    def put(self, step: int, value: torch.Tensor, source: torch.Tensor | None = None) -> None:
        """Start copying ``value`` (``width`` elements) to the host, without reading it;
        ``source`` (default ``value``) is handed back with it in :class:`Due`."""
        row = self._ticks % len(self._rows)
        value = value.detach().reshape(self._width)
        if value.dtype != self._dtype:
            value = value.to(self._dtype)  # on its device
        event = None
        if value.device.type == "cuda":
            if not self._pinned:  # once: pending rows keep the old buffer alive
                self._allocate(pinned=True)
            self._rows[row].copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            self._rows[row].copy_(value)
        keep = value if source is None else source
        self._pending.append(_Pending(self._ticks, step, self._arrays[row], event, keep))

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def due(self) -> list[Due]:
        """The values put ``lag`` ticks ago or earlier, oldest first (waiting for the copy of
        any the device has not finished)."""
        out = []
        while self._pending and self._pending[0].tick <= self._ticks - self.lag:
            out.append(await self._resolve(self._pending.popleft()))
        return out

    def due_now(self) -> list[Due] | None:
        """:meth:`due` without waiting: ``None`` when a due value's copy is still in flight
        (then ``await`` :meth:`due`)."""
        limit = self._ticks - self.lag
        for p in self._pending:
            if p.tick > limit:
                break
            if p.event is not None and not p.event.query():
                return None
        out = []
        while self._pending and self._pending[0].tick <= limit:
            p = self._pending.popleft()
            out.append(Due(p.step, p.array.copy(), p.source))
        return out

    async def drain(self) -> list[Due]:
        """Every pending value, oldest first."""
        out = []
        while self._pending:
            out.append(await self._resolve(self._pending.popleft()))
        return out

    async def _resolve(self, p: _Pending) -> Due:
        if p.event is not None:
            while not p.event.query():  # never a synchronize: the loop keeps running
                await anyio.sleep(_POLL)
        return Due(p.step, p.array.copy(), p.source)
