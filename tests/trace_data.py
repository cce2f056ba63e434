"""Trace values of every supported ODPS type, shared by the trace tests."""

from __future__ import annotations

import datetime as dt

import numpy as np

from recis_async.trace.buffer import Batch, ColumnBuffer

ALL_FIELDS = [
    "c_bigint",
    "c_int",
    "c_double",
    "c_float",
    "c_boolean",
    "c_string",
    "c_binary",
    "c_datetime",
    "c_arr_bigint",
    "c_arr_int",
    "c_arr_double",
    "c_arr_float",
    "c_arr_string",
]
ALL_TYPES = [
    "bigint",
    "int",
    "double",
    "float",
    "boolean",
    "string",
    "binary",
    "datetime",
    "array<bigint>",
    "array<int>",
    "array<double>",
    "array<float>",
    "array<string>",
]
BASE_TIME = dt.datetime(2026, 11, 22, 10, 30, 0, 125000)


def all_types_step(rows: int, start: int = 0) -> dict[str, object]:
    """One step of every type; row ``i`` (global index ``start + i``) is predictable."""
    idx = np.arange(start, start + rows)
    return {
        "c_bigint": idx * (1 << 33) - 5,
        "c_int": (idx % 1000 - 500).astype(np.int32),
        "c_double": idx * 0.5,
        "c_float": (idx * 0.25).astype(np.float32),
        "c_boolean": idx % 3 == 0,
        "c_string": np.array([f"row-{i}-é" for i in idx]),
        "c_binary": [bytes([i % 256, 0, 255]) for i in idx],
        "c_datetime": np.array(BASE_TIME, dtype="datetime64[ms]") + idx * 1000,
        "c_arr_bigint": np.stack([idx, -idx], axis=1),
        "c_arr_int": [[int(i)] * int(i % 3) for i in idx],
        "c_arr_double": np.stack([idx * 1.5, idx * 2.5, idx * 3.5], axis=1),
        "c_arr_float": np.ones((rows, 4), np.float32) * 0.5,
        "c_arr_string": [[f"a{i}", "b"] for i in idx],
    }


def expected_row(i: int) -> dict[str, object]:
    """Row ``i`` of :func:`all_types_step`, as Python values."""
    return {
        "c_bigint": i * (1 << 33) - 5,
        "c_int": i % 1000 - 500,
        "c_double": i * 0.5,
        "c_float": i * 0.25,
        "c_boolean": i % 3 == 0,
        "c_string": f"row-{i}-é",
        "c_binary": bytes([i % 256, 0, 255]),
        "c_datetime": BASE_TIME + dt.timedelta(seconds=i),
        "c_arr_bigint": [i, -i],
        "c_arr_int": [i] * (i % 3),
        "c_arr_double": [i * 1.5, i * 2.5, i * 3.5],
        "c_arr_float": [0.5] * 4,
        "c_arr_string": [f"a{i}", "b"],
    }


def all_types_batch(rows: int = 6, steps: int = 2) -> Batch:
    buffer = ColumnBuffer(ALL_FIELDS, ALL_TYPES)
    per = rows // steps
    for s in range(steps):
        buffer.append(all_types_step(per, start=s * per))
    batch = buffer.seal()
    assert batch is not None
    return batch


def simple_batches(n: int, rows: int = 5, seq_start: int = 0) -> list[Batch]:
    """``n`` batches of (id bigint, v double) with ids numbered consecutively."""
    buffer = ColumnBuffer(["id", "v"], ["bigint", "double"])
    out = []
    for b in range(n):
        ids = np.arange(b * rows, (b + 1) * rows) + seq_start * rows
        buffer.append({"id": ids, "v": ids * 0.5})
        batch = buffer.seal()
        assert batch is not None
        out.append(batch)
    return out
