"""What importing this library adds to a job's start, per path, in fresh processes.

Each run is a fresh interpreter that imports torch first (untimed: every path needs it), then
times the imports one path needs from this library -- ``own`` (a loop with the logger,
progress bar, tracker and checkpoint hooks), ``trainer`` (the ``Trainer`` with its default
hooks and a tracker), ``trace`` (``own`` plus ``TraceHook(ParquetSink)``: pyarrow and the
writer) -- and reports which heavy modules came with them.  Bytecode is cached as for an
installed package (one untimed run per path and checkout writes it first).  Runs of the
paths (and of the ``--compare`` checkout's, if given) alternate over ``--reps``
repetitions; printed: the median seconds and range per path, and the median of the paired
differences against the compared checkout::

    python benchmarks/bench_import.py [--reps 10] [--compare /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What each path imports, as its user's module would.
PATHS = {
    "own": (
        "from recis_async import (CheckpointSaverHook, HookBus, LoggerHook, MLTrackerHook,"
        " ProgressBarHook, add_metric, add_to_ml_tracker)\n"
        "from recis_async.events import AfterStep, BeforeStep\n"
        "from recis_async.trackers import JsonlTracker\n"
    ),
    "trainer": (
        "from recis_async import MLTrackerHook, ProgressBarHook, Trainer, TrainingArguments\n"
        "from recis_async.trackers import JsonlTracker\n"
    ),
    "trace": (
        "from recis_async import (CheckpointSaverHook, HookBus, LoggerHook, MLTrackerHook,"
        " ParquetSink, ProgressBarHook, TraceHook, add_metric, add_to_trace)\n"
        "from recis_async.trackers import JsonlTracker\n"
    ),
}

#: Modules whose presence says what a path pulled in.
HEAVY = ("pyarrow", "recis_async.trace", "tqdm", "greenlet", "trio")

_CHILD = """
import json, sys, time
import torch  # every path needs it: not counted
start = time.perf_counter()
exec(compile(sys.argv[1], "<imports>", "exec"))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "heavy": [m for m in sys.argv[2:] if m in sys.modules]}))
"""


def run(path: str, code: Path) -> dict[str, object]:
    """One fresh interpreter importing ``path``'s modules from the checkout at ``code``."""
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package has its bytecode cached
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, PATHS[path], *HEAVY],
        env=env, capture_output=True, text=True, timeout=300, cwd=code,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{path} with {code}: the child failed:\n{proc.stderr[-3000:]}")
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=10, help="repetitions (default 10)")
    parser.add_argument("--only", default=",".join(PATHS), help="paths, comma-separated")
    parser.add_argument("--compare", type=Path, help="another checkout, run alternately")
    args = parser.parse_args()
    paths = args.only.split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        parser.error(f"--only: unknown paths {unknown}; known: {', '.join(PATHS)}")
    if args.reps < 1:
        parser.error(f"--reps: expected an int >= 1, got {args.reps}")
    codes = {"": ROOT} | ({"@compare": args.compare.resolve()} if args.compare else {})
    seconds: dict[str, list[float]] = {}
    heavy: dict[str, list[str]] = {}
    for path in paths:  # untimed: each checkout's bytecode cached, the files read once
        for code in codes.values():
            run(path, code)
    for rep in range(args.reps):
        for path in paths:
            # alternate which checkout goes first: a cold file cache favours the second
            for tag, code in list(codes.items())[:: 1 if rep % 2 == 0 else -1]:
                result = run(path, code)
                seconds.setdefault(path + tag, []).append(float(result["seconds"]))  # type: ignore[arg-type]
                heavy[path + tag] = list(result["heavy"])  # type: ignore[call-overload]
    print(f"import seconds after torch (fresh processes, {args.reps} repetitions)\n")
    print("| path | median s (range) | also imported |")
    print("|---|---|---|")
    for name, values in seconds.items():
        low, high = min(values), max(values)
        also = ", ".join(heavy[name]) or "-"
        print(f"| {name} | {statistics.median(values):.3f} ({low:.3f}-{high:.3f}) | {also} |")
    if args.compare:
        print()
        for path in paths:
            pairs = zip(seconds[path], seconds[path + "@compare"], strict=True)
            diff = statistics.median(a - b for a, b in pairs)
            print(f"{path}: {diff * 1e3:+.0f} ms against {args.compare} (median of pairs)")


if __name__ == "__main__":
    main()
