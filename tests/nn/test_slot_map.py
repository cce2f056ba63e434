"""SlotMap (the torch-ops id -> slot map) and NativeSlotMap (compiled probe loops) against a
dict model and against each other, on the same ids."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recis_async.nn import _native
from recis_async.nn.slot_map import EMPTY, TOMB, NativeSlotMap, SlotMap, new_slot_map

KERNELS = _native.kernels()
# the suite runs where a C++ compiler exists (the README's install): the native path must load
assert KERNELS is not None, "the native map did not build; see the warning logged above"


def native(min_capacity: int = 16) -> SlotMap:
    assert KERNELS is not None
    return NativeSlotMap(KERNELS, min_capacity)


MAPS: dict[str, Callable[..., SlotMap]] = {"torch": SlotMap, "native": native}

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
# a small id pool makes duplicates, re-insertions and collisions common
POOL = st.sampled_from([0, -1, 1, 2, 3, 17, 2**31, -(2**63), 2**63 - 1, 1 << 40, 12345, -7])
IDS = st.one_of(POOL, INT64, st.integers(0, 64))


class Model:
    """The map under test next to a dict, with a slot allocator shaped like the table's."""

    def __init__(self, make: Callable[..., SlotMap] = SlotMap) -> None:
        self.map = make()
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


@pytest.mark.parametrize("kind", MAPS)
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_matches_a_dict_under_random_operations(
    kind: str, ops: list[tuple[str, list[int]]]
) -> None:
    model = Model(MAPS[kind])
    for op, ids in ops:
        if op == "upsert":
            model.find_or_insert(ids)
        elif op == "find":
            model.find(ids)
        else:
            model.remove(ids)
        model.check()
    model.find(list(model.ref) + [5, -5, 2**62])


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_native_and_torch_maps_agree_on_the_same_ids(ops: list[tuple[str, list[int]]]) -> None:
    """Both paths on one op sequence: the same outcome per id (hit, inserted, absent), the
    same keys held, the same tombstones and load; slot numbers may differ (the torch map
    numbers the new ids of a batch in its own order) but each id keeps its slot."""
    both = (Model(SlotMap), Model(native))
    for op, ids in ops:
        if op == "upsert":
            outs = [
                m.map.find_or_insert(torch.tensor(ids, dtype=torch.int64), m.alloc) for m in both
            ]
            for m, out in zip(both, outs, strict=True):
                for i, s in zip(ids, out.tolist(), strict=True):
                    assert m.ref.setdefault(i, s) == s
            # duplicates of a batch share one slot in both, and the same ids share them
            a, b = (out.tolist() for out in outs)
            assert [a.index(x) for x in a] == [b.index(x) for x in b]
        elif op == "find":
            a, b = (m.map.find(torch.tensor(ids, dtype=torch.int64)) for m in both)
            assert torch.equal(a == EMPTY, b == EMPTY)
        else:
            for m in both:
                m.remove(ids)
        for m in both:
            m.check()
        t, n = (m.map for m in both)
        assert set(t.items()[0].tolist()) == set(n.items()[0].tolist())
        assert (t.capacity, t._used, len(t)) == (n.capacity, n._used, len(n))
        assert int((t._kv[:-1, 1] == TOMB).sum()) == int((n._kv[:-1, 1] == TOMB).sum())


@pytest.mark.parametrize("kind", MAPS)
@settings(max_examples=30, deadline=None)
@given(ids=st.lists(IDS, min_size=1, max_size=300), seed=st.integers(0, 2**32))
def test_duplicates_in_one_batch_get_one_slot(kind: str, ids: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = torch.tensor(ids, dtype=torch.int64)
    batch = batch[torch.randint(0, len(ids), (3 * len(ids),), generator=g)]  # many repeats
    model = Model(MAPS[kind])
    model.find_or_insert(batch.tolist())
    model.check()
    assert model.next == len(set(batch.tolist()))  # exactly one new slot per distinct id


@pytest.mark.parametrize("kind", MAPS)
def test_large_batch_grows_and_rehashes_consistently(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    m = MAPS[kind]()
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


@pytest.mark.parametrize("kind", MAPS)
def test_tombstones_are_skipped_and_cleared_by_rehash(kind: str) -> None:
    m = MAPS[kind](min_capacity=64)
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


@pytest.mark.parametrize("kind", MAPS)
def test_failed_allocation_leaves_the_map_unchanged(kind: str) -> None:
    m = MAPS[kind]()
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


def test_native_claims_are_undone_when_allocation_fails_behind_tombstones() -> None:
    m = native(min_capacity=64)
    m.insert(torch.arange(20), torch.arange(20))
    m.remove(torch.arange(0, 20, 3))

    # keys at empty positions mean nothing: compare values, live keys and bookkeeping
    def state(m: SlotMap) -> tuple[object, ...]:
        live = m._kv[:, 1] != EMPTY
        return m._kv[:, 1].tolist(), m._kv[live, 0].tolist(), m._slot_pos.tolist(), m._used, len(m)

    before = state(m)

    def broken(k: int) -> torch.Tensor:
        raise MemoryError("no room")

    with pytest.raises(MemoryError):
        m.find_or_insert(torch.tensor([100, 1, 101, 100, 0, 102]), broken)
    assert state(m) == before
    with pytest.raises(ValueError, match="expected 3 int64 slots >= 0"):
        m.find_or_insert(torch.tensor([100, 101, 102]), lambda k: torch.arange(k - 1))
    assert state(m) == before
    with pytest.raises(ValueError, match="expected 3 int64 slots >= 0"):
        m.find_or_insert(torch.tensor([100, 101, 102]), lambda k: torch.arange(k) - 1)
    assert state(m) == before
    with pytest.raises(ValueError, match="ids: expected a 1-D int64 tensor, got torch.int32"):
        m.find(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="SlotMap.insert: expected distinct ids"):
        m.insert(torch.tensor([7, 500]), torch.tensor([40, 41]))  # 7 is present
    assert state(m) == before


def test_either_map_reads_the_others_state_and_pickles_to_the_native_one() -> None:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-(2**40), 2**40, (5000,), generator=g)
    built = SlotMap()
    slots = built.find_or_insert(ids, lambda k: torch.arange(k))
    built.remove(slots[:100].unique())
    copy = pickle.loads(pickle.dumps(built))
    assert type(copy) is NativeSlotMap  # this process can run the native map
    assert torch.equal(copy.find(ids), built.find(ids))
    more = torch.arange(10_000)  # enough to rehash the copied state
    nxt = int(slots.max()) + 1
    copy.find_or_insert(more, lambda k: torch.arange(nxt, nxt + k))
    assert torch.equal(copy.find(ids), built.find(ids))
    assert type(pickle.loads(pickle.dumps(copy))) is NativeSlotMap
    assert type(new_slot_map()) is NativeSlotMap
