"""The trainer's cross-rank agreement at step boundaries, started at one boundary and read at
the next, so that no step waits for the other ranks.

At each boundary every rank offers a value -- :data:`CONTINUE`, :data:`END_PASS` (it will lack
a batch) or :data:`STOP` (its bus should stop) -- and the maximum over ranks is what all of
them do.  The collective is an ``all_reduce(MAX)`` started with ``async_op=True`` on a group of
its own that runs on the CPU (gloo, see :func:`recis_async.dist.control_group`): it never
touches an accelerator, so reading it never waits for the device either, and it does not mix
with the job's gradient collectives or the checkpoint barriers.  Its result is read at the
next boundary, where the other ranks have, in the common case, long since joined: the read
is a look at a finished buffer.  When it has not finished, the wait runs in a worker thread,
bounded by ``timeout``.

The price is one step of lag: what a rank offers after step ``k`` is acted on by every rank
after step ``k + 1``.  The trainer therefore offers, after step ``k``, whether it holds the
batch of step ``k + 2`` (it reads that far ahead), and a stop requested in step ``k`` on some
ranks stops every rank after step ``k + 1``.  A rank that stops waits for the outcome at once
(:meth:`Agreement.peek`; it is leaving the loop, there is no step to keep busy): when every
rank offered to stop at the same boundary (a :class:`~recis_async.hooks.StopAtStepHook`, a
signal to the whole job between the same two steps) they all stop there, without the lag.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import anyio
import anyio.to_thread
import numpy as np
import torch

from . import dist

__all__ = ["CONTINUE", "END_PASS", "STOP", "Agreement", "Decision"]

CONTINUE, END_PASS, STOP = 0, 1, 2


class Decision(NamedTuple):
    """What every rank does: the maximum offer, a failed rank + 1 (the highest when several
    failed; 0: none), and the minimum offer (equal to ``value`` when every rank offered the
    same)."""

    value: int
    failed: int
    low: int


class _Pending(NamedTuple):
    work: Any
    values: np.ndarray  # the reduced values land here (the tensor is a view of it)
    step: int


class Agreement:
    """One in-flight agreement at a time over ``group``; see the module docstring.

    Args:
        group: the process group (from :func:`recis_async.dist.control_group`).
        timeout: seconds a read waits for the other ranks before naming this rank and failing.
    """

    def __init__(self, group: Any, timeout: float) -> None:
        self.group = group
        self.timeout = timeout
        self._pending: _Pending | None = None
        self._early: Decision | None = None  # the pending one's outcome, read by peek()

    @property
    def pending(self) -> bool:
        """Whether an agreement was started and not yet read."""
        return self._pending is not None

    def settled(self) -> bool:
        """Whether no collective of this agreement is in flight: none was started and left
        unread, or the one that was has completed (its group may then be released)."""
        return self._pending is None or bool(self._pending.work.is_completed())

    def start(self, offer: int, step: int) -> None:
        """Offer ``offer`` for the boundary after ``step`` (no wait: the collective runs in the
        background)."""
        if self._pending is not None:
            raise RuntimeError("Agreement.start: the previous agreement was not read")
        self._pending = self._launch([offer, 0, -offer], step)

    async def peek(self) -> Decision:
        """Wait for the pending agreement now; :meth:`result` then returns the same outcome."""
        if self._early is None:
            self._early = await self._read()
        return self._early

    async def result(self) -> Decision:
        """The pending agreement's outcome (waited for in a worker thread when it has not
        completed yet); no agreement is pending afterwards.

        Raises:
            RuntimeError: no agreement pending; another rank announced it failed (named).
            TimeoutError: the other ranks did not join within ``timeout`` (naming this rank).
        """
        try:
            return self._early if self._early is not None else await self._read()
        finally:
            self._pending = self._early = None

    async def _read(self) -> Decision:
        pending = self._pending
        if pending is None:
            raise RuntimeError("Agreement.result: no agreement pending")
        what = f"the stop agreement at global_step {pending.step}"
        if pending.work.is_completed():
            dist.wait_work(pending.work, self.timeout, what)  # returns at once; raises a failed one
        else:
            await anyio.to_thread.run_sync(
                functools.partial(dist.wait_work, pending.work, self.timeout, what)
            )
        values = pending.values
        decision = Decision(int(values[0]), int(values[1]), -int(values[2]))
        if decision.failed:
            self._pending = None
            raise RuntimeError(
                f"rank {decision.failed - 1} failed in the step at global_step {pending.step}; "
                f"rank {dist.get_rank()} stops with it"
            )
        return decision

    async def now(self, offer: int, step: int) -> Decision:
        """Agree on ``offer`` and wait for the outcome (at a pass's start or end)."""
        if self._pending is not None:
            await self.result()
        self.start(offer, step)
        return await self.result()

    async def announce_failure(self, rank: int, timeout: float) -> None:
        """Tell the other ranks this one failed: its offer in their next agreement names it.
        Waits at most ``timeout`` seconds; shielded from cancellation."""
        self._pending = self._early = None  # an unread one completes: the others joined it
        pending = self._launch([STOP, rank + 1, -STOP], -1)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(
                functools.partial(
                    dist.wait_work, pending.work, timeout, "announcing this rank's failure"
                )
            )

    def _launch(self, values: list[int], step: int) -> _Pending:
        import torch.distributed as tdist

        buffer = np.array(values, dtype=np.int64)
        work = tdist.all_reduce(
            torch.from_numpy(buffer), op=tdist.ReduceOp.MAX, group=self.group, async_op=True
        )
        return _Pending(work, buffer, step)

