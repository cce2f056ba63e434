"""A vectorised map from arbitrary int64 ids to row slots, built from torch ops.

Open addressing with linear probing over two flat tensors (``keys``, ``vals``).  A whole
batch of ids is probed at once: each round gathers one position per still-unresolved id,
so a lookup costs a handful of tensor ops per probe round and no Python work per id.
The load factor stays at or below one half, which keeps the rounds few.

``vals`` holds the slot of a key, or ``EMPTY`` / ``TOMB`` (a removed key: probes pass over
it, inserts may reuse it).  Every id value is valid, so emptiness lives in ``vals`` and
never in ``keys``.  The map also records where each slot's key sits, so removing a slot
touches one position instead of probing.

Not thread-safe: the owning table serialises calls with its lock.
"""

from __future__ import annotations

import torch

__all__ = ["SlotMap"]

EMPTY = -1
TOMB = -2
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # Fibonacci hashing multiplier as a signed int64
_MIN_BITS = 4
_MAX_LOAD = 0.5


class SlotMap:
    """Map int64 ids (any value) to int64 slots, in batches."""

    def __init__(self, min_capacity: int = 1 << _MIN_BITS) -> None:
        bits = max(_MIN_BITS, (max(min_capacity, 1) - 1).bit_length())
        self._alloc(bits)
        self._slot_pos = torch.empty(0, dtype=torch.int64)  # slot -> position of its key

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self._keys = torch.zeros(1 << bits, dtype=torch.int64)
        self._vals = torch.full((1 << bits,), EMPTY, dtype=torch.int64)
        self._live = 0
        self._used = 0  # live keys plus tombstones

    @property
    def capacity(self) -> int:
        return 1 << self._bits

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes + self._slot_pos.nbytes

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        # top `bits` bits of id * golden ratio: the arithmetic shift sign-extends, the mask
        # keeps exactly those bits.
        return ((ids * _GOLDEN) >> (64 - self._bits)) & ((1 << self._bits) - 1)

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids`` (1-D int64, duplicates allowed); ``EMPTY`` where absent."""
        out = torch.full_like(ids, EMPTY)
        if ids.numel() == 0 or self._live == 0:
            return out
        mask = (1 << self._bits) - 1
        pos = self._home(ids)
        keys = ids
        idx: torch.Tensor | None = None  # None: all queries still active, in order
        while True:
            v = self._vals[pos]
            hit = (v >= 0) & (self._keys[pos] == keys)
            more = (v != EMPTY) & ~hit
            if idx is None:
                out = torch.where(hit, v, out)
            else:
                out[idx[hit]] = v[hit]
            nxt = more.nonzero().squeeze(1)
            if nxt.numel() == 0:
                return out
            idx = nxt if idx is None else idx[nxt]
            keys = keys[nxt]
            pos = (pos[nxt] + 1) & mask

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``ids`` (distinct, none present) mapped to ``slots`` (distinct, >= 0)."""
        n = ids.numel()
        if n == 0:
            return
        if self._used + n > _MAX_LOAD * self.capacity:
            self._rehash(self._live + n)
        top = int(slots.max()) + 1
        if top > self._slot_pos.numel():
            grown = torch.full((max(top, 2 * self._slot_pos.numel()),), -1, dtype=torch.int64)
            grown[: self._slot_pos.numel()] = self._slot_pos
            self._slot_pos = grown
        self._place(ids, slots)

    def _place(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        mask = (1 << self._bits) - 1
        pos = self._home(ids)
        while ids.numel():
            v = self._vals[pos]
            free = (v < 0).nonzero().squeeze(1)
            if free.numel():
                cpos, cslot = pos[free], slots[free]
                prior = v[free]
                # Several ids may claim one free position in the same round: every claim
                # writes, one write survives, and reading back tells the winners.
                self._vals[cpos] = cslot
                won = self._vals[cpos] == cslot
                wpos = cpos[won]
                self._keys[wpos] = ids[free[won]]
                self._slot_pos[cslot[won]] = wpos
                self._used += int((prior[won] == EMPTY).sum())
                self._live += int(wpos.numel())
                left = torch.ones(ids.numel(), dtype=torch.bool)
                left[free[won]] = False
                rest = left.nonzero().squeeze(1)
                ids, slots, pos = ids[rest], slots[rest], pos[rest]
            # the position of every remaining id is taken now: probe the next one
            pos = (pos + 1) & mask

    def remove(self, slots: torch.Tensor) -> torch.Tensor:
        """Remove the keys held by ``slots`` (distinct, each present); returns those ids."""
        if slots.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        pos = self._slot_pos[slots]
        removed = self._keys[pos]
        self._vals[pos] = TOMB
        self._slot_pos[slots] = -1
        self._live -= int(slots.numel())
        return removed

    def ids_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Ids held by ``slots`` (each present)."""
        return self._keys[self._slot_pos[slots]]

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All ``(ids, slots)`` pairs, ordered by slot."""
        slots = (self._slot_pos >= 0).nonzero().squeeze(1)
        return self._keys[self._slot_pos[slots]], slots

    def clear(self, min_capacity: int = 1 << _MIN_BITS) -> None:
        """Forget every key."""
        self._alloc(max(_MIN_BITS, (max(min_capacity, 1) - 1).bit_length()))
        self._slot_pos = torch.empty(0, dtype=torch.int64)

    def _rehash(self, live_after: int) -> None:
        """Rebuild without tombstones, sized so ``live_after`` keys fill at most a quarter."""
        ids, slots = self.items()
        bits = max(self._bits, (4 * live_after - 1).bit_length())
        self._alloc(bits)
        self._place(ids, slots)
