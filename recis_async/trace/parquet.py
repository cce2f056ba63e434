"""ParquetSink: trace batches as Parquet files in ODPS-like partition folders.

Layout: ``root/table/k=v[/k2=v2]/part-<rank>-<seq>.parquet`` (Hive-style folders, so
``pyarrow.dataset`` and ``pandas.read_parquet`` restore the partition keys as columns).
Each batch is one file.  It is written under a temporary dot-name (ignored by readers),
flushed to disk, then published under its final name with a no-replace link, so a reader
never sees half a file and a file already in the folder is never overwritten: ``<seq>``
continues after the highest part number this rank already has there.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .. import dist
from .._checks import boolean, dir_path, non_negative_int, one_of, positive_int
from .._files import fsync_path
from ..errors import SinkError
from .base import Attempt, parse_partition
from .buffer import Batch
from .schema import OdpsType

__all__ = ["ParquetSink"]

logger = logging.getLogger(__name__)

#: the bytes of a batch encoded as one row group (see ``row_group_size``)
_ROW_GROUP_BYTES = 8 << 20
_CODECS = ("snappy", "zstd", "lz4", "gzip", "brotli", "none")

_PERMANENT_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENAMETOOLONG,
        errno.EEXIST,  # a file where the table folder should be (mkdir)
    }
)


class ParquetSink:
    """Write each batch as one Parquet file under ``root/table/<partition folders>``.

    Args:
        root: the dataset's root directory.
        table: the table's folder under ``root``.
        partition: ``"dt=20261122"``, ``"dt=20261122,hour=10"`` or a mapping; folders
            ``dt=.../hour=...`` as Hive and pyarrow datasets read them.
        rank: the number in file names; by default :func:`recis_async.dist.get_rank` when
            the sink opens.
        compression: the codec, one of ``"snappy"``, ``"zstd"``, ``"lz4"``, ``"gzip"``,
            ``"brotli"`` or ``"none"`` (or ``None``), as :class:`pyarrow.parquet.ParquetWriter`
            names them.
        use_dictionary: dictionary-encode columns; off by default: it favours throughput and
            keeps the writer's encoding buffers small.
        row_group_size: rows per row group.  By default a batch is written in row groups of
            about 8 MiB, so Arrow's encoding buffers stay that size whatever
            ``size_threshold`` is: encoding a 50 MiB batch at once took buffers as large,
            freshly mapped for every batch, which cost a ~3 ms training step 5-6 %
            (benchmarks/README.md, "Parquet row groups").
        fsync: flush each file and its folder to disk before counting it as delivered.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a ``table`` name that is not a plain name, a malformed ``partition``, a
            negative ``rank``, an unknown or unavailable ``compression``, a non-positive
            ``row_group_size``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        table: str,
        partition: str | Mapping[str, object] | None = None,
        *,
        rank: int | None = None,
        compression: str | None = "snappy",
        use_dictionary: bool = False,
        row_group_size: int | None = None,
        fsync: bool = True,
    ) -> None:
        if not isinstance(table, str):
            raise TypeError(f"ParquetSink(table=...): expected a str, got {table!r}")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", table):
            raise ValueError(
                "ParquetSink(table=...): expected a name of letters, digits, '_', '-' or '.', "
                f"got {table!r}"
            )
        if rank is not None:
            non_negative_int("ParquetSink", "rank", rank)
        self._root = Path(dir_path("ParquetSink", "root", root))  # proven writable by open()
        self._table = table
        self._partition = parse_partition(partition)
        self._rank = rank
        self._write_options: dict[str, Any] = {
            "compression": _codec(compression),
            "use_dictionary": boolean("ParquetSink", "use_dictionary", use_dictionary),
        }
        self._row_group_size = (
            None
            if row_group_size is None
            else positive_int("ParquetSink", "row_group_size", row_group_size)
        )
        self._fsync = boolean("ParquetSink", "fsync", fsync)
        self._lock = threading.Lock()
        self._next_seq = 0
        self._opened_rank: int | None = None

    @property
    def root(self) -> Path:
        """The dataset's root directory (the writer warns when its spill folder shares the
        file system: a full disk then fails both)."""
        return self._root

    @property
    def directory(self) -> Path:
        """The folder the part files go to."""
        return self._root.joinpath(self._table, *(f"{k}={v}" for k, v in self._partition))

    @property
    def name(self) -> str:
        return f"parquet:{self.directory}"

    @property
    def location(self) -> str:
        """Where the rows go, for a person: the part files' absolute folder."""
        return str(self.directory.absolute())

    def __repr__(self) -> str:
        return f"ParquetSink({str(self._root)!r}, {self._table!r}, partition={self._partition!r})"

    def check_fields(self, fields: tuple[str, ...] | list[str], owner: str = "ParquetSink") -> None:
        """Refuse a field named like a partition key: readers restore the key as a column,
        so the dataset would hold two columns of one name and could not be read."""
        keys = {k.lower(): k for k, _ in self._partition}
        for field in fields:
            key = keys.get(str(field).lower())
            if key is not None:
                raise ValueError(
                    f"{owner}(fields=...): field {field!r} is also a partition key ({key!r}) of "
                    f"table {self._table!r} in {self._root}; readers restore partition keys as "
                    "columns, so rename the field or the key"
                )

    def open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        self.check_fields(fields)
        rank = dist.get_rank() if self._rank is None else self._rank
        directory = self.directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            names = os.listdir(directory)
            pattern = re.compile(rf"part-{rank}-(\d+)\.parquet\Z")
            taken = [int(m.group(1)) for p in names if (m := pattern.match(p))]
            # An existing folder the process cannot write (permissions, a read-only mount) is
            # found here, when the bus starts, not at the first batch minutes later.  A probe
            # whose removal failed, or whose process was killed between these two lines, is
            # removed by this rank's next open (_remove_leftovers); that sweep may take this
            # one too (another sink of this rank on this folder), hence missing_ok.
            probe = directory / f".probe-{rank}-{uuid.uuid4().hex}.tmp"
            probe.touch(exist_ok=False)
            probe.unlink(missing_ok=True)
        except OSError as exc:
            raise self._error(exc, f"cannot prepare {directory}") from None
        self._remove_leftovers(directory, names, rank)
        with self._lock:
            self._opened_rank = rank
            self._next_seq = max(taken, default=-1) + 1

    def delivered_steps(self, run: str) -> list[tuple[int, int]]:
        """The step ranges of ``run`` this rank's part files hold (from their footers: each
        file written for a batch of a run records its run and first and last step)."""
        rank = self._opened_rank
        if rank is None:
            raise SinkError(f"{self.name}: delivered_steps before open", transient=False)
        pattern = re.compile(rf"part-{rank}-\d+\.parquet\Z")
        found = []
        for name in os.listdir(self.directory):
            if not pattern.match(name):
                continue
            meta = pq.read_schema(self.directory / name).metadata or {}
            if meta.get(_RUN_KEY, b"").decode() == run and _STEPS_KEY in meta:
                first, _, last = meta[_STEPS_KEY].decode().partition("-")
                found.append((int(first), int(last)))
        return sorted(found)

    def write(self, batch: Batch, attempt: Attempt) -> None:
        """Write ``batch`` as one new part file (the in-doubt token is its final path)."""
        rank = self._opened_rank
        if rank is None:
            raise SinkError(f"{self.name}: write before open", transient=False)
        if attempt.token is not None:
            if _published(attempt.token):
                logger.info(
                    "%s: batch %d already published (%s)", self.name, batch.seq, attempt.token
                )
                return
            attempt.resolve()
        directory = self.directory
        tmp = directory / f".part-{rank}-{uuid.uuid4().hex}.parquet.tmp"
        try:
            try:
                table = batch.to_arrow()
                if batch.run is not None and batch.steps is not None:
                    table = table.replace_schema_metadata(_steps_metadata(batch.run, batch.steps))
                rows = self._row_group_size or _rows_per_group(batch)
                with pq.ParquetWriter(str(tmp), table.schema, **self._write_options) as writer:
                    for start in range(0, table.num_rows, rows):
                        writer.write_table(table.slice(start, rows), row_group_size=rows)
                # Arrow's allocator keeps freed encoding buffers cached; hand them back so
                # RSS tracks the buffered data
                pa.default_memory_pool().release_unused()
                if self._fsync:
                    fsync_path(tmp)
                final = self._publish(tmp, rank, attempt)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise self._error(exc, f"cannot write batch {batch.seq}") from None
        except (pa.ArrowException, ValueError, TypeError) as exc:
            raise SinkError(
                f"{self.name}: cannot write batch {batch.seq}: {exc}", transient=False
            ) from None
        if self._fsync:
            try:
                fsync_path(directory)
            except OSError as exc:  # the file is visible already; durability is best effort
                logger.warning(
                    "%s: fsync of %s failed after publishing: %s", self.name, directory, exc
                )
        logger.debug("%s: batch %d (%d rows) -> %s", self.name, batch.seq, batch.rows, final.name)

    def close(self) -> None:
        """Nothing to release: every write is complete when it returns."""

    def _remove_leftovers(self, directory: Path, names: list[str], rank: int) -> None:
        """Remove this rank's temporary files left by a run killed mid-write (``kill -9``):
        never published, so no reader counts them, but they hold disk space; and the
        writability probes of an open killed before it removed its probe (a daemon thread
        ended by the process's exit) or whose removal failed.  Named in the log; one that
        cannot be removed is named too."""
        leftovers = ((f".part-{rank}-", ".parquet.tmp"), (f".probe-{rank}-", ".tmp"))
        removed, kept = [], []
        for name in names:
            if any(name.startswith(p) and name.endswith(s) for p, s in leftovers):
                try:
                    (directory / name).unlink()
                    removed.append(name)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    kept.append(f"{name} ({exc.strerror})")
        if removed:
            logger.warning(
                "%s: removed %d temporary file(s) left by an interrupted run: %s",
                self.name,
                len(removed),
                ", ".join(removed[:10]) + (" ..." if len(removed) > 10 else ""),
            )
        if kept:
            logger.warning(
                "%s: cannot remove temporary file(s) left by an interrupted run: %s",
                self.name,
                ", ".join(kept),
            )

    def _publish(self, tmp: Path, rank: int, attempt: Attempt) -> Path:
        """Give ``tmp`` the next free final name without ever replacing a file.

        The in-doubt token names the final path and the temporary file's inode, so only a
        file that is this very one counts as published when the doubt is settled.
        """
        inode = os.stat(tmp).st_ino
        with self._lock:
            while True:
                final = tmp.parent / f"part-{rank}-{self._next_seq}.parquet"
                self._next_seq += 1
                if not attempt.commit(f"{final}{_INODE_SEP}{inode}"):
                    attempt.resolve()
                    raise SinkError(f"{self.name}: write abandoned by the writer", transient=False)
                try:
                    os.link(tmp, final)
                    return final
                except FileExistsError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                        attempt.resolve()
                        raise
                # no hard links on this file system: check-then-rename under our lock
                if final.exists():
                    continue
                try:
                    os.rename(tmp, final)
                except OSError:
                    attempt.resolve()
                    raise
                return final

    def _error(self, exc: OSError, what: str) -> SinkError:
        transient = exc.errno not in _PERMANENT_ERRNOS
        return SinkError(f"{self.name}: {what}: {exc}", transient=transient)


_INODE_SEP = "#inode="


def _published(token: str) -> bool:
    """Whether the file named by an in-doubt token exists and is the one we linked."""
    path, _, inode = token.rpartition(_INODE_SEP)
    try:
        return path != "" and os.stat(path).st_ino == int(inode)
    except (OSError, ValueError):
        return False


def _codec(compression: object) -> str:
    """``compression`` if pyarrow can write it (checked here, not at the first write);
    ``None`` is ``"none"``, as for pyarrow."""
    if compression is None:
        return "none"
    if not isinstance(compression, str):
        raise TypeError(f"ParquetSink(compression=...): expected a str, got {compression!r}")
    name = one_of("ParquetSink", "compression", compression.lower(), _CODECS)
    if name != "none" and not pa.Codec.is_available(name):
        raise ValueError(
            f"ParquetSink(compression=...): {compression!r} is not available in this pyarrow build"
        )
    return name


def _rows_per_group(batch: Batch) -> int:
    """Rows of ``batch`` that hold about :data:`_ROW_GROUP_BYTES`."""
    return max(1, batch.rows * _ROW_GROUP_BYTES // max(batch.nbytes, 1))


_RUN_KEY, _STEPS_KEY = b"recis_async.run", b"recis_async.steps"


def _steps_metadata(run: str, steps: tuple[int, int]) -> dict[bytes, bytes]:
    """A part file's footer metadata naming the run and the steps whose rows it holds."""
    return {_RUN_KEY: run.encode(), _STEPS_KEY: f"{steps[0]}-{steps[1]}".encode()}
