"""JsonlTracker: the embedded default tracker, a run folder of plain JSON files.

Layout of a run: ``<root>/<project>/<run_id>/``

- ``params.json``   the run's config (as given, JSON-encoded)
- ``run.json``      project, name, run_id, status, start and end times
- ``metrics.jsonl`` one :class:`~recis_async.trackers.StepRecord` per line
  (``{"step": .., "time": .., "values": {...}}``; arrays are lists, NaN is ``null``)

Passing an existing ``run_id`` resumes that run: metrics are appended, params replaced.  A
resumed run that logs again from step ``s`` (a job restored from an earlier checkpoint)
first drops the earlier attempt's records of steps ``>= s``, so each step is in the file
once, as the attempt that continues logged it (TensorBoard's ``purge_step``).

A batch is written whole or not at all: a write that fails midway (a full disk) is cut back
to the last whole line before the error is raised, so the caller may keep the batch
elsewhere without doubling a record.  :func:`read_records` skips a torn last line (a crash
mid-write) with a warning.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from .._checks import creatable_dir
from .._files import atomic_path
from ..events import EndStatus
from .base import RunSpec, StepRecord, encode_value

__all__ = ["JsonlTracker", "RunInfo", "read_records"]

logger = logging.getLogger(__name__)

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
    """Read a ``metrics.jsonl`` (or a tracker spill file) back into records.

    A torn last line (no newline: the writer died mid-write) is skipped with a warning; any
    other line that does not decode raises."""
    decoder = msgspec.json.Decoder(StepRecord)
    with open(path, "rb") as fh:
        data = fh.read()
    whole, _, torn = data.rpartition(b"\n") if not data.endswith(b"\n") else (data, b"", b"")
    if torn.strip():
        logger.warning(
            "read_records: %s ends with a torn line of %d bytes (a write cut short); skipped",
            os.fspath(path),
            len(torn),
        )
    records = []
    for number, line in enumerate(whole.split(b"\n"), 1):
        if line.strip():
            try:
                records.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise ValueError(
                    f"read_records: {os.fspath(path)} line {number}: expected a record, "
                    f"got {line[:60]!r} ({exc})"
                ) from None
    return records


def _whole_lines(path: Path) -> int:
    """The size of ``path`` without a torn last line (bytes after the last newline)."""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        pos = size
        while pos > 0:
            step = min(pos, 1 << 16)
            fh.seek(pos - step)
            chunk = fh.read(step)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                return pos - step + cut + 1
            pos -= step
        return 0


def write_whole(fd: int, data: bytes) -> None:
    """Append ``data`` (whole lines) to ``fd`` or, on failure, leave the file as it was:
    a partial write is truncated away before the error propagates.  Should the truncation
    fail too, the error carries ``delivered``: the whole lines of ``data`` that stayed."""
    start = os.lseek(fd, 0, os.SEEK_END)
    view = memoryview(data)
    done = 0
    try:
        while done < len(view):
            done += os.write(fd, view[done:])
    except OSError as exc:
        if done:
            try:
                os.ftruncate(fd, start)
            except OSError:
                kept = data.rfind(b"\n", 0, done) + 1
                exc.delivered = data.count(b"\n", 0, kept)  # type: ignore[attr-defined]
        raise


class JsonlTracker:
    """Write runs as JSON files under ``root``; needs nothing beyond msgspec.

    Args:
        root: the directory holding ``<project>/<run>/`` folders.
    """

    def __init__(self, root: str | os.PathLike[str] = "ml_tracker") -> None:
        root_path = Path(creatable_dir("JsonlTracker", "root", root))
        self.root = root_path
        self.run_dir: Path | None = None
        self.run_id: str | None = None
        self._info: RunInfo | None = None
        self._fd: int | None = None
        self._continued = False  # the run existed: its first log supersedes later steps
        self._created = False  # this start made the run folder
        self._logged = False
        self._encoder = msgspec.json.Encoder(enc_hook=encode_value)

    def __repr__(self) -> str:
        return f"JsonlTracker(root={str(self.root)!r})"

    def start(self, run: RunSpec) -> None:
        run_id = run.run_id or (
            f"{_safe(run.name)}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"
        )
        run_dir = self.root / _safe(run.project) / _safe(run_id)
        self._created = not run_dir.exists()
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
        metrics = run_dir / "metrics.jsonl"
        self._fd = os.open(metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._continued = os.fstat(self._fd).st_size > 0
        self._logged = False
        self.run_dir, self.run_id, self._info = run_dir, info.run_id, info

    def log(self, records: Sequence[StepRecord]) -> None:
        if self._fd is None or self.run_dir is None:
            raise RuntimeError("JsonlTracker.log: the run is not started")
        if not records:
            return
        if not self._logged:
            self._supersede(min(record.step for record in records))
        else:
            self._cut_torn_tail()
        buf = bytearray()
        for record in records:
            self._encoder.encode_into(record, buf, -1)
            buf += b"\n"
        write_whole(self._fd, bytes(buf))
        self._logged = True

    def _cut_torn_tail(self) -> None:
        """Remove a torn last line an earlier failed write could not cut back."""
        assert self._fd is not None and self.run_dir is not None
        path = self.run_dir / "metrics.jsonl"
        keep = _whole_lines(path)
        if keep != os.fstat(self._fd).st_size:
            os.ftruncate(self._fd, keep)

    def _supersede(self, first_step: int) -> None:
        """The first batch of a resumed run: drop the earlier attempt's records of steps
        ``>= first_step`` (and a torn last line), so each step is stored once."""
        assert self._fd is not None and self.run_dir is not None
        if not self._continued:
            return
        path = self.run_dir / "metrics.jsonl"
        records = read_records(path)
        kept = [record for record in records if record.step < first_step]
        if len(kept) == len(records) and _whole_lines(path) == os.fstat(self._fd).st_size:
            return
        logger.info(
            "JsonlTracker: run %s continues at step %d; %d records of steps >= %d from an "
            "earlier attempt are replaced",
            self.run_id,
            first_step,
            len(records) - len(kept),
            first_step,
        )
        buf = bytearray()
        for record in kept:
            self._encoder.encode_into(record, buf, -1)
            buf += b"\n"
        os.close(self._fd)
        self._fd = None
        self._write_atomic(path, bytes(buf))
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    def discard(self) -> None:
        """End the run just started without a trace if nothing was logged to it (a resumed
        job continues its checkpoint's run instead)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        run_dir, self.run_dir, self._info = self.run_dir, None, None
        if run_dir is not None and self._created and not self._logged:
            for name in ("metrics.jsonl", "params.json", "run.json"):
                (run_dir / name).unlink(missing_ok=True)
            try:
                run_dir.rmdir()
            except OSError:
                pass

    def finish(self, status: EndStatus) -> None:
        if self._fd is None or self._info is None or self.run_dir is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._info.status, self._info.end_time = status, time.time()
        self._write_atomic(self.run_dir / "run.json", self._encoder.encode(self._info))

    @staticmethod
    def _write_atomic(path: Path, data: Any) -> None:
        with atomic_path(path, path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")) as tmp:
            tmp.write_bytes(data)
