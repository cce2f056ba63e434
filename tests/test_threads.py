from __future__ import annotations

import contextvars
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import anyio
import pytest

from recis_async._threads import Call, run_sync, wait

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.anyio
async def test_run_sync_returns_the_result_or_raises_the_error() -> None:
    assert await run_sync(lambda a, b: a + b, 2, 3) == 5

    def fails() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await run_sync(fails)


@pytest.mark.anyio
async def test_run_sync_runs_in_a_daemon_thread_with_the_callers_context() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var")
    var.set("from the caller")

    def where() -> tuple[bool, str, bool]:
        me = threading.current_thread()
        return me.daemon, var.get(), me is threading.main_thread()

    assert await run_sync(where) == (True, "from the caller", False)


@pytest.mark.anyio
async def test_a_cancelled_call_is_abandoned_or_waited_for() -> None:
    release = threading.Event()
    ended = threading.Event()

    def blocks() -> None:
        release.wait(10)
        ended.set()

    with anyio.move_on_after(0.1):
        await run_sync(blocks, abandon_on_cancel=True)
    assert not ended.is_set()  # given up on: the cancellation came first
    release.set()
    assert ended.wait(5)

    release.clear()
    ended.clear()
    t0 = time.monotonic()
    with anyio.CancelScope() as scope:
        scope.cancel()
        threading.Timer(0.3, release.set).start()
        await run_sync(blocks)  # not abandoned: waits for the call, then is cancelled
    assert ended.is_set() and scope.cancelled_caught
    assert time.monotonic() - t0 >= 0.25


@pytest.mark.anyio
async def test_wait_for_a_call_times_out_or_is_cancelled_without_ending_the_call() -> None:
    gate = threading.Event()
    call = Call(gate.wait, 10)
    assert await wait(call, 0.05) is False  # timed out; the call runs on
    with anyio.move_on_after(0.05) as scope:
        await wait(call)
    assert scope.cancelled_caught and not call.done
    threading.Timer(0.05, gate.set).start()
    with anyio.fail_after(5):
        assert await wait(call) is True
    assert call.result() is True
    assert await wait(call, 0) is True  # ended already: at once


def test_call_waits_with_a_timeout_and_hands_back_the_result() -> None:
    gate = threading.Event()
    call = Call(lambda: gate.wait(5) and "done")
    assert not call.wait(0.05) and not call.done
    gate.set()
    assert call.wait(5) and call.done and call.result() == "done"


_ABANDON = """
import sys, threading, time, anyio
from recis_async._threads import run_sync as run
async def main():
    with anyio.move_on_after(0.2):
        await run(threading.Event().wait, abandon_on_cancel=True)  # never returns
    print("closed", flush=True)
anyio.run(main, backend=sys.argv[1])
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_abandoned_call_does_not_keep_the_process_alive(backend: str, tmp_path: Path) -> None:
    script = tmp_path / "abandon.py"
    script.write_text(textwrap.dedent(_ABANDON))
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(script), backend],
            capture_output=True,
            text=True,
            timeout=8,
            cwd=tmp_path,
            env={"PYTHONPATH": str(REPO), "PATH": ""},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{backend}: the process was still alive 8 s after its call was abandoned")
    assert done.returncode == 0, done.stderr
    assert "closed" in done.stdout
    assert time.monotonic() - t0 < 8
