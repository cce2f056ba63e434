"""A training loop tracing rows to Parquet, for the signal test.

    python trace_loop.py OUT_DIR BACKEND

Traces 64 rows per step (ids numbered from 0) through TraceHook(ParquetSink(OUT_DIR, "t")),
prints ``ready`` after 20 steps and runs until stopped; the number of steps published goes to
``OUT_DIR/steps.txt`` once the bus has closed.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import anyio
import numpy as np

from recis_async import HookBus, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink

ROWS = 64


async def main(out: Path) -> None:
    steps = 0
    try:
        async with HookBus(flush_timeout=30) as bus:
            bus.add_hook(
                TraceHook(
                    ParquetSink(out, "t", rank=0),
                    ["id", "emb"],
                    ["bigint", "array<float>"],
                    worker_num=2,
                    size_threshold=64 * 1024,
                    spill_dir=out / "spill",
                )
            )
            for step in itertools.count():
                await bus.publish(BeforeStep(global_step=step))
                add_to_trace("id", np.arange(step * ROWS, (step + 1) * ROWS))
                add_to_trace("emb", np.full((ROWS, 16), step, np.float32))
                await bus.publish(AfterStep(global_step=step, samples=ROWS))
                steps += 1
                if step == 20:
                    print("ready", flush=True)
                if bus.should_stop:
                    break
                await anyio.sleep(0.002)
    finally:
        (out / "steps.txt").write_text(str(steps))


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), backend=sys.argv[2])
