"""Cost of tracing a real training loop, and raw trace throughput into Parquet.

A CTR-style torch model (two embedding tables of 32 -> 64 features -> MLP 256-256-1 by
default, ``--hidden`` for other widths; batch 512, ``torch.set_num_threads(1)``) traces 4
columns per step: ``user_id bigint``, ``item_id bigint``, ``score double`` and ``emb
array<float>`` (the 64 input features).  Each configuration runs in its own process,
alternating rounds without tracing and with it, so the ratio compares steps/s measured in the
same process:

* ``parquet``           TraceHook(ParquetSink)
* ``odps``              TraceToOdpsHook against the loopback ODPS service (tests/odps_server.py,
                        run as a separate process at nice 19, as a real service would be remote)
* ``baseline-parquet``  RecIS's design: one ``multiprocessing.Queue(maxsize=worker_num)`` fed
                        at every step with the step's arrays and read by ``worker_num`` writer
                        processes that buffer to ``size_threshold`` and write the same sink
* ``baseline-odps``     the same, writing to the loopback ODPS service
* ``throughput``        no model: trace steps as fast as possible into Parquet (rows/s,
                        counting the close that drains everything)
* ``discard``           diagnostic: TraceHook with a sink that writes nothing, i.e. the
                        pipeline's own cost; a config's further slowdown is its sink's CPU
* ``floor``             diagnostic: in one process, 100-step slices alternate between no
                        tracing; a bare ``tensor.numpy().copy()`` of the 4 columns (the least
                        a copy-on-trace costs in Python); the same copies held until
                        ``size_threshold`` bytes and then dropped (plus what holding them
                        costs); the copies written into arrays reused in a ring of
                        ``size_threshold`` bytes (the least any buffering costs);
                        ``add_to_trace`` into TraceHook with the discard sink (the pipeline);
                        and no tracing while another process spins on the other core (what
                        any concurrent work, such as a writer's, costs the step on this
                        machine).  Prints each mode's cost per step against the slice of no
                        tracing just before it (medians).

``--job`` measures what a user's job sees instead (the mode the README leads with): every run
is a fresh process that builds the model, warms torch up (30 steps, untimed), then enters a
``HookBus``, adds the hook and publishes ``Start`` (the set-up, timed apart), trains
``--job-steps`` steps (1,200) and leaves the bus (the close).  Configs, each run ``--reps``
times (4), alternated within each repetition:

* ``untraced``            the same job without tracing
* ``untraced-again``      the same again, as a config of its own: its ratio to ``untraced`` is
                          the measurement's own noise on this machine (process to process:
                          memory layout, the allocator's state, neighbours), the resolution
                          the other ratios are read at
* ``odps`` / ``odps-8m``  TraceToOdpsHook with RecIS's config dict, 50 MiB / 8 MiB threshold,
                          against the loopback service in its own process, deferring the
                          decoding of every block until the run's rows are read back (a remote
                          service's work never lands on the training machine)
* ``parquet`` / ``parquet-8m``  TraceHook(ParquetSink), 50 MiB / 8 MiB
* ``baseline-odps`` / ``baseline-odps-8m``  RecIS's design (``multiprocessing.Queue`` and a
                          forked writer process) on the same job and service

Printed per config (medians over repetitions, ranges in brackets): steps/s from the first step
to the end of the close over the untraced run's of the same repetition; the same counting
the set-up too; set-up and close seconds; the first 100 steps' time over the untraced run's;
step p50 / p99 / max in ms; peak PSS of the job's processes over the untraced run's, from
one more run of every config after the timed ones (sampled every 50 ms from the driver:
reading a torch process's page tables takes ~6 ms and slows it ~5 %, so timed runs are not
sampled); the p50 of the model's own step (forward,
backward, optimizer: what the writer's work on the other core and the GIL cost it); minor page
faults per step from the first step to the end of the close (fresh memory the allocator asks
the kernel for; an untraced torch step takes tens of them).  Every
row is read back and counted.  ``--import-first`` imports pyodps / pyarrow.parquet before the
timing (the issue's harness); ``--job-threshold MIB`` gives every traced config that
``size_threshold`` (a sweep over sizes, one run each).
Targets (issue 16): ODPS >= 0.90 at 50 MiB and >= 0.85 at 8 MiB, Parquet >= 0.95, step p50
<= 1.05x and the first 100 steps <= 1.1x untraced.

    python benchmarks/bench_trace.py --job                  # about 6 minutes
    python benchmarks/bench_trace.py --job --reps 2 --only untraced,odps-8m

For each: steps/s without and with tracing (medians over rounds); their ratio, the median of
each traced round over the untraced round before it; the cost tracing adds to a step in
microseconds, the median of the same pairs' step-time differences (the ratio at another step
time T is about T / (T + cost)); traced rows/s (including the close); seconds spent in close
(draining); peak RSS growth of the process (plus its writer processes; not the ODPS service
process; after pyarrow and pyodps were initialised) against the bound ``(worker_num + 2) *
size_threshold + 64 MiB``; and the time the training thread itself spends per step handing the
trace over (``add_to_trace`` and ``TraceHook.after_step`` without backpressure waits; the queue
``put`` for the baselines).  The sink is opened before a traced round is timed, as a real job
opens it once at start.  A round is long enough to seal about four batches at the default
threshold, so the writer's work on the other core -- and, for ODPS, the loopback service's --
overlaps the timed steps as in a long job, instead of mostly falling into the close of a round
that sealed one.  Targets (issue 3): ratio >= 0.98, throughput >= 1,000,000 rows/s, RSS growth
within the bound.

    python benchmarks/bench_trace.py                       # about 5 minutes
    python benchmarks/bench_trace.py --rounds 6 --only parquet,odps,discard
    python benchmarks/bench_trace.py --only throughput --worker-num 2 --throughput-steps 2400
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH = 512
EMB = 64
FIELDS = ["user_id", "item_id", "score", "emb"]
TYPES = ["bigint", "bigint", "double", "array<float>"]
CONFIGS = (
    "parquet",
    "odps",
    "baseline-parquet",
    "baseline-odps",
    "throughput",
    "discard",
    "floor",
)
FLOOR_SLICE = 100  # steps per slice of the floor diagnostic
PROJECT = "bench"


# ----------------------------------------------------------------------------- helpers


class RssSampler:
    """Peak resident memory of this process (and, with ``children``, its child processes
    but ``exclude``), sampled every 20 ms in a thread for the whole run, in rounds with and
    without tracing alike.  ``mark()`` starts a new peak from the current value."""

    def __init__(self, *, children: bool = False, exclude: tuple[int, ...] = ()) -> None:
        import psutil

        self._proc = psutil.Process()
        self._children = children
        self._exclude = exclude
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def current(self) -> int:
        total = self._proc.memory_info().rss
        if self._children:
            for child in self._proc.children(recursive=True):
                if child.pid in self._exclude:
                    continue
                try:
                    total += child.memory_info().rss
                except Exception:  # exited meanwhile
                    pass
        return int(total)

    def mark(self) -> int:
        self.peak = base = self.current()
        return base

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            self._stop.wait(0.02)

    def __enter__(self) -> RssSampler:
        self.mark()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def start_odps_server() -> tuple[subprocess.Popen[str], int]:
    # It stands in for a remote service, whose work never lands on the training machine: it
    # keeps each block's bytes and decodes them when the rows are read back after the run
    # (as in --job mode), and runs at the lowest priority for what it still does.
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "odps_server.py"), PROJECT, "--defer-decoding"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
    return proc, int(proc.stdout.readline())


def odps_config(port: int, table: str) -> dict[str, Any]:
    return {
        "access_id": "bench-id",
        "access_key": "bench-secret",
        "project": PROJECT,
        "end_point": f"http://127.0.0.1:{port}/api",
        "tunnel_endpoint": f"http://127.0.0.1:{port}",
        "table_name": table,
        "partition": "dt=20261122",
    }


def warm_up_libraries(out: Path) -> None:
    """Import and initialise pyarrow's Parquet writer and pyodps once, so RSS growth counts
    buffered data and not one-time library setup."""
    import odps.tunnel  # noqa: F401
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": [1]}), out / "warm-up.parquet")
    (out / "warm-up.parquet").unlink()


class DiscardSink:
    """Accepts every batch and writes nothing: isolates the pipeline's own cost (the
    ``discard`` diagnostic), so the rest of a config's slowdown is its sink's CPU."""

    name = "discard"

    def open(self, fields: Any, types: Any) -> None:
        pass

    def write(self, batch: Any, attempt: Any) -> None:
        pass

    def close(self) -> None:
        pass


def make_sink(kind: str, out: Path, port: int | None, table: str) -> Any:
    from recis_async.sinks import OdpsSink, ParquetSink

    if kind == "discard":
        return DiscardSink()
    if kind == "parquet":
        return ParquetSink(out, table, "dt=20261122", rank=0)
    assert port is not None
    return OdpsSink(odps_config(port, table))


def trace_hook(sink: Any, args: argparse.Namespace, out: Path) -> Any:
    """The hook every traced config measures, with the run's worker_num and threshold."""
    from recis_async.hooks import TraceHook

    return TraceHook(
        sink,
        FIELDS,
        TYPES,
        worker_num=args.worker_num,
        size_threshold=args.size_threshold,
        spill_dir=out / "spill",
    )


async def wait_sink_open(hook: Any) -> None:
    """The writer opens its sink when the bus starts; a real job does that once, so it is
    setup, not a cost of the steps measured."""
    import anyio

    while not hook.writer.stats()["sink_open"]:
        await anyio.sleep(0.005)


# ----------------------------------------------------------------------------- the model


class Model:
    def __init__(self, seed: int = 0, hidden: tuple[int, ...] = (256, 256)) -> None:
        import torch
        from torch import nn

        torch.manual_seed(seed)
        torch.set_num_threads(1)
        self.torch = torch
        self.user = nn.Embedding(20_000, 32, sparse=True)
        self.item = nn.Embedding(20_000, 32, sparse=True)
        layers: list[nn.Module] = []
        width = EMB
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))
        params = [*self.user.parameters(), *self.item.parameters(), *self.mlp.parameters()]
        self.opt = torch.optim.SGD(params, lr=0.05)
        self.loss = nn.BCEWithLogitsLoss()
        gen = torch.Generator().manual_seed(seed)
        self.data = [
            (
                torch.randint(0, 20_000, (BATCH,), generator=gen),
                torch.randint(0, 20_000, (BATCH,), generator=gen),
                torch.randint(0, 2, (BATCH,), generator=gen).float(),
            )
            for _ in range(16)
        ]

    def step(self, i: int) -> tuple[Any, Any, Any, Any]:
        users, items, labels = self.data[i % len(self.data)]
        x = self.torch.cat([self.user(users), self.item(items)], dim=1)
        logit = self.mlp(x).squeeze(1)
        loss = self.loss(logit, labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return users, items, self.torch.sigmoid(logit.detach()), x.detach()


# ----------------------------------------------------------------------------- RecIS design


def baseline_writer(
    queue: Any, ready: Any, kind: str, out: str, port: int | None, table: str, threshold: int
) -> None:
    """A RecIS-style writer process: buffer rows from the queue, write at the threshold."""
    from recis_async.sinks import Attempt
    from recis_async.trace.buffer import ColumnBuffer

    buffer = ColumnBuffer(FIELDS, TYPES)
    sink = make_sink(kind, Path(out), port, table)
    sink.open(buffer.fields, buffer.types)
    ready.set()
    while True:
        item = queue.get()
        if item is None:
            break
        buffer.append(item)
        if buffer.nbytes >= threshold:
            batch = buffer.seal()
            assert batch is not None
            sink.write(batch, Attempt())
    batch = buffer.seal()
    if batch is not None:
        sink.write(batch, Attempt())
    sink.close()


# ----------------------------------------------------------------------------- one config


async def run_config(args: argparse.Namespace) -> dict[str, Any]:

    from recis_async import HookBus, add_to_trace
    from recis_async.events import AfterStep, BeforeStep

    config = args.child
    out = Path(tempfile.mkdtemp(prefix="bench-trace-"))
    server = None
    port = None
    if "odps" in config:
        server, port = start_odps_server()
    sink_kind = "odps" if "odps" in config else "discard" if config == "discard" else "parquet"
    model = Model(hidden=args.hidden)
    for i in range(30):  # warm up torch
        model.step(i)
    warm_up_libraries(out)

    trace_s = [0.0]  # time the training thread spends handing trace data over

    async def loop(bus: Any, steps: int, trace: str | None, queue: Any = None) -> float:
        start = time.perf_counter()
        for i in range(steps):
            await bus.publish(BeforeStep(global_step=i))
            users, items, scores, emb = model.step(i)
            t = time.perf_counter()
            if trace == "hook":
                add_to_trace("user_id", users)
                add_to_trace("item_id", items)
                add_to_trace("score", scores)
                add_to_trace("emb", emb)
            elif trace == "queue":  # RecIS: the step's arrays go through a multiprocessing queue
                queue.put(
                    {
                        "user_id": users.numpy().copy(),
                        "item_id": items.numpy().copy(),
                        "score": scores.numpy().copy(),
                        "emb": emb.numpy().copy(),
                    }
                )
            trace_s[0] += time.perf_counter() - t
            await bus.publish(AfterStep(global_step=i, samples=BATCH))
        return time.perf_counter() - start

    none_rates, traced_rates, closes, totals = [], [], [], []
    peak_growth = 0
    sampler = RssSampler(
        children=config.startswith("baseline"), exclude=(server.pid,) if server is not None else ()
    )
    with sampler:
        for r in range(args.rounds):
            async with HookBus(handle_signals=False) as bus:
                elapsed = await loop(bus, args.steps, None)
            none_rates.append(args.steps / elapsed)
            table = f"t_{config.replace('-', '_')}_{r}"
            if config.startswith("baseline"):
                # RecIS ran its writer processes from the training process (fork on Linux)
                ctx = mp.get_context("fork")
                queue = ctx.Queue(maxsize=args.worker_num)
                ready = [ctx.Event() for _ in range(args.worker_num)]
                procs = [
                    ctx.Process(
                        target=baseline_writer,
                        args=(queue, ev, sink_kind, str(out), port, table, args.size_threshold),
                    )
                    for ev in ready
                ]
                for p in procs:
                    p.start()
                for ev in ready:
                    ev.wait(60)
                base = sampler.mark()
                async with HookBus(handle_signals=False) as bus:
                    elapsed = await loop(bus, args.steps, "queue", queue)
                t_end = time.perf_counter()
                for _ in procs:
                    queue.put(None)
                for p in procs:
                    p.join()
                close = time.perf_counter() - t_end
            else:
                hook = trace_hook(make_sink(sink_kind, out, port, table), args, out)
                base = sampler.mark()
                async with HookBus(handle_signals=False) as bus:
                    bus.add_hook(hook)
                    await wait_sink_open(hook)
                    elapsed = await loop(bus, args.steps, "hook")
                    t_end = time.perf_counter()
                    handler = bus.stats()["subscribers"]["TraceHook.after_step"]["total_s"]
                    # in-band cost: validation and buffering, not the backpressure waits
                    trace_s[0] += handler - hook.writer.stats()["backpressure_wait_s"]
                close = time.perf_counter() - t_end
            traced_rates.append(args.steps / elapsed)
            closes.append(close)
            totals.append(args.steps * BATCH / (elapsed + close))
            peak_growth = max(peak_growth, sampler.peak - base)
    rows = (
        args.rounds * args.steps * BATCH
        if sink_kind == "discard"
        else count_rows(sink_kind, out, port, args.rounds, config)
    )
    if server is not None:
        server.kill()
    shutil.rmtree(out, ignore_errors=True)
    expected = args.rounds * args.steps * BATCH
    if rows != expected:
        raise SystemExit(f"{config}: {rows} rows written, expected {expected}")
    none = statistics.median(none_rates)
    traced = statistics.median(traced_rates)
    return {
        "config": config,
        "none_steps_s": none,
        "traced_steps_s": traced,
        # each traced round against the untraced round just before it: robust to the
        # machine's speed drifting over the run
        "ratio": statistics.median(t / n for t, n in zip(traced_rates, none_rates, strict=True)),
        # what tracing adds to a step, in the same pairs: the ratio at another step time T
        # is about T / (T + cost)
        "cost_us": statistics.median(
            1e6 / t - 1e6 / n for t, n in zip(traced_rates, none_rates, strict=True)
        ),
        "rows_s": statistics.median(totals),
        "close_s": statistics.median(closes),
        "rss_growth_mib": peak_growth / 2**20,
        "rows_checked": rows,
        "trace_us_per_step": trace_s[0] / (args.rounds * args.steps) * 1e6,
        "none_rounds": none_rates,
        "traced_rounds": traced_rates,
    }


def count_rows(kind: str, out: Path, port: int | None, rounds: int, config: str) -> int:
    if kind == "parquet":
        import pyarrow.dataset as pads

        return sum(
            pads.dataset(out / f"t_{config.replace('-', '_')}_{r}").count_rows()
            for r in range(rounds)
        )
    from odps import ODPS

    assert port is not None
    cfg = odps_config(port, "x")
    odps = ODPS(
        cfg["access_id"],
        cfg["access_key"],
        PROJECT,
        cfg["end_point"],
        tunnel_endpoint=cfg["tunnel_endpoint"],
        overwrite_global=False,
    )
    total = 0
    for r in range(rounds):
        table = odps.get_table(f"t_{config.replace('-', '_')}_{r}")
        with table.open_reader(partition="dt=20261122") as reader:
            total += reader.count
    return total


async def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from recis_async import HookBus, add_to_trace
    from recis_async.events import AfterStep, BeforeStep
    from recis_async.sinks import ParquetSink

    rows = args.throughput_rows
    rng = np.random.default_rng(0)
    payloads = [
        {
            "user_id": rng.integers(0, 1 << 40, rows),
            "item_id": rng.integers(0, 1 << 30, rows),
            "score": rng.random(rows),
            "emb": rng.random((rows, EMB), dtype=np.float32),
        }
        for _ in range(8)
    ]
    out = Path(tempfile.mkdtemp(prefix="bench-trace-tp-"))
    warm_up_libraries(out)
    steps = args.throughput_steps
    sampler = RssSampler()
    baseline_rss = sampler.current()
    with sampler:
        hook = trace_hook(ParquetSink(out, "tp", rank=0), args, out)
        start = time.perf_counter()
        async with HookBus(handle_signals=False) as bus:
            bus.add_hook(hook)
            for i in range(steps):
                await bus.publish(BeforeStep(global_step=i))
                for name, value in payloads[i % len(payloads)].items():
                    add_to_trace(name, value)
                await bus.publish(AfterStep(global_step=i, samples=rows))
            t_end = time.perf_counter()
        total = time.perf_counter() - start
        close = time.perf_counter() - t_end
    import pyarrow.dataset as pads

    written = pads.dataset(out / "tp").count_rows()
    shutil.rmtree(out, ignore_errors=True)
    if written != steps * rows:
        raise SystemExit(f"throughput: {written} rows written, expected {steps * rows}")
    return {
        "config": "throughput",
        "rows_s": written / total,
        "loop_rows_s": written / (total - close),
        "close_s": close,
        "rss_growth_mib": (sampler.peak - baseline_rss) / 2**20,
        "rows_checked": written,
        "backpressure_wait_s": hook.writer.stats()["backpressure_wait_s"],
    }


async def run_floor(args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import numpy as np

    from recis_async import HookBus, add_to_trace
    from recis_async.events import AfterStep, BeforeStep

    model = Model(hidden=args.hidden)
    for i in range(30):  # warm up torch
        model.step(i)
    out = Path(tempfile.mkdtemp(prefix="bench-trace-floor-"))
    hook = trace_hook(DiscardSink(), args, out)
    modes = ("none", "copy", "copy held", "copy reused", "pipeline", "busy core")
    times: dict[str, list[float]] = {m: [] for m in modes}
    held: list[Any] = []
    held_bytes = 0
    # "copy reused": the copies go into arrays written before (pages mapped, no allocation),
    # cycling through size_threshold bytes of them: the least any buffering design costs
    sample = [t.numpy() for t in model.step(0)]
    per_step = sum(a.nbytes for a in sample)
    ring = [[a.copy() for a in sample] for _ in range(-(-args.size_threshold // per_step))]
    slot = 0
    step = 0
    async with HookBus(handle_signals=False) as bus:
        bus.add_hook(hook)
        await wait_sink_open(hook)
        for _ in range(args.rounds * 10):
            for mode in modes:
                spinner = None
                if mode == "busy core":
                    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    await anyio.sleep(0.2)  # running, on the other core
                start = time.perf_counter()
                for _ in range(FLOOR_SLICE):
                    await bus.publish(BeforeStep(global_step=step))
                    columns = model.step(step)
                    if mode == "copy":
                        copies = [t.numpy().copy() for t in columns]
                        del copies
                    elif mode == "copy held":
                        for t in columns:
                            held.append(t.numpy().copy())
                            held_bytes += held[-1].nbytes
                        if held_bytes >= args.size_threshold:
                            held, held_bytes = [], 0
                    elif mode == "copy reused":
                        for dst, t in zip(ring[slot], columns, strict=True):
                            np.copyto(dst, t.numpy())
                        slot = (slot + 1) % len(ring)
                    elif mode == "pipeline":
                        for name, t in zip(FIELDS, columns, strict=True):
                            add_to_trace(name, t)
                    await bus.publish(AfterStep(global_step=step, samples=BATCH))
                    step += 1
                times[mode].append((time.perf_counter() - start) / FLOOR_SLICE * 1e6)
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    shutil.rmtree(out, ignore_errors=True)
    none = times["none"]
    return {
        "config": "floor",
        "step_us": statistics.median(none),
        "cost_us": {
            m: statistics.median(t - n for t, n in zip(times[m], none, strict=True))
            for m in modes[1:]
        },
    }


# ----------------------------------------------------------------------------- job-shaped

JOB_CONFIGS = (
    "untraced",
    "untraced-again",
    "odps",
    "odps-8m",
    "parquet",
    "parquet-8m",
    "baseline-odps",
    "baseline-odps-8m",
)
MIB = 1024 * 1024


def job_threshold(config: str, mib: float | None) -> int:
    if mib is not None:
        return int(mib * MIB)
    return 8 * MIB if config.endswith("-8m") else 50 * MIB


async def run_job(args: argparse.Namespace) -> dict[str, Any]:
    """One job, in this fresh process: set-up, ``--job-steps`` steps, close; per-step times."""
    from recis_async import HookBus, add_to_trace
    from recis_async.events import AfterStep, BeforeStep, Start

    config = args.job_child
    table = args.job_table
    kind = "odps" if "odps" in config else "parquet"
    threshold = job_threshold(config, args.job_threshold)
    out = Path(args.job_out)
    model = Model(hidden=args.hidden)
    for i in range(30):  # warm up torch
        model.step(i)
    if args.import_first:
        import odps.tunnel  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    marks = [0] * (args.job_steps + 1)
    compute = [0] * args.job_steps  # the model's step alone, ns
    queue = procs = None
    hook: Any = None
    t_setup = time.perf_counter()
    if config.startswith("baseline"):
        # RecIS ran its writer processes from the training process (fork on Linux)
        ctx = mp.get_context("fork")
        queue = ctx.Queue(maxsize=1)
        ready = ctx.Event()
        procs = [
            ctx.Process(
                target=baseline_writer,
                args=(queue, ready, kind, str(out), args.job_port, table, threshold),
            )
        ]
        for p in procs:
            p.start()
        ready.wait(120)
    elif not config.startswith("untraced"):
        if kind == "odps":
            from recis_async.hooks import TraceToOdpsHook

            hook = TraceToOdpsHook(
                odps_config(args.job_port, table), FIELDS, TYPES, size_threshold=threshold,
                spill_dir=out / "spill",
            )  # fmt: skip
        else:
            from recis_async.hooks import TraceHook
            from recis_async.sinks import ParquetSink

            hook = TraceHook(
                ParquetSink(out, table, "dt=20261122", rank=0), FIELDS, TYPES,
                size_threshold=threshold, spill_dir=out / "spill",
            )  # fmt: skip
    perf_ns = time.perf_counter_ns
    async with HookBus(handle_signals=False) as bus:
        if hook is not None:
            bus.add_hook(hook)
        await bus.publish(Start(is_train=True))
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t_loop = time.perf_counter()
        for i in range(args.job_steps):
            marks[i] = perf_ns()
            await bus.publish(BeforeStep(global_step=i))
            t0 = perf_ns()
            users, items, scores, emb = model.step(i)
            compute[i] = perf_ns() - t0
            if hook is not None:
                add_to_trace("user_id", users)
                add_to_trace("item_id", items)
                add_to_trace("score", scores)
                add_to_trace("emb", emb)
            elif queue is not None:
                queue.put(
                    {
                        "user_id": users.numpy().copy(),
                        "item_id": items.numpy().copy(),
                        "score": scores.numpy().copy(),
                        "emb": emb.numpy().copy(),
                    }
                )
            await bus.publish(AfterStep(global_step=i, samples=BATCH))
        marks[-1] = perf_ns()
        t_close = time.perf_counter()
        if procs is not None:
            assert queue is not None
            queue.put(None)
            for p in procs:
                p.join()
    t_end = time.perf_counter()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    steps_ms = [(b - a) / 1e6 for a, b in zip(marks, marks[1:], strict=False)]
    return {
        "config": config,
        "setup_s": t_loop - t_setup,
        "loop_s": t_close - t_loop,
        "close_s": t_end - t_close,
        "first100_s": (marks[min(100, args.job_steps)] - marks[0]) / 1e9,
        "steps_ms": steps_ms,
        "compute_ms": sorted(c / 1e6 for c in compute)[args.job_steps // 2],
        "faults": faults,
    }


def job_rows(kind: str, out: Path, port: int | None, table: str) -> int:
    if kind == "parquet":
        import pyarrow.dataset as pads

        return int(pads.dataset(out / table).count_rows())
    from odps import ODPS

    assert port is not None
    cfg = odps_config(port, table)
    client = ODPS(
        cfg["access_id"], cfg["access_key"], PROJECT, cfg["end_point"],
        tunnel_endpoint=cfg["tunnel_endpoint"], overwrite_global=False,
    )  # fmt: skip
    with client.get_table(table).open_reader(partition="dt=20261122") as reader:
        return int(reader.count)


def run_job_process(
    config: str,
    args: argparse.Namespace,
    port: int | None,
    out: Path,
    table: str,
    root: Path,
    sample: bool,
) -> dict[str, Any]:
    """Run one job in a fresh process, with the code under ``root``; with ``sample``, sample
    the PSS of its process tree every 50 ms meanwhile (``pss_mb``, the peak).

    Sampling reads the processes' page tables (~6 ms a sample for a torch process, holding
    the job's memory-map lock): it slows the job ~5 %, so timed runs are not sampled."""
    import psutil

    cmd = [
        sys.executable, str(root / "benchmarks" / "bench_trace.py"), "--job-child", config,
        "--job-table", table,
        "--job-out", str(out), "--job-steps", str(args.job_steps),
        "--hidden", ",".join(map(str, args.hidden)), "--backend", args.backend,
    ]  # fmt: skip
    if port is not None:
        cmd += ["--job-port", str(port)]
    if args.import_first:
        cmd.append("--import-first")
    if args.job_threshold is not None:
        cmd += ["--job-threshold", str(args.job_threshold)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    peak = 0
    root = psutil.Process(proc.pid)
    while sample and proc.poll() is None:
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                total += p.memory_full_info().pss
        except psutil.Error:
            pass  # exited meanwhile
        peak = max(peak, total)
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        print(stderr, file=sys.stderr)
        raise SystemExit(f"job {config} failed")
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    if sample:
        result["pss_mb"] = peak / 1e6
    return result


def job_main(args: argparse.Namespace) -> None:
    configs = args.only.split(",") if args.only else list(JOB_CONFIGS)
    for config in configs:
        if config not in JOB_CONFIGS:
            raise SystemExit(
                f"--only: unknown job config {config!r}; choose from {', '.join(JOB_CONFIGS)}"
            )
    if "untraced" not in configs:
        configs.insert(0, "untraced")
    roots = {c: ROOT for c in configs}
    if args.compare:
        # every traced config again, with the code of another checkout: before/after pairs
        # measured in the same run, under the same load
        other = Path(args.compare).resolve()
        for config in [c for c in configs if not c.startswith(("untraced", "baseline"))]:
            configs.append(f"{config}@{other.name}")
            roots[configs[-1]] = other
    server = port = None
    if any("odps" in c for c in configs):
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "odps_server.py"), PROJECT, "--defer-decoding"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        os.setpriority(os.PRIO_PROCESS, proc.pid, 19)  # stands in for a remote service
        server, port = proc, int(proc.stdout.readline())
    out = Path(tempfile.mkdtemp(prefix="bench-trace-job-"))
    load = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    pss: dict[str, float] = {}
    started = time.perf_counter()
    try:
        # the timed repetitions, then one more of every config sampling its memory
        for rep in range(args.reps + 1):
            sample = rep == args.reps
            # alternate: rotate the order every repetition
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for label in order:
                config = label.split("@")[0]
                table = f"j_{label.replace('-', '_').replace('@', '_')}_{rep}"
                result = run_job_process(config, args, port, out, table, roots[label], sample)
                if not config.startswith("untraced"):
                    kind = "odps" if "odps" in config else "parquet"
                    rows = job_rows(kind, out, port, table)
                    if rows != args.job_steps * BATCH:
                        raise SystemExit(
                            f"{config}: {rows} rows read back, expected {args.job_steps * BATCH}"
                        )
                if sample:
                    pss[label] = result["pss_mb"]
                    print(f"# memory {label}: peak PSS {result['pss_mb']:.0f} MB", file=sys.stderr)
                    continue
                runs[label].append(result)
                steps_s = args.job_steps / (result["loop_s"] + result["close_s"])
                print(
                    f"# rep {rep} {label}: {steps_s:.1f} steps/s, "
                    f"setup {result['setup_s']:.2f}s, close {result['close_s']:.2f}s",
                    file=sys.stderr,
                )
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(out, ignore_errors=True)
    print(
        f"job-shaped: fresh process per run, {args.job_steps} steps after 30 warm-up steps, "
        f"batch {BATCH}, MLP {'-'.join(map(str, args.hidden))}, {args.reps} repetitions "
        f"alternated, backend {args.backend}; {os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start; {time.perf_counter() - started:.0f}s"
        + ("; pyodps/pyarrow.parquet imported before timing" if args.import_first else "")
        + (f"; every threshold {args.job_threshold:g} MiB" if args.job_threshold else "")
    )
    print(
        f"{'config':<24}{'ratio':>7}{' [range]':<14}{'w/ setup':>9}{'setup s':>8}{'close s':>8}"
        f"{'first100':>9}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'PSS +MB':>9}"
        f"{'model p50':>10}{'faults/st':>10}"
    )
    base = runs["untraced"]

    def rate(r: dict[str, Any], setup: bool = False) -> float:
        return args.job_steps / (r["loop_s"] + r["close_s"] + (r["setup_s"] if setup else 0.0))

    med = statistics.median
    base_pss = pss["untraced"]
    for config in configs:
        rs = runs[config]
        ratios = [rate(r) / rate(b) for r, b in zip(rs, base, strict=True)]
        with_setup = [rate(r, True) / rate(b, True) for r, b in zip(rs, base, strict=True)]
        first = [r["first100_s"] / b["first100_s"] for r, b in zip(rs, base, strict=True)]
        steps = [sorted(r["steps_ms"]) for r in rs]
        p50 = med(s[len(s) // 2] for s in steps)
        p99 = med(s[int(len(s) * 0.99)] for s in steps)
        worst = med(s[-1] for s in steps)
        print(
            f"{config:<24}{med(ratios):>7.3f}{f' [{min(ratios):.2f}-{max(ratios):.2f}]':<14}"
            f"{med(with_setup):>9.3f}{med(r['setup_s'] for r in rs):>8.2f}"
            f"{med(r['close_s'] for r in rs):>8.2f}{med(first):>9.2f}{p50:>8.2f}{p99:>8.2f}"
            f"{worst:>8.1f}{pss[config] - base_pss:>9.0f}"
            f"{med(r.get('compute_ms', math.nan) for r in rs):>10.2f}"
            f"{med(r.get('faults', math.nan) for r in rs) / args.job_steps:>10.1f}"
        )
    print(f"untraced: {med(rate(b) for b in base):.1f} steps/s, peak PSS {base_pss:.0f} MB")


# ----------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1500, help="training steps per round")
    parser.add_argument("--rounds", type=int, default=4, help="alternating untraced/traced rounds")
    parser.add_argument(
        "--hidden",
        type=lambda v: tuple(int(w) for w in v.split(",")),
        default=(256, 256),
        help="MLP hidden widths (default 256,256: a ~3 ms step here)",
    )
    parser.add_argument("--worker-num", type=int, default=1)
    parser.add_argument("--size-threshold", type=int, default=50 * 1024 * 1024)
    parser.add_argument("--throughput-steps", type=int, default=600)
    parser.add_argument("--throughput-rows", type=int, default=4096, help="rows per step")
    parser.add_argument(
        "--only",
        default=None,
        help=f"comma-separated configs, from {', '.join(CONFIGS)} (default: all but floor); "
        f"with --job from {', '.join(JOB_CONFIGS)} (default: all)",
    )
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--job", action="store_true", help="the job-shaped mode (see above)")
    parser.add_argument("--reps", type=int, default=4, help="[--job] repetitions of each config")
    parser.add_argument("--job-steps", type=int, default=1200, help="[--job] timed steps a run")
    parser.add_argument(
        "--job-threshold",
        type=float,
        default=None,
        metavar="MIB",
        help="[--job] size_threshold of every traced config, in MiB (a sweep: run it per size)",
    )
    parser.add_argument(
        "--import-first",
        action="store_true",
        help="[--job] import pyodps and pyarrow.parquet before the timing",
    )
    for hidden in ("--job-child", "--job-table", "--job-out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--job-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--compare",
        metavar="DIR",
        help="[--job] also run every traced config with the code of the checkout DIR "
        "(labelled config@DIR's name): before/after in the same run",
    )
    args = parser.parse_args()

    import anyio

    if args.job_child:
        print(json.dumps(anyio.run(run_job, args, backend=args.backend)))
        return
    if args.job:
        job_main(args)
        return
    if args.child:
        runners = {"throughput": run_throughput, "floor": run_floor}
        runner = runners.get(args.child, run_config)
        result = anyio.run(runner, args, backend=args.backend)
        print(json.dumps(result))
        return

    results = []
    for config in (args.only or ",".join(c for c in CONFIGS if c != "floor")).split(","):
        if config not in CONFIGS:
            raise SystemExit(f"--only: unknown config {config!r}; choose from {', '.join(CONFIGS)}")
        cmd = [
            sys.executable,
            __file__,
            "--child",
            config,
            "--steps",
            str(args.steps),
            "--rounds",
            str(args.rounds),
            "--hidden",
            ",".join(map(str, args.hidden)),
            "--worker-num",
            str(args.worker_num),
            "--size-threshold",
            str(args.size_threshold),
            "--throughput-steps",
            str(args.throughput_steps),
            "--throughput-rows",
            str(args.throughput_rows),
            "--backend",
            args.backend,
        ]
        started = time.perf_counter()
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            raise SystemExit(f"{config} failed")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"# {config}: done in {time.perf_counter() - started:.1f}s", file=sys.stderr)

    bound = (args.worker_num + 2) * args.size_threshold / 2**20 + 64
    print(
        f"batch {BATCH}, worker_num {args.worker_num}, size_threshold "
        f"{args.size_threshold / 2**20:.0f} MiB, MLP {'-'.join(map(str, args.hidden))}, "
        f"{args.steps} steps x {args.rounds} rounds, "
        f"backend {args.backend}; RSS bound {bound:.0f} MiB"
    )
    table = [r for r in results if r["config"] != "floor"]
    if table:
        print(
            f"{'config':<18}{'no-trace st/s':>14}{'traced st/s':>13}{'ratio':>8}{'rows/s':>12}"
            f"{'close s':>9}{'RSS +MiB':>10}{'in-band us/step':>17}{'cost us/step':>14}"
        )
    for r in table:
        if r["config"] == "throughput":
            print(
                f"{'throughput':<18}{'-':>14}{'-':>13}{'-':>8}{r['rows_s']:>12,.0f}"
                f"{r['close_s']:>9.2f}{r['rss_growth_mib']:>10.0f}"
            )
        else:
            print(
                f"{r['config']:<18}{r['none_steps_s']:>14.1f}{r['traced_steps_s']:>13.1f}"
                f"{r['ratio']:>8.3f}{r['rows_s']:>12,.0f}{r['close_s']:>9.2f}"
                f"{r['rss_growth_mib']:>10.0f}{r['trace_us_per_step']:>17.0f}{r['cost_us']:>14.0f}"
            )
    for r in results:
        if r["config"] == "floor":
            print(
                f"\nfloor (in one process; a step without tracing takes {r['step_us']:.0f} us): "
                "cost per step against the slice without tracing before it"
            )
            for mode, cost in r["cost_us"].items():
                print(f"  {mode:<12}{cost:>8.0f} us  ({cost / r['step_us']:.1%})")


if __name__ == "__main__":
    main()
