"""A close cut short by a second stop signal names where the undelivered data went.

A real job (``tests/scripts/close_cut_short.py``) whose trace sink and tracker hang gets two
SIGINTs sent to its process group: the first stops the loop, the second cuts the close short.
The error the user reads -- the bus's ``failed while closing the bus`` ERROR lines, one per
service, as leaving the block raises ``SystemExit(130)`` -- must name every spill file that
holds their rows and the command that replays it.  Replaying each file named there with that
command then puts every row and every step in its store exactly once (Parquet counted with
pyarrow, the tracker's run with its own reader).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.dataset as pads
import pytest
from subprocess_support import wait_for

from recis_async.trackers import read_records

SCRIPT = Path(__file__).resolve().parent / "scripts" / "close_cut_short.py"
ROOT = Path(__file__).resolve().parents[1]
ROWS = 16  # the script's rows per step


def _closing_errors(stderr: str) -> dict[str, str]:
    """The bus's ERROR lines about each service's close, by service name."""
    found = {}
    for line in stderr.splitlines():
        match = re.match(
            r"ERROR recis_async\.bus: failed while closing the bus: service '([^']+)'", line
        )
        if match:
            found[match.group(1)] = line
    return found


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_error_of_a_close_cut_short_names_the_spill_files_and_the_replay(
    tmp_path: Path, backend: str
) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path), backend],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: a terminal's Ctrl-C reaches the group
    )
    try:
        wait_for(proc, "ready")
        time.sleep(0.3)  # step 1 is waiting for room behind the hung calls
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: stop at the step boundary
        wait_for(proc, "stopping", timeout=20)
        time.sleep(0.5)  # the close waits on the hung sink and tracker
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C again: cut the close short
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert (tmp_path / "steps.txt").read_text() == "2"
    errors = _closing_errors(stderr)
    assert sorted(name.split(":")[0].split("[")[0] for name in errors) == [
        "MLTrackerHook",
        "trace",
    ], stderr
    trace_error = next(text for name, text in errors.items() if name.startswith("trace:"))
    tracker_error = next(text for name, text in errors.items() if name.startswith("MLTracker"))

    # the trace: every spill file on disk is named in the error, with the replay command
    spills = sorted((tmp_path / "spill").glob("*.arrows"))
    assert spills, stderr
    assert "was cancelled: a second stop signal arrived" in trace_error
    for path in spills:  # several files in a folder are named by the folder and a count
        named = f"{len(spills)} files in {path.parent}" if len(spills) > 1 else str(path)
        assert named in trace_error, trace_error
    command = f"python -m recis_async.spill replay FILE --parquet {shlex.quote(str(tmp_path))}"
    assert command in trace_error, trace_error
    assert not any((tmp_path / "t").rglob("*.parquet"))  # the hung writes never committed
    for path in spills:
        replay = shlex.split(command)[1:]  # run as the error says, FILE being the file
        replay[replay.index("FILE")] = str(path)
        subprocess.run([sys.executable, *replay], check=True, env=env, timeout=120)
    ids = pads.dataset(tmp_path / "t", format="parquet").to_table().column("id").to_pylist()
    assert sorted(ids) == list(range(2 * ROWS))  # each row once

    # the tracker: the unsent and the in-flight records' files, each with its command
    tracker_spills = sorted((tmp_path / "tracker_spill").glob("*.jsonl"))
    assert len(tracker_spills) == 2, stderr  # step 0 in doubt, step 1 unsent
    assert "was cancelled: a second stop signal arrived" in tracker_error
    for path in tracker_spills:
        replay = f"python -m recis_async.trackers.replay {shlex.quote(str(path))}"
        assert replay in tracker_error, tracker_error
    (run_dir,) = (tmp_path / "runs" / "p").iterdir()
    for path in tracker_spills:
        # the sidecar names the script's tracker subclass: name the JSONL root
        subprocess.run(
            [
                sys.executable,
                "-m",
                "recis_async.trackers.replay",
                str(path),
                "--root",
                str(tmp_path / "runs"),
            ],
            check=True,
            env=env,
            timeout=120,
        )
    steps = Counter(r.step for r in read_records(run_dir / "metrics.jsonl"))
    assert steps == {0: 1, 1: 1}  # each step once
