"""The examples run for real (shortened) and leave readable outputs where they say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    # the checkout first, then whatever the caller's path holds (packages installed there)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    for key in [k for k in env if k.startswith("ODPS_")]:
        del env[key]  # the Parquet default, whatever the machine has set
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT
    )


def test_train_ctr_learns_and_writes_every_output(tmp_path: Path) -> None:
    steps = 300
    proc = run(
        "examples/train_ctr.py",
        *("--steps", str(steps), "--output-dir", str(tmp_path), "--device", "cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    auc = float(re.search(r"held-out AUC: ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert auc > 0.6, out

    parts = sorted((tmp_path / "trace" / "ctr_samples").glob("dt=*/part-0-*.parquet"))
    table = pq.read_table(parts[0].parent)
    assert table.num_rows == steps * 512
    assert table.column_names[:4] == ["user_id", "item_id", "label", "score"]

    (run_dir,) = [p for p in (tmp_path / "runs").rglob("metrics.jsonl")]
    lines = run_dir.read_bytes().splitlines()
    records = [msgspec.json.decode(line) for line in lines]
    assert len(records) >= steps  # a "loss" value for every training step
    assert (run_dir.parent / "params.json").exists()

    assert sorted((tmp_path / "checkpoints").glob("checkpoint-*.pt"))
    assert list((tmp_path / "timeline").glob("0-timeline-*.json"))
    # the library names every output at the start and sums them up at the end (stderr)
    summary = proc.stderr[proc.stderr.index("outputs of this run:") :]
    for what, where in (
        ("traces (TraceHook)", tmp_path / "trace" / "ctr_samples"),
        ("experiment tracking (MLTrackerHook)", run_dir.parent),
        ("checkpoints (CheckpointSaverHook)", tmp_path / "checkpoints"),
        ("profiler timelines (ProfilerHook)", tmp_path / "timeline"),
    ):
        assert f"  {what}: {where}" in summary, summary


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_ctr_runs_on_cuda(tmp_path: Path) -> None:
    proc = run(
        "examples/train_ctr.py",
        *("--steps", "300", "--output-dir", str(tmp_path), "--device", "cuda"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    auc = float(re.search(r"held-out AUC: ([0-9.]+)", proc.stdout).group(1))  # type: ignore[union-attr]
    assert auc > 0.6, proc.stdout
    assert sorted((tmp_path / "checkpoints").glob("checkpoint-*.pt"))


def test_train_loop_example_runs() -> None:
    proc = run("examples/train_loop.py", "--steps", "100")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 5: loss=" in proc.stdout  # the custom hook's own lines show before the stop
    assert "run ended: ok" in proc.stdout
