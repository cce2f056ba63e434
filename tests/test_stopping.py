"""The stop policy: which End status and which exit a run's ending implies (the signals
themselves are exercised end to end in test_preemption.py and test_signal_storm.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from recis_async.stopping import end_status, preempted_exit

ROOT = Path(__file__).resolve().parent.parent
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


def test_a_signal_still_pending_when_the_bus_closes_does_not_escape_as_an_error(
    tmp_path: Path,
) -> None:
    """A second SIGINT that arrives in the last moment of the close, after the watcher's last
    chance to take it: trio hands a signal still pending when its receiver closes back to the
    default handler, which raised ``KeyboardInterrupt`` out of the closed bus instead of the
    first signal's exit status."""
    script = tmp_path / "late_signal.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            import anyio
            from recis_async import HookBus

            class SignalsAtTheEnd:
                name = "signals-at-the-end"
                async def run(self) -> None:
                    await anyio.sleep_forever()
                async def aclose(self, deadline: float) -> None:
                    os.kill(os.getpid(), signal.SIGINT)  # no await after it: stays pending
                def stats(self) -> dict:
                    return {}

            async def main() -> None:
                async with HookBus(flush_timeout=5) as bus:
                    bus.start_service(SignalsAtTheEnd())
                    os.kill(os.getpid(), signal.SIGINT)  # the stop
                    await anyio.sleep(0.2)  # the watcher takes it

            anyio.run(main, backend=sys.argv[1])
            """
        )
    )
    # the late signal reaches trio's receiver a loop pass later: a race, so trio runs 5 times
    for backend in ("asyncio", *["trio"] * 5):
        result = subprocess.run(
            [sys.executable, str(script), backend],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 128 + signal.SIGINT, (backend, result.stderr)
        assert "KeyboardInterrupt" not in result.stderr, (backend, result.stderr)


@pytest.mark.anyio
async def test_children_forked_while_a_bus_watches_ignore_stop_signals_but_programs_they_run_do_not(
    tmp_path: Path,
) -> None:
    """A forked child (a DataLoader worker) shares the terminal's process group: it must not
    stop on the Ctrl-C meant for the job, nor pass it to the parent's loop.  A program it
    starts (fork + exec) gets the default dispositions back: an ignored signal would stay
    ignored across exec."""
    from recis_async import HookBus

    async with HookBus():
        pid = os.fork()
        if pid == 0:  # the child: survives a SIGINT, then reports
            try:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)
                (tmp_path / "child").write_text("alive")
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert (tmp_path / "child").read_text() == "alive"
        probe = (
            "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN, "
            "signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)"
        )
        # preexec_fn makes subprocess run the at-fork handlers in the child, before exec
        result = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, preexec_fn=lambda: None
        )
    assert result.stdout.split() == ["False", "False"], result


@pytest.mark.anyio
async def test_a_closed_buss_handler_put_back_by_a_framework_acts_as_before_the_bus() -> None:
    """Lightning's signal connector saves the handlers it finds at the start of ``fit`` (the
    open bus's) and puts them back at its teardown, after a failure closed the bus: Ctrl-C must
    still interrupt, and SIGTERM reach the handler that was there before the bus."""
    from recis_async import HookBus

    got: list[int] = []
    before_term = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        async with HookBus():
            stale = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s, handler in stale.items():  # what the framework's teardown does
            signal.signal(s, handler)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before_term)


@pytest.mark.parametrize("before", ["default", "ignore"])
def test_a_closed_buss_handler_put_back_kills_or_ignores_as_the_default_did(
    tmp_path: Path, before: str
) -> None:
    """With no handler of its own before the bus, SIGTERM kills the process (status -15) as
    the default action does; an ignored SIGTERM (``nohup``) stays ignored."""
    script = tmp_path / "stale.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys
            import anyio
            from recis_async import HookBus

            if sys.argv[1] == "ignore":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)

            async def main():
                async with HookBus():
                    return signal.getsignal(signal.SIGTERM)

            signal.signal(signal.SIGTERM, anyio.run(main))  # a framework puts it back
            os.kill(os.getpid(), signal.SIGTERM)
            print("alive", flush=True)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script), before],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if before == "default":
        assert result.returncode == -TERM, result.stderr
        assert result.stdout == ""
    else:
        assert (result.returncode, result.stdout) == (0, "alive\n"), result.stderr
