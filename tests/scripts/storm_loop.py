"""A traced and tracked training loop for the signal-storm and interrupt tests.

    python storm_loop.py OUT_DIR BACKEND [--workers N --start-method fork|spawn] [--hooks-only]

Every step traces ``ROWS`` rows (ids numbered from 0) through
``TraceHook(ParquetSink(OUT_DIR, "t"))`` (small batches, so some are delivered, some queued
and some buffered whenever a signal arrives) and tracks one value through
``MLTrackerHook(JsonlTracker(OUT_DIR / "ml"))``.  After each ``AfterStep`` publish returns,
its step number is appended to ``OUT_DIR/published.txt`` (unbuffered), so the test knows
which rows the library owes.  Prints ``ready`` after 10 steps and runs until stopped.

``--workers N``: the step numbers come from a ``DataLoader`` with ``N`` worker processes
started by ``--start-method`` (they share the terminal's process group, so a Ctrl-C reaches
them too).  ``--hooks-only``: no trace, no tracker, only an in-band hook, so the bus has no
service (and the loop never yields to the event loop on its own).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Iterable
from pathlib import Path

import anyio
import numpy as np

from recis_async import HookBus, add_to_ml_tracker, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import MLTrackerHook, StepCounterHook, TraceHook
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker

ROWS = 32


class Steps:
    """A map-style dataset of step numbers, for a ``DataLoader`` with workers."""

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> int:
        return i


def steps(workers: int, start_method: str) -> Iterable[int]:
    if not workers:
        return itertools.count()
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        Steps(),  # type: ignore[arg-type]
        batch_size=None,
        num_workers=workers,
        multiprocessing_context=start_method,
    )
    return (int(i) for i in loader)


async def main(out: Path, workers: int, start_method: str, hooks_only: bool) -> None:
    fd = os.open(out / "published.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        async with HookBus(flush_timeout=30) as bus:
            if hooks_only:
                bus.add_hook(StepCounterHook(every_n_steps=1000))
            else:
                add_hooks(bus, out)
            for step in steps(workers, start_method):
                await bus.publish(BeforeStep(global_step=step))
                if not hooks_only:
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
                if not hooks_only:
                    await anyio.sleep(0.001)
    finally:
        os.close(fd)


def add_hooks(bus: HookBus, out: Path) -> None:
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("backend")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--start-method", default="fork")
    parser.add_argument("--hooks-only", action="store_true")
    args = parser.parse_args()
    anyio.run(
        main, args.out, args.workers, args.start_method, args.hooks_only, backend=args.backend
    )
