"""A job whose trace sink and tracker hang, for the test of a close cut short by a second signal.

    python close_cut_short.py OUT_DIR BACKEND

Traces ROWS rows per step (ids numbered from 0) through TraceHook(ParquetSink(OUT_DIR, "t"))
with a batch per step and one worker, and tracks ``loss`` per step through MLTrackerHook on a
JsonlTracker under ``OUT_DIR/runs``.  Both hang: the sink's ``write`` and the tracker's ``log``
wait on a gate that only opens after the bus has closed.  Step 0 is published (its batch and
its record each held by a hung call), then ``ready`` is printed; step 1 then waits for room
until the first stop signal; ``stopping`` is printed when the loop ends and the close begins.
The published steps go to ``OUT_DIR/steps.txt``.  Logs go to stderr.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import anyio
import numpy as np

from recis_async import HookBus, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import MLTrackerHook, TraceHook
from recis_async.sinks import ParquetSink
from recis_async.trace.base import Attempt
from recis_async.trace.buffer import Batch
from recis_async.trackers import JsonlTracker, StepRecord

ROWS = 16
GATE = threading.Event()  # opened once the bus has closed: the hung calls then end
HANG_S = 60.0  # a bound on the job, never reached in the test


class HungSink(ParquetSink):
    def write(self, batch: Batch, attempt: Attempt) -> None:
        GATE.wait(HANG_S)
        super().write(batch, attempt)  # abandoned by then: nothing is published


class HungJsonl(JsonlTracker):
    def log(self, records: Sequence[StepRecord]) -> None:
        GATE.wait(HANG_S)
        super().log(records)


async def main(out: Path) -> None:
    steps = 0
    try:
        async with HookBus(flush_timeout=60) as bus:
            bus.add_hook(
                TraceHook(
                    HungSink(out, "t", rank=0),
                    ["id"],
                    ["bigint"],
                    worker_num=1,
                    size_threshold=1,  # a batch per step
                    spill_dir=out / "spill",
                )
            )
            bus.add_hook(
                MLTrackerHook(
                    "p",
                    "cut",
                    tracker=HungJsonl(out / "runs"),
                    max_buffer_bytes=150,  # one record {"loss": x} fits, a second does not
                    flush_interval=0,
                    spill_dir=out / "tracker_spill",
                )
            )
            for step in itertools.count():
                await bus.publish(BeforeStep(global_step=step))
                add_to_trace("id", np.arange(step * ROWS, (step + 1) * ROWS))
                await bus.publish(AfterStep(global_step=step, tracked={"loss": float(step)}))
                steps += 1
                if step == 0:
                    await anyio.sleep(0.2)  # the hung calls take step 0's batch and record
                    print("ready", flush=True)
                if bus.should_stop:
                    break
            print("stopping", flush=True)
    finally:
        GATE.set()
        (out / "steps.txt").write_text(str(steps))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    anyio.run(main, Path(sys.argv[1]), backend=sys.argv[2])
