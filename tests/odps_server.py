"""A loopback ODPS (MaxCompute) service that pyodps's unmodified client talks to.

It implements the slice of the REST and table-tunnel protocols that trace uploads and
read-back use, over plain HTTP on 127.0.0.1 (stdlib ``ThreadingHTTPServer``):

* ``GET  {api}/logview/host``                               -- answered so client setup is quiet
* ``GET  {api}/projects/<p>``                                -- project metadata (XML)
* ``GET  {api}/projects/<p>/tunnel?service``                 -- tunnel address (this server)
* ``GET  {api}/projects/<p>/tables/<t>``                     -- table metadata (XML + JSON schema)
* ``GET  {api}/projects/<p>/tables/<t>?partitions``          -- partition listing
* ``GET  {api}/projects/<p>/tables/<t>/partitions?partition=`` -- one partition's metadata
* ``POST {api}/projects/<p>/instances``                      -- SQL jobs: ``CREATE TABLE`` and
  ``ALTER TABLE ... ADD PARTITION`` are executed at once; the instance reports success
* ``GET  {api}/projects/<p>/instances/<id>[?taskstatus]``    -- instance / task status
* tunnel, on ``/projects/<p>/tables/<t>`` (with or without the ``{api}`` prefix):
  ``POST ?uploads`` (new upload session, ``create_partition``), ``GET ?uploadid`` (status and
  uploaded block list), ``PUT ?uploadid&blockid[&arrow]`` (a block; the body is decoded with
  pyodps's own ``TunnelRecordReader`` / ``TunnelArrowReader``), ``POST ?uploadid`` (commit:
  the session's blocks become visible at once, the session is CLOSED), ``POST ?downloads``,
  ``GET ?downloadid``, ``GET ?data&downloadid&rowrange[&arrow]`` (encoded with pyodps's
  ``BaseRecordWriter`` / ``BaseArrowWriter``).

With ``defer_decoding=True`` (the benchmarks' mode, ``python tests/odps_server.py PROJECT
--defer-decoding``) a PUT keeps the block's bytes and they are decoded only when the rows are
read, as a remote service's work would never land on the client's machine; tests keep the
default, decoding on arrival, so a malformed block fails its PUT.

Faults are injected with :meth:`OdpsServer.inject`: a 503 or a 500, a connection reset
before the request is handled, a permanent 4xx, ``"lost"`` -- the request is fully processed
(a commit succeeds) and then the connection is reset instead of answering --, ``"hang"`` (the
request is read and never answered, until the server stops), ``"trickle"`` (processed, then
answered one byte a second), or ``"garbage"`` (a 200 whose body is binary noise).  ``times=``
a large number makes a fault last (``FOREVER``).

Requests are signed by pyodps; signatures are not verified and headers are never logged,
so the server's log (``server.log_lines``) cannot contain a credential.
"""

from __future__ import annotations

import io
import json
import re
import socket
import struct
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import pyarrow as pa
from odps.models import Record, TableSchema
from odps.tunnel.io.reader import TunnelArrowReader, TunnelRecordReader
from odps.tunnel.io.stream import CompressOption, get_decompress_stream
from odps.tunnel.io.types import odps_schema_to_arrow_schema
from odps.tunnel.io.writer import BaseArrowWriter, BaseRecordWriter

__all__ = ["FOREVER", "GARBAGE", "OdpsServer", "Fault"]

API_PREFIX = "/api"

# ------------------------------------------------------------------------------------------
# state


@dataclass
class _RawBlock:
    """An uploaded block kept as bytes (``defer_decoding``): decoded when first read."""

    body: bytes
    arrow: bool
    encoding: str | None


@dataclass
class _Table:
    name: str
    columns: list[tuple[str, str]]
    partition_keys: list[tuple[str, str]]
    created: float = field(default_factory=time.time)
    # partition spec ("" for none) -> committed blocks, in commit order (decoded Arrow tables,
    # or raw blocks under defer_decoding until something reads them)
    data: dict[str, list[pa.Table | _RawBlock]] = field(default_factory=dict)

    def decoded(self, spec: str) -> list[pa.Table]:
        """The partition's committed blocks as Arrow tables, decoding deferred ones now
        (call with the state's lock held)."""
        blocks = self.data.get(spec, [])
        for i, block in enumerate(blocks):
            if isinstance(block, _RawBlock):
                blocks[i] = _decode_block(self, block.body, block.arrow, block.encoding)
        return list(blocks)  # type: ignore[arg-type]  # every block is decoded now

    @property
    def schema(self) -> TableSchema:
        return TableSchema.from_lists(
            [c for c, _ in self.columns],
            [t for _, t in self.columns],
            [c for c, _ in self.partition_keys] or None,
            [t for _, t in self.partition_keys] or None,
        )

    @property
    def data_schema(self) -> TableSchema:
        """Only the data columns: what a tunnel block carries."""
        return TableSchema.from_lists([c for c, _ in self.columns], [t for _, t in self.columns])

    def rows(self, spec: str) -> int:
        return sum(t.num_rows for t in self.decoded(spec))


@dataclass
class _UploadSession:
    id: str
    table: _Table
    spec: str
    status: str = "normal"
    blocks: dict[int, pa.Table | _RawBlock] = field(default_factory=dict)


@dataclass
class _DownloadSession:
    id: str
    table: _Table
    spec: str
    snapshot: pa.Table


@dataclass
class Fault:
    """One injected failure: the next ``times`` requests of ``op`` get ``action``.

    ``op``: ``"create_upload"``, ``"reload_upload"``, ``"put_block"``, ``"commit"``,
    ``"create_download"``, ``"download_data"``, ``"table_meta"``, ``"instance"`` or ``"any"``.
    ``action``: ``"503"``, ``"500"``, ``"reset"`` (connection reset before handling),
    ``"4xx"`` (403 NoPermission, permanent), ``"lost"`` (handled, then the connection is
    reset instead of answering), ``"slow:<seconds>"`` (handled after a delay), ``"hang"``
    (read, never handled nor answered while the server runs), ``"trickle"`` /
    ``"trickle:<seconds per byte>"`` (handled, then answered a byte at a time, one a second
    by default), or ``"garbage"`` (not handled; a 200 with a binary body).  ``after``: let
    that many matching requests through first.  ``message``: text of the error response.
    """

    op: str
    action: str
    times: int = 1
    after: int = 0
    message: str = ""
    hits: int = 0
    seen: int = 0


#: ``times=FOREVER``: the fault never runs out
FOREVER = 10**9
#: the body of a ``"garbage"`` answer: what a proxy's error page in another encoding, or a
#: stray binary, looks like to a JSON parser
GARBAGE = b"\x89\xff\xfe\x00garbage\x93\xc3(\xa0\xa1 not json"


def _partition_spec(text: str | None) -> str:
    """Canonical partition spec: ``k=v`` pairs joined by commas, quotes removed."""
    if not text:
        return ""
    parts = []
    for part in text.split(","):
        if not part.strip():
            continue
        key, _, value = part.partition("=")
        parts.append(f"{key.strip().lower()}={value.strip().strip(chr(39)).strip(chr(34))}")
    return ",".join(parts)


_CREATE_RE = re.compile(
    r"CREATE\s+TABLE\s+(?P<ine>IF\s+NOT\s+EXISTS\s+)?(?:[\w`]+\.)?`?(?P<name>\w+)`?\s*\((?P<cols>.*?)\)"
    r"(?:\s*PARTITIONED\s+BY\s*\((?P<parts>.*?)\))?",
    re.S | re.I,
)
_ALTER_RE = re.compile(
    r"ALTER\s+TABLE\s+(?:[\w`]+\.)?`?(?P<name>\w+)`?\s+ADD\s+(?P<ine>IF\s+NOT\s+EXISTS\s+)?"
    r"PARTITION\s*\((?P<spec>.*?)\)",
    re.S | re.I,
)


def _split_columns(text: str) -> list[tuple[str, str]]:
    """``"`a` BIGINT, `b` ARRAY<FLOAT>"`` -> ``[("a", "bigint"), ("b", "array<float>")]``."""
    out: list[tuple[str, str]] = []
    depth = 0
    current = ""
    for ch in text + ",":
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        if ch == "," and depth == 0:
            item = current.strip()
            current = ""
            if not item:
                continue
            item = re.sub(r"\s+COMMENT\s+'.*'$", "", item, flags=re.I)
            name, _, type_ = item.partition(" ")
            out.append((name.strip("`").lower(), "".join(type_.split()).lower()))
        else:
            current += ch
    return out


class _State:
    def __init__(self, project: str, defer_decoding: bool = False) -> None:
        self.project = project
        self.defer_decoding = defer_decoding
        self.lock = threading.RLock()
        self.tables: dict[str, _Table] = {}
        self.partitions: dict[str, set[str]] = {}
        self.uploads: dict[str, _UploadSession] = {}
        self.downloads: dict[str, _DownloadSession] = {}
        self.instances: dict[str, str] = {}  # id -> task name
        self.faults: list[Fault] = []
        self.log_lines: list[str] = []
        self.counts: dict[str, int] = {}
        self.stopped = threading.Event()  # ends every "hang" and "trickle" at stop()

    def take_fault(self, op: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.hits < fault.times and fault.op in (op, "any"):
                    fault.seen += 1
                    if fault.seen <= fault.after:
                        continue
                    fault.hits += 1
                    return fault
        return None

    def run_sql(self, sql: str) -> None:
        with self.lock:
            if m := _CREATE_RE.search(sql):
                name = m.group("name").lower()
                if name in self.tables:
                    if m.group("ine"):
                        return
                    raise _HttpError(409, "ODPS-0130111", f"Table or view already exists - {name}")
                self.tables[name] = _Table(
                    name, _split_columns(m.group("cols")), _split_columns(m.group("parts") or "")
                )
                self.partitions[name] = set()
                return
            if m := _ALTER_RE.search(sql):
                name = m.group("name").lower()
                if name not in self.tables:
                    raise _HttpError(404, "NoSuchObject", f"Table not found - {name}")
                spec = _partition_spec(m.group("spec"))
                if spec in self.partitions[name] and not m.group("ine"):
                    raise _HttpError(409, "ODPS-0130111", f"Partition already exists - {spec}")
                self.partitions[name].add(spec)
                return
        raise _HttpError(
            400, "ODPS-0130161", "ParseError: only CREATE TABLE / ADD PARTITION run here"
        )


class _HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


# ------------------------------------------------------------------------------------------
# wire helpers


def _schema_json(table: _Table) -> dict[str, Any]:
    return {
        "columns": [
            {"name": n, "type": t, "comment": "", "isNullable": True} for n, t in table.columns
        ],
        "partitionKeys": [{"name": n, "type": t, "comment": ""} for n, t in table.partition_keys],
    }


def _decode_block(table: _Table, body: bytes, arrow: bool, encoding: str | None) -> pa.Table:
    """Decode an uploaded block with pyodps's own tunnel readers."""
    schema = table.data_schema
    option = CompressOption.CompressAlgorithm.from_encoding(encoding) if encoding else None

    def stream(*_args: Any, **_kw: Any) -> Any:
        raw = io.BytesIO(body)
        if option is None:
            return raw
        return get_decompress_stream(raw, CompressOption(option), requests=False)

    arrow_schema = odps_schema_to_arrow_schema(schema)
    if arrow:
        reader = TunnelArrowReader(schema, lambda pos: stream() if pos == 0 else None)
        result = reader.read()
        return result.cast(arrow_schema) if result.num_rows else arrow_schema.empty_table()
    used = [False]

    def creator(cursor: int, row_number: int | None = None, raw_size: int | None = None) -> Any:
        if used[0]:
            return None
        used[0] = True
        return stream()

    records = [list(r.values) for r in TunnelRecordReader(schema, creator)]
    names = [c for c, _ in table.columns]
    return pa.Table.from_pylist(
        [dict(zip(names, r, strict=True)) for r in records], schema=arrow_schema
    )


def _encode_rows(table: _Table, rows: pa.Table, arrow: bool) -> bytes:
    out = io.BytesIO()
    schema = table.data_schema
    if arrow:
        writer: Any = BaseArrowWriter(schema, out)
        if rows.num_rows:
            writer.write(rows)
        writer.close()
        return out.getvalue()
    writer = BaseRecordWriter(schema, out)
    for row in rows.to_pylist():
        writer.write(Record(schema=schema, values=[row[c] for c, _ in table.columns]))
    writer.close()
    return out.getvalue()


def _xml_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# ------------------------------------------------------------------------------------------
# HTTP


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        pass  # the server keeps its own log, without headers

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # -- body -------------------------------------------------------------------------

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    # -- responses ----------------------------------------------------------------------

    def _send(
        self,
        status: int,
        body: bytes = b"",
        content_type: str = "application/xml",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-odps-request-id", uuid.uuid4().hex)
        self.send_header("Date", formatdate(usegmt=True))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, obj: Any, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _send_error(self, status: int, code: str, message: str) -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{_xml_escape(message)}</Message><RequestId>{uuid.uuid4().hex}</RequestId>"
            f"<HostId>127.0.0.1</HostId></Error>"
        ).encode()
        self._send(status, body)

    def _reset(self) -> None:
        """Abort the connection with a TCP RST instead of answering."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.connection.close()

    # -- dispatch -----------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        state = self.server.state
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        if path.startswith(API_PREFIX):
            path = path[len(API_PREFIX) :]
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        op = self._classify(path, params)
        with state.lock:
            state.counts[op] = state.counts.get(op, 0) + 1
            state.log_lines.append(
                f"{self.command} {path} op={op} "
                + " ".join(f"{k}={v}" for k, v in sorted(params.items()) if k != "curr_project")
            )
        fault = state.take_fault(op)
        if fault is not None and fault.action == "reset":
            state.log_lines.append(f"fault reset {op}")
            self._reset()
            return
        body = self._read_body()
        if fault is not None and fault.action == "503":
            state.log_lines.append(f"fault 503 {op}")
            self._send_error(
                503, "ServiceUnavailable", fault.message or "injected: service unavailable"
            )
            return
        if fault is not None and fault.action == "4xx":
            state.log_lines.append(f"fault 403 {op}")
            self._send_error(403, "NoPermission", fault.message or "injected: permission denied")
            return
        if fault is not None and fault.action == "500":
            state.log_lines.append(f"fault 500 {op}")
            self._send_error(500, "InternalServerError", fault.message or "injected: error")
            return
        if fault is not None and fault.action == "hang":
            state.log_lines.append(f"fault hang {op}")
            state.stopped.wait()
            self.close_connection = True
            return
        if fault is not None and fault.action == "garbage":
            state.log_lines.append(f"fault garbage {op}")
            self._send(200, GARBAGE, "application/octet-stream")
            return
        if fault is not None and fault.action.startswith("slow:"):
            time.sleep(float(fault.action.split(":", 1)[1]))
        try:
            responder = self._handle(op, path, params, body)
        except _HttpError as exc:
            self._send_error(exc.status, exc.code, exc.message)
            return
        if fault is not None and fault.action == "lost":
            state.log_lines.append(f"fault lost response {op}")
            self._reset()
            return
        if fault is not None and fault.action.startswith("trickle"):
            state.log_lines.append(f"fault trickle {op}")
            self._trickle(responder, float(fault.action.partition(":")[2] or 1.0))
            return
        responder()

    def _trickle(self, responder: Callable[[], None], interval: float) -> None:
        """Send the answer ``responder`` writes one byte every ``interval`` seconds."""
        out, self.wfile = self.wfile, io.BytesIO()
        try:
            responder()
            answer = self.wfile.getvalue()  # type: ignore[attr-defined]
        finally:
            self.wfile = out
        self.close_connection = True
        for i in range(len(answer)):
            if self.server.state.stopped.wait(interval):
                return
            try:
                out.write(answer[i : i + 1])
                out.flush()
            except OSError:  # the client gave up
                return

    def _classify(self, path: str, params: dict[str, str]) -> str:
        m = self.command
        if path == "/logview/host":
            return "logview"
        if re.fullmatch(r"/projects/[^/]+/instances(/[^/]+)?", path):
            return "instance"
        if re.fullmatch(r"/projects/[^/]+/tables/[^/]+", path):
            if m == "POST" and "uploads" in params:
                return "create_upload"
            if m == "PUT" and "uploadid" in params:
                return "put_block"
            if m == "POST" and "uploadid" in params:
                return "commit"
            if m == "GET" and "uploadid" in params:
                return "reload_upload"
            if m == "POST" and "downloads" in params:
                return "create_download"
            if m == "GET" and "downloadid" in params and "data" in params:
                return "download_data"
            if m == "GET" and "downloadid" in params:
                return "reload_download"
            if m == "GET" and "partition" in params and "partitions" not in params:
                return "partition_meta"
            return "table_meta"
        if re.fullmatch(r"/projects/[^/]+/tables/[^/]+/partitions", path):
            return "partition_meta"
        if re.fullmatch(r"/projects/[^/]+/tunnel", path):
            return "tunnel_service"
        if re.fullmatch(r"/projects/[^/]+", path):
            return "project_meta"
        return "unknown"

    def _handle(
        self, op: str, path: str, params: dict[str, str], body: bytes
    ) -> Callable[[], None]:
        """Apply the request to the state; return the function that sends the answer."""
        state = self.server.state
        segs = path.strip("/").split("/")
        if op == "logview":
            return lambda: self._send(200, b"http://logview.invalid", "text/plain")
        if op == "unknown" or (len(segs) >= 2 and segs[1] != state.project):
            raise _HttpError(404, "NoSuchObject", f"not found: {path}")
        if op == "tunnel_service":
            addr = f"127.0.0.1:{self.server.server_address[1]}"
            return lambda: self._send(200, addr.encode(), "text/plain")
        if op == "project_meta":
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?><Project><Name>{state.project}</Name>'
                f"<Type>managed</Type><Comment></Comment><State>AVAILABLE</State>"
                f"<Owner>ALIYUN$tester</Owner><CreationTime>{formatdate(usegmt=True)}</CreationTime>"
                f"<LastModifiedTime>{formatdate(usegmt=True)}</LastModifiedTime>"
                f"<ProjectGroupName></ProjectGroupName><Properties></Properties></Project>"
            )
            return lambda: self._send(200, xml.encode())
        if op == "instance":
            return self._instance(segs, params, body)
        table = self._table(segs[3])
        if op == "table_meta":
            if "partitions" in params:
                return self._list_partitions(table)
            return self._table_meta(table)
        if op == "partition_meta":
            return self._partition_meta(table, _partition_spec(params.get("partition")))
        return self._tunnel(op, table, params, body)

    def _table(self, name: str) -> _Table:
        state = self.server.state
        with state.lock:
            table = state.tables.get(name.lower())
        if table is None:
            raise _HttpError(404, "NoSuchObject", f"ODPS-0130131:Table not found - '{name}'")
        return table

    # -- metadata -----------------------------------------------------------------------

    def _table_meta(self, table: _Table) -> Callable[[], None]:
        schema = json.dumps(
            _schema_json(table)
            | {
                "tableName": table.name,
                "createTime": int(table.created),
                "lastDDLTime": int(table.created),
                "lastModifiedTime": int(time.time()),
                "isVirtualView": False,
                "lifecycle": -1,
                "size": 0,
            }
        )
        xml = (
            f'<?xml version="1.0" encoding="UTF-8"?><Table><Name>{table.name}</Name>'
            f"<TableId>{uuid.uuid5(uuid.NAMESPACE_DNS, table.name).hex}</TableId>"
            f"<Owner>ALIYUN$tester</Owner><Type>MANAGED_TABLE</Type>"
            f'<Schema format="json"><![CDATA[{schema}]]></Schema></Table>'
        )
        return lambda: self._send(200, xml.encode())

    def _partition_xml(self, table: _Table, spec: str) -> str:
        cols = "".join(
            f'<Column Name="{k}" Value="{v}"/>'
            for k, v in (p.split("=", 1) for p in spec.split(","))
        )
        meta = json.dumps(
            {
                "createTime": int(table.created),
                "lastDDLTime": int(table.created),
                "lastModifiedTime": int(time.time()),
                "partitionSize": 0,
                "partitionRecordNum": table.rows(spec),
            }
        )
        return f"<Partition>{cols}<Schema><![CDATA[{meta}]]></Schema></Partition>"

    def _list_partitions(self, table: _Table) -> Callable[[], None]:
        state = self.server.state
        with state.lock:
            specs = sorted(state.partitions.get(table.name, ()))
        body = "".join(self._partition_xml(table, s) for s in specs)
        xml = f'<?xml version="1.0" encoding="UTF-8"?><Partitions>{body}<Marker></Marker><MaxItems>1000</MaxItems></Partitions>'
        return lambda: self._send(200, xml.encode())

    def _partition_meta(self, table: _Table, spec: str) -> Callable[[], None]:
        state = self.server.state
        with state.lock:
            exists = spec in state.partitions.get(table.name, ())
        if not exists:
            raise _HttpError(404, "NoSuchObject", f"ODPS-0130131:Partition not found - {spec}")
        xml = '<?xml version="1.0" encoding="UTF-8"?>' + self._partition_xml(table, spec)
        return lambda: self._send(200, xml.encode())

    # -- instances (DDL) -----------------------------------------------------------------

    def _instance(self, segs: list[str], params: dict[str, str], body: bytes) -> Callable[[], None]:
        state = self.server.state
        if self.command == "POST" and len(segs) == 3:
            root = ET.fromstring(body)
            task = root.find(".//SQL")
            if task is None:
                raise _HttpError(400, "InvalidArgument", "only SQL tasks are supported")
            name = task.findtext("Name") or "AnonymousSQLTask"
            sql = task.findtext("Query") or ""
            state.run_sql(sql)
            inst_id = time.strftime("%Y%m%d%H%M%S") + uuid.uuid4().hex[:12]
            with state.lock:
                state.instances[inst_id] = name
            location = f"http://127.0.0.1:{self.server.server_address[1]}{API_PREFIX}/projects/{state.project}/instances/{inst_id}"
            return lambda: self._send(201, b"", headers={"Location": location})
        if len(segs) != 4:
            raise _HttpError(400, "InvalidArgument", "bad instance request")
        with state.lock:
            name = state.instances.get(segs[3])
        if name is None:
            raise _HttpError(404, "NoSuchObject", f"instance not found - {segs[3]}")
        if "result" in params:
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?><Instance><Tasks>'
                f'<Task Type="SQL"><Name>{name}</Name><Result Format="text"><![CDATA[OK]]></Result></Task>'
                "</Tasks></Instance>"
            )
        else:
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?><Instance><Status>Terminated</Status><Tasks>'
                f'<Task Type="SQL"><Name>{name}</Name><Status>Success</Status></Task>'
                "</Tasks></Instance>"
            )
        headers = {
            "x-odps-owner": "ALIYUN$tester",
            "x-odps-start-time": formatdate(usegmt=True),
            "x-odps-end-time": formatdate(usegmt=True),
        }
        return lambda: self._send(200, xml.encode(), headers=headers)

    # -- tunnel --------------------------------------------------------------------------

    def _upload_json(self, s: _UploadSession) -> dict[str, Any]:
        return {
            "UploadID": s.id,
            "Status": s.status,
            "Schema": _schema_json(s.table),
            "UploadedBlockList": [{"BlockID": b} for b in sorted(s.blocks)],
            "MaxFieldSize": 8 * 1024 * 1024,
        }

    def _tunnel(
        self, op: str, table: _Table, params: dict[str, str], body: bytes
    ) -> Callable[[], None]:
        state = self.server.state
        spec = _partition_spec(params.get("partition"))
        if op in ("create_upload", "create_download"):
            if bool(spec) != bool(table.partition_keys):
                raise _HttpError(
                    400,
                    "InvalidPartitionSpec",
                    f"partition spec {spec!r} does not fit {table.name}",
                )
            with state.lock:
                known = state.partitions[table.name]
                if spec and spec not in known:
                    if op == "create_upload" and params.get("create_partition") in ("true", ""):
                        known.add(spec)
                    else:
                        raise _HttpError(404, "NoSuchPartition", f"partition not found - {spec}")
        if op == "create_upload":
            session = _UploadSession(uuid.uuid4().hex.upper(), table, spec)
            with state.lock:
                state.uploads[session.id] = session
            doc = self._upload_json(session)
            return lambda: self._send_json(doc, 201)
        if op == "create_download":
            with state.lock:
                tables = table.decoded(spec)
            arrow_schema = odps_schema_to_arrow_schema(table.data_schema)
            snapshot = pa.concat_tables(tables) if tables else arrow_schema.empty_table()
            dl = _DownloadSession(uuid.uuid4().hex.upper(), table, spec, snapshot)
            with state.lock:
                state.downloads[dl.id] = dl
            doc = {
                "DownloadID": dl.id,
                "Status": "normal",
                "RecordCount": snapshot.num_rows,
                "Schema": _schema_json(table),
            }
            return lambda: self._send_json(doc, 201)
        if op in ("reload_download", "download_data"):
            with state.lock:
                dl = state.downloads.get(params["downloadid"])
            if dl is None:
                raise _HttpError(404, "NoSuchDownload", "download session not found")
            if op == "reload_download":
                doc = {
                    "DownloadID": dl.id,
                    "Status": "normal",
                    "RecordCount": dl.snapshot.num_rows,
                    "Schema": _schema_json(table),
                }
                return lambda: self._send_json(doc)
            start, count = (int(x) for x in params["rowrange"].strip("()").split(","))
            data = _encode_rows(table, dl.snapshot.slice(start, count), "arrow" in params)
            return lambda: self._send(200, data, "application/octet-stream")
        with state.lock:
            session = state.uploads.get(params["uploadid"])
        if session is None or session.table is not table:
            raise _HttpError(404, "NoSuchUpload", "upload session not found")
        if op == "reload_upload":
            doc = self._upload_json(session)
            return lambda: self._send_json(doc)
        if op == "put_block":
            if session.status != "normal":
                raise _HttpError(400, "InvalidStatus", f"upload session is {session.status}")
            encoding = self.headers.get("Content-Encoding")
            block: pa.Table | _RawBlock
            if state.defer_decoding:
                block = _RawBlock(body, "arrow" in params, encoding)
                size = f"bytes={len(body)}"
            else:
                try:
                    block = _decode_block(table, body, "arrow" in params, encoding)
                except Exception as exc:  # a malformed block is the client's fault
                    raise _HttpError(
                        400, "MalformedDataStream", f"cannot decode block: {exc}"
                    ) from None
                size = f"rows={block.num_rows}"
            with state.lock:
                session.blocks[int(params["blockid"])] = block
                state.log_lines.append(f"block {session.id}/{params['blockid']} {size}")
            return lambda: self._send(200, b"", "text/plain")
        if op == "commit":
            with state.lock:
                if session.status == "closed":
                    raise _HttpError(400, "InvalidStatus", "upload session already committed")
                if session.status != "normal":
                    raise _HttpError(400, "InvalidStatus", f"upload session is {session.status}")
                committed = [session.blocks[b] for b in sorted(session.blocks)]
                table.data.setdefault(session.spec, []).extend(committed)
                session.status = "closed"
                state.log_lines.append(
                    f"commit {session.id} blocks={len(committed)} spec={session.spec}"
                )
            doc = self._upload_json(session)
            return lambda: self._send_json(doc)
        raise _HttpError(400, "InvalidArgument", f"unsupported tunnel request {op}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    state: _State


class OdpsServer:
    """Run the loopback service in a background thread; use as a context manager."""

    def __init__(self, project: str = "trace_proj", *, defer_decoding: bool = False) -> None:
        self.project = project
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.state = _State(project, defer_decoding)
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> _State:
        return self._server.state

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """The REST endpoint (``end_point`` in a RecIS config)."""
        return f"http://127.0.0.1:{self.port}{API_PREFIX}"

    @property
    def tunnel_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_lines(self) -> list[str]:
        with self.state.lock:
            return list(self.state.log_lines)

    def counts(self, op: str) -> int:
        with self.state.lock:
            return self.state.counts.get(op, 0)

    def inject(
        self, op: str, action: str, times: int = 1, *, after: int = 0, message: str = ""
    ) -> Fault:
        fault = Fault(op, action, times, after, message)
        with self.state.lock:
            self.state.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.state.lock:
            self.state.faults.clear()

    def committed(self, table: str, partition: str | None = None) -> pa.Table:
        """Committed rows straight from the store (tests also read back through pyodps)."""
        with self.state.lock:
            t = self.state.tables[table.lower()]
            parts = t.decoded(_partition_spec(partition))
        return (
            pa.concat_tables(parts)
            if parts
            else odps_schema_to_arrow_schema(t.data_schema).empty_table()
        )

    def start(self) -> OdpsServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.02},
            name="odps-loopback",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self.state.stopped.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> OdpsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------
# test helpers

TEST_ACCESS_ID = "LTAI-test-access-id"
TEST_SECRET = "s3cr3t-Do-Not-Leak-0123456789abcdef"


def sink_config(
    server: OdpsServer, table: str, partition: str | None = None, **extra: Any
) -> dict[str, Any]:
    """A RecIS-style config pointing at ``server``."""
    config: dict[str, Any] = {
        "access_id": TEST_ACCESS_ID,
        "access_key": TEST_SECRET,
        "project": server.project,
        "end_point": server.endpoint,
        "table_name": table,
        "tunnel_endpoint": server.tunnel_endpoint,
    }
    if partition is not None:
        config["partition"] = partition
    config.update(extra)
    return config


def pyodps_client(server: OdpsServer) -> Any:
    """pyodps's own client, pointed at ``server`` with the test credentials."""
    from odps import ODPS

    return ODPS(
        TEST_ACCESS_ID,
        TEST_SECRET,
        server.project,
        server.endpoint,
        tunnel_endpoint=server.tunnel_endpoint,
        overwrite_global=False,
    )


def read_with_pyodps(
    server: OdpsServer, table: str, partition: str | None = None, *, arrow: bool = False
) -> list[dict[str, Any]]:
    """Read a table (partition) back through pyodps's own download tunnel."""
    t = pyodps_client(server).get_table(table)
    names = [c.name for c in t.table_schema.simple_columns]
    if arrow:
        with t.open_reader(partition=partition, arrow=True) as reader:
            return list(reader.read_all().to_pylist())
    with t.open_reader(partition=partition) as reader:
        return [{n: record[n] for n in names} for record in reader]


if __name__ == "__main__":  # pragma: no cover - used by benchmarks/bench_trace.py
    import sys

    # a separate process, as a real service would be: print the port, serve until killed
    _args = [a for a in sys.argv[1:] if a != "--defer-decoding"]
    with OdpsServer(
        _args[0] if _args else "trace_proj", defer_decoding="--defer-decoding" in sys.argv
    ) as _server:
        print(_server.port, flush=True)
        threading.Event().wait()
