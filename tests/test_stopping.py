"""The stop policy: which End status and which exit a run's ending implies (the signals
themselves are exercised end to end in test_preemption.py and test_signal_storm.py)."""

from __future__ import annotations

import signal

import anyio
import pytest

from recis_async.stopping import end_status, preempted_exit

TERM = int(signal.SIGTERM)


async def a_cancellation() -> BaseException:
    """A real cancellation exception of the running backend (trio's has no constructor)."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        try:
            await anyio.sleep(1)
        except anyio.get_cancelled_exc_class() as exc:
            return exc
    raise AssertionError("not cancelled")


@pytest.mark.anyio
async def test_end_status() -> None:
    cancelled = await a_cancellation()
    assert end_status(None, None) == "ok"
    assert end_status(ValueError("x"), None) == "failed"
    assert end_status(cancelled, None) == "cancelled"
    assert end_status(None, TERM) == "preempted"
    assert end_status(cancelled, TERM) == "preempted"  # the second signal cancelled the body
    assert end_status(ValueError("x"), TERM) == "failed"  # it failed on its own


@pytest.mark.anyio
async def test_preempted_exit() -> None:
    assert preempted_exit(None, None) is None
    exit_ = preempted_exit(TERM, None)
    assert isinstance(exit_, SystemExit) and exit_.code == 143
    exit_ = preempted_exit(int(signal.SIGINT), await a_cancellation())
    assert isinstance(exit_, SystemExit) and exit_.code == 130
    assert preempted_exit(TERM, ValueError("x")) is None  # the body's own error propagates
