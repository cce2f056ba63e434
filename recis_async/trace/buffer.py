"""A byte-accounted column buffer that validates each step's trace and seals immutable batches.

:class:`ColumnBuffer` checks a step's columns against the declared ``fields``/``types``
before keeping anything of it, so a bad step fails at the ``publish`` that carried it and
leaves the buffer exactly as it was.  Accepted steps are kept as per-step chunks (at most
one copy of the caller's data, no concatenation; see :data:`~recis_async.trace.schema.Chunk`)
and their size is counted exactly in bytes.  :meth:`ColumnBuffer.seal` hands them over as
a :class:`Batch`: frozen, with read-only arrays, numbered by ``seq`` -- the unit a writer
delivers, retries and spills.  A step's tensors arrive as
:class:`~recis_async.hostcopy.HostCopy` s, checked by their dtype and shape alone; they are
resolved by a later step once ready (the bus's pool does it) or by the writer's worker
thread when it lays the batch out (:meth:`Batch.to_arrow`), never by the step waiting on the
device.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import pyarrow as pa

from ..events import TraceParts
from ..hostcopy import HostCopy
from .schema import (
    _OFFSET_MAX,
    Chunk,
    OdpsType,
    arrow_schema,
    chunk_rows,
    convert,
    fast_dtype,
    freeze,
    from_arrow,
    host_chunk,
    parse_schema,
    prepare_conversion,
    to_arrow,
)

__all__ = ["Batch", "ColumnBuffer"]


def _chunk(field: str, type_: OdpsType, value: object) -> Chunk:
    """One field's chunk on the full path: a host copy whose metadata fits is kept as it
    is (resolved later, off the step); anything else is converted (a host copy resolved
    first, at the step: its values decide, e.g. whether int64 values fit an ``int``)."""
    if type(value) is HostCopy and (chunk := host_chunk(type_, value)) is not None:
        return chunk
    return convert(field, type_, value)


def _field_chunks(field: str, type_: OdpsType, value: object) -> Chunk | tuple[Chunk, ...]:
    """One field's chunk on the full path, or a tuple of them for a column traced in parts
    (:class:`~recis_async.events.TraceParts`, each part checked as a value of its own)."""
    if type(value) is TraceParts:
        return tuple(_chunk(field, type_, part) for part in value)
    return _chunk(field, type_, value)


def _rows(chunks: Chunk | tuple[Chunk, ...]) -> int:
    if isinstance(chunks, tuple):
        return sum(chunk_rows(chunk) for chunk in chunks)
    return chunk_rows(chunks)


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    """An immutable run of trace rows: what a sink writes in one atomic unit.

    ``columns[i]`` holds the chunks of ``fields[i]`` in row order (see
    :data:`~recis_async.trace.schema.Chunk`); every field has ``rows`` rows in total.  ``nbytes``
    is the exact size of all arrays held.  ``steps`` is the first and last ``global_step`` whose
    rows it holds, when the feeder said (for messages about where rows went); ``run`` names
    the traced run they belong to (:attr:`ColumnBuffer.run`), so that a run resumed after a
    crash can tell which of its steps a table already holds.
    """

    seq: int
    rows: int
    nbytes: int
    fields: tuple[str, ...]
    types: tuple[OdpsType, ...]
    columns: tuple[tuple[Chunk, ...], ...]
    steps: tuple[int, int] | None = None
    run: str | None = None

    @property
    def schema(self) -> pa.Schema:
        return arrow_schema(self.fields, self.types)

    def to_arrow(self) -> pa.Table:
        """The rows as an Arrow table (one record batch per buffered step); the memory is
        shared, except where a raw chunk is cast to its field's stored type.  Host copies are
        resolved (waiting for the device if needed): a writer calls it in a worker thread."""
        arrays = [
            pa.chunked_array([to_arrow(c, t) for c in chunks], type=t.arrow_type)
            for chunks, t in zip(self.columns, self.types, strict=True)
        ]
        return pa.Table.from_arrays(arrays, schema=self.schema)

    @classmethod
    def from_arrow(
        cls,
        table: pa.Table,
        *,
        seq: int,
        fields: Sequence[str],
        types: Sequence[str],
        steps: tuple[int, int] | None = None,
        run: str | None = None,
    ) -> Batch:
        """Rebuild a batch from an Arrow table holding ``fields`` (used by spill replay)."""
        names, parsed = parse_schema(fields, types)
        missing = [f for f in names if f not in table.column_names]
        if missing:
            raise ValueError(f"arrow table: missing field(s) {missing}, got {table.column_names}")
        pairs = zip(names, parsed, strict=True)
        columns = tuple((from_arrow(table.column(f), t),) for f, t in pairs)
        nbytes = sum(c.nbytes for chunks in columns for c in chunks)
        return cls(
            seq=seq,
            rows=table.num_rows,
            nbytes=nbytes,
            fields=names,
            types=parsed,
            columns=columns,
            steps=steps,
            run=run,
        )


class ColumnBuffer:
    """Validated, byte-counted rows waiting to be sealed into a :class:`Batch`.

    Not thread-safe: it lives on the event loop with the hook that feeds it.

    Args:
        fields: the column names.
        types: their ODPS types (see :mod:`recis_async.trace.schema`).

    Raises:
        ValueError: fields and types of different lengths, a duplicate or empty name, an unknown
            type.
    """

    def __init__(self, fields: Sequence[str], types: Sequence[str]) -> None:
        self.fields, self.types = parse_schema(fields, types)
        prepare_conversion(self.types)  # before the loop, not on its first step
        self._index = {name: i for i, name in enumerate(self.fields)}
        self._chunks: list[list[Chunk]] = [[] for _ in self.fields]
        self._rows = 0
        self._nbytes = 0
        self._steps = 0
        self._first_at: float | None = None
        # the first and last ``global_step`` buffered (the sealed batch's ``steps``)
        self._first_step: int | None = None
        self._last_step = 0
        #: the bytes the last :meth:`append` added (0 if it added nothing)
        self.step_nbytes = 0
        self.run: str | None = None  # the traced run's id, stamped on every batch sealed
        self._next_seq = 0
        # per field: (name, the numpy dtype it is stored as or None, the ndim of a raw chunk)
        self._plan = tuple(
            (f, fast_dtype(t), 1 if t.element is None else 2)
            for f, t in zip(self.fields, self.types, strict=True)
        )

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def nbytes(self) -> int:
        """Exact bytes held by the buffered columns."""
        return self._nbytes

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def next_seq(self) -> int:
        """The ``seq`` the next sealed batch will carry."""
        return self._next_seq

    def age(self, now: float | None = None) -> float:
        """Seconds since the oldest buffered row arrived (0.0 when empty)."""
        if self._first_at is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self._first_at

    def validate(
        self, trace: Mapping[str, object]
    ) -> tuple[tuple[Chunk | tuple[Chunk, ...], ...], int]:
        """Check a step's ``trace`` and return one chunk per declared field, in order (a tuple
        of chunks for a column traced in parts), and the number of rows.

        Raises ``ValueError`` naming the field, what was expected and what arrived when a
        declared field is missing, an undeclared one is present, a value cannot be
        converted to its type, or the fields disagree on the number of rows.
        """
        fast = self._fast(trace)
        if fast is not None:
            return fast
        return self._converted(trace)

    def _converted(
        self, trace: Mapping[str, object]
    ) -> tuple[tuple[Chunk | tuple[Chunk, ...], ...], int]:
        """:meth:`validate`'s full way, every field through its conversion."""
        names = set(trace)
        missing = [f for f in self.fields if f not in names]
        extra = sorted(str(n) for n in names if n not in self._index)
        if missing or extra:
            parts = []
            if missing:
                parts.append("missing " + ", ".join(repr(f) for f in missing))
            if extra:
                parts.append("undeclared " + ", ".join(repr(f) for f in extra))
            raise ValueError(
                f"trace does not match the declared fields: {'; '.join(parts)} "
                f"(declared: {', '.join(self.fields)})"
            )
        pairs = zip(self.fields, self.types, strict=True)
        columns = tuple(_field_chunks(f, t, trace[f]) for f, t in pairs)
        rows = _rows(columns[0])
        if any(_rows(c) != rows for c in columns):
            counts = ", ".join(f"{f}={_rows(c)}" for f, c in zip(self.fields, columns, strict=True))
            raise ValueError(
                f"trace fields must have the same number of rows: expected {rows} rows "
                f"(from {self.fields[0]!r}) in every field, got {counts}"
            )
        return columns, rows

    def _fast(self, trace: Mapping[str, object]) -> tuple[tuple[Chunk, ...], int] | None:
        """The common step, checked in one flat pass and kept as raw arrays or host copies
        (see :data:`~recis_async.trace.schema.Chunk`): every declared field a numpy array
        (or a :class:`~recis_async.hostcopy.HostCopy`) of its stored dtype, or of a number
        type cast to a floating point one, 1-D (2-D for ``array<...>``), all with one row
        count.  Arrays are copied only if the caller could still change them; host copies
        are checked by their metadata, never read; casting and laying out happen in the
        writer.  It runs on every step right after the model's compute, when little of
        Python is in cache, so it touches as little as it can.  Anything else -- and every
        error -- goes the full way through :func:`~recis_async.trace.schema.convert`."""
        if len(trace) != len(self.fields):
            return None
        arrays: list[Chunk] = []
        rows = -1
        for field, dtype, ndim in self._plan:
            value = trace.get(field)
            if type(value) is np.ndarray:
                if dtype is None or value.ndim != ndim:
                    return None
                if ndim == 2 and value.size > _OFFSET_MAX:
                    return None  # too many elements for int32 offsets: convert says so
                if (
                    value.dtype is not dtype
                    and value.dtype != dtype
                    and (dtype.kind != "f" or value.dtype.kind not in "fiu")
                ):
                    return None  # integer narrowing, bools...: checked by convert
                flags = value.flags  # freeze(value), inlined: a collector's copy is kept
                if not flags.writeable and flags.owndata and flags.c_contiguous:
                    chunk: Chunk = value
                else:
                    chunk = freeze(value)
                n = len(value)
            elif type(value) is HostCopy:
                shape = value.shape  # its slot, not its ``ndim`` / ``len``: a call each
                if dtype is None or len(shape) != ndim:
                    return None
                if ndim == 2 and value.size > _OFFSET_MAX:
                    return None
                # (numpy's dtypes of its own types are single objects: ``is`` first spares
                # the step numpy's comparison, whose code it would run cold)
                if (
                    value.dtype is not dtype
                    and value.dtype != dtype
                    and (dtype.kind != "f" or value.dtype.kind not in "fiu")
                ):
                    return None  # widening ints and the rest: the slow path's host_chunk
                chunk = value
                n = shape[0]
            else:
                return None
            if n != rows:
                if rows >= 0:
                    return None
                rows = n
            arrays.append(chunk)
        return tuple(arrays), rows

    def append(self, trace: Mapping[str, object], step: int | None = None) -> int:
        """Validate and keep a step's trace; all or nothing.  Returns the rows added.

        ``step`` (the step's ``global_step``) is remembered as the sealed batch's ``steps``."""
        self.step_nbytes = 0
        if not trace:
            return 0
        checked = self._fast(trace)  # validate's first try, without its call
        chunks, rows = checked if checked is not None else self._converted(trace)
        if rows == 0:
            return 0
        nbytes = 0  # a host copy counts as its resolved array: exact before and after
        for held, chunk in zip(self._chunks, chunks, strict=True):
            if isinstance(chunk, tuple):  # a column traced in parts (TraceParts)
                held.extend(chunk)
                nbytes += sum(part.nbytes for part in chunk)
            else:
                held.append(chunk)
                nbytes += chunk.nbytes
        self._rows += rows
        self._nbytes += nbytes
        self.step_nbytes = nbytes
        self._steps += 1
        if self._first_at is None:
            self._first_at = time.monotonic()
        if step is not None:
            if self._first_step is None:
                self._first_step = step
            self._last_step = step
        return rows

    def due(self, size_threshold: int, max_age: float | None) -> bool:
        """Whether the buffer should be sealed now: it holds ``size_threshold`` bytes, or its
        oldest row is ``max_age`` seconds old (one call a step, for the feeding hook)."""
        if self._nbytes >= size_threshold:
            return True
        first = self._first_at
        return max_age is not None and first is not None and time.monotonic() - first >= max_age

    def seal(self) -> Batch | None:
        """Hand over everything buffered as a :class:`Batch` and start empty (None if empty)."""
        if not self._rows:
            return None
        batch = Batch(
            seq=self._next_seq,
            rows=self._rows,
            nbytes=self._nbytes,
            fields=self.fields,
            types=self.types,
            columns=tuple(tuple(chunks) for chunks in self._chunks),
            steps=None if self._first_step is None else (self._first_step, self._last_step),
            run=self.run,
        )
        self._next_seq += 1
        self._first_step = None
        self._chunks = [[] for _ in self.fields]
        self._rows = self._nbytes = self._steps = 0
        self._first_at = None
        return batch
