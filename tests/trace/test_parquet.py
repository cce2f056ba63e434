from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from trace_data import ALL_FIELDS, ALL_TYPES, all_types_batch, expected_row, simple_batches

from recis_async.sinks import Attempt, ParquetSink, SinkError
from recis_async.trace.schema import parse_type


def opened(sink: ParquetSink, fields: list[str], types: list[str]) -> ParquetSink:
    sink.open(tuple(fields), tuple(parse_type(t) for t in types))
    return sink


def parts(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_every_type_round_trips_through_pyarrow_and_pandas(tmp_path: Path) -> None:
    sink = opened(ParquetSink(tmp_path, "traces", rank=0), ALL_FIELDS, ALL_TYPES)
    batch = all_types_batch(rows=6, steps=2)
    sink.write(batch, Attempt())
    (path,) = (tmp_path / "traces").iterdir()
    table = pq.read_table(path)
    for name, type_name in zip(ALL_FIELDS, ALL_TYPES, strict=True):
        assert table.schema.field(name).type == parse_type(type_name).arrow_type
    assert table.to_pylist() == [expected_row(i) for i in range(6)]
    frame = pd.read_parquet(path)
    assert len(frame) == 6
    assert frame["c_bigint"].dtype == "int64" and frame["c_int"].dtype == "int32"
    assert frame["c_float"].dtype == "float32" and frame["c_boolean"].dtype == bool
    assert str(frame["c_datetime"].dtype).startswith("datetime64")
    assert frame["c_datetime"][1].to_pydatetime() == expected_row(1)["c_datetime"]
    assert list(frame["c_arr_double"][2]) == [3.0, 5.0, 7.0]
    assert frame["c_string"][5] == "row-5-é"


def test_layout_is_partition_folders_with_rank_and_seq(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "3")
    sink = opened(
        ParquetSink(tmp_path, "tr", "dt=20261122,hour=10"), ["id", "v"], ["bigint", "double"]
    )
    assert sink.directory == tmp_path / "tr" / "dt=20261122" / "hour=10"
    for batch in simple_batches(3):
        sink.write(batch, Attempt())
    assert parts(sink.directory) == ["part-3-0.parquet", "part-3-1.parquet", "part-3-2.parquet"]
    data = pads.dataset(tmp_path / "tr", partitioning="hive").to_table()
    assert sorted(data.column("id").to_pylist()) == list(range(15))
    assert set(data.column("dt").to_pylist()) == {20261122}
    frame = pd.read_parquet(tmp_path / "tr")
    assert len(frame) == 15 and set(frame["hour"].astype(str)) == {"10"}


def test_existing_files_are_never_overwritten(tmp_path: Path) -> None:
    directory = tmp_path / "tr"
    directory.mkdir()
    old = pa.table({"id": [99], "v": [9.0]})
    pq.write_table(old, directory / "part-0-0.parquet")
    pq.write_table(old, directory / "part-0-4.parquet")
    sink = opened(ParquetSink(tmp_path, "tr", rank=0), ["id", "v"], ["bigint", "double"])
    (batch,) = simple_batches(1)
    sink.write(batch, Attempt())
    assert parts(directory) == ["part-0-0.parquet", "part-0-4.parquet", "part-0-5.parquet"]
    assert pq.read_table(directory / "part-0-0.parquet").equals(old)


def test_a_file_appearing_under_the_next_name_is_skipped_not_replaced(tmp_path: Path) -> None:
    sink = opened(ParquetSink(tmp_path, "tr", rank=0), ["id", "v"], ["bigint", "double"])
    first, second = simple_batches(2)
    sink.write(first, Attempt())
    # another writer takes part-0-1 after this sink opened
    pq.write_table(pa.table({"id": [7]}), tmp_path / "tr" / "part-0-1.parquet")
    sink.write(second, Attempt())
    assert parts(tmp_path / "tr") == ["part-0-0.parquet", "part-0-1.parquet", "part-0-2.parquet"]
    assert pq.read_table(tmp_path / "tr" / "part-0-1.parquet").num_rows == 1


def test_a_published_batch_in_doubt_is_not_written_again(tmp_path: Path) -> None:
    sink = opened(ParquetSink(tmp_path, "tr", rank=0), ["id", "v"], ["bigint", "double"])
    (batch,) = simple_batches(1)
    attempt = Attempt()
    sink.write(batch, attempt)
    token = attempt.token
    assert token is not None and "part-0-0.parquet" in token
    sink.write(batch, Attempt(token))  # e.g. the writer lost track of the first outcome
    assert parts(tmp_path / "tr") == ["part-0-0.parquet"]


def test_a_token_naming_another_file_means_not_delivered(tmp_path: Path) -> None:
    sink = opened(ParquetSink(tmp_path, "tr", rank=0), ["id", "v"], ["bigint", "double"])
    first, second = simple_batches(2)
    attempt = Attempt()
    sink.write(first, attempt)
    assert attempt.token is not None
    stale = attempt.token.replace("#inode=", "#inode=1")  # same path, different file
    retry = Attempt(stale)
    sink.write(second, retry)
    assert retry.token is not None and retry.token != stale
    assert parts(tmp_path / "tr") == ["part-0-0.parquet", "part-0-1.parquet"]


def test_an_abandoned_attempt_writes_nothing(tmp_path: Path) -> None:
    sink = opened(ParquetSink(tmp_path, "tr", rank=0), ["id", "v"], ["bigint", "double"])
    (batch,) = simple_batches(1)
    attempt = Attempt()
    assert attempt.abandon() is None
    with pytest.raises(SinkError, match="abandoned") as info:
        sink.write(batch, attempt)
    assert info.value.transient is False
    assert os.listdir(tmp_path / "tr") == []
    assert attempt.token is None


def test_an_unusable_root_is_a_permanent_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sink = ParquetSink(blocker, "tr", rank=0)
    with pytest.raises(SinkError) as info:
        opened(sink, ["id"], ["bigint"])
    assert info.value.transient is False and str(blocker) in str(info.value)


def test_a_probe_left_by_a_failed_open_is_removed_by_the_next_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The writability probe's removal fails (an I/O error; a process killed between touch and
    unlink leaves the same file): the open fails as a transient error, naming the probe, and
    this rank's next open removes it -- another rank's probe (may be live) stays."""
    real_unlink = Path.unlink

    def unlink(path: Path, missing_ok: bool = False) -> None:
        if path.name.startswith(".probe-"):
            raise OSError(errno.EIO, "Input/output error", str(path))
        real_unlink(path, missing_ok)

    sink = ParquetSink(tmp_path, "tr", rank=0)
    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(SinkError) as info:
        opened(sink, ["id"], ["bigint"])
    monkeypatch.undo()
    (probe,) = parts(tmp_path / "tr")
    assert probe.startswith(".probe-0-") and probe in str(info.value)
    assert info.value.transient  # the writer retries the open with the first batch
    theirs = tmp_path / "tr" / ".probe-1-0123456789abcdef.tmp"
    theirs.touch()
    caplog.set_level(logging.WARNING, "recis_async.trace.parquet")
    opened(sink, ["id"], ["bigint"])
    assert parts(tmp_path / "tr") == [theirs.name]
    assert f"removed 1 temporary file(s) left by an interrupted run: {probe}" in caplog.text


def test_write_before_open_is_refused(tmp_path: Path) -> None:
    (batch,) = simple_batches(1)
    with pytest.raises(SinkError, match="write before open"):
        ParquetSink(tmp_path, "tr").write(batch, Attempt())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"table": "a/b"}, "ParquetSink(table=...): expected a name of letters"),
        ({"table": "t", "partition": "dt"}, "partition: expected 'key=value' pairs, got 'dt'"),
        ({"table": "t", "partition": "dt=a/b"}, "partition: value of 'dt' must be non-empty"),
        ({"table": "t", "partition": "dt=1,dt=2"}, "partition: duplicate key 'dt'"),
        ({"table": "t", "partition": "1x=2"}, "partition: expected an identifier as key, got '1x'"),
        ({"table": "t", "partition": 5}, "partition: expected a string like"),
        ({"table": "t", "rank": -1}, "ParquetSink(rank=...): expected an int >= 0, got -1"),
        ({"table": "t", "compression": "zip"}, "ParquetSink(compression=...): expected one of"),
        (
            {"table": "t", "row_group_size": 0},
            "ParquetSink(row_group_size=...): expected a positive",
        ),
        ({"root": 3, "table": "t"}, "ParquetSink(root=...): expected a directory path, got 3"),
        ({"root": "", "table": "t"}, "ParquetSink(root=...): expected a directory path, got ''"),
    ],
)
def test_constructor_validation(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    kwargs = {"root": tmp_path, **kwargs}
    with pytest.raises(ValueError) as info:
        ParquetSink(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_partition_may_be_a_mapping(tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path, "t", {"dt": 20261122, "hour": "07"})
    assert sink.directory == tmp_path / "t" / "dt=20261122" / "hour=07"


@pytest.mark.parametrize("partition", ["a=5", "dt=1,A=5"])
def test_a_partition_key_named_like_a_field_is_refused_at_the_call(
    tmp_path: Path, partition: str
) -> None:
    """Readers restore partition keys as columns: a field of the same name made the dataset
    unreadable ("Unable to merge: Field a has incompatible types")."""
    from recis_async.hooks import TraceHook

    sink = ParquetSink(tmp_path, "tp", partition)
    with pytest.raises(ValueError, match=r"TraceHook\(fields=...\): field 'a' .*key .*table 'tp'"):
        TraceHook(sink, ["a", "b"], ["bigint", "bigint"])
    with pytest.raises(ValueError, match=r"field 'a' .*partition key .*table 'tp'"):
        sink.open(("a",), (parse_type("bigint"),))
    TraceHook(sink, ["b"], ["bigint"])  # other names are fine


def test_a_large_batch_is_written_in_row_groups_of_about_8_mib(tmp_path: Path) -> None:
    """Encoding a whole 50 MiB batch at once made Arrow map fresh buffers that large for
    every batch (5-6 % of a 3 ms step in ``bench_trace.py --job``); row groups bound them."""
    import numpy as np

    from recis_async.trace.buffer import ColumnBuffer

    buffer = ColumnBuffer(["id", "emb"], ["bigint", "array<float>"])
    rng = np.random.default_rng(7)
    steps = [
        (np.arange(s * 512, (s + 1) * 512), rng.random((512, 64), dtype=np.float32))
        for s in range(180)
    ]
    for ids, emb in steps:  # 180 steps of 512 rows x (8 + 256 bytes): ~23 MiB
        buffer.append({"id": ids, "emb": emb})
    batch = buffer.seal()
    assert batch is not None and batch.nbytes > 20 << 20
    sink = opened(ParquetSink(tmp_path, "big", rank=0), ["id", "emb"], ["bigint", "array<float>"])
    sink.write(batch, Attempt())
    (path,) = (tmp_path / "big").iterdir()
    meta = pq.ParquetFile(path).metadata
    rows_per_group = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert meta.num_row_groups == 3 and sum(rows_per_group) == 180 * 512
    assert max(rows_per_group) * batch.nbytes / batch.rows <= 8.01 * 2**20
    table = pq.read_table(path)
    assert table.column("id").to_numpy().tolist() == list(range(180 * 512))
    emb = np.stack(table.column("emb").to_numpy(zero_copy_only=False))
    assert np.array_equal(emb, np.concatenate([e for _, e in steps]))


def test_row_group_size_sets_the_rows_per_group(tmp_path: Path) -> None:
    sink = opened(
        ParquetSink(tmp_path, "rg", rank=0, row_group_size=4), ["id", "v"], ["bigint", "double"]
    )
    (batch,) = simple_batches(1, rows=10)
    sink.write(batch, Attempt())
    (path,) = (tmp_path / "rg").iterdir()
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [4, 4, 2]
    assert pq.read_table(path).column("id").to_pylist() == list(range(10))


@pytest.mark.parametrize("codec", ["zstd", "none", None, "GZIP"])
def test_a_named_codec_is_the_one_written(tmp_path: Path, codec: str | None) -> None:
    sink = opened(
        ParquetSink(tmp_path, "c", rank=0, compression=codec), ["id", "v"], ["bigint", "double"]
    )
    (batch,) = simple_batches(1)
    sink.write(batch, Attempt())
    (path,) = (tmp_path / "c").iterdir()
    written = pq.ParquetFile(path).metadata.row_group(0).column(0).compression
    assert written == ("UNCOMPRESSED" if codec in ("none", None) else codec.upper())
    assert pq.read_table(path).column("id").to_pylist() == list(range(5))


def test_a_batch_of_many_small_steps_is_read_back_whole_and_in_order(tmp_path: Path) -> None:
    """2,000 steps of 256 ids (the benchmark's trace) in one batch: two row groups, every
    row read back once, in order, with the footer naming the run and its steps."""
    import numpy as np

    from recis_async.trace.buffer import ColumnBuffer

    buffer = ColumnBuffer(["id", "loss"], ["bigint", "float"])
    buffer.run = "r1"
    for s in range(2000):
        buffer.append(
            {"id": np.arange(s * 256, (s + 1) * 256), "loss": np.full(256, s, np.float64)}, s
        )
    batch = buffer.seal()
    assert batch is not None
    sink = opened(
        ParquetSink(tmp_path, "small", rank=0, row_group_size=300_000),
        ["id", "loss"],
        ["bigint", "float"],
    )
    sink.write(batch, Attempt())
    (path,) = (tmp_path / "small").iterdir()
    meta = pq.ParquetFile(path).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [300_000, 212_000]
    assert meta.metadata[b"recis_async.steps"] == b"0-1999"
    table = pq.read_table(path)
    assert table.num_rows == 2000 * 256
    assert np.array_equal(table.column("id").to_numpy(), np.arange(2000 * 256))
    assert np.array_equal(
        table.column("loss").to_numpy(), np.repeat(np.arange(2000), 256).astype(np.float32)
    )
