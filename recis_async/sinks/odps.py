"""OdpsSink: trace batches uploaded to a MaxCompute (ODPS) table through pyodps's table tunnel.

pyodps is imported lazily, and its client is built in the worker thread that first opens
the sink (``ODPS(..., overwrite_global=False)``: no process-wide default entry is set).
Opening creates the table (declared fields and types, partition keys as ``string``) and the
partition when missing, and checks an existing table's columns against the declaration.

Each batch is one upload session: a fresh session, one Arrow block with an explicit block
id, then a commit -- so every retry starts from a new session (pyodps would otherwise keep
writing to a session the server may have dropped).  When a commit fails, the session's
status is read back at once: CLOSED means the commit was applied and its response was lost,
so the batch is delivered and nothing is sent again; if the status cannot be read, the
session id stays in doubt and is settled the same way before the next attempt (or when a
spill file is replayed).

Credentials come from ``config`` or the ``ALIBABA_CLOUD_ACCESS_KEY_ID`` /
``ALIBABA_CLOUD_ACCESS_KEY_SECRET`` environment variables.  They appear in no repr, log
line or exception: messages of wrapped pyodps errors are scrubbed and never chained.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import crc32c
import pyarrow as pa

from ..buffer import Batch
from ..schema import OdpsType
from .base import Attempt, SinkError, parse_partition

__all__ = ["OdpsSink"]

logger = logging.getLogger(__name__)

ENV_ACCESS_ID = "ALIBABA_CLOUD_ACCESS_KEY_ID"
ENV_ACCESS_KEY = "ALIBABA_CLOUD_ACCESS_KEY_SECRET"
_REQUIRED = ("project", "end_point", "table_name")
_KNOWN = frozenset(("access_id", "access_key", "partition", "tunnel_endpoint") + _REQUIRED)
_TRANSIENT_STATUS = frozenset({408, 429})
_BLOCK_ID = 0


class _Credentials:
    """An access key pair that never prints itself."""

    __slots__ = ("access_id", "_secret")

    def __init__(self, access_id: str, secret: str) -> None:
        self.access_id = access_id
        self._secret = secret

    def reveal(self) -> str:
        return self._secret

    def scrub(self, text: str) -> str:
        for value in (self._secret, self.access_id):
            if value:
                text = text.replace(value, "***")
        return text

    def __repr__(self) -> str:
        return "<credentials redacted>"

    def __reduce__(self) -> Any:
        raise TypeError("credentials are not picklable")


def _config_str(config: Mapping[str, Any], key: str) -> str | None:
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        shown = "<redacted>" if key in ("access_id", "access_key") else repr(value)
        raise ValueError(f"config[{key!r}]: expected a non-empty string, got {shown}")
    return value.strip()


class OdpsSink:
    """Upload batches to ``config["table_name"]`` in ``config["project"]``.

    ``config`` keys (as in RecIS): ``access_id``, ``access_key``, ``project``,
    ``end_point``, ``table_name``; optional ``partition`` (``"dt=20261122"`` or
    ``"dt=20261122,hour=10"``) and ``tunnel_endpoint``.  Missing or malformed keys raise
    ``ValueError`` here, not in a worker.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        if not isinstance(config, Mapping):
            raise ValueError(f"config: expected a mapping, got {type(config).__name__}")
        unknown = sorted(str(k) for k in config if k not in _KNOWN)
        if unknown:
            raise ValueError(
                f"config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"expected {', '.join(sorted(_KNOWN))}"
            )
        missing = [k for k in _REQUIRED if _config_str(config, k) is None]
        access_id = _config_str(config, "access_id") or os.environ.get(ENV_ACCESS_ID, "").strip()
        secret = _config_str(config, "access_key") or os.environ.get(ENV_ACCESS_KEY, "").strip()
        if not access_id:
            missing.append(f"access_id (or the {ENV_ACCESS_ID} environment variable)")
        if not secret:
            missing.append(f"access_key (or the {ENV_ACCESS_KEY} environment variable)")
        if missing:
            raise ValueError(f"config: missing required key(s): {', '.join(missing)}")
        self._credentials = _Credentials(access_id, secret)
        self._project = str(config["project"]).strip()
        self._table = str(config["table_name"]).strip()
        self._endpoint = str(config["end_point"]).strip()
        self._tunnel_endpoint = _config_str(config, "tunnel_endpoint")
        for key, url in (("end_point", self._endpoint), ("tunnel_endpoint", self._tunnel_endpoint)):
            if url is not None and (
                urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc
            ):
                raise ValueError(f"config[{key!r}]: expected an http(s) URL, got {url!r}")
        self._partition = parse_partition(config.get("partition"))
        self._lock = threading.Lock()
        self._odps: Any = None
        self._tunnel: Any = None

    @property
    def name(self) -> str:
        where = f"{self._project}.{self._table}"
        if self._partition:
            where += "/" + ",".join(f"{k}={v}" for k, v in self._partition)
        return f"odps:{where}"

    @property
    def location(self) -> str:
        """Where the rows go, for a person: project, table and partition (no credentials)."""
        where = f"ODPS table {self._project}.{self._table}"
        spec = self.partition_spec
        return f"{where}, partition {spec}" if spec else where

    @property
    def partition_spec(self) -> str | None:
        return ",".join(f"{k}={v}" for k, v in self._partition) or None

    def __repr__(self) -> str:
        return (
            f"OdpsSink(project={self._project!r}, table_name={self._table!r}, "
            f"end_point={self._endpoint!r}, partition={self.partition_spec!r})"
        )

    # ------------------------------------------------------------------------------------

    def open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        """Build the client, create the table and partition if missing, check the schema."""
        try:
            self._open(fields, types)
        except SinkError:
            raise
        except Exception as exc:
            raise self._wrap(exc, "cannot open") from None

    def _open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        from odps import ODPS
        from odps.models import TableSchema
        from odps.tunnel import TableTunnel

        with self._lock:
            if self._odps is None:
                self._odps = ODPS(
                    self._credentials.access_id,
                    self._credentials.reveal(),
                    project=self._project,
                    endpoint=self._endpoint,
                    tunnel_endpoint=self._tunnel_endpoint,
                    overwrite_global=False,
                )
            odps = self._odps
        part_keys = [k for k, _ in self._partition]
        if not odps.exist_table(self._table):
            schema = TableSchema.from_lists(
                list(fields),
                [t.name for t in types],
                part_keys or None,
                ["string"] * len(part_keys) or None,
            )
            odps.create_table(self._table, schema, if_not_exists=True)
            logger.info("%s: created table", self.name)
        table = odps.get_table(self._table)
        table.reload()
        self._check_schema(table.table_schema, fields, types, part_keys)
        spec = self.partition_spec
        if spec is not None and not table.exist_partition(spec):
            table.create_partition(spec, if_not_exists=True)
            logger.info("%s: created partition", self.name)
        with self._lock:
            if self._tunnel is None:
                self._tunnel = TableTunnel(odps, endpoint=self._tunnel_endpoint)

    def _check_schema(
        self,
        schema: Any,
        fields: tuple[str, ...],
        types: tuple[OdpsType, ...],
        part_keys: list[str],
    ) -> None:
        have = [
            (c.name.lower(), str(c.type).lower().replace(" ", "")) for c in schema.simple_columns
        ]
        want = [(f.lower(), t.name) for f, t in zip(fields, types, strict=True)]
        if have != want:
            raise SinkError(
                f"{self.name}: the existing table has columns "
                f"{', '.join(f'{n} {t}' for n, t in have)}; "
                f"expected {', '.join(f'{n} {t}' for n, t in want)}",
                transient=False,
            )
        have_parts = [p.name.lower() for p in schema.partitions]
        if have_parts != [k.lower() for k in part_keys]:
            raise SinkError(
                f"{self.name}: the existing table is partitioned by {have_parts or 'nothing'}; "
                f"the configured partition has keys {part_keys or 'none'}",
                transient=False,
            )

    # ------------------------------------------------------------------------------------

    def write(self, batch: Batch, attempt: Attempt) -> None:
        """Upload ``batch`` in a fresh session (one block) and commit it."""
        tunnel = self._tunnel
        if tunnel is None:
            raise SinkError(f"{self.name}: write before open", transient=False)
        if attempt.token is not None:
            if self._settle(attempt.token, batch):
                return
            attempt.resolve()
        table = batch.to_arrow()
        # pyodps's arrow schema has nullable fields; matching it keeps its writer on the
        # fast path (no per-batch casting)
        table = table.cast(pa.schema([f.with_nullable(True) for f in table.schema]))
        try:
            session = tunnel.create_upload_session(
                self._table,
                partition_spec=self.partition_spec,
                create_partition=bool(self._partition),
            )
            writer = session.open_arrow_writer(_BLOCK_ID)
            _use_hardware_crc(writer)
            try:
                for record_batch in table.to_batches():
                    writer.write(record_batch)
                    # pyodps checksums each chunk holding the GIL; hand it back between
                    # record batches so the training thread is not stalled behind a block
                    time.sleep(0)
            finally:
                writer.close()  # ends the streamed PUT even when write() raised
        except Exception as exc:
            # an uncommitted session is invisible: nothing of this batch was delivered
            raise self._wrap(exc, f"cannot upload batch {batch.seq}") from None
        if not attempt.commit(session.id):
            raise SinkError(
                f"{self.name}: batch {batch.seq} abandoned by the writer", transient=False
            )
        try:
            session.commit([_BLOCK_ID])
        except Exception as exc:
            failure = self._wrap(
                exc, f"cannot commit batch {batch.seq} (upload session {session.id})"
            )
            try:
                delivered = self._settle(session.id, batch)
            except SinkError as check:
                raise SinkError(
                    f"{failure}; its outcome is unknown: {check}", transient=True
                ) from None
            if delivered:
                return
            attempt.resolve()
            raise failure from None
        logger.debug(
            "%s: batch %d (%d rows) committed in %s", self.name, batch.seq, batch.rows, session.id
        )

    def _settle(self, upload_id: str, batch: Batch) -> bool:
        """Whether the upload session ``upload_id`` was committed (True) or never will be."""
        from odps.tunnel import TableUploadSession

        try:
            session = self._tunnel.create_upload_session(
                self._table, partition_spec=self.partition_spec, upload_id=upload_id
            )
            status = session.status
        except Exception as exc:
            raise self._wrap(exc, f"cannot read the status of upload session {upload_id}") from None
        if status == TableUploadSession.Status.Closed:
            logger.info(
                "%s: batch %d was committed by session %s (the response had been lost)",
                self.name,
                batch.seq,
                upload_id,
            )
            return True
        if status in (TableUploadSession.Status.Closing, TableUploadSession.Status.Unknown):
            raise SinkError(
                f"{self.name}: upload session {upload_id} is {status.value}; "
                "its commit outcome is not known yet",
                transient=True,
            )
        return False  # NORMAL (never committed, and nothing will commit it), EXPIRED, CANCELED, ...

    def close(self) -> None:
        with self._lock:
            self._tunnel = None
            self._odps = None

    # ------------------------------------------------------------------------------------

    def _wrap(self, exc: BaseException, what: str) -> SinkError:
        """A scrubbed, unchained :class:`SinkError` classified as transient or permanent."""
        detail = " ".join(str(exc).split())  # pyodps messages span lines
        message = self._credentials.scrub(f"{self.name}: {what}: {type(exc).__name__}: {detail}")
        return SinkError(message, transient=_is_transient(exc))


class _Crc32c:
    """pyodps's checksum interface (``update`` / ``getvalue`` / ``reset``) computed by the
    ``crc32c`` package: with the CPU's CRC instruction and the GIL released.  pyodps's own
    runs in software holding the GIL, two passes over every uploaded byte: ~0.3 s of GIL a
    50 MiB batch, during which the training thread waits at each of its torch calls."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes) -> None:
        self._value = crc32c.crc32c(data, self._value)

    def getvalue(self) -> int:
        return self._value

    def reset(self) -> None:
        self._value = 0


def _use_hardware_crc(writer: Any) -> None:
    """Give a fresh pyodps Arrow block writer :class:`_Crc32c` checksums (same values).

    pyodps keeps them in ``_crc`` (each chunk) and ``_crccrc`` (the whole block); a pyodps
    without them keeps its own, which is correct, only slower
    (``tests/test_odps_sink.py`` checks that the swap happens with the pinned pyodps)."""
    if hasattr(writer, "_crc") and hasattr(writer, "_crccrc"):
        writer._crc, writer._crccrc = _Crc32c(), _Crc32c()


def _is_transient(exc: BaseException) -> bool:
    import requests
    from odps import errors

    if isinstance(exc, SinkError):
        return exc.transient
    status = getattr(exc, "status_code", None)
    if isinstance(exc, errors.BaseODPSError) and status is not None:
        return status >= 500 or status in _TRANSIENT_STATUS
    if isinstance(exc, (requests.RequestException, ConnectionError, TimeoutError, OSError)):
        return True
    # pyodps's own tunnel errors without an HTTP status (block list mismatch, stream
    # truncated, ...) concern only this session; a fresh session may succeed
    return isinstance(exc, errors.BaseODPSError)
