"""Issue 23 on a CUDA device: the step never synchronizes with the device, and what leaves the
device arrives exactly as it was recorded.

* The loops of the host-read proof (``all_hooks``: every built-in hook, the Trainer and an own
  loop), with the model and the data on the GPU, run under ``torch.cuda.set_sync_debug_mode``:
  no synchronization on the step's thread on an ordinary step.
* float32, bfloat16 and int64 device values traced to Parquet and tracked (JSONL) read back
  equal to what was recorded, even when the tensors change in place after the call.
* A checkpoint written from device tensors restores equal, onto the same device.

The CUDA cases are marked ``gpu`` and skipped where CUDA is absent; the round trips also run
on the CPU (the same code path, issue 23: one path on every device).

Why "warn" and not "error": the debug mode is one setting for the whole process (c10's
``WarningState``), so "error" would also fail a worker thread that reads a window's values
off the step, which the design allows (it does not hold the step).  The recorder below takes
torch's "called a synchronizing CUDA operation" warnings, keeps the thread each came from and
fails on those of the step's thread: "error" for the step, a count for the workers.  torch
reports synchronizations that go through ``memcpy_and_sync`` and ``stream_synchronize``
(``item``, ``cpu``, ``tolist``, ``nonzero``, blocking copies); it does not report a
``non_blocking`` copy from the device into pageable (unpinned) memory, which is synchronous
all the same, so the recorder also counts those (a ``TorchFunctionMode`` on ``copy_``).
"""

from __future__ import annotations

import threading
import traceback
import warnings
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, TextIO

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch
from all_hooks import (
    EPOCHS,
    EVAL_BATCHES,
    ROWS,
    STEPS,
    CtrModel,
    Where,
    batches,
    every_hook,
    optimizer,
    ordinary,
    own_loop,
    trainer,
)
from odps_server import OdpsServer, sink_config
from torch.overrides import TorchFunctionMode

from recis_async import HookBus, add_to_ml_tracker, add_to_trace
from recis_async.events import AfterStep, BeforeStep, Start
from recis_async.hooks import CheckpointSaverHook, MLTrackerHook, TraceHook, restore_checkpoint
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker, read_records

pytestmark = pytest.mark.anyio

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ],
)
_SYNC_MESSAGE = "called a synchronizing CUDA operation"


class Sync(NamedTuple):
    where: Any  # the Where label
    step_thread: bool  # made by the thread that runs the loop (else a worker thread)
    what: str  # torch's message, or "copy_ into pageable memory"
    stack: tuple[str, ...]  # the innermost frames outside torch, "file:line func"


class DeviceSyncs(TorchFunctionMode):
    """Records the CUDA synchronizations made inside its ``with`` block, labelled with
    ``where`` (set by :class:`~all_hooks.Where`) and the thread that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[Sync] = []
        self.where: Any = None
        self._thread = threading.get_ident()
        self._warnings: Any = None
        self._shown: Any = None

    def __enter__(self) -> DeviceSyncs:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=_SYNC_MESSAGE)
        self._shown = warnings.showwarning
        warnings.showwarning = self._warned
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        super().__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc, tb)
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(exc_type, exc, tb)

    def _warned(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if _SYNC_MESSAGE not in str(message):
            self._shown(message, category, filename, lineno, file, line)
            return
        self._add(_SYNC_MESSAGE)

    def _add(self, what: str) -> None:
        stack = tuple(
            f"{f.filename}:{f.lineno} {f.name}"
            for f in reversed(traceback.extract_stack()[:-2])
            if "/torch/" not in f.filename and "warnings" not in f.filename
        )[:4]
        self.syncs.append(
            Sync(self.where, threading.get_ident() == self._thread, what, stack)
        )

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            if (
                isinstance(dst, torch.Tensor)
                and isinstance(src, torch.Tensor)
                and src.is_cuda
                and dst.device.type == "cpu"
                and not dst.is_pinned()
            ):
                self._add("copy_ into pageable memory")
        return func(*args, **kwargs)

    def on_steps(self) -> list[Sync]:
        """The step thread's synchronizations on ordinary steps."""
        return [s for s in self.syncs if s.step_thread and ordinary(s.where)]


def _report(syncs: list[Sync]) -> str:
    return "\n".join(
        f"  {s.where}: {s.what}\n" + "".join(f"      {frame}\n" for frame in s.stack)
        for s in syncs
    )


@pytest.mark.parametrize("loop", ["trainer", "own_loop"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_no_device_sync_on_a_step_with_every_hook(tmp_path: Path, loop: str) -> None:
    """Every built-in hook on, model and data on the GPU: the step's thread never
    synchronizes on an ordinary step (boundaries may: a window's values are read there)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    syncs = DeviceSyncs()
    where = Where(syncs)
    with OdpsServer("proof_proj") as server:
        model = CtrModel(device, record=loop == "trainer")
        opt = optimizer(model)
        hooks = every_hook(tmp_path, model, opt, sink_config(server, "proof", "dt=1"))
        if loop == "trainer":
            run = trainer(model, opt, [where, *hooks], tmp_path, device)
            with syncs:
                await run.train_and_evaluate()
        else:
            with syncs:
                async with HookBus(handle_signals=False) as bus:
                    for hook in [where, *hooks]:
                        bus.add_hook(hook)
                    await own_loop(bus, model, opt, device)
        rows = server.committed("proof", "dt=1").num_rows
    assert rows == (STEPS + EPOCHS * EVAL_BATCHES) * ROWS
    steps = {w for w in where.seen if ordinary(w) and w[0] == "train"}
    assert len(steps) == 12, where.seen
    assert not syncs.on_steps(), (
        f"the step's thread synchronized with the device on ordinary steps:\n"
        f"{_report(syncs.on_steps())}"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_the_recorder_sees_a_sync_on_the_step_and_tells_a_worker_apart() -> None:
    """The instrument itself: ``.item()`` on the step's thread and an unpinned copy are
    seen; a read in a worker thread is counted apart."""
    import anyio

    t = torch.ones(4, device="cuda")
    with DeviceSyncs() as syncs:
        syncs.where = ("train", 1)
        t.sum().item()
        torch.empty(4).copy_(t, non_blocking=True)
        await anyio.to_thread.run_sync(lambda: t.sum().item())
    assert [(s.what, s.step_thread) for s in syncs.syncs] == [
        (_SYNC_MESSAGE, True),
        ("copy_ into pageable memory", True),
        (_SYNC_MESSAGE, False),
    ], syncs.syncs


async def test_the_recorder_tells_the_step_thread_from_a_worker() -> None:
    """The instrument's bookkeeping, on any machine: torch's warning from the step's thread
    is a sync of the step, from a worker thread it is counted apart, labels are kept, and
    other warnings pass through."""
    import anyio

    with DeviceSyncs() as syncs:
        syncs.where = ("train", 1)
        warnings.warn(_SYNC_MESSAGE, stacklevel=1)
        await anyio.to_thread.run_sync(lambda: warnings.warn(_SYNC_MESSAGE, stacklevel=1))
        syncs.where = ("train", 4)
        warnings.warn(_SYNC_MESSAGE, stacklevel=1)
        with pytest.warns(UserWarning, match="something else"):
            warnings.warn("something else", stacklevel=1)
    assert [(s.where, s.step_thread) for s in syncs.syncs] == [
        (("train", 1), True),
        (("train", 1), False),
        (("train", 4), True),
    ]
    assert syncs.on_steps() == syncs.syncs[:1]
    assert "test_gpu.py" in syncs.syncs[0].stack[0], syncs.syncs[0]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("device", ["cpu", CUDA])
async def test_device_values_traced_and_tracked_read_back_equal(
    tmp_path: Path, device: str
) -> None:
    """float32, bfloat16 and int64 values on ``device``, traced to Parquet and tracked to
    JSONL, changed in place right after each call: what is read back is what was recorded
    (bfloat16 as float32, which holds every bfloat16 exactly; tracked values as the float64
    a tracker stores)."""
    gen = torch.Generator().manual_seed(3)
    recorded: list[dict[str, np.ndarray]] = []
    scalars: list[dict[str, float]] = []
    tracker = JsonlTracker(tmp_path / "runs")
    async with HookBus(handle_signals=False) as bus:
        bus.add_hook(
            TraceHook(
                ParquetSink(tmp_path / "trace", "values", "dt=1"),
                ["step", "f32", "bf16", "i64", "vec"],
                ["bigint", "float", "float", "bigint", "array<float>"],
                spill_dir=tmp_path / "spill",
            )
        )
        bus.add_hook(MLTrackerHook("proof", "values", tracker=tracker, spill_dir=tmp_path / "spill"))
        await bus.publish(Start())
        for g in range(6):
            await bus.publish(BeforeStep(global_step=g))
            f32 = (torch.randn(8, generator=gen) * 1e3).to(device)
            bf16 = torch.randn(8, generator=gen).to(device, torch.bfloat16)
            i64 = torch.randint(-(2**62), 2**62, (8,), generator=gen).to(device)
            vec = torch.randn(8, 3, generator=gen).to(device)
            recorded.append(
                {
                    "f32": f32.cpu().numpy().copy(),
                    "bf16": bf16.float().cpu().numpy().copy(),
                    "i64": i64.cpu().numpy().copy(),
                    "vec": vec.cpu().numpy().copy(),
                }
            )
            add_to_trace("step", torch.full((8,), g, dtype=torch.int64, device=device))
            for name, value in (("f32", f32), ("bf16", bf16), ("i64", i64), ("vec", vec)):
                add_to_trace(name, value)
            add_to_ml_tracker("f32", f32[0])
            add_to_ml_tracker("bf16", bf16[0])
            add_to_ml_tracker("i64", i64[0] >> 12)  # trackers hold float64: 2**50 is exact
            scalars.append(
                {
                    "f32": float(f32[0].item()),
                    "bf16": float(bf16[0].float().item()),
                    "i64": float((i64[0] >> 12).item()),
                }
            )
            for value in (f32, bf16, i64, vec):
                value.add_(1)  # after the calls: must not reach what was recorded
            await bus.publish(AfterStep(global_step=g, samples=8))
    table = ds.dataset(tmp_path / "trace" / "values").to_table().sort_by("step")
    assert table.num_rows == 6 * 8
    for g, want in enumerate(recorded):
        rows = table.filter(ds.field("step") == g)
        assert rows.column("f32").type == "float" and rows.column("bf16").type == "float"
        np.testing.assert_array_equal(rows.column("f32").to_numpy(), want["f32"])
        np.testing.assert_array_equal(rows.column("bf16").to_numpy(), want["bf16"])
        np.testing.assert_array_equal(rows.column("i64").to_numpy(), want["i64"])
        rows_vec = np.stack(rows.column("vec").to_pylist()).astype(np.float32)
        np.testing.assert_array_equal(rows_vec, want["vec"])
    assert tracker.run_dir is not None
    records = [r for r in read_records(tracker.run_dir / "metrics.jsonl") if "i64" in r.values]
    assert [r.step for r in records] == list(range(6))
    for record, scalar in zip(records, scalars, strict=True):
        assert record.values["f32"] == scalar["f32"]
        assert record.values["bf16"] == scalar["bf16"]
        assert record.values["i64"] == scalar["i64"]


@pytest.mark.parametrize("device", ["cpu", CUDA])
async def test_checkpoint_of_device_tensors_restores_equal(tmp_path: Path, device: str) -> None:
    """Train on ``device`` with a checkpoint every 3 steps (and at the end), then restore
    into a fresh model and optimizer on the same device: every tensor equal, on its device."""
    torch.manual_seed(0)
    model = CtrModel(device)
    opt = optimizer(model)
    data = batches(7, seed=0, device=device)
    async with HookBus(handle_signals=False) as bus:
        bus.add_hook(CheckpointSaverHook(tmp_path / "ckpt", save_steps=3, model=model, optimizer=opt))
        await bus.publish(Start())
        for g, batch in enumerate(data):
            await bus.publish(BeforeStep(global_step=g))
            loss = model(batch)["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            await bus.publish(AfterStep(global_step=g, samples=16))
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    saved_devices = {k: v.device for k, v in model.state_dict().items()}
    torch.manual_seed(1)  # the fresh model starts elsewhere
    fresh = CtrModel(device)
    fresh_opt = optimizer(fresh)
    async with HookBus(handle_signals=False) as bus:
        assert await restore_checkpoint(bus, tmp_path / "ckpt", fresh, fresh_opt) == len(data)
    restored = fresh.state_dict()
    assert sorted(restored) == sorted(saved)
    for key, value in restored.items():
        assert value.device == saved_devices[key], key
        assert torch.equal(value.detach().cpu(), saved[key]), key
    # the optimizer's state (momentum rows of the table included) came back too
    want = [s for s in opt.state_dict()["state"].values()]
    got = [s for s in fresh_opt.state_dict()["state"].values()]
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        for name in a:
            if isinstance(a[name], torch.Tensor):
                assert torch.equal(a[name].cpu(), b[name].cpu()), name
