"""Embedding tables on a device: the id map stays on the host, the rows (with their gradients
and the attached optimizer's row state) follow ``.to()``; a lookup's indices reach the rows'
device in one copy.  A CPU-only machine checks the same code with a dtype change (which moves
the row state as a device change does) and the meta device (which shows where tensors went);
the ``gpu`` tests run it on CUDA under ``set_sync_debug_mode("error")``."""

from __future__ import annotations

import functools
import io

import pytest
import torch

from recis_async.nn import DynamicEmbedding, EmbeddingOption, FilterHook, HashTable
from recis_async.nn._device import host_to

META = torch.device("meta")


def table(**kw: object) -> HashTable:
    return HashTable(
        4,
        initializer=functools.partial(torch.nn.init.normal_, std=0.1),
        capacity=4,
        **kw,  # type: ignore[arg-type]
    )


def train(t: HashTable, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    t(ids).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def test_attached_optimizer_state_follows_the_table() -> None:
    torch.manual_seed(0)
    t = table()
    opt = torch.optim.Adam(t.parameters(), lr=0.1)
    t.attach_optimizer(opt)
    train(t, opt, torch.arange(3))
    t.double()  # what .to("cuda") does to the rows, done to their dtype
    state = opt.state[t.weight]
    assert t.weight.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float64
    train(t, opt, torch.arange(2, 20))  # grows past the capacity: state padded in float64
    assert t.capacity >= 20 and state["exp_avg"].shape == t.weight.shape
    assert state["exp_avg"].dtype == torch.float64

    # a checkpoint of the moved table restores equal into a table of the same kind
    buf = io.BytesIO()
    torch.save({"table": t.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = table().double()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh.attach_optimizer(fresh_opt)
    fresh.load_state_dict(saved["table"])
    fresh_opt.load_state_dict(saved["opt"])
    ids = torch.arange(20)
    assert torch.equal(fresh(ids), t(ids))
    assert fresh.weight.dtype == torch.float64
    train(t, opt, ids)
    train(fresh, fresh_opt, ids)
    assert torch.equal(fresh(ids), t(ids))


def test_rows_move_with_the_module_and_the_id_map_stays_on_the_host() -> None:
    e = DynamicEmbedding(
        EmbeddingOption(
            embedding_dim=4,
            shared_name="m",
            combiner="mean",
            filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 2}),
        )
    )
    e(torch.tensor([[1, 2], [3, -1]]))
    e.to(META)
    assert e.table.device == META and e.table.weight.device == META
    out = e(torch.tensor([[1, 2, -1], [7, -1, -1]]))  # host ids; 7 is inserted
    assert out.device == META and out.shape == (2, 4)
    out.sum().backward()
    assert e.table.weight.grad is not None and e.table.weight.grad.device == META
    assert e.table.ids().device.type == "cpu" and e.table.ids().tolist() == [1, 2, 3, 7]
    rows = e.table(torch.tensor([7, 99]))  # eval-like miss: zeros on the rows' device
    assert rows.device == META and rows.shape == (2, 4)
    assert e.table.scan_eviction(10).slots.device.type == "cpu"  # evictions: host only


def test_host_to_sends_many_indices_in_one_copy() -> None:
    a, b, c = torch.arange(3), torch.arange(5), torch.zeros(0, dtype=torch.int64)
    moved = host_to(META, a, b, c)
    assert [m.device for m in moved] == [META] * 3
    assert [tuple(m.shape) for m in moved] == [(3,), (5,), (0,)]
    same = host_to(torch.device("cpu"), a, b)
    assert same[0] is a and same[1] is b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sparse", [False, True])
def test_on_cuda_a_table_trains_without_synchronizing(sparse: bool) -> None:
    torch.manual_seed(0)
    t = table(sparse=sparse, filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 2}))
    t.to("cuda")
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(t.parameters(), lr=0.1)
        if sparse
        else torch.optim.Adam(t.parameters(), lr=0.1)
    )
    t.attach_optimizer(opt)
    train(t, opt, torch.arange(8))  # warm-up: allocations, pinned blocks
    t.evict(10)  # frees rows: later lookups reuse them (initialised on the device)
    try:
        # sparse gradients: torch's own sparse ops (coalescing in the optimizer step) may read
        # the number of distinct rows; the table's part is checked with dense ones
        torch.cuda.set_sync_debug_mode("default" if sparse else "error")
        for step in range(5):
            t.advance(step)
            train(t, opt, torch.arange(step * 3, step * 3 + 40))  # grows, reuses, inserts
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert t.weight.device.type == "cuda"
    assert t.weight.grad is None or t.weight.grad.device.type == "cuda"
    state = t.state_dict()
    fresh = table(sparse=sparse, filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 2}))
    fresh.to("cuda").load_state_dict(state)
    ids = torch.arange(12, 52)  # the last step's ids (unseen ids get fresh random rows)
    assert fresh.weight.device.type == "cuda"
    assert torch.equal(fresh(ids), t(ids))
