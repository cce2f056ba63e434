from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from recis_async import HookBus, add_metric, add_to_ml_tracker, add_to_trace
from recis_async.events import AfterStep, BeforeStep, OutOfData
from recis_async.hostcopy import HostCopy
from recis_async.window import read_values

pytestmark = pytest.mark.anyio


async def test_collected_values_attach_to_the_next_after_step_then_clear(tensor_path: str) -> None:
    seen: list[AfterStep] = []
    async with HookBus() as bus:
        bus.subscribe(AfterStep, seen.append)
        weights = torch.arange(6, dtype=torch.float32).reshape(3, 2)
        add_metric("loss", torch.tensor(0.5))
        add_to_trace("user_id", torch.tensor([1, 2, 3]))
        add_to_trace("emb", weights)
        add_to_ml_tracker("auc", np.float32(0.75))
        add_to_ml_tracker("hist", torch.tensor([1.0, 2.0]))
        weights.add_(100)  # in-place change after collection must not leak
        await bus.publish(AfterStep(global_step=0, metrics={"lr": 0.1}))
        await bus.publish(AfterStep(global_step=1))
    first, second = seen
    if tensor_path == "device":
        assert isinstance(first.metrics["loss"], torch.Tensor)  # kept on its device, not read
        # tensors reach AfterStep as host copies (issue 23), read with np.asarray
        assert isinstance(first.trace["user_id"], HostCopy)
    else:  # a CPU tensor waits for nothing: a metric or tracked value is read at the call
        assert first.metrics["loss"] == 0.5 and type(first.metrics["loss"]) is float
        assert first.tracked["hist"] == [1.0, 2.0]
        # a trace column is held as a clone, read off the step (hostcopy.held)
        held = first.trace["emb"]
        assert isinstance(held, HostCopy) and not held.resolved
        assert (held.dtype, tuple(held.shape), held.nbytes) == (np.dtype(np.float32), (3, 2), 24)
        assert not np.asarray(held).flags.writeable and held.resolved
    assert read_values(first.metrics) == {"loss": 0.5, "lr": 0.1}
    assert np.asarray(first.trace["user_id"]).tolist() == [1, 2, 3]
    assert np.asarray(first.trace["emb"]).tolist() == [[0, 1], [2, 3], [4, 5]]
    assert first.tracked["auc"] == 0.75
    assert np.asarray(first.tracked["hist"]).tolist() == [1.0, 2.0]
    assert second.metrics == {} and second.trace == {} and second.tracked == {}


async def test_publisher_values_win_over_collected() -> None:
    seen: list[AfterStep] = []
    async with HookBus() as bus:
        bus.subscribe(AfterStep, seen.append)
        add_metric("loss", 1.0)
        add_metric("acc", 0.9)
        await bus.publish(AfterStep(metrics={"loss": 2.0}))
    assert seen[0].metrics == {"loss": 2.0, "acc": 0.9}


async def test_out_of_data_discards_the_unfinished_step() -> None:
    seen: list[dict[str, Any]] = []
    async with HookBus() as bus:
        bus.subscribe(AfterStep, lambda e: seen.append(e.metrics))
        await bus.publish(BeforeStep(global_step=0))
        add_metric("loss", 3.0)
        await bus.publish(OutOfData(global_step=0))
        await bus.publish(BeforeStep(is_train=False))
        await bus.publish(AfterStep(is_train=False))
    assert seen == [{}]


async def test_collectors_are_per_bus() -> None:
    outer: list[dict[str, Any]] = []
    inner: list[dict[str, Any]] = []
    async with HookBus() as bus_a:
        bus_a.subscribe(AfterStep, lambda e: outer.append(e.metrics))
        add_metric("a", 1)
        async with HookBus() as bus_b:
            bus_b.subscribe(AfterStep, lambda e: inner.append(e.metrics))
            add_metric("b", 2)
            await bus_b.publish(AfterStep())
        add_metric("c", 3)
        await bus_a.publish(AfterStep())
    assert inner == [{"b": 2}]
    assert outer == [{"a": 1, "c": 3}]


def test_collectors_need_an_open_bus() -> None:
    for fn in (add_metric, add_to_trace, add_to_ml_tracker):
        with pytest.raises(RuntimeError, match=rf"{fn.__name__}\(\) called with no HookBus open"):
            fn("x", [1])


async def test_collectors_refuse_bad_values_naming_the_type() -> None:
    async with HookBus():
        with pytest.raises(
            ValueError,
            match=r"add_to_trace\('user_id'\): expected a torch.Tensor, numpy.ndarray or list, got dict",
        ):
            add_to_trace("user_id", {"a": 1})
        with pytest.raises(ValueError, match=r"got a scalar"):
            add_to_trace("user_id", np.array(1.0))
        with pytest.raises(ValueError, match=r"add_to_ml_tracker\('run'\): .* got str"):
            add_to_ml_tracker("run", "fast")
        with pytest.raises(
            TypeError, match=r"add_metric\(name=...\): expected a non-empty str, got 3"
        ):
            add_metric(3, 1.0)  # type: ignore[arg-type]


async def test_collectors_closed_after_the_block() -> None:
    async with HookBus() as bus:
        await bus.aclose()
        with pytest.raises(RuntimeError, match="no HookBus open"):
            add_metric("late", 1.0)


@pytest.mark.parametrize("received", [False, True], ids=["unreceived", "received"])
async def test_switching_between_train_and_eval_drops_the_other_kinds_values(
    received: bool,
) -> None:
    """Whether or not a subscriber receives ``BeforeStep`` (unreceived, its publish does only
    the bus's part of it)."""
    seen: list[tuple[bool, dict[str, Any]]] = []
    befores: list[BeforeStep] = []
    async with HookBus() as bus:
        bus.subscribe(AfterStep, lambda e: seen.append((e.is_train, e.metrics)))
        if received:
            bus.subscribe(BeforeStep, befores.append)
        await bus.publish(BeforeStep(is_train=True))
        await bus.publish(AfterStep(is_train=True))
        add_metric("from_a_train_hook", 1.0)  # collected after the train step finished
        await bus.publish(BeforeStep(is_train=False))
        add_metric("eval_loss", 2.0)
        await bus.publish(AfterStep(is_train=False))
        await bus.publish(BeforeStep(is_train=False))
        add_metric("next", 3.0)
        await bus.publish(AfterStep(is_train=False))
    assert seen == [(True, {}), (False, {"eval_loss": 2.0}), (False, {"next": 3.0})]
    assert [b.is_train for b in befores] == ([True, False, False] if received else [])


async def test_trace_values_are_private_read_only_copies_and_ragged_lists_work() -> None:
    seen: list[AfterStep] = []
    async with HookBus() as bus:
        bus.subscribe(AfterStep, seen.append)
        source = np.arange(3)
        add_to_trace("ids", source)
        add_to_trace("tags", [[1, 2], [3], []])  # ragged: one array per row
        await bus.publish(AfterStep())
    ids = seen[0].trace["ids"]
    assert not ids.flags.writeable and not np.shares_memory(ids, source)
    assert [row.tolist() for row in seen[0].trace["tags"]] == [[1, 2], [3], []]


async def test_a_plain_cpu_tensor_is_traced_as_a_held_clone_read_off_the_step() -> None:
    """The fast way (a dense CPU tensor of a numpy dtype): a clone the caller's later
    in-place changes do not reach, held as a ``HostCopy`` that is read only when resolved
    (off the step: numpy's conversion costs a cold step more than the clone), strided views
    laid out, a grad tensor detached, a negative bit resolved, and a 0-d one refused."""
    seen: list[AfterStep] = []
    ids = torch.arange(6)
    async with HookBus() as bus:
        bus.subscribe(AfterStep, seen.append)
        add_to_trace("ids", ids)
        add_to_trace("every_other", torch.arange(10)[::2])
        add_to_trace("grad", torch.ones(2, requires_grad=True))
        add_to_trace("negated", torch._neg_view(torch.arange(3.0)))
        ids.add_(100)  # after the call: not in the trace
        with pytest.raises(ValueError, match=r"add_to_trace\('x'\): expected one entry per row"):
            add_to_trace("x", torch.tensor(3))
        await bus.publish(AfterStep())
    trace = seen[0].trace
    assert all(type(v) is HostCopy and not v.resolved for v in trace.values())
    assert "x" not in trace
    values = {name: np.asarray(v) for name, v in trace.items()}
    assert values["ids"].tolist() == list(range(6)) and not values["ids"].flags.writeable
    assert values["every_other"].tolist() == [0, 2, 4, 6, 8]
    assert values["every_other"].flags.c_contiguous
    assert values["grad"].tolist() == [1.0, 1.0]
    assert values["negated"].tolist() == [-0.0, -1.0, -2.0]
    assert trace["ids"].dtype == np.dtype(np.int64) and len(trace["ids"]) == 6


async def test_trace_tensors_of_every_kind_are_copied_as_their_values() -> None:
    seen: list[AfterStep] = []
    weights = torch.nn.Parameter(torch.tensor([1.0, 2.0]))  # requires grad
    cplx = torch.tensor([1 + 2j, 3 - 1j])
    plain = torch.tensor([5, 6])
    async with HookBus() as bus:
        bus.subscribe(AfterStep, seen.append)
        add_to_trace("w", weights)
        add_to_trace("conj", cplx.conj())  # conjugate bit set: resolved
        negative = cplx.conj().imag
        assert negative.is_neg()
        add_to_trace("neg", negative)  # negative bit set: resolved
        add_to_trace("plain", plain)
        plain.add_(10)  # later in-place changes do not reach the trace
        # bfloat16 (GPU training's dtype) has no numpy dtype: kept as float32, exactly
        bf = torch.tensor([1.5, -0.0078125, 3.0e38], dtype=torch.bfloat16)
        add_to_trace("bf", bf)
        add_to_trace("half", torch.tensor([0.5, 65504.0], dtype=torch.float16))
        with pytest.raises(ValueError, match=r"add_to_trace\(.f8.\): .*got torch.float8_e4m3fn"):
            add_to_trace("f8", torch.ones(2, dtype=torch.float8_e4m3fn))
        await bus.publish(AfterStep())
    trace = {name: np.asarray(value) for name, value in seen[0].trace.items()}
    assert trace["w"].tolist() == [1.0, 2.0]
    assert trace["conj"].tolist() == [1 - 2j, 3 + 1j]
    assert trace["neg"].tolist() == [-2.0, 1.0]
    assert trace["plain"].tolist() == [5, 6]
    assert trace["bf"].dtype == np.float32 and trace["bf"].tolist() == bf.float().tolist()
    assert trace["half"].tolist() == [0.5, 65504.0]
    assert "f8" not in trace


async def test_add_metric_refuses_what_is_not_a_number_tensor_or_array() -> None:
    async with HookBus():
        for bad, shown in (
            ("abc", r"str \('abc'\)"),
            (None, r"NoneType \(None\)"),
            ({"a": 1}, r"dict"),
            (1j, r"complex"),
            (np.array(["a"]), r"ndarray of dtype <U1"),
            (["a", "b"], r"list \(\['a', 'b'\]\)"),
            ([[1], [2, 3]], r"list"),
            (torch.zeros(2, dtype=torch.complex64), r"Tensor of dtype torch.complex64"),
        ):
            with pytest.raises(
                TypeError,
                match=r"add_metric\('loss'\): expected a number, tensor, numeric numpy array "
                r"or list of numbers \(a str or other array needs reduce='last' or a callable\), "
                rf"got {shown}",
            ):
                add_metric("loss", bad)
        add_metric("tag", "batch-3", reduce="last")  # a str the reduction can combine
        add_metric("names", np.array(["a"]), reduce=lambda v: v[-1])
        with pytest.raises(TypeError, match=r"add_metric\('tag'\): .* got NoneType"):
            add_metric("tag", None, reduce="last")


async def test_add_metric_keeps_numbers_and_converts_tensors_arrays_and_lists(
    tensor_path: str,
) -> None:
    seen: list[AfterStep] = []
    async with HookBus() as bus:
        bus.subscribe(AfterStep, seen.append)
        add_metric("flag", True)
        add_metric("n", np.int64(3))
        half = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
        add_metric("half", half)
        add_metric("grad", torch.tensor(0.5, requires_grad=True))
        add_metric("xs", [0.1, 0.2])
        add_metric("count", torch.tensor([7]))
        half.add_(1)  # in-place change after collection must not leak
        await bus.publish(AfterStep())
    kept = seen[0].metrics
    if tensor_path == "device":  # kept on the device, unread
        assert kept["half"].dtype == torch.bfloat16 and not kept["grad"].requires_grad
    else:  # read at the call: numbers, and owned float32 arrays for the half types
        assert type(kept["grad"]) is float and kept["count"] == 7 and type(kept["count"]) is int
        assert type(kept["half"]) is np.ndarray and kept["half"].dtype == np.float32
    metrics = read_values(kept)  # as a hook reads them, off the step
    assert metrics["flag"] is True and metrics["n"] == 3 and metrics["grad"] == 0.5
    assert metrics["half"].dtype == np.float32 and metrics["half"].tolist() == [1.0, 2.0]
    assert metrics["xs"].tolist() == [0.1, 0.2] and metrics["count"] == 7


async def test_tensors_without_readable_values_are_refused_naming_the_call() -> None:
    async with HookBus():
        meta = torch.zeros(3, device="meta")
        for call in (add_to_trace, add_metric, add_to_ml_tracker):
            with pytest.raises(
                ValueError,
                match=rf"{call.__name__}\('x'\): expected a tensor holding data, got a tensor "
                r"on the meta device \(shape \(3,\)",
            ):
                call("x", meta)
        with pytest.raises(
            ValueError,
            match=r"add_to_trace\('x'\): expected a dense tensor, got layout torch.sparse_coo",
        ):
            add_to_trace("x", torch.zeros(3).to_sparse())
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
        with pytest.raises(
            ValueError, match=r"add_to_trace\('x'\): expected a dense tensor, got a nested"
        ):
            add_to_trace("x", nested)
        # one element each: the shapes a loss has, which the collectors read at the call
        one = {
            "a nested tensor": torch.nested.nested_tensor([torch.ones(1)]),
            "layout torch.sparse_coo": torch.ones(1).to_sparse(),
            "layout torch.sparse_csr": torch.ones(1, 1).to_sparse_csr(),
        }
        for call in (add_metric, add_to_ml_tracker):
            for what, value in one.items():
                with pytest.raises(
                    ValueError,
                    match=rf"{call.__name__}\('x'\): expected a dense tensor, got {what}",
                ):
                    call("x", value)
