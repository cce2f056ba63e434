"""Instructions per step of bench_peers' job on each path, counted under callgrind.

Times on a shared 2-core machine drift by more than the library's whole cost (bench_peers'
A/A row); instruction counts do not: the same code runs the same instructions however loaded
the machine is, so a change of a few thousand instructions a step is seen in one run.  They
are not time -- on the step, right after the model's compute, Python's code runs out of
cache, and a thousand instructions there cost about 1.7 µs (bench_peers' CPU figures against
these counts) -- but fewer of them is what makes the step lighter.

Each config of ``bench_peers.py`` runs in a fresh process under ``valgrind --tool=callgrind``
with instrumentation off, switched on (``callgrind_control -i on``) at the forward call of
step 60 and off at step ``60 + --steps``: the count covers exactly those steps, every thread
(the hooks' workers, the Parquet writer) included.  The model is small (``--hidden 16``), so
the runs are short.  Time-based work is scaled to valgrind's ~50x slowdown, as at full speed:
tqdm redraws every 30 steps (never inside the count), the tracker and the bus's yields to
services do not fire inside it (at full speed a 1 s flush spans ~300 steps), nor does the
trace's ``max_age`` seal (the Parquet writer's encoding, thousands of steps' rows at once at
full speed, is left out of the count: ``bench_trace.py`` measures it).

Printed: instructions per step, and over the plain loop's of the same run.

``--cycles`` simulates the caches and the branch predictor as well (``--cache-sim=yes
--branch-sim=yes``, about twice as slow) and prints estimated cycles instead, by
KCachegrind's formula: instructions + 10 per first-level cache miss + 100 per last-level
miss + 10 per mispredicted branch.  The library's code on the step misses the caches and
mispredicts more often than the model's compute, so its share of the estimate is what its
share of the step's time is (checked against ``bench_peers``' CPU figures: benchmarks/README.md,
"Estimated cycles"); the estimate moves by up to ~1 % of the step between runs of the same
code (where the heap lands), the instruction count by ~0.1 %.

    python benchmarks/bench_instructions.py [--only trainer,own] [--steps 100]
    python benchmarks/bench_instructions.py --compare <checkout>   # before/after rows
    python benchmarks/bench_instructions.py --cycles              # % of the plain loop's step
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_peers  # noqa: E402

WARM = 60
DEFAULT = ("plain", "trainer", "async-loop", "sync-loop")


def _toggle(state: str) -> None:
    """Switch callgrind's instrumentation of this process on or off (returns once done)."""
    proc = subprocess.Popen(
        ["callgrind_control", "-i", state, str(os.getpid())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while proc.poll() is None:
        time.sleep(0.005)


class _Marks(list):  # type: ignore[type-arg]
    """``Clock.times``, switching instrumentation on at step ``WARM`` and off ``steps`` later."""

    def __init__(self, steps: int, toggle: bool) -> None:
        super().__init__()
        self.steps, self.toggle = steps, toggle

    def append(self, value: Any) -> None:
        n = len(self)
        if self.toggle and n in (WARM, WARM + self.steps):
            if n == WARM:
                # Each count starts with the collector's young generations empty: otherwise
                # where the count starts in the collector's cycle (which any change to what
                # was imported or allocated before moves) decides whether a collection of
                # the middle generation lands inside it, ~18k a step either way.
                gc.collect()
            _toggle("on" if n == WARM else "off")
        super().append(value)


def _as_at_full_speed() -> None:
    """Time-based work at its full-speed cadence, not valgrind's (see the module)."""
    import tqdm

    from recis_async import bus
    from recis_async.hooks import trace
    from recis_async.trackers import service

    init = tqdm.tqdm.__init__

    def bar(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **{**k, "mininterval": 1e6, "miniters": 30})

    tqdm.tqdm.__init__ = bar  # type: ignore[method-assign]
    tracker_init = service.TrackerService.__init__

    def tracker(self: Any, *a: Any, **k: Any) -> None:
        tracker_init(self, *a, **k)
        self.flush_interval = 1e9

    service.TrackerService.__init__ = tracker  # type: ignore[method-assign]
    bus._YIELD_EVERY_S = 1e9  # type: ignore[misc]
    trace_init = trace.TraceHook.__init__

    def traced(self: Any, *a: Any, **k: Any) -> None:
        trace_init(self, *a, **k)
        self._max_age = self._writer._max_age = 1e9

    trace.TraceHook.__init__ = traced  # type: ignore[method-assign]


def child(config: str, steps: int, hidden: int, toggle: bool) -> None:
    import logging

    torch, mlp, batches = bench_peers.build(hidden, WARM + steps + 5)
    framework = config.split("+")[0]
    _as_at_full_speed()
    clock = bench_peers.Clock()
    clock.times = _Marks(steps, toggle)
    bench_peers.time_the_model(torch, mlp, clock)
    runner = getattr(bench_peers, f"run_{framework.replace('-', '_')}")
    with tempfile.TemporaryDirectory() as out:
        runner(
            torch, mlp, batches, clock, Path(out), logging.getLogger("bench"),
            config.endswith("+adapter"),
        )  # fmt: skip


def count(config: str, steps: int, hidden: int, code: Path, cycles: bool = False) -> float:
    """Instructions (``cycles``: estimated cycles) per step of ``config`` with the
    recis_async of ``code``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        sim = ["--cache-sim=yes", "--branch-sim=yes"] if cycles else []
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", *sim,
             f"--callgrind-out-file={out}", sys.executable, __file__, "--child", config,
             "--steps", str(steps), "--hidden", str(hidden), "--toggle"],
            env=env, capture_output=True, text=True, cwd=code,
        )  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"{config}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        lines = out.read_text().splitlines()
        events = [line.split()[1:] for line in lines if line.startswith("events:")]
        totals = [line.split()[1:] for line in lines if line.startswith("totals:")]
        if not events or not totals:  # (the "summary:" line counts from the start: 0 here)
            raise SystemExit(f"{config}: callgrind wrote no totals")
        counts = dict(zip(events[-1], map(int, totals[-1]), strict=True))
        return (estimated_cycles(counts) if cycles else counts["Ir"]) / steps


def estimated_cycles(counts: dict[str, int]) -> int:
    """KCachegrind's cycle estimate from callgrind's event counts (cache and branch
    simulation on): a first-level miss costs 10 cycles, a last-level one 100, a mispredicted
    branch 10."""
    first = counts["I1mr"] + counts["D1mr"] + counts["D1mw"]
    last = counts["ILmr"] + counts["DLmr"] + counts["DLmw"]
    return counts["Ir"] + 10 * first + 100 * last + 10 * (counts["Bcm"] + counts["Bim"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="comma-separated configs ('own': both own loops)")
    parser.add_argument("--steps", type=int, default=100, help="steps counted a run")
    parser.add_argument("--hidden", type=int, default=16, help="the MLP's hidden width")
    parser.add_argument("--compare", metavar="DIR", help="also count the checkout DIR's code")
    parser.add_argument(
        "--cycles", action="store_true", help="estimated cycles (cache and branch simulation)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--toggle", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.hidden, args.toggle)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench_instructions needs valgrind (apt install valgrind)")
    names = args.only.split(",") if args.only else list(DEFAULT)
    configs = [c for n in names for c in bench_peers.ALIASES.get(n, [n])]
    configs = ["plain"] + [c for c in dict.fromkeys(configs) if c != "plain"]
    unknown = [c for c in configs if c not in bench_peers.CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(bench_peers.CONFIGS)}")
    codes = [("", HERE.parent)]
    if args.compare:
        codes.append((f"@{Path(args.compare).resolve().name}", Path(args.compare).resolve()))
    rows = []
    for config in configs:
        for suffix, code in codes if config != "plain" else codes[:1]:
            per_step = count(config, args.steps, args.hidden, code, args.cycles)
            rows.append((config + suffix, per_step))
            print(f"{config + suffix:24s} {per_step / 1e3:9.1f}k", file=sys.stderr, flush=True)
    plain = rows[0][1]
    what = "estimated cycles" if args.cycles else "instructions"
    print(f"{what} per step (callgrind, {args.steps} steps, --hidden {args.hidden})\n")
    print(f"| path | k {what} / step | over plain | over plain, % of its step |")
    print("|---|---|---|---|")
    for label, per_step in rows:
        over = per_step - plain
        print(f"| {label} | {per_step / 1e3:.1f} | {over / 1e3:+.1f} | {100 * over / plain:+.1f} |")


if __name__ == "__main__":
    main()
