"""Real torchrun jobs (2 ranks, gloo, CPU): stop decisions agree across ranks, none hangs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from odps_server import TEST_ACCESS_ID, TEST_SECRET, OdpsServer, read_with_pyodps
from subprocess_support import torchrun_argv

from recis_async.hooks import list_checkpoints

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"

pytestmark = pytest.mark.slow


def torchrun(
    script: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = torchrun_argv(SCRIPTS / script, *args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_stop_on_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    proc = torchrun("dist_train.py", str(tmp_path), "stop")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = results(tmp_path)
    # asked in step 3, agreed one step later: every rank stops after step 4
    assert [s for _, s in r0["steps"]] == [0, 1, 2, 3, 4]
    assert r0["steps"] == r1["steps"]
    assert r0["stop_reason_seen"] == "another rank requested a stop"
    # the process group is gone with its threads before exit (it used to outlive
    # destroy_process_group and be torn down, now and then aborting, at interpreter exit)
    for r in (r0, r1):
        assert not [t for t in r["threads_after_destroy"] if "gloo" in t], r
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
    # rank 0 reads the agreement of step 3 at the end of step 4
    assert [s for _, s in r0["steps"]] == [0, 1, 2, 3, 4]


def test_uneven_data_ends_each_epoch_together(tmp_path: Path) -> None:
    proc = torchrun("dist_train.py", str(tmp_path), "uneven")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = results(tmp_path)
    # rank 0 has 5 batches a pass, rank 1 has 8: both end each pass after the 5th step, at
    # the same global step (before, rank 1 ran a 6th step rank 0 had no batch for, which in
    # data-parallel training waits forever in its gradient all-reduce)
    assert r0["steps"] == r1["steps"] == [[0, s] for s in range(5)] + [[1, s] for s in range(5, 10)]


def test_the_step_boundary_does_not_wait_for_the_other_ranks(tmp_path: Path) -> None:
    proc = torchrun("dist_train.py", str(tmp_path), "overlap")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = results(tmp_path)
    # rank 1, held in step 3, saw rank 0 already in step 4: the agreement of step 3 was
    # started at its boundary and read one step later, not waited for there
    assert r1["overlapped"] is True
    # rank 1 asked to stop in step 5: both ranks stop after step 6, none hangs
    assert r0["steps"] == r1["steps"] == [[0, s] for s in range(7)]
    assert r0["stop_reason_seen"] == "another rank requested a stop"
    assert r0["status"] == r1["status"] == "ok"


def test_a_stop_in_the_last_step_of_a_pass_ends_every_rank_there(tmp_path: Path) -> None:
    proc = torchrun("dist_train.py", str(tmp_path), "uneven_stop")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = results(tmp_path)
    # rank 0 has 5 batches; rank 1 asks to stop in step 4, after which the pass ends anyway:
    # the stop is agreed between the passes, so no rank starts the second epoch alone
    assert r0["steps"] == r1["steps"] == [[0, s] for s in range(5)]
    assert r0["stop_reason_seen"] == "another rank requested a stop"
    assert r0["status"] == r1["status"] == "ok"


def test_a_nan_loss_on_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    proc = torchrun("dist_train.py", str(tmp_path), "nan")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = results(tmp_path)
    assert r0["steps"] == r1["steps"]
    # NaN in step 3; the NaN check may act a step or two late, the agreement one step late
    assert r0["steps"][:5] == [[0, s] for s in range(5)] and len(r0["steps"]) <= 7
    assert "NaN" in r1["stop_reason_seen"] or "nan" in r1["stop_reason_seen"].lower()
    assert r0["stop_reason_seen"] == "another rank requested a stop"
    # the process group is gone with its threads before exit (it used to outlive
    # destroy_process_group and be torn down, now and then aborting, at interpreter exit)
    for r in (r0, r1):
        assert not [t for t in r["threads_after_destroy"] if "gloo" in t], r


def test_every_ranks_traced_rows_arrive_exactly_once(tmp_path: Path) -> None:
    with OdpsServer("dist_proj") as server:
        env = {
            "TEST_ODPS_ACCESS_ID": TEST_ACCESS_ID,
            "TEST_ODPS_ACCESS_KEY": TEST_SECRET,
            "TEST_ODPS_PROJECT": server.project,
            "TEST_ODPS_ENDPOINT": server.endpoint,
            "TEST_ODPS_TUNNEL_ENDPOINT": server.tunnel_endpoint,
        }
        proc = torchrun("dist_train.py", str(tmp_path), "trace", env=env, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        odps_rows = read_with_pyodps(server, "dist_trace", "dt=20261122")
    r0, r1 = results(tmp_path)
    assert r0["steps"] == r1["steps"] == [[0, s] for s in range(12)]
    expected = sorted((r, s, i) for r in (0, 1) for s in range(12) for i in range(8))

    spilled = sorted(p.name for p in (tmp_path / "spill").glob("*")) if (tmp_path / "spill").exists() else []
    assert sorted((x["rank"], x["step"], x["row"]) for x in odps_rows) == expected, (
        spilled,
        proc.stderr[-3000:],
    )

    folder = tmp_path / "parquet" / "dist_trace" / "dt=20261122"
    parquet_rows = []
    for rank in (0, 1):
        files = sorted(folder.glob(f"part-{rank}-*.parquet"))
        assert files, f"rank {rank} wrote no part files"
        for f in files:
            table = pq.read_table(f)
            assert set(table.column("rank").to_pylist()) == {rank}  # parts are per rank
            parquet_rows += zip(
                *(table.column(c).to_pylist() for c in ("rank", "step", "row")), strict=True
            )
    assert sorted(parquet_rows) == expected

    # LoggerHook(all_reduce=True): rank 0 logs the mean over ranks, rank 1 logs nothing
    assert [line.split()[1] for line in r0["log_lines"]] == ["<gstep=3>", "<gstep=7>", "<gstep=11>"]
    assert all("<rank_metric=0.5>" in line for line in r0["log_lines"])
    assert r1["log_lines"] == []

    # rank 0 wrote the checkpoints after barriers; both ranks saw the last one on disk
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")][-1] == 12
    assert r0["checkpoint_step_seen"] == r1["checkpoint_step_seen"] == 12
    # restore works on every rank: both get rank 0's weights of step 12
    assert r0["restored_step"] == r1["restored_step"] == 12
    assert r0["restored_weights"] == r1["restored_weights"] == r0["trained_weights"]
    assert r1["trained_weights"] != r0["trained_weights"]  # no DDP here: rank 1 trained apart


def test_evaluation_metrics_are_reduced_over_ranks(tmp_path: Path) -> None:
    proc = torchrun("dist_eval.py", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = results(tmp_path)
    # rank 0 saw values 0..3 (2 batches of 2 rows), rank 1 values 100..111 (3 batches of 4)
    values = [*range(4), *range(100, 112)]
    expected = {
        "loss": (0 * 4 + 1 * 12) / 16,  # each rank's loss is its rank, weighted by rows
        "ones": 1.0,
        "value": sum(values) / 16,  # the per-batch means weighted by rows
        "rows": 16,
        "biggest": 111.0,
        "smallest": 0.0,
        "rank_last": 1,  # "last" takes the highest rank's
        "spread": 111.0 - 1.0,  # np.ptp over every step's batch max: 1, 3, 103, 107, 111
    }
    for r in (r0, r1):
        assert r["returned"] == pytest.approx(expected)
        assert r["seen"] == [r["returned"]]
    summary = [line for line in r0["lines"] if "<mode=eval_summary>" in line]
    assert len(summary) == 1 and "<rows=16>" in summary[0] and "<steps=2>" in summary[0]
    assert not [line for line in r1["lines"] if "eval_summary" in line]
