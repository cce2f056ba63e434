"""Traced and tracked tensors end to end (issue 23): float32, bfloat16, float16 and int64
values recorded with ``add_to_trace`` / ``add_to_ml_tracker`` reach a real Parquet table, a
JSONL run and a TensorBoard run equal to what was recorded, are the values at the call, go
through a small host buffer pool without loss, and the step thread reads none of them."""

from __future__ import annotations

from pathlib import Path

import pyarrow.dataset as pads
import pytest
import torch
from host_reads import HostReads

from recis_async import HookBus, add_to_ml_tracker, add_to_trace
from recis_async.events import AfterStep, BeforeStep, Start
from recis_async.hooks import MLTrackerHook, TraceHook
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker, TensorBoardTracker, read_records

pytestmark = pytest.mark.anyio

FIELDS = ["step", "f32", "bf16", "f16", "i64", "emb"]
TYPES = ["bigint", "float", "float", "double", "bigint", "array<float>"]
ROWS = 6


def step_tensors(step: int) -> dict[str, torch.Tensor]:
    """One step's columns: values each dtype holds exactly, different every step."""
    gen = torch.Generator().manual_seed(step)
    return {
        "step": torch.full((ROWS,), step, dtype=torch.int64),
        "f32": torch.randn(ROWS, generator=gen),
        "bf16": torch.randn(ROWS, generator=gen).to(torch.bfloat16),
        "f16": torch.randn(ROWS, generator=gen).to(torch.float16),
        "i64": torch.randint(-(2**62), 2**62, (ROWS,), generator=gen),
        "emb": torch.randn(ROWS, 3, generator=gen).to(torch.bfloat16),
    }


def expected_rows(steps: int) -> dict[str, list[object]]:
    out: dict[str, list[object]] = {f: [] for f in FIELDS}
    for step in range(steps):
        for name, t in step_tensors(step).items():
            out[name].extend(t.float().tolist() if t.is_floating_point() else t.tolist())
    return out


def tracked_values(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {
        "loss": torch.rand((), generator=gen),
        "loss_bf16": torch.rand((), generator=gen).to(torch.bfloat16),
        "loss_f16": torch.rand((1,), generator=gen).to(torch.float16),
        "count": torch.tensor(step * 1000 + 7, dtype=torch.int64),
        "hist": torch.randn(5, generator=gen).to(torch.bfloat16),
    }


async def run_loop(
    tmp_path: Path, steps: int, *, host_buffer_bytes: int = 64 << 20, size_threshold: int = 4096
) -> dict[str, object]:
    trace = TraceHook(
        ParquetSink(tmp_path / "pq", "t", rank=0),
        FIELDS,
        TYPES,
        size_threshold=size_threshold,
        spill_dir=tmp_path / "spill",
    )
    jsonl = MLTrackerHook("p", "run", tracker=JsonlTracker(tmp_path / "jsonl"))
    board = MLTrackerHook("p", "tb", tracker=TensorBoardTracker(tmp_path / "tb", subdir=False))
    async with HookBus(host_buffer_bytes=host_buffer_bytes) as bus:
        for hook in (trace, jsonl, board):
            bus.add_hook(hook)
        await bus.publish(Start())
        for step in range(steps):
            await bus.publish(BeforeStep(global_step=step))
            columns = step_tensors(step)
            for name, t in columns.items():
                add_to_trace(name, t)
            for name, t in tracked_values(step).items():
                add_to_ml_tracker(name, t)
            for t in columns.values():
                t.add_(1)  # in place, after the call: never seen by the trace
            await bus.publish(AfterStep(global_step=step, samples=ROWS))
        stats = bus.stats()["host_buffers"]
    assert jsonl.service is not None
    return {"stats": stats, "run_dir": jsonl.tracker.run_dir}  # type: ignore[attr-defined]


def read_trace(root: Path) -> dict[str, list[object]]:
    table = pads.dataset(root / "pq" / "t", format="parquet").to_table().sort_by("step")
    return {f: table.column(f).to_pylist() for f in FIELDS}


async def test_traced_tensors_of_every_dtype_read_back_equal_from_parquet(
    tmp_path: Path, tensor_path: str
) -> None:
    await run_loop(tmp_path, 12)
    got, want = read_trace(tmp_path), expected_rows(12)
    assert got["step"] == want["step"] and got["i64"] == want["i64"]
    for name in ("f32", "bf16", "f16", "emb"):
        assert got[name] == want[name], name  # float32/64 columns hold these values exactly


async def test_tracked_tensors_read_back_equal_from_jsonl_and_tensorboard(
    tmp_path: Path, tensor_path: str
) -> None:
    from tensorboard.backend.event_processing import event_accumulator

    result = await run_loop(tmp_path, 5)
    records = read_records(Path(str(result["run_dir"])) / "metrics.jsonl")
    assert [r.step for r in records] == list(range(5))
    for record in records:
        want = tracked_values(record.step)
        values = record.values
        assert values["loss"] == want["loss"].item()
        assert values["loss_bf16"] == want["loss_bf16"].float().item()
        assert values["loss_f16"] == want["loss_f16"].float().item()
        assert values["count"] == float(want["count"].item())
        assert values["hist"] == want["hist"].float().tolist()
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0}
    )
    acc.Reload()
    for name in ("loss", "loss_bf16", "loss_f16"):
        points = acc.Scalars(name)
        assert [p.step for p in points] == list(range(5))
        assert [p.value for p in points] == [
            tracked_values(s)[name].float().item() for s in range(5)
        ]
    hist = acc.Histograms("hist")
    assert [h.step for h in hist] == list(range(5))
    assert [h.histogram_value.max for h in hist] == [
        max(tracked_values(s)["hist"].float().tolist()) for s in range(5)
    ]


@pytest.mark.usefixtures("device_path")
async def test_a_small_pool_back_pressures_and_every_row_arrives_once(tmp_path: Path) -> None:
    # a step copies 6 * (8 + 4 + 2 + 2 + 8 + 6) = 180 bytes of trace and 26 of tracked
    # values: a pool of 128 bytes is over its bound within every step
    result = await run_loop(tmp_path, 40, host_buffer_bytes=128, size_threshold=1000)
    stats = result["stats"]
    assert isinstance(stats, dict)
    assert stats["backpressure_waits"] >= 40 and stats["held_bytes"] <= 128
    got, want = read_trace(tmp_path), expected_rows(40)
    assert got == want  # every row, once, equal
    records = read_records(Path(str(result["run_dir"])) / "metrics.jsonl")
    assert [r.step for r in records] == list(range(40))


async def test_the_step_thread_reads_no_tensor_value_on_ordinary_steps(tmp_path: Path) -> None:
    trace = TraceHook(
        ParquetSink(tmp_path / "pq", "t", rank=0),
        ["pred", "emb"],
        ["float", "array<float>"],
        size_threshold=2000,
        spill_dir=tmp_path / "spill",
    )
    tracker = MLTrackerHook("p", "reads", tracker=JsonlTracker(tmp_path / "jsonl"))
    model = torch.nn.Linear(4, 1)
    counter = HostReads()
    per_step: list[int] = []
    with counter:
        float(torch.tensor(1.0))  # the counter sees a read
        assert [r.name for r in counter.reads] == ["__float__"]
        counter.reads.clear()
        async with HookBus() as bus:
            bus.add_hook(trace)
            bus.add_hook(tracker)
            await bus.publish(Start())
            for step in range(30):
                before = len(counter.reads)
                await bus.publish(BeforeStep(global_step=step))
                x = torch.randn(16, 4)
                pred = model(x).squeeze(1)
                loss = pred.pow(2).mean()
                loss.backward()
                add_to_trace("pred", pred)  # requires grad, float32
                add_to_trace("emb", x.to(torch.bfloat16))
                add_to_ml_tracker("loss", loss)
                add_to_ml_tracker("loss_bf16", loss.detach().to(torch.bfloat16))
                await bus.publish(AfterStep(global_step=step, samples=16))
                per_step.append(len(counter.reads) - before)
    assert per_step == [0] * 30, counter.reads
    table = pads.dataset(tmp_path / "pq" / "t", format="parquet").to_table()
    assert table.num_rows == 30 * 16
    run_dir = tracker.tracker.run_dir  # type: ignore[attr-defined]
    assert [r.step for r in read_records(run_dir / "metrics.jsonl")] == list(range(30))


def test_host_copies_are_checked_against_the_table_by_their_metadata() -> None:
    from recis_async.hostcopy import HostBufferPool
    from recis_async.trace.buffer import ColumnBuffer

    pool = HostBufferPool()
    buffer = ColumnBuffer(
        ["id", "small", "emb", "flag"], ["bigint", "int", "array<float>", "boolean"]
    )

    def step(**columns: torch.Tensor) -> dict[str, object]:
        base = {
            "id": torch.arange(3, dtype=torch.int32),  # widened to bigint: no read needed
            "small": torch.arange(3, dtype=torch.int32),
            "emb": torch.ones(3, 2, dtype=torch.bfloat16),
            "flag": torch.tensor([True, False, True]),
        }
        return {k: pool.copy(v) for k, v in {**base, **columns}.items()}

    good = step()
    assert buffer.append(good) == 3
    assert not any(c.resolved for c in good.values())  # kept unread
    assert buffer.nbytes == 3 * 4 + 3 * 4 + 6 * 4 + 3  # the resolved arrays' sizes, exactly
    bad = [
        ({"id": torch.ones(3)}, r"field 'id' \(bigint\): expected integer values, got float32"),
        ({"emb": torch.ones(3)}, r"field 'emb' \(array<float>\): expected a 2-D"),
        (
            {"small": torch.tensor([0, 1, 2**40])},
            r"field 'small' \(int\): expected values within int range",
        ),
        (
            {"flag": torch.arange(3) + 5},
            r"field 'flag' \(boolean\): expected bool values \(or 0/1\), got 5",
        ),
        ({"id": torch.arange(4)}, r"expected 3 rows \(from 'small'\)|same number of rows"),
    ]
    for columns, message in bad:
        with pytest.raises(ValueError, match=message):
            buffer.append(step(**columns))
    assert buffer.rows == 3  # nothing of a refused step was kept
    # an int64 tensor whose values fit an ``int`` column is read at the step and accepted
    assert buffer.append(step(small=torch.tensor([1, 2, 3]))) == 3
    batch = buffer.seal()
    assert batch is not None
    table = batch.to_arrow()
    assert table.column("small").to_pylist() == [0, 1, 2, 1, 2, 3]
    assert table.column("emb").to_pylist() == [[1.0, 1.0]] * 6
    assert batch.nbytes == sum(c.nbytes for chunks in batch.columns for c in chunks)
