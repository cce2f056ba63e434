"""SIGTERM / SIGINT on a real process: stop at the step boundary, drain, exit 128 + signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "preempt_loop.py"
ROOT = Path(__file__).resolve().parent.parent


def start(out: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    wait_for_line(proc, "ready")
    return proc


def wait_for_line(proc: subprocess.Popen[str], expected: str, timeout: float = 30) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.strip().startswith(expected):
            return lines
    proc.kill()
    raise AssertionError(f"never printed {expected!r}; got {lines}; stderr: {proc.stderr.read()}")  # type: ignore[union-attr]


def read_rows(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_at_step_boundary_drains_and_exits(
    tmp_path: Path, backend: str, sig: signal.Signals, status: int
) -> None:
    proc = start(tmp_path, "--backend", backend)
    proc.send_signal(sig)
    lines = wait_for_line(proc, "stopped after step")
    last = int(lines[-1].rsplit(" ", 1)[1])
    assert proc.wait(timeout=30) == status
    rows = read_rows(tmp_path / "rows.jsonl")
    assert rows == list(range(last + 1))  # every step's row, once, in order
    assert json.loads((tmp_path / "end.json").read_text()) == {"status": "preempted"}
    assert not (tmp_path / "spill.jsonl").exists()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_second_signal_spills_and_exits_at_once(tmp_path: Path, backend: str) -> None:
    proc = start(tmp_path, "--slow-close", "--backend", backend)
    proc.send_signal(signal.SIGTERM)
    lines = wait_for_line(proc, "closing")
    last = int(next(x for x in lines if x.startswith("stopped")).rsplit(" ", 1)[1])
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 143
    assert time.monotonic() - t0 < 10  # not the 60 s the slow close would take
    assert not (tmp_path / "rows.jsonl").exists()
    assert read_rows(tmp_path / "spill.jsonl") == list(range(last + 1))
    assert json.loads((tmp_path / "end.json").read_text()) == {"status": "preempted"}
