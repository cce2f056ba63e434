"""Benchmarks run in CI as smoke tests: a tiny configuration on the CPU, start to end, printing
what a real run prints (the figures themselves are measured on the hardware they are for)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_bench_gpu_runs_in_cpu_smoke_mode() -> None:
    """``benchmarks/bench_gpu.py --device cpu``: every variant runs with every hook on, and the
    table of ratios against the hook-free baseline is printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_gpu.py", "--device", "cpu", "--backend", "trio"],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    hooks = out[out.index("hooks: ") :].splitlines()[0]
    for name in ("LoggerHook", "TraceHook", "TraceToOdpsHook", "MLTrackerHook",
                 "CheckpointSaverHook", "HashTableFilterHook", "NanTensorHook"):  # fmt: skip
        assert name in hooks, hooks
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:6] in
            ("none  ", "hooks ", "naive ")}  # fmt: skip
    assert sorted(rows) == ["hooks", "naive", "none"], out
    assert rows["none"][2] == "1.000", out
    assert float(rows["hooks"][2]) > 0 and float(rows["naive"][2]) > 0, out
    assert "cpu smoke mode" in out, out
