"""A Trainer job's life across processes: SIGTERM mid-run, a plain rerun (refused), a rerun with
``resume_from_checkpoint=True``, compared with the same job run once without a stop.

Read back: the Parquet trace table (pyarrow), the checkpoint files (torch.load) and the log
lines on stderr.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from subprocess_support import wait_for

from recis_async.checkpoint import list_checkpoints

SCRIPT = Path(__file__).parent / "scripts" / "resume_train.py"
ROOT = Path(__file__).resolve().parent.parent
STEPS, IDS, BATCH = 128, 256, 4  # as in the script: two epochs of 64 steps
_LINE = re.compile(r"<mode=train> <gstep=(\d+)>")


def run(out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=out.parent,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr


def rows(out: Path) -> list[dict[str, object]]:
    table = pq.read_table(out / "trace" / "t")
    return sorted(table.to_pylist(), key=lambda r: (r["step"], r["id"]))


def logged_steps(stderr: str) -> list[int]:
    return [int(m.group(1)) for m in _LINE.finditer(stderr)]


def weights(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The same job run once, never stopped: its folder and its stderr."""
    ref = tmp_path_factory.mktemp("restart") / "ref"
    ref.mkdir()
    code, _, err = finish(run(ref))
    assert code == 0, err
    return ref, err


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_then_rerun_continues_exactly_as_an_uninterrupted_run(
    tmp_path: Path, backend: str, reference: tuple[Path, str]
) -> None:
    ref, ref_err = reference
    out = tmp_path / "job"
    out.mkdir()
    first = run(out, "--backend", backend)
    wait_for(first, "ready")
    first.send_signal(signal.SIGTERM)
    code, _, first_err = finish(first)
    assert code == 143, first_err
    ((stopped, _),) = list_checkpoints(out / "ckpt")[-1:]  # the checkpoint taken at End
    assert 70 <= stopped < STEPS
    assert {r["step"] for r in rows(out)} == set(range(stopped))  # every step done, once

    # a plain rerun of the same script: refused before anything runs, nothing written
    before = sorted(os.listdir(out / "ckpt")), len(rows(out))
    code, _, err = finish(run(out, "--backend", backend))
    assert code == 1
    assert "resume_from_checkpoint=True" in err and "overwrite_output_dir=True" in err, err
    assert f"checkpoint-{stopped}.pt" in err
    assert (sorted(os.listdir(out / "ckpt")), len(rows(out))) == before

    resumed = run(out, "--backend", backend, "--resume")
    code, stdout, resumed_err = finish(resumed)
    assert code == 0, resumed_err
    assert f"done {STEPS}" in stdout

    # the trace table: every step's rows exactly once, each epoch's ids each exactly once,
    # the same rows (ids, order, losses) as the uninterrupted run's
    got, want = rows(out), rows(ref)
    assert Counter(r["step"] for r in got) == {step: BATCH for step in range(STEPS)}
    for epoch in (0, 1):
        assert sorted(r["id"] for r in got if r["epoch"] == epoch) == list(range(IDS))
    assert [(r["step"], r["epoch"], r["id"]) for r in got] == [
        (r["step"], r["epoch"], r["id"]) for r in want
    ]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)

    # log lines: at the steps completing multiples of log_steps=10, each once over both runs
    lines = logged_steps(first_err) + logged_steps(resumed_err)
    assert lines == logged_steps(ref_err) == [s for s in range(STEPS) if (s + 1) % 10 == 0]

    # the checkpoint folder holds one lineage: the uninterrupted run's checkpoints, bit for bit
    kept = list_checkpoints(out / "ckpt")
    assert [s for s, _ in kept] == [s for s, _ in list_checkpoints(ref / "ckpt")] == [96, 112, 128]
    for (_, path), (_, ref_path) in zip(kept, list_checkpoints(ref / "ckpt"), strict=True):
        for name, tensor in weights(ref_path).items():
            torch.testing.assert_close(weights(path)[name], tensor, rtol=1e-5, atol=1e-6)


def test_overwrite_output_dir_starts_again_with_one_lineage(tmp_path: Path) -> None:
    out = tmp_path / "job"
    out.mkdir()
    first = run(out, "--ready", "40")
    wait_for(first, "ready")
    first.send_signal(signal.SIGTERM)
    assert finish(first)[0] == 143
    (stopped, _) = list_checkpoints(out / "ckpt")[-1]
    assert 40 <= stopped < 64

    code, stdout, err = finish(run(out, "--overwrite"))
    assert code == 0, err
    assert f"done {STEPS}" in stdout
    assert "removed" in err and f"checkpoint-{stopped}.pt" in err
    assert [s for s, _ in list_checkpoints(out / "ckpt")] == [96, 112, 128]


def test_kill_9_then_resume_traces_each_step_once(tmp_path: Path) -> None:
    """After a crash (no checkpoint at End) the run resumes at a checkpoint older than its
    last delivered rows: the steps between them, which it trains again, are not traced again
    (their part files name the run and the steps), and every step from the checkpoint on is in
    the table once.  Rows still buffered at the kill are lost (the README's bound)."""
    out = tmp_path / "job"
    out.mkdir()
    first = run(out, "--ready", "78", "--trace-bytes", "1024")  # a batch per 8 steps
    wait_for(first, "ready")
    first.kill()
    first.wait(timeout=30)
    (restored, _) = list_checkpoints(out / "ckpt")[-1]
    assert restored >= 64  # save_steps=16; killed after step 78
    code, _, err = finish(run(out, "--resume", "--trace-bytes", "1024"))
    assert code == 0, err
    counts = Counter(r["step"] for r in rows(out))
    assert set(counts.values()) == {BATCH}, sorted(s for s, n in counts.items() if n != BATCH)
    assert all(counts[s] for s in range(restored, STEPS))
    assert "were delivered before it stopped; resumed at step" in err
