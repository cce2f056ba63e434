from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.dataset as pads
import pytest
from odps_server import OdpsServer, read_with_pyodps, sink_config
from trace_data import ALL_FIELDS, all_types_batch, expected_row, simple_batches

from recis_async.sinks import Attempt, OdpsSink, ParquetSink, SinkError
from recis_async.spill import SpillEntry, read_spill, replay_spill, write_spill
from recis_async.trace.buffer import Batch
from recis_async.trace.schema import OdpsType


def written_ids(root: Path, table: str = "t") -> list[int]:
    if not (root / table).exists():
        return []
    return sorted(pads.dataset(root / table).to_table().column("id").to_pylist())


def test_spill_files_are_arrow_ipc_streams_with_documented_metadata(tmp_path: Path) -> None:
    batch = all_types_batch(rows=6, steps=3)
    path = write_spill(
        tmp_path, [SpillEntry(batch, "UPLOAD-1")], sink_name="odps:p.t", reason="permanent error"
    )
    assert path.suffix == ".arrows" and path.parent == tmp_path
    reader = pa.ipc.open_stream(path.read_bytes())  # plain pyarrow reads it
    meta = {k.decode(): v.decode() for k, v in reader.schema.metadata.items()}
    assert meta["recis_async.spill"] == "1" and json.loads(meta["fields"]) == ALL_FIELDS
    assert meta["sink"] == "odps:p.t" and meta["reason"] == "permanent error"
    record, custom = reader.read_next_batch_with_custom_metadata()
    assert {k.decode(): v.decode() for k, v in custom.items()} == {
        "seq": "0",
        "rows": "6",
        "in_doubt": "UPLOAD-1",
    }
    spill = read_spill(path)
    assert spill.rows == 6 and spill.fields == tuple(ALL_FIELDS)
    (entry,) = spill.entries
    assert entry.in_doubt == "UPLOAD-1" and entry.batch.seq == 0
    assert entry.batch.to_arrow().to_pylist() == [expected_row(i) for i in range(6)]
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_replay_delivers_every_batch_once_and_removes_the_file(tmp_path: Path) -> None:
    batches = simple_batches(3)
    path = write_spill(
        tmp_path / "spill", [SpillEntry(b, None) for b in batches], sink_name="x", reason="r"
    )
    report = replay_spill(path, ParquetSink(tmp_path, "t", rank=0))
    assert (report.delivered, report.skipped, report.rows) == (3, 0, 15)
    assert written_ids(tmp_path) == list(range(15))
    assert not path.exists() and not path.with_name(path.name + ".journal").exists()


def test_a_batch_already_delivered_before_the_spill_is_not_written_again(tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path, "t", rank=0)
    first, second = simple_batches(2)
    sink.open(first.fields, first.types)
    attempt = Attempt()
    sink.write(first, attempt)  # delivered, but the writer lost the outcome
    path = write_spill(
        tmp_path / "spill",
        [SpillEntry(first, attempt.token), SpillEntry(second, None)],
        sink_name=sink.name,
        reason="deadline",
    )
    report = replay_spill(path, ParquetSink(tmp_path, "t", rank=0))
    assert (report.delivered, report.present, report.rows) == (1, 1, 5)  # not "delivered 2"
    assert written_ids(tmp_path) == list(range(10))


class _CrashingSink:
    """A real ParquetSink that 'crashes' once: after the write of batch ``seq`` (which
    succeeded) it raises, as if the process died before recording the outcome."""

    def __init__(self, inner: ParquetSink, seq: int, *, after_write: bool) -> None:
        self.inner, self.seq, self.after_write = inner, seq, after_write
        self.name = inner.name

    def open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        self.inner.open(fields, types)

    def write(self, batch: Batch, attempt: Attempt) -> None:
        if batch.seq == self.seq and not self.after_write:
            raise SinkError("crash before writing", transient=True)
        self.inner.write(batch, attempt)
        if batch.seq == self.seq:
            raise SinkError("crash after writing", transient=True)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("after_write", [False, True])
def test_an_interrupted_replay_can_be_run_again_without_duplicates(
    tmp_path: Path, after_write: bool
) -> None:
    batches = simple_batches(3)
    path = write_spill(
        tmp_path / "spill", [SpillEntry(b, None) for b in batches], sink_name="x", reason="r"
    )
    with pytest.raises(SinkError, match="crash"):
        replay_spill(
            path, _CrashingSink(ParquetSink(tmp_path, "t", rank=0), 1, after_write=after_write)
        )
    assert path.exists()
    journal = path.with_name(path.name + ".journal").read_text().splitlines()
    assert {"seq": 0, "done": True} in [json.loads(line) for line in journal]
    report = replay_spill(path, ParquetSink(tmp_path, "t", rank=0))
    # batch 1 written before the crash is found there, not counted as delivered now
    expected = (1, 1, 1) if after_write else (1, 2, 0)
    assert (report.skipped, report.delivered, report.present) == expected
    assert written_ids(tmp_path) == list(range(15))  # batch 1 exactly once either way
    assert not path.exists()


@pytest.fixture
def server() -> Iterator[OdpsServer]:
    with OdpsServer("trace_proj") as srv:
        yield srv


def test_replay_into_odps_settles_a_commit_left_in_doubt(
    server: OdpsServer, tmp_path: Path
) -> None:
    config = sink_config(server, "t", "dt=1")
    first, second = simple_batches(2)
    sink = OdpsSink(config)
    sink.open(first.fields, first.types)
    server.inject("commit", "lost")
    server.inject("reload_upload", "reset", times=20, after=1)  # the outcome cannot be read
    attempt = Attempt()
    with pytest.raises(SinkError, match="outcome is unknown"):
        sink.write(first, attempt)
    sink.close()  # the job that failed ends; the replay below is a new process's sink
    server.clear_faults()
    path = write_spill(
        tmp_path,
        [SpillEntry(first, attempt.token), SpillEntry(second, None)],
        sink_name=sink.name,
        reason="r",
    )
    report = replay_spill(path, OdpsSink(config))
    assert (report.delivered, report.present) == (1, 1)  # the lost commit had been applied
    assert sorted(r["id"] for r in read_with_pyodps(server, "t", "dt=1")) == list(range(10))


def test_other_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.arrows"
    table = pa.table({"a": [1]})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    with pytest.raises(ValueError, match="expected a recis_async spill file"):
        read_spill(path)
    with pytest.raises(ValueError, match="at least one batch"):
        write_spill(tmp_path, [], sink_name="x", reason="r")


def test_a_spilled_batch_keeps_its_run_and_steps_through_replay(tmp_path: Path) -> None:
    """Replayed rows count as delivered for the run they belong to (a resume after a crash
    then does not trace their steps again)."""
    batch = msgspec.structs.replace(simple_batches(1)[0], steps=(7, 9), run="run-a")
    path = write_spill(tmp_path / "spill", [SpillEntry(batch, None)], sink_name="x", reason="r")
    (entry,) = read_spill(path).entries
    assert (entry.batch.steps, entry.batch.run) == ((7, 9), "run-a")
    sink = ParquetSink(tmp_path, "t", rank=0)
    replay_spill(path, sink)
    sink.open(batch.fields, batch.types)
    assert sink.delivered_steps("run-a") == [(7, 9)] and sink.delivered_steps("run-b") == []
