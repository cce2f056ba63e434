"""JsonlTracker: the embedded default tracker, a run folder of plain JSON files.

Layout of a run: ``<root>/<project>/<run_id>/``

- ``params.json``   the run's config (as given, JSON-encoded)
- ``run.json``      project, name, run_id, status, start and end times
- ``metrics.jsonl`` one :class:`~recis_async.trackers.StepRecord` per line
  (``{"step": .., "time": .., "values": {...}}``; arrays are lists, NaN is ``null``)

Passing an existing ``run_id`` resumes that run: metrics are appended, params replaced.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from .._checks import creatable_dir
from .._files import atomic_path
from ..events import EndStatus
from .base import RunSpec, StepRecord, append_jsonl, encode_value

__all__ = ["JsonlTracker", "RunInfo", "read_records"]

_UNSAFE = re.compile(r"[^\w.\-]+")


class RunInfo(msgspec.Struct, kw_only=True):
    """Contents of ``run.json``."""

    project: str
    name: str
    run_id: str
    status: str = "running"
    start_time: float = 0.0
    end_time: float | None = None


def _safe(part: str) -> str:
    cleaned = _UNSAFE.sub("_", part).strip("._")
    return cleaned or "_"


def read_records(path: str | os.PathLike[str]) -> list[StepRecord]:
    """Read a ``metrics.jsonl`` (or a tracker spill file) back into records."""
    decoder = msgspec.json.Decoder(StepRecord)
    with open(path, "rb") as fh:
        return [decoder.decode(line) for line in fh if line.strip()]


class JsonlTracker:
    """Write runs as JSON files under ``root``; needs nothing beyond msgspec.

    Args:
        root: the directory holding ``<project>/<run>/`` folders.
    """

    def __init__(self, root: str | os.PathLike[str] = "ml_tracker") -> None:
        root_path = Path(creatable_dir("JsonlTracker", "root", root))
        self.root = root_path
        self.run_dir: Path | None = None
        self._info: RunInfo | None = None
        self._metrics: IO[bytes] | None = None
        self._encoder = msgspec.json.Encoder(enc_hook=encode_value)

    def __repr__(self) -> str:
        return f"JsonlTracker(root={str(self.root)!r})"

    def start(self, run: RunSpec) -> None:
        run_id = run.run_id or (
            f"{_safe(run.name)}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"
        )
        run_dir = self.root / _safe(run.project) / _safe(run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        info_path = run_dir / "run.json"
        if info_path.exists():
            info = msgspec.json.decode(info_path.read_bytes(), type=RunInfo)
            info.status, info.end_time = "running", None
        else:
            info = RunInfo(
                project=run.project, name=run.name, run_id=run_id, start_time=time.time()
            )
        self._write_atomic(run_dir / "params.json", self._encoder.encode(run.params))
        self._write_atomic(info_path, self._encoder.encode(info))
        self._metrics = open(run_dir / "metrics.jsonl", "ab")
        self.run_dir, self._info = run_dir, info

    def log(self, records: Sequence[StepRecord]) -> None:
        if self._metrics is None:
            raise RuntimeError("JsonlTracker.log: the run is not started")
        append_jsonl(self._metrics, self._encoder, records)

    def finish(self, status: EndStatus) -> None:
        if self._metrics is None or self._info is None or self.run_dir is None:
            return
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        self._metrics.close()
        self._metrics = None
        self._info.status, self._info.end_time = status, time.time()
        self._write_atomic(self.run_dir / "run.json", self._encoder.encode(self._info))

    @staticmethod
    def _write_atomic(path: Path, data: Any) -> None:
        with atomic_path(path, path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")) as tmp:
            tmp.write_bytes(data)
