"""A synchronous loop that opens a ``SyncHookBus`` with ``open()`` and never closes it.

    python left_open.py OUT_DIR asyncio|trio raise|return

Five steps trace 4 rows each (``TraceHook(ParquetSink(OUT_DIR, "t"))``) and track a value
(``MLTrackerHook``, JSONL under ``OUT_DIR/ml``); then the program dies of a ``ValueError``
(``raise``) or just ends (``return``) with the bus still open.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from recis_async import SyncHookBus, add_to_ml_tracker, add_to_trace
from recis_async.events import AfterStep
from recis_async.hooks import MLTrackerHook, TraceHook
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker


def main() -> None:
    out, backend, ending = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    bus = SyncHookBus(flush_timeout=10, backend=backend).open()
    bus.add_hook(
        TraceHook(ParquetSink(out, "t", rank=0), ["id"], ["bigint"], spill_dir=out / "spill")
    )
    bus.add_hook(
        MLTrackerHook("p", "r", tracker=JsonlTracker(out / "ml"), spill_dir=out / "ml_spill")
    )
    for step in range(5):
        add_to_trace("id", np.arange(step * 4, step * 4 + 4))
        add_to_ml_tracker("loss", float(step))
        bus.publish(AfterStep(global_step=step, samples=4))
    if ending == "raise":
        raise ValueError("the loop died")


if __name__ == "__main__":
    main()
