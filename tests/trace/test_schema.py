from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_data import ALL_TYPES  # spelled out there, not derived from the code

from recis_async.trace.schema import (
    OdpsType,
    convert,
    from_arrow,
    parse_schema,
    parse_type,
    to_arrow,
)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("BIGINT", "bigint"),
        (" Double ", "double"),
        ("Array< Float >", "array<float>"),
        ("ARRAY<STRING>", "array<string>"),
        ("datetime", "datetime"),
    ],
)
def test_type_names_are_case_and_space_insensitive(text: str, canonical: str) -> None:
    assert parse_type(text, "f").name == canonical


@pytest.mark.parametrize(
    "bad", ["varchar", "array<boolean>", "array<array<int>>", "map<string,int>", ""]
)
def test_unknown_type_names_the_field_and_the_supported_types(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_type(bad, "score")
    message = str(info.value)
    assert "field 'score'" in message and repr(bad) in message
    assert "bigint" in message and "array<" in message


def test_schema_declaration_errors() -> None:
    with pytest.raises(ValueError, match=r"same length: got 2 fields .* and 1 types"):
        parse_schema(["a", "b"], ["bigint"])
    with pytest.raises(ValueError, match="duplicate field name 'A'"):
        parse_schema(["a", "A"], ["bigint", "bigint"])
    with pytest.raises(ValueError, match="at least one field"):
        parse_schema([], [])
    with pytest.raises(ValueError, match="expected a list of field names, got str"):
        parse_schema("a", ["bigint"])
    with pytest.raises(ValueError, match="field 'b': unknown ODPS type 'text'"):
        parse_schema(["a", "b"], ["bigint", "text"])


def sample(type_name: str, rows: int = 4) -> object:
    """A value for ``rows`` rows of ``type_name``."""
    r = np.arange(rows)
    return {
        "bigint": r.astype(np.int64) * (1 << 40),
        "int": r.astype(np.int32) - 2,
        "double": r * 0.5,
        "float": (r * 0.25).astype(np.float32),
        "boolean": r % 2 == 0,
        "string": np.array([f"s{i}é" for i in r]),
        "binary": [bytes([i, 0, 255]) for i in r],
        "datetime": np.array("2026-11-22T10:00:00.123", dtype="datetime64[ms]") + r,
        "array<bigint>": np.arange(rows * 3).reshape(rows, 3),
        "array<int>": [[int(i)] * int(i) for i in r],  # ragged, one row empty
        "array<double>": np.linspace(0, 1, rows * 2).reshape(rows, 2),
        "array<float>": torch.ones(rows, 5) * 0.5,
        "array<string>": [[f"t{i}", "x"] for i in r],
    }[type_name]


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_every_type_converts_to_a_read_only_column_and_round_trips_through_arrow(
    type_name: str,
) -> None:
    type_ = parse_type(type_name)
    column = convert("f", type_, sample(type_name))
    assert column.rows == 4
    assert not column.values.flags.writeable
    assert all(not o.flags.writeable for o in column.offsets)
    assert len(column.offsets) == type_.offset_levels
    arrow = to_arrow(column, type_)
    assert arrow.type == type_.arrow_type and len(arrow) == 4 and arrow.null_count == 0
    back = from_arrow(arrow, type_)
    assert to_arrow(back, type_).equals(arrow)


def test_converted_values_match_the_input() -> None:
    col = lambda t, v: to_arrow(convert("f", parse_type(t), v), parse_type(t)).to_pylist()  # noqa: E731
    assert col("int", [1, -2, 3]) == [1, -2, 3]
    assert col("boolean", np.array([0, 1, 1])) == [False, True, True]
    assert col("string", [b"caf\xc3\xa9", "x"]) == ["café", "x"]
    assert col("binary", np.zeros((2, 3), np.uint8)) == [b"\0\0\0", b"\0\0\0"]
    assert col("datetime", [dt.datetime(2026, 1, 2, 3, 4, 5, 678000)]) == [
        dt.datetime(2026, 1, 2, 3, 4, 5, 678000)
    ]
    assert col("datetime", np.array(["2026-01-01T00:00:00.123456"], "datetime64[us]")) == [
        dt.datetime(2026, 1, 1, 0, 0, 0, 123000)
    ]
    assert col("array<float>", np.zeros((2, 0))) == [[], []]
    assert col("array<string>", np.array([["a", "b"], ["c", "d"]])) == [["a", "b"], ["c", "d"]]
    assert col("array<bigint>", [np.array([1, 2]), [3]]) == [[1, 2], [3]]


def test_the_column_owns_its_data() -> None:
    source = np.arange(4)
    column = convert("f", parse_type("bigint"), source)
    source[:] = -1
    assert column.values.tolist() == [0, 1, 2, 3]


def test_byte_accounting_is_exact() -> None:
    assert convert("f", parse_type("bigint"), np.arange(512)).nbytes == 512 * 8
    assert convert("f", parse_type("int"), np.arange(512)).nbytes == 512 * 4
    assert convert("f", parse_type("boolean"), np.ones(10, bool)).nbytes == 10
    # strings: UTF-8 bytes plus (rows + 1) int32 offsets
    words = ["a", "é", "", "日本"]
    utf8 = sum(len(w.encode()) for w in words)
    assert convert("f", parse_type("string"), words).nbytes == utf8 + 5 * 4
    # array<float> of (512, 64): values plus 513 offsets
    emb = np.zeros((512, 64), np.float32)
    assert convert("f", parse_type("array<float>"), emb).nbytes == 512 * 64 * 4 + 513 * 4
    # array<string>: list offsets, string offsets, bytes
    nested = [["ab", "c"], []]
    assert convert("f", parse_type("array<string>"), nested).nbytes == 3 + 3 * 4 + 3 * 4


@pytest.mark.parametrize(
    ("type_name", "value", "expected"),
    [
        ("bigint", np.array([1.5]), "field 'f' (bigint): expected integer values, got float64"),
        (
            "int",
            np.array([2**40]),
            "expected values within int range [-2147483648, 2147483647], got 1099511627776 at row 0",
        ),
        ("bigint", np.array([2**64 - 1], np.uint64), "expected values within bigint range"),
        ("double", np.array(["x"]), "expected integer or floating-point values, got <U1"),
        ("boolean", np.array([0, 2]), "expected bool values (or 0/1), got 2 at row 1"),
        ("boolean", np.array([0.5]), "expected bool values, got float64"),
        (
            "string",
            [1, 2],
            "field 'f' (string): expected str values (or UTF-8 bytes), got list of 2 items, first item int",
        ),
        ("string", [b"\xff"], "expected str values (or UTF-8 bytes)"),
        ("string", ["a", None], "expected string values, got None at row 1"),
        ("binary", np.arange(3), "expected bytes values, got int64"),
        (
            "datetime",
            np.arange(3),
            "expected datetime64 values or datetime.datetime objects, got int64",
        ),
        ("datetime", [dt.datetime(2026, 1, 1, tzinfo=dt.UTC)], "expected naive datetimes"),
        ("datetime", np.array(["NaT"], "datetime64[ms]"), "expected datetimes, got NaT at row 0"),
        (
            "bigint",
            np.zeros((2, 2), np.int64),
            "field 'f' (bigint): expected a 1-D array (one value per row), got shape (2, 2)",
        ),
        (
            "array<float>",
            np.zeros(3),
            "field 'f' (array<float>): expected a 2-D (rows, n) array or a sequence of sequences, got float64 array of shape (3,)",
        ),
        (
            "array<bigint>",
            [[1], [2.5]],
            "field 'f' (array<bigint>): expected integer values, got float64",
        ),
        ("array<bigint>", [[1], 5], "expected a sequence of elements per row, got int at row 1"),
        (
            "bigint",
            7,
            "field 'f' (bigint): expected an array or list with one entry per row, got int (7)",
        ),
        ("string", "abc", "expected an array or list with one entry per row, got str ('abc')"),
        (
            "bigint",
            [1, 2**70],
            "field 'f' (bigint): expected values within bigint range "
            "[-9223372036854775808, 9223372036854775807], got 1180591620717411303424 at row 1",
        ),
        ("bigint", [-(2**70)], "got -1180591620717411303424 at row 0"),
        ("int", np.array([3, 2**65], dtype=object), "int range [-2147483648, 2147483647], got"),
        ("double", [1.0, 2**1100], "double range [-1.79769e+308, 1.79769e+308], got 1358"),
        ("bigint", [1, None], "field 'f' (bigint): expected numbers, got NoneType (None) at row 1"),
        (
            "double",
            [0.5, None],
            "field 'f' (double): expected numbers, got NoneType (None) at row 1",
        ),
    ],
)
def test_bad_values_are_refused_with_field_expected_and_actual(
    type_name: str, value: object, expected: str
) -> None:
    with pytest.raises(ValueError) as info:
        convert("f", parse_type(type_name), value)
    assert expected in str(info.value)


def test_types_are_frozen_values() -> None:
    t = parse_type("array<float>")
    assert t == OdpsType("array<float>", OdpsType("float")) and str(t) == "array<float>"
    with pytest.raises(AttributeError):
        t.name = "bigint"  # type: ignore[misc]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=4), max_size=6
    )
)
def test_ragged_bigint_arrays_round_trip(rows: list[list[int]]) -> None:
    type_ = parse_type("array<bigint>")
    column = convert("f", type_, rows)
    assert to_arrow(column, type_).to_pylist() == rows
    assert column.nbytes == 8 * sum(map(len, rows)) + 4 * (len(rows) + 1)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.text(max_size=8), max_size=12))
def test_strings_round_trip_and_are_counted_in_utf8(words: list[str]) -> None:
    type_ = parse_type("string")
    column = convert("f", type_, words)
    assert to_arrow(column, type_).to_pylist() == words
    assert column.nbytes == sum(len(w.encode()) for w in words) + 4 * (len(words) + 1)


def test_slices_of_arrow_arrays_convert_back() -> None:
    type_ = parse_type("array<string>")
    arr = pa.array([["a"], ["b", "c"], [], ["d"]], type=type_.arrow_type).slice(1, 2)
    assert to_arrow(from_arrow(arr, type_), type_).to_pylist() == [["b", "c"], []]


def test_writable_arrays_are_copied_and_frozen_private_ones_are_kept() -> None:
    type_ = parse_type("array<float>")
    writable = np.ones((4, 3), np.float32)
    column = convert("f", type_, writable)
    assert not np.shares_memory(column.values, writable)
    writable[:] = 0
    assert column.values.tolist() == [1.0] * 12
    frozen = np.ones((4, 3), np.float32)
    frozen.setflags(write=False)
    kept = convert("f", type_, frozen)
    assert np.shares_memory(kept.values, frozen) and not kept.values.flags.writeable
    view = np.ones((8, 3), np.float32)[::2]  # read-only but not owning its memory: copied
    view.setflags(write=False)
    assert not np.shares_memory(convert("f", type_, view).values, view)


def test_the_first_arrow_conversion_imports_nothing_more(tmp_path: Path) -> None:
    """pyarrow's ``pa.array`` imports pandas on its first call (~130 ms holding the GIL).
    Once the buffer and the sink are set up (before the loop), a fresh process appends every
    type (on the step), converts it to Arrow and writes Parquet (in the writer, overlapping
    steps) without importing anything more."""
    code = textwrap.dedent(
        """
        import sys, datetime
        import numpy as np
        from recis_async.trace.base import Attempt
        from recis_async.trace.buffer import ColumnBuffer
        from recis_async.trace.parquet import ParquetSink
        from recis_async.trace.schema import parse_type
        fields = ("i", "n", "d", "f", "b", "s", "y", "t", "al", "as")
        types = ("bigint", "int", "double", "float", "boolean", "string", "binary", "datetime",
                 "array<float>", "array<string>")
        buffer = ColumnBuffer(fields, types)
        sink = ParquetSink(sys.argv[1], "t", rank=0)
        sink.open(buffer.fields, buffer.types)
        before = set(sys.modules)
        buffer.append({"i": [1, 2], "n": [3, 4], "d": [0.5, 1.5], "f": [2.5, 3.5],
                       "b": [True, False], "s": ["x", "yz"], "y": [b"a", b""],
                       "t": [datetime.datetime(2026, 1, 1), datetime.datetime(2026, 1, 2)],
                       "al": [[1.0], []], "as": [["a", "b"], ["c"]]})
        batch = buffer.seal()
        table = batch.to_arrow()
        sink.write(batch, Attempt())
        late = sorted(m for m in set(sys.modules) - before if not m.startswith("encodings"))
        assert not late, f"imported during the loop: {late[:10]}"
        assert table.column("b").to_pylist() == [True, False]
        assert table.column("t").to_pylist()[1] == datetime.datetime(2026, 1, 2)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
