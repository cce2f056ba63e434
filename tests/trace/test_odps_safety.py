"""OdpsSink under a user's mistakes and a hostile log level: endpoints with user info, keys
pasted with whitespace, DEBUG logging on the root logger, an endpoint that refuses
connections.  All against pyodps's real client and the loopback service."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from odps_server import TEST_ACCESS_ID, TEST_SECRET, OdpsServer, read_with_pyodps, sink_config

from recis_async import HookBus, HookError, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceToOdpsHook
from recis_async.sinks import Attempt, OdpsSink
from recis_async.spill import read_spill
from recis_async.trace.schema import parse_type

SIMPLE = (("id",), (parse_type("bigint"),))
_AUTH_VALUE = re.compile(r"(?i)authorization['\"]?\s*[:=]\s*['\"]?([^'\"\r\n,}]*)")


@pytest.fixture
def server() -> Iterator[OdpsServer]:
    with OdpsServer("trace_proj") as srv:
        yield srv


@pytest.fixture
def no_env_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ALIBABA_CLOUD_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", raising=False)


# ----------------------------------------------------------------------------- defect 6


@pytest.mark.parametrize("key", ["end_point", "tunnel_endpoint"])
@pytest.mark.parametrize(
    "url",
    [
        "http://AKIDuser:SECRETpass@odps.example.com/api",
        "https://SECRETpass@odps.example.com",
        "AKIDuser:SECRETpass@odps.example.com/api",  # no scheme: parsed as scheme 'akiduser'
    ],
)
def test_an_endpoint_with_user_info_is_refused_without_echoing_it(
    server: OdpsServer, key: str, url: str
) -> None:
    with pytest.raises(ValueError) as info:
        OdpsSink(sink_config(server, "t", **{key: url}))
    message = str(info.value)
    assert message.startswith(f"config[{key!r}]: expected an http(s) URL without user info")
    assert "***@odps.example.com" in message
    assert "SECRETpass" not in message and "AKIDuser" not in message


def test_an_endpoint_query_is_refused_without_echoing_it(server: OdpsServer) -> None:
    with pytest.raises(ValueError) as info:
        OdpsSink(sink_config(server, "t", end_point="http://h.example.com/api?token=SECRETq"))
    assert "without query or fragment" in str(info.value) and "SECRETq" not in str(info.value)


@pytest.mark.parametrize("key", ["access_id", "access_key"])
@pytest.mark.parametrize(
    ("value", "what"),
    [
        ("{v}\n", "trailing '\\n'"),
        (" {v}", "leading ' '"),
        ("{v}\r\n", "trailing '\\r\\n'"),
        ("{v}\t", "trailing '\\t'"),
    ],
)
def test_a_key_with_surrounding_whitespace_is_refused_naming_the_field(
    server: OdpsServer, no_env_credentials: None, key: str, value: str, what: str
) -> None:
    real = TEST_ACCESS_ID if key == "access_id" else TEST_SECRET
    with pytest.raises(ValueError) as info:
        OdpsSink(sink_config(server, "t", **{key: value.format(v=real)}))
    assert str(info.value) == (
        f"config[{key!r}]: expected no leading or trailing whitespace, got a value with {what}"
    )


@pytest.mark.parametrize("key", ["access_id", "access_key"])
def test_a_key_with_inner_whitespace_or_control_characters_is_refused(
    server: OdpsServer, no_env_credentials: None, key: str
) -> None:
    for bad in (f"{TEST_SECRET[:5]} {TEST_SECRET[5:]}", f"{TEST_SECRET[:5]}\x00{TEST_SECRET[5:]}"):
        with pytest.raises(ValueError, match=rf"config\['{key}'\]: expected a key without") as info:
            OdpsSink(sink_config(server, "t", **{key: bad}))
        assert TEST_SECRET[5:] not in str(info.value)


def test_a_key_from_the_environment_with_a_newline_is_refused_naming_the_variable(
    server: OdpsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_ID", TEST_ACCESS_ID)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", TEST_SECRET + "\n")
    config = sink_config(server, "t")
    del config["access_id"], config["access_key"]
    with pytest.raises(ValueError) as info:
        OdpsSink(config)
    assert str(info.value) == (
        "the ALIBABA_CLOUD_ACCESS_KEY_SECRET environment variable: expected no leading or "
        "trailing whitespace, got a value with trailing '\\n'"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"project": 5}, "config['project']: expected a non-empty string, got 5"),
        ({"project": " trace_proj"}, "config['project']: expected no leading or trailing"),
        ({"table_name": "t; DROP"}, "config['table_name']: expected a name of letters, digits"),
        ({"table_name": ["t"]}, "config['table_name']: expected a non-empty string, got ['t']"),
        ({"end_point": b"http://x"}, "config['end_point']: expected a non-empty string, got b'"),
        ({"tunnel_endpoint": "tunnel"}, "config['tunnel_endpoint']: expected an http(s) URL"),
        ({"partition": 20261122}, "config['partition']: expected a string like 'dt=20261122"),
        ({"access_id": 7}, "config['access_id']: expected a non-empty string, got <redacted>"),
    ],
)
def test_every_config_key_is_type_checked(
    server: OdpsServer, no_env_credentials: None, change: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        OdpsSink({**sink_config(server, "t"), **change})
    assert str(info.value).startswith(message)


# ----------------------------------------------------------------------------- defect 7


class _Records(logging.Handler):
    """Every record reaching the root logger, formatted as a user's DEBUG handler would."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.records: list[logging.LogRecord] = []
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.texts.append(self.format(record))


@pytest.fixture
def root_at_debug() -> Iterator[_Records]:
    root = logging.getLogger()
    handler, level = _Records(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _assert_clean(texts: list[str]) -> None:
    for text in texts:
        assert TEST_SECRET not in text and TEST_ACCESS_ID not in text, text
        for value in _AUTH_VALUE.findall(text):
            assert value == "***", text


def _redactors() -> list[logging.Filterer]:
    """The sinks' redacting filters left on any logger."""
    return [
        f
        for logger in [logging.getLogger("odps"), *logging.Logger.manager.loggerDict.values()]
        if isinstance(logger, logging.Logger)
        for f in logger.filters
        if type(f).__name__ == "_Redactor"
    ]


@pytest.mark.anyio
async def test_no_credential_reaches_any_log_record_at_debug(
    server: OdpsServer, root_at_debug: _Records, tmp_path: Path
) -> None:
    # a real upload through the bus, with failures: a 503, a reset, a lost commit, and a
    # permanent error whose message echoes the key pair (as a misbehaving proxy might)
    server.inject("put_block", "503")
    server.inject("put_block", "reset", after=1)
    server.inject("commit", "lost", after=1)
    server.inject("put_block", "4xx", after=5, message=f"denied for {TEST_ACCESS_ID}:{TEST_SECRET}")
    hook = TraceToOdpsHook(
        sink_config(server, "t", "dt=1"),
        ["id"],
        ["bigint"],
        size_threshold=64,
        retry_backoff=0.01,
        spill_dir=tmp_path / "spill",
    )
    with pytest.raises(HookError):
        async with HookBus() as bus:
            bus.add_hook(hook)
            for step in range(12):
                await bus.publish(BeforeStep(global_step=step))
                add_to_trace("id", np.arange(step * 4, step * 4 + 4))
                await bus.publish(AfterStep(global_step=step))
                await anyio.sleep(0.02)
    texts = root_at_debug.texts
    names = {r.name for r in root_at_debug.records}
    # pyodps did log its signed headers, its requests and the tracebacks of its errors
    assert "odps.accounts" in names and "odps.rest" in names and "urllib3.connectionpool" in names
    assert sum("Authorization" in t for t in texts) >= 10
    _assert_clean(texts)
    # the rows: delivered once or spilled (the 4xx), none lost
    delivered = sorted(r["id"] for r in read_with_pyodps(server, "t", "dt=1"))
    spilled = [
        i
        for path in (tmp_path / "spill").glob("*.arrows")
        for e in read_spill(path).entries
        for i in e.batch.to_arrow().column("id").to_pylist()
    ]
    assert sorted(delivered + spilled) == list(range(48))
    # the last sink closed: no redactor is left on any logger
    assert _redactors() == []


def test_tracebacks_logged_by_pyodps_are_redacted_too(
    server: OdpsServer, root_at_debug: _Records
) -> None:
    sink = OdpsSink(sink_config(server, "t"))
    sink.open(*SIMPLE)
    try:
        raise RuntimeError(f"signing failed: Authorization: ODPS {TEST_ACCESS_ID}:c2lnbmF0dXJl")
    except RuntimeError:
        logging.getLogger("odps.accounts").exception("Failed to sign request on SignServer.")
    logging.getLogger("urllib3.connectionpool").debug("retry %s", TEST_SECRET, stack_info=True)
    sink.close()
    texts = root_at_debug.texts[-2:]
    assert "RuntimeError: signing failed: Authorization: ***" in texts[0]
    assert "retry ***" in texts[1] and "Stack (most recent call last)" in texts[1]
    _assert_clean(root_at_debug.texts)


def test_several_sinks_share_one_redactor_per_logger_until_the_last_closes(
    server: OdpsServer, root_at_debug: _Records
) -> None:
    first = OdpsSink(sink_config(server, "t"))
    other = dict(sink_config(server, "u"), access_id="LTAI-other-id", access_key="other-S3CRET")
    second = OdpsSink(other)
    first.open(*SIMPLE)
    second.open(*SIMPLE)
    accounts = logging.getLogger("odps.accounts")
    assert [type(f).__name__ for f in accounts.filters].count("_Redactor") == 1
    accounts.debug("keys %s %s", TEST_SECRET, "other-S3CRET")
    assert root_at_debug.texts[-1].endswith("keys *** ***")
    first.close()  # the second sink's keys stay masked
    accounts.debug("key %s", "other-S3CRET")
    assert root_at_debug.texts[-1].endswith("key ***")
    second.write(_batch(), Attempt())
    assert TEST_ACCESS_ID not in " ".join(root_at_debug.texts)
    assert "other-S3CRET" not in " ".join(root_at_debug.texts)
    second.close()
    assert _redactors() == []
    # and a failed open leaves nothing behind either
    refused = OdpsSink(sink_config(server, "t", end_point=f"http://127.0.0.1:{_closed_port()}/api"))
    with pytest.raises(Exception, match="cannot open"):
        refused.open(*SIMPLE)
    assert _redactors() == []


def _batch() -> Any:
    from recis_async.trace.buffer import ColumnBuffer

    buffer = ColumnBuffer(["id"], ["bigint"])
    buffer.append({"id": np.arange(3)})
    return buffer.seal()


# ----------------------------------------------------------------------------- defect 8


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Timed(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((time.monotonic(), record.getMessage()))


@pytest.mark.anyio
async def test_a_refused_endpoint_is_reported_at_once_and_named_in_the_error(
    tmp_path: Path,
) -> None:
    import odps.tunnel  # noqa: F401 - not timing pyodps's import

    config = {
        "access_id": TEST_ACCESS_ID,
        "access_key": TEST_SECRET,
        "project": "trace_proj",
        "end_point": f"http://127.0.0.1:{_closed_port()}/api",
        "table_name": "t",
    }
    hook = TraceToOdpsHook(config, ["id"], ["bigint"], spill_dir=tmp_path / "spill")
    timed = _Timed()
    writer_logger = logging.getLogger("recis_async.trace.service")
    writer_logger.addHandler(timed)
    try:
        with pytest.raises(HookError) as info:
            async with HookBus(flush_timeout=4) as bus:
                start = time.monotonic()
                bus.add_hook(hook)
                for step in range(20):
                    await bus.publish(BeforeStep(global_step=step))
                    add_to_trace("id", np.arange(step * 3, step * 3 + 3))
                    await bus.publish(AfterStep(global_step=step))
                    await anyio.sleep(0.15)
    finally:
        writer_logger.removeHandler(timed)
    first_at, first = timed.seen[0]
    assert "cannot open the sink yet" in first and "Connection refused" in first
    assert first_at - start < 3.0
    message = str(info.value)
    assert "Last error: None" not in message and "None" not in message
    assert re.search(r"Last error: .*Connection refused", message), message
    (path,) = (tmp_path / "spill").glob("*.arrows")
    spill = read_spill(path)
    assert "Connection refused" in spill.reason
    assert sorted(
        i for e in spill.entries for i in e.batch.to_arrow().column("id").to_pylist()
    ) == list(range(60))


@pytest.mark.anyio
async def test_a_deadline_during_the_first_upload_still_names_the_cause(
    server: OdpsServer, tmp_path: Path
) -> None:
    server.inject("put_block", "slow:1.5", times=10)
    hook = TraceToOdpsHook(
        sink_config(server, "t", "dt=1"), ["id"], ["bigint"], spill_dir=tmp_path / "spill"
    )
    with pytest.raises(HookError) as info:
        async with HookBus(flush_timeout=0.3) as bus:
            bus.add_hook(hook)
            await bus.publish(BeforeStep(global_step=0))
            add_to_trace("id", np.arange(5))
            await bus.publish(AfterStep(global_step=0))
    message = str(info.value)
    assert "None" not in message
    assert "Last error: batch 0: the close deadline passed during its upload" in message


def test_redacting_a_huge_record_takes_linear_time() -> None:
    """pyodps logs whole response bodies at DEBUG: a long run of word characters must not
    make the redactor backtrack quadratically (it did: ~50 s for 20 kB, hours for 1 MB).
    In a subprocess, so a regression fails by timeout instead of stalling the suite."""
    script = (
        "import logging\n"
        "from recis_async.trace.odps import _Redactor\n"
        "r = _Redactor.register(logging.getLogger('odps.rest'), object(), ('k3y',))\n"
        "record = logging.LogRecord('odps.rest', 10, 'f', 1, 'body: %s', ('A' * 1_000_000 "
        "+ ' k3y token=abc',), None)\n"
        "r.filter(record)\n"
        "print(record.getMessage()[-15:])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "A *** token=***\n"
