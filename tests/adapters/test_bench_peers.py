"""benchmarks/bench_peers.py --quick: every path of the side-by-side job runs and reports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_peers_quick_runs_every_path(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--quick"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    for config in ("plain", "plain-again", "trainer", "async-loop", "sync-loop"):
        assert f"| {config} |" in table, table
    for framework in ("lightning", "hf", "ignite"):
        assert f"| {framework} |" in table and f"| {framework}+adapter |" in table, table
    # every path spends some CPU of its own besides the model's (Lightning's closure, run
    # inside the optimizer's step, once counted as the model's: a negative figure)
    first = table.partition("within each repetition")[0]
    rows = [line for line in first.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 12, first  # the header and the 11 configs
    for line in rows[1:]:
        besides = line.split("|")[4].split()[0]  # "CPU µs/step besides the model (range)"
        assert float(besides) > 0, line
    _, _, added = table.partition("What each adapter adds to its framework's step")
    for framework in ("lightning", "hf", "ignite"):  # step thread, whole process, p50
        row = next(line for line in added.splitlines() if line.startswith(f"| {framework}+"))
        assert row.count(" µs = ") == 3, row


@pytest.mark.slow
def test_bench_peers_paired_alternates_the_jobs_in_one_process(tmp_path: Path) -> None:
    """``--paired``: one process per config and repetition, a job not counted, then jobs
    without and with the adapter alternated; every job's figures are reported, the A/A row
    (the bare framework) beside the adapter's."""
    proc = _paired(tmp_path, "2")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ignite")]
    assert [row.split("(")[0].strip("| ") for row in rows] == ["ignite", "ignite+adapter"]
    for row in rows:
        cells = row.split("|")
        assert cells[4].strip().endswith("(2)"), row  # both pairs of the one process
        assert " µs = " in cells[2] and cells[7].strip().endswith("µs"), row
    # stderr has a line per process: each config's one, with its pairs' raw differences
    assert proc.stderr.count("rep 1/1 ignite") == 2, proc.stderr[-3000:]


@pytest.mark.slow
def test_bench_peers_paired_compare_runs_the_other_checkouts_adapter_on_side_a(
    tmp_path: Path,
) -> None:
    """``--paired --compare DIR``: in the one process, side ``a`` of ``ignite+adapter`` runs
    the adapter with DIR's ``recis_async`` and side ``b`` with this checkout's (each job
    with its side's modules); the bare framework stays the A/A."""
    other = tmp_path / "other"
    shutil.copytree(
        ROOT / "recis_async", other / "recis_async", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path / "paired.json"
    proc = _paired(tmp_path, "1", "--compare", str(other), "--json", str(out))
    assert f"side a: '<framework>+adapter' with the recis_async of {other}" in proc.stdout
    results = json.loads(out.read_text())
    [adapter] = results["ignite+adapter"]
    assert Path(adapter["code"]["a"]).is_relative_to(other), adapter["code"]
    assert Path(adapter["code"]["b"]).is_relative_to(ROOT / "recis_async"), adapter["code"]
    [bare] = results["ignite"]  # no adapter on either side: this checkout's code, untouched
    assert Path(bare["code"]["a"]).is_relative_to(ROOT / "recis_async"), bare["code"]
    # both sides of the adapter's pair ran the adapter (the same code: within the noise)
    [pair] = adapter["pairs"]
    assert pair["a_us"] > 0 and pair["b_us"] > 0


def _paired(tmp_path: Path, blocks: str, *more: str) -> subprocess.CompletedProcess[str]:
    """``bench_peers.py --paired BLOCKS`` of a tiny Ignite job, with and without the adapter,
    one process a config; checked to have exited 0."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_peers.py"), "--paired", blocks,
         "--reps", "1", "--steps", "80", "--hidden", "16", "--only", "ignite,ignite+adapter",
         *more],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
