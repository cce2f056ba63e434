"""What a few of the step's operations cost right after the model's compute, two ways each.

The library's code on a step runs after the model's forward, backward and optimizer step,
which leave little of Python's code and data in the caches: an operation costs several times
what a warm loop of it (``timeit``) says, and two ways of doing one thing can rank otherwise
cold than warm.  So each operation here is timed once right after a training step of
``bench_peers``' MLP (``--hidden``), the ways of each pair in turn (the order rotates every
round), and the medians are printed with each way's difference from the pair's first way:

* ``read``: a 0-d CPU loss's number, ``loss.item()`` / ``loss.tolist()`` (the collectors'
  one-element reads, ``add_metric`` / ``add_to_ml_tracker``);
* ``held``: a CPU trace column's :class:`~recis_async.hostcopy.HostCopy` around its clone
  (``add_to_trace``), with the clone's shape, dtype and device read again and a lock made
  for it (as it was) / with what the collector read already and no lock (``held``);
* ``event``: a step's ``AfterStep`` with a metric, a tracked value and a trace column
  collected, built and then merged by the bus (``AfterStep(...)`` and
  ``StepCollector.merged``) / built once with them (``StepCollector.step_event``, what the
  ``Trainer`` and the adapters publish).

    python benchmarks/bench_cold.py [--rounds 200] [--hidden 384]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers  # noqa: E402  (its job's model and batches)

SHAPE = (bench_peers.BATCH,)  # a step's id column


def ways(collector: Any, clone: Any) -> dict[str, dict[str, Callable[[Any, int], Any]]]:
    """The pairs: each way is called as ``way(loss, step)``; ``clone`` is the step's column."""
    import threading

    import numpy as np
    import torch

    from recis_async.events import AfterStep
    from recis_async.hostcopy import HostCopy, held

    int64, cpu = np.dtype(np.int64), torch.device("cpu")

    def read_again_and_locked(loss: Any, step: int) -> Any:
        column = clone()
        threading.Lock()
        return HostCopy(None, None, None, int64, column.shape, column.numel(), column.dtype,
                        column.device, 0, column)  # fmt: skip

    def held_as_read(loss: Any, step: int) -> Any:
        column = clone()
        return held(column, int64, SHAPE, torch.int64, cpu)

    def built_then_merged(loss: Any, step: int) -> Any:
        event = AfterStep(is_train=True, global_step=step, local_step=step, epoch=0, samples=1)
        return collector.merged(event)

    def built_once(loss: Any, step: int) -> Any:
        return collector.step_event(True, step, step, 0, 1)

    return {
        "read": {
            "item()": lambda loss, step: loss.item(),
            "tolist()": lambda loss, step: loss.tolist(),
        },
        "held": {"reads + lock": read_again_and_locked, "held": held_as_read},
        "event": {"AfterStep + merged": built_then_merged, "step_event": built_once},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=200, help="timings of each way")
    parser.add_argument("--hidden", type=int, default=384, help="the MLP's width (its step)")
    args = parser.parse_args()

    import numpy as np

    from recis_async.collect import StepCollector
    from recis_async.hostcopy import held

    torch, mlp, batches = bench_peers.build(args.hidden, 64)
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.01)
    collector = StepCollector()
    int64, cpu = np.dtype(np.int64), torch.device("cpu")

    def train_step(batch: dict[str, Any]) -> Any:
        loss = torch.nn.functional.mse_loss(mlp(batch["x"]), batch["y"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    step_ids: list[Any] = [batches[0]["ids"]]  # the column of the step under way
    pairs = ways(collector, lambda: step_ids[0].clone())
    order = [(pair, way) for pair, by_way in pairs.items() for way in by_way]
    times: dict[tuple[str, str], list[int]] = {key: [] for key in order}
    warmup = 10
    for i in range(warmup + args.rounds):
        for pair, way in order:
            batch = batches[i % len(batches)]
            step_ids[0] = batch["ids"]
            loss = train_step(batch)
            # what a step has collected when its AfterStep is built
            collector.metrics["loss"] = 0.5
            collector.tracked["loss"] = 0.5
            collector.trace["id"] = held(batch["ids"].clone(), int64, SHAPE, torch.int64, cpu)
            fn = pairs[pair][way]
            t = time.perf_counter_ns()
            fn(loss, i)
            elapsed = time.perf_counter_ns() - t
            collector.drop()
            if i >= warmup:
                times[(pair, way)].append(elapsed)
        order = order[1:] + order[:1]

    print(f"each way timed {args.rounds} times after a training step (--hidden {args.hidden})")
    print("| pair | way | median µs | minus the pair's first way, µs |")
    print("|---|---|---|---|")
    for pair, by_way in pairs.items():
        first = None
        for way in by_way:
            median = statistics.median(times[(pair, way)]) / 1e3
            first = median if first is None else first
            print(f"| {pair} | {way} | {median:.1f} | {median - first:+.1f} |")


if __name__ == "__main__":
    main()
