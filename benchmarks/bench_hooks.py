"""What built-in hooks cost a real torch training loop, measured side by side in one process.

Sections (``--only`` picks some, comma separated; default all):

``tracker``
    A small MLP (``torch.set_num_threads(1)``) trained inside a ``HookBus``.  Steps/s with no
    hooks, with ``MLTrackerHook(MlflowTracker)``, and with mlflow's own ``log_metric`` called
    in the loop, synchronous and with ``synchronous=False``, all against one local sqlite
    tracking store.  Variants run interleaved for ``--rounds`` rounds of ``--seconds`` each;
    the median steps/s of each is compared to the no-hook median.
    Target (issue 4): MLTrackerHook >= 0.99x no-hook.

    python benchmarks/bench_hooks.py [--only tracker] [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import torch

from recis_async import HookBus, add_to_ml_tracker
from recis_async.events import AfterData, AfterStep, BeforeStep

Section = Callable[[argparse.Namespace], bool]


# --------------------------------------------------------------------------- shared loop


class Workload:
    """The training step every variant runs: an MLP on random data, one thread."""

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

    def step(self) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


StepFn = Callable[[int, torch.Tensor], Awaitable[None] | None]


async def timed_loop(
    bus: HookBus,
    work: Workload,
    seconds: float,
    on_step: StepFn,
    *,
    warmup: float = 0.5,
    ready: Callable[[], bool] = lambda: True,
) -> float:
    """Steps/s of the workload on ``bus`` over ``seconds``, timed once ``warmup`` seconds
    passed and ``ready()`` holds (e.g. a tracker finished starting: steady state only)."""
    step = 0
    timed_from = -1
    start = 0.0
    warm_until = time.perf_counter() + warmup
    while True:
        now = time.perf_counter()
        if timed_from < 0:
            if now >= warm_until and ready():
                timed_from, start = step, now
        elif now - start >= seconds:
            return (step - timed_from) / (now - start)
        await bus.publish(BeforeStep(global_step=step))
        await bus.publish(AfterData(global_step=step))
        loss = work.step()
        result = on_step(step, loss)
        if result is not None:
            await result
        await bus.publish(AfterStep(global_step=step, samples=work.batch))
        step += 1


# --------------------------------------------------------------------------- tracker section


def _metric_values(loss: torch.Tensor, n: int) -> dict[str, float]:
    value = float(loss)
    return {"loss": value, **{f"m{i}": value * i for i in range(1, n)}}


def section_tracker(args: argparse.Namespace) -> bool:
    """MLTrackerHook(MlflowTracker) vs mlflow's log_metric (sync and async) vs no hooks."""
    try:
        import mlflow  # noqa: F401
        from mlflow import MlflowClient
    except ImportError:
        print("tracker: mlflow is not installed (pip install recis_async[mlflow]); skipped")
        return True
    from recis_async.hooks import MLTrackerHook
    from recis_async.trackers import MlflowTracker, SubprocessTracker

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_hooks_"))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("bench", artifact_location=str(root / "artifacts"))
    n_metrics = args.metrics

    async def no_hooks(work: Workload) -> float:
        async with HookBus() as bus:
            return await timed_loop(bus, work, args.seconds, lambda s, loss: None)

    def hook(process: bool) -> Callable[[Workload], Awaitable[float]]:
        async def run(work: Workload) -> float:
            tracker: Any = (
                SubprocessTracker(functools.partial(MlflowTracker, uri))
                if process
                else MlflowTracker(uri)
            )
            return await tracked(work, tracker)

        return run

    async def tracked(work: Workload, tracker: Any) -> float:
        hook = MLTrackerHook("bench", "hook", {"lr": 1e-3}, tracker=tracker)
        async with HookBus() as bus:
            bus.add_hook(hook)

            def track(step: int, loss: torch.Tensor) -> None:
                for name, value in _metric_values(loss, n_metrics).items():
                    add_to_ml_tracker(name, value)

            def started() -> bool:  # time the steady state, after the run was created
                return hook.service is not None and hook.service.stats()["batches"] > 0

            rate = await timed_loop(bus, work, args.seconds, track, ready=started)
            close_start = time.perf_counter()
        closes.append(time.perf_counter() - close_start)
        return rate

    def direct(synchronous: bool) -> Callable[[Workload], Awaitable[float]]:
        async def run(work: Workload) -> float:
            run_id = client.create_run(
                experiment, run_name=f"direct-sync={synchronous}"
            ).info.run_id
            client.log_param(run_id, "lr", 1e-3)
            pending: list[Any] = []

            def log(step: int, loss: torch.Tensor) -> None:
                for name, value in _metric_values(loss, n_metrics).items():
                    op = client.log_metric(run_id, name, value, step=step, synchronous=synchronous)
                    if op is not None:
                        pending.append(op)

            async with HookBus() as bus:
                rate = await timed_loop(bus, work, args.seconds, log)
            for op in pending:  # mlflow's async queue must drain too (not timed)
                op.wait()
            client.set_terminated(run_id)
            return rate

        return run

    closes: list[float] = []
    variants: dict[str, Callable[[Workload], Awaitable[float]]] = {
        "no hooks": no_hooks,
        "MLTrackerHook(MlflowTracker)": hook(False),
        "MLTrackerHook(SubprocessTracker(Mlflow))": hook(True),
        "mlflow log_metric synchronous": direct(True),
        "mlflow log_metric synchronous=False": direct(False),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    work = Workload()
    for _ in range(args.rounds):
        for name, variant in variants.items():

            async def go(variant: Callable[[Workload], Awaitable[float]] = variant) -> float:
                return await variant(work)

            rates[name].append(anyio.run(go, backend=args.backend))

    base = statistics.median(rates["no hooks"])
    print(
        f"\n[tracker] {n_metrics} metrics/step, MLP 64-256-256-1, batch {work.batch}, "
        f"1 thread, {args.backend}, {args.rounds} rounds x {args.seconds}s, sqlite store"
    )
    print(f"{'variant':40} {'steps/s (median)':>17} {'ratio':>7}   rounds")
    for name, values in rates.items():
        med = statistics.median(values)
        spread = " ".join(f"{v:.0f}" for v in values)
        print(f"{name:40} {med:17.1f} {med / base:6.3f}x   {spread}")
    ratio = statistics.median(rates["MLTrackerHook(MlflowTracker)"]) / base
    print(f"MLTrackerHook close (final flush + FINISHED), median: {statistics.median(closes):.3f}s")
    ok = ratio >= 0.99
    print(f"target MLTrackerHook >= 0.99x no hooks: {ratio:.3f}x {'met' if ok else 'NOT met'}")
    return ok


# --------------------------------------------------------------------------- main

SECTIONS: dict[str, Section] = {
    "tracker": section_tracker,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections: {', '.join(SECTIONS)}",
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per variant run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant")
    parser.add_argument("--metrics", type=int, default=4, help="tracked metrics per step")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args(argv)
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
