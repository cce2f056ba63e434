from __future__ import annotations

import os
import resource
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import recis_async.checkpoint.snapshot as snapshot_module
import recis_async.checkpoint.writer as writer_module
from recis_async import Hook, HookBus, HookError, Priority, Trainer, TrainingArguments, add_metric
from recis_async.checkpoint import checkpoint_path
from recis_async.events import (
    AfterLoadCheckpoint,
    AfterStep,
    BeforeEpoch,
    BeforeSaveCheckpoint,
    BeforeStep,
    Event,
    Start,
)
from recis_async.hooks import (
    CheckpointSaverHook,
    latest_checkpoint,
    latest_checkpoint_step,
    list_checkpoints,
    restore_checkpoint,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


class Net(torch.nn.Module):
    """Parameters, buffers (BatchNorm running stats) and state_dict version metadata."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, width)
        self.norm = torch.nn.BatchNorm1d(width)
        self.head = torch.nn.Linear(width, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.head(torch.relu(self.norm(self.linear(batch["x"])))).squeeze(-1)
        return torch.nn.functional.mse_loss(out, batch["y"])


def data(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(6, 4, generator=gen)
        out.append({"x": x, "y": x.sum(dim=1)})
    return out


class Counter(Hook):
    """A hook with state: training steps seen and the losses, plus a tensor."""

    def __init__(self) -> None:
        self.steps = 0
        self.losses: list[float] = []
        self.acc = torch.zeros(3)

    def after_step(self, event: AfterStep) -> None:
        if event.is_train:
            self.steps += 1
            self.losses.append(event.metrics["loss"])
            self.acc += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "losses": self.losses, "acc": self.acc}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self.losses = state["losses"]
        self.acc = state["acc"]


class Seen(Hook):
    def __init__(self) -> None:
        self.events: list[Event] = []

    def before_save_checkpoint(self, event: BeforeSaveCheckpoint) -> None:
        self.events.append(event)

    def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        self.events.append(event)


class Vandal(Hook):
    """Runs after the saver in the same publish: records the model's state, then zeroes the
    weights (and ``others``) in place, which a snapshot taken on the step must not see."""

    priority = Priority.LOWEST

    def __init__(
        self, model: torch.nn.Module, expected: dict[str, torch.Tensor], *others: torch.Tensor
    ) -> None:
        self.model, self.expected, self.others = model, expected, others

    def after_step(self, event: AfterStep) -> None:
        self.expected.update({k: v.clone() for k, v in self.model.state_dict().items()})
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
        for t in self.others:
            t.zero_()


def parts() -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


async def train_steps(
    bus: HookBus, model: Net, opt: Any, sched: Any, batches: list[Any], first: int = 0
) -> None:
    for i, batch in enumerate(batches, start=first):
        await bus.publish(BeforeStep(global_step=i))
        loss = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        add_metric("loss", loss)
        await bus.publish(AfterStep(global_step=i, samples=6))


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        elif isinstance(a[key], dict):
            assert_same_state(a[key], b[key])
        else:
            assert a[key] == b[key], key


async def test_the_write_starts_on_the_snapshot_step(tmp_path: Path) -> None:
    """Even on a step longer than the bus's yield interval, the background write is under way
    when the snapshot step's publish returns: nothing else runs the loop here."""
    model, opt, sched = parts()
    saver = CheckpointSaverHook(tmp_path, save_steps=1, save_end=False, model=model, optimizer=opt)
    async with HookBus() as bus:
        bus.add_hook(saver)
        await anyio.sleep(0.01)  # the writer service is waiting
        time.sleep(0.15)  # a long step
        await bus.publish(AfterStep(global_step=0, samples=6))
        path = Path(checkpoint_path(str(tmp_path), 1))
        for _ in range(500):  # blocking: the loop gets no pass while we wait
            if path.exists():
                break
            time.sleep(0.01)
        assert path.exists(), "the write had not started by the end of the snapshot step"


@pytest.mark.async_bus_only  # awaits the hook's own coroutines from the test
async def test_restore_into_a_fresh_model_gives_equal_weights_and_hook_state(
    tmp_path: Path,
) -> None:
    model, opt, sched = parts()
    counter, seen = Counter(), Seen()
    async with HookBus() as bus:
        bus.add_hook(counter)
        bus.add_hook(seen)
        saver = CheckpointSaverHook(
            tmp_path, save_steps=3, model=model, optimizer=opt, lr_scheduler=sched
        )
        bus.add_hook(saver)
        batches = data(6)
        await train_steps(bus, model, opt, sched, batches[:3])
        await saver.flush()  # else a busy loop may let step 6 supersede step 3 before its write
        await train_steps(bus, model, opt, sched, batches[3:], first=3)
        await saver.flush()
    assert [p for _, p in list_checkpoints(tmp_path)] == [
        str(tmp_path / "checkpoint-3.pt"),
        str(tmp_path / "checkpoint-6.pt"),
    ]
    assert [(e.global_step, e.path) for e in seen.events] == [
        (3, str(tmp_path / "checkpoint-3.pt")),
        (6, str(tmp_path / "checkpoint-6.pt")),
    ]

    torch.manual_seed(123)
    model2 = Net()
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    assert not torch.equal(model2.linear.weight, model.linear.weight)
    counter2, seen2 = Counter(), Seen()
    async with HookBus() as bus:
        bus.add_hook(counter2)
        bus.add_hook(seen2)
        step = await restore_checkpoint(bus, tmp_path, model2, opt2, sched2)
        assert step == 6
        assert_same_state(model.state_dict(), model2.state_dict())
        assert_same_state(opt.state_dict()["state"], opt2.state_dict()["state"])
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.01 * 0.5**3
        assert sched2.state_dict() == sched.state_dict()
        assert counter2.steps == 6 and counter2.losses == counter.losses
        assert torch.equal(counter2.acc, torch.full((3,), 6.0))
        (loaded,) = seen2.events
        assert isinstance(loaded, AfterLoadCheckpoint)
        assert loaded.global_step == 6 and loaded.path == str(tmp_path / "checkpoint-6.pt")
        assert loaded.hook_states["Counter"]["steps"] == 6
        # the restored run continues exactly as the original would have
        more = data(2, seed=9)
        await train_steps(bus, model2, opt2, sched2, more, first=6)
    async with HookBus() as bus:
        await train_steps(bus, model, opt, sched, more, first=6)
    assert_same_state(model.state_dict(), model2.state_dict())


async def test_the_snapshot_is_taken_on_the_step(tmp_path: Path) -> None:
    """A hook that runs after the saver, in the same publish, zeroes the weights in place: the
    checkpoint must still hold the weights of the save point (the snapshot was a copy)."""
    model, opt, sched = parts()
    expected: dict[str, torch.Tensor] = {}
    async with HookBus() as bus:
        bus.add_hook(CheckpointSaverHook(tmp_path, save_steps=1, save_end=False, model=model))
        bus.add_hook(Vandal(model, expected))
        await train_steps(bus, model, opt, sched, data(1))
    saved = torch.load(tmp_path / "checkpoint-1.pt", weights_only=True)
    assert saved["global_step"] == 1 and saved["optimizer"] is None
    assert_same_state(saved["model"], expected)
    assert not torch.equal(saved["model"]["linear.weight"], model.linear.weight)


async def test_the_snapshot_copy_is_split_over_threads_and_done_on_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every tensor worth a thread, the copies run in several threads, all finished
    before the publish returns (a later hook zeroing the weights cannot reach the file);
    a tensor met twice stays one tensor and a strided view keeps its values."""
    monkeypatch.setattr(snapshot_module, "_COPY_MIN_BYTES", 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    copying: set[str] = set()
    real_copy = torch.Tensor.copy_

    def recording_copy(self: torch.Tensor, src: torch.Tensor, *args: Any) -> torch.Tensor:
        copying.add(threading.current_thread().name)
        return real_copy(self, src, *args)

    model, opt, sched = parts()
    view = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    expected: dict[str, torch.Tensor] = {}

    class Holder(Hook):
        def state_dict(self) -> dict[str, Any]:
            return {"view": view, "same": view}  # one tensor under two names

    async with HookBus() as bus:
        bus.add_hook(CheckpointSaverHook(tmp_path, save_steps=1, save_end=False, model=model))
        bus.add_hook(Holder())
        bus.add_hook(Vandal(model, expected, view))
        monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
        await train_steps(bus, model, opt, sched, data(1))
        monkeypatch.undo()
    assert {"MainThread", "recis-checkpoint-copy"} <= copying
    saved = torch.load(tmp_path / "checkpoint-1.pt", weights_only=True)
    assert_same_state(saved["model"], expected)
    held = saved["hooks"]["Holder"]
    assert torch.equal(held["view"], torch.arange(12.0).reshape(3, 4).t())
    assert held["same"].data_ptr() == held["view"].data_ptr()  # still one tensor
    restored = Net()
    restored.load_state_dict(saved["model"])
    assert_same_state(restored.state_dict(), expected)


@pytest.mark.async_bus_only  # awaits the hook's own coroutines from the test
async def test_max_to_keep_keeps_the_newest(tmp_path: Path) -> None:
    model, opt, sched = parts()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    async with HookBus() as bus:
        saver = CheckpointSaverHook(tmp_path, save_steps=1, max_to_keep=2, model=model)
        bus.add_hook(saver)
        await train_flushing(bus, saver, (model, opt, sched), 5)
        stats = bus.stats()["services"][f"CheckpointSaverHook({tmp_path})"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4.pt", "checkpoint-5.pt", "notes.txt"]
    assert stats["written"] == 5 and stats["superseded"] == 0
    assert latest_checkpoint(tmp_path) == (5, str(tmp_path / "checkpoint-5.pt"))
    assert latest_checkpoint_step(tmp_path) == 5
    assert latest_checkpoint_step(tmp_path / "missing") is None


@pytest.mark.async_bus_only  # awaits the hook's own coroutines from the test
async def test_a_newer_snapshot_replaces_a_waiting_one(tmp_path: Path) -> None:
    """Saving every step faster than the disk: at most one write in flight plus one waiting;
    the newest state always lands."""
    model, opt, sched = parts()
    async with HookBus() as bus:
        saver = CheckpointSaverHook(tmp_path, save_steps=1, max_to_keep=None, model=model)
        bus.add_hook(saver)
        await train_steps(bus, model, opt, sched, data(20))
        await saver.flush()
        stats = dict(bus.stats()["services"][f"CheckpointSaverHook({tmp_path})"])
    assert stats["written"] + stats["superseded"] == 20
    assert stats["superseded"] >= 1
    steps = [s for s, _ in list_checkpoints(tmp_path)]
    assert len(steps) == stats["written"] and steps[-1] == 20


async def train_flushing(
    bus: HookBus, saver: CheckpointSaverHook, parts: tuple[Net, Any, Any], n: int
) -> None:
    """Train ``n`` steps, waiting for each save to land (no snapshot is superseded)."""
    for i, batch in enumerate(data(n)):
        await train_steps(bus, *parts, [batch], first=i)
        await saver.flush()


@pytest.mark.async_bus_only  # awaits the hook's own coroutines from the test
async def test_every_written_file_holds_its_own_steps_state(tmp_path: Path) -> None:
    """Snapshots overwrite the spare buffers of older ones: never one still being written."""
    model, opt, sched = parts()
    expected: dict[int, dict[str, torch.Tensor]] = {}

    class Truth(Hook):
        def after_step(self, event: AfterStep) -> None:
            expected[event.global_step + 1] = {k: v.clone() for k, v in model.state_dict().items()}

    async with HookBus() as bus:
        saver = CheckpointSaverHook(tmp_path, save_steps=1, max_to_keep=None, model=model)
        bus.add_hook(Truth())
        bus.add_hook(saver)
        for i, batch in enumerate(data(30)):
            await train_steps(bus, model, opt, sched, [batch], first=i)
            if i % 7 == 0:
                await saver.flush()  # sometimes idle, sometimes superseding
    found = list_checkpoints(tmp_path)
    assert len(found) >= 5 and found[-1][0] == 30
    for step, path in found:
        saved = torch.load(path, weights_only=True)
        assert saved["global_step"] == step
        assert_same_state(saved["model"], expected[step])


async def test_the_writer_thread_runs_reniced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = torch.save
    seen: list[tuple[str, int]] = []

    def recording_save(obj: Any, f: Any) -> None:
        seen.append(
            (
                threading.current_thread().name,
                os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
            )
        )
        real_save(obj, f)

    monkeypatch.setattr(writer_module.torch, "save", recording_save)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    model = Net()
    for nice, expected in ((10, min(19, base + 10)), (None, base)):
        seen.clear()
        async with HookBus() as bus:
            bus.add_hook(CheckpointSaverHook(tmp_path, save_steps=1, model=model, writer_nice=nice))
            await bus.publish(AfterStep(global_step=0))
        assert seen == [("recis-checkpoint-writer", expected)]


@pytest.mark.async_bus_only  # awaits the hook's own coroutines from the test
async def test_buffers_are_allocated_off_the_step_and_reused(tmp_path: Path) -> None:
    model, opt, sched = parts()
    params = sum(p.nbytes for p in model.parameters())
    buffers = sum(b.nbytes for b in model.buffers())
    steps = 4 * len(list(model.parameters()))  # Adam's float32 step counter per parameter
    nbytes = params + buffers + 2 * params + steps  # weights, buffers, exp_avg, exp_avg_sq

    def spare() -> int:
        return int(bus.stats()["services"][f"CheckpointSaverHook({tmp_path})"]["spare_bytes"])

    async with HookBus() as bus:
        saver = CheckpointSaverHook(
            tmp_path, save_steps=3, model=model, optimizer=opt, lr_scheduler=sched
        )
        bus.add_hook(saver)
        assert spare() == 0
        await train_flushing(bus, saver, (model, opt, sched), 1)  # no save: allocates a spare
        assert spare() == nbytes
        await train_steps(bus, model, opt, sched, data(2), first=1)  # step 3 overwrites it
        assert spare() == 0
        await saver.flush()
        assert spare() == nbytes  # the written snapshot's buffers are the next spare
    async with HookBus() as bus:
        saver = CheckpointSaverHook(tmp_path, save_steps=3, model=model, reuse_buffers=False)
        bus.add_hook(saver)
        await train_flushing(bus, saver, (model, opt, sched), 3)
        assert spare() == 0


@pytest.mark.async_bus_only  # awaits the hook's own coroutines from the test
async def test_end_saves_the_last_step_unless_the_run_failed(tmp_path: Path) -> None:
    model, opt, sched = parts()
    async with HookBus() as bus:
        saver = CheckpointSaverHook(tmp_path / "ok", save_steps=2, model=model, optimizer=opt)
        bus.add_hook(saver)
        await train_flushing(bus, saver, (model, opt, sched), 5)
    assert [s for s, _ in list_checkpoints(tmp_path / "ok")] == [2, 4, 5]

    with pytest.raises(ZeroDivisionError):
        async with HookBus() as bus:
            saver = CheckpointSaverHook(tmp_path / "failed", save_steps=2, model=model)
            bus.add_hook(saver)
            await train_flushing(bus, saver, (model, opt, sched), 5)
            raise ZeroDivisionError("diverged")
    assert [s for s, _ in list_checkpoints(tmp_path / "failed")] == [2, 4]


async def test_save_secs(tmp_path: Path) -> None:
    model, opt, sched = parts()
    async with HookBus() as bus:
        bus.add_hook(CheckpointSaverHook(tmp_path, save_secs=0.5, save_end=False, model=model))
        await train_steps(bus, model, opt, sched, data(2))  # too soon for a save
        await anyio.sleep(0.6)
        await train_steps(bus, model, opt, sched, data(2), first=2)  # step 3 saves
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]


@pytest.fixture
def file_size_limit() -> Iterator[Any]:
    """Makes writes past a size fail with EFBIG, like a full disk (works for root too)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limit(nbytes: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))

    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


async def test_a_write_failing_midway_leaves_no_file_and_raises_at_the_next_publish(
    tmp_path: Path, file_size_limit: Any
) -> None:
    model = torch.nn.Linear(512, 512)  # 1 MB of weights, far over the limit below
    steps_run = 0
    with pytest.raises(HookError, match="cannot write the checkpoint of step 1") as info:
        async with HookBus() as bus:
            saver = CheckpointSaverHook(tmp_path, save_steps=1, model=model)
            bus.add_hook(saver)
            file_size_limit(64 * 1024)
            await bus.publish(AfterStep(global_step=0))
            with anyio.fail_after(10):
                while True:
                    await anyio.sleep(0.01)
                    await bus.publish(Start())  # raises once the write failed
                    steps_run += 1
    assert "File too large" in str(info.value)
    assert info.value.subscriber == f"CheckpointSaverHook({tmp_path})"
    assert os.listdir(tmp_path) == []  # neither the checkpoint nor its temporary file


async def test_an_unwritable_directory_raises_at_close(tmp_path: Path) -> None:
    """The directory turns into a file after construction (root ignores permission bits)."""
    model, opt, sched = parts()
    target = tmp_path / "ckpt"
    with pytest.raises(HookError, match=r"checkpoint of step 2 .*NotADirectoryError"):
        async with HookBus() as bus:
            bus.add_hook(CheckpointSaverHook(target, save_steps=2, model=model))
            target.rmdir()
            target.write_text("now a file")
            await train_steps(bus, model, opt, sched, data(2))
    assert target.read_text() == "now a file"
    assert os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.async_bus_only  # awaits the hook's own coroutines from the test
async def test_a_failed_writer_refuses_later_saves_loudly(tmp_path: Path) -> None:
    model, opt, sched = parts()
    target = tmp_path / "ckpt"
    caught: list[HookError] = []
    with pytest.raises(HookError):
        async with HookBus() as bus:
            saver = CheckpointSaverHook(target, save_steps=1, model=model)
            bus.add_hook(saver)
            target.rmdir()
            target.write_text("now a file")
            await train_steps(bus, model, opt, sched, data(1))
            with pytest.raises(RuntimeError, match="checkpoint writer failed"):
                await saver.flush()
            try:
                await bus.publish(Start())
            except HookError as exc:  # the user swallows the writer's failure ...
                caught.append(exc)
            # ... and the next save point refuses instead of queueing into a dead writer
            await train_steps(bus, model, opt, sched, data(1), first=1)
    assert "cannot write the checkpoint of step 1" in str(caught[0])


async def test_a_write_slower_than_flush_timeout_is_reported_not_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_save = torch.save

    def slow_save(obj: Any, f: Any) -> None:  # stands in for a stalled network disk
        import time

        time.sleep(1.0)
        real_save(obj, f)

    monkeypatch.setattr(writer_module.torch, "save", slow_save)
    model, opt, sched = parts()
    with anyio.fail_after(5):
        with pytest.raises(HookError, match=r"step \[1\] not confirmed written"):
            async with HookBus(flush_timeout=0.2) as bus:
                bus.add_hook(CheckpointSaverHook(tmp_path, save_steps=1, model=model))
                await train_steps(bus, model, opt, sched, data(1))


async def test_a_state_torch_load_cannot_read_back_fails_at_the_step(tmp_path: Path) -> None:
    class NumpyState(Hook):
        def state_dict(self) -> dict[str, Any]:
            return {"best": np.float64(0.5)}

    model, opt, sched = parts()
    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.add_hook(NumpyState())
            bus.add_hook(CheckpointSaverHook(tmp_path, save_steps=1, model=model))
            await train_steps(bus, model, opt, sched, data(1))
    message = str(info.value)
    assert "CheckpointSaverHook.after_step failed on AfterStep" in message
    assert "hook state 'NumpyState'['best'] is a numpy.float64" in message
    assert "weights_only" in message


async def test_restore_without_checkpoints_returns_none(tmp_path: Path) -> None:
    model, _, _ = parts()
    async with HookBus() as bus:
        assert await restore_checkpoint(bus, tmp_path / "nothing", model) is None


async def test_restore_refuses_a_foreign_file(tmp_path: Path) -> None:
    model, _, _ = parts()
    torch.save({"weights": torch.zeros(1)}, tmp_path / "checkpoint-7.pt")
    with pytest.raises(ValueError, match=r"not a recis_async checkpoint \(expected format"):
        async with HookBus() as bus:
            await restore_checkpoint(bus, tmp_path, model)


def test_bad_constructor_input_names_the_argument(tmp_path: Path) -> None:
    model = Net()
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"save_steps": 0},
            r"CheckpointSaverHook\(save_steps=...\): expected a positive int, got 0",
        ),
        ({"save_secs": -1.0}, r"save_secs=...\): expected a positive number, got -1.0"),
        (
            {"save_steps": 10, "save_secs": 5.0},
            r"expected at most one of save_steps or save_secs, got save_steps=10, save_secs=5.0",
        ),
        ({"save_end": False}, r"expected save_steps, save_secs or save_end=True"),
        ({"save_steps": 1, "max_to_keep": 0}, r"max_to_keep=...\): expected a positive int, got 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            CheckpointSaverHook(tmp_path, model=model, **kwargs)
    with pytest.raises(ValueError, match=r"writer_nice=...\): expected an int in 0..19 or None"):
        CheckpointSaverHook(tmp_path, save_steps=1, model=model, writer_nice=-5)
    with pytest.raises(TypeError, match=r"reuse_buffers=...\): expected a bool, got 1"):
        CheckpointSaverHook(tmp_path, save_steps=1, model=model, reuse_buffers=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model=...\): expected an object with state_dict\(\)"):
        CheckpointSaverHook(tmp_path, save_steps=1, model=None)
    with pytest.raises(TypeError, match=r"optimizer=...\): expected .* or None, got 3"):
        CheckpointSaverHook(tmp_path, save_steps=1, model=model, optimizer=3)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"output_dir=...\): expected a writable directory, got"):
        CheckpointSaverHook(a_file, save_steps=1, model=model)
    with pytest.raises(ValueError, match=r"output_dir=...\): expected a writable directory"):
        CheckpointSaverHook(a_file / "sub", save_steps=1, model=model)


async def test_stale_temporary_files_are_removed_when_added_to_a_bus(tmp_path: Path) -> None:
    stale = tmp_path / ".checkpoint-40.pt.tmp-0123456789ab"
    stale.write_bytes(b"half a checkpoint")
    (tmp_path / "checkpoint-30.pt").write_bytes(b"x")
    hook = CheckpointSaverHook(tmp_path, save_steps=1, model=Net())
    assert stale.exists()  # other ranks construct the hook too, but never add it
    async with HookBus() as bus:
        bus.add_hook(hook)
        assert sorted(os.listdir(tmp_path)) == ["checkpoint-30.pt"]


async def test_two_savers_on_one_bus(tmp_path: Path) -> None:
    model, opt, sched = parts()
    async with HookBus() as bus:
        bus.add_hook(CheckpointSaverHook(tmp_path / "often", save_steps=1, model=model))
        bus.add_hook(CheckpointSaverHook(tmp_path / "rarely", save_steps=3, model=model))
        await train_steps(bus, model, opt, sched, data(3))
    assert latest_checkpoint_step(tmp_path / "often") == 3
    assert [s for s, _ in list_checkpoints(tmp_path / "rarely")] == [3]


# ---------------------------------------------------------------------- the Trainer


class Recorder(Hook):
    def __init__(self) -> None:
        self.log: list[str] = []

    def start(self, event: Start) -> None:
        self.log.append("Start")

    def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        self.log.append(f"AfterLoadCheckpoint({event.global_step})")

    def before_epoch(self, event: BeforeEpoch) -> None:
        self.log.append("BeforeEpoch")

    def after_step(self, event: AfterStep) -> None:
        self.log.append(f"AfterStep({event.global_step})")


def make_trainer(out: Path, hooks: list[Hook], **kwargs: Any) -> tuple[Trainer, Net]:
    model, opt, sched = parts()
    args = TrainingArguments(output_dir=str(out), **{"save_steps": 2, "max_to_keep": 2, **kwargs})
    trainer = Trainer(
        model, args, train_dataset=data(5), hooks=hooks, dense_optimizers=(opt, sched)
    )
    return trainer, model


async def test_trainer_saves_every_save_steps_and_resumes(tmp_path: Path) -> None:
    counter = Counter()
    trainer, model = make_trainer(tmp_path, [counter])
    assert isinstance(trainer.checkpoint_hook, CheckpointSaverHook)
    await trainer.train()
    assert trainer.global_step == 5
    kept = [s for s, _ in list_checkpoints(tmp_path)]  # a save may be superseded by a newer
    assert kept[-1] == 5 and len(kept) <= 2 and set(kept) <= {2, 4, 5}  # End saves step 5

    counter2, rec = Counter(), Recorder()
    # the first run read its one epoch to the end: the resumed run goes on with a second one
    resumed, model2 = make_trainer(tmp_path, [counter2, rec], train_steps=7, train_epoch=2)
    torch.manual_seed(99)
    with torch.no_grad():
        for p in model2.parameters():
            p.normal_()
    await resumed.train(resume_from_checkpoint=True)
    assert rec.log[:3] == ["Start", "AfterLoadCheckpoint(5)", "BeforeEpoch"]
    assert [e for e in rec.log if e.startswith("AfterStep")] == ["AfterStep(5)", "AfterStep(6)"]
    assert resumed.global_step == 7
    assert counter2.steps == 7 and counter2.losses[:5] == counter.losses
    kept = [s for s, _ in list_checkpoints(tmp_path)]
    assert kept[-1] == 7 and len(kept) <= 2


async def test_trainer_resume_without_checkpoint_starts_at_zero(tmp_path: Path) -> None:
    rec = Recorder()
    trainer, _ = make_trainer(tmp_path / "fresh", [rec], train_steps=2, save_steps=None)
    assert trainer.checkpoint_hook is None
    await trainer.train(resume_from_checkpoint=True)
    assert rec.log == ["Start", "BeforeEpoch", "AfterStep(0)", "AfterStep(1)"]
    with pytest.raises(TypeError, match=r"resume_from_checkpoint=...\): expected a bool"):
        await trainer.train(resume_from_checkpoint=3)  # type: ignore[arg-type]


async def test_trainer_keeps_a_user_checkpoint_hook(tmp_path: Path) -> None:
    model, opt, _ = parts()
    own = CheckpointSaverHook(tmp_path / "own", save_steps=1, max_to_keep=1, model=model)
    trainer = Trainer(
        model,
        TrainingArguments(output_dir=str(tmp_path / "args"), save_steps=2),
        train_dataset=data(3),
        hooks=[own],
        dense_optimizers=(opt, None),
    )
    assert trainer.checkpoint_hook is None
    await trainer.train()
    assert [s for s, _ in list_checkpoints(tmp_path / "own")] == [3]
    assert not (tmp_path / "args").exists()


async def test_the_save_at_end_is_announced_too(tmp_path: Path) -> None:
    model, opt, sched = parts()
    seen = Seen()
    async with HookBus() as bus:
        bus.add_hook(seen)
        bus.add_hook(CheckpointSaverHook(tmp_path, save_steps=3, model=model, optimizer=opt))
        await train_steps(bus, model, opt, sched, data(4))
    assert [(e.global_step, type(e).__name__) for e in seen.events] == [
        (3, "BeforeSaveCheckpoint"),
        (4, "BeforeSaveCheckpoint"),
    ]
    # step 3's snapshot may have been superseded by step 4's before its write began
    assert [step for step, _ in list_checkpoints(tmp_path)][-1] == 4


def test_a_tensorflow_style_positional_save_secs_is_refused(tmp_path: Path) -> None:
    """TF's CheckpointSaverHook(dir, 600) means every 600 seconds; here it used to save every
    600 steps.  Now every argument after output_dir is keyword-only, with a message."""
    with pytest.raises(
        TypeError,
        match=r"CheckpointSaverHook\(output_dir, ...\): expected every argument after "
        r"output_dir by keyword \(save_steps=N or save_secs=S\), got 1 more positional: 600 "
        r"\(TensorFlow's second positional argument is save_secs\)",
    ):
        CheckpointSaverHook(tmp_path, 600, model=torch.nn.Linear(1, 1))
    assert not any(tmp_path.iterdir())


async def test_with_save_steps_the_hook_is_called_at_its_save_steps_only(tmp_path: Path) -> None:
    """The bus passes over the other steps (the hook costs them nothing), and the save at End
    still holds the last step, which the hook never saw: the bus counts the steps."""
    model, opt, sched = parts()
    saver = CheckpointSaverHook(tmp_path, save_steps=4, model=model, optimizer=opt)
    async with HookBus() as bus:
        bus.add_hook(saver)
        await train_steps(bus, model, opt, sched, data(10))
        assert bus.stats()["subscribers"]["CheckpointSaverHook.after_step"]["calls"] == 2
    steps = [step for step, _ in list_checkpoints(str(tmp_path))]
    # A snapshot still queued gives way to a newer one (these steps are far shorter than a
    # write, and the buffers' prewarm may still be running at step 4): 4 and 8 may be gone.
    assert set(steps) <= {4, 8, 10} and steps[-1] == 10
    assert torch.load(checkpoint_path(str(tmp_path), 10), weights_only=False)["global_step"] == 10


async def test_the_save_at_end_holds_no_step_whose_after_step_failed(tmp_path: Path) -> None:
    """A subscriber ahead of the saver fails on step 3's AfterStep and the loop goes on to a
    clean end: the save at End holds 3 steps, not 4, so a resumed run repeats step 3 and a
    trace writer that never received it gets its rows then."""

    class FailsAtStep3(Hook):
        def after_step(self, event: AfterStep) -> None:
            if event.global_step == 3:
                raise OSError("the disk is full")

    model, opt, sched = parts()
    async with HookBus() as bus:
        bus.add_hook(FailsAtStep3())
        bus.add_hook(CheckpointSaverHook(tmp_path, save_steps=100, model=model, optimizer=opt))
        with pytest.raises(HookError, match="the disk is full"):
            await train_steps(bus, model, opt, sched, data(6))
        assert bus.steps_done == 3
    assert [step for step, _ in list_checkpoints(str(tmp_path))] == [3]
