"""SIGTERM on a real Trainer process: the checkpoint taken at End holds the last step, the CSV
history is complete, and a new process resumes from it with no row duplicated."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from subprocess_support import wait_for

from recis_async.hooks import list_checkpoints

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "preempt_train.py"
ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def history_steps(out: Path) -> list[int]:
    with open(out / "history.csv", newline="") as f:
        return [int(row["steps"]) for row in csv.DictReader(f)]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_saves_the_last_step_and_a_new_process_resumes(
    tmp_path: Path, backend: str
) -> None:
    proc = run(tmp_path, "--backend", backend)
    wait_for(proc, "ready")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    ((done, path),) = list_checkpoints(tmp_path / "ckpt")  # save_steps is far: only End's save
    assert done >= 5
    saved = torch.load(path, weights_only=True)
    assert saved["global_step"] == done
    steps = history_steps(tmp_path)
    assert steps == sorted(set(steps)) and steps[-1] == done  # End closed the partial interval
    assert steps[:-1] == list(range(3, done, 3))

    proc = run(tmp_path, "--backend", backend, "--resume", "--steps", str(done + 4))
    assert wait_for(proc, "done") == f"done {done + 4}"
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert list_checkpoints(tmp_path / "ckpt")[-1][0] == done + 4
    steps = history_steps(tmp_path)
    assert steps == sorted(set(steps)) and steps[-1] == done + 4
