"""What built-in hooks cost a real torch training loop, measured side by side in one process.

Sections (``--only`` picks some, comma separated; default all); each is one function
registered in ``SECTIONS``:

``tracker``
    A small MLP (``torch.set_num_threads(1)``; ``--batch 2048 --width 256`` is about 10 ms a
    step, ``--batch 256`` about 1.5 ms) trained inside a ``HookBus``, logging ``--metrics``
    scalars per step.  "loop us" is the per-step time outside the training computation
    (publishes, ``add_to_ml_tracker``, the hook): what tracking costs the step itself.
    Variants: no hooks; ``MLTrackerHook(MlflowTracker)`` (MLflow's client in a child process,
    the default); ``MLTrackerHook(MlflowClientTracker)`` (the same client in a worker thread
    of the training process, for reference); mlflow's own ``log_metric`` in the loop,
    synchronous and with ``synchronous=False``; all against one local sqlite store.
    Every variant keeps its own bus (and run) open in its own task for the whole section and
    they take turns: ``--rounds`` rounds, each giving every variant one slice of
    ``--seconds`` of training (order rotated per round).  After a slice the variant's
    background backlog is drained so it cannot slow the next variant's slice; that drain time
    is printed, and "sustained" counts it (steps / (slice + drain)).  The hook flushes every
    ``--flush-interval`` seconds (its default, 1 s: fewer, bigger ``log_batch`` requests; MLflow's
    sqlite store spends ~7 ms per request plus ~50 us per metric).  Every variant's slice sits
    between two no-hook slices; its ratio is its steps/s over their mean, and a variant's
    ratio is the median over rounds: load changes of a shared machine from one slice to the
    next (5-10 % here) stay out of the comparison.
    Target (issue 4): MLTrackerHook >= 0.99x no hooks.

    python benchmarks/bench_hooks.py [--only tracker] [--rounds 4] [--seconds 1.5] [--batch 256]

``tracker-job``
    What a user's job sees: every round is a fresh process that builds the MLP (default batch
    512 here, ~3 ms a step), warms torch up (30 steps, untimed), then enters a fresh
    ``HookBus``, adds the hook and publishes ``Start`` (the set-up, timed apart), trains
    ``--job-steps`` steps (3,000) logging ``--metrics`` scalars a step (8 here) and leaves the
    bus (the close).  Configs, alternated in every round: no hooks; ``MLTrackerHook`` with the
    default ``JsonlTracker``; ``MLTrackerHook(MlflowTracker)`` against a fresh sqlite store.
    Printed: steps/s from the first step to the end of the close over the no-hook run's of the
    same round (median and range), set-up and close seconds, step p50 / max.  Beside them, in
    a fresh process of each round, what MLflow's own client needs in-process to start: ``import
    mlflow`` then ``start_run`` on a fresh store (the yardstick for the set-up).
    Target (issue 16): MlflowTracker >= 0.9x no hooks, set-up no longer than that yardstick.

    python benchmarks/bench_hooks.py --only tracker-job [--rounds 4]

``monitors``
    The monitoring hooks of issue 24 (``DeviceStatsHook``, ``OOMObserverHook``, ``NvtxHook``
    with no-op ranges, ``AnomalyProfilerHook`` on a run without anomalies, ``TimerHook``), each
    alone and all five together, interleaved with no hooks as in ``tracker`` (default batch
    512, ~3 ms a step).  Printed: each one's loop time over the no-hook loop time per step,
    in us and as a share of the step.  Target (issue 24): each <= 1 % of the step.

    python benchmarks/bench_hooks.py --only monitors [--rounds 4] [--seconds 1.5]

``optim``
    The same MLP (batch 512: ~3 ms a step) with ``BeforeOptimizerStep`` / ``AfterOptimizerStep``
    published around every optimizer step, in interleaved slices as in ``tracker``: no hooks;
    ``clip_grad_norm_`` and the total norm computed by hand (the yardsticks of the clipping and
    norm hooks: that work is the user's either way); ``ClipGradNormHook``; ``GradNormHook()``
    and ``(per_layer=True)``; ``LearningRateHook``; ``MetricReportHook`` with FLOPs and MFU.
    "loop us" is what the publishes and the hooks cost the step.  Target (issue 24): each hook
    adds <= 1 % of the step over its yardstick.

    python benchmarks/bench_hooks.py --only optim [--rounds 4] [--seconds 1.5]

``copy-out``
    What copying traced and tracked tensors out of the bus's host buffers costs the step, by
    where it happens: on the step (``HostBufferPool(copy_out_interval=None)``: each step
    resolves the copies of the step before), by the copy-out thread every
    ``DEFAULT_COPY_OUT_INTERVAL`` seconds in a batch (the default), and by the thread woken
    every step (``copy_out_interval=0``).  The MLP of ``tracker`` (batch 256) steps between
    the copies; per step the loss and ``--metrics`` - 1 (default 3) columns of 512 ids are
    copied.  Printed: the step thread's CPU in ``copy`` + ``next_step``, and the process's
    other threads' CPU, per step (medians over ``--rounds`` alternated runs).

    python benchmarks/bench_hooks.py --only copy-out [--rounds 6]

``breakdown``
    Where the step's CPU goes, per hook and per collector call, for the held-out job of
    ``bench_peers.py`` (its MLP, batches and hook set: the loss logged every 50 steps, a
    progress bar, the loss to a local JSONL tracker every step, one checkpoint at the end) on
    its ``--breakdown-configs`` paths (default ``trainer,async-loop,sync-loop``).  Every run is
    a fresh process; each round runs every config once (and again with the code of
    ``--compare DIR``, alternated).  In the child, the bus's subscribers, ``publish``, the
    collectors (``add_metric``, ``add_to_ml_tracker``, ``add_to_trace``), the host-copy pool
    (``copy``, ``next_step``), the bus's collector merge and yields, and the model's forward,
    backward and optimizer step are wrapped in sections timed on the thread's CPU clock
    (``time.thread_time_ns``: what other processes on the machine take is not counted),
    nested: each row is a section's own time (its timed children taken out), per training
    step over the steps after ``bench_peers``'s 50 warm-up steps.  The cost of the timing
    itself is measured in the child and taken out (printed).  "loop (the rest)" is the step
    thread's CPU outside every section (the Trainer's or the loop's own code, the event
    loop); "other threads" the CPU of the process's other threads per step (the tracker's
    writer, the reads).  Medians over ``--rounds`` rounds.

    ``--breakdown-normalize`` scales each run's rows by the median model CPU per step (all
    runs) over the run's own: on a shared machine one process runs 20 % slower than the next
    in everything, the model included.  ``--breakdown-bare`` also runs each config without
    the sections, to check the step thread's total.

    python benchmarks/bench_hooks.py --only breakdown [--rounds 3] [--breakdown-steps 1500]
        [--breakdown-configs trainer,async-loop] [--compare <checkout>] [--breakdown-normalize]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from recis_async import Hook, HookBus, add_to_ml_tracker
from recis_async.events import (
    AfterData,
    AfterOptimizerStep,
    AfterStep,
    BeforeOptimizerStep,
    BeforeStep,
)

Section = Callable[[argparse.Namespace], bool]


# --------------------------------------------------------------------------- shared pieces


class Workload:
    """The training step every variant runs: an MLP on fixed random data, one thread."""

    def __init__(self, batch: int = 256, width: int = 256, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(64, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 1),
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(batch, 64)
        self.y = torch.randn(batch, 1)
        self.batch = batch
        self.step_count = 0
        self.optimizer_events = False  # publish Before/AfterOptimizerStep (section optim)

    def step(self) -> torch.Tensor:
        loss = self.backward()
        self.optimizer_step()
        return loss

    def backward(self) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Session(NamedTuple):
    """One variant, open for the whole section."""

    bus: HookBus
    on_step: Callable[[int, torch.Tensor], None]  # called between the step and AfterStep
    drain: Callable[[], Awaitable[None]]  # wait until its background work is done (untimed)
    ready: Callable[[], bool]  # warm-up lasts until this holds (e.g. a tracker has started)


class Slice(NamedTuple):
    rate: float  # steps/s
    train_us: float  # per step: the training computation (forward, backward, optimizer)
    hook_us: float  # per step: everything else in the loop (publishes, tracking calls)


async def train_for(bus: HookBus, work: Workload, seconds: float, session: Session) -> Slice:
    """Train on ``bus`` for ``seconds``, timing the training part and the rest apart."""
    steps = 0
    train = 0.0
    start = time.perf_counter()
    end = start + seconds
    while True:
        now = time.perf_counter()
        if now >= end:
            elapsed = now - start
            per_step = 1e6 / max(steps, 1)
            return Slice(steps / elapsed, train * per_step, (elapsed - train) * per_step)
        step = work.step_count
        await bus.publish(BeforeStep(global_step=step))
        await bus.publish(AfterData(global_step=step))
        t = time.perf_counter()
        if work.optimizer_events:
            loss = work.backward()
            train += time.perf_counter() - t
            optimizers = (work.opt,)
            await bus.publish(BeforeOptimizerStep(global_step=step, optimizers=optimizers))
            t = time.perf_counter()
            work.optimizer_step()
            train += time.perf_counter() - t
            await bus.publish(AfterOptimizerStep(global_step=step, optimizers=optimizers))
        else:
            loss = work.step()
            train += time.perf_counter() - t
        session.on_step(step, loss)
        await bus.publish(AfterStep(global_step=step, samples=work.batch))
        work.step_count += 1
        steps += 1


async def run_variant(
    open_session: Callable[[], contextlib.AbstractAsyncContextManager[Session]],
    work: Workload,
    turns: MemoryObjectReceiveStream[float],
    results: MemoryObjectSendStream[tuple[Slice, float]],
) -> None:
    """A variant's task: open its session, warm up, then train one slice per turn."""
    async with open_session() as session, turns, results:
        with anyio.fail_after(120):
            while True:  # warm up: at least 0.3 s and until ready
                await train_for(session.bus, work, 0.3, session)
                if session.ready():
                    break
        await session.drain()
        await results.send((Slice(0.0, 0.0, 0.0), 0.0))  # warmed up
        async for seconds in turns:
            result = await train_for(session.bus, work, seconds, session)
            start = time.perf_counter()
            await session.drain()
            await results.send((result, time.perf_counter() - start))


class Rounds(NamedTuple):
    slices: dict[str, list[Slice]]
    drains: dict[str, list[float]]  # seconds to finish the slice's background work after it
    neighbours: dict[str, list[tuple[int, int]]]  # per slice: the base slices around it


async def interleave(
    variants: dict[str, Callable[[], contextlib.AbstractAsyncContextManager[Session]]],
    work: Workload,
    rounds: int,
    seconds: float,
    base: str,
) -> Rounds:
    """Every variant's slices, taken in turn (order rotated per round), with a slice of
    ``base`` before the first and after every other variant's slice: each variant's slice
    then has a ``base`` slice right before and right after it (see :func:`report`)."""
    names = list(variants)
    others = [name for name in names if name != base]
    slices: dict[str, list[Slice]] = {name: [] for name in names}
    drains: dict[str, list[float]] = {name: [] for name in names}
    neighbours: dict[str, list[tuple[int, int]]] = {name: [] for name in others}
    async with anyio.create_task_group() as tg:
        channels = {}
        for name in names:
            send_turn, recv_turn = anyio.create_memory_object_stream[float](1)
            send_result, recv_result = anyio.create_memory_object_stream[tuple[Slice, float]](1)
            tg.start_soon(run_variant, variants[name], work, recv_turn, send_result)
            await recv_result.receive()  # one variant warms up at a time
            channels[name] = (send_turn, recv_result)

        async def turn(name: str) -> None:
            send_turn, recv_result = channels[name]
            await send_turn.send(seconds)
            result, drained = await recv_result.receive()
            slices[name].append(result)
            drains[name].append(drained)

        for r in range(rounds):
            await turn(base)
            for name in others[r % len(others) :] + others[: r % len(others)]:
                before = len(slices[base]) - 1
                await turn(name)
                await turn(base)
                neighbours[name].append((before, before + 1))
        for send_turn, recv_result in channels.values():
            await send_turn.aclose()
            await recv_result.aclose()
    return Rounds(slices, drains, neighbours)


def report(result: Rounds, base: str, seconds: float) -> dict[str, float]:
    """Print, per variant: median steps/s; the median over its slices of its steps/s divided
    by the mean of the two ``base`` slices right before and after it (a load change of the
    shared machine between slices would otherwise land in the ratio); the per-step time of the
    training part and of the rest of the loop (the publishes and tracking calls: what the hook
    costs the step itself); the backlog drain time after a slice; the sustained ratio (steps
    over slice + drain).  Returns the ratios."""
    ratios: dict[str, float] = {}
    print(
        f"{'variant':48} {'steps/s':>8} {'ratio':>7} {'train us':>9} {'loop us':>8} "
        f"{'drain s':>8} {'sustained':>9}   per-slice ratios"
    )
    base_rates = [s.rate for s in result.slices[base]]
    for name, slices in result.slices.items():
        rates = [s.rate for s in slices]
        drains = result.drains[name]
        if name == base:  # each base slice against the mean of its neighbours
            refs = [
                (base_rates[max(i - 1, 0)] + base_rates[min(i + 1, len(rates) - 1)]) / 2
                for i in range(len(rates))
            ]
        else:
            refs = [(base_rates[a] + base_rates[b]) / 2 for a, b in result.neighbours[name]]
        each = [r / ref for r, ref in zip(rates, refs, strict=True)]
        ratios[name] = statistics.median(each)
        sustained = statistics.median(
            e * seconds / (seconds + d) for e, d in zip(each, drains, strict=True)
        )
        spread = " ".join(f"{e:.3f}" for e in each)
        print(
            f"{name:48} {statistics.median(rates):8.1f} {ratios[name]:6.3f}x "
            f"{statistics.median(s.train_us for s in slices):9.1f} "
            f"{statistics.median(s.hook_us for s in slices):8.1f} "
            f"{statistics.median(drains):8.3f} {sustained:8.3f}x   {spread}"
        )
    return ratios


# --------------------------------------------------------------------------- tracker section


def _metric_values(loss: torch.Tensor, n: int) -> dict[str, float]:
    value = float(loss)
    return {"loss": value, **{f"m{i}": value * i for i in range(1, n)}}


def section_tracker(args: argparse.Namespace) -> bool:
    """MLTrackerHook(MlflowTracker) vs mlflow's log_metric (sync and async) vs no hooks."""
    try:
        from mlflow import MlflowClient
    except ImportError:
        print("[tracker] mlflow is not installed (pip install recis_async[mlflow]); skipped")
        return True
    from recis_async.hooks import MLTrackerHook
    from recis_async.trackers import MlflowTracker
    from recis_async.trackers.mlflow import MlflowClientTracker

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_hooks_"))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("bench", artifact_location=str(root / "artifacts"))
    n_metrics = args.metrics or 4

    def no_track(step: int, loss: torch.Tensor) -> None:
        pass

    async def nothing() -> None:
        pass

    @contextlib.asynccontextmanager
    async def no_hooks() -> AsyncIterator[Session]:
        async with HookBus() as bus:
            yield Session(bus, no_track, nothing, lambda: True)

    def with_hook(process: bool) -> Callable[[], contextlib.AbstractAsyncContextManager[Session]]:
        @contextlib.asynccontextmanager
        async def session() -> AsyncIterator[Session]:
            tracker: Any = MlflowTracker(uri) if process else MlflowClientTracker(uri)
            hook = MLTrackerHook(
                "bench", f"hook-process={process}", {"lr": 1e-3}, tracker=tracker,
                flush_interval=args.flush_interval,
            )  # fmt: skip

            def track(step: int, loss: torch.Tensor) -> None:
                for name, value in _metric_values(loss, n_metrics).items():
                    add_to_ml_tracker(name, value)

            def stats() -> Any:
                assert hook.service is not None
                return hook.service.stats()

            async with HookBus() as bus:
                bus.add_hook(hook)
                yield Session(bus, track, hook.flush, lambda: stats()["batches"] > 0)
            closes.append(stats())

        return session

    def direct(synchronous: bool) -> Callable[[], contextlib.AbstractAsyncContextManager[Session]]:
        @contextlib.asynccontextmanager
        async def session() -> AsyncIterator[Session]:
            run_id = client.create_run(experiment, run_name=f"direct-sync={synchronous}")
            run_id = run_id.info.run_id
            client.log_param(run_id, "lr", 1e-3)
            pending: list[Any] = []

            def log(step: int, loss: torch.Tensor) -> None:
                for name, value in _metric_values(loss, n_metrics).items():
                    op = client.log_metric(run_id, name, value, step=step, synchronous=synchronous)
                    if op is not None:
                        pending.append(op)

            async def drain() -> None:
                ops = pending[:]
                pending.clear()
                await anyio.to_thread.run_sync(lambda: [op.wait() for op in ops])

            async with HookBus() as bus:
                yield Session(bus, log, drain, lambda: True)
            client.set_terminated(run_id)

        return session

    closes: list[Any] = []
    variants = {
        "no hooks": no_hooks,
        "MLTrackerHook(MlflowTracker)": with_hook(True),
        "MLTrackerHook(MlflowClientTracker) in-process": with_hook(False),
        "mlflow log_metric synchronous": direct(True),
        "mlflow log_metric synchronous=False": direct(False),
    }
    work = Workload(batch=args.batch or 2048, width=args.width)
    load = os.getloadavg()[0]

    async def go() -> Rounds:
        return await interleave(variants, work, args.rounds, args.seconds, "no hooks")

    started = time.perf_counter()
    result = anyio.run(go, backend=args.backend)
    print(
        f"\n[tracker] {n_metrics} metrics/step; MLP 64-{args.width}-{args.width}-1, batch "
        f"{work.batch}, 1 torch "
        f"thread; {args.backend}; {args.rounds} rounds x {args.seconds}s slices; sqlite store; "
        f"hook flush_interval {args.flush_interval}s; {os.cpu_count()} CPUs, load average "
        f"{load:.2f} at start; {time.perf_counter() - started:.0f}s"
    )
    ratios = report(result, "no hooks", args.seconds)
    for stats in closes:
        assert stats["spilled"] == 0 and stats["logged"] == stats["records"]
    name = "MLTrackerHook(MlflowTracker)"
    met = ratios[name] >= 0.99
    print(f"target {name} >= 0.99x no hooks: {ratios[name]:.3f}x {'met' if met else 'NOT met'}")
    return met


# --------------------------------------------------------------------------- optim


def section_optim(args: argparse.Namespace) -> bool:
    """The optimizer-step and report hooks of issue 24, each alone, against no hooks."""
    from recis_async.hooks import (
        ClipGradNormHook,
        GradNormHook,
        LearningRateHook,
        MetricReportHook,
        ReportArguments,
    )

    torch.set_num_threads(1)
    logging.getLogger("recis_async").setLevel(logging.WARNING)
    work = Workload(batch=args.batch or 512, width=args.width)
    work.optimizer_events = True

    def no_track(step: int, loss: torch.Tensor) -> None:
        pass

    async def nothing() -> None:
        pass

    def with_hooks(*make: Callable[[], Any]) -> Callable[[], Any]:
        @contextlib.asynccontextmanager
        async def session() -> AsyncIterator[Session]:
            async with HookBus() as bus:
                for m in make:
                    bus.add_hook(m())
                yield Session(bus, no_track, nothing, lambda: True)

        return session

    params = list(work.model.parameters())

    class ClipByHand(Hook):
        """What a loop that clips does without the hook: the yardstick of ClipGradNormHook."""

        def before_optimizer_step(self, event: Any) -> None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)

    class NormByHand(Hook):
        """The gradient norm a loop computes without the hook (kept on the device, unread)."""

        def before_optimizer_step(self, event: Any) -> None:
            torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    variants = {
        "no hooks": with_hooks(),
        "clip_grad_norm_ by hand (no hook)": with_hooks(ClipByHand),
        "total norm by hand (no hook)": with_hooks(NormByHand),
        "ClipGradNormHook(max_norm=1, log_steps=100)": with_hooks(
            lambda: ClipGradNormHook(params, None, 1.0)
        ),
        "GradNormHook()": with_hooks(lambda: GradNormHook(params)),
        "GradNormHook(per_layer=True)": with_hooks(lambda: GradNormHook(params, per_layer=True)),
        "LearningRateHook(momentum, weight_decay)": with_hooks(
            lambda: LearningRateHook(work.opt, momentum=True, weight_decay=True)
        ),
        "MetricReportHook(FLOPs, MFU)": with_hooks(
            lambda: MetricReportHook(work.model, ReportArguments(peak_flops=1e11, log=False))
        ),
    }
    load = os.getloadavg()[0]

    async def go() -> Rounds:
        return await interleave(variants, work, args.rounds, args.seconds, "no hooks")

    started = time.perf_counter()
    result = anyio.run(go, backend=args.backend)
    print(
        f"\n[optim] MLP 64-{args.width}-{args.width}-1, batch {work.batch}, 1 torch thread, "
        f"Before/AfterOptimizerStep published every step; {args.backend}; {args.rounds} rounds "
        f"x {args.seconds}s slices; {os.cpu_count()} CPUs, load average {load:.2f} at start; "
        f"{time.perf_counter() - started:.0f}s"
    )
    report(result, "no hooks", args.seconds)
    # What a hook costs the step is its "loop us" over its yardstick's: the same work done by
    # hand for the clipping and norm hooks (the norm is the user's to pay), no hooks for the
    # others.  (The steps/s ratios move by a few percent from slice to slice on this machine.)
    yardstick = {
        "ClipGradNormHook(max_norm=1, log_steps=100)": "clip_grad_norm_ by hand (no hook)",
        "GradNormHook()": "total norm by hand (no hook)",
        "GradNormHook(per_layer=True)": "total norm by hand (no hook)",
    }
    loop = {n: statistics.median(s.hook_us for s in sl) for n, sl in result.slices.items()}
    step_us = statistics.median(s.train_us + s.hook_us for s in result.slices["no hooks"])
    met = True
    for name in loop:
        if name == "no hooks" or name.endswith("by hand (no hook)"):
            continue
        base = yardstick.get(name, "no hooks")
        extra = loop[name] - loop[base]
        met = met and extra <= 0.01 * step_us
        print(f"{name}: {extra:+.1f} us a step over {base} ({extra / step_us:+.2%} of the step)")
    print(f"target: each hook costs <= 1% of the step: {'met' if met else 'NOT met'}")
    return met


# --------------------------------------------------------------------------- tracker-job

JOB_CONFIGS = ("no hooks", "MLTrackerHook(JsonlTracker)", "MLTrackerHook(MlflowTracker)")


async def job_child(args: argparse.Namespace) -> dict[str, Any]:
    """One job in this fresh process: set-up, ``--job-steps`` steps, close."""
    from recis_async.events import Start
    from recis_async.hooks import MLTrackerHook

    config = args.job_child
    root = Path(args.job_dir)
    torch.set_num_threads(1)
    work = Workload(batch=args.batch or 512, width=args.width)
    for _ in range(30):  # warm up torch
        work.step()
    n_metrics = args.metrics or 8
    marks = [0] * (args.job_steps + 1)
    t_setup = time.perf_counter()
    hook: Any = None
    if config == "MLTrackerHook(JsonlTracker)":
        from recis_async.trackers import JsonlTracker

        hook = MLTrackerHook("bench", "job", {"lr": 1e-3}, tracker=JsonlTracker(root / "jsonl"))
    elif config == "MLTrackerHook(MlflowTracker)":
        from recis_async.trackers import MlflowTracker

        tracker = MlflowTracker(f"sqlite:///{root / 'mlflow.db'}")
        hook = MLTrackerHook("bench", "job", {"lr": 1e-3}, tracker=tracker)
    perf_ns = time.perf_counter_ns
    async with HookBus(handle_signals=False) as bus:
        if hook is not None:
            bus.add_hook(hook)
        await bus.publish(Start(is_train=True))
        t_loop = time.perf_counter()
        for step in range(args.job_steps):
            marks[step] = perf_ns()
            await bus.publish(BeforeStep(global_step=step))
            loss = work.step()
            if hook is not None:
                for name, value in _metric_values(loss, n_metrics).items():
                    add_to_ml_tracker(name, value)
            await bus.publish(AfterStep(global_step=step, samples=work.batch))
        marks[-1] = perf_ns()
        t_close = time.perf_counter()
    t_end = time.perf_counter()
    logged = None
    if hook is not None:
        assert hook.service is not None
        stats = hook.service.stats()
        assert stats["spilled"] == 0 and stats["logged"] == stats["records"] == args.job_steps
        logged = stats["logged"]
    steps_ms = sorted((b - a) / 1e6 for a, b in zip(marks, marks[1:], strict=False))
    return {
        "setup_s": t_loop - t_setup,
        "loop_s": t_close - t_loop,
        "close_s": t_end - t_close,
        "p50_ms": steps_ms[len(steps_ms) // 2],
        "max_ms": steps_ms[-1],
        "logged": logged,
    }


def mlflow_own_start(root: Path) -> float:
    """Seconds MLflow's own client needs in a fresh process: import, then start_run on a
    fresh sqlite store (run in a child so the import is cold)."""
    import subprocess

    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "import mlflow\n"
        "mlflow.set_tracking_uri(sys.argv[1])\n"
        "mlflow.set_experiment('bench')\n"
        "mlflow.start_run(run_name='job')\n"
        "print(time.perf_counter() - t)\n"
        "mlflow.end_run()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, f"sqlite:///{root / 'own.db'}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def section_tracker_job(args: argparse.Namespace) -> bool:
    """MLTrackerHook(MlflowTracker) in a job's lifetime: fresh process and bus per round."""
    import json
    import subprocess

    try:
        import mlflow  # noqa: F401
    except ImportError:
        print("[tracker-job] mlflow is not installed (pip install recis_async[mlflow]); skipped")
        return True
    here = Path(__file__).resolve().parent.parent
    roots = {c: here for c in JOB_CONFIGS}
    if args.compare:  # the tracker again with another checkout's code: before/after pairs
        other = Path(args.compare).resolve()
        roots[f"MLTrackerHook(MlflowTracker)@{other.name}"] = other
    configs = list(roots)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    own: list[float] = []
    load = os.getloadavg()
    started = time.perf_counter()
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for label in order:
            config, code = label.split("@")[0], roots[label]
            root = Path(tempfile.mkdtemp(prefix="bench_hooks_job_"))
            cmd = [
                sys.executable, str(code / "benchmarks" / "bench_hooks.py"), "--job-child", config,
                "--job-dir", str(root), "--job-steps", str(args.job_steps),
                "--metrics", str(args.metrics or 8), "--width", str(args.width),
                "--backend", args.backend,
            ]  # fmt: skip
            if args.batch:
                cmd += ["--batch", str(args.batch)]
            env = {**os.environ, "PYTHONPATH": str(code)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                raise SystemExit(f"[tracker-job] {label} failed")
            runs[label].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"# round {r} {label}: {runs[label][-1]}", file=sys.stderr)
        root = Path(tempfile.mkdtemp(prefix="bench_hooks_own_"))
        own.append(mlflow_own_start(root))
    med = statistics.median
    print(
        f"\n[tracker-job] fresh process and bus per round, {args.job_steps} steps after 30 "
        f"warm-up steps, {args.metrics or 8} metrics/step; MLP 64-{args.width}-{args.width}-1, "
        f"batch "
        f"{args.batch or 512}, 1 torch thread; {args.backend}; {args.rounds} rounds alternated; "
        f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at "
        f"start; {time.perf_counter() - started:.0f}s"
    )
    print(
        f"{'variant':40} {'steps/s':>8} {'ratio':>7} {'range':>12} {'setup s':>8} {'close s':>8}"
        f" {'p50 ms':>7} {'max ms':>7}"
    )
    base = runs["no hooks"]

    def rate(run: dict[str, Any]) -> float:
        return float(args.job_steps / (run["loop_s"] + run["close_s"]))

    ratios: dict[str, float] = {}
    for config, rs in runs.items():
        each = [rate(x) / rate(b) for x, b in zip(rs, base, strict=True)]
        ratios[config] = med(each)
        print(
            f"{config:40} {med(rate(x) for x in rs):8.1f} {med(each):6.3f}x "
            f"{f'{min(each):.2f}-{max(each):.2f}':>12} {med(x['setup_s'] for x in rs):8.2f} "
            f"{med(x['close_s'] for x in rs):8.2f} {med(x['p50_ms'] for x in rs):7.2f} "
            f"{med(x['max_ms'] for x in rs):7.1f}"
        )
    name = "MLTrackerHook(MlflowTracker)"
    setup = med(x["setup_s"] for x in runs[name])
    print(
        f"mlflow's own client in-process, import + start_run on a fresh store: {med(own):.2f}s "
        f"(range {min(own):.2f}-{max(own):.2f})"
    )
    met = ratios[name] >= 0.9 and setup <= med(own)
    print(
        f"target {name} >= 0.9x no hooks and set-up <= mlflow's own start: {ratios[name]:.3f}x, "
        f"{setup:.2f}s vs {med(own):.2f}s {'met' if met else 'NOT met'}"
    )
    return met


# --------------------------------------------------------------------------- main

# --------------------------------------------------------------------------- monitors


def section_monitors(args: argparse.Namespace) -> bool:
    """The monitoring hooks of issue 24, each alone and all together, against no hooks."""
    from recis_async.hooks import (
        AnomalyProfilerHook,
        DeviceStatsHook,
        NvtxHook,
        OOMObserverHook,
        TimerHook,
    )

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_monitors_"))

    class NoRanges:  # NVTX's bookkeeping without CUDA: the pushes and pops do nothing
        def range_push(self, msg: str) -> None: ...
        def range_pop(self) -> None: ...

    def nothing_on_step(step: int, loss: torch.Tensor) -> None:
        pass

    async def nothing() -> None:
        pass

    def variant(
        *make: Callable[[], Any],
    ) -> Callable[[], contextlib.AbstractAsyncContextManager[Session]]:
        @contextlib.asynccontextmanager
        async def session() -> AsyncIterator[Session]:
            async with HookBus() as bus:
                for m in make:
                    bus.add_hook(m())
                yield Session(bus, nothing_on_step, nothing, lambda: True)

        return session

    hooks: dict[str, Callable[[], Any]] = {
        "DeviceStatsHook(every_n_steps=100)": lambda: DeviceStatsHook(100),
        "OOMObserverHook": lambda: OOMObserverHook(root),
        "NvtxHook (no-op ranges)": lambda: NvtxHook(NoRanges()),
        "AnomalyProfilerHook (no anomaly)": lambda: AnomalyProfilerHook(
            output_dir=root, max_profiles=1, slowdown=50.0, loss_jump=None
        ),
        "TimerHook(1 day)": lambda: TimerHook("01:00:00:00"),
    }
    variants = {"no hooks": variant()}
    variants.update({name: variant(make) for name, make in hooks.items()})
    variants["all five"] = variant(*hooks.values())
    work = Workload(batch=args.batch or 512, width=args.width)

    async def go() -> Rounds:
        return await interleave(variants, work, args.rounds, args.seconds, "no hooks")

    load = os.getloadavg()[0]
    result = anyio.run(go, backend=args.backend)
    print(
        f"\n[monitors] MLP 64-{args.width}-{args.width}-1, batch {work.batch}, 1 torch thread; "
        f"{args.backend}; {args.rounds} rounds x {args.seconds}s slices; {os.cpu_count()} CPUs, "
        f"load average {load:.2f} at start"
    )
    report(result, "no hooks", args.seconds)
    base = statistics.median(s.hook_us for s in result.slices["no hooks"])
    step = statistics.median(s.train_us + s.hook_us for s in result.slices["no hooks"])
    met = True
    print(f"cost per step over no hooks' loop time ({base:.1f} us), of a {step:.0f} us step:")
    for name in [*hooks, "all five"]:
        cost = statistics.median(s.hook_us for s in result.slices[name]) - base
        share = 100.0 * cost / step
        ok = name == "all five" or share <= 1.0
        met &= ok
        print(f"  {name:40} {cost:7.1f} us  {share:5.2f} %{'' if ok else '  > 1 %'}")
    for p in root.iterdir():
        p.unlink()
    root.rmdir()
    print(f"target each hook <= 1 % of the step: {'met' if met else 'NOT met'}")
    return met


# --------------------------------------------------------------------------- breakdown

BREAKDOWN_CONFIGS = ("trainer", "async-loop", "sync-loop")


class _Sections:
    """Nested sections timed on this thread's CPU clock: per name, calls, inclusive ns and
    the inclusive ns of its timed children (its own time is the difference)."""

    def __init__(self) -> None:
        import threading

        self.thread = threading.get_ident()
        self.calls: dict[str, int] = {}
        self.incl: dict[str, int] = {}
        self.kids: dict[str, int] = {}
        self.kid_calls: dict[str, int] = {}
        self.stack: list[list[int]] = []  # per open section: [children's ns, children]

    def reset(self) -> None:
        self.calls, self.incl, self.kids, self.kid_calls = {}, {}, {}, {}

    def enter(self) -> int:
        self.stack.append([0, 0])
        return time.thread_time_ns()

    def leave(self, name: str, t0: int) -> None:
        took = time.thread_time_ns() - t0
        kids, kid_calls = self.stack.pop()
        self.calls[name] = self.calls.get(name, 0) + 1
        self.incl[name] = self.incl.get(name, 0) + took
        self.kids[name] = self.kids.get(name, 0) + kids
        self.kid_calls[name] = self.kid_calls.get(name, 0) + kid_calls
        if self.stack:
            self.stack[-1][0] += took
            self.stack[-1][1] += 1

    def sync(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed as ``name`` (a str, or a function of the call's arguments); an
        awaitable it returns is timed as ``name (awaited)`` when awaited."""
        import functools
        import inspect
        import threading

        get_ident = threading.get_ident

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            if get_ident() != self.thread:
                return fn(*a, **k)
            label = name if isinstance(name, str) else name(*a, **k)
            t0 = self.enter()
            try:
                result = fn(*a, **k)
            finally:
                self.leave(label, t0)
            if result is not None and inspect.isawaitable(result):
                return self._awaited(f"{label} (awaited)", result)
            return result

        return timed

    async def _awaited(self, name: str, awaitable: Awaitable[Any]) -> Any:
        t0 = self.enter()
        try:
            return await awaitable
        finally:
            self.leave(name, t0)

    def coro(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        """A coroutine function timed as ``name`` from its call to its end (a suspension
        counts what the loop ran meanwhile on this thread)."""
        import functools

        @functools.wraps(fn)
        async def timed(*a: Any, **k: Any) -> Any:
            label = name if isinstance(name, str) else name(*a, **k)
            t0 = self.enter()
            try:
                return await fn(*a, **k)
            finally:
                self.leave(label, t0)

        return timed


def _calibrate(sections: _Sections) -> tuple[float, float]:
    """The timing's own cost in ns: (as a parent sees a timed no-op, as the no-op records)."""

    def noop() -> None:
        return None

    timed = sections.sync("calibration", noop)
    best_outer = best_inner = math.inf
    for _ in range(5):
        sections.reset()
        n = 20000
        t0 = time.thread_time_ns()
        for _ in range(n):
            timed()
        outer = (time.thread_time_ns() - t0) / n
        t0 = time.thread_time_ns()
        for _ in range(n):
            noop()
        outer -= (time.thread_time_ns() - t0) / n
        inner = sections.incl["calibration"] / n
        best_outer, best_inner = min(best_outer, outer), min(best_inner, inner)
    sections.reset()
    return best_outer, best_inner


def _instrument(sections: _Sections) -> None:
    """Wrap the bus, the collectors, the host-copy pool and the model's work in timed
    sections (class-level patches: the breakdown's child process only)."""
    import recis_async
    from recis_async import bus as bus_module
    from recis_async import collect, hostcopy, trainer

    bus_cls = recis_async.HookBus
    original_add = bus_cls._add

    def add(self: Any, event_type: Any, fn: Any, name: str, *rest: Any) -> Any:
        import inspect

        label = f"hook {name}"
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004
        )
        wrapped = sections.coro(label, fn) if is_async else sections.sync(label, fn)
        return original_add(self, event_type, wrapped, name, *rest)

    bus_cls._add = add  # type: ignore[method-assign]
    bus_cls._publish = sections.coro(  # type: ignore[method-assign]
        lambda self, event: f"bus publish {type(event).__name__}", bus_cls._publish
    )
    collector_cls = collect.StepCollector
    collector_cls.merged = sections.sync(  # type: ignore[method-assign]
        "bus collector merge (AfterStep)", collector_cls.merged
    )
    bus_module.yield_to_services = sections.coro(  # type: ignore[attr-defined]
        "bus yield to services", bus_module.yield_to_services
    )
    pool = hostcopy.HostBufferPool
    pool.copy = sections.sync("hostcopy copy (the step's)", pool.copy)  # type: ignore[method-assign]
    pool.next_step = sections.sync(  # type: ignore[method-assign]
        "hostcopy next_step (earlier copies out)", pool.next_step
    )
    for name in ("add_metric", "add_to_ml_tracker", "add_to_trace"):
        setattr(recis_async, name, sections.sync(f"collector {name}", getattr(recis_async, name)))
    trainer.add_metric = sections.sync(  # type: ignore[attr-defined]
        "collector add_metric", trainer.add_metric
    )
    try:
        from recis_async.syncbus import SyncHookBus

        SyncHookBus.publish = sections.sync(  # type: ignore[method-assign]
            "SyncHookBus.publish (the switches)", SyncHookBus.publish
        )
    except ImportError:
        pass
    # the Trainer's own work on a step (its step events are built inline, in the step loop)
    trainer.Lookahead.take = sections.sync(  # type: ignore[method-assign]
        "trainer next batch (Lookahead.take, to_device)", trainer.Lookahead.take
    )
    for name in ("_loss_of", "_trainable", "batch_size"):
        setattr(trainer, name, sections.sync(f"trainer {name}", getattr(trainer, name)))
    torch.nn.functional.mse_loss = sections.sync("model loss", torch.nn.functional.mse_loss)
    torch.Tensor.backward = sections.sync(  # type: ignore[method-assign]
        "model backward", torch.Tensor.backward
    )
    torch.optim.SGD.step = sections.sync("model optimizer", torch.optim.SGD.step)  # type: ignore[method-assign]
    torch.optim.SGD.zero_grad = sections.sync(  # type: ignore[method-assign]
        "model optimizer", torch.optim.SGD.zero_grad
    )


def breakdown_child(args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``bench_peers``'s job on the path ``args.breakdown_child``, instrumented."""
    import threading

    import bench_peers  # this directory: the same job, batches and hooks

    sections = _Sections()
    outer, inner = _calibrate(sections)
    config = args.breakdown_child
    steps = args.breakdown_steps
    torch_, mlp, batches = bench_peers.build(256, steps)
    out = Path(args.job_dir)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    log = logging.getLogger("bench")

    if not args.breakdown_bare:
        _instrument(sections)
    marks: dict[str, Any] = {}
    forwards = [0]
    mlp_forward = mlp.forward
    timed_forward = sections.sync("model forward", mlp_forward)
    if args.breakdown_bare:
        timed_forward = mlp_forward

    def forward(x: Any) -> Any:
        forwards[0] += 1
        n = forwards[0]
        if n == bench_peers.WARMUP + 1:  # the first timed step starts here
            sections.reset()
            marks["start"] = (time.thread_time_ns(), time.process_time_ns(), time.perf_counter())
        elif n == steps:  # the last step's forward: steps WARMUP .. steps - 2 are done
            marks["end"] = (time.thread_time_ns(), time.process_time_ns(), time.perf_counter())
            marks["sections"] = (
                dict(sections.calls),
                dict(sections.incl),
                dict(sections.kids),
                dict(sections.kid_calls),
            )
        return timed_forward(x)

    mlp.forward = forward
    assert threading.get_ident() == sections.thread
    clock = bench_peers.Clock()
    runner = getattr(bench_peers, f"run_{config.replace('-', '_')}")
    runner(torch_, mlp, batches, clock, out, log, False)
    timed_steps = steps - 1 - bench_peers.WARMUP
    calls, incl, kids, kid_calls = marks["sections"]
    (t0, p0, w0), (t1, p1, w1) = marks["start"], marks["end"]
    return {
        "steps": timed_steps,
        "thread_ns": t1 - t0,
        "process_ns": p1 - p0,
        "wall_s": w1 - w0,
        "outer_ns": outer,
        "inner_ns": inner,
        "sections": {
            name: {
                "calls": calls[name],
                "incl": incl[name],
                "kids": kids[name],
                "kid_calls": kid_calls[name],
            }
            for name in calls
        },
    }


def _breakdown_rows(run: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per row of one run: (us per step, calls per step), the timing's own cost taken out: a
    section records ``inner`` ns more than it took, and each timed child costs its parent
    ``outer - inner`` ns that no section records."""
    n = run["steps"]
    outer, inner = run["outer_ns"], run["inner_ns"]
    rows: dict[str, tuple[float, float]] = {}
    timed_calls = 0
    own_total = 0.0
    for name, s in run["sections"].items():
        own = s["incl"] - s["kids"] - s["calls"] * inner - s["kid_calls"] * (outer - inner)
        rows[name] = (own / n / 1e3, s["calls"] / n)
        timed_calls += s["calls"]
        own_total += own
    thread = run["thread_ns"] - timed_calls * outer  # the step thread without the timing
    rows["loop (the rest)"] = ((thread - own_total) / n / 1e3, 1.0)
    rows["= step thread CPU"] = (thread / n / 1e3, 1.0)
    rows["other threads CPU"] = ((run["process_ns"] - run["thread_ns"]) / n / 1e3, 1.0)
    rows["(steps/s, wall, instrumented)"] = (n / run["wall_s"], 0.0)
    return rows


def section_breakdown(args: argparse.Namespace) -> bool:
    """Per-hook and per-collector CPU per step of the held-out job (see the module doc)."""
    import json
    import subprocess

    here = Path(__file__).resolve().parent.parent
    codes = {"": here}
    if args.compare:
        other = Path(args.compare).resolve()
        codes[f"@{other.name}"] = other
    configs = [c.strip() for c in args.breakdown_configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in BREAKDOWN_CONFIGS]
    if unknown:
        raise SystemExit(f"--breakdown-configs: unknown {unknown}; known {BREAKDOWN_CONFIGS}")
    variants = [("", False)] + ([(" bare", True)] if args.breakdown_bare else [])
    labels = [c + suffix + bare for c in configs for suffix in codes for bare, _ in variants]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    load = os.getloadavg()
    started = time.perf_counter()
    for r in range(args.rounds):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            config, _, rest = label.partition("@")
            config, bare = config.removesuffix(" bare"), label.endswith(" bare")
            code = codes["@" + rest.removesuffix(" bare") if rest else ""]
            root = Path(tempfile.mkdtemp(prefix="bench_breakdown_"))
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "--breakdown-child", config,
                "--job-dir", str(root), "--breakdown-steps", str(args.breakdown_steps),
            ]  # fmt: skip
            if bare:
                cmd.append("--breakdown-bare")
            env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
            with open(root / "stderr.txt", "w") as err:
                proc = subprocess.run(
                    cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=err, text=True
                )
            if proc.returncode != 0:
                print((root / "stderr.txt").read_text()[-3000:], file=sys.stderr)
                raise SystemExit(f"[breakdown] {label} failed")
            runs[label].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            shutil.rmtree(root, ignore_errors=True)
            rows = _breakdown_rows(runs[label][-1])
            print(
                f"# round {r + 1} {label}: step thread {rows['= step thread CPU'][0]:.0f} us, "
                f"hooks {sum(v[0] for k, v in rows.items() if k.startswith('hook ')):.0f} us",
                file=sys.stderr,
                flush=True,
            )
    if args.breakdown_json:
        Path(args.breakdown_json).write_text(json.dumps(runs, indent=1))
    med = statistics.median
    per = {label: [_breakdown_rows(run) for run in rs] for label, rs in runs.items()}
    model = {
        id(rows): sum(us for name, (us, _) in rows.items() if name.startswith("model "))
        for rows_list in per.values()
        for rows in rows_list
    }
    reference = med([m for m in model.values() if m > 0] or [1.0])
    if args.breakdown_normalize:  # every run's figures at the median model speed
        for rows_list in per.values():
            for rows in rows_list:
                scale = reference / model[id(rows)] if model[id(rows)] > 0 else 1.0
                for name, (us, calls) in list(rows.items()):
                    if not name.startswith("("):
                        rows[name] = (us * scale, calls)
    names: list[str] = []
    for label in labels:
        for rows in per[label]:
            names.extend(n for n in rows if n not in names)
    order = ("model ", "trainer ", "collector ", "hostcopy ", "bus ", "SyncHookBus", "hook ")
    order += ("loop ", "= ")
    names.sort(key=lambda n: next((i for i, p in enumerate(order) if n.startswith(p)), 99))
    print(
        f"\n[breakdown] bench_peers' job ({args.breakdown_steps} steps, the first "
        f"{args.breakdown_steps - (runs[labels[0]][0]['steps'] if runs[labels[0]] else 0)} "
        f"untimed), fresh process per run, {args.rounds} rounds; us of thread CPU per training "
        f"step, medians (calls per step in brackets); {os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start; "
        f"{time.perf_counter() - started:.0f}s"
    )
    calib = [r["outer_ns"] for rs in runs.values() for r in rs]
    print(f"timing cost taken out: {med(calib):.0f} ns per timed call")
    spread = [m for m in model.values() if m > 0]
    if spread:
        print(
            f"the model's CPU per step (forward, loss, backward, optimizer) over the runs: "
            f"{min(spread):.0f}-{max(spread):.0f} us, median {reference:.0f}"
            + (
                "; every run's figures scaled to that median (--breakdown-normalize)"
                if args.breakdown_normalize
                else ""
            )
        )
    width = max(len(n) for n in names)
    print(f"| {'row':{width}} | " + " | ".join(f"{label:>18}" for label in labels) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * 20 for _ in labels) + "|")
    for name in names:
        cells = []
        for label in labels:
            values = [rows[name] for rows in per[label] if name in rows]
            if not values:
                cells.append(f"{'–':>18}")
                continue
            us = med(v[0] for v in values)
            calls = med(v[1] for v in values)
            text = f"{us:.1f}" if name.startswith("(") else f"{us:.1f} ({calls:.2g})"
            if name.startswith(("=", "loop", "other")) or name.startswith("("):
                text = f"{us:.1f}"
            cells.append(f"{text:>18}")
        print(f"| {name:{width}} | " + " | ".join(cells) + " |")
    return True


# --------------------------------------------------------------------------- copy-out


def section_copy_out(args: argparse.Namespace) -> bool:
    """Where host copies are copied out: on the step, or by the copy-out thread (batched, or
    woken every step), after a real MLP step (see the module doc)."""
    from recis_async.hostcopy import DEFAULT_COPY_OUT_INTERVAL, HostBufferPool

    torch.set_num_threads(1)
    work = Workload(batch=args.batch or 256, width=args.width)
    columns = args.metrics or 4
    variants = {
        "on the step (copy_out_interval=None)": None,
        f"copy-out thread, every {DEFAULT_COPY_OUT_INTERVAL} s (the default)": (
            DEFAULT_COPY_OUT_INTERVAL
        ),
        "copy-out thread, every step (copy_out_interval=0)": 0.0,
    }
    steps = 400
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    ids = torch.arange(512)
    for r in range(args.rounds):
        names = list(variants)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            pool = HostBufferPool(copy_out_interval=variants[name])
            spent = 0
            t0, p0 = time.thread_time_ns(), time.process_time_ns()
            for _ in range(steps):
                loss = work.step()
                t = time.thread_time_ns()
                pool.copy(loss)
                for _ in range(columns - 1):
                    pool.copy(ids)
                pool.next_step()
                spent += time.thread_time_ns() - t
            thread = time.thread_time_ns() - t0
            other = time.process_time_ns() - p0 - thread
            pool.close()
            if pool._thread is not None:
                pool._thread.join(10)
            results[name].append((spent / steps / 1e3, other / steps / 1e3))
    load = os.getloadavg()[0]
    print(
        f"\n[copy-out] MLP 64-{args.width}-{args.width}-1, batch {work.batch}, 1 torch thread; "
        f"per step the loss and {columns - 1} columns of 512 int64 copied, {steps} steps a "
        f"run, {args.rounds} rounds alternated; {os.cpu_count()} CPUs, load average "
        f"{load:.2f} at start; us of thread CPU per step, medians (range)"
    )
    print(f"{'where':55} {'step thread: copy + next_step':>30} {'other threads':>16}")
    for name, rs in results.items():
        step_us = [x[0] for x in rs]
        other_us = [x[1] for x in rs]
        print(
            f"{name:55} {statistics.median(step_us):12.1f} ({min(step_us):.1f}-{max(step_us):.1f})"
            f"{'':5} {statistics.median(other_us):8.1f} ({min(other_us):.1f}-{max(other_us):.1f})"
        )
    return True


SECTIONS: dict[str, Section] = {
    "tracker": section_tracker,
    "tracker-job": section_tracker_job,
    "monitors": section_monitors,
    "optim": section_optim,
    "breakdown": section_breakdown,
    "copy-out": section_copy_out,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections: {', '.join(SECTIONS)}",
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds of interleaved slices")
    parser.add_argument("--seconds", type=float, default=1.5, help="seconds per slice")
    parser.add_argument(
        "--metrics", type=int, default=None, help="metrics per step (tracker: 4, tracker-job: 8)"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="MLP batch size (tracker: 2048, tracker-job: 512)"
    )
    parser.add_argument("--width", type=int, default=256, help="[tracker] MLP hidden width")
    parser.add_argument(
        "--flush-interval",
        type=float,
        default=1.0,
        help="[tracker] MLTrackerHook flush_interval (default 1.0, the hook's own default)",
    )
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument(
        "--job-steps", type=int, default=3000, help="[tracker-job] timed steps a round"
    )
    parser.add_argument(
        "--compare",
        metavar="DIR",
        help="[tracker-job] also run MlflowTracker with the code of the checkout DIR; "
        "[breakdown] every config again with that code",
    )
    parser.add_argument(
        "--breakdown-steps", type=int, default=1500, help="[breakdown] steps a run (bench_peers')"
    )
    parser.add_argument(
        "--breakdown-configs",
        default=",".join(BREAKDOWN_CONFIGS),
        help=f"[breakdown] comma-separated paths of bench_peers: {', '.join(BREAKDOWN_CONFIGS)}",
    )
    parser.add_argument(
        "--breakdown-bare",
        action="store_true",
        help="[breakdown] also run every config without the sections (the step thread's CPU "
        "as it is: a check of the timing's cost taken out)",
    )
    parser.add_argument(
        "--breakdown-normalize",
        action="store_true",
        help="[breakdown] scale each run's figures by the median model CPU per step over its "
        "own (a machine slower in one run than in another slows both alike)",
    )
    parser.add_argument("--breakdown-json", help="[breakdown] also write every run's sections here")
    parser.add_argument("--breakdown-child", help=argparse.SUPPRESS)
    parser.add_argument("--job-child", help=argparse.SUPPRESS)
    parser.add_argument("--job-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.breakdown_child:
        import json

        print(json.dumps(breakdown_child(args)))
        return 0
    if args.job_child:
        import json

        print(json.dumps(anyio.run(job_child, args, backend=args.backend)))
        return 0
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    ok = True
    for name in chosen:
        ok &= SECTIONS[name](args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
