"""HashTable: insertion, training with torch optimizers, policies, eviction, state."""

from __future__ import annotations

import copy
import functools
import io
import pickle
import threading

import pytest
import torch
from torch import nn

from recis_async.nn import (
    DEFAULT_POLICIES,
    AdmitHook,
    AdmitPolicy,
    FilterHook,
    GlobalStepFilter,
    HashTable,
    PolicyRegistry,
    _memory,
    attach_optimizer,
    register_admit_policy,
    register_filter_policy,
)
from recis_async.nn import hashtable as hashtable_module
from recis_async.nn.slot_map import SlotMap


@pytest.fixture(params=["native", "torch"])
def id_map(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on each id map: the native one, and the torch-ops fallback."""
    if request.param == "torch":
        monkeypatch.setattr(hashtable_module, "new_slot_map", SlotMap)
    return str(request.param)


def step_filter(n: int) -> FilterHook:
    return FilterHook("GlobalStepFilter", {"filter_step": n})


def const(value: float):  # an initializer filling new rows with `value`
    return lambda t: t.fill_(value)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------- hook descriptions
def test_hook_descriptions() -> None:
    admit = AdmitHook("ReadOnly")
    filt = FilterHook("GlobalStepFilter", {"filter_step": 5, "a": [1, 2]})
    assert (admit.name, admit.params, admit.type) == ("ReadOnly", {}, "admit")
    assert (filt.name, filt.type) == ("GlobalStepFilter", "filter")
    assert filt.params == {"filter_step": 5, "a": [1, 2]}
    assert str(admit) == '{"name": "ReadOnly", "params": {}}'
    assert str(filt) == '{"name": "GlobalStepFilter", "params": {"a": [1, 2], "filter_step": 5}}'
    filt.params["filter_step"] = 99  # a copy: the description does not change
    assert filt.params["filter_step"] == 5
    assert FilterHook("X", {"b": 1, "a": 2}) == FilterHook("X", {"a": 2, "b": 1})
    with pytest.raises(ValueError, match="AdmitHook.name"):
        AdmitHook("")
    with pytest.raises(ValueError, match="FilterHook.params.*JSON"):
        FilterHook("GlobalStepFilter", {"filter_step": object()})


# ---------------------------------------------------------------- insertion and reads
def test_unseen_ids_get_initialized_rows_in_training() -> None:
    table = HashTable([2, 3], initializer=const(0.5))
    out = table(ids(7, -(2**63), 7, 2**63 - 1))
    assert out.shape == (4, 2, 3)
    assert torch.equal(out, torch.full((4, 2, 3), 0.5))
    assert table.ids_count() == 3
    assert table.ids().tolist() == [-(2**63), 7, 2**63 - 1]
    assert table(ids(7, 8).reshape(1, 2)).shape == (1, 2, 2, 3)  # any ids shape


def test_default_initializer_is_zeros_and_bad_initializers_fail_at_construction() -> None:
    table = HashTable(4)
    assert torch.equal(table(ids(1, 2)), torch.zeros(2, 4))
    torch.manual_seed(0)
    normal = HashTable(4, initializer=lambda t: torch.nn.init.normal_(t, std=1.0))
    rows = normal(ids(1, 2))
    assert rows.std() > 0.1 and not torch.equal(rows[0], rows[1])
    with pytest.raises(ValueError, match="initializer.*shape"):
        HashTable(4, initializer=lambda t: torch.zeros(3))
    with pytest.raises(ValueError, match=r"HashTable\(initializer=...\): expected a callable"):
        HashTable(4, initializer=0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="embedding_shape"):
        HashTable([4, 0])
    with pytest.raises(ValueError, match="dtype"):
        HashTable(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="ids: expected an integer tensor"):
        table(torch.tensor([1.0]))


def test_bad_shapes_and_sizes_are_refused_before_allocating() -> None:
    expected = r"HashTable\(embedding_shape=...\): expected a positive int or a non-empty sequence"
    for bad, shown in ((4.0, "float 4.0"), ("64", "str '64'"), (True, "bool True"), (None, "None")):
        with pytest.raises(ValueError, match=rf"{expected} of positive ints, got {shown}"):
            HashTable(bad)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"HashTable\(embedding_shape=1099511627776, capacity=1024\): 1024 rows of "
        r"1099511627776 float32 values would take 4.0 PiB, more than this machine's .* of memory",
    ):
        HashTable(2**40)
    with pytest.raises(ValueError, match=r"capacity=1099511627776\): .* would take 256.0 TiB"):
        HashTable(64, capacity=2**40)


def test_growth_beyond_the_machine_is_refused_naming_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = HashTable(4, name="user", capacity=16)
    table(ids(*range(16)))
    # a machine of 300 bytes: the 16 rows of 16 bytes fit, a growth to 24 rows does not
    monkeypatch.setattr(hashtable_module, "_physical_memory", lambda: 300)
    with pytest.raises(
        ValueError,
        match=r"HashTable 'user' growing to hold 17 ids: 24 rows of 4 float32 values would take "
        r"384 B, more than this machine's 300 B of memory",
    ):
        table(ids(99))
    assert table.ids_count() == 16 and table.capacity == 16
    assert table(ids(3)).shape == (1, 4)  # the table stays usable


def test_bad_clock_ids_and_registries_are_refused() -> None:
    table = HashTable(4, filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 1}))
    with pytest.raises(
        ValueError, match=r"HashTable.advance\(global_step=...\): expected an int >= 0, got -1"
    ):
        table.advance(-1)
    with pytest.raises(
        ValueError,
        match=r"HashTable.scan_eviction\(now=...\): expected an int >= 0 or None, got 'x'",
    ):
        table.evict("x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ids: expected a dense tensor holding ids, got one"):
        table(torch.zeros(3).to_sparse().long())
    with pytest.raises(
        ValueError,
        match=r"PolicyRegistry\(admit=...\): expected a mapping of name -> policy class or None, "
        r"got int",
    ):
        PolicyRegistry(admit=3)  # type: ignore[arg-type]


def test_dtype_follows_module_conversion() -> None:
    table = HashTable(2, initializer=const(1.5)).double()
    assert table(ids(1)).dtype == torch.float64 and table.dtype == torch.float64
    table(ids(1)).sum().backward()
    assert table.weight.grad is not None and table.weight.grad.dtype == torch.float64


def test_eval_lookups_do_not_insert() -> None:
    table = HashTable(3, initializer=const(1.0))
    table(ids(1))
    table.eval()
    out = table(ids(1, 2))
    assert out.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert table.ids_count() == 1
    assert table.contains(ids(1, 2)).tolist() == [True, False]


def test_table_grows_keeping_rows() -> None:
    table = HashTable(
        2, capacity=4, initializer=lambda t: t.copy_(torch.arange(t.numel()).view_as(t))
    )
    first = table(ids(10, 11)).detach().clone()
    table(torch.arange(100, 1100))
    assert table.capacity >= 1002
    table.eval()
    assert torch.equal(table(ids(10, 11)), first)


# ---------------------------------------------------------------- training
def _trained_rows(table: HashTable, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    opt.zero_grad()
    out = table(batch)
    (out * torch.linspace(1, 2, out.shape[-1])).sum().backward()
    opt.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.Adam(p, lr=0.1),
        lambda p: torch.optim.Adagrad(p, lr=0.1),
    ],
    ids=["sgd", "sgd-momentum", "adam", "adagrad"],
)
def test_optimizer_changes_exactly_the_looked_up_rows(make, id_map: str) -> None:
    table = HashTable(4, initializer=const(1.0), capacity=16)
    table(torch.arange(10))  # rows 0..9 exist
    opt = make(table.parameters())
    table.attach_optimizer(opt)
    before = table.weight.detach().clone()
    _trained_rows(table, opt, ids(2, 5, 5))
    changed = (table.weight.detach() != before).any(1).nonzero().squeeze(1)
    table.eval()
    slots, _ = table.lookup_slots(ids(2, 5))
    assert sorted(changed.tolist()) == sorted(slots.tolist())
    # growth after the optimizer has state: the state is padded, training continues
    table.train()
    table(torch.arange(1000, 1100))
    assert table.capacity >= 110
    untouched = table.lookup_slots(ids(7))[0]
    row7 = table.weight.detach()[untouched].clone()
    _trained_rows(table, opt, ids(3, 1050))
    assert torch.equal(table.weight.detach()[untouched], row7)


def test_sparse_gradients_with_sparse_adam() -> None:
    table = HashTable(4, initializer=const(1.0), sparse=True)
    table(torch.arange(10))
    opt = torch.optim.SparseAdam(list(table.parameters()), lr=0.1)
    before = table.weight.detach().clone()
    _trained_rows(table, opt, ids(2, 5))
    assert table.weight.grad is not None and table.weight.grad.is_sparse
    changed = (table.weight.detach() != before).any(1).nonzero().squeeze(1)
    assert sorted(changed.tolist()) == sorted(table.lookup_slots(ids(2, 5))[0].tolist())


def test_gradients_match_a_plain_embedding() -> None:
    torch.manual_seed(0)
    table = HashTable(3, initializer=lambda t: torch.nn.init.normal_(t))
    batch = ids(4, 9, 4, 4, 100, 9)
    table(batch)  # insert
    slots, _ = table.lookup_slots(batch)
    weights = torch.randn(6, 3)
    (table(batch) * weights).sum().backward()
    ref = table.weight.detach().clone().requires_grad_(True)
    (nn.functional.embedding(slots, ref) * weights).sum().backward()
    assert table.weight.grad is not None
    torch.testing.assert_close(table.weight.grad, ref.grad)


def test_two_lookups_in_one_step_survive_a_growth_between_them() -> None:
    table = HashTable(2, initializer=const(1.0), capacity=4)
    a = table(ids(1, 2))
    b = table(torch.arange(100, 200))  # grows the table while `a` is still in the graph
    (a.sum() + 2 * b.sum()).backward()
    grad = table.weight.grad
    assert grad is not None and grad.shape == table.weight.shape
    assert grad[table.lookup_slots(ids(1))[0]].tolist() == [[1.0, 1.0]]
    assert grad[table.lookup_slots(ids(150))[0]].tolist() == [[2.0, 2.0]]


def test_frozen_table_and_no_grad_produce_no_gradient() -> None:
    table = HashTable(2, initializer=const(1.0))
    with torch.no_grad():
        out = table(ids(1))
    assert not out.requires_grad and table.ids_count() == 1  # still a training lookup
    table.weight.requires_grad_(False)
    assert not table(ids(1)).requires_grad


# ---------------------------------------------------------------- admission policies
def test_read_only_admission_returns_zeros_and_inserts_nothing() -> None:
    source = HashTable(2, initializer=const(3.0))
    source(ids(1, 2))
    table = HashTable(2, admit_hook=AdmitHook("ReadOnly"))
    table.load_state_dict(source.state_dict())
    out = table(ids(1, 99, 2, 99))
    assert out.tolist() == [[3.0, 3.0], [0.0, 0.0], [3.0, 3.0], [0.0, 0.0]]
    assert table.ids_count() == 2 and not table.contains(ids(99)).any()
    out.sum().backward()  # gradients reach the known rows only
    grad = table.weight.grad
    assert grad is not None and grad.sum().item() == 4.0
    # and per call on a normal table
    source(ids(5), admit_hook=AdmitHook("ReadOnly"))
    assert not source.contains(ids(5)).any()


def test_unknown_policy_names_list_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown admit policy 'Nope'; registered: ReadOnly"):
        HashTable(4, admit_hook=AdmitHook("Nope"))
    with pytest.raises(
        ValueError, match=r"unknown filter policy 'Nope'; registered: GlobalStepFilter"
    ):
        HashTable(4, filter_hook=FilterHook("Nope"))
    with pytest.raises(ValueError, match="filter_step"):
        HashTable(4, filter_hook=FilterHook("GlobalStepFilter"))
    with pytest.raises(ValueError, match="filter_step: expected an int >= 0"):
        HashTable(4, filter_hook=step_filter(-1))
    with pytest.raises(ValueError, match="admit_hook: expected an AdmitHook"):
        HashTable(4, admit_hook=FilterHook("GlobalStepFilter", {"filter_step": 1}))  # type: ignore[arg-type]


class EvenOnly(AdmitPolicy):
    def admit(self, ids: torch.Tensor) -> torch.Tensor:
        return ids % 2 == 0


def test_registering_returns_a_new_registry_and_changes_no_other() -> None:
    custom = register_admit_policy("EvenOnly", EvenOnly)
    assert custom.admit_names == ("EvenOnly", "ReadOnly")
    assert DEFAULT_POLICIES.admit_names == ("ReadOnly",)
    table = HashTable(2, admit_hook=AdmitHook("EvenOnly"), policies=custom)
    table(torch.arange(6))
    assert table.ids().tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="unknown admit policy 'EvenOnly'"):
        HashTable(2, admit_hook=AdmitHook("EvenOnly"))
    with pytest.raises(ValueError, match="already registered"):
        register_admit_policy("EvenOnly", EvenOnly, custom)
    assert register_admit_policy("EvenOnly", EvenOnly, custom, replace=True).admit_names
    with pytest.raises(ValueError, match="subclass of FilterPolicy"):
        register_filter_policy("Bad", EvenOnly)  # type: ignore[arg-type]
    both = register_filter_policy("Steps", GlobalStepFilter, custom)
    assert both.filter_names == ("GlobalStepFilter", "Steps")
    assert isinstance(PolicyRegistry.builtin(), PolicyRegistry)


# ---------------------------------------------------------------- GlobalStepFilter
def test_global_step_filter_boundary_is_strictly_greater() -> None:
    table = HashTable(2, filter_hook=step_filter(3))
    table.advance(10)
    table(ids(1))
    table.advance(12)
    table(ids(2))
    assert table.evict(13) == 0  # 13 - 10 = 3, not > 3
    assert table.evict(14) == 1  # 14 - 10 > 3
    assert table.ids().tolist() == [2]
    assert table.evict(15) == 0 and table.evict(16) == 1
    assert table.ids_count() == 0


def test_eval_lookups_do_not_stamp() -> None:
    table = HashTable(2, filter_hook=step_filter(2))
    table.advance(0)
    table(ids(1, 2))
    table.eval()
    table.advance(5)
    table(ids(1))  # eval: not a use
    table.train()
    table(ids(2))  # training: stamps 5
    assert table.evict() == 1  # now = clock = 5
    assert table.ids().tolist() == [2]


def test_evicted_rows_are_reused_with_fresh_state() -> None:
    table = HashTable(2, initializer=const(1.0), filter_hook=step_filter(0), capacity=8)
    opt = torch.optim.Adam(table.parameters(), lr=0.5)
    table.attach_optimizer(opt)
    table.advance(0)
    _trained_rows(table, opt, torch.arange(8))
    old_slots = set(table.lookup_slots(torch.arange(8))[0].tolist())
    table.advance(2)
    assert table.evict() == 8
    cap, mem = table.capacity, table.memory_bytes()
    fresh = table(torch.arange(100, 108))
    assert table.capacity == cap and table.memory_bytes() <= mem  # no growth
    assert set(table.lookup_slots(torch.arange(100, 108))[0].tolist()) == old_slots
    assert torch.equal(fresh, torch.ones(8, 2))  # re-initialised, not the old trained rows
    state = opt.state[table.weight]
    assert all(float(state[k].abs().sum()) == 0.0 for k in ("exp_avg", "exp_avg_sq"))


def test_scan_then_apply_spares_rows_used_in_between() -> None:
    table = HashTable(2, filter_hook=step_filter(1))
    table.advance(0)
    table(torch.arange(10))
    table.advance(5)
    plan = table.scan_eviction()
    assert plan.candidates == 10 and plan.now == 5
    table(ids(3, 4))  # looked up after the scan: must survive its apply
    assert table.apply_eviction(plan) == 8
    assert table.ids().tolist() == [3, 4]
    stats = table.eviction_stats()
    assert stats["evicted_total"] == 8 and stats["last"]["candidates"] == 10
    assert table.apply_eviction(plan) == 0  # applying twice frees nothing twice
    with pytest.raises(ValueError, match="plan: expected an EvictionPlan of table"):
        HashTable(2, name="other", filter_hook=step_filter(1)).apply_eviction(plan)


def test_plan_made_before_a_load_is_ignored() -> None:
    table = HashTable(2, filter_hook=step_filter(0))
    table(torch.arange(4))
    state = copy.deepcopy(table.state_dict())
    table.advance(3)
    plan = table.scan_eviction()
    table.load_state_dict(state)
    assert table.apply_eviction(plan) == 0 and table.ids_count() == 4


def test_eviction_in_a_thread_never_races_lookups(id_map: str) -> None:
    torch.manual_seed(1)
    table = HashTable(4, initializer=const(1.0), filter_hook=step_filter(2))
    stop = threading.Event()
    errors: list[BaseException] = []

    def evictor() -> None:
        try:
            while not stop.is_set():
                table.evict()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    worker = threading.Thread(target=evictor)
    worker.start()
    try:
        for step in range(60):
            table.advance(step)
            batch = torch.randint(0, 5000, (2000,))
            out = table(batch)
            # every id just looked up has a row with its initial value (never half-evicted)
            assert torch.equal(out, torch.ones(2000, 4))
            assert table.contains(batch).all()
    finally:
        stop.set()
        worker.join()
    assert not errors
    ids_, slots = table._map.items()
    assert len(set(slots.tolist())) == table.ids_count() == ids_.numel()
    assert len(table._free) + table.ids_count() == table._next


def test_growth_past_huge_page_sizes_keeps_rows_and_optimizer_state() -> None:
    """Rows and Adam state of a table grown from 16 rows through mappings of several MiB
    equal those of a table that never grew; growth inside a mapping's reserve moves nothing
    and every tensor's storage is exactly its size (a checkpoint carries no reserve)."""
    torch.manual_seed(0)
    init = lambda t: torch.nn.init.normal_(t)  # noqa: E731
    grown, fixed = HashTable(64, capacity=16), HashTable(64, capacity=1 << 17)
    opts = []
    for table in (grown, fixed):
        opt = torch.optim.Adam(table.parameters(), lr=0.01)
        table.attach_optimizer(opt)
        opts.append(opt)
    g = torch.Generator().manual_seed(1)
    growths = []  # (new capacity, whether the rows moved)
    for _ in range(12):
        batch = torch.randint(0, 1 << 30, (8000,), generator=g)
        rows = init(torch.empty(batch.numel(), 64))
        ptr, cap = grown.weight.data_ptr(), grown.capacity
        for table, opt in zip((grown, fixed), opts, strict=True):
            opt.zero_grad()
            (table(batch) * rows).sum().backward()
            opt.step()
        if grown.capacity != cap:
            growths.append((grown.capacity, grown.weight.data_ptr() != ptr))
    assert grown.capacity < fixed.capacity and grown.ids_count() == fixed.ids_count()
    everything = fixed.ids()
    grown.eval()
    fixed.eval()
    torch.testing.assert_close(grown(everything), fixed(everything))
    gs, fs = grown.lookup_slots(everything)[0], fixed.lookup_slots(everything)[0]
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(
            opts[0].state[grown.weight][key][gs], opts[1].state[fixed.weight][key][fs]
        )
    if _memory._ADVICE is not None:  # Linux: growth within the reserve is in place
        mapped = 0  # capacity when the current mapping was made
        for new, moved in growths:
            assert moved == (new > _memory._RESERVE * mapped), growths
            mapped = new if moved else mapped
        assert sum(not moved for _, moved in growths) >= 3, growths
    assert grown.weight.untyped_storage().nbytes() == grown.weight.nbytes
    buf = io.BytesIO()
    torch.save(grown.state_dict(), buf)
    assert len(buf.getvalue()) < grown.weight.nbytes * 1.2


# ---------------------------------------------------------------- state
def test_state_dict_round_trips_into_a_fresh_table(id_map: str) -> None:
    torch.manual_seed(0)
    table = HashTable(
        [2, 2], initializer=lambda t: torch.nn.init.normal_(t), filter_hook=step_filter(4)
    )
    table.advance(1)
    table(torch.arange(50))
    table.advance(7)
    table(torch.arange(40, 300))
    assert table.evict(5) == 0  # 5 - 1 = 4: nothing is stale yet
    table.advance(9)
    buf = io.BytesIO()
    torch.save(table.state_dict(), buf)
    buf.seek(0)
    fresh = HashTable([2, 2], filter_hook=step_filter(4), capacity=2)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(fresh.ids(), table.ids())
    table.eval()
    fresh.eval()
    assert torch.equal(fresh(torch.arange(300)), table(torch.arange(300)))
    assert fresh.step == 9
    # the stamps came along: the same ids are stale
    assert fresh.evict(11) == table.evict(11) == 40  # stamped 1: 11 - 1 > 4; stamped 7: not
    assert torch.equal(fresh.ids(), table.ids())


def test_state_dict_inside_a_model_and_key_checks() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = HashTable(3, initializer=const(2.0), filter_hook=step_filter(1))
            self.dense = nn.Linear(3, 1)

    a, b = Model(), Model()
    a.user(ids(5, 6))
    sd = a.state_dict()
    assert set(sd) == {
        "user.weight",
        "user.ids",
        "user.slots",
        "user.filter_last_seen",
        "user.filter_clock",
        "dense.weight",
        "dense.bias",
    }
    b.load_state_dict(sd)
    assert b.user.ids().tolist() == [5, 6]
    missing = {k: v for k, v in sd.items() if k != "user.filter_last_seen"}
    with pytest.raises(RuntimeError, match="Missing key.*user.filter_last_seen"):
        Model().load_state_dict(missing)
    with pytest.raises(RuntimeError, match="Unexpected key.*user.extra"):
        Model().load_state_dict({**sd, "user.extra": torch.zeros(1)})
    bad = dict(sd, **{"user.ids": torch.tensor([5, 5])})
    with pytest.raises(RuntimeError, match="ids: expected distinct values"):
        Model().load_state_dict(bad)
    bad = dict(sd, **{"user.weight": torch.zeros(4, 7)})
    with pytest.raises(
        RuntimeError, match=r"weight: expected a floating tensor of shape \[capacity, 3\]"
    ):
        Model().load_state_dict(bad)


def test_pickle_deepcopy_and_attach_helper() -> None:
    table = HashTable(
        2,
        initializer=functools.partial(nn.init.constant_, val=1.0),
        admit_hook=None,
        filter_hook=step_filter(3),
        policies=register_admit_policy("EvenOnly", EvenOnly),
    )
    table(ids(1, 2))
    for clone in (pickle.loads(pickle.dumps(table)), copy.deepcopy(table)):
        assert clone.ids().tolist() == [1, 2]
        clone(ids(3))  # its own lock works
        assert clone.ids_count() == 3 and table.ids_count() == 2
        assert clone.filter_hook == step_filter(3) and "EvenOnly" in clone.policies.admit_names
    model = nn.ModuleDict({"a": table, "b": HashTable(2)})
    assert attach_optimizer(model, torch.optim.Adam(model.parameters())) == 2
    with pytest.raises(ValueError, match="optimizer: expected a torch.optim.Optimizer"):
        table.attach_optimizer(object())  # type: ignore[arg-type]


def test_ids_count_and_memory_bytes() -> None:
    table = HashTable(16, capacity=8)
    empty = table.memory_bytes()
    assert table.ids_count() == 0 and empty >= 8 * 16 * 4
    table(torch.arange(1000))
    assert table.ids_count() == 1000
    assert table.memory_bytes() >= 1000 * 16 * 4 + 1000 * 16  # rows + at least a key/slot each
