"""Spill files: trace batches a writer could not deliver, kept on local disk for replay.

Format, version 1 -- an Arrow IPC *stream* (``pyarrow.ipc``; suffix ``.arrows``):

* The schema has one field per trace field, typed as in :mod:`recis_async.trace.schema`.
  Schema metadata (UTF-8): ``recis_async.spill`` = ``"1"``; ``fields`` and ``types`` = JSON
  lists of the declared names and ODPS type names; ``sink`` = the sink's description;
  ``reason`` = why the batches were spilled; ``created`` = ISO-8601 UTC time.
* One record batch per trace batch, in ``seq`` order, with custom metadata ``seq``,
  ``rows``, optionally ``steps`` (``"first-last"`` global steps whose rows it holds), ``run``
  (the traced run's id) and
  ``in_doubt``: empty, or the token of a delivery attempt whose outcome was
  unknown (an ODPS upload session id; a Parquet path and inode).  A batch in doubt is settled
  by the sink before it is sent again, so replaying never duplicates it.

No credentials are written: sink descriptions never contain them.

:func:`replay_spill` keeps a journal next to the file (``<file>.journal``, JSON lines:
``{"seq": n, "token": t}`` before each commit, ``{"seq": n, "done": true}`` after), so an
interrupted replay can be run again without duplicating or losing a batch.  When every batch
is delivered both files are removed.

From a shell: ``python -m recis_async.spill inspect FILE`` and
``python -m recis_async.spill replay FILE --parquet ROOT`` (or ``--odps-config cfg.json``);
see :mod:`recis_async.spill.__main__`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..._files import atomic_path
from ..base import Attempt, Sink
from ..buffer import Batch

__all__ = [
    "ReplayReport",
    "SpillEntry",
    "SpillFile",
    "journal_path",
    "read_journal",
    "read_spill",
    "replay_spill",
    "write_spill",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = "1"
SUFFIX = ".arrows"


@dataclass(frozen=True)
class SpillEntry:
    batch: Batch
    in_doubt: str | None


@dataclass(frozen=True)
class SpillFile:
    path: Path
    fields: tuple[str, ...]
    types: tuple[str, ...]
    sink: str
    reason: str
    created: str
    entries: tuple[SpillEntry, ...]

    @property
    def rows(self) -> int:
        return sum(e.batch.rows for e in self.entries)


@dataclass(frozen=True)
class ReplayReport:
    """What :func:`replay_spill` did: ``delivered`` batches (``rows`` rows) sent now;
    ``present`` batches found already in the sink (an earlier attempt in doubt had in fact
    committed them: not sent again); ``skipped`` ones an earlier replay had finished."""

    delivered: int
    skipped: int
    rows: int
    present: int = 0


def write_spill(
    directory: str | os.PathLike[str],
    entries: Sequence[SpillEntry],
    *,
    sink_name: str,
    reason: str,
    prefix: str = "trace",
) -> Path:
    """Write ``entries`` (all of one schema) to a new spill file in ``directory``; blocking.

    The file appears under its final name only once complete and flushed to disk.
    """
    if not entries:
        raise ValueError("write_spill: expected at least one batch, got none")
    first = entries[0].batch
    schema = first.schema.with_metadata(
        {
            "recis_async.spill": FORMAT_VERSION,
            "fields": json.dumps(list(first.fields)),
            "types": json.dumps([t.name for t in first.types]),
            "sink": sink_name,
            "reason": reason,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    )
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", prefix)[:60]
    name = f"{slug}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}{SUFFIX}"
    final = folder / name
    with (
        atomic_path(final, folder / f".{name}.tmp") as tmp,
        pa.OSFile(str(tmp), "wb") as sink,
        pa.ipc.new_stream(sink, schema) as writer,
    ):
        for entry in entries:
            batch = entry.batch
            if batch.fields != first.fields or batch.types != first.types:
                raise ValueError("write_spill: every batch must have the same fields and types")
            table = batch.to_arrow().combine_chunks()
            record = table.to_batches()[0] if table.num_rows else None
            if record is None:
                continue
            writer.write_batch(
                record.replace_schema_metadata(None),
                custom_metadata={
                    "seq": str(batch.seq),
                    "rows": str(batch.rows),
                    "in_doubt": entry.in_doubt or "",
                    **({"steps": f"{batch.steps[0]}-{batch.steps[1]}"} if batch.steps else {}),
                    **({"run": batch.run} if batch.run else {}),
                },
            )
    return final


def read_spill(path: str | os.PathLike[str]) -> SpillFile:
    """Load a spill file written by :func:`write_spill`."""
    path = Path(path)
    with pa.OSFile(str(path), "rb") as source:
        reader = pa.ipc.open_stream(source)
        meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
        if meta.get("recis_async.spill") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: expected a recis_async spill file (format {FORMAT_VERSION}), "
                f"got metadata {sorted(meta)}"
            )
        fields = tuple(json.loads(meta["fields"]))
        types = tuple(json.loads(meta["types"]))
        entries = []
        while True:
            try:
                record, custom = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                break
            info = {k.decode(): v.decode() for k, v in (custom or {}).items()}
            steps = info.get("steps")
            first, _, last = (steps or "").rpartition("-")
            batch = Batch.from_arrow(
                pa.Table.from_batches([record]),
                seq=int(info["seq"]),
                fields=fields,
                types=types,
                steps=(int(first), int(last)) if steps else None,
                run=info.get("run") or None,
            )
            if batch.rows != int(info["rows"]):
                raise ValueError(
                    f"{path}: batch {batch.seq} has {batch.rows} rows, header says {info['rows']}"
                )
            entries.append(SpillEntry(batch, info.get("in_doubt") or None))
    return SpillFile(
        path=path,
        fields=fields,
        types=types,
        sink=meta.get("sink", ""),
        reason=meta.get("reason", ""),
        created=meta.get("created", ""),
        entries=tuple(entries),
    )


class _JournaledAttempt(Attempt):
    """An attempt that records its commit token durably before the commit runs."""

    __slots__ = ("_journal", "_seq")

    def __init__(self, journal: Path, seq: int, in_doubt: str | None) -> None:
        super().__init__(in_doubt)
        self._journal = journal
        self._seq = seq

    def commit(self, token: str) -> bool:
        _append(self._journal, {"seq": self._seq, "token": token})
        return super().commit(token)


def replay_spill(path: str | os.PathLike[str], sink: Sink) -> ReplayReport:
    """Deliver every batch of a spill file to ``sink`` exactly once; blocking.

    Batches left in doubt (by the writer, or by an interrupted earlier replay) are settled by
    the sink first.  Raises what the sink raises; run it again later to continue.  On success
    the spill file and its journal are removed.
    """
    spill = read_spill(path)
    journal = journal_path(spill.path)
    done, tokens = read_journal(spill.path)
    delivered = skipped = present = rows = 0
    first = spill.entries[0].batch if spill.entries else None
    if first is not None:
        sink.open(first.fields, first.types)
    try:
        for entry in spill.entries:
            seq = entry.batch.seq
            if seq in done:
                skipped += 1
                continue
            attempt = _JournaledAttempt(journal, seq, tokens.get(seq, entry.in_doubt))
            sink.write(entry.batch, attempt)
            _append(journal, {"seq": seq, "done": True})
            if attempt.settled_present:
                present += 1
            else:
                delivered += 1
                rows += entry.batch.rows
    finally:
        sink.close()
    logger.info(
        "replayed %s into %s: %d batches (%d rows) delivered, %d already present, "
        "%d by an earlier replay",
        spill.path,
        sink.name,
        delivered,
        rows,
        present,
        skipped,
    )
    spill.path.unlink()
    journal.unlink(missing_ok=True)
    return ReplayReport(delivered=delivered, skipped=skipped, rows=rows, present=present)


def journal_path(path: str | os.PathLike[str]) -> Path:
    """Where :func:`replay_spill` records its progress on the spill file ``path``."""
    path = Path(path)
    return path.with_name(path.name + ".journal")


def read_journal(path: str | os.PathLike[str]) -> tuple[set[int], dict[int, str]]:
    """The progress of earlier replays of the spill file ``path``: the ``seq`` of every batch
    delivered, and the in-doubt token of each batch whose commit may have run since."""
    done: set[int] = set()
    tokens: dict[int, str] = {}
    journal = journal_path(path)
    if journal.exists():
        for line in journal.read_text().splitlines():
            if not line.strip():
                continue
            record: dict[str, Any] = json.loads(line)
            if record.get("done"):
                done.add(int(record["seq"]))
            elif record.get("token"):
                tokens[int(record["seq"])] = str(record["token"])
    return done, tokens


def _append(journal: Path, record: dict[str, Any]) -> None:
    with open(journal, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
