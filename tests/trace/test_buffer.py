from __future__ import annotations

import msgspec
import numpy as np
import pytest

from recis_async.trace.buffer import Batch, ColumnBuffer

FIELDS = ["user_id", "score", "emb", "tag"]
TYPES = ["bigint", "double", "array<float>", "string"]


def step(rows: int = 4, start: int = 0) -> dict[str, object]:
    return {
        "user_id": np.arange(start, start + rows),
        "score": np.linspace(0, 1, rows),
        "emb": np.ones((rows, 3), np.float32),
        "tag": [f"t{i}" for i in range(rows)],
    }


def test_appends_count_rows_and_exact_bytes() -> None:
    buf = ColumnBuffer(FIELDS, TYPES)
    assert buf.append(step(4)) == 4
    assert buf.append(step(2, start=4)) == 2
    tags = sum(len(f"t{i}") for i in range(4)) + sum(len(f"t{i}") for i in range(2))
    expected = 6 * 8 + 6 * 8 + (6 * 3 * 4 + (5 + 3) * 4) + (tags + (5 + 3) * 4)
    assert (buf.rows, buf.steps, buf.nbytes) == (6, 2, expected)


@pytest.mark.parametrize(
    ("trace", "message"),
    [
        (
            {k: v for k, v in step().items() if k != "emb"},
            "trace does not match the declared fields: missing 'emb' (declared: user_id, score, emb, tag)",
        ),
        (
            {**step(), "extra": np.arange(4)},
            "trace does not match the declared fields: undeclared 'extra'",
        ),
        (
            {**step(), "score": np.zeros(3)},
            "trace fields must have the same number of rows: expected 4 rows (from 'user_id') in "
            "every field, got user_id=4, score=3, emb=4, tag=4",
        ),
        ({**step(), "tag": np.arange(4)}, "field 'tag' (string): expected str values"),
        ({**step(), "emb": np.ones(4)}, "field 'emb' (array<float>): expected a 2-D"),
    ],
)
def test_a_bad_step_is_refused_whole(trace: dict[str, object], message: str) -> None:
    buf = ColumnBuffer(FIELDS, TYPES)
    buf.append(step())
    before = (buf.rows, buf.nbytes, buf.steps)
    with pytest.raises(ValueError) as info:
        buf.append(trace)
    assert message in str(info.value)
    assert (buf.rows, buf.nbytes, buf.steps) == before
    batch = buf.seal()
    assert batch is not None and batch.rows == 4


def test_steps_without_trace_or_rows_add_nothing() -> None:
    buf = ColumnBuffer(FIELDS, TYPES)
    assert buf.append({}) == 0
    assert buf.append(step(0)) == 0
    assert buf.rows == 0 and buf.seal() is None


def test_seal_hands_over_an_immutable_numbered_batch_and_starts_empty() -> None:
    buf = ColumnBuffer(FIELDS, TYPES)
    buf.append(step(3))
    buf.append(step(2, start=3))
    nbytes = buf.nbytes
    batch = buf.seal()
    assert batch is not None
    assert (batch.seq, batch.rows, batch.nbytes) == (0, 5, nbytes)
    assert batch.fields == tuple(FIELDS)
    assert buf.rows == buf.nbytes == 0 and buf.age() == 0.0 and buf.next_seq == 1
    with pytest.raises(AttributeError):
        batch.rows = 1  # type: ignore[misc]
    for chunks in batch.columns:
        for column in chunks:
            with pytest.raises(ValueError, match="read-only"):
                column.values[...] = 0
    table = batch.to_arrow()
    assert table.column("user_id").to_pylist() == [0, 1, 2, 3, 4]
    assert table.column("emb").to_pylist()[0] == [1.0, 1.0, 1.0]
    assert sum(c.nbytes for chunks in batch.columns for c in chunks) == batch.nbytes
    buf.append(step(1))
    second = buf.seal()
    assert second is not None and second.seq == 1


def test_batch_rebuilt_from_arrow_is_equal_in_content() -> None:
    buf = ColumnBuffer(FIELDS, TYPES)
    buf.append(step(3))
    buf.append(step(2))
    batch = buf.seal()
    assert batch is not None
    again = Batch.from_arrow(batch.to_arrow(), seq=7, fields=FIELDS, types=TYPES)
    assert again.seq == 7 and again.rows == 5
    assert again.to_arrow().equals(batch.to_arrow().combine_chunks())
    assert isinstance(again, msgspec.Struct)


def test_age_counts_from_the_oldest_buffered_row() -> None:
    buf = ColumnBuffer(FIELDS, TYPES)
    assert buf.age() == 0.0
    buf.append(step())
    assert buf.age() >= 0.0
    first = buf.age(now=10**9)
    buf.append(step())
    assert buf.age(now=10**9) == first


def test_constructor_validates_the_declaration() -> None:
    with pytest.raises(ValueError, match="same length"):
        ColumnBuffer(["a"], ["bigint", "double"])
    with pytest.raises(ValueError, match="field 'a': unknown ODPS type 'long'"):
        ColumnBuffer(["a"], ["long"])


NUMERIC = [
    "bigint",
    "int",
    "double",
    "float",
    "boolean",
    "array<bigint>",
    "array<double>",
    "array<float>",
]


@pytest.mark.parametrize(
    "value",
    [
        np.arange(5, dtype=np.int64),
        np.arange(5, dtype=np.int32),
        np.arange(5, dtype=np.uint8),
        np.linspace(-2, 2, 5),
        np.linspace(-2, 2, 5).astype(np.float32),
        np.array([1e300, -1e300, np.nan, np.inf, 0.1]),
        np.array([True, False, True, True, False]),
        np.arange(15, dtype=np.int64).reshape(5, 3),
        np.linspace(0, 1, 10).reshape(5, 2),
        np.linspace(0, 1, 10).astype(np.float32).reshape(5, 2),
        np.arange(10, dtype=np.int32).reshape(5, 2),
    ],
    ids=lambda v: f"{v.dtype}{list(v.shape)}",
)
def test_the_per_step_fast_path_writes_what_the_full_conversion_writes(value: np.ndarray) -> None:
    from recis_async.trace.schema import convert, parse_type, to_arrow

    value.setflags(write=False)
    for type_name in NUMERIC:
        type_ = parse_type(type_name)
        fast = ColumnBuffer(["x"], [type_name])._fast({"x": value})
        try:
            full = convert("x", type_, value)
        except ValueError:
            assert fast is None, f"{type_name}: the fast path took what convert refuses"
            continue
        if fast is None:
            continue  # left to convert: fine
        ((chunk,), rows) = fast
        assert rows == full.rows, type_name
        if value.flags.owndata and value.flags.c_contiguous:
            assert chunk is value, f"{type_name}: a read-only owned array is kept, not copied"
        assert not chunk.flags.writeable, type_name
        got, want = to_arrow(chunk, type_), to_arrow(full, type_)
        assert got.type == want.type == type_.arrow_type, type_name
        if type_.element is not None:
            np.testing.assert_array_equal(got.offsets.to_numpy(), want.offsets.to_numpy())
            got, want = got.flatten(), want.flatten()
        # NaN-aware, unlike Arrow's equals
        np.testing.assert_array_equal(
            got.to_numpy(zero_copy_only=False), want.to_numpy(zero_copy_only=False)
        )


def test_the_fast_path_copies_arrays_the_caller_can_still_change() -> None:
    buf = ColumnBuffer(["user_id", "emb"], ["bigint", "array<float>"])
    emb = np.ones((2, 3), dtype=np.float32)  # writable: must be copied
    ids = np.arange(2)[::-1]  # a view: must be copied
    assert buf._fast({"user_id": ids, "emb": emb}) is not None
    buf.append({"user_id": ids, "emb": emb})
    emb[...] = 7.0
    ids.base[...] = 9
    batch = buf.seal()
    assert batch is not None
    table = batch.to_arrow()
    assert table.column("emb").to_pylist() == [[1.0] * 3, [1.0] * 3]
    assert table.column("user_id").to_pylist() == [1, 0]
