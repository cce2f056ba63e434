"""Benchmarks run in CI as smoke tests: a tiny configuration on the CPU, start to end, printing
what a real run prints (the figures themselves are measured on the hardware they are for)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def table_rows(out: str, header: str) -> dict[str, list[str]]:
    """The rows of the Markdown tables in ``out``, by first cell (header rows left out)."""
    return {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in out.splitlines()
        if line.startswith("| ") and not line.startswith(f"| {header}")
    }


def run_bench(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<script> <args>`` from the checkout's root, with its package and one
    OpenMP thread; asserted to exit 0 (the failure shows the command and what it printed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, f"benchmarks/{script}", *args]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert proc.returncode == 0, " ".join(command[1:]) + proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_bench_gpu_runs_in_cpu_smoke_mode() -> None:
    """``benchmarks/bench_gpu.py --device cpu``: every variant runs with every hook on, and the
    table of ratios against the hook-free baseline is printed."""
    proc = run_bench("bench_gpu.py", "--device", "cpu", "--backend", "trio")
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


@pytest.mark.slow
def test_bench_hooks_breakdown_names_every_hook_and_collector_of_the_job() -> None:
    """``bench_hooks.py --only breakdown``: a row per subscriber, collector and bus part of
    the held-out job, on the Trainer and on an own loop, with the step thread's total."""
    proc = run_bench(
        "bench_hooks.py", "--only", "breakdown", "--rounds", "1", "--breakdown-steps", "80",
        "--breakdown-configs", "trainer,async-loop",
    )  # fmt: skip
    rows = table_rows(proc.stdout, "row")
    for name in ("hook ProgressBarHook.after_step", "hook MLTrackerHook.after_step",
                 "hook LoggerHook.after_step",
                 "collector add_metric", "collector add_to_ml_tracker",
                 "bus publish AfterStep", "model backward", "= step thread CPU"):  # fmt: skip
        assert name in rows, proc.stdout
        assert all(float(cell.split()[0]) >= 0 for cell in rows[name]), rows[name]
    # the checkpoint saver acts at its save steps only: the bus calls it on none of these
    assert "hook CheckpointSaverHook.after_step" not in rows, proc.stdout
    # the own loop has no Trainer
    assert rows["trainer next batch (Lookahead.take, to_device)"][1] == "–", rows


@pytest.mark.slow
def test_bench_peers_only_keeps_the_a_a_row() -> None:
    """``bench_peers.py --only``: plain and plain-again (the A/A row) run beside what was
    asked; ``own`` is the two own loops."""
    proc = run_bench("bench_peers.py", "--quick", "--only", "own")
    table = proc.stdout.split("\n\n")[0]  # the first table (the within-repetition one follows)
    paths = [line.split("|")[1].strip() for line in table.splitlines() if line[:2] == "| "]
    assert paths == ["path", "plain", "plain-again", "async-loop", "sync-loop"], proc.stdout


@pytest.mark.slow
def test_bench_hooks_copy_out_compares_the_three_places() -> None:
    """``bench_hooks.py --only copy-out``: on the step, batched in the thread, every step."""
    proc = run_bench("bench_hooks.py", "--only", "copy-out", "--rounds", "1")
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("on the", "copy-out"))]
    assert len(rows) == 3 and all(float(row.split()[-4]) > 0 for row in rows), proc.stdout


def test_bench_peers_pairs_each_repetitions_configs() -> None:
    """``bench_peers.paired``: within each repetition, a config minus the plain loop (the mean
    of plain and plain-again; plain-again minus plain) and minus its ``--compare`` code."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_peers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def runs(*besides_us: float) -> list[dict[str, float]]:
        return [{"cpu_ms": 3.0 + b / 1e3, "model_ms": 3.0} for b in besides_us]

    table = bench_peers.paired(
        {
            "plain": runs(200, 260),
            "plain-again": runs(220, 240),
            "own": runs(400, 330),
            "own@before": runs(500, 480),
        }
    )
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
        for line in table.splitlines()[2:]
    }
    assert rows == {
        "plain-again": ["+0 (+20, -20)", "–"],
        "own": ["+135 (+190, +80)", "-125 (-100, -150)"],
    }, table


def _bench_peers() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_peers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench_peers


def test_bench_peers_median_interval_is_the_sign_tests() -> None:
    """The 95 % interval of a median from order statistics: with 18 values the 5th and the
    14th (P(Binomial(18, 1/2) <= 4) = 0.015 <= 0.025 < P(<= 5)); with 8 or fewer, none is
    excluded (P(<= 1) = 0.035 already)."""
    interval = _bench_peers().median_interval
    assert interval([float(v) for v in range(18, 0, -1)]) == (5.0, 14.0)
    assert interval([3.0, 1.0, 2.0, 8.0, 5.0, 4.0, 7.0, 6.0]) == (1.0, 8.0)
    assert interval([2.0]) == (2.0, 2.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--paired", "0", "--only", "ignite"], "--paired: expected a number of jobs a side >= 1"),
        (["--paired", "2", "--only", "trainer"], "--paired: expected --only to name a framework"),
        (["--steps", "40"], "--steps: expected more than 52 (50 warm-up), got 40"),
        (
            ["--paired", "2", "--only", "ignite+adapter", "--compare", "benchmarks"],
            "--compare: expected a checkout holding recis_async/, got benchmarks",
        ),
    ],
)
def test_bench_peers_refuses_what_it_cannot_measure(argv: list[str], message: str) -> None:
    """A paired run with no job a side or no framework, or fewer steps than the warm-up: a
    usage error naming the option, before any job runs (not an IndexError in a child, nor an
    empty table)."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_peers.py", *argv],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_bench_peers_paired_report_reads_each_block_at_its_speed() -> None:
    """``--paired``: a job's cost besides the model is read as a share of its own model time,
    so blocks run at different speeds (the VM's minute) give the adapter's cost at the
    framework's median model time, where the raw difference gives the speed's."""

    def pair(speed_a: float, speed_b: float) -> dict[str, float]:
        model, framework, adapter = 3000.0, 400.0, 100.0  # µs a step at speed 1
        return {
            "a_us": speed_a * framework,
            "a_model_us": speed_a * model,
            "a_p50_ms": speed_a * (model + framework) / 1e3,
            "a_gc_us": 0.0,
            "b_us": speed_b * (framework + adapter),
            "b_model_us": speed_b * model,
            "b_p50_ms": speed_b * (model + framework + adapter) / 1e3,
            "b_gc_us": 2.0,
            "a_ours_us": 0.0,
            "b_ours_us": speed_b * 60.0,  # of the adapter's 100: the library's own code
        }

    runs = [{"pairs": [pair(1.0, 1.3), pair(1.3, 1.0), pair(1.0, 1.0)]}]
    table = _bench_peers().paired_report({"ignite+adapter": runs})
    row = table.splitlines()[2].split("|")
    assert row[1].strip() == "ignite+adapter (step p50 3.40 ms)", table
    assert row[2].strip() == "+100 µs = +2.9 %", table
    assert row[4].strip() == "+100 to +100 (3)", table
    assert row[6].strip() == "+100 (-20 to +250)", table  # raw: the speed's, not the adapter's
    assert row[7].strip() == "0 / 2 µs", table
    assert row[8].strip() == "+60.0 µs (+60.0 to +60.0)", table
    # without --compare the library's code is not timed (side a has none): no figure
    for p in runs[0]["pairs"]:
        del p["a_ours_us"], p["b_ours_us"]
    table = _bench_peers().paired_report({"ignite+adapter": runs})
    assert table.splitlines()[2].split("|")[8].strip() == "–", table


@pytest.mark.slow
def test_bench_instructions_child_runs_each_path_without_valgrind() -> None:
    """``bench_instructions.py --child``: the job of each path runs as it will under callgrind
    (its time-based work scaled), start to end, on a machine without valgrind too."""
    for config in ("plain", "trainer", "async-loop", "sync-loop"):
        run_bench("bench_instructions.py", "--child", config, "--steps", "5")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
@pytest.mark.parametrize("cycles", [False, True], ids=["instructions", "cycles"])
def test_bench_instructions_counts_each_path_under_callgrind(cycles: bool) -> None:
    """``bench_instructions.py``: a count per path, the plain loop's first, each over it (in
    k and in % of the plain loop's); ``--cycles``: estimated cycles, more than instructions."""
    proc = run_bench(
        "bench_instructions.py", "--only", "async-loop", "--steps", "5",
        *(["--cycles"] if cycles else []), timeout=900,
    )  # fmt: skip
    rows = table_rows(proc.stdout, "path")
    assert list(rows) == ["plain", "async-loop"], proc.stdout
    assert rows["plain"][1:] == ["+0.0", "+0.0"] and float(rows["async-loop"][0]) > 100, proc.stdout
    plain, own = float(rows["plain"][0]), float(rows["async-loop"][0])
    assert float(rows["async-loop"][2]) == pytest.approx(100 * (own - plain) / plain, abs=0.1)
    assert ("estimated cycles per step" in proc.stdout) is cycles, proc.stdout


def test_estimated_cycles_weighs_misses_by_kcachegrinds_formula() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_instructions import estimated_cycles
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    counts = dict(
        Ir=1000, I1mr=1, D1mr=2, D1mw=3, ILmr=1, DLmr=0, DLmw=2, Bc=50, Bcm=4, Bi=9, Bim=1
    )
    assert estimated_cycles(counts) == 1000 + 10 * 6 + 100 * 3 + 10 * 5


def test_bench_import_times_each_path_and_names_what_it_pulled_in() -> None:
    """``bench_import.py``: a row per path; an own loop's imports bring no pyarrow, tracing's
    do; with ``--compare`` the paired differences are printed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_import.py", "--reps", "1", "--only", "own,trace",
         "--compare", str(ROOT)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = table_rows(proc.stdout, "path")
    assert sorted(rows) == ["own", "own@compare", "trace", "trace@compare"], proc.stdout
    assert "pyarrow" not in rows["own"][1] and "pyarrow" in rows["trace"][1], proc.stdout
    assert float(rows["own"][0].split()[0]) > 0, proc.stdout
    assert "own: " in proc.stdout and "ms against" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_bench_cold_prints_each_pair_of_ways() -> None:
    """``bench_cold.py``: every way of every pair timed after a training step, each with its
    difference from its pair's first way (zero for that one)."""
    proc = run_bench("bench_cold.py", "--rounds", "3", "--hidden", "16")
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    ways = {(pair.strip(), way.strip()): (float(median), float(minus))
            for pair, way, median, minus in rows[1:]}  # fmt: skip
    assert sorted(ways) == sorted([
        ("read", "item()"), ("read", "tolist()"),
        ("event", "AfterStep + merged"), ("event", "AfterStep built once"),
    ]), proc.stdout  # fmt: skip
    for first in (("read", "item()"), ("event", "AfterStep + merged")):
        assert ways[first][1] == 0.0 and ways[first][0] > 0, proc.stdout
