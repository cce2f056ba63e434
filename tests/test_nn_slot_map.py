"""SlotMap (the vectorised id -> slot map) against a dict model."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recis_async.nn.slot_map import EMPTY, SlotMap

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
# a small id pool makes duplicates, re-insertions and collisions common
POOL = st.sampled_from([0, -1, 1, 2, 3, 17, 2**31, -(2**63), 2**63 - 1, 1 << 40, 12345, -7])
IDS = st.one_of(POOL, INT64, st.integers(0, 64))


class Model:
    """The map under test next to a dict, with a slot allocator shaped like the table's."""

    def __init__(self) -> None:
        self.map = SlotMap()
        self.ref: dict[int, int] = {}
        self.free: list[int] = []
        self.next = 0

    def alloc(self, k: int) -> torch.Tensor:
        reused, self.free = self.free[:k], self.free[k:]
        fresh = list(range(self.next, self.next + k - len(reused)))
        self.next += len(fresh)
        return torch.tensor(reused + fresh, dtype=torch.int64)

    def find_or_insert(self, ids: list[int]) -> None:
        out = self.map.find_or_insert(torch.tensor(ids, dtype=torch.int64), self.alloc).tolist()
        for i, s in zip(ids, out, strict=True):
            assert s >= 0
            assert self.ref.setdefault(i, s) == s, f"id {i} moved from {self.ref[i]} to {s}"
        assert len(set(self.ref.values())) == len(self.ref), "two ids share a slot"

    def find(self, ids: list[int]) -> None:
        out = self.map.find(torch.tensor(ids, dtype=torch.int64)).tolist()
        assert out == [self.ref.get(i, EMPTY) for i in ids]

    def remove(self, pick: list[int]) -> None:
        victims = sorted({k for k in pick if k in self.ref})
        slots = torch.tensor([self.ref[k] for k in victims], dtype=torch.int64)
        removed = self.map.remove(slots).tolist()
        assert removed == victims
        for k in victims:
            self.free.append(self.ref.pop(k))

    def check(self) -> None:
        assert len(self.map) == len(self.ref)
        ids, slots = self.map.items()
        assert dict(zip(ids.tolist(), slots.tolist(), strict=True)) == self.ref
        assert slots.tolist() == sorted(slots.tolist())


OPS = st.lists(
    st.tuples(st.sampled_from(["upsert", "find", "remove"]), st.lists(IDS, max_size=60)),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_matches_a_dict_under_random_operations(ops: list[tuple[str, list[int]]]) -> None:
    model = Model()
    for op, ids in ops:
        if op == "upsert":
            model.find_or_insert(ids)
        elif op == "find":
            model.find(ids)
        else:
            model.remove(ids)
        model.check()
    model.find(list(model.ref) + [5, -5, 2**62])


@settings(max_examples=30, deadline=None)
@given(st.lists(IDS, min_size=1, max_size=300), st.integers(0, 2**32))
def test_duplicates_in_one_batch_get_one_slot(ids: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = torch.tensor(ids, dtype=torch.int64)
    batch = batch[torch.randint(0, len(ids), (3 * len(ids),), generator=g)]  # many repeats
    model = Model()
    model.find_or_insert(batch.tolist())
    model.check()
    assert model.next == len(set(batch.tolist()))  # exactly one new slot per distinct id


def test_large_batch_grows_and_rehashes_consistently() -> None:
    g = torch.Generator().manual_seed(0)
    m = SlotMap()
    ref: dict[int, int] = {}
    nxt = [0]

    def alloc(k: int) -> torch.Tensor:
        nxt[0] += k
        return torch.arange(nxt[0] - k, nxt[0])

    for _ in range(6):
        ids = torch.randint(-(2**62), 2**62, (20_000,), generator=g) // 1000  # some repeats
        out = m.find_or_insert(ids, alloc)
        for i, s in zip(ids.tolist(), out.tolist(), strict=True):
            assert ref.setdefault(i, s) == s
    assert len(m) == len(ref) == nxt[0]
    assert m.capacity >= 2 * len(m)  # load factor at most one half
    probe = torch.tensor(list(ref)[:5000] + [1, 2, 3])
    assert m.find(probe).tolist() == [ref.get(i, EMPTY) for i in probe.tolist()]


def test_tombstones_are_skipped_and_cleared_by_rehash() -> None:
    m = SlotMap(min_capacity=64)
    ids = torch.arange(24)
    m.insert(ids, torch.arange(24))
    m.remove(torch.arange(0, 24, 2))
    assert m.find(ids).tolist() == [EMPTY if i % 2 == 0 else i for i in range(24)]
    # re-insert into a map full of tombstones until it has to rebuild
    more = torch.arange(100, 160)
    m.insert(more, torch.arange(24, 84))
    assert m.find(torch.arange(1, 24, 2)).tolist() == list(range(1, 24, 2))
    assert m.find(more).tolist() == list(range(24, 84))
    assert len(m) == 12 + 60


def test_failed_allocation_leaves_the_map_unchanged() -> None:
    m = SlotMap()
    m.insert(torch.tensor([1, 2]), torch.tensor([0, 1]))

    def broken(k: int) -> torch.Tensor:
        raise MemoryError("no room")

    try:
        m.find_or_insert(torch.tensor([3, 4, 1]), broken)
    except MemoryError:
        pass
    else:
        raise AssertionError("allocation error was swallowed")
    assert len(m) == 2
    assert m.find(torch.tensor([1, 2, 3, 4])).tolist() == [0, 1, EMPTY, EMPTY]
