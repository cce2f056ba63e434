"""ODPS column types for traced data: parsing, conversion, Arrow types and byte sizes.

A trace table is declared as two parallel lists, ``fields`` and ``types``, with ODPS type
names: ``bigint``, ``int``, ``double``, ``float``, ``boolean``, ``string``, ``binary``,
``datetime`` and ``array<bigint|int|double|float|string>``.

Every value a step traces is converted here into a :class:`Column`: a chunk of rows held in
read-only numpy arrays laid out like Arrow's columnar format (``values`` plus zero or more
levels of ``int32`` offsets), so its size is known to the byte and it becomes an Arrow array
without copying.  Conversion rules (anything else is refused with a ``ValueError`` naming
the field, the declared type and what arrived):

=================  ===================================================================
type               accepted values (1-D: one value per row)
=================  ===================================================================
bigint, int        integer arrays whose values fit int64 / int32
double, float      integer or floating-point arrays (stored as float64 / float32)
boolean            bool arrays, or integer arrays holding only 0 and 1
string             str values (numpy ``U`` arrays, lists); bytes must be valid UTF-8
binary             bytes values (lists, object or ``S`` arrays), or a 2-D uint8 array
                   ``(rows, n)`` giving ``n`` bytes per row; str is stored as UTF-8
datetime           ``datetime64`` arrays or naive ``datetime.datetime`` values, kept at
                   millisecond precision as naive (local wall-clock) times, which is how
                   pyodps reads and writes ODPS ``datetime``
array<T>           a 2-D array ``(rows, n)`` (one array of ``n`` elements per row), or a
                   sequence of 1-D sequences (ragged rows); elements follow T's rule
=================  ===================================================================

Missing values (``None``, ``NaT``) are refused: trace rows are complete by construction.
Text is kept byte for byte, NUL characters included; only numpy's fixed-width ``U``/``S``
arrays cannot hold trailing NULs (numpy drops them itself), so pass such values as lists or
object arrays (``add_to_trace`` keeps lists of text as objects).

Converted data is copied, so later changes to the caller's arrays do not reach the trace --
except for contiguous, read-only arrays of exactly the stored dtype that own their memory
(such as a collector's private copies): those are kept as they are, saving a copy per step.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import numpy as np
import pyarrow as pa

from ..hostcopy import HostCopy

__all__ = [
    "OdpsType",
    "Column",
    "Chunk",
    "parse_type",
    "parse_schema",
    "prepare_conversion",
    "convert",
    "host_chunk",
    "chunk_rows",
    "to_arrow",
    "from_arrow",
    "arrow_schema",
    "SCALAR_TYPES",
    "ELEMENT_TYPES",
]

#: ODPS scalar type names accepted in a trace schema.
SCALAR_TYPES: Final = (
    "bigint",
    "int",
    "double",
    "float",
    "boolean",
    "string",
    "binary",
    "datetime",
)
#: Element types accepted inside ``array<...>``.
ELEMENT_TYPES: Final = ("bigint", "int", "double", "float", "string")

_NUMPY_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "bigint": np.dtype(np.int64),
    "int": np.dtype(np.int32),
    "double": np.dtype(np.float64),
    "float": np.dtype(np.float32),
    "boolean": np.dtype(np.bool_),
    "datetime": np.dtype("datetime64[ms]"),
}
_FAST_DTYPES: Final = {k: v for k, v in _NUMPY_DTYPES.items() if k != "datetime"}
_ARROW_SCALARS: Final = {
    "bigint": pa.int64(),
    "int": pa.int32(),
    "double": pa.float64(),
    "float": pa.float32(),
    "boolean": pa.bool_(),
    "string": pa.string(),
    "binary": pa.binary(),
    "datetime": pa.timestamp("ms"),
}
_INT32: Final = np.dtype(np.int32)
_OFFSET_MAX: Final = np.iinfo(np.int32).max
_EMPTY_OFFSETS: Final = np.zeros(1, dtype=np.int32)
_EMPTY_OFFSETS.setflags(write=False)


@dataclass(frozen=True, slots=True)
class OdpsType:
    """A parsed ODPS column type: ``name`` is canonical (lower case, no spaces)."""

    name: str
    element: OdpsType | None = None

    @property
    def is_array(self) -> bool:
        return self.element is not None

    @property
    def is_text(self) -> bool:
        """Variable-width bytes per value (``string`` / ``binary``)."""
        return self.name in ("string", "binary")

    @property
    def arrow_type(self) -> pa.DataType:
        """The Arrow type used for Parquet files and the ODPS Arrow tunnel."""
        if self.element is not None:
            return pa.list_(self.element.arrow_type)
        return _ARROW_SCALARS[self.name]

    @property
    def offset_levels(self) -> int:
        """How many offset arrays a :class:`Column` of this type carries."""
        levels = 1 if self.is_text else 0
        if self.element is not None:
            levels = 1 + self.element.offset_levels
        return levels

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True, eq=False)
class Column:
    """A chunk of rows of one field, laid out like an Arrow array without nulls.

    ``values`` holds the leaf data (numbers, ``datetime64[ms]`` or UTF-8/bytes as uint8);
    ``offsets`` holds one ``int32`` array per nesting level, outermost first: none for fixed
    width types, one for ``string``/``binary`` and ``array<number>``, two for
    ``array<string>``.  All arrays are read-only.
    """

    values: np.ndarray
    offsets: tuple[np.ndarray, ...] = ()

    @property
    def rows(self) -> int:
        if self.offsets:
            return len(self.offsets[0]) - 1
        return len(self.values)

    @property
    def nbytes(self) -> int:
        """Exact bytes held: leaf values plus every offsets array."""
        return int(self.values.nbytes) + sum(int(o.nbytes) for o in self.offsets)


#: One step's rows of one field as a buffer holds them: a converted :class:`Column`, or a raw
#: array the buffer's per-step fast path accepted -- read-only, owning its memory, of a number
#: type that casts to the field's stored one, 1-D (2-D ``(rows, n)`` for ``array<...>``) --
#: or a :class:`~recis_async.hostcopy.HostCopy` meeting the same rules by its metadata (see
#: :func:`host_chunk`), whose values may still be on their way from the device.  A raw chunk is
#: cast and laid out by :func:`to_arrow`, in the writer, off the training step; a host copy is
#: resolved there too, unless a later step found it ready first.  Its ``nbytes`` is the size
#: of its resolved array, so a buffer's count stays exact whichever happens.
Chunk: TypeAlias = "Column | np.ndarray | HostCopy"


# ---------------------------------------------------------------------------------------
# parsing


def parse_type(text: object, field: str = "?") -> OdpsType:
    """Parse an ODPS type name (case-insensitive, spaces ignored) for ``field``."""
    if not isinstance(text, str):
        raise ValueError(
            f"field {field!r}: expected an ODPS type name (str), got {type(text).__name__} "
            f"({text!r})"
        )
    name = "".join(text.split()).lower()
    if name in SCALAR_TYPES:
        return OdpsType(name)
    if name.startswith("array<") and name.endswith(">"):
        inner = name[len("array<") : -1]
        if inner in ELEMENT_TYPES:
            return OdpsType(name, OdpsType(inner))
    supported = ", ".join(SCALAR_TYPES) + ", array<" + "|".join(ELEMENT_TYPES) + ">"
    raise ValueError(f"field {field!r}: unknown ODPS type {text!r}; supported: {supported}")


def parse_schema(
    fields: Sequence[str], types: Sequence[str]
) -> tuple[tuple[str, ...], tuple[OdpsType, ...]]:
    """Validate a ``fields``/``types`` declaration and parse its types."""
    if isinstance(fields, (str, bytes)) or not isinstance(fields, Sequence):
        raise ValueError(f"fields: expected a list of field names, got {type(fields).__name__}")
    if isinstance(types, (str, bytes)) or not isinstance(types, Sequence):
        raise ValueError(f"types: expected a list of ODPS type names, got {type(types).__name__}")
    if len(fields) != len(types):
        raise ValueError(
            f"fields and types must have the same length: got {len(fields)} fields "
            f"({list(fields)}) and {len(types)} types ({list(types)})"
        )
    if not fields:
        raise ValueError("fields: expected at least one field, got an empty list")
    seen: set[str] = set()
    for name in fields:
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"fields: expected non-empty names without spaces, got {name!r}")
        if name.lower() in seen:  # ODPS column names are case-insensitive
            raise ValueError(f"fields: duplicate field name {name!r}")
        seen.add(name.lower())
    parsed = tuple(parse_type(t, f) for f, t in zip(fields, types, strict=True))
    return tuple(fields), parsed


def arrow_schema(fields: Sequence[str], types: Sequence[OdpsType]) -> pa.Schema:
    """The Arrow schema of a trace table (values are never null)."""
    pairs = zip(fields, types, strict=True)
    return pa.schema([pa.field(f, t.arrow_type, nullable=False) for f, t in pairs])


# ---------------------------------------------------------------------------------------
# conversion of step values


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}"
    if isinstance(value, (list, tuple)):
        first = f", first item {type(value[0]).__name__}" if value else ""
        return f"{type(value).__name__} of {len(value)} items{first}"
    return f"{type(value).__name__} ({value!r:.60})"


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


def _as_array(value: object) -> Any:
    """numpy view of tensors/arrays; lists and tuples are kept for the caller to decide."""
    if isinstance(value, np.ndarray):
        return value
    detach = getattr(value, "detach", None)
    if detach is not None and hasattr(value, "numpy"):  # a torch tensor, without importing torch
        return detach().cpu().numpy()
    return value


class _Reject(ValueError):
    """Raised by the per-type converters with the 'expected ..., got ...' part only."""


def _check_1d(arr: np.ndarray) -> None:
    if arr.ndim != 1:
        raise _Reject(f"expected a 1-D array (one value per row), got shape {arr.shape}")


def _numeric(arr: np.ndarray, type_name: str) -> np.ndarray:
    dtype = _NUMPY_DTYPES[type_name]
    kind = arr.dtype.kind
    if kind == "O":  # e.g. a list holding None, or ints beyond 64 bits: name the first
        items = arr.tolist()
        unfit = _first_unfit(items, type_name)
        if unfit:
            raise _Reject(unfit)
        arr = np.array(items, dtype=np.float64 if type_name in ("double", "float") else None)
        kind = arr.dtype.kind
    if type_name in ("bigint", "int"):
        if kind not in "iu":
            raise _Reject(f"expected integer values, got {arr.dtype}")
        info = np.iinfo(dtype)
        if arr.size and arr.dtype != dtype and not np.can_cast(arr.dtype, dtype):
            low, high = arr.min(), arr.max()
            if low < info.min or high > info.max:
                bad = low if low < info.min else high
                row = int(np.flatnonzero(arr == bad)[0])
                raise _Reject(
                    f"expected values within {type_name} range [{info.min}, {info.max}], "
                    f"got {int(bad)} at row {row}"
                )
    elif type_name in ("double", "float"):
        if kind not in "iuf":
            raise _Reject(f"expected integer or floating-point values, got {arr.dtype}")
    elif type_name == "boolean":
        if kind in "iu":
            if arr.size and not np.isin(arr, (0, 1)).all():
                row = int(np.flatnonzero(~np.isin(arr, (0, 1)))[0])
                raise _Reject(
                    f"expected bool values (or 0/1), got {arr[row].item()!r} at row {row}"
                )
        elif kind != "b":
            raise _Reject(f"expected bool values, got {arr.dtype}")
    return np.array(arr, dtype=dtype, copy=True)


def _first_unfit(items: list[Any], type_name: str) -> str | None:
    """Why ``items`` cannot be ``type_name`` values: the first non-number, or a number out
    of the type's range (Python ints have no bound); None when they all fit."""
    dtype = _NUMPY_DTYPES[type_name]
    integral = type_name in ("bigint", "int")
    for row, item in enumerate(items):
        if isinstance(item, bool | np.bool_) or not isinstance(item, int | float | np.number):
            if type_name == "boolean" and isinstance(item, bool | np.bool_):
                continue
            return f"expected numbers, got {type(item).__name__} ({item!r:.40}) at row {row}"
        if isinstance(item, int):
            low, high = (
                (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
                if integral
                else (-float(np.finfo(dtype).max), float(np.finfo(dtype).max))
            )
            if not low <= item <= high:
                text = (
                    str(item)
                    if len(str(item)) <= 40
                    else f"{str(item)[:20]}... ({len(str(item))} digits)"
                )
                bounds = f"[{low}, {high}]" if integral else f"[{low:.6g}, {high:.6g}]"
                return f"expected values within {type_name} range {bounds}, got {text} at row {row}"
    return None


def _datetime(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray) and value.dtype.kind == "M":
        arr = value.astype("datetime64[ms]")
    elif isinstance(value, np.ndarray) and value.dtype.kind != "O":
        raise _Reject(f"expected datetime64 values or datetime.datetime objects, got {value.dtype}")
    else:
        items = value.tolist() if isinstance(value, np.ndarray) else list(value)
        for row, item in enumerate(items):
            if not isinstance(item, (_dt.datetime, np.datetime64)):
                raise _Reject(
                    f"expected datetime64 values or datetime.datetime objects, got "
                    f"{type(item).__name__} ({item!r:.40}) at row {row}"
                )
            if isinstance(item, _dt.datetime) and item.tzinfo is not None:
                raise _Reject(
                    f"expected naive datetimes (local wall-clock time), got {item!r} with "
                    f"tzinfo at row {row}"
                )
        arr = np.array(items, dtype="datetime64[ms]").reshape(len(items))
    if arr.size and np.isnat(arr).any():
        row = int(np.flatnonzero(np.isnat(arr))[0])
        raise _Reject(f"expected datetimes, got NaT at row {row}")
    return arr


def _regular_offsets(rows: int, width: int) -> np.ndarray:
    return (np.arange(rows + 1, dtype=np.int64) * width).astype(np.int32)


def _text(value: Any, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(utf-8/bytes data, int32 offsets) for string/binary values."""
    if isinstance(value, np.ndarray):
        if type_name == "binary" and value.ndim == 2 and value.dtype in (np.uint8, np.int8):
            rows, width = value.shape
            data = np.ascontiguousarray(value).view(np.uint8).reshape(-1).copy()
            if data.size > _OFFSET_MAX:
                raise _Reject(f"expected at most {_OFFSET_MAX} bytes per step, got {data.size}")
            return data, _regular_offsets(rows, width)
        _check_1d(value)
        if value.dtype.kind not in "USO":
            expected = "str values" if type_name == "string" else "bytes values"
            raise _Reject(f"expected {expected}, got {value.dtype}")
        if value.dtype.kind != "O":
            # pyarrow reads numpy's fixed-width U/S items only up to their first NUL (and
            # U items as raw UCS-4 for binary): hand it the items as Python objects instead
            value = value.tolist()
    try:
        arr = pa.array(value, type=_ARROW_SCALARS[type_name], from_pandas=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        expected = "str values (or UTF-8 bytes)" if type_name == "string" else "bytes values"
        raise _Reject(f"expected {expected}, got {_describe(value)}: {exc}") from None
    except pa.ArrowCapacityError:
        raise _Reject(f"expected at most {_OFFSET_MAX} bytes per step") from None
    if arr.null_count:
        row = next(i for i, v in enumerate(arr.is_null().to_pylist()) if v)
        raise _Reject(f"expected {type_name} values, got None at row {row}")
    _, offsets_buf, data_buf = arr.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=len(arr) + 1)
    end = int(offsets[-1])
    data = (
        np.frombuffer(data_buf, dtype=np.uint8, count=end)
        if data_buf is not None and end
        else np.zeros(0, dtype=np.uint8)
    )
    return data, offsets


def prepare_conversion(types: Sequence[OdpsType]) -> None:
    """Run the one-time setup of the conversions ``types`` need, now rather than on the first
    step: text values are encoded by ``pa.array``, whose first call in a process imports
    pandas (~130 ms holding the GIL)."""
    if any(t.is_text or (t.element is not None and t.element.is_text) for t in types):
        pa.array([], type=pa.string())


def _leaf(value: Any, type_: OdpsType) -> Column:
    """A column of a non-array type from one value per row."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.size == 0:
        return _empty(type_)  # numpy gives empty lists a float dtype: any is fine
    if type_.is_text:
        data, offsets = _text(value, type_.name)
        return Column(_readonly(data), (_readonly(offsets),))
    if type_.name == "datetime":
        if isinstance(value, np.ndarray):
            _check_1d(value)
        return Column(_readonly(_datetime(value)))
    if not isinstance(value, np.ndarray):
        try:
            value = np.asarray(value)
        except ValueError as exc:
            raise _Reject(f"expected a 1-D sequence of numbers ({exc})") from None
    _check_1d(value)
    return Column(_readonly(_numeric(value, type_.name)))


def _empty(type_: OdpsType) -> Column:
    if type_.is_text:
        return Column(_readonly(np.zeros(0, np.uint8)), (_EMPTY_OFFSETS,))
    return Column(_readonly(np.zeros(0, _NUMPY_DTYPES[type_.name])))


def _array(value: Any, type_: OdpsType) -> Column:
    element = type_.element
    assert element is not None
    if not isinstance(value, np.ndarray):
        if not isinstance(value, (list, tuple)):
            raise _Reject(
                f"expected a 2-D array or a sequence of sequences, got {_describe(value)}"
            )
        rows = value
        try:
            value = np.asarray(rows)
        except ValueError:  # ragged rows
            value = np.array(list(rows) + [None], dtype=object)[:-1]
        else:
            if value.dtype.kind in "SU":  # keep text as objects: U/S drop trailing NULs
                value = np.array(rows, dtype=object)
    if value.ndim == 2:
        rows, width = value.shape
        if rows * width > _OFFSET_MAX:
            raise _Reject(f"expected at most {_OFFSET_MAX} elements per step, got {rows * width}")
        flat = _leaf(value.reshape(-1), element)
        return Column(flat.values, (_readonly(_regular_offsets(rows, width)),) + flat.offsets)
    if value.ndim == 1 and (value.dtype.kind == "O" or len(value) == 0):
        items: list[Any] = []
        for row, item in enumerate(value):
            item = _as_array(item)
            if isinstance(item, np.ndarray):
                if item.ndim != 1:
                    raise _Reject(
                        f"expected a 1-D sequence per row, got shape {item.shape} at row {row}"
                    )
                items.append(item)
            elif isinstance(item, (list, tuple)):
                items.append(item)
            else:
                raise _Reject(
                    f"expected a sequence of elements per row, got {type(item).__name__} "
                    f"at row {row}"
                )
        lengths = np.fromiter((len(i) for i in items), dtype=np.int64, count=len(items))
        total = int(lengths.sum())
        if total > _OFFSET_MAX:
            raise _Reject(f"expected at most {_OFFSET_MAX} elements per step, got {total}")
        outer = np.zeros(len(items) + 1, dtype=np.int32)
        np.cumsum(lengths, out=outer[1:])
        if element.is_text:
            flat_items: list[Any] = [
                x
                for item in items
                for x in (item.tolist() if isinstance(item, np.ndarray) else item)
            ]
            flat = _leaf(flat_items, element)
        else:
            parts = [np.asarray(i) for i in items if len(i)]  # empty lists default to float
            merged = (
                np.concatenate(parts) if parts else np.zeros(0, dtype=_NUMPY_DTYPES[element.name])
            )
            flat = _leaf(merged, element)
        return Column(flat.values, (_readonly(outer),) + flat.offsets)
    raise _Reject(
        f"expected a 2-D (rows, n) array or a sequence of sequences, got {_describe(value)}"
    )


def fast_dtype(type_: OdpsType) -> np.dtype[Any] | None:
    """The numpy dtype whose arrays a column of ``type_`` keeps without conversion (the
    element's for ``array<...>``), or None when every value needs converting."""
    return _FAST_DTYPES.get((type_.element or type_).name)


def freeze(value: np.ndarray) -> np.ndarray:
    """``value`` itself if nothing can change it any more, else a read-only copy.

    A contiguous array that owns its memory and is already read-only is kept as it is (a
    collector's private copy, say): changing it would take re-enabling writes on purpose.
    """
    flags = value.flags
    if not flags.writeable and flags.owndata and flags.c_contiguous:
        return value
    return _readonly(value.copy())


def host_chunk(type_: OdpsType, copy: HostCopy) -> HostCopy | None:
    """``copy`` itself if its dtype and shape alone make it a valid chunk of ``type_`` (a
    number type that casts to the stored one without a range check: the same, a wider
    integer, or any number into a floating point type; 1-D, or 2-D for
    ``array<...>``), else None: such a copy is resolved at the step and converted by
    :func:`convert`, which checks its values or names what is wrong."""
    dtype = _FAST_DTYPES.get((type_.element or type_).name)
    if dtype is None:
        return None
    kind = copy.dtype.kind
    if copy.dtype != dtype:
        widening = kind in "iu" and dtype.kind == "i" and np.can_cast(copy.dtype, dtype)
        if not widening and (dtype.kind != "f" or kind not in "fiu"):
            return None  # integer narrowing, ints into booleans, floats into ints...
    if copy.ndim != (1 if type_.element is None else 2):
        return None
    if type_.element is not None and copy.size > _OFFSET_MAX:
        return None
    return copy


def chunk_rows(chunk: Chunk) -> int:
    """The rows a chunk holds."""
    return chunk.rows if isinstance(chunk, Column) else len(chunk)


def _fast(type_: OdpsType, value: np.ndarray) -> Column | None:
    """The common case without checks: a numeric array already of the stored dtype."""
    element = type_.element
    dtype = _FAST_DTYPES.get((element or type_).name)
    if dtype is None or value.dtype != dtype:  # (a float64 dtype equals None)
        return None
    if element is None:
        if value.ndim == 1:
            return _from_raw(freeze(value), type_)
    elif value.ndim == 2 and value.size <= _OFFSET_MAX:
        return _from_raw(freeze(value), type_)
    return None


def _from_raw(value: np.ndarray, type_: OdpsType) -> Column:
    """The column of a raw chunk: cast to the stored dtype (as :func:`convert` casts
    numbers to floating point types), flattened, with regular offsets for ``array<...>``."""
    values = _readonly(value.astype(_FAST_DTYPES[(type_.element or type_).name], copy=False))
    if type_.element is None:
        return Column(values)
    rows, width = value.shape
    return Column(values.reshape(-1), (_readonly(_regular_offsets(rows, width)),))


def convert(field: str, type_: OdpsType, value: object) -> Column:
    """Convert one step's value for ``field`` into an owned, read-only :class:`Column`.  A
    :class:`~recis_async.hostcopy.HostCopy` is resolved first (waiting for its copy).

    Raises ``ValueError`` naming the field, the declared type and what arrived.
    """
    if type(value) is HostCopy:
        value = value.resolve()
    if type(value) is np.ndarray and (column := _fast(type_, value)) is not None:
        return column
    value = _as_array(value)
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        raise ValueError(
            f"field {field!r} ({type_}): expected an array or list with one entry per row, "
            f"got {_describe(value)}"
        )
    try:
        if type_.is_array:
            return _array(value, type_)
        return _leaf(value, type_)
    except _Reject as exc:
        raise ValueError(f"field {field!r} ({type_}): {exc}") from None


# ---------------------------------------------------------------------------------------
# Arrow


def _buffer(arr: np.ndarray, dtype: np.dtype[Any] | None = None) -> pa.Buffer:
    return pa.py_buffer(np.ascontiguousarray(arr, dtype=dtype))


def _leaf_to_arrow(
    col_values: np.ndarray, offsets: tuple[np.ndarray, ...], type_: OdpsType
) -> pa.Array:
    # Arrays are built from their buffers, sharing the chunk's memory: ``pa.array`` would
    # also work, but its first call in a process imports pandas (~130 ms holding the GIL),
    # which would land in the first batch's write, on the training steps it overlaps.
    if type_.is_text:
        (off,) = offsets
        return pa.Array.from_buffers(
            type_.arrow_type, len(off) - 1, [None, _buffer(off), _buffer(col_values)]
        )
    if type_.name == "boolean":  # Arrow packs booleans into bits, least significant first
        data = pa.py_buffer(np.packbits(col_values.astype(np.bool_), bitorder="little"))
    else:  # fixed width: Arrow's layout byte for byte, in the type's exact dtype
        data = _buffer(col_values, _NUMPY_DTYPES[type_.name])
    return pa.Array.from_buffers(type_.arrow_type, len(col_values), [None, data])


def to_arrow(chunk: Chunk, type_: OdpsType) -> pa.Array:
    """The Arrow array of a chunk, sharing its memory where the layouts agree.  A host copy
    is resolved here (waiting for the device if it has not finished: call it in a worker
    thread)."""
    if isinstance(chunk, HostCopy):
        chunk = chunk.resolve()
    column = chunk if isinstance(chunk, Column) else _from_raw(chunk, type_)
    if type_.element is not None:
        outer, *inner = column.offsets
        values = _leaf_to_arrow(column.values, tuple(inner), type_.element)
        offsets = pa.Array.from_buffers(pa.int32(), len(outer), [None, _buffer(outer, _INT32)])
        return pa.ListArray.from_arrays(offsets, values)
    return _leaf_to_arrow(column.values, column.offsets, type_)


def _from_arrow_leaf(arr: pa.Array, type_: OdpsType) -> Column:
    if type_.is_text:
        arr = arr.cast(type_.arrow_type)
        if arr.offset:  # normalise a slice so offsets start at zero
            arr = pa.concat_arrays([arr])
        _, offsets_buf, data_buf = arr.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int32, count=len(arr) + 1)
        start, end = int(offsets[0]), int(offsets[-1])
        data = (
            np.frombuffer(data_buf, dtype=np.uint8)[start:end].copy()
            if data_buf is not None
            else np.zeros(0, dtype=np.uint8)
        )
        return Column(_readonly(data), (_readonly(offsets - start),))
    values = arr.cast(type_.arrow_type).to_numpy(zero_copy_only=False)
    return Column(_readonly(np.array(values, dtype=_NUMPY_DTYPES[type_.name], copy=True)))


def from_arrow(arr: pa.Array | pa.ChunkedArray, type_: OdpsType) -> Column:
    """The inverse of :func:`to_arrow` (used to replay spill files); copies the data."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    if arr.null_count:
        raise ValueError(f"expected no nulls in a {type_} column, got {arr.null_count}")
    if type_.element is not None:
        arr = arr.cast(type_.arrow_type)
        raw = np.asarray(arr.offsets, dtype=np.int32)
        inner = _from_arrow_leaf(
            arr.values.slice(int(raw[0]), int(raw[-1] - raw[0])), type_.element
        )
        return Column(inner.values, (_readonly(raw - raw[0]),) + inner.offsets)
    return _from_arrow_leaf(arr, type_)
