"""Per-event cost of ``await bus.publish(event)`` against a plain hook loop, same process.

For 0, 1, 3 and 10 subscribers, sync and async, on asyncio and trio: the median over
``--repeats`` runs of ``--events`` publishes, and the ratio to a plain
``for h in hooks: h.after_step(ev)`` loop with the same number of sync hooks measured in the
same run.  Target (issue 2): 3 async subscribers <= 1.5 us per event median and <= 10x the
plain loop.

Then the synchronous bus: ``SyncHookBus.publish(event)`` from plain code against
``await HookBus.publish(event)``, same subscribers, same backend, measured alternately in the
same run; the ratio sync/async.  Target (issue 25): <= 2x for 3 subscribers, sync and async.

    python benchmarks/bench_dispatch.py [--events 100000] [--repeats 7] [--only async|sync]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio

from recis_async import Hook, HookBus, SyncHookBus
from recis_async.events import AfterStep

COUNTS = (0, 1, 3, 10)


class PlainHook:
    """The baseline: what a hand-written hook list calls."""

    def after_step(self, event: AfterStep) -> None:
        pass


class Numbered(Hook):
    """Hooks of one class need distinct state keys to share a bus."""

    def __init__(self, index: int) -> None:
        self.index = index

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}-{self.index}"


class SyncHook(Numbered):
    def after_step(self, event: AfterStep) -> None:
        pass


class AsyncHook(Numbered):
    async def after_step(self, event: AfterStep) -> None:
        pass


def plain_loop(n_hooks: int, events: int) -> float:
    hooks = [PlainHook() for _ in range(n_hooks)]
    event = AfterStep(global_step=1, samples=512)
    start = time.perf_counter()
    for _ in range(events):
        for h in hooks:
            h.after_step(event)
    return (time.perf_counter() - start) / events


async def bus_loop(
    hook_cls: type[Numbered],
    n_hooks: int,
    events: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    event = AfterStep(global_step=1, samples=512)
    async with HookBus() as bus:
        for i in range(n_hooks):
            bus.add_hook(hook_cls(i))
        publish = bus.publish
        for _ in range(1000):  # warm the route cache and the interpreter
            await publish(event)
        start = clock()
        for _ in range(events):
            await publish(event)
        return (clock() - start) / events


def sync_bus_loop(hook_cls: type[Numbered], n_hooks: int, events: int, backend: str) -> float:
    """``bus.publish(event)`` on a :class:`SyncHookBus` from plain code: thread CPU seconds per
    event (the same thread runs the bus's loop; CPU time, as this 2-core machine is shared)."""
    event = AfterStep(global_step=1, samples=512)
    with SyncHookBus(backend=backend) as bus:
        for i in range(n_hooks):
            bus.add_hook(hook_cls(i))
        publish = bus.publish
        for _ in range(1000):
            publish(event)
        start = time.thread_time()
        for _ in range(events):
            publish(event)
        return (time.thread_time() - start) / events


def async_bus_run(hook_cls: type[Numbered], n_hooks: int, events: int, backend: str) -> float:
    result: list[float] = []

    async def go() -> None:
        result.append(await bus_loop(hook_cls, n_hooks, events, time.thread_time))

    anyio.run(go, backend=backend)
    return result[0]


def sync_rows(events: int, repeats: int) -> bool:
    """The synchronous bus against the async one; prints the table and the verdict."""
    print(
        f"\n{'backend':8} {'kind':5} {'subs':>4} {'sync us':>8} {'async us':>9} {'sync/async':>11}"
    )
    ok = True
    for backend in ("asyncio", "trio"):
        for kind, cls in (("sync", SyncHook), ("async", AsyncHook)):  # type: type[Numbered]
            for n in COUNTS:
                sync_s: list[float] = []
                async_s: list[float] = []
                for _ in range(repeats):  # alternated, so drift hits both alike
                    async_s.append(async_bus_run(cls, n, events, backend))
                    sync_s.append(sync_bus_loop(cls, n, events, backend))
                s, a = statistics.median(sync_s), statistics.median(async_s)
                print(f"{backend:8} {kind:5} {n:4d} {s * 1e6:8.3f} {a * 1e6:9.3f} {s / a:10.2f}x")
                if n == 3:
                    passed = s / a <= 2.0
                    ok &= passed
    print(
        "\n(sync = `bus.publish(ev)` on SyncHookBus from plain code; async = `await "
        "bus.publish(ev)` on HookBus; thread CPU time, medians of alternated runs)"
    )
    print(f"target sync/async <= 2x with 3 subscribers: {'met' if ok else 'NOT met'}")
    return ok


def median_of(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", choices=("async", "sync"), help="run one of the two tables")
    args = parser.parse_args(argv)
    if args.only == "sync":
        return 0 if sync_rows(args.events, args.repeats) else 1

    rows: list[tuple[str, str, int, float, float]] = []
    for backend in ("asyncio", "trio"):
        for kind, cls in (("sync", SyncHook), ("async", AsyncHook)):  # type: type[Numbered]
            for n in COUNTS:

                def run_bus(cls: type[Numbered] = cls, n: int = n) -> float:
                    result: list[float] = []

                    async def go() -> None:
                        result.append(await bus_loop(cls, n, args.events))

                    anyio.run(go, backend=backend)  # noqa: B023 - run at once, inside the loop
                    return result[0]

                bus_s = median_of(run_bus, args.repeats)
                plain_s = median_of(lambda n=n: plain_loop(max(n, 1), args.events), args.repeats)
                rows.append((backend, kind, n, bus_s, plain_s))

    print(f"{'backend':8} {'kind':5} {'subs':>4} {'publish us':>11} {'plain us':>9} {'ratio':>7}")
    verdict: dict[str, Any] = {}
    for backend, kind, n, bus_s, plain_s in rows:
        ratio = bus_s / plain_s
        print(f"{backend:8} {kind:5} {n:4d} {bus_s * 1e6:11.3f} {plain_s * 1e6:9.3f} {ratio:6.1f}x")
        if kind == "async" and n == 3:
            verdict[backend] = (bus_s * 1e6, ratio)
    print("\n(plain = `for h in hooks: h.after_step(ev)` with max(subs, 1) sync hooks, same run)")
    ok = True
    for backend, (us, ratio) in verdict.items():
        passed = us <= 1.5 and ratio <= 10
        ok &= passed
        print(
            f"target 3 async subscribers on {backend}: {us:.3f} us (<= 1.5), "
            f"{ratio:.1f}x plain (<= 10x): {'met' if passed else 'NOT met'}"
        )
    if args.only is None:
        ok &= sync_rows(args.events, args.repeats)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
