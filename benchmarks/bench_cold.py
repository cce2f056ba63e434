"""What a few of the step's operations cost right after the model's compute, two ways each.

The library's code on a step runs after the model's forward, backward and optimizer step,
which leave little of Python's code and data in the caches: an operation costs several times
what a warm loop of it (``timeit``) says, and two ways of doing one thing can rank otherwise
cold than warm.  So each operation here is timed once right after a training step of
``bench_peers``' MLP (``--hidden``), the ways of each pair in turn (the order rotates every
round), and the medians are printed with each way's difference from the pair's first way:

* ``read``: a 0-d CPU loss's number, ``loss.item()`` / ``loss.tolist()``;
* ``event``: a step's ``AfterStep`` with a metric, a tracked value and a trace column
  collected, built and then merged by the bus (``AfterStep(...)`` and
  ``StepCollector.merged``, what a publish does) / built once with them.

Timed alone, an operation pays for all of its code cold; inside a job, code the job ran
already on that step (the framework's own ``loss.item()``, say) is warm.  A saving seen here
is a candidate, not a result: ``bench_peers.py --paired --compare`` says whether the job
keeps it (benchmarks/README.md, "Tried and dropped: cheaper ways timed alone").

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


def ways(collector: Any) -> dict[str, dict[str, Callable[[Any, int], Any]]]:
    """The pairs: each way is called as ``way(loss, step)``."""
    from recis_async.events import AfterStep

    def built_then_merged(loss: Any, step: int) -> Any:
        event = AfterStep(is_train=True, global_step=step, local_step=step, epoch=0, samples=1)
        return collector.merged(event)

    def built_once(loss: Any, step: int) -> Any:
        event = AfterStep(
            is_train=True,
            global_step=step,
            local_step=step,
            epoch=0,
            samples=1,
            metrics=collector.metrics,
            trace=collector.trace,
            tracked=collector.tracked,
        )
        collector.metrics, collector.trace, collector.tracked = {}, {}, {}
        return event

    return {
        "read": {
            "item()": lambda loss, step: loss.item(),
            "tolist()": lambda loss, step: loss.tolist(),
        },
        "event": {"AfterStep + merged": built_then_merged, "AfterStep built once": built_once},
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
    int64 = np.dtype(np.int64)

    def train_step(batch: dict[str, Any]) -> Any:
        loss = torch.nn.functional.mse_loss(mlp(batch["x"]), batch["y"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    pairs = ways(collector)
    order = [(pair, way) for pair, by_way in pairs.items() for way in by_way]
    times: dict[tuple[str, str], list[int]] = {key: [] for key in order}
    warmup = 10
    for i in range(warmup + args.rounds):
        for pair, way in order:
            batch = batches[i % len(batches)]
            loss = train_step(batch)
            # what a step has collected when its AfterStep is built
            collector.metrics["loss"] = 0.5
            collector.tracked["loss"] = 0.5
            collector.trace["id"] = held(batch["ids"].clone(), int64)
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
