"""Real torchrun jobs (2 ranks, gloo, CPU): stop decisions agree across ranks, none hangs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(SCRIPTS / script),
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_stop_on_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    proc = torchrun("dist_train.py", str(tmp_path), "stop")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = results(tmp_path)
    assert [s for _, s in r0["steps"]] == [0, 1, 2, 3]
    assert r0["steps"] == r1["steps"]
    assert r0["stop_reason_seen"] == "another rank requested a stop"
    assert r1["stop_reason_seen"] == "rank 1 asked"
    assert r0["status"] == r1["status"] == "ok"


def test_a_failing_rank_is_named_and_nobody_hangs(tmp_path: Path) -> None:
    proc = torchrun("dist_train.py", str(tmp_path), "fail")  # each rank records its error
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = results(tmp_path)
    assert r1["error"] == "ValueError: model blew up on rank 1"
    assert r0["error"] == (
        "RuntimeError: rank 1 failed in the step at global_step 3; rank 0 stops with it"
    )
    assert r0["status"] == r1["status"] == "failed"
    assert [s for _, s in r0["steps"]] == [0, 1, 2, 3]


def test_uneven_data_ends_each_epoch_together(tmp_path: Path) -> None:
    proc = torchrun("dist_train.py", str(tmp_path), "uneven")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = results(tmp_path)
    # rank 0 runs out at local step 5; rank 1 finishes that step and ends the epoch with it
    assert r0["steps"] == [[0, s] for s in range(5)] + [[1, s] for s in range(5, 10)]
    assert r1["steps"] == [[0, s] for s in range(6)] + [[1, s] for s in range(6, 12)]
