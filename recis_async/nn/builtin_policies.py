"""The built-in policies: ``ReadOnly`` admission and ``GlobalStepFilter`` eviction."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import _memory
from .policy import AdmitPolicy, FilterPolicy

__all__ = ["ReadOnly", "GlobalStepFilter"]

_FREE = torch.iinfo(torch.int64).max  # stamp of a free slot: never older than any step


class ReadOnly(AdmitPolicy):
    """Never inserts: unseen ids read as zeros (for serving, or freezing a table)."""

    def admit(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ids.shape, dtype=torch.bool)


class GlobalStepFilter(FilterPolicy):
    """Evicts an id iff ``global_step - last_seen > filter_step``.

    ``last_seen`` is the clock value of the latest *training* lookup of the id (insertion
    counts); eval lookups do not stamp.

    Args:
        filter_step: training steps an id may go unseen before it is evicted.

    Raises:
        ValueError: a ``filter_step`` that is not an int >= 0.
    """

    state_keys = ("last_seen", "clock")

    def __init__(self, filter_step: int) -> None:
        if type(filter_step) is not int or filter_step < 0:
            raise ValueError(
                f"GlobalStepFilter.filter_step: expected an int >= 0, got {filter_step!r}"
            )
        self.filter_step = filter_step
        self._step = 0
        self._last_seen = torch.empty(0, dtype=torch.int64)

    @property
    def step(self) -> int:
        return self._step

    def advance(self, global_step: int) -> None:
        self._step = int(global_step)

    def resize(self, capacity: int) -> None:
        old = self._last_seen
        self._last_seen = _memory.zeros((capacity,), torch.int64).fill_(_FREE)
        keep = min(capacity, old.numel())
        self._last_seen[:keep] = old[:keep]

    def touch(self, slots: torch.Tensor) -> None:
        self._last_seen[slots] = self._step

    def release(self, slots: torch.Tensor) -> None:
        self._last_seen[slots] = _FREE

    def snapshot(self, start: int, stop: int) -> torch.Tensor:
        return self._last_seen[start:stop].clone()

    def expired(self, snapshot: torch.Tensor, now: int) -> torch.Tensor:
        # now - last_seen > filter_step, written so that the _FREE stamp cannot overflow
        return snapshot < now - self.filter_step

    def still_expired(self, slots: torch.Tensor, now: int) -> torch.Tensor:
        return self._last_seen[slots] < now - self.filter_step

    def state(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "last_seen": self._last_seen[slots].clone(),
            "clock": torch.tensor(self._step, dtype=torch.int64),
        }

    def load_state(self, slots: torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
        last_seen, clock = state["last_seen"], state["clock"]
        if last_seen.dtype != torch.int64 or last_seen.shape != slots.shape:
            raise ValueError(
                f"filter_last_seen: expected int64 of shape {tuple(slots.shape)}, "
                f"got {last_seen.dtype} of shape {tuple(last_seen.shape)}"
            )
        if clock.numel() != 1:
            raise ValueError(f"filter_clock: expected a scalar, got shape {tuple(clock.shape)}")
        self._last_seen[slots] = last_seen
        self._step = int(clock)

    @property
    def nbytes(self) -> int:
        return self._last_seen.nbytes
