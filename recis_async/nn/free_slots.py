"""A FIFO of free row slots, kept as a queue of tensors so pushes and pops never copy it all."""

from __future__ import annotations

from collections import deque

import torch

__all__ = ["FreeSlots"]


class FreeSlots:
    """Slots released by eviction, handed out again oldest first."""

    def __init__(self) -> None:
        self._chunks: deque[torch.Tensor] = deque()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return 8 * self._count

    def push(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._chunks.append(slots)
            self._count += int(slots.numel())

    def pop(self, k: int) -> torch.Tensor:
        """Up to ``k`` slots (fewer only if fewer are free)."""
        parts: list[torch.Tensor] = []
        while k > 0 and self._chunks:
            head = self._chunks[0]
            if head.numel() <= k:
                parts.append(self._chunks.popleft())
                k -= head.numel()
            else:
                parts.append(head[:k])
                self._chunks[0] = head[k:]
                k = 0
        taken = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        self._count -= int(taken.numel())
        return taken

    def clear(self) -> None:
        self._chunks.clear()
        self._count = 0
