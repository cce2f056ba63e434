"""What every built-in hook costs a GPU-bound training step (issue 23), side by side in one process.

The step: an MLP of ``--depth`` layers of ``--width``^2 weights over a batch of ``--batch`` rows
already on the device, bfloat16 autocast on CUDA, SGD with momentum; large enough that the
kernels, not Python, set the step time (``--width 2048 --depth 6 --batch 16384``: about 2.5
TFLOP a step).  Where a ``DynamicEmbedding`` can keep its rows on the device, a user table
(ids on the host, as a loader gives them) feeds the MLP and ``HashTableFilterHook`` is on;
otherwise both are left out, and the output says so.

Variants, each keeping its own bus open for the whole run and taking turns:

* ``none``   the bare loop: no bus, nothing recorded (the hook-free baseline);
* ``hooks``  every built-in hook on the bus (the list is printed; ``ProfilerHook`` is left out:
  the steps it profiles are slow by design), and every step records its tensors as they are:
  ``add_metric`` of the loss and the accuracy, ``add_to_trace`` of ids, predictions (float32
  and bfloat16), labels (int64) and a 2-D slice of activations, ``add_to_ml_tracker`` of the
  loss;
* ``naive``  the same hooks, recording the way a loop without this library's care does: the
  values read on the host every step (``.item()``, ``.cpu()``) before they are recorded.

Each round gives every variant a slice of ``--steps`` steps (order rotated per round), timed
from a ``torch.cuda.synchronize()`` before the slice to one after it; a variant's ratio is its
steps/s over the ``none`` slice of the same round, and the printed figure the median over
``--rounds``.  Target (issue 23), on a GPU: ``hooks`` >= 0.98x ``none``.

    python benchmarks/bench_gpu.py [--rounds 5 --steps 200 --width 2048 --depth 6 --batch 16384]
    python benchmarks/bench_gpu.py --device cpu      # a tiny smoke run (tests/test_benchmarks.py)
    python benchmarks/bench_gpu.py --without OOMObserverHook,TraceHook   # what those cost
    python benchmarks/bench_gpu.py --switch-interval 0.0005   # the GIL handed over sooner

Each variant also prints its step thread's CPU time per step (launches, hooks, recording: on a
GPU the step is host-bound once it exceeds the device's time), and the hooks variant the step
subscribers that took the most of the loop's time (``bus.stats()``: wall time, waits included).

The trace goes to Parquet and, with ``--odps`` (the default when ``tests/odps_server.py`` is
there), to the loopback ODPS service in a separate process at nice 19, as bench_trace.py runs it;
the trackers are JSONL, and TensorBoard and MLflow where installed.  Everything is written
under a temporary folder that is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from recis_async import Hook, HookBus, add_metric, add_to_ml_tracker, add_to_trace
from recis_async.events import (
    AfterBackward,
    AfterData,
    AfterOptimizerStep,
    AfterStep,
    BeforeOptimizerStep,
    BeforeStep,
    Start,
)

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("none", "hooks", "naive")
TRACED_ROWS = 256  # rows of each step traced (a sample of the batch, as a job traces)
FIELDS = ["user_id", "pred", "pred_bf16", "label", "act"]
TYPES = ["bigint", "float", "float", "bigint", "array<float>"]


class Workload:
    """The model, its optimizer and one batch on ``device``; ``step()`` trains once."""

    def __init__(self, device: torch.device, width: int, depth: int, batch: int) -> None:
        torch.manual_seed(0)
        self.device = device
        self.table = _device_table(device)
        dim_in = width // 2
        layers: list[torch.nn.Module] = [torch.nn.Linear(dim_in + 16, width), torch.nn.ReLU()]
        for _ in range(depth - 1):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.body = torch.nn.Sequential(*layers).to(device)
        self.head = torch.nn.Linear(width, 1).to(device)
        self.model = torch.nn.ModuleDict({"body": self.body, "head": self.head})
        if self.table is not None:
            self.model["user"] = self.table
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        if self.table is not None:
            self.table.attach_optimizer(self.opt)
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 10_000, (batch,), generator=gen)  # on the host
        self.x = torch.randn(batch, dim_in, generator=gen).to(device)
        self.y = (torch.rand(batch, generator=gen) < 0.3).float().to(device)
        self.autocast = device.type == "cuda"

    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training step; returns the loss, the accuracy, predictions and activations
        (detached, on the device)."""
        if self.table is not None:
            user = self.table(self.ids.unsqueeze(1))
        else:
            user = torch.zeros(self.x.shape[0], 16, device=self.device)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
            act = self.body(torch.cat([self.x, user], dim=1))
            logits = self.head(act).squeeze(1).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        pred = torch.sigmoid(logits.detach())
        acc = ((pred > 0.5).float() == self.y).float().mean()
        return loss.detach(), acc, pred, act.detach()


def _device_table(device: torch.device) -> Any:
    """A ``DynamicEmbedding`` whose rows live on ``device``, or ``None`` where they cannot."""
    from recis_async.nn import DynamicEmbedding, EmbeddingOption, FilterHook

    table = DynamicEmbedding(
        EmbeddingOption(
            embedding_dim=16,
            shared_name="user",
            combiner="sum",
            filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 1000}),
        )
    ).to(device)
    try:
        rows = table(torch.arange(4).unsqueeze(1))
    except Exception as exc:  # said, not hidden: the rest of the benchmark still runs
        print(f"DynamicEmbedding on {device} failed: {type(exc).__name__}: {exc}")
        return None
    return table if rows.device.type == device.type else None  # cuda:0 is not cuda


def every_hook(work: Workload, out: Path, args: argparse.Namespace, odps: Any) -> list[Hook]:
    """Every built-in hook that applies (ProfilerHook left out: see the module doc)."""
    from recis_async.hooks import (
        AnomalyProfilerHook,
        CheckpointSaverHook,
        ClipGradNormHook,
        DeviceStatsHook,
        EarlyStoppingHook,
        GlobalStepWaiterHook,
        GradNormHook,
        HashTableFilterHook,
        HistorySaverHook,
        LearningRateHook,
        LoggerHook,
        LoggingTensorHook,
        MetricReportHook,
        MLTrackerHook,
        NanTensorHook,
        NvtxHook,
        OOMObserverHook,
        ReportArguments,
        StepCounterHook,
        StopAtStepHook,
        SummarySaverHook,
        TimerHook,
        TraceHook,
        TraceToOdpsHook,
    )
    from recis_async.sinks import ParquetSink
    from recis_async.trackers import JsonlTracker

    every, spill = args.log_every, out / "spill"
    hooks: list[Hook] = [
        LoggerHook(log_step=every),
        NanTensorHook(),
        StepCounterHook(every_n_steps=every),
        EarlyStoppingHook("loss", patience=100),
        TraceHook(ParquetSink(out / "trace", "gpu", "dt=1"), FIELDS, TYPES, spill_dir=spill),
        MLTrackerHook("bench", "jsonl", tracker=JsonlTracker(out / "jsonl"), spill_dir=spill),
        CheckpointSaverHook(
            out / "ckpt", save_steps=args.save_every, save_end=False, max_to_keep=1,
            model=work.model, optimizer=work.opt,
        ),
        MetricReportHook(work.model, ReportArguments(interval_step=every)),
        ClipGradNormHook(max_norm=1.0, log_steps=every),
        GradNormHook(log_steps=every),
        LearningRateHook(log_steps=every),
        SummarySaverHook(every, out / "summary"),
        HistorySaverHook(every, out / "history"),
        LoggingTensorHook(["loss", "acc"], every_n_iter=every),
        DeviceStatsHook(every_n_steps=every),
        OOMObserverHook(out / "oom"),
        NvtxHook(),
        AnomalyProfilerHook(slowdown=None, output_dir=out / "anomaly"),
        TimerHook(10 * 24 * 3600),
        StopAtStepHook(last_step=10**9),
        GlobalStepWaiterHook(0, lambda: 0, poll_interval=0.01),
    ]
    with contextlib.suppress(ImportError):
        from recis_async.hooks import ProgressBarHook

        hooks.append(ProgressBarHook(file=io.StringIO()))
    with contextlib.suppress(ImportError):
        from recis_async.trackers import TensorBoardTracker

        tb = TensorBoardTracker(out / "tb")
        hooks.append(MLTrackerHook("bench", "tensorboard", tracker=tb, spill_dir=spill))
    if importlib.util.find_spec("mlflow"):  # the child process imports it, not this one
        from recis_async.trackers import MlflowTracker

        mlflow = MlflowTracker(f"sqlite:///{out / 'mlflow.db'}")
        hooks.append(MLTrackerHook("bench", "mlflow", tracker=mlflow, spill_dir=spill))
    if odps is not None:
        hooks.append(TraceToOdpsHook(odps, FIELDS, TYPES, spill_dir=spill))
    if work.table is not None:
        hooks.append(HashTableFilterHook(every, model=work.model))
    unknown = args.without - {type(h).__name__ for h in hooks}
    if unknown:
        raise SystemExit(f"--without: no such hook on the bus: {', '.join(sorted(unknown))}")
    return [h for h in hooks if type(h).__name__ not in args.without]


class Slice(NamedTuple):
    variant: str
    steps: int
    seconds: float
    cpu_seconds: float  # the step thread's CPU time (launches, hooks, recording)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _record(work: Workload, out: tuple[torch.Tensor, ...], naive: bool) -> None:
    loss, acc, pred, act = out
    n = TRACED_ROWS
    if naive:  # read on the host every step, then recorded
        add_metric("loss", loss.item())
        add_metric("acc", acc.item())
        add_to_trace("user_id", work.ids[:n])
        add_to_trace("pred", pred[:n].cpu())
        add_to_trace("pred_bf16", pred[:n].to(torch.bfloat16).cpu())
        add_to_trace("label", work.y[:n].long().cpu())
        add_to_trace("act", act[:n, :8].float().cpu())
        add_to_ml_tracker("loss", loss.item())
    else:
        add_metric("loss", loss)
        add_metric("acc", acc)
        add_to_trace("user_id", work.ids[:n])
        add_to_trace("pred", pred[:n])
        add_to_trace("pred_bf16", pred[:n].to(torch.bfloat16))
        add_to_trace("label", work.y[:n].long())
        add_to_trace("act", act[:n, :8].float())
        add_to_ml_tracker("loss", loss)


async def _steps(work: Workload, bus: HookBus | None, first: int, n: int, naive: bool) -> None:
    for g in range(first, first + n):
        if bus is None:
            work.step()
            continue
        opts = (work.opt,)
        await bus.publish(BeforeStep(global_step=g))
        await bus.publish(AfterData(global_step=g))
        out = work.step()  # (AfterBackward and the optimizer events follow it: one call)
        await bus.publish(AfterBackward(global_step=g))
        await bus.publish(BeforeOptimizerStep(global_step=g, optimizers=opts))
        await bus.publish(AfterOptimizerStep(global_step=g, optimizers=opts))
        _record(work, out, naive)
        await bus.publish(AfterStep(global_step=g, samples=int(work.x.shape[0])))


@contextlib.asynccontextmanager
async def _variant_bus(
    name: str, work: Workload, out: Path, args: argparse.Namespace, odps: Any
) -> AsyncIterator[HookBus | None]:
    if name == "none":
        yield None
        return
    async with HookBus(handle_signals=False, flush_timeout=120) as bus:
        for hook in every_hook(work, out / name, args, odps):
            bus.add_hook(hook)
        await bus.publish(Start())
        yield bus


async def _variant(
    name: str,
    work: Workload,
    out: Path,
    args: argparse.Namespace,
    odps: Any,
    turns: MemoryObjectReceiveStream[int],
    done: MemoryObjectSendStream[Slice],
) -> None:
    """Keep this variant's bus open; run a timed slice per turn received."""
    step = 0
    async with _variant_bus(name, work, out, args, odps) as bus:
        if bus is not None and name == VARIANTS[1]:
            print("hooks:", ", ".join(sorted({type(h).__name__ for h in bus.hooks})))
        async for n in turns:
            if n < 0:  # the last turn: report where the step thread's time went
                if bus is not None and name == VARIANTS[1]:
                    _print_costs(bus, step)
                continue
            _sync(work.device)
            start, cpu = time.perf_counter(), time.thread_time()
            await _steps(work, bus, step, n, naive=name == "naive")
            _sync(work.device)
            elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
            await done.send(Slice(name, n, elapsed, cpu))
            step += n
            await anyio.sleep(0.05)  # background work of the slice gets the loop once
    await done.aclose()


async def run(args: argparse.Namespace, out: Path, odps: Any) -> dict[str, list[float]]:
    device = torch.device(args.device)
    work = Workload(device, args.width, args.depth, args.batch)
    if work.table is None:
        print(f"DynamicEmbedding rows cannot live on {device} in this build: the table and "
              "HashTableFilterHook are left out")
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    async with anyio.create_task_group() as tg:
        channels = {}
        for name in VARIANTS:
            send, receive = anyio.create_memory_object_stream[int](1)
            done_send, done_receive = anyio.create_memory_object_stream[Slice](1)
            channels[name] = (send, done_receive)
            tg.start_soon(_variant, name, work, out, args, odps, receive, done_send)
        for round_ in range(args.rounds + 1):  # round 0 warms every variant up, untimed
            order = VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]
            got: dict[str, Slice] = {}
            for name in order:
                send, done_receive = channels[name]
                await send.send(args.warmup if round_ == 0 else args.steps)
                got[name] = await done_receive.receive()
            if round_ == 0:
                continue
            base = got["none"].steps / got["none"].seconds
            for name in VARIANTS:
                rate = got[name].steps / got[name].seconds
                rates[name].append(rate)
                ratios[name].append(rate / base)
                cpu_ms[name].append(1e3 * got[name].cpu_seconds / got[name].steps)
            print(f"round {round_}: " + ", ".join(
                f"{n} {rates[n][-1]:.1f} steps/s ({ratios[n][-1]:.3f}x)" for n in VARIANTS
            ), flush=True)
        for send, _ in channels.values():
            await send.send(-1)
            await send.aclose()
    return {
        **{f"{v}/ratio": ratios[v] for v in VARIANTS},
        **{f"{v}/cpu_ms": cpu_ms[v] for v in VARIANTS},
        **{v: rates[v] for v in VARIANTS},
    }


def _print_costs(bus: HookBus, steps: int) -> None:
    """The subscribers that took the most of the loop's time, per step (``bus.stats()``)."""
    once = {"Start", "End", "BeforeTrain", "AfterTrain", "BeforeEpoch", "AfterEpoch"}
    subs = {k: v for k, v in bus.stats()["subscribers"].items() if v["event"] not in once}
    top = sorted(subs.items(), key=lambda kv: -kv[1]["total_s"])[:12]
    print(f"hooks: the costliest step subscribers over {steps} steps (µs a step, on the loop):")
    for name, s in top:
        print(f"  {1e6 * s['total_s'] / max(steps, 1):8.1f}  {name} ({s['calls']} calls)")


def _odps_server() -> tuple[subprocess.Popen[str], dict[str, Any]] | None:
    script = ROOT / "tests" / "odps_server.py"
    if not script.exists():
        return None
    proc = subprocess.Popen(
        [sys.executable, str(script), "bench_gpu", "--defer-decoding"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
    port = int(proc.stdout.readline())
    config = {
        "access_id": "bench-id", "access_key": "bench-secret", "project": "bench_gpu",
        "end_point": f"http://127.0.0.1:{port}/api", "tunnel_endpoint": f"http://127.0.0.1:{port}",
        "table_name": "gpu_trace", "partition": "dt=1",
    }  # fmt: skip
    return proc, config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5; cpu 1)")
    parser.add_argument("--steps", type=int, help="steps per slice (default 200; cpu 6)")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant (default 30; cpu 3)")
    parser.add_argument("--width", type=int, help="MLP width (default 2048; cpu 32)")
    parser.add_argument("--depth", type=int, default=6, help="MLP layers")
    parser.add_argument("--batch", type=int, help="rows per step (default 16384; cpu 512)")
    parser.add_argument("--log-every", type=int, help="hooks' cadence (default 100; cpu 3)")
    parser.add_argument("--save-every", type=int, help="checkpoint cadence (default 500; cpu 4)")
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument("--no-odps", dest="odps", action="store_false",
                        help="leave TraceToOdpsHook and the loopback ODPS service out")
    parser.add_argument("--without", type=lambda s: set(filter(None, s.split(","))),
                        default=set(), help="hook classes to leave out (comma-separated)")
    parser.add_argument("--switch-interval", type=float,
                        help="sys.setswitchinterval for the run (Python's default is 0.005 s)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)  # how long a thread may keep the GIL
    if args.device == "cuda" and not cuda:
        parser.error("--device cuda: CUDA is not available here (use --device cpu)")
    gpu = args.device == "cuda"
    for name, on_gpu, on_cpu in (
        ("rounds", 5, 1), ("steps", 200, 6), ("warmup", 30, 3), ("width", 2048, 32),
        ("batch", 16384, 512), ("log_every", 100, 3), ("save_every", 500, 4),
    ):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    if not gpu:
        torch.set_num_threads(1)
    server = _odps_server() if args.odps else None
    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu-") as tmp:
            found = anyio.run(run, args, Path(tmp), server and server[1], backend=args.backend)
    finally:
        if server is not None:
            server[0].kill()
            server[0].wait()
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"\n{name}, width {args.width} x {args.depth} layers, batch {args.batch}, "
          f"{args.rounds} rounds of {args.steps} steps, {args.backend}")
    if args.without:
        print(f"left out: {', '.join(sorted(args.without))}")
    if args.switch_interval is not None:
        print(f"GIL switch interval: {args.switch_interval} s")
    print(f"{'variant':<8} {'steps/s':>9} {'x none':>8}  {'range':<11}  step-thread CPU ms/step")
    for v in VARIANTS:
        r = found[f"{v}/ratio"]
        print(f"{v:<8} {statistics.median(found[v]):9.2f} {statistics.median(r):8.3f}  "
              f"{min(r):.3f}-{max(r):.3f}  {statistics.median(found[f'{v}/cpu_ms']):.3f}")
    ratio = statistics.median(found["hooks/ratio"])
    if gpu:
        verdict = "met" if ratio >= 0.98 else "NOT met"
        print(f"target (issue 23): every hook on >= 0.98x the hook-free steps/s: {verdict} "
              f"({ratio:.3f}x)")
    else:
        print("(cpu smoke mode: the 0.98x target is for a GPU-bound step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
