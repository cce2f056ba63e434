"""A vectorised map from arbitrary int64 ids to row slots, built from torch ops.

Open addressing with linear probing.  A whole batch of ids is probed at once: each round
gathers one position per still-unresolved id, so a lookup costs a handful of tensor ops per
probe round and no Python work per id.  The load factor stays at or below one half, which
keeps the rounds few.  Key and value of a position sit side by side (one ``[capacity, 2]``
tensor) so a probe touches one cache line.

A value is a slot (``>= 0``), ``EMPTY`` or ``TOMB`` (a removed key: probes pass over it).
Every id value is valid, so emptiness lives in the value, never in the key.  Inserting
claims empty positions and picks one winner per position; equal ids of one batch probe in
lockstep and meet at the winner's position in the next round, so duplicates resolve to one
key without sorting the batch.

Per round the work is done full-width with integer arithmetic instead of boolean-mask
selection (which branches per element and costs several times more on random masks):
queries that must not write are pointed at a scratch entry past the end, and the
unresolved queries are compacted once per round.  Random passes over the big table are
what a round costs most (TLB misses), so claims are arbitrated in a small side array and
the table is touched twice per round: one gather, one write of the winners' rows.

The map also records where each slot's key sits, so removing a slot touches one position.
Not thread-safe: the owning table serialises calls with its lock.

:class:`NativeSlotMap` keeps the same tensors and layout but probes with compiled loops
(``_slot_map.cpp``, one pass over the batch, home positions prefetched ahead), several times
faster; :func:`new_slot_map` gives it wherever the native library loads and this map
elsewhere.  Both pickle to whichever the unpickling process can run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _memory, _native

__all__ = ["SlotMap", "NativeSlotMap", "new_slot_map", "EMPTY", "TOMB"]

EMPTY = -1
TOMB = -2
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # Fibonacci hashing multiplier as a signed int64
_MIN_BITS = 4
_MAX_LOAD = 0.5
_SCRATCH_BITS = 20  # claim-arbitration cells: at most 8 MiB, small enough to stay TLB-resident


def _bits_for(n: int) -> int:
    return max(_MIN_BITS, (max(n, 1) - 1).bit_length())


class SlotMap:
    """Map int64 ids (any value) to int64 slots, in batches."""

    def __init__(self, min_capacity: int = 1 << _MIN_BITS) -> None:
        self._alloc(_bits_for(min_capacity))
        # slot -> position of its key (-1: free); the last element is a scratch entry
        self._slot_pos = torch.full((1,), -1, dtype=torch.int64)
        self._space = _memory.RowSpace()

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        # one scratch row at index `capacity` absorbs writes of queries that must not write
        self._kv = _memory.zeros(((1 << bits) + 1, 2), torch.int64).fill_(EMPTY)
        self._flat = self._kv.view(-1)  # key of position p at 2p, value at 2p + 1
        self._live = 0
        self._used = 0  # live keys plus tombstones
        # Claims are arbitrated in a small array indexed by position modulo its size (the
        # last cell absorbs non-claims), made by the first insert.  Two positions sharing a
        # cell make one claimant lose spuriously; it simply claims again next round.
        self._arbiter: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 1 << self._bits

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        arbiter = 0 if self._arbiter is None else self._arbiter.nbytes
        return self._kv.nbytes + self._slot_pos.nbytes + arbiter

    def __reduce__(self) -> tuple[Callable[[dict[str, object]], SlotMap], tuple[object]]:
        return _restore, (self.__dict__.copy(),)

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        # top `bits` bits of id * golden ratio: the arithmetic shift sign-extends, the mask
        # keeps exactly those bits.
        return ((ids * _GOLDEN) >> (64 - self._bits)) & ((1 << self._bits) - 1)

    def _probe(
        self, pos: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Look at ``pos`` for each query: its value ``v``, whether it holds the query's key
        (``hit``) or is empty (``empty``), and where to look next (``pos`` when either).
        Flags are int64 0/1."""
        entry = self._kv.index_select(0, pos)
        v = entry[:, 1]
        hit = ((entry[:, 0] == keys) & (v >= 0)).long()
        empty = (v == EMPTY).long()
        nxt = (pos + (1 - hit - empty)) & ((1 << self._bits) - 1)
        return v, hit, empty, nxt

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids`` (1-D int64, duplicates allowed); ``EMPTY`` where absent."""
        out = torch.full_like(ids, EMPTY)
        if ids.numel() == 0 or self._live == 0:
            return out
        pos = self._home(ids)
        keys = ids
        idx: torch.Tensor | None = None  # None: all queries active, in order
        while True:
            v, hit, empty, nxt = self._probe(pos, keys)
            res = (v + 1) * hit - 1  # v on a hit, else EMPTY
            if idx is None:
                out = res
            else:
                out.index_put_((idx,), res)
            more = (1 - hit - empty).nonzero().squeeze(1)
            if more.numel() == 0:
                return out
            idx = more if idx is None else idx.index_select(0, more)
            keys = keys.index_select(0, more)
            pos = nxt.index_select(0, more)

    def find_or_insert(
        self, ids: torch.Tensor, alloc: Callable[[int], torch.Tensor]
    ) -> torch.Tensor:
        """Slots of ``ids`` (1-D int64, duplicates allowed), inserting the absent ones.

        ``alloc(k)`` returns ``k`` distinct unused slots (``>= 0``); it is called once per
        probe round that inserts.  Ids inserted before it raises stay inserted.
        """
        return self._probe_insert(ids, alloc, None)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``ids`` (distinct, none present) mapped to ``slots`` (distinct, >= 0)."""
        self._probe_insert(ids, None, slots)

    def _probe_insert(
        self,
        ids: torch.Tensor,
        alloc: Callable[[int], torch.Tensor] | None,
        given: torch.Tensor | None,
    ) -> torch.Tensor:
        n = ids.numel()
        out = torch.full_like(ids, EMPTY)
        if n == 0:
            return out
        if self._used + n > _MAX_LOAD * self.capacity:
            self._rehash(self._live + n)
        if given is not None:
            self._reserve_slots(int(given.max()) + 1)
        scratch = 1 << self._bits
        if self._arbiter is None:
            self._arbiter = torch.empty(
                (1 << min(self._bits, _SCRATCH_BITS)) + 1, dtype=torch.int64
            )
        arbiter = self._arbiter
        cells = arbiter.numel() - 1
        pos = self._home(ids)
        keys = ids
        idx = torch.arange(n)
        while idx.numel():
            m = idx.numel()
            v, hit, empty, nxt = self._probe(pos, keys)
            # Every empty position found is claimed; among claimants of one arbiter cell
            # the surviving write wins.  Losers stay put and look again next round, where
            # a duplicate of the winner finds its key.
            cell = cells + ((pos & (cells - 1)) - cells) * empty
            marker = torch.arange(m)
            arbiter[cell] = marker
            won = (arbiter.index_select(0, cell) == marker).long() * empty
            k = int(won.sum())
            slot = torch.zeros(m, dtype=torch.int64)
            if k:
                if given is not None:
                    slot = given.index_select(0, idx)
                else:
                    assert alloc is not None
                    fresh = alloc(k)  # nothing of this round is written yet if it raises
                    self._reserve_slots(int(fresh.max()) + 1)
                    slot = fresh.index_select(0, ((torch.cumsum(won, 0) - 1) * won))
                self._kv[scratch + (pos - scratch) * won] = torch.stack((keys, slot), 1)
                dump = self._slot_pos.numel() - 1
                self._slot_pos[dump + (slot - dump) * won] = pos
                self._slot_pos[dump] = -1
                self._used += k
                self._live += k
            res = (v + 1) * hit + (slot + 1) * won - 1  # found or inserted, else EMPTY
            if m == n:
                out = res
            else:
                out.index_put_((idx,), res)
            rest = (1 - hit - won).nonzero().squeeze(1)
            pos = nxt.index_select(0, rest)
            idx = idx.index_select(0, rest)
            keys = keys.index_select(0, rest)
        return out

    def _reserve_slots(self, top: int) -> None:
        """Make ``_slot_pos`` hold slots below ``top`` plus the scratch entry (doubling, in
        place within its mapping's reserve where it has one)."""
        have = self._slot_pos.numel() - 1
        if top <= have:
            return
        grown = self._space.grown(self._slot_pos, max(top, 2 * have) + 1)
        grown[have + 1 :] = -1  # the old scratch entry (at `have`) is -1 already
        self._slot_pos = grown

    def remove(self, slots: torch.Tensor) -> torch.Tensor:
        """Remove the keys held by ``slots`` (distinct, each present); returns those ids."""
        if slots.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        pos = self._slot_pos[slots]
        removed = self._flat[2 * pos]
        self._flat[2 * pos + 1] = TOMB
        self._slot_pos[slots] = -1
        self._live -= int(slots.numel())
        return removed

    def ids_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Ids held by ``slots`` (each present)."""
        return self._flat[2 * self._slot_pos[slots]]

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All ``(ids, slots)`` pairs, ordered by slot."""
        slots = (self._slot_pos[:-1] >= 0).nonzero().squeeze(1)
        return self.ids_of(slots), slots

    def clear(self, min_capacity: int = 1 << _MIN_BITS) -> None:
        """Forget every key."""
        self._alloc(_bits_for(min_capacity))
        self._slot_pos = torch.full((1,), -1, dtype=torch.int64)

    def _rehash(self, live_after: int) -> None:
        """Rebuild without tombstones, sized so ``live_after`` keys fill at most a quarter."""
        ids, slots = self.items()
        self._alloc(max(self._bits, _bits_for(4 * live_after)))
        self._slot_pos.fill_(-1)
        if ids.numel():
            self.insert(ids, slots)


class NativeSlotMap(SlotMap):
    """:class:`SlotMap` with compiled probe loops (same tensors, same results).

    A batch is probed id by id in one pass, so duplicates resolve by order; absent keys are
    claimed first and given their slots by one ``alloc`` call per batch.
    """

    def __init__(self, kernels: _native.Kernels, min_capacity: int = 1 << _MIN_BITS) -> None:
        super().__init__(min_capacity)
        self._k = kernels

    def __reduce__(self) -> tuple[Callable[[dict[str, object]], SlotMap], tuple[object]]:
        state = self.__dict__.copy()
        del state["_k"]  # a loaded library: the unpickling process loads its own
        return _restore, (state,)

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.numel()
        if n == 0 or self._live == 0:
            return torch.full_like(ids, EMPTY)
        ids = _int64(ids)
        out = torch.empty_like(ids)
        self._k.find(self._kv.data_ptr(), self._bits, ids.data_ptr(), n, out.data_ptr())
        return out

    def _probe_insert(
        self,
        ids: torch.Tensor,
        alloc: Callable[[int], torch.Tensor] | None,
        given: torch.Tensor | None,
    ) -> torch.Tensor:
        n = ids.numel()
        if n == 0:
            return torch.full_like(ids, EMPTY)
        ids = _int64(ids)
        if self._used + n > _MAX_LOAD * self.capacity:
            self._rehash(self._live + n)
        out = torch.empty_like(ids)
        new_pos = torch.empty_like(ids)
        kv = self._kv.data_ptr()
        k = int(
            self._k.claim(kv, self._bits, ids.data_ptr(), n, out.data_ptr(), new_pos.data_ptr())
        )
        if k == 0:
            return out
        try:
            if given is not None:
                if k != n:
                    raise ValueError(
                        f"SlotMap.insert: expected distinct ids not yet present, got {n - k} "
                        f"present or repeated"
                    )
                slots = given
            else:
                assert alloc is not None
                slots = alloc(k)
            if slots.dtype != torch.int64 or slots.shape != (k,) or int(slots.min()) < 0:
                raise ValueError(
                    f"SlotMap alloc: expected {k} int64 slots >= 0, got {slots.dtype} "
                    f"{tuple(slots.shape)}"
                )
            slots = slots.contiguous()
            self._reserve_slots(int(slots.max()) + 1)
        except BaseException:
            self._k.revert(kv, new_pos.data_ptr(), k)  # the map is as it was
            raise
        self._k.resolve(
            kv,
            self._slot_pos.data_ptr(),
            new_pos.data_ptr(),
            slots.data_ptr(),
            k,
            out.data_ptr(),
            n,
        )
        self._used += k
        self._live += k
        return out


def _int64(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` as the native loops read them: contiguous 1-D int64 (they index raw memory)."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(
            f"ids: expected a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}"
        )
    return ids.contiguous()


def new_slot_map(min_capacity: int = 1 << _MIN_BITS) -> SlotMap:
    """A :class:`NativeSlotMap` where the native library loads, else a :class:`SlotMap`."""
    kernels = _native.kernels()
    if kernels is None:
        return SlotMap(min_capacity)
    return NativeSlotMap(kernels, min_capacity)


def _restore(state: dict[str, object]) -> SlotMap:
    """Unpickle into a native map where this process can run one."""
    kernels = _native.kernels()
    out = object.__new__(SlotMap if kernels is None else NativeSlotMap)
    out.__dict__.update(state)
    out.__dict__.pop("_k", None)
    if kernels is not None:
        out.__dict__["_k"] = kernels
    return out
