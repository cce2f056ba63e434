from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from odps_server import (
    TEST_ACCESS_ID,
    TEST_SECRET,
    OdpsServer,
    pyodps_client,
    read_with_pyodps,
    sink_config,
)
from trace_data import ALL_FIELDS, ALL_TYPES, all_types_batch, expected_row, simple_batches

from recis_async.sinks import Attempt, OdpsSink, SinkError
from recis_async.trace.buffer import ColumnBuffer
from recis_async.trace.odps import _Crc32c, _use_hardware_crc
from recis_async.trace.schema import parse_type

SIMPLE = (("id", "v"), ("bigint", "double"))


@pytest.fixture
def server() -> Iterator[OdpsServer]:
    with OdpsServer("trace_proj") as srv:
        yield srv


_OPENED: list[OdpsSink] = []


@pytest.fixture(autouse=True)
def _close_opened_sinks() -> Iterator[None]:
    """Close what a test opened: an open sink keeps its redacting filters on pyodps's loggers,
    and the safety tests check that none are left."""
    yield
    while _OPENED:
        _OPENED.pop().close()


def opened(
    sink: OdpsSink, fields: tuple[str, ...] | list[str], types: tuple[str, ...] | list[str]
) -> OdpsSink:
    sink.open(tuple(fields), tuple(parse_type(t) for t in types))
    _OPENED.append(sink)
    return sink


def simple_sink(
    server: OdpsServer, table: str = "t", partition: str | None = "dt=20261122"
) -> OdpsSink:
    return opened(OdpsSink(sink_config(server, table, partition)), *SIMPLE)


def ids(server: OdpsServer, table: str = "t", partition: str | None = "dt=20261122") -> list[int]:
    return sorted(row["id"] for row in read_with_pyodps(server, table, partition))


def test_every_type_round_trips_through_odps(server: OdpsServer) -> None:
    sink = opened(
        OdpsSink(sink_config(server, "all_types", "dt=20261122,hour=10")), ALL_FIELDS, ALL_TYPES
    )
    sink.write(all_types_batch(rows=6, steps=3), Attempt())
    expected = [expected_row(i) for i in range(6)]
    assert read_with_pyodps(server, "all_types", "dt=20261122,hour=10") == expected
    assert read_with_pyodps(server, "all_types", "dt=20261122,hour=10", arrow=True) == expected
    # the server decoded the block with pyodps's arrow tunnel reader and stored typed columns
    stored = server.committed("all_types", "dt=20261122,hour=10")
    assert str(stored.schema.field("c_arr_float").type) == "list<item: float>"


def test_blocks_are_checksummed_in_hardware_and_pyodps_verifies_them(
    server: OdpsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from odps.tunnel import TableTunnel

    sink = simple_sink(server)
    # the pinned pyodps keeps its block checksums where the sink swaps in the fast ones
    tunnel = TableTunnel(pyodps_client(server), endpoint=server.tunnel_endpoint)
    writer = tunnel.create_upload_session("t", partition_spec="dt=20261122").open_arrow_writer(0)
    _use_hardware_crc(writer)
    assert isinstance(writer._crc, _Crc32c) and isinstance(writer._crccrc, _Crc32c)
    writer.close()  # an uncommitted session: nothing lands

    # ~640 KB: ten 64 KiB chunks, each with its CRC, then the block's; the service decodes
    # with pyodps's reader, which checks them all
    buffer = ColumnBuffer(*SIMPLE)
    for step in range(8):
        rows = np.arange(step * 5000, (step + 1) * 5000)
        buffer.append({"id": rows, "v": rows * 0.5})
    batch = buffer.seal()
    assert batch is not None
    sink.write(batch, Attempt())
    assert ids(server) == list(range(40_000))

    # and a wrong checksum is refused, so the check above is real
    monkeypatch.setattr(_Crc32c, "getvalue", lambda self: self._value ^ 1)
    with pytest.raises(SinkError, match="MalformedDataStream"):
        sink.write(simple_batches(1, seq_start=9000)[0], Attempt())
    assert len(ids(server)) == 40_000


def test_open_creates_table_and_partition_then_reuses_them(server: OdpsServer) -> None:
    first = simple_sink(server, "t", "dt=1,hour=2")
    assert server.counts("instance") >= 2  # CREATE TABLE and ADD PARTITION ran as SQL jobs
    assert server.state.tables["t"].columns == [("id", "bigint"), ("v", "double")]
    assert server.state.tables["t"].partition_keys == [("dt", "string"), ("hour", "string")]
    assert "dt=1,hour=2" in server.state.partitions["t"]
    first.write(simple_batches(1)[0], Attempt())
    before = server.counts("instance")
    second = simple_sink(server, "t", "dt=1,hour=2")  # exists: no DDL
    assert server.counts("instance") == before
    second.write(simple_batches(1, seq_start=1)[0], Attempt())
    assert ids(server, "t", "dt=1,hour=2") == list(range(10))


def test_an_existing_table_with_other_columns_is_a_permanent_error(server: OdpsServer) -> None:
    simple_sink(server, "t", None)
    other = OdpsSink(sink_config(server, "t"))
    with pytest.raises(SinkError) as info:
        opened(other, ("id", "v"), ("bigint", "string"))
    assert info.value.transient is False
    assert "existing table has columns id bigint, v double; expected id bigint, v string" in str(
        info.value
    )
    partitioned = OdpsSink(sink_config(server, "t", "dt=1"))
    with pytest.raises(
        SinkError, match="partitioned by nothing; the configured partition has keys"
    ):
        opened(partitioned, *SIMPLE)


@pytest.mark.parametrize(
    ("action", "transient"),
    [("503", True), ("reset", True), ("4xx", False)],
)
def test_block_upload_failures_are_classified_and_commit_nothing(
    server: OdpsServer, action: str, transient: bool
) -> None:
    sink = simple_sink(server)
    server.inject("put_block", action)
    attempt = Attempt()
    with pytest.raises(SinkError) as info:
        sink.write(simple_batches(1)[0], attempt)
    assert info.value.transient is transient
    assert attempt.token is None  # nothing was in doubt: the commit never started
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert ids(server) == []
    sink.write(simple_batches(1)[0], Attempt())  # a fresh session succeeds
    assert ids(server) == list(range(5))


def test_a_lost_commit_response_is_settled_without_resending(server: OdpsServer) -> None:
    sink = simple_sink(server)
    server.inject("commit", "lost")
    attempt = Attempt()
    sink.write(simple_batches(1)[0], attempt)  # returns: the session is CLOSED
    assert ids(server) == list(range(5))
    assert server.counts("create_upload") == 1 and server.counts("put_block") == 1
    assert any("fault lost response commit" in line for line in server.log_lines)


def test_a_commit_in_doubt_is_kept_and_settled_by_the_next_attempt(server: OdpsServer) -> None:
    sink = simple_sink(server)
    (batch,) = simple_batches(1)
    server.inject("commit", "lost")
    # pyodps reloads the session before committing; fail the status read after the commit
    server.inject("reload_upload", "reset", times=10, after=1)
    attempt = Attempt()
    with pytest.raises(SinkError, match="outcome is unknown") as info:
        sink.write(batch, attempt)
    assert info.value.transient is True
    token = attempt.token
    assert token is not None and token in server.state.uploads
    server.clear_faults()
    sink.write(batch, Attempt(token))
    assert ids(server) == list(range(5))  # exactly once
    assert server.counts("create_upload") == 1  # nothing was uploaded again


def test_a_rejected_commit_resolves_the_doubt(server: OdpsServer) -> None:
    sink = simple_sink(server)
    server.inject("commit", "4xx")
    attempt = Attempt()
    with pytest.raises(SinkError) as info:
        sink.write(simple_batches(1)[0], attempt)
    assert info.value.transient is False and "NoPermission" in str(info.value)
    assert attempt.token is None  # the session is NORMAL: never committed
    assert ids(server) == []


def test_an_abandoned_attempt_does_not_commit(server: OdpsServer) -> None:
    sink = simple_sink(server)
    attempt = Attempt()
    attempt.abandon()
    with pytest.raises(SinkError, match="abandoned"):
        sink.write(simple_batches(1)[0], attempt)
    assert server.counts("commit") == 0 and ids(server) == []


def test_credentials_never_show(
    server: OdpsServer, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, pyodps's request logs included
    sink = opened(OdpsSink(sink_config(server, "t", "dt=1")), *SIMPLE)
    texts = [repr(sink), sink.name, str(vars(sink))]
    for op, action in [
        ("put_block", "503"),
        ("put_block", "reset"),
        ("put_block", "4xx"),
        ("commit", "lost"),
        ("create_upload", "4xx"),
    ]:
        server.inject(op, action)
        try:
            sink.write(simple_batches(1)[0], Attempt())
        except SinkError as exc:
            texts += [str(exc), repr(exc)]
    with pytest.raises(TypeError):
        pickle.dumps(sink)
    out, err = capsys.readouterr()
    texts += [caplog.text, out, err, *server.log_lines]
    assert len(texts) > 8 and "Authorization" in caplog.text  # the requests were logged
    for text in texts:
        assert TEST_SECRET not in text


def test_wrapped_error_messages_are_scrubbed(server: OdpsServer) -> None:
    sink = opened(OdpsSink(sink_config(server, "t", "dt=1")), *SIMPLE)
    # a server error echoing the key pair (as a misbehaving proxy might)
    server.inject("put_block", "4xx", message=f"denied for {TEST_ACCESS_ID}:{TEST_SECRET}")
    with pytest.raises(SinkError) as info:
        sink.write(simple_batches(1)[0], Attempt())
    assert "denied for ***:***" in str(info.value)
    assert TEST_SECRET not in str(info.value) and TEST_ACCESS_ID not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_credentials_may_come_from_the_environment(
    server: OdpsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_ID", TEST_ACCESS_ID)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", TEST_SECRET)
    config = sink_config(server, "t", "dt=1")
    del config["access_id"], config["access_key"]
    sink = opened(OdpsSink(config), *SIMPLE)
    sink.write(simple_batches(1)[0], Attempt())
    assert ids(server, "t", "dt=1") == list(range(5))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"project": None}, "config: missing required key(s): project"),
        ({"table_name": None, "end_point": None}, "missing required key(s): end_point, table_name"),
        (
            {"access_key": None},
            "access_key (or the ALIBABA_CLOUD_ACCESS_KEY_SECRET environment variable)",
        ),
        (
            {"endpoint": "http://x"},
            "config: unknown key(s) 'endpoint'; expected access_id, access_key",
        ),
        (
            {"end_point": "service.odps"},
            "config['end_point']: expected an http(s) URL, got 'service.odps'",
        ),
        ({"table_name": ""}, "config['table_name']: expected a non-empty string, got ''"),
        ({"access_key": 12}, "config['access_key']: expected a non-empty string, got <redacted>"),
        ({"partition": "dt"}, "config['partition']: expected 'key=value' pairs, got 'dt'"),
    ],
)
def test_config_errors_fail_in_the_constructor(
    server: OdpsServer, monkeypatch: pytest.MonkeyPatch, change: dict[str, object], message: str
) -> None:
    monkeypatch.delenv("ALIBABA_CLOUD_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", raising=False)
    config: dict[str, object] = dict(sink_config(server, "t"))
    for key, value in change.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    with pytest.raises(ValueError) as info:
        OdpsSink(config)
    assert message in str(info.value)
    assert TEST_SECRET not in str(info.value)


def test_pyodps_is_imported_lazily_and_leaves_no_global_entry(tmp_path: Path) -> None:
    script = tmp_path / "lazy.py"
    script.write_text(
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from odps_server import OdpsServer, sink_config\n"
        "sys.modules.pop('odps', None)\n"
        "[sys.modules.pop(m) for m in list(sys.modules) if m.startswith('odps.')]\n"
        "from recis_async.sinks import OdpsSink\n"
        "from recis_async.trace.schema import parse_type\n"
        "with OdpsServer() as server:\n"
        "    sink = OdpsSink(sink_config(server, 't'))\n"
        "    assert 'odps' not in sys.modules, 'imported at construction'\n"
        "    sink.open(('id',), (parse_type('bigint'),))\n"
        "    from odps import options\n"
        "    assert options.account is None and options.default_project is None\n"
        "print('ok')\n"
    )
    tests_dir = str(Path(__file__).resolve().parents[1])
    result = subprocess.run(
        [sys.executable, str(script), tests_dir],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_loopback_service_decodes_record_format_blocks_too(server: OdpsServer) -> None:
    """pyodps's classic protobuf record writer, straight through its tunnel API."""
    from odps.models import TableSchema
    from odps.tunnel import TableTunnel

    odps = pyodps_client(server)
    odps.create_table("rec", TableSchema.from_lists(["id", "tags"], ["bigint", "array<string>"]))
    session = TableTunnel(odps, endpoint=server.tunnel_endpoint).create_upload_session("rec")
    with session.open_record_writer(3) as writer:
        for i in range(4):
            writer.write(session.new_record([i, [f"t{i}"] * i]))
    session.commit([3])
    assert read_with_pyodps(server, "rec") == [{"id": i, "tags": [f"t{i}"] * i} for i in range(4)]
