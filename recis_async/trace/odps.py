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
``ALIBABA_CLOUD_ACCESS_KEY_SECRET`` environment variables, each one token without
whitespace (a pasted newline is refused, not stripped); endpoints may not carry user info.
They appear in no repr, log line or exception: messages of wrapped pyodps errors are
scrubbed and never chained, and while a sink is open every record of pyodps's, urllib3's
and requests' loggers is redacted (:class:`_Redactor`) -- at any level, DEBUG included,
where pyodps logs its signed ``Authorization`` headers.

Opening connects within 2 s and without pyodps's own retries (pyodps ``options`` scoped to
the opening call, not set globally), so an unreachable endpoint is reported as soon as the
bus starts; the writer retries it with backoff.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import crc32c
import pyarrow as pa

from ..errors import SinkError
from .base import Attempt, parse_partition
from .buffer import Batch
from .schema import OdpsType

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


_SECRET_KEYS = ("access_id", "access_key")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_USERINFO = re.compile(r"\A([A-Za-z][A-Za-z0-9+.-]*://)?[^/?#]*@")
#: connection settings for the requests a sink makes while opening (pyodps reads them from its
#: options, scoped here to the opening call): a refused or unreachable endpoint fails within
#: ~2 s, and the writer -- not pyodps -- retries, logging each failure
_OPEN_OPTIONS = MappingProxyType({"connect_timeout": 2, "retry_times": 0})


@dataclass(frozen=True)
class _Config:
    """A checked sink config (credentials kept apart, in :class:`_Credentials`)."""

    project: str
    table: str
    endpoint: str
    tunnel_endpoint: str | None
    partition: tuple[tuple[str, str], ...]


def _check_config(config: Any) -> tuple[_Config, _Credentials]:
    """Check every key of a RecIS ``config``; raise ``ValueError`` naming the key, what was
    expected and what arrived (never a credential: those are described, not shown)."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config: expected a mapping, got {type(config).__name__}")
    unknown = sorted(str(k) for k in config if k not in _KNOWN)
    if unknown:
        raise ValueError(
            f"config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"expected {', '.join(sorted(_KNOWN))}"
        )
    missing = [k for k in _REQUIRED if config.get(k) is None]
    access_id = _credential(config, "access_id", ENV_ACCESS_ID)
    secret = _credential(config, "access_key", ENV_ACCESS_KEY)
    if access_id is None:
        missing.append(f"access_id (or the {ENV_ACCESS_ID} environment variable)")
    if secret is None:
        missing.append(f"access_key (or the {ENV_ACCESS_KEY} environment variable)")
    if missing:
        raise ValueError(f"config: missing required key(s): {', '.join(missing)}")
    assert access_id is not None and secret is not None
    project = _config_str(config, "project")
    table = _config_str(config, "table_name")
    for key, name in (("project", project), ("table_name", table)):
        if name is not None and not _IDENTIFIER.match(name):
            raise ValueError(
                f"config[{key!r}]: expected a name of letters, digits and underscores, got {name!r}"
            )
    endpoint = _endpoint(config, "end_point")
    assert project is not None and table is not None and endpoint is not None
    checked = _Config(
        project=project,
        table=table,
        endpoint=endpoint,
        tunnel_endpoint=_endpoint(config, "tunnel_endpoint"),
        partition=_partition(config.get("partition")),
    )
    return checked, _Credentials(access_id, secret)


def _partition(spec: Any) -> tuple[tuple[str, str], ...]:
    try:
        return parse_partition(spec)
    except ValueError as exc:
        raise ValueError(f"config['partition']: {str(exc).removeprefix('partition: ')}") from None


def _config_str(config: Mapping[str, Any], key: str) -> str | None:
    """``config[key]`` as a non-empty string without surrounding whitespace, or None."""
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        shown = "<redacted>" if key in _SECRET_KEYS else repr(value)
        raise ValueError(f"config[{key!r}]: expected a non-empty string, got {shown}")
    if value != value.strip():
        shown = "a value" if key in _SECRET_KEYS else repr(value)
        raise ValueError(
            f"config[{key!r}]: expected no leading or trailing whitespace, got {shown} "
            f"with {_whitespace(value)}"
        )
    return value


def _credential(config: Mapping[str, Any], key: str, env: str) -> str | None:
    """An access id or key from ``config`` or else ``env``: one token without whitespace or
    control characters (a trailing newline pasted with a key is refused, not stripped)."""
    value = _config_str(config, key)
    where = f"config[{key!r}]"
    if value is None:
        value = os.environ.get(env) or None
        where = f"the {env} environment variable"
        if value is not None and value != value.strip():
            raise ValueError(
                f"{where}: expected no leading or trailing whitespace, got a value with "
                f"{_whitespace(value)}"
            )
    if value is not None and any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(
            f"{where}: expected a key without whitespace or control characters, got a value "
            "containing some (not shown)"
        )
    return value


def _whitespace(value: str) -> str:
    ends = [("leading", value[: len(value) - len(value.lstrip())])]
    ends.append(("trailing", value[len(value.rstrip()) :]))
    return " and ".join(f"{side} {text!r}" for side, text in ends if text)


def _endpoint(config: Mapping[str, Any], key: str) -> str | None:
    """An http(s) URL without user info, query or fragment; shown with any user info masked."""
    url = _config_str(config, key)
    if url is None:
        return None
    parts = urlsplit(url)
    shown = _USERINFO.sub(lambda m: f"{m.group(1) or ''}***@", url)
    if "@" in parts.netloc or _USERINFO.match(url):
        raise ValueError(
            f"config[{key!r}]: expected an http(s) URL without user info (credentials go in "
            f"access_id / access_key), got {shown.split('?')[0]!r}"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"config[{key!r}]: expected an http(s) URL, got {shown!r}")
    if parts.query or parts.fragment:
        raise ValueError(
            f"config[{key!r}]: expected an http(s) URL without query or fragment, got "
            f"{parts.scheme}://{parts.netloc}{parts.path}?... (query not shown)"
        )
    return url


class OdpsSink:
    """Upload batches to ``config["table_name"]`` in ``config["project"]``.

    Args:
        config: as in RecIS: ``access_id``, ``access_key``, ``project``, ``end_point``,
            ``table_name``; optional ``partition`` (``"dt=20261122"`` or
            ``"dt=20261122,hour=10"``) and ``tunnel_endpoint``.  Credentials may come from
            ``ALIBABA_CLOUD_ACCESS_KEY_ID`` / ``ALIBABA_CLOUD_ACCESS_KEY_SECRET`` instead.

    Raises:
        ValueError: a missing, unknown or malformed key -- here, not in a worker; the
            message never contains a credential.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        checked, self._credentials = _check_config(config)
        self._project = checked.project
        self._table = checked.table
        self._endpoint = checked.endpoint
        self._tunnel_endpoint = checked.tunnel_endpoint
        self._partition = checked.partition
        self._lock = threading.Lock()
        self._odps: Any = None
        self._tunnel: Any = None
        self._redactors: list[_Redactor] = []

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
        """Build the client, create the table and partition if missing, check the schema.

        From here until :meth:`close`, pyodps's, urllib3's and requests' log records are
        redacted (:class:`_Redactor`).  The requests made here connect within 2 s and are not
        retried by pyodps, so a bad endpoint is reported at once; a failed open releases
        what it built and is retried by the writer."""
        from odps.config import option_context

        self._redact_logs()
        try:
            with option_context(dict(_OPEN_OPTIONS)):
                self._open(fields, types)
        except BaseException as exc:
            self.close()
            if isinstance(exc, SinkError) or not isinstance(exc, Exception):
                raise
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

    def _redact_logs(self) -> None:
        """Register this sink's credentials with a :class:`_Redactor` on every logger of
        pyodps, urllib3 and requests (imported first, so their loggers exist)."""
        import odps.tunnel  # noqa: F401 - creates the loggers of the modules the sink uses
        import requests  # noqa: F401
        import urllib3  # noqa: F401

        secrets = (self._credentials.access_id, self._credentials.reveal())
        with self._lock:
            known = {id(r.logger) for r in self._redactors}
            for target in _redacted_loggers():
                if id(target) not in known:
                    self._redactors.append(_Redactor.register(target, self, secrets))

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
        """Drop the client; stop redacting logs for this sink (a redactor with no sink left
        is removed from its logger)."""
        with self._lock:
            self._tunnel = None
            self._odps = None
            redactors, self._redactors = self._redactors, []
        for redactor in redactors:
            redactor.unregister(self)

    # ------------------------------------------------------------------------------------

    def _wrap(self, exc: BaseException, what: str) -> SinkError:
        """A scrubbed, unchained :class:`SinkError` classified as transient or permanent."""
        detail = " ".join(str(exc).split())  # pyodps messages span lines
        message = self._credentials.scrub(f"{self.name}: {what}: {type(exc).__name__}: {detail}")
        return SinkError(message, transient=_is_transient(exc))


#: loggers (with their children) whose records can carry request headers, URLs or server
#: messages: pyodps's own and those of the HTTP stack under it
_REDACTED_LOGGERS = ("odps", "urllib3", "requests")
#: ``name: value`` / ``name=value`` / ``'name': 'value'`` where the name says it is secret;
#: a name starts where a word does (the lookbehind), which keeps the scan linear on long words
_SECRET_FIELD = re.compile(
    r"(?i)((?<![\w-])[\w-]*(?:authorization|authentication|signature|secret|password|token|access_?key)"
    r"[\w-]*['\"]?\s*[:=]\s*['\"]?)([^'\"\r\n,;}&]+)"
)


def _redacted_loggers() -> list[logging.Logger]:
    """The loggers named in :data:`_REDACTED_LOGGERS` and all their existing descendants.

    A filter on a logger sees only the records logged on that very logger (not those its
    children propagate), so each emitting logger needs its own."""
    names = set(_REDACTED_LOGGERS)
    names.update(
        n
        for n, obj in list(logging.Logger.manager.loggerDict.items())
        if isinstance(obj, logging.Logger) and n.startswith(tuple(f"{r}." for r in names))
    )
    return [logging.getLogger(n) for n in sorted(names)]


class _Redactor(logging.Filter):
    """Rewrites every record of one logger so that no credential survives formatting.

    Masked: the access ids and keys of the sinks registered with it, and the value of any
    ``Authorization`` / signature / token / secret header or parameter, in the message, its
    arguments and any traceback.  One redactor per logger is shared by all open sinks: each
    registers its credentials when it opens and unregisters when it closes; the last one
    out removes the redactor from the logger.  The shared state lives on the logger (in its
    ``filters``), not in this module.
    """

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.logger = target
        self._lock = threading.Lock()
        self._attached = True
        self._owners: dict[int, tuple[str, ...]] = {}
        self._secrets: tuple[str, ...] = ()

    @classmethod
    def register(cls, target: logging.Logger, owner: object, secrets: tuple[str, ...]) -> _Redactor:
        """Add ``owner``'s ``secrets`` to the redactor on ``target``, installing one if none."""
        while True:
            found = next((f for f in target.filters if isinstance(f, cls)), None)
            redactor = found or cls(target)
            with redactor._lock:
                if redactor._attached:  # not removed by its last owner meanwhile
                    redactor._owners[id(owner)] = secrets
                    redactor._update()
                    if found is None:
                        target.addFilter(redactor)
                    return redactor

    def unregister(self, owner: object) -> None:
        with self._lock:
            self._owners.pop(id(owner), None)
            self._update()
            if not self._owners:
                self._attached = False
                self.logger.removeFilter(self)

    def _update(self) -> None:
        # longest first, so a secret containing another is masked whole; read without the
        # lock by filter() (one tuple, replaced, never mutated)
        secrets = {s for owned in self._owners.values() for s in owned if s}
        self._secrets = tuple(sorted(secrets, key=len, reverse=True))

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return _SECRET_FIELD.sub(r"\1***", text)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: logging would print its arguments
            message = f"<unformattable record from {record.name}>"
        redacted = self.redact(message)
        if redacted != message or record.args:
            record.msg, record.args = redacted, ()
        trace = record.exc_text
        if not trace and record.exc_info:
            trace = logging.Formatter().formatException(record.exc_info)
        if trace and (redacted := self.redact(trace)) != trace:
            record.exc_text, record.exc_info = redacted, None  # handlers get only the text
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


class _Crc32c:
    """pyodps's checksum interface (``update`` / ``getvalue`` / ``reset``) computed by the
    ``crc32c`` package: with the CPU's CRC instruction and the GIL released.  pyodps's own
    runs in software holding the GIL, two passes over every uploaded byte, during which the
    training thread waits at each of its torch calls (benchmarks/README.md, "Block
    checksums")."""

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
