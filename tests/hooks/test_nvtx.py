"""NvtxHook: the ranges it pushes and pops, recorded through its ``ranges`` seam on the CPU;
the real ``torch.cuda.nvtx`` under the ``gpu`` marker."""

from __future__ import annotations

import logging
import threading

import anyio
import pytest
import torch
from hooks_support import trainer

from recis_async import Hook, HookBus, Priority
from recis_async.events import (
    AfterBackward,
    AfterData,
    AfterEval,
    AfterStep,
    BeforeStep,
    OutOfData,
    Start,
)
from recis_async.hooks import NvtxHook

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


class Recorder:
    """Keeps the NVTX stack as torch.cuda.nvtx would, and every finished range by depth."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.closed: list[tuple[int, str]] = []  # (depth, name) in the order they ended
        self.threads: set[int] = set()

    def range_push(self, msg: str) -> int:
        self.threads.add(threading.get_ident())
        self.stack.append(msg)
        return len(self.stack) - 1

    def range_pop(self) -> int:
        self.threads.add(threading.get_ident())
        name = self.stack.pop()
        self.closed.append((len(self.stack), name))
        return len(self.stack)


class Inside(Hook):
    """Sees which ranges are open while ordinary hooks run."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.seen: list[list[str]] = []

    def after_data(self, event: AfterData) -> None:
        self.seen.append(list(self.rec.stack))


async def test_phases_of_a_step_and_the_hooks_ranges() -> None:
    rec = Recorder()
    inside = Inside(rec)
    async with HookBus() as bus:
        bus.add_hook(NvtxHook(rec))
        bus.add_hook(inside)
        await bus.publish(Start())
        for cls in (BeforeStep, AfterData, AfterBackward, AfterStep):
            await bus.publish(cls(global_step=7))
        assert rec.stack == []
        await bus.publish(BeforeStep(is_train=False, global_step=8))
        await bus.publish(AfterData(is_train=False, global_step=8))
        await bus.publish(AfterStep(is_train=False, global_step=8))
        await bus.publish(BeforeStep(global_step=9))
        await bus.publish(OutOfData(global_step=9))
        await bus.publish(AfterEval(global_step=9))
    assert inside.seen == [["train step 7", "hooks AfterData"], ["eval step 8", "hooks AfterData"]]
    assert rec.closed == [
        (0, "hooks Start"),
        (1, "hooks BeforeStep"),
        (1, "data"),
        (1, "hooks AfterData"),
        (1, "forward+backward"),
        (1, "hooks AfterBackward"),
        (1, "optimizer"),
        (1, "hooks AfterStep"),
        (0, "train step 7"),
        (1, "hooks BeforeStep"),
        (1, "data"),
        (1, "hooks AfterData"),
        (1, "forward"),
        (1, "hooks AfterStep"),
        (0, "eval step 8"),
        (1, "hooks BeforeStep"),
        (1, "data"),
        (1, "hooks OutOfData"),
        (0, "train step 9"),
        (0, "hooks AfterEval"),
        (0, "hooks End"),
    ]
    assert rec.stack == [] and rec.threads == {threading.get_ident()}


async def test_the_trainer_balances_every_range() -> None:
    rec = Recorder()
    t = trainer([NvtxHook(rec)], train_epoch=1, eval_steps=2)
    await t.train_and_evaluate()
    assert rec.stack == []
    steps = [name for depth, name in rec.closed if depth == 0 and "step" in name]
    assert steps == [f"train step {g}" for g in range(10)] + ["train step 10"] + [
        "eval step 10",
        "eval step 10",
    ]  # the 11th training step found no data; two evaluation steps
    phases = [name for depth, name in rec.closed if depth == 1 and not name.startswith("hooks")]
    assert phases[:3] == ["data", "forward+backward", "optimizer"]


class Fails(Hook):
    priority = Priority.HIGH

    def after_backward(self, event: AfterBackward) -> None:
        raise RuntimeError("boom")


async def test_a_failing_hook_leaves_no_range_open() -> None:
    rec = Recorder()
    with pytest.raises(Exception, match="boom"):
        async with HookBus() as bus:
            bus.add_hook(NvtxHook(rec))
            bus.add_hook(Fails())
            for cls in (BeforeStep, AfterData, AfterBackward):
                await bus.publish(cls(global_step=0))
    assert rec.stack == []
    assert rec.closed[-3:] == [(0, "train step 0"), (0, "hooks Error"), (0, "hooks End")]


async def test_a_publish_from_a_worker_thread_is_marked_on_the_loop_thread() -> None:
    rec = Recorder()
    async with HookBus() as bus:
        bus.add_hook(NvtxHook(rec))
        await bus.publish(BeforeStep(global_step=0))

        def elsewhere() -> None:
            anyio.from_thread.run(bus.publish, AfterData(global_step=0))

        await anyio.to_thread.run_sync(elsewhere)
        await bus.publish(AfterStep(global_step=0))
    assert rec.threads == {threading.get_ident()}
    assert rec.stack == []
    assert [name for _, name in rec.closed if not name.startswith("hooks")] == [
        "data",
        "forward+backward",
        "train step 0",
    ]


async def test_without_cuda_it_says_so_once_and_does_nothing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    caplog.set_level(logging.INFO, logger="recis_async.hooks.nvtx")
    hook = NvtxHook()
    assert repr(hook) == "<NvtxHook ranges=off (no CUDA)>"
    async with HookBus() as bus:
        bus.add_hook(hook)
        for g in range(3):
            await bus.publish(BeforeStep(global_step=g))
            await bus.publish(AfterStep(global_step=g))
        assert len(bus.describe().splitlines()) == len(HookBus().describe().splitlines())
    assert caplog.messages == ["NvtxHook: CUDA is not available; no NVTX ranges"]


def test_ranges_check() -> None:
    with pytest.raises(TypeError, match=r"NvtxHook\(ranges=...\): expected an object with"):
        NvtxHook(ranges=object())  # type: ignore[arg-type]
    assert repr(NvtxHook(torch.cuda.nvtx)) == "<NvtxHook ranges=torch.cuda.nvtx>"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_real_nvtx_ranges_on_a_gpu() -> None:
    """torch.cuda.nvtx returns the depth of the stack: every step starts at depth 0."""
    if torch.cuda.nvtx.range_push("probe") < 0:  # NVTX returns -2 when no tool (nsys) listens
        pytest.skip("no NVTX tool attached: range_push does not report depths")
    torch.cuda.nvtx.range_pop()
    depths: list[int] = []

    class Depth(Hook):
        def after_step(self, event: AfterStep) -> None:
            # the step and its hooks range are open: the next push lands at depth 2
            depths.append(torch.cuda.nvtx.range_push("probe"))
            torch.cuda.nvtx.range_pop()

    model = torch.nn.Linear(8, 8).cuda()
    with torch.cuda.nvtx.range("outer"):  # the hook's ranges nest inside the caller's
        async with HookBus() as bus:
            bus.add_hook(NvtxHook())
            bus.add_hook(Depth())
            for g in range(3):
                await bus.publish(BeforeStep(global_step=g))
                await bus.publish(AfterData(global_step=g))
                model(torch.randn(4, 8, device="cuda")).sum().backward()
                await bus.publish(AfterBackward(global_step=g))
                await bus.publish(AfterStep(global_step=g))
        assert torch.cuda.nvtx.range_push("after") == 1  # only "outer" is still open
        torch.cuda.nvtx.range_pop()
    assert depths == [3, 3, 3]
