"""Checkpoint snapshots of device tensors: copied into pinned buffers without the step waiting,
the writer waiting in its worker thread for the event recorded after the copies.

On a CPU-only machine the writer's side is checked with a stand-in for the CUDA event (nothing
real can run here): the write waits for it, in the writer's thread, while the event loop goes
on.  The ``gpu`` test takes a real snapshot of CUDA tensors under
``set_sync_debug_mode("error")`` and restores it equal."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
import torch

from recis_async import HookBus, Priority
from recis_async.checkpoint.snapshot import Copier, Snapshot
from recis_async.checkpoint.writer import CheckpointWriter
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import CheckpointSaverHook, restore_checkpoint

pytestmark = pytest.mark.anyio


class GateEvent:
    """Stands in for a CUDA event: ``synchronize`` blocks until the test opens the gate."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.waited_in: list[str] = []

    def synchronize(self) -> None:
        self.waited_in.append(threading.current_thread().name)
        assert self.gate.wait(30), "the test never opened the gate"


async def test_the_writer_waits_for_the_snapshots_event_in_its_thread(tmp_path: Path) -> None:
    copier = Copier()
    payload = {"w": copier.copy(torch.arange(6.0), "w")}
    copier.finish()
    assert copier.ready == ()  # host tensors only: nothing to wait for
    event = GateEvent()
    path = str(tmp_path / "checkpoint-3.pt")
    async with HookBus() as bus:
        writer = CheckpointWriter(str(tmp_path), None, None, reuse=True)
        bus.start_service(writer)
        writer.submit(Snapshot(3, path, payload, copier.nbytes, copier.buffers, (event,)))
        with anyio.fail_after(30):
            while not event.waited_in:  # the loop runs on while the writer waits
                await anyio.sleep(0.01)
        assert not (tmp_path / "checkpoint-3.pt").exists()
        assert event.waited_in == ["recis-checkpoint-writer"]
        event.gate.set()
        await writer.wait_written()
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(6.0))


def test_a_superseded_snapshot_with_device_copies_lends_no_buffers(tmp_path: Path) -> None:
    """Its copies may still be landing: its buffers are not handed to the next snapshot."""
    writer = CheckpointWriter(str(tmp_path), None, None, reuse=True)
    buffers = {"w": torch.zeros(2)}
    writer.replaced(Snapshot(1, "p", {}, 8, buffers, (GateEvent(),)))
    assert writer.take_spare() is None
    writer.replaced(Snapshot(2, "p", {}, 8, buffers))
    assert writer.take_spare() is buffers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_snapshot_of_cuda_tensors_never_synchronizes_and_restores_equal(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    saver = CheckpointSaverHook(tmp_path, save_steps=3, save_end=False, model=model, optimizer=opt)
    expected: dict[str, torch.Tensor] = {}

    def guard(event: BeforeStep) -> None:
        torch.cuda.set_sync_debug_mode("error" if event.global_step >= 1 else "default")

    def unguard(event: AfterStep) -> None:
        torch.cuda.set_sync_debug_mode("default")
        if event.global_step == 2:  # the save step: what the file must hold
            expected.update({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})

    try:
        async with HookBus() as bus:
            bus.add_hook(saver)
            bus.subscribe(BeforeStep, guard, priority=Priority.LOWEST)
            bus.subscribe(AfterStep, unguard, priority=Priority.LOWEST)
            for step in range(6):
                await bus.publish(BeforeStep(global_step=step))
                loss = model(torch.randn(32, 64, device="cuda")).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                await bus.publish(AfterStep(global_step=step, samples=32))
            await saver.flush()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)).cuda()
    async with HookBus(handle_signals=False) as bus:
        step = await restore_checkpoint(bus, tmp_path, fresh)
    assert step == 6
    saved = torch.load(tmp_path / "checkpoint-3.pt", weights_only=True)["model"]
    for key, value in expected.items():
        assert torch.equal(saved[key], value), key
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
