"""A stop signal as a user's job meets it: Ctrl-C typed in a real terminal (a SIGINT to the
whole foreground process group, ``DataLoader`` workers included) and a scheduler's SIGTERM.  Each is one stop, at the next step boundary, with or without background
services, on asyncio and trio; every row is accounted for."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from storm_support import account_for_every_row
from terminal import Terminal

SCRIPT = Path(__file__).parent / "scripts" / "storm_loop.py"
ROOT = Path(__file__).resolve().parent.parent

RECEIVED = "received: stopping at the next step boundary"
SECOND = "second stop signal"

JOBS = {
    # hooks only: no service, so the loop never yields to the event loop by itself
    "hooks-only": ["--hooks-only"],
    "forked-workers": ["--workers", "2", "--start-method", "fork"],
    "spawned-workers": ["--workers", "2", "--start-method", "spawn"],
}


def start(tmp_path: Path, backend: str, job: str) -> Terminal:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    term = Terminal([sys.executable, str(SCRIPT), str(tmp_path), backend, *JOBS[job]], env=env)
    term.expect(b"ready")
    return term


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("job", list(JOBS))
def test_one_ctrl_c_in_a_terminal_is_one_stop(tmp_path: Path, backend: str, job: str) -> None:
    with start(tmp_path, backend, job) as term:
        term.press(b"\x03")
        rc = term.wait()
    assert rc == 128 + signal.SIGINT, term.text
    assert term.text.count(RECEIVED) == 1, term.text
    assert SECOND not in term.text, term.text
    assert "Traceback" not in term.text, term.text
    if job != "hooks-only":
        account_for_every_row(tmp_path, single=True, stderr=term.text)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_schedulers_sigterm_is_one_stop_with_workers_running(tmp_path: Path, backend: str) -> None:
    """SIGTERM to the main process, as Kubernetes sends it.  (Sent to the whole process group,
    as Slurm does, it also reaches the DataLoader workers, which torch's own handler ends, and
    torch's SIGCHLD handler then raises in the parent: see the README.)"""
    with start(tmp_path, backend, "forked-workers") as term:
        os.kill(term.proc.pid, signal.SIGTERM)
        rc = term.wait()
    assert rc == 128 + signal.SIGTERM, term.text
    assert term.text.count(RECEIVED) == 1 and SECOND not in term.text, term.text
    account_for_every_row(tmp_path, single=True, stderr=term.text)
