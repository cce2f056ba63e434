"""The two policy interfaces a hash table consults: admission and filtering (eviction).

A table builds one policy object per table from an :class:`~recis_async.nn.AdmitHook` /
:class:`~recis_async.nn.FilterHook` description, so policy state (for example the step each
id was last seen) lives and dies with its table.  Every method is called with the table's
lock held unless its docstring says otherwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

__all__ = ["AdmitPolicy", "FilterPolicy"]


class AdmitPolicy(ABC):
    """Decides which unseen ids a training lookup inserts.

    Subclasses take their parameters as keyword arguments (from ``AdmitHook.params``) and
    raise ``ValueError`` naming the parameter when one is invalid.
    """

    @abstractmethod
    def admit(self, ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask over ``ids`` (distinct, unseen, 1-D int64): True inserts the id.

        Ids left out read as zeros and get no row.
        """


class FilterPolicy(ABC):
    """Decides which rows are evicted.  The table calls it around lookups and evictions.

    Rows are addressed by slot (row index).  The eviction is split in three so that the
    expensive part runs in a worker thread without the lock: :meth:`snapshot` copies what
    the decision needs (lock held, quick), :meth:`expired` decides on that copy (no lock,
    pure), and :meth:`still_expired` re-checks the chosen slots against the live state just
    before they are removed (lock held), so a row looked up in between survives.
    """

    #: Names of the tensors :meth:`state` returns (saved as ``filter_<name>``).
    state_keys: tuple[str, ...] = ()

    @abstractmethod
    def advance(self, global_step: int) -> None:
        """Move the policy's clock to ``global_step`` (the training step now running)."""

    @property
    @abstractmethod
    def step(self) -> int:
        """The policy's clock: the step later training lookups belong to."""

    @abstractmethod
    def resize(self, capacity: int) -> None:
        """The table now has ``capacity`` slots (it only grows, except on load)."""

    @abstractmethod
    def touch(self, slots: torch.Tensor) -> None:
        """A training lookup used ``slots`` (new rows included); eval lookups do not call this."""

    @abstractmethod
    def release(self, slots: torch.Tensor) -> None:
        """``slots`` were evicted and are free for reuse."""

    @abstractmethod
    def snapshot(self, start: int, stop: int) -> torch.Tensor:
        """A private copy of what :meth:`expired` needs for slots ``[start, stop)``."""

    @abstractmethod
    def expired(self, snapshot: torch.Tensor, now: int) -> torch.Tensor:
        """Boolean mask over a :meth:`snapshot`: True for rows to evict at step ``now``.

        Runs in a worker thread without the lock; must not touch live state.  Free slots
        must never be reported.
        """

    @abstractmethod
    def still_expired(self, slots: torch.Tensor, now: int) -> torch.Tensor:
        """Boolean mask over ``slots``: True where the row is live and still to evict."""

    @abstractmethod
    def state(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint for the live ``slots`` (keys: :attr:`state_keys`)."""

    @abstractmethod
    def load_state(self, slots: torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
        """Restore what :meth:`state` returned, rows now living at ``slots``.

        Called after :meth:`resize`; raises ``ValueError`` naming the key on bad input.
        """

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of tensors this policy holds."""
