"""Trainer(device=...): batches reach the model on its device (pinned, non-blocking copies),
ids named in keep_on_host stay on the host; the model moves to a device given."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from recis_async import HookBus, Priority, Trainer, TrainingArguments
from recis_async.batches import Lookahead, model_device, mover, to_device
from recis_async.events import AfterStep, BeforeStep

pytestmark = pytest.mark.anyio

META = torch.device("meta")  # a device a CPU-only machine has: a move to it is visible
Pair = namedtuple("Pair", "a b")


def test_to_device_moves_nested_tensors_and_leaves_the_rest() -> None:
    batch = {
        "ids": torch.arange(4),
        "dense": torch.ones(4, 2),
        "nested": [torch.zeros(4), (torch.ones(1), "text"), Pair(torch.ones(2), 7)],
        "name": "b0",
        "ordered": OrderedDict(x=torch.ones(1)),
    }
    moved = to_device(batch, META, keep_on_host={"ids"})
    assert moved["ids"] is batch["ids"]  # kept on the host, untouched
    assert moved["dense"].device == META and moved["dense"].shape == (4, 2)
    first, (one, text), pair = moved["nested"]
    assert first.device == one.device == pair.a.device == META
    assert text == "text" and pair.b == 7 and isinstance(pair, Pair)
    assert moved["name"] == "b0"
    assert isinstance(moved["ordered"], OrderedDict) and moved["ordered"]["x"].device == META
    assert moved is not batch and batch["dense"].device.type == "cpu"  # the user's dict kept
    cpu = torch.device("cpu")
    assert to_device(batch, cpu)["dense"] is batch["dense"]  # already there: no copy


def test_a_dict_batch_with_nothing_to_move_comes_back_as_it_is() -> None:
    batch = {"x": torch.ones(2), "ids": torch.arange(2), "name": "b0"}
    assert to_device(batch, torch.device("cpu")) is batch  # not even the dict is copied
    assert to_device(batch, META, keep_on_host={"x", "ids"}) is batch
    half = to_device(batch, META, keep_on_host={"ids"})
    assert half is not batch and half["x"].device == META and half["ids"] is batch["ids"]
    assert batch["x"].device.type == "cpu"


def test_lookahead_reads_ahead_once_and_hands_out_in_order() -> None:
    read: list[int] = []

    def source() -> Any:
        for i in range(3):
            read.append(i)
            yield i

    ahead = Lookahead(source(), prepare=lambda b: b * 10)
    assert ahead.has(2) and read == [0, 1]
    assert ahead.take() == 0
    assert not ahead.has(3) and ahead.has(2)  # 10 and 20 left
    assert [ahead.take(), ahead.take()] == [10, 20]
    with pytest.raises(StopIteration):
        ahead.take()


def test_take_alone_reads_one_batch_at_a_time_and_prepares_each_once() -> None:
    read: list[int] = []
    prepared: list[int] = []

    def source() -> Any:
        for i in range(2):
            read.append(i)
            yield i

    def prepare(b: int) -> int:
        prepared.append(b)
        return b + 100

    ahead = Lookahead(source(), prepare=prepare)
    assert ahead.take() == 100 and read == [0] and prepared == [0]
    assert ahead.has(1) and ahead.take() == 101 and prepared == [0, 1]
    for _ in range(2):  # the end is remembered: the exhausted iterator is not read again
        with pytest.raises(StopIteration):
            ahead.take()
    assert not ahead.has(1) and read == [0, 1]


@pytest.mark.parametrize("keep", [(), ("ids",), ("x", "ids")])
@pytest.mark.parametrize("device", [torch.device("cpu"), META])
def test_mover_moves_as_to_device_does(device: torch.device, keep: tuple[str, ...]) -> None:
    batch = {"x": torch.ones(2), "ids": torch.arange(2), "rows": [torch.zeros(1)], "name": "b"}
    moved, expected = mover(device, keep)(batch), to_device(batch, device, keep)
    assert (moved is batch) == (expected is batch)
    assert moved.keys() == expected.keys() and moved["name"] == "b"
    for key in ("x", "ids"):
        assert moved[key].device == expected[key].device
        assert (moved[key] is batch[key]) == (expected[key] is batch[key])
    assert moved["rows"][0].device == expected["rows"][0].device
    assert batch["x"].device.type == "cpu"  # the user's batch is never changed in place


class Recorder(torch.nn.Module):
    """Records where each batch's tensors arrived; its weight is a plain tensor on the CPU
    (not a parameter), so a Trainer moving the module to the meta device leaves the step
    runnable while the batches do go there."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.ones(2, requires_grad=True)
        self.seen: list[dict[str, str]] = []

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.seen.append({k: v.device.type for k, v in batch.items()})
        return (self.w**2).sum()


async def test_the_trainer_moves_batches_to_the_device_given(tmp_path: Path) -> None:
    model = Recorder()
    data = [{"ids": torch.arange(3), "x": torch.ones(3, 2)} for _ in range(3)]
    trainer = Trainer(
        model,
        TrainingArguments(output_dir=str(tmp_path), save_steps=None),
        train_dataset=data,
        eval_dataset=data[:2],
        dense_optimizers=(torch.optim.SGD([model.w], lr=0.1), None),
        device="meta",
        keep_on_host=["ids"],
    )
    assert trainer.device == META
    await trainer.train()
    await trainer.evaluate()
    assert model.seen == [{"ids": "cpu", "x": "meta"}] * 5


NO_SAVES = TrainingArguments(save_steps=None)


def test_a_device_given_moves_the_model_and_none_follows_it() -> None:
    model = torch.nn.Linear(2, 1)
    assert Trainer(model, NO_SAVES).device == torch.device("cpu")
    trainer = Trainer(model, NO_SAVES, device="meta")
    assert model.weight.device == META and trainer.device == META
    other = torch.nn.Linear(2, 1)
    follows = Trainer(other, NO_SAVES)
    other.to("meta")  # moved after the trainer was made: the next loop follows it
    assert follows.device == META == model_device(other)


def test_bad_device_arguments_are_refused_at_the_call() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"Trainer\(device=...\): expected a torch.device"):
        Trainer(model, NO_SAVES, device=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Trainer\(device=...\): expected a usable device"):
        Trainer(model, NO_SAVES, device="warp-drive")
    with pytest.raises(TypeError, match=r"Trainer\(keep_on_host=...\)"):
        Trainer(model, NO_SAVES, keep_on_host="ids")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_on_cuda_the_ordinary_step_never_synchronizes(tmp_path: Path) -> None:
    """From the third step on, any synchronization in a step (a pageable copy, a read of the
    loss) raises: torch.cuda.set_sync_debug_mode("error") around each step."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
            self.out = torch.nn.Linear(16, 1)

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            return self.out(self.net(batch)).pow(2).mean()

    model = Net()
    trainer = Trainer(
        model,
        TrainingArguments(output_dir=str(tmp_path), save_steps=None, log_steps=1000),
        train_dataset=[torch.randn(32, 8) for _ in range(12)],
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None),
        device="cuda",
    )

    def guard(event: BeforeStep) -> None:
        torch.cuda.set_sync_debug_mode("error" if event.global_step >= 2 else "default")

    def unguard(event: AfterStep) -> None:
        torch.cuda.set_sync_debug_mode("default")

    try:
        async with HookBus() as bus:
            trainer.bus = bus
            bus.subscribe(BeforeStep, guard, priority=Priority.LOWEST)
            bus.subscribe(AfterStep, unguard, priority=Priority.LOWEST)
            await trainer.train()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.global_step == 12
