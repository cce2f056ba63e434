"""A traced and tracked training loop for the signal-storm tests.

    python storm_loop.py OUT_DIR BACKEND

Every step traces ``ROWS`` rows (ids numbered from 0) through
``TraceHook(ParquetSink(OUT_DIR, "t"))`` (small batches, so some are delivered, some queued
and some buffered whenever a signal arrives) and tracks one value through
``MLTrackerHook(JsonlTracker(OUT_DIR / "ml"))``.  After each ``AfterStep`` publish returns,
its step number is appended to ``OUT_DIR/published.txt`` (unbuffered), so the test knows
which rows the library owes.  Prints ``ready`` after 10 steps and runs until stopped.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import anyio
import numpy as np

from recis_async import HookBus, add_to_ml_tracker, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import MLTrackerHook, TraceHook
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker

ROWS = 32


async def main(out: Path) -> None:
    fd = os.open(out / "published.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        async with HookBus(flush_timeout=30) as bus:
            bus.add_hook(
                TraceHook(
                    ParquetSink(out, "t", rank=0),
                    ["id", "tag"],
                    ["bigint", "string"],
                    worker_num=2,
                    size_threshold=4 * 1024,
                    spill_dir=out / "spill",
                )
            )
            bus.add_hook(
                MLTrackerHook(
                    "storm",
                    "run",
                    tracker=JsonlTracker(out / "ml"),
                    flush_interval=0.05,
                    spill_dir=out / "ml_spill",
                )
            )
            for step in itertools.count():
                await bus.publish(BeforeStep(global_step=step))
                add_to_trace("id", np.arange(step * ROWS, (step + 1) * ROWS))
                add_to_trace("tag", [f"s{step}"] * ROWS)
                add_to_ml_tracker("x", float(step))
                await bus.publish(AfterStep(global_step=step, samples=ROWS))
                os.write(fd, b"%d\n" % step)
                if step == 10:
                    print("ready", flush=True)
                if bus.should_stop:
                    break
                time.sleep(0.001)  # the "compute" of a step
                await anyio.sleep(0.001)
    finally:
        os.close(fd)


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), backend=sys.argv[2])
