"""The ODPS sink against a service that hangs, answers a byte a second, 500s or answers noise:
every wait bounded, every row delivered or spilled once (counted back from the service's
table and from the spill files, replayed with ``python -m recis_async.spill replay``), and
the process gone within seconds of the bus's close."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from odps_server import (
    FOREVER,
    TEST_ACCESS_ID,
    TEST_SECRET,
    OdpsServer,
    read_with_pyodps,
    sink_config,
)
from subprocess_support import wait_for

from recis_async import HookBus, HookError, add_to_trace
from recis_async.events import AfterStep, BeforeStep, Start
from recis_async.hooks import TraceHook, TraceToOdpsHook
from recis_async.sinks import Attempt, OdpsSink, SinkError
from recis_async.spill import read_spill
from recis_async.spill.__main__ import main as spill_main
from recis_async.trace.buffer import ColumnBuffer
from recis_async.trace.schema import parse_type

ROOT = Path(__file__).resolve().parents[2]
ROWS_PER_STEP = 4


@pytest.fixture
def server() -> Iterator[OdpsServer]:
    with OdpsServer("trace_proj") as srv:
        yield srv


def published_ids(steps: int) -> list[int]:
    return list(range(steps * ROWS_PER_STEP))


def delivered_ids(server: OdpsServer) -> list[int]:
    if "t" not in server.state.tables:
        return []
    return sorted(r["id"] for r in read_with_pyodps(server, "t", "dt=1"))


def spilled_ids(spill_dir: Path) -> list[int]:
    return sorted(
        i
        for path in spill_dir.glob("*.arrows")
        for entry in read_spill(path).entries
        for i in entry.batch.to_arrow().column("id").to_pylist()
    )


def replay_all(spill_dir: Path, server: OdpsServer, tmp_path: Path) -> list[str]:
    """Replay every spill file with ``python -m recis_async.spill replay FILE --odps-config``
    (its ``main``, in this process: a subprocess each costs seconds of start-up); return
    what each printed."""
    path = tmp_path / "odps.json"
    path.write_text(json.dumps(sink_config(server, "t", "dt=1")))
    outputs = []
    for spill in sorted(spill_dir.glob("*.arrows")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = spill_main(["replay", str(spill), "--odps-config", str(path)])
        assert status == 0, out.getvalue()
        outputs.append(out.getvalue())
    return outputs


def trace_hook(server: OdpsServer, tmp_path: Path, timeout: float, **kwargs: object) -> TraceHook:
    return TraceHook(
        OdpsSink(sink_config(server, "t", "dt=1"), timeout=timeout),
        ["id"],
        ["bigint"],
        size_threshold=ROWS_PER_STEP * 8,  # a batch a step
        spill_dir=tmp_path / "spill",
        **kwargs,  # type: ignore[arg-type]
    )


async def publish_steps(bus: HookBus, first: int, count: int) -> None:
    for step in range(first, first + count):
        await bus.publish(BeforeStep(global_step=step))
        add_to_trace("id", np.arange(step * ROWS_PER_STEP, (step + 1) * ROWS_PER_STEP))
        await bus.publish(AfterStep(global_step=step))


# ------------------------------------------------------------------------------ in process


@pytest.mark.anyio
@pytest.mark.parametrize("hook_class", ["TraceHook", "TraceToOdpsHook"])
async def test_start_gives_up_on_a_hung_service_within_the_timeout_naming_the_endpoint(
    server: OdpsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, hook_class: str
) -> None:
    server.inject("any", "hang", FOREVER)
    if hook_class == "TraceHook":
        hook = trace_hook(server, tmp_path, timeout=2.0, retries=0)
    else:  # RecIS's hook passes the timeout on to its sink
        hook = TraceToOdpsHook(
            sink_config(server, "t", "dt=1"),
            ["id"],
            ["bigint"],
            size_threshold=ROWS_PER_STEP * 8,
            timeout=2.0,
            retries=0,
            spill_dir=tmp_path / "spill",
        )
    caplog.set_level(logging.WARNING, "recis_async.trace.service")
    with pytest.raises(HookError) as info:
        async with HookBus(flush_timeout=3) as bus:
            bus.add_hook(hook)
            t0 = time.monotonic()
            await bus.publish(Start(is_train=True))
            waited = time.monotonic() - t0
            await publish_steps(bus, 0, 3)
    # the sink's timeout, and some slack for a loaded machine (pyodps imported already)
    assert waited < 2.0 + 1.5
    (line,) = [r.getMessage() for r in caplog.records if "cannot open the sink yet" in r.message]
    assert f"no answer from the ODPS service at {server.endpoint} within 2 s" in line
    assert TEST_SECRET not in line and TEST_ACCESS_ID not in line
    assert "no answer from the ODPS service" in str(info.value)
    # nothing reached the service; every row is in a spill file, and a replay delivers it once
    assert delivered_ids(server) == [] and spilled_ids(tmp_path / "spill") == published_ids(3)
    server.clear_faults()
    replay_all(tmp_path / "spill", server, tmp_path)
    assert delivered_ids(server) == published_ids(3)


@pytest.mark.anyio
@pytest.mark.parametrize("op", ["create_upload", "put_block", "commit", "reload_upload"])
async def test_a_service_hanging_mid_run_costs_a_bounded_retry_then_a_spill(
    server: OdpsServer, tmp_path: Path, op: str
) -> None:
    hook = trace_hook(server, tmp_path, timeout=0.5, retries=1, retry_backoff=0.05)
    with pytest.raises(HookError, match="no answer from the ODPS service|has not ended yet"):
        async with HookBus(flush_timeout=20) as bus:
            bus.add_hook(hook)
            await bus.publish(Start(is_train=True))
            await publish_steps(bus, 0, 3)
            while hook.writer.stats()["queued_batches"]:
                await bus.publish(BeforeStep(global_step=3))  # let the writer deliver them
            if op == "reload_upload":  # a commit lost, then the status read hangs
                server.inject("commit", "lost", FOREVER)
            server.inject(op, "hang", FOREVER)
            t0 = time.monotonic()
            await publish_steps(bus, 3, 3)
            while hook.writer.stats()["queued_batches"]:
                await bus.publish(BeforeStep(global_step=6))
            settled = time.monotonic() - t0
    # three batches, each two attempts of at most three 0.5 s calls and one backoff, no wait
    # for the close deadline
    assert settled < 3 * 2 * (3 * 0.5 + 0.1) + 3
    delivered, spilled = delivered_ids(server), spilled_ids(tmp_path / "spill")
    assert sorted(delivered + spilled) == published_ids(6)  # each once: none lost, none doubled
    assert delivered == published_ids(3)
    server.clear_faults()
    replay_all(tmp_path / "spill", server, tmp_path)
    assert delivered_ids(server) == published_ids(6)


@pytest.mark.anyio
async def test_a_commit_answered_a_byte_a_second_is_settled_not_sent_again(
    server: OdpsServer, tmp_path: Path
) -> None:
    """The commit is applied, its answer trickles: the writer gives up on the call, keeps the
    session in doubt while the call runs on, spills the batch with its doubt, and the replay
    finds the commit applied -- the rows land once."""
    hook = trace_hook(server, tmp_path, timeout=0.5, retries=2, retry_backoff=0.05)
    server.inject("commit", "trickle", FOREVER)
    with pytest.raises(HookError, match="has not ended yet"):
        async with HookBus(flush_timeout=10) as bus:
            bus.add_hook(hook)
            await bus.publish(Start(is_train=True))
            await publish_steps(bus, 0, 1)
    assert delivered_ids(server) == published_ids(1)  # the commit was applied
    (spill,) = (tmp_path / "spill").glob("*.arrows")
    assert [e.in_doubt is not None for e in read_spill(spill).entries] == [True]
    server.clear_faults()
    replay_all(tmp_path / "spill", server, tmp_path)
    assert delivered_ids(server) == published_ids(1)  # settled: not sent again


def test_a_garbage_answer_says_what_arrived(server: OdpsServer) -> None:
    sink = OdpsSink(sink_config(server, "t", "dt=1"), timeout=5)
    buffer = ColumnBuffer(["id"], ["bigint"])
    buffer.append({"id": np.arange(4)})
    batch = buffer.seal()
    assert batch is not None
    sink.open(("id",), (parse_type("bigint"),))
    try:
        server.inject("create_upload", "garbage")
        with pytest.raises(SinkError) as info:
            sink.write(batch, Attempt())
        message = str(info.value)
        assert info.value.transient
        assert "UnicodeDecodeError:" not in message  # not the parser's error as the cause
        assert (
            f"the ODPS service at {server.tunnel_endpoint}/projects/trace_proj/tables/t "
            "answered 200 with content type 'application/octet-stream' and a body starting "
            "b'\\x89\\xff\\xfe\\x00garbage" in message
        )
        sink.write(batch, Attempt())  # the next answer is a real one
    finally:
        sink.close()
    assert delivered_ids(server) == [0, 1, 2, 3]


@pytest.mark.anyio
async def test_500_forever_is_retried_then_spilled_and_replayed_once(
    server: OdpsServer, tmp_path: Path
) -> None:
    hook = trace_hook(server, tmp_path, timeout=5, retries=2, retry_backoff=0.05)
    with pytest.raises(HookError, match="500"):
        async with HookBus(flush_timeout=20) as bus:
            bus.add_hook(hook)
            await bus.publish(Start(is_train=True))
            server.inject("commit", "500", FOREVER)
            await publish_steps(bus, 0, 3)
    assert delivered_ids(server) == []
    assert spilled_ids(tmp_path / "spill") == published_ids(3)
    server.clear_faults()
    replay_all(tmp_path / "spill", server, tmp_path)
    assert delivered_ids(server) == published_ids(3)


# ------------------------------------------------------------------------------ names


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (["id", "x" * 129], "of at most 128 bytes (MaxCompute's rule for column names), got 'xxx"),
        (["id", "user-id"], "got 'user-id'"),
        (["id", "_id"], "starting with a letter"),
        (["id", "1st"], "got '1st'"),
        (["id", "名字"], "got '名字'"),
        (["id", "dt"], "expected no column named like a partition key, got 'dt'"),
        ([f"c{i}" for i in range(1201)], "expected at most 1200 columns"),
    ],
)
def test_column_names_maxcompute_refuses_fail_when_the_hook_is_built(
    server: OdpsServer, tmp_path: Path, fields: list[str], message: str
) -> None:
    sink = OdpsSink(sink_config(server, "t", "dt=1"))
    with pytest.raises(ValueError) as info:
        TraceHook(sink, fields, ["bigint"] * len(fields), spill_dir=tmp_path)
    assert str(info.value).startswith("TraceHook(fields=...): expected ")
    assert message in str(info.value)
    TraceHook(sink, ["id", "x" * 128, "Ab_9"], ["bigint"] * 3, spill_dir=tmp_path)  # the limits


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        ("dt=2026/11", "must be non-empty without /"),
        ("dt=%2F..%2F", "= % or quotes, got '%2F..%2F'"),  # the check shared with ParquetSink
        ("dt=日期", "got '日期'"),
        ("dt=" + "9" * 129, "at most 128 bytes"),
        ("dt=_x", "starting with a letter or digit"),
        ("dt=a\tb", "got 'a\\tb'"),
        ("_dt=1", "MaxCompute's rule for partition keys"),
        (",".join(f"p{i}=1" for i in range(7)), "expected at most 6 levels"),
    ],
)
def test_partitions_maxcompute_refuses_fail_in_the_constructor(
    server: OdpsServer, partition: str, message: str
) -> None:
    with pytest.raises(ValueError) as info:
        OdpsSink(sink_config(server, "t", partition))
    assert str(info.value).startswith("config['partition']: ")
    assert message in str(info.value)


def test_partition_values_maxcompute_documents_are_accepted(server: OdpsServer) -> None:
    for value in ("20261122", "2026-11-22", "a b:c_d$e#f.g!h@i", "9" * 128):
        assert OdpsSink(sink_config(server, "t", f"dt={value}")).partition_spec == f"dt={value}"


def test_table_names_maxcompute_refuses_fail_in_the_constructor(server: OdpsServer) -> None:
    for table in ("t" * 129, "_t", "1t"):
        with pytest.raises(ValueError, match=r"config\['table_name'\]: expected a name of"):
            OdpsSink(sink_config(server, table))


def test_timeout_is_checked(server: OdpsServer) -> None:
    with pytest.raises(ValueError, match=r"OdpsSink\(timeout=...\): expected .*, got 0"):
        OdpsSink(sink_config(server, "t"), timeout=0)
    with pytest.raises(TypeError, match=r"OdpsSink\(timeout=...\): expected .*, got '5'"):
        OdpsSink(sink_config(server, "t"), timeout="5")  # type: ignore[arg-type]
    assert "timeout=7.5" in repr(OdpsSink(sink_config(server, "t"), timeout=7.5))


# ------------------------------------------------------------------------------ processes

_CHILD = """
import json, sys, time
import anyio, numpy as np
from recis_async import HookBus, add_to_trace
from recis_async.events import AfterStep, BeforeStep, Start
from recis_async.hooks import TraceHook
from recis_async.sinks import OdpsSink

config, backend, spill_dir = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
steps, flush_timeout, workers = int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])

async def main():
    # a batch a step; with 8 workers no step waits for room while calls hang, with 1 the
    # third step after the hang waits for room
    hook = TraceHook(OdpsSink(config), ["id"], ["bigint"], size_threshold=32,
                     spill_dir=spill_dir, worker_num=workers)
    try:
        async with HookBus(flush_timeout=flush_timeout) as bus:
            bus.add_hook(hook)
            await bus.publish(Start(is_train=True))
            step = 0
            while step < steps or steps < 0:
                await bus.publish(BeforeStep(global_step=step))
                add_to_trace("id", np.arange(step * 4, step * 4 + 4))
                await bus.publish(AfterStep(global_step=step))
                print(f"step {step}", flush=True)
                step += 1
                if bus.should_stop:
                    break
                await anyio.sleep(0.1)
            print("closing", flush=True)
    finally:
        print(f"closed {time.monotonic()}", flush=True)

anyio.run(main, backend=backend)
"""


def start_child(
    server: OdpsServer,
    tmp_path: Path,
    backend: str,
    steps: int,
    flush_timeout: float,
    workers: int = 8,
) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(script), json.dumps(sink_config(server, "t", "dt=1")), backend]
        + [str(tmp_path / "spill"), str(steps), str(flush_timeout), str(workers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("action", ["hang", "trickle"])
def test_the_process_exits_within_seconds_of_the_close_with_calls_still_hanging(
    server: OdpsServer, tmp_path: Path, backend: str, action: str
) -> None:
    """The sink's default timeout (30 s) is longer than the close's: the uploads under way at
    the close are given up on, their batches spilled, and the process ends at once -- not
    when the abandoned calls end."""
    proc = start_child(server, tmp_path, backend, steps=4, flush_timeout=1.0)
    wait_for(proc, "step 0")
    server.inject("put_block", action, FOREVER)
    closed_at = float(wait_for(proc, "closed").split()[1])
    try:
        status = proc.wait(timeout=25)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{backend}/{action}: alive 25 s after the bus closed")
    exit_s = time.monotonic() - closed_at
    assert exit_s < 3.0, f"{backend}/{action}: exited {exit_s:.1f} s after the bus closed"
    assert status == 1  # the TraceDeliveryError, raised from the bus's close
    stderr = proc.stderr.read()  # type: ignore[union-attr]
    assert "TraceDeliveryError" in stderr
    server.clear_faults()  # to read the table back
    delivered, spilled = delivered_ids(server), spilled_ids(tmp_path / "spill")
    assert sorted(delivered + spilled) == published_ids(4)  # once each
    replay_all(tmp_path / "spill", server, tmp_path)
    assert delivered_ids(server) == published_ids(4)


def sigterm_and_account(
    proc: subprocess.Popen[str], seen: list[str], server: OdpsServer, tmp_path: Path, backend: str
) -> str:
    """Send the scheduler's SIGTERM: the child exits 143 within its close deadline (2 s) plus
    3 s; every row of a step it printed is delivered or spilled once, and the replay delivers
    the rest.  Returns the child's stderr."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{backend}: alive 30 s after SIGTERM")
    took = time.monotonic() - t0
    assert status == 143
    assert took < 2.0 + 3.0, f"{backend}: exited {took:.1f} s after SIGTERM"
    assert proc.stdout is not None and proc.stderr is not None
    seen += proc.stdout.read().splitlines()
    last = max(int(line.split()[1]) for line in seen if line.startswith("step "))
    server.clear_faults()  # to read the table back
    delivered, spilled = delivered_ids(server), spilled_ids(tmp_path / "spill")
    assert spilled, "the hung batches are in a spill file"
    assert sorted(delivered + spilled) == published_ids(last + 1)  # once each
    replay_all(tmp_path / "spill", server, tmp_path)
    assert delivered_ids(server) == published_ids(last + 1)
    return proc.stderr.read()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_while_the_service_hangs_spills_and_exits_143_within_the_deadline(
    server: OdpsServer, tmp_path: Path, backend: str
) -> None:
    proc = start_child(server, tmp_path, backend, steps=-1, flush_timeout=2.0)
    seen: list[str] = []
    wait_for(proc, "step 2", seen)
    server.inject("any", "hang", FOREVER)
    wait_for(proc, "step 4", seen)
    sigterm_and_account(proc, seen, server, tmp_path, backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_reaches_a_publish_waiting_for_room_while_the_service_hangs(
    server: OdpsServer, tmp_path: Path, backend: str
) -> None:
    """One worker, the service hung: the step's publish waits for buffer room (up to
    send_timeout, 60 s).  The scheduler's one SIGTERM ends that wait at once (its batch kept
    for the close, not spilled for want of room), the close spills what the hung service did
    not take by its deadline, and the process exits 143 within it (it waited for SIGKILL)."""
    proc = start_child(server, tmp_path, backend, steps=-1, flush_timeout=2.0, workers=1)
    seen: list[str] = []
    wait_for(proc, "step 2", seen)
    server.inject("any", "hang", FOREVER)
    time.sleep(3.0)  # a batch hangs in the worker, one waits in the queue, the step waits
    stderr = sigterm_and_account(proc, seen, server, tmp_path, backend)
    assert "close deadline:" in stderr and "no room" not in stderr, stderr
