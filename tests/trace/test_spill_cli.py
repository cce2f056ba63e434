"""``python -m recis_async.spill``, end to end in subprocesses: a spill file made by a real
TraceHook whose sink failed is inspected, replayed to Parquet (read back with pyarrow) and to
the loopback ODPS service (read back with pyodps), interrupted and rerun without duplicates;
bad inputs give one line and a non-zero status."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pytest
from odps_server import TEST_ACCESS_ID, TEST_SECRET, OdpsServer, read_with_pyodps, sink_config
from trace_data import simple_batches

from recis_async import HookBus, HookError, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceToOdpsHook
from recis_async.spill import SpillEntry, journal_path, write_spill
from recis_async.spill.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
ROWS = 20  # 5 steps of 4 rows: two sealed batches of 8 rows and a remainder of 4


@pytest.fixture
def server() -> Iterator[OdpsServer]:
    with OdpsServer("trace_proj") as srv:
        yield srv


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def spill_file(tmp_path: Path) -> Path:
    """A spill file written by TraceToOdpsHook when its endpoint refused every connection:
    three batches (8 + 8 + 4 rows) left at the close deadline."""
    config = {
        "access_id": TEST_ACCESS_ID,
        "access_key": TEST_SECRET,
        "project": "trace_proj",
        "end_point": f"http://127.0.0.1:{_closed_port()}/api",
        "table_name": "t",
        "partition": "dt=1",
    }
    hook = TraceToOdpsHook(
        config,
        ["id"],
        ["bigint"],
        size_threshold=64,
        retry_backoff=30.0,  # the worker waits to retry the first batch until the deadline
        spill_dir=tmp_path / "spill",
    )

    async def run() -> None:
        async with HookBus(flush_timeout=0.5) as bus:
            bus.add_hook(hook)
            for step in range(5):
                await bus.publish(BeforeStep(global_step=step))
                add_to_trace("id", np.arange(step * 4, step * 4 + 4))
                await bus.publish(AfterStep(global_step=step))

    with pytest.raises(HookError, match="Connection refused"):
        anyio.run(run)
    (path,) = (tmp_path / "spill").glob("*.arrows")
    return path


def cli(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ALIBABA_CLOUD_")}
    return subprocess.run(
        [sys.executable, "-m", "recis_async.spill", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def run(capsys: pytest.CaptureFixture[str], *args: object) -> subprocess.CompletedProcess[str]:
    """The same command line in this process (``main``), for the many bad-input cases:
    a subprocess each costs seconds of interpreter and torch start-up."""
    capsys.readouterr()
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), status, out, err)


def one_line_failure(result: subprocess.CompletedProcess[str], command: str) -> str:
    assert result.returncode == 1, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"spill {command}: ")
    assert TEST_SECRET not in result.stderr and TEST_ACCESS_ID not in result.stderr
    return lines[0]


def parquet_ids(root: Path, table: str = "t") -> list[int]:
    return sorted(
        pads.dataset(root / table, partitioning="hive").to_table().column("id").to_pylist()
    )


def odps_config(tmp_path: Path, server: OdpsServer, **change: object) -> Path:
    config: dict[str, object] = dict(sink_config(server, "t", "dt=1"))
    del config["access_id"], config["access_key"]  # from the environment
    config.update(change)
    path = tmp_path / f"odps-{len(list(tmp_path.glob('odps-*.json')))}.json"
    path.write_text(json.dumps(config))
    return path


ENV = {
    "ALIBABA_CLOUD_ACCESS_KEY_ID": TEST_ACCESS_ID,
    "ALIBABA_CLOUD_ACCESS_KEY_SECRET": TEST_SECRET,
}


# ------------------------------------------------------------------------------ help, inspect


def test_help_says_what_each_command_does(capsys: pytest.CaptureFixture[str]) -> None:
    top = cli("--help")
    assert top.returncode == 0
    for words in ("inspect", "replay", "exactly once", "run again", "exit status", "spill_dir"):
        assert words in top.stdout
    replay = cli("replay", "--help")
    assert replay.returncode == 0
    for words in ("--parquet ROOT", "--odps-config", "--table", "--partition"):
        assert words in replay.stdout
    assert "ALIBABA_CLOUD_ACCESS_KEY_ID" in replay.stdout and "never printed" in replay.stdout
    with pytest.raises(SystemExit) as usage:  # neither --parquet nor --odps-config
        main(["replay", "x.arrows"])
    assert usage.value.code == 2
    assert "one of the arguments --parquet --odps-config" in capsys.readouterr().err


def test_inspect_shows_fields_batches_rows_and_reason(spill_file: Path) -> None:
    human = cli("inspect", spill_file)
    assert human.returncode == 0, human.stderr
    out = human.stdout
    assert f"file      {spill_file}" in out
    assert "sink      odps:trace_proj.t/dt=1" in out
    assert "reason    not delivered by the close deadline; last error:" in out
    assert "Connection refused" in out
    assert "id  bigint" in out and "batches   3, 20 rows" in out
    assert out.count("to deliver") == 3
    assert TEST_SECRET not in out and TEST_ACCESS_ID not in out

    data = json.loads(cli("inspect", spill_file, "--json").stdout)
    assert data["fields"] == [{"name": "id", "type": "bigint"}]
    assert [(b["seq"], b["rows"]) for b in data["batches"]] == [(0, 8), (1, 8), (2, 4)]
    assert data["rows"] == ROWS and data["in_doubt"] == [] and data["replayed_batches"] == []
    assert data["sink"] == "odps:trace_proj.t/dt=1" and "Connection refused" in data["reason"]
    assert spill_file.exists()  # inspecting changes nothing


def test_inspect_shows_uploads_in_doubt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = simple_batches(2)
    path = write_spill(
        tmp_path,
        [SpillEntry(first, "UPLOAD-7F3A"), SpillEntry(second, None)],
        sink_name="odps:p.t",
        reason="retries exhausted: SinkError: outcome unknown",
    )
    data = json.loads(run(capsys, "inspect", path, "--json").stdout)
    assert data["in_doubt"] == ["UPLOAD-7F3A"]
    assert [b["in_doubt"] for b in data["batches"]] == ["UPLOAD-7F3A", None]
    assert "in doubt: UPLOAD-7F3A (settled before anything is sent again)" in (
        run(capsys, "inspect", path).stdout
    )


# ------------------------------------------------------------------------------------ replay


def test_replay_to_parquet_delivers_every_row_once_and_removes_the_file(
    spill_file: Path, tmp_path: Path
) -> None:
    root = tmp_path / "traces"
    result = cli("replay", spill_file, "--parquet", root)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"delivered 3 batch(es) (20 rows) to parquet:{root}/t/dt=1; removed {spill_file}\n"
    )
    assert parquet_ids(root) == list(range(ROWS))
    table = pads.dataset(root / "t", partitioning="hive").to_table()
    assert set(table.column("dt").to_pylist()) == {1}
    assert not spill_file.exists() and not journal_path(spill_file).exists()
    again = cli("replay", spill_file, "--parquet", root)  # nothing left: no duplicate either
    assert "no such file" in one_line_failure(again, "replay")
    assert parquet_ids(root) == list(range(ROWS))


def test_replay_to_parquet_into_another_table_and_partition(
    spill_file: Path, tmp_path: Path
) -> None:
    root = tmp_path / "traces"
    result = cli("replay", spill_file, "--parquet", root, "--table", "ctr", "--partition", "dt=9")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (root / "ctr").iterdir()) == ["dt=9"]
    assert parquet_ids(root, "ctr") == list(range(ROWS))


def test_replay_to_odps_takes_credentials_from_the_environment(
    spill_file: Path, tmp_path: Path, server: OdpsServer
) -> None:
    result = cli("replay", spill_file, "--odps-config", odps_config(tmp_path, server), env=ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("delivered 3 batch(es) (20 rows) to odps:trace_proj.t/dt=1")
    assert sorted(r["id"] for r in read_with_pyodps(server, "t", "dt=1")) == list(range(ROWS))
    assert TEST_SECRET not in result.stdout + result.stderr
    assert TEST_ACCESS_ID not in result.stdout + result.stderr


def test_a_replay_failing_midway_is_rerun_without_duplicates(
    spill_file: Path, tmp_path: Path, server: OdpsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = odps_config(tmp_path, server)
    server.inject("commit", "4xx", after=1)  # the second batch's commit is refused
    failed = cli("replay", spill_file, "--odps-config", config, "-v", env=ENV)
    assert failed.returncode == 1
    reason = failed.stderr.splitlines()[-1]
    assert reason.startswith("spill replay: odps:trace_proj.t/dt=1: cannot commit batch 1")
    assert "NoPermission" in reason and "1 of 3 batches are delivered" in reason
    assert TEST_SECRET not in failed.stderr and TEST_ACCESS_ID not in failed.stderr
    progress = json.loads(run(capsys, "inspect", spill_file, "--json").stdout)
    assert progress["replayed_batches"] == [0] and progress["replayed_rows"] == 8
    assert "replayed  1 of 3 batches" in run(capsys, "inspect", spill_file).stdout

    server.clear_faults()
    rerun = cli("replay", spill_file, "--odps-config", config, env=ENV)
    assert rerun.returncode == 0, rerun.stderr
    assert "delivered 2 batch(es) (12 rows)" in rerun.stdout and "1 by an earlier" in rerun.stdout
    assert sorted(r["id"] for r in read_with_pyodps(server, "t", "dt=1")) == list(range(ROWS))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_killed_replay_is_rerun_without_duplicates(
    spill_file: Path, tmp_path: Path, server: OdpsServer, sig: signal.Signals
) -> None:
    """SIGKILL (or Ctrl-C) while the second batch's commit is under way: the commit lands
    after the process stopped; the rerun finds it applied (the journal named its upload
    session) and sends only the third batch."""
    config = odps_config(tmp_path, server)
    server.inject("commit", "slow:2", after=1)
    base = {k: v for k, v in os.environ.items() if not k.startswith("ALIBABA_CLOUD_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "recis_async.spill", "replay", str(spill_file)]
        + ["--odps-config", str(config)],
        env={**base, "PYTHONPATH": str(ROOT), **ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    journal = journal_path(spill_file)
    deadline = time.monotonic() + 90
    while server.counts("commit") < 2:  # the second commit reached the server (it waits 2 s)
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and out == ""
        assert err == (
            "spill replay: interrupted; run the same command again to continue "
            "(nothing is delivered twice)\n"
        )
    assert '"seq": 1, "token"' in journal.read_text()  # recorded before the commit was sent
    while len(server.committed("t", "dt=1")) < 16:
        assert time.monotonic() < deadline
        time.sleep(0.05)  # the server applies the commit the dead process had sent
    assert json.loads(cli("inspect", spill_file, "--json").stdout)["in_doubt"] != []

    rerun = cli("replay", spill_file, "--odps-config", config, env=ENV)
    assert rerun.returncode == 0, rerun.stderr
    assert "delivered 1 batch(es) (4 rows)" in rerun.stdout
    assert ", 1 already present, 1 by an earlier replay;" in rerun.stdout
    assert sorted(r["id"] for r in read_with_pyodps(server, "t", "dt=1")) == list(range(ROWS))
    assert server.counts("commit") == 3  # the settled batch was not committed again


# ------------------------------------------------------------------------------- bad inputs


def test_bad_files_give_one_line(
    tmp_path: Path, spill_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.arrows"
    garbage.write_bytes(os.urandom(300))
    foreign = tmp_path / "foreign.arrows"
    table = pa.table({"a": [1, 2]})
    with pa.OSFile(str(foreign), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    damaged = tmp_path / "damaged.arrows"
    data = spill_file.read_bytes()
    damaged.write_bytes(data[: len(data) - 40])
    cases = {
        tmp_path / "missing.arrows": "no such file",
        tmp_path: "is a directory",
        garbage: "not a readable recis_async spill file",
        foreign: "expected a recis_async spill file",
        damaged: "not a readable recis_async spill file",
    }
    for path, message in cases.items():
        for command in ("inspect", "replay"):
            extra = ["--parquet", tmp_path / "out"] if command == "replay" else []
            line = one_line_failure(run(capsys, command, path, *extra), command)
            assert message in line, line
    assert not (tmp_path / "out").exists()
    # and the same from a shell: status 1, one line
    assert "damaged.arrows: not a readable" in one_line_failure(cli("inspect", damaged), "inspect")


def test_bad_odps_configs_give_one_line_without_credentials(
    spill_file: Path,
    tmp_path: Path,
    server: OdpsServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"project": "p", "access_key": "' + TEST_SECRET + '",')
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    closed = f"http://127.0.0.1:{_closed_port()}/api"
    cases: list[tuple[Path, str]] = [
        (tmp_path / "absent.json", "cannot read the ODPS config: No such file or directory"),
        (bad_json, "expected a JSON object, got invalid JSON (Expecting"),
        (listed, "expected a JSON object, got a JSON list"),
        (odps_config(tmp_path, server, endpoint="x"), "config: unknown key(s) 'endpoint'"),
        (
            odps_config(tmp_path, server, end_point=f"http://{TEST_ACCESS_ID}:{TEST_SECRET}@h/api"),
            "config['end_point']: expected an http(s) URL without user info",
        ),
        (
            odps_config(tmp_path, server, access_id=TEST_ACCESS_ID, access_key=TEST_SECRET + "\n"),
            "config['access_key']: expected no leading or trailing whitespace",
        ),
        (
            odps_config(tmp_path, server, end_point=closed, tunnel_endpoint=None),
            "Connection refused",
        ),
    ]
    for config, message in cases:
        line = one_line_failure(
            run(capsys, "replay", spill_file, "--odps-config", config), "replay"
        )
        assert message in line, line
    assert spill_file.exists()


def test_a_spill_file_that_names_no_table_needs_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_spill(
        tmp_path, [SpillEntry(simple_batches(1)[0], None)], sink_name="x", reason="r"
    )
    line = one_line_failure(run(capsys, "replay", path, "--parquet", tmp_path / "out"), "replay")
    assert "give --table" in line
    bad = run(capsys, "replay", path, "--parquet", tmp_path / "out", "--table", "bad name")
    assert "table=...): expected a name of letters" in one_line_failure(bad, "replay")
    assert (
        run(capsys, "replay", path, "--parquet", tmp_path / "out", "--table", "t").returncode == 0
    )
