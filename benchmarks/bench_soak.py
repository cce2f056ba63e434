"""Soak: ``--rows`` traced rows (default 10M) into Parquet through a real bus, memory flat.

Each step traces ``--rows-per-step`` rows of ``id bigint, v double, emb array<float>(8)``
through ``TraceHook(ParquetSink)`` (``--size-threshold`` bytes a batch, two workers).  The
process's resident memory (RSS) is sampled every step: printed are the rows, RSS at the start
(after the first batch, when the sink and the allocators are warm), its peak, at the end,
and the time.  Every row is then counted back with pyarrow (once each: ids are unique).

    python benchmarks/bench_soak.py [--rows 10000000] [--rows-per-step 20000]

A flat RSS means buffered and written batches are released: the peak stays near the start
figure plus about ``(worker_num + 2) * size_threshold``, whatever ``--rows`` is.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np
import psutil
import pyarrow.compute as pc
import pyarrow.dataset as ds

from recis_async import HookBus, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink

MIB = 1 << 20


async def soak(root: Path, rows: int, per_step: int, threshold: int) -> dict[str, float]:
    proc = psutil.Process()
    hook = TraceHook(
        ParquetSink(root, "soak", rank=0),
        ["id", "v", "emb"],
        ["bigint", "double", "array<float>"],
        worker_num=2,
        size_threshold=threshold,
        spill_dir=root / "spill",
    )
    emb = np.ones((per_step, 8), np.float32)
    start_rss = peak = 0
    t0 = time.perf_counter()
    async with HookBus(handle_signals=False) as bus:
        bus.add_hook(hook)
        for step in range(rows // per_step):
            await bus.publish(BeforeStep(global_step=step))
            ids = np.arange(step * per_step, (step + 1) * per_step)
            add_to_trace("id", ids)
            add_to_trace("v", ids * 0.5)
            add_to_trace("emb", emb)
            await bus.publish(AfterStep(global_step=step, samples=per_step))
            rss = proc.memory_info().rss
            if not start_rss and hook.writer.stats()["batches"]:
                start_rss = rss  # warm: one batch written
            peak = max(peak, rss)
    elapsed = time.perf_counter() - t0
    end_rss = proc.memory_info().rss
    stats = hook.writer.stats()
    return {
        "rows": stats["rows"],
        "batches": stats["batches"],
        "start": start_rss / MIB,
        "peak": peak / MIB,
        "end": end_rss / MIB,
        "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--rows-per-step", type=int, default=20_000)
    parser.add_argument("--size-threshold", type=int, default=16 * MIB)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        r = anyio.run(soak, root, args.rows, args.rows_per_step, args.size_threshold)
        dataset = ds.dataset(str(root / "soak"), format="parquet")
        counted = dataset.count_rows()
        ids = dataset.to_table(columns=["id"])["id"]
        unique = len(pc.unique(ids))
    print(
        f"rows traced {int(r['rows']):,} in {int(r['batches'])} batches, read back {counted:,} "
        f"({unique:,} distinct ids)"
    )
    print(
        f"RSS start {r['start']:.0f} MiB, peak {r['peak']:.0f} MiB, end {r['end']:.0f} MiB "
        f"(peak - start {r['peak'] - r['start']:.0f} MiB); {r['seconds']:.1f} s, "
        f"{r['rows'] / r['seconds'] / 1e6:.2f} M rows/s"
    )


if __name__ == "__main__":
    main()
