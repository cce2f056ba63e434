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
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
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


SECTIONS: dict[str, Section] = {
    "tracker": section_tracker,
    "tracker-job": section_tracker_job,
    "monitors": section_monitors,
    "optim": section_optim,
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
        help="[tracker-job] also run MlflowTracker with the code of the checkout DIR",
    )
    parser.add_argument("--job-child", help=argparse.SUPPRESS)
    parser.add_argument("--job-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
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
