"""The tracker contract: what a run is, what a logged step is, and the calls a tracker answers.

Trackers are plain blocking objects.  They are only ever called from one worker thread at a
time (by :class:`~recis_async.trackers.TrackerService`), in the order ``start`` -> ``log``* ->
``finish``, so they need no locking and may use blocking client libraries freely.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, Protocol, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

import msgspec
import numpy as np

from ..events import EndStatus
from ..hostcopy import HostCopy

__all__ = [
    "RunSpec",
    "StepRecord",
    "Tracker",
    "check_metric_name",
    "flatten_params",
    "to_tracked_value",
    "record_nbytes",
    "resolve_records",
    "append_jsonl",
]

_NAME_CHARS = re.compile(r"^[/\w.\- :]+$")
MAX_NAME_LENGTH = 250


class RunSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Which run a tracker opens: ``run_id`` resumes an existing run when the tracker can."""

    project: str
    name: str
    run_id: str | None = None
    params: dict[str, Any] = msgspec.field(default_factory=dict)


class StepRecord(msgspec.Struct, frozen=True):
    """The values logged for one step.

    ``time`` is wall-clock seconds since the epoch (trackers store it as the point's
    timestamp).  A value is a float or a float64 numpy array (histograms / arrays); while a
    record waits in :class:`~recis_async.trackers.TrackerService` it may also hold a
    :class:`~recis_async.hostcopy.HostCopy`, resolved by :func:`resolve_records` in the
    service's worker thread before a tracker sees it.
    """

    step: int
    time: float
    values: dict[str, Any]


@runtime_checkable
class Tracker(Protocol):
    """An experiment tracker behind three blocking calls, made from a worker thread."""

    def start(self, run: RunSpec) -> None:
        """Open (or resume) the run and record its params."""
        ...

    def log(self, records: Sequence[StepRecord]) -> None:
        """Store the records; return only when they are handed to the backing store.

        A failure may say how much landed, as attributes of the exception it raises:
        ``delivered`` (an int: that many leading records were stored) or ``in_doubt``
        (true: the call was cut off with no answer, so any of them may have been stored).
        The service spills records in doubt apart (``*.inflight.jsonl``); the replay
        settles them against the store either way."""
        ...

    def finish(self, status: EndStatus) -> None:
        """Mark the run ended with ``status`` and release resources."""
        ...


def check_metric_name(name: object, *, where: str = "metric name") -> str:
    """Validate a metric or param name under the strictest common rule (MLflow's).

    Names may hold letters, digits, ``_ - . / : `` and spaces, at most 250 characters, and
    must not change under path normalisation (no ``a//b``, ``./a``, ``../a``, ``/a``).
    """
    if not isinstance(name, str):
        raise TypeError(f"{where}: expected str, got {type(name).__name__} ({name!r})")
    if not name or len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"{where}: expected 1..{MAX_NAME_LENGTH} characters, got {len(name)} ({name[:40]!r})"
        )
    if not _NAME_CHARS.match(name):
        raise ValueError(
            f"{where}: expected only letters, digits, '_', '-', '.', '/', ':' and spaces, "
            f"got {name!r}"
        )
    norm = posixpath.normpath(name)
    if norm != name or norm == "." or norm.startswith(("..", "/")):
        raise ValueError(f"{where}: expected a normalised path-like name, got {name!r}")
    return name


def flatten_params(config: Mapping[str, Any], *, where: str = "config") -> dict[str, Any]:
    """Flatten nested mappings into ``a.b.c`` keys.

    Leaves that are JSON values (str, numbers, bools, None, lists of those) stay as given;
    anything else (paths, dtypes, objects) is stored as its ``str``.

    Keys are validated with :func:`check_metric_name` so a bad key fails here, at
    construction, and not in a background flush.
    """
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Mapping[str, Any]) -> None:
        for key, value in node.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where}: keys must be str, got {type(key).__name__} ({key!r}) "
                    f"under {prefix or '<root>'!r}"
                )
            full = f"{prefix}.{key}" if prefix else key
            if isinstance(value, Mapping) and value:
                walk(full, value)
            else:
                check_metric_name(full, where=f"{where} key")
                out[full] = _plain(value)

    walk("", config)
    return out


def _plain(value: Any) -> Any:
    """A param value every store can encode: JSON scalars and lists stay, others become str."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def to_tracked_value(name: str, value: object, *, where: str) -> float | np.ndarray | HostCopy:
    """Normalise one tracked value: numbers become ``float``, sequences float64 arrays; a
    :class:`~recis_async.hostcopy.HostCopy` of numbers is kept as it is (not read here: see
    :func:`resolve_records`).

    Raises ``TypeError`` naming ``where[name]`` for anything else (strings, dicts, ragged
    lists, a host copy of complex numbers), so bad input fails at the publish that carried it.
    """
    if isinstance(value, (bool, int, float, np.number, np.bool_)):
        return float(value)
    if type(value) is HostCopy:
        if value.dtype.kind not in "biuf":
            raise TypeError(
                f"{where}[{name!r}]: expected a tensor of real numbers, got {value.source_dtype}"
            )
        return value
    if isinstance(value, (list, tuple, np.ndarray)):
        try:
            arr = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{where}[{name!r}]: expected a number or a (nested) list/array of numbers, "
                f"got {type(value).__name__} that does not convert to float64 ({exc})"
            ) from None
        if arr.ndim == 0:
            return float(arr)
        return arr
    raise TypeError(
        f"{where}[{name!r}]: expected a number or a list/array of numbers, "
        f"got {type(value).__name__} ({value!r:.60})"
    )


def host_value(copy: HostCopy) -> float | np.ndarray:
    """A tracked host copy as the tracker's value, waiting for it if needed (call it in a
    worker thread): one element as a float, more as a float64 array (``bfloat16`` and
    ``float16`` widened exactly)."""
    array = copy.resolve()
    if array.size == 1:
        return float(array.reshape(-1)[0])
    return array.astype(np.float64)


def value_nbytes(value: object) -> int:
    """The payload bytes a tracked value counts for (a host copy: the float64 array it will
    become; a number: none beyond :data:`VALUE_OVERHEAD`)."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if type(value) is HostCopy and value.size != 1:
        return 8 * value.size
    return 0


def resolve_records(records: Sequence[StepRecord]) -> Sequence[StepRecord]:
    """``records`` with every host copy replaced by its value (:func:`host_value`); the same
    sequence when none holds one.  Blocks on the device when a copy is not ready: the tracker
    service calls it in its worker thread."""
    if not any(type(v) is HostCopy for r in records for v in r.values.values()):
        return records
    return [
        StepRecord(
            r.step,
            r.time,
            {k: host_value(v) if type(v) is HostCopy else v for k, v in r.values.items()},
        )
        for r in records
    ]


RECORD_OVERHEAD = 64  # bytes counted per record besides its values
VALUE_OVERHEAD = 48  # bytes counted per value besides its name and array payload


def record_nbytes(record: StepRecord) -> int:
    """Bytes a record holds for buffer accounting (payload plus a fixed per-entry cost)."""
    total = RECORD_OVERHEAD
    for key, value in record.values.items():
        total += VALUE_OVERHEAD + len(key) + value_nbytes(value)
    return total


def append_jsonl(
    file: IO[bytes], encoder: msgspec.json.Encoder, records: Iterable[StepRecord]
) -> None:
    """Append ``records`` to ``file`` as JSON lines in one write, then flush."""
    buf = bytearray()
    for record in records:
        encoder.encode_into(record, buf, -1)
        buf += b"\n"
    file.write(buf)
    file.flush()


def encode_value(obj: Any) -> Any:
    """``enc_hook`` for msgspec: numpy arrays and scalars become JSON lists / numbers (a host
    copy is resolved: encode in a worker thread)."""
    if type(obj) is HostCopy:
        obj = host_value(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def params_for_text(params: Mapping[str, Any]) -> dict[str, str | float | bool]:
    """Params as the scalar types text-based stores accept (others via ``str``)."""
    out: dict[str, str | float | bool] = {}
    for key, value in params.items():
        if isinstance(value, bool):
            out[key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value) if math.isfinite(value) else str(value)
        elif isinstance(value, str):
            out[key] = value
        else:
            out[key] = str(value)
    return out


def chunked(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def public_uri(uri: str) -> str:
    """``uri`` without a user and password; otherwise exactly as given (``sqlite:///a.db``
    keeps its three slashes)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def tracker_location(tracker: object, project: str) -> str:
    """Where a tracker keeps a run, for a person: a folder, or an MLflow tracking URI without
    its user and password; other trackers by their ``repr``."""
    run_dir = getattr(tracker, "run_dir", None)
    root = getattr(tracker, "root", None)
    if run_dir is not None:
        return os.path.abspath(run_dir)
    if root is not None:
        return os.path.join(os.path.abspath(root), project, "<run>")
    log_dir = getattr(tracker, "log_dir", None)
    if log_dir is not None:
        return os.path.abspath(log_dir)
    if hasattr(tracker, "tracking_uri"):
        uri = getattr(tracker, "tracking_uri", None)
        if not uri:
            return "MLflow (its default tracking URI)"
        return f"MLflow at {public_uri(str(uri))}"
    return repr(tracker)


def tracker_target(tracker: object) -> dict[str, str | None]:
    """What a replay needs to reach a tracker's store again (no credentials)."""
    if hasattr(tracker, "tracking_uri"):
        uri = getattr(tracker, "tracking_uri", None)
        return {"tracking_uri": public_uri(str(uri)) if uri else None}
    for field in ("root", "log_dir"):
        value = getattr(tracker, field, None)
        if value is not None:
            return {field: os.path.abspath(value)}
    return {}
