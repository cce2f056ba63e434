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

Every call to the service is bounded by the sink's ``timeout`` (default 30 s; pyodps's own
is 120 s per read, with retries of its own): the open as a whole (so ``Start`` waits at most
that long, then logs which endpoint did not answer), and each step of a batch -- the upload
session, the block, the commit, a status read.  Each runs in a daemon thread
(:class:`recis_async._threads.Call`) with pyodps's ``connect_timeout`` / ``read_timeout``
scoped to it and pyodps's retries off (``options`` set for that call only, not globally);
a step that does not end in time -- a server that hangs, or answers a byte a second -- is a
transient :class:`SinkError` naming the endpoint, so the writer retries it with backoff and
then spills.  The thread given up on runs on unattended and never delays the process's exit.
A commit given up on stays in doubt until its call has ended, then is settled as above.

An answer the client cannot read (a proxy's page, binary noise) is reported with what
arrived -- status, content type, first bytes, endpoint -- not as the parser's error.
Table, column and partition names are checked against MaxCompute's documented limits when
the sink (or the hook, for columns) is built.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import crc32c
import pyarrow as pa

from .._checks import positive_number
from .._threads import Call
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
#: MaxCompute's documented limits (help.aliyun.com, "MaxCompute SQL limits"; "Partition"):
#: table and column names of at most 128 bytes, letters, digits and underscores, starting with
#: a letter; at most 1,200 columns and 6 partition levels; a partition value of at most 128
#: bytes, starting with a letter or digit, of letters, digits and `` :_$#.!@`` (other
#: characters "undefined"; ``-``, common in dates, is let through)
_ODPS_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_NAME_BYTES = 128
_MAX_COLUMNS = 1200
_MAX_PARTITION_LEVELS = 6
_PARTITION_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9 :_$#.!@-]*\Z")
#: seconds to connect, at most (pyodps's default: 120); the rest of ``timeout`` is for answers
_CONNECT_TIMEOUT = 5
DEFAULT_TIMEOUT = 30.0


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
    if project is not None and not _IDENTIFIER.match(project):
        raise ValueError(
            f"config['project']: expected a name of letters, digits and underscores, "
            f"got {project!r}"
        )
    if table is not None:
        _check_name("config['table_name']", "table names", table)
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


def _check_name(where: str, what: str, name: str) -> None:
    """Refuse a table, column or partition key name that MaxCompute would refuse."""
    if not _ODPS_NAME.match(name) or len(name.encode()) > _NAME_BYTES:
        raise ValueError(
            f"{where}: expected a name of letters, digits and underscores, starting with a "
            f"letter, of at most {_NAME_BYTES} bytes (MaxCompute's rule for {what}), "
            f"got {_shown(name)}"
        )


def _shown(name: str) -> str:
    return repr(name) if len(name) <= 60 else f"{name[:40]!r}... ({len(name.encode())} bytes)"


def _partition(spec: Any) -> tuple[tuple[str, str], ...]:
    try:
        parts = parse_partition(spec)
    except ValueError as exc:
        raise ValueError(f"config['partition']: {str(exc).removeprefix('partition: ')}") from None
    if len(parts) > _MAX_PARTITION_LEVELS:
        raise ValueError(
            f"config['partition']: expected at most {_MAX_PARTITION_LEVELS} levels "
            f"(MaxCompute's limit), got {len(parts)}"
        )
    for key, value in parts:
        _check_name("config['partition']", "partition keys", key)
        if not _PARTITION_VALUE.match(value) or len(value.encode()) > _NAME_BYTES:
            raise ValueError(
                f"config['partition']: expected the value of {key!r} to be one MaxCompute "
                f"accepts (at most {_NAME_BYTES} bytes, starting with a letter or digit, of "
                f"letters, digits and ' :_$#.!@-'), got {_shown(value)}"
            )
    return parts


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
        timeout: seconds the service has to answer: the whole open, and each step of a
            batch's upload (session, block, commit).  A block must reach the service within
            it too: 30 s carries a 50 MiB batch over a link of 2 MB/s or more.

    Raises:
        ValueError: a missing, unknown or malformed key, a name or partition value that
            MaxCompute refuses, a ``timeout`` out of range -- here, not in a worker; the
            message never contains a credential.
        TypeError: a ``timeout`` that is not a number.
    """

    def __init__(self, config: Mapping[str, Any], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._timeout = positive_number("OdpsSink", "timeout", timeout)
        checked, self._credentials = _check_config(config)
        self._project = checked.project
        self._table = checked.table
        self._endpoint = checked.endpoint
        self._tunnel_endpoint = checked.tunnel_endpoint
        self._partition = checked.partition
        # pyodps's options for every call of this sink (pyodps wants whole seconds)
        read = max(1, math.ceil(self._timeout))
        self._options = MappingProxyType(
            {"connect_timeout": min(_CONNECT_TIMEOUT, read), "read_timeout": read, "retry_times": 0}
        )
        self._lock = threading.Lock()
        self._odps: Any = None
        self._tunnel: Any = None
        self._redactors: list[_Redactor] = []
        self._closed = True
        self._live: set[Call[Any]] = set()  # calls still running, given up on or not
        self._committing: dict[str, Call[Any]] = {}  # upload id -> its commit, given up on

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

    @property
    def timeout(self) -> float:
        """Seconds the service has to answer the open, and each step of an upload."""
        return self._timeout

    def __repr__(self) -> str:
        return (
            f"OdpsSink(project={self._project!r}, table_name={self._table!r}, "
            f"end_point={self._endpoint!r}, partition={self.partition_spec!r}, "
            f"timeout={self._timeout:g})"
        )

    def check_fields(self, fields: tuple[str, ...], owner: str) -> None:
        """Refuse column names MaxCompute would refuse (called by the hook when it is built,
        so a bad name fails there, not at the first upload)."""
        if len(fields) > _MAX_COLUMNS:
            raise ValueError(
                f"{owner}(fields=...): expected at most {_MAX_COLUMNS} columns (MaxCompute's "
                f"limit), got {len(fields)}"
            )
        part_keys = {k.lower() for k, _ in self._partition}
        for field in fields:  # (names equal but for case: refused by the hook's buffer)
            _check_name(f"{owner}(fields=...)", "column names", field)
            if field.lower() in part_keys:
                raise ValueError(
                    f"{owner}(fields=...): expected no column named like a partition key, "
                    f"got {field!r} (partition {self.partition_spec})"
                )

    # ------------------------------------------------------------------------------------

    def open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        """Build the client, create the table and partition if missing, check the schema.

        From here until :meth:`close` (and until the last call given up on has ended),
        pyodps's, urllib3's and requests' log records are redacted (:class:`_Redactor`).
        The open as a whole must end within ``timeout``; a failed open releases what it
        built and is retried by the writer."""
        self._redact_logs()
        try:
            self._call("cannot open", self._endpoint, self._open, fields, types)
        except BaseException:
            self.close()
            raise

    def _open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        from odps import ODPS
        from odps.models import TableSchema
        from odps.tunnel import TableTunnel

        with self._lock:
            odps = self._odps
        if odps is None:  # built outside the lock: pyodps may send a request here
            odps = ODPS(
                self._credentials.access_id,
                self._credentials.reveal(),
                project=self._project,
                endpoint=self._endpoint,
                tunnel_endpoint=self._tunnel_endpoint,
                overwrite_global=False,
            )
            with self._lock:
                self._odps = self._odps or odps
                odps = self._odps
        _keep_answers(odps.rest)
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
        tunnel = TableTunnel(odps, endpoint=self._tunnel_endpoint)
        tunnel.tunnel_rest  # noqa: B018 - finds the tunnel's address now, within the open's time
        with self._lock:
            if self._odps is odps and self._tunnel is None:  # not closed meanwhile
                self._tunnel = tunnel

    def _call(
        self,
        what: str,
        where: str | None,
        fn: Callable[..., Any],
        *args: Any,
        commit_of: str | None = None,
    ) -> Any:
        """``fn(*args)`` in a daemon thread with this sink's pyodps options, given up on after
        ``timeout`` seconds; any failure raised as a scrubbed :class:`SinkError`.  A call
        that commits upload session ``commit_of`` is remembered while it runs on, given up
        on, so that the session is not settled before its commit has ended."""
        call = Call(self._run, fn, args, name=f"{self.name} {what}")
        with self._lock:
            self._live.add(call)
        call._on_done(lambda: self._ended(call))
        if not call.wait(self._timeout):
            if commit_of is not None:
                with self._lock:
                    if not call.done:
                        self._committing[commit_of] = call
            raise SinkError(
                f"{self.name}: {what}: no answer from the ODPS service at "
                f"{where or self._tunnel_endpoint or self._endpoint} within {self._timeout:g} s "
                "(the call was given up on)",
                transient=True,
            )
        try:
            return call.result()
        except SinkError:
            raise
        except Exception as exc:
            raise self._wrap(exc, what) from None

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """In a call's own thread: run ``fn`` under this sink's pyodps options, keeping the
        last HTTP answer pyodps received (the thread's own requests sessions carry the hook,
        so no other call's answers mix in) to describe one the client cannot read."""
        from odps.config import option_context

        with self._lock:
            odps, tunnel = self._odps, self._tunnel
        if odps is not None:
            _keep_answers(odps.rest)
        if tunnel is not None:  # its address was found by the open: no request is sent here
            _keep_answers(tunnel.tunnel_rest)
        with option_context(dict(self._options)):
            try:
                return fn(*args)
            except (UnicodeError, json.JSONDecodeError, ET.ParseError) as exc:
                with self._lock:
                    clients = [self._odps and self._odps.rest, self._tunnel]
                rests = [c.tunnel_rest if c is self._tunnel else c for c in clients if c]
                answers = [a for a in (_last_answer(r) for r in rests) if a is not None]
                if not answers:
                    raise
                raise _UnreadableAnswer(_describe(max(answers)[1], exc)) from None

    def _ended(self, call: Call[Any]) -> None:
        with self._lock:
            self._live.discard(call)
            for upload_id, commit in list(self._committing.items()):
                if commit is call:
                    del self._committing[upload_id]
        self._release_logs()

    def _redact_logs(self) -> None:
        """Register this sink's credentials with a :class:`_Redactor` on every logger of
        pyodps, urllib3 and requests (imported first, so their loggers exist)."""
        import odps.tunnel  # noqa: F401 - creates the loggers of the modules the sink uses
        import requests  # noqa: F401
        import urllib3  # noqa: F401

        secrets = (self._credentials.access_id, self._credentials.reveal())
        with self._lock:
            self._closed = False
            known = {id(r.logger) for r in self._redactors}
            for target in _redacted_loggers():
                if id(target) not in known:
                    self._redactors.append(_Redactor.register(target, self, secrets))

    def _release_logs(self) -> None:
        """Stop redacting once closed and no call of this sink is running any more (a call
        given up on still logs)."""
        with self._lock:
            if not self._closed or self._live:
                return
            redactors, self._redactors = self._redactors, []
        for redactor in redactors:
            redactor.unregister(self)

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
        """Upload ``batch`` in a fresh session (one block) and commit it; each of the three
        steps must end within ``timeout``."""
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
        # an uncommitted session is invisible: nothing of this batch is delivered until then
        session = self._call(
            f"cannot upload batch {batch.seq}",
            None,
            lambda: tunnel.create_upload_session(
                self._table,
                partition_spec=self.partition_spec,
                create_partition=bool(self._partition),
            ),
        )
        self._call(f"cannot upload batch {batch.seq}", None, _upload, session, table)
        if not attempt.commit(session.id):
            raise SinkError(
                f"{self.name}: batch {batch.seq} abandoned by the writer", transient=False
            )
        try:
            self._call(
                f"cannot commit batch {batch.seq} (upload session {session.id})",
                None,
                session.commit,
                [_BLOCK_ID],
                commit_of=session.id,
            )
        except SinkError as failure:
            try:
                delivered = self._settle(session.id, batch)
            except SinkError as check:
                raise SinkError(
                    f"{failure}; its outcome is unknown: {check}", transient=True
                ) from None
            if delivered:
                return
            attempt.resolve()
            raise
        logger.debug(
            "%s: batch %d (%d rows) committed in %s", self.name, batch.seq, batch.rows, session.id
        )

    def _settle(self, upload_id: str, batch: Batch) -> bool:
        """Whether the upload session ``upload_id`` was committed (True) or never will be."""
        from odps.tunnel import TableUploadSession

        with self._lock:
            running = self._committing.get(upload_id)
        if running is not None and not running.done:
            raise SinkError(
                f"{self.name}: the commit of upload session {upload_id} has not ended yet; "
                "its outcome is not known",
                transient=True,
            )
        tunnel = self._tunnel
        status = self._call(
            f"cannot read the status of upload session {upload_id}",
            None,
            lambda: (
                tunnel.create_upload_session(
                    self._table, partition_spec=self.partition_spec, upload_id=upload_id
                ).status
            ),
        )
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
        """Drop the client; stop redacting logs for this sink once no call of it is running
        (a redactor with no sink left is removed from its logger)."""
        with self._lock:
            self._tunnel = None
            self._odps = None
            self._closed = True
        self._release_logs()

    # ------------------------------------------------------------------------------------

    def _wrap(self, exc: BaseException, what: str) -> SinkError:
        """A scrubbed, unchained :class:`SinkError` classified as transient or permanent."""
        detail = " ".join(str(exc).split())  # pyodps messages span lines
        if not isinstance(exc, _UnreadableAnswer):
            detail = f"{type(exc).__name__}: {detail}"
        message = self._credentials.scrub(f"{self.name}: {what}: {detail}")
        return SinkError(message, transient=_is_transient(exc))


def _upload(session: Any, table: pa.Table) -> None:
    """Write ``table`` as one Arrow block of ``session``."""
    writer = session.open_arrow_writer(_BLOCK_ID)
    _use_hardware_crc(writer)
    try:
        for record_batch in table.to_batches():
            writer.write(record_batch)
            # pyodps checksums each chunk holding the GIL; hand it back between record
            # batches so the training thread is not stalled behind a block
            time.sleep(0)
    finally:
        writer.close()  # ends the streamed PUT even when write() raised


def _keep_answers(rest: Any) -> None:
    """Keep the last answer received through pyodps's client ``rest`` in this thread on its
    requests session (pyodps gives each thread its own), with the time it arrived."""
    session = rest.session
    if hasattr(session, "recis_last_answer"):
        return
    session.recis_last_answer = None
    send = session.send  # pyodps prepares its requests itself: session hooks are not used

    def send_and_keep(*args: Any, **kwargs: Any) -> Any:
        response = send(*args, **kwargs)
        session.recis_last_answer = (time.monotonic(), response)
        return response

    session.send = send_and_keep


def _last_answer(rest: Any) -> tuple[float, Any] | None:
    answer: tuple[float, Any] | None = getattr(rest.session, "recis_last_answer", None)
    return answer


class _UnreadableAnswer(Exception):
    """The service answered something the client could not parse (transient)."""


def _describe(response: Any, exc: BaseException) -> str:
    """What arrived: status, content type, the first bytes, and where from (no query)."""
    body = getattr(response, "_content", None)  # read already (never waits for more)
    head = body[:32] if isinstance(body, bytes) else b"<not read>"
    url = urlsplit(str(getattr(response, "url", "")))
    return (
        f"the ODPS service at {url.scheme}://{url.netloc}{url.path} answered "
        f"{getattr(response, 'status_code', '?')} with content type "
        f"{response.headers.get('Content-Type')!r} and a body starting {head!r}"
        f"{'...' if isinstance(body, bytes) and len(body) > 32 else ''}, which the client "
        f"cannot read ({type(exc).__name__})"
    )


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
    if isinstance(exc, _UnreadableAnswer):
        return True  # a proxy or a server mid-restart; the retries are bounded
    status = getattr(exc, "status_code", None)
    if isinstance(exc, errors.BaseODPSError) and status is not None:
        return status >= 500 or status in _TRANSIENT_STATUS
    if isinstance(exc, (requests.RequestException, ConnectionError, TimeoutError, OSError)):
        return True
    # pyodps's own tunnel errors without an HTTP status (block list mismatch, stream
    # truncated, ...) concern only this session; a fresh session may succeed
    return isinstance(exc, errors.BaseODPSError)
