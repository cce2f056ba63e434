"""The same small training job on every path a user may take, side by side.

The job: an MLP (64 -> ``--hidden`` -> ``--hidden`` -> 1, batch 256, SGD, one thread: a
~4 ms step on the project's VM) over ``--steps`` pre-built batches in one epoch, with the loss
logged every 50 steps, a progress bar (tqdm, to the run's stderr file), the loss recorded every
step to a local file, and one checkpoint at the end.  Each path does that its own way:

* ``plain``          a ``for`` loop: ``logging`` every 50 steps, ``tqdm``, ``loss.item()``
                     written to a file every step, ``torch.save`` at the end
* ``plain-again``    the same, as a config of its own: its ratio to ``plain`` is the
                     measurement's own noise (process to process), the resolution the other
                     ratios are read at (the A/A row)
* ``trainer``        this library's ``Trainer``: its logger (``log_steps=50``), a
                     ``ProgressBarHook``, ``MLTrackerHook`` (JSONL) fed ``add_to_ml_tracker``,
                     its checkpoint at the end
* ``async-loop``     an own loop on ``HookBus``: ``LoggerHook``, ``ProgressBarHook``,
                     ``MLTrackerHook`` (JSONL), ``CheckpointSaverHook`` at the end
* ``sync-loop``      the same loop on ``SyncHookBus``
* ``lightning``      ``self.log("loss")`` into a ``CSVLogger`` every step, Lightning's progress
                     bar, a callback printing every 50 steps, ``ModelCheckpoint`` at the end
* ``hf``             ``transformers.Trainer``: ``logging_steps=50``, its progress bar, the
                     model writing each step's loss to a file, a checkpoint at the last step
* ``ignite``         ``Engine``: ``ProgressBar``, handlers logging every 50 steps and writing
                     the loss every step, ``Checkpoint`` at the end
* ``<framework>+adapter``  the same job with the framework's adapter carrying
                     ``TraceHook(ParquetSink)`` (the batch's 256 ids every step) and
                     ``MLTrackerHook`` (the loss every step)

Every run is a fresh process; each repetition runs every config once, in an order rotated
from one repetition to the next.  A step's time is the time between two consecutive forward
calls of the model (the same clock on every path, whatever the framework does around it); the
first 50 steps are warm-up.  Printed per config, medians over repetitions (ranges in
brackets): steps/s over the ``plain`` run's of the same repetition; the process's CPU time
per step (all threads) over ``plain``'s -- the cost that contention on a shared machine
disturbs least; that CPU time less the model's own (its forward, loss, backward and optimizer
calls, timed on the thread's CPU clock in every path alike), in µs per step: what the path
itself costs, free of the model's own variation from run to run; step p50 / p99 in ms;
process wall time and import time in s (start to the end of the imports the path needs);
peak RSS in MB.  Then, per repetition, each path's CPU besides the model over the plain loop's,
and what each adapter adds to its framework's step: on the step thread (its own CPU clock:
the adapter's callbacks, the bus and the hooks' work on the step), in the whole process (the
hooks' background threads too, which run beside the step on another core) and to the step's
p50, in µs and in % of the framework's step.

``--hidden`` sets the step: the issue's job is a ~4 ms step (``--hidden 384`` on the 2-core
VM of 2026-11; the default 256 was ~3.5 ms on the VM it was written on, ~1.8 ms there).

``--paired BLOCKS`` measures what an adapter adds to its framework's step inside one process
instead, where fresh processes cannot resolve it (each runs at its own speed; the frameworks'
own work besides the model moves with it by more than the adapter costs): per framework
config, ``--reps`` processes, each running one job not counted (the process's one-off costs:
imports, the first full garbage collections), then BLOCKS jobs without the adapter
alternated with BLOCKS with it (``<framework>+adapter``; a bare ``<framework>``: without it
on both sides, the A/A).  Each job's step-thread CPU besides the model is read at that job's
own speed (as a share of its model time); printed per config: the median over every pair, in
µs and in % of the framework's step p50, the 95 % interval of that median, and the step
thread's garbage collection a step on each side.  With ``--compare DIR`` as well, side ``a``
of ``<framework>+adapter`` runs the adapter too, with the ``recis_async`` of the checkout
``DIR`` (both packages loaded in the process, each job run with its side's): what a change
costs or saves the adapter's step.  The step thread's CPU in the library's own code alone
(the adapter's callbacks, the bus and hooks inside them, the model's collector calls) is
printed beside it: free of the framework's and the model's variation, it resolves a few µs.

    python benchmarks/bench_peers.py [--reps 6] [--steps 1500] [--only trainer,own,...]
    python benchmarks/bench_peers.py --quick          # every config once, a few steps
    python benchmarks/bench_peers.py --only trainer,own --compare <checkout>  # before/after
    python benchmarks/bench_peers.py --paired 6 --reps 3 --steps 400 --only ignite,ignite+adapter
    python benchmarks/bench_peers.py --paired 6 --reps 3 --steps 400 --only ignite+adapter \
        --compare <checkout>     # the adapter with that code (a) and with this one (b)
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # before the heavy imports: the child's import time counts from here

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BATCH = 256
FEATURES = 64
LOG_EVERY = 50
WARMUP = 50

CONFIGS = (
    "plain",
    "plain-again",
    "trainer",
    "async-loop",
    "sync-loop",
    "lightning",
    "lightning+adapter",
    "hf",
    "hf+adapter",
    "ignite",
    "ignite+adapter",
)

#: ``--only`` names standing for several configs
ALIASES = {"own": ["async-loop", "sync-loop"]}


# --------------------------------------------------------------------------- the child
class Clock:
    """Times of the model's training forward calls: wall clock, and the CPU time of the whole
    process (every thread: the hooks' workers count) -- which a busy machine disturbs far less
    than wall time."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.thread: list[float] = []  # the step thread's own CPU (the background threads' not)
        self.model: list[int] = []  # the model's own thread CPU so far, ns (see time_the_model)
        self.model_ns = 0
        self.gc: list[int] = []  # the step thread's garbage collection so far, ns
        self.gc_ns = 0
        self.gc_started = 0
        self.ours: list[int] = []  # the step thread's CPU in this library's code so far, ns
        # (--paired --compare: see time_our_code)
        self.ours_ns = 0
        self.in_ours = False

    def count_gc(self) -> None:
        """Time this thread's garbage collections into ``gc_ns``: a full one walks the whole
        heap that torch and a framework import, so a few in a run are a share of its steps'
        time that moves from run to run."""
        import gc
        import threading

        thread = threading.get_ident()

        def timed(phase: str, info: dict[str, int]) -> None:
            if threading.get_ident() != thread:
                return
            if phase == "start":
                self.gc_started = time.thread_time_ns()
            else:
                self.gc_ns += time.thread_time_ns() - self.gc_started

        gc.callbacks.append(timed)


def time_the_model(torch: Any, mlp: Any, clock: Clock) -> None:
    """Count the thread CPU of the model's own work -- the MLP's forward, the loss, backward,
    the optimizer's step and zero_grad -- into ``clock.model_ns``, whatever path calls them:
    what is left of a step's CPU is the path's own (hooks, loggers, the framework's loop),
    which the model's variation from run to run does not blur.  (Each timed call costs two
    reads of the thread clock, the same on every path.)  Lightning hands the optimizer's
    ``step`` a closure running its whole training step (the forward and backward, its logging,
    the callbacks): that closure runs first, outside the optimizer's timing, so that the
    framework's own work there is not counted as the model's, nor the model's calls in it
    twice."""
    import functools

    def timed(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.thread_time_ns()
            try:
                return fn(*a, **k)
            finally:
                clock.model_ns += time.thread_time_ns() - t

        return wrapper

    def timed_step(fn: Any) -> Any:
        inner = timed(fn)

        @functools.wraps(fn)
        def wrapper(self: Any, closure: Any = None, **k: Any) -> Any:
            if closure is None:
                return inner(self, **k)
            with torch.enable_grad():  # as the optimizer runs it, once, before its update
                loss = closure()
            return inner(self, lambda: loss, **k)

        return wrapper

    mlp.forward = timed(mlp.forward)
    torch.nn.functional.mse_loss = timed(torch.nn.functional.mse_loss)
    torch.Tensor.backward = timed(torch.Tensor.backward)
    torch.optim.SGD.step = timed_step(torch.optim.SGD.step)
    torch.optim.SGD.zero_grad = timed(torch.optim.SGD.zero_grad)


def build(hidden: int, steps: int) -> tuple[Any, Any, list[dict[str, Any]]]:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(steps):
        x = torch.randn(BATCH, FEATURES, generator=g)
        batches.append(
            {"x": x, "y": x[:, :1].clone(), "ids": torch.arange(i * BATCH, (i + 1) * BATCH)}
        )
    return torch, mlp, batches


def make_net(
    torch: Any,
    mlp: Any,
    clock: Clock,
    record: Any = None,
    trace: bool = False,
    whole_batch: bool = False,
) -> Any:
    """The model as every path runs it: ``forward(x, y, ids) -> {"loss": ...}``, stamping the
    clock; ``record(loss)`` per training step; ``trace``: the ids to the trace, the loss to
    the tracker (adapter configs); ``whole_batch``: ``forward(batch)`` instead, the
    ``Trainer``'s convention (``model(batch)``), as a user writing for it would."""
    from recis_async import add_to_ml_tracker, add_to_trace

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = mlp

        def forward(self, x: Any, y: Any, ids: Any) -> dict[str, Any]:
            if self.training:
                clock.times.append(time.perf_counter())
                clock.cpu.append(time.process_time())
                clock.thread.append(time.thread_time())
                clock.model.append(clock.model_ns)
                clock.gc.append(clock.gc_ns)
                clock.ours.append(clock.ours_ns)
            loss = torch.nn.functional.mse_loss(self.mlp(x), y)
            if self.training:
                if record is not None:
                    record(loss)
                if trace:
                    add_to_trace("id", ids)
                    add_to_ml_tracker("loss", loss)
            return {"loss": loss}

    class BatchNet(Net):
        def forward(self, batch: dict[str, Any]) -> dict[str, Any]:  # type: ignore[override]
            return super().forward(**batch)

    return BatchNet() if whole_batch else Net()


def child(config: str, out: Path, steps: int, hidden: int) -> dict[str, Any]:
    import logging

    torch, mlp, batches = build(hidden, steps)
    import recis_async  # noqa: F401

    framework = config.split("+")[0]
    if framework == "lightning":
        import lightning.pytorch  # noqa: F401
    elif framework == "hf":
        import transformers  # noqa: F401
    elif framework == "ignite":
        import ignite.engine  # noqa: F401
    imported = time.perf_counter() - _T0
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    log = logging.getLogger("bench")
    clock = Clock()
    time_the_model(torch, mlp, clock)
    clock.count_gc()
    adapter = config.endswith("+adapter")
    runner = globals()[f"run_{framework.replace('-', '_')}"]
    runner(torch, mlp, batches, clock, out, log, adapter)
    times = clock.times
    gaps = sorted(b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1 :], strict=False))
    return {
        "config": config,
        "steps_per_s": (len(times) - WARMUP - 1) / (times[-1] - times[WARMUP]),
        "cpu_ms": 1e3 * (clock.cpu[-1] - clock.cpu[WARMUP]) / (len(times) - WARMUP - 1),
        "model_ms": 1e-6 * (clock.model[-1] - clock.model[WARMUP]) / (len(times) - WARMUP - 1),
        "thread_ms": 1e3 * (clock.thread[-1] - clock.thread[WARMUP]) / (len(times) - WARMUP - 1),
        "gc_ms": 1e-6 * (clock.gc[-1] - clock.gc[WARMUP]) / (len(times) - WARMUP - 1),
        "p50_ms": 1e3 * gaps[len(gaps) // 2],
        "p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))],
        "import_s": imported,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steps": len(times),
    }


def paired_child(
    config: str, out: Path, steps: int, hidden: int, blocks: int, other: Path | None = None
) -> dict[str, Any]:
    """A framework's job without its adapter (side ``a``) and, for ``<framework>+adapter``,
    with it (side ``b``; for a bare ``<framework>``, without it again: the A/A), ``blocks``
    times each, alternated (the order swapped from one pair to the next) in this one process.
    The process's own speed -- its memory layout, its hash seed, the machine's minute -- is
    then the same on both sides, so a pair's difference is the adapter's, not that of two
    processes.  Each block is a whole job over the same batches (its own model wrapper,
    optimizer, framework objects, bus and outputs); per block: the step thread's CPU besides
    the model, and the step p50.

    ``other`` (``--compare``): side ``a`` of ``<framework>+adapter`` runs the adapter too,
    with the ``recis_async`` of that checkout (both packages are loaded; each job runs with
    its side's modules in ``sys.modules``): what a change of this code costs or saves the
    adapter's step."""
    import logging

    torch, mlp, batches = build(hidden, steps)
    import recis_async  # noqa: F401

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    log = logging.getLogger("bench")
    clock = Clock()
    time_the_model(torch, mlp, clock)  # once: it wraps the model's functions for good
    clock.count_gc()
    framework = config.split("+")[0]
    runner = globals()[f"run_{framework}"]
    adapter = config.endswith("+adapter")
    sides = {"a": adapter and other is not None, "b": adapter}
    # A first job, not counted: the process's one-off costs (the framework's and the
    # adapter's lazy imports, the first full garbage collection of what they allocated) are
    # not a step's; the fresh-process runs show them (import time, process wall time).
    (out / "first").mkdir()
    runner(torch, mlp, batches, clock, out / "first", log, sides["b"])
    code = {"a": _package_modules(), "b": _package_modules()}
    if other is not None and adapter:  # the other checkout's package, and its first job
        code["a"] = _other_package(other)
        (out / "first_a").mkdir()
        runner(torch, mlp, batches, clock, out / "first_a", log, True)
        code["a"] = _package_modules()
    pairs: list[dict[str, float]] = []
    for block in range(blocks):
        pair: dict[str, float] = {}
        for side in ("a", "b") if block % 2 == 0 else ("b", "a"):
            _use_package(code[side])
            if other is not None:  # both sides run the library's code: timed alike
                time_our_code(clock, framework)  # (once per package)
            clock.times, clock.cpu, clock.thread, clock.model, clock.gc = [], [], [], [], []
            clock.ours = []
            where = out / f"{block}{side}"
            where.mkdir()
            runner(torch, mlp, batches, clock, where, log, sides[side])
            n = len(clock.times) - WARMUP - 1
            pair[f"{side}_gc_us"] = 1e-3 * (clock.gc[-1] - clock.gc[WARMUP]) / n
            if other is not None:
                pair[f"{side}_ours_us"] = 1e-3 * (clock.ours[-1] - clock.ours[WARMUP]) / n
            thread = (clock.thread[-1] - clock.thread[WARMUP]) / n
            model = 1e-9 * (clock.model[-1] - clock.model[WARMUP]) / n
            times = clock.times[WARMUP:]
            gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
            pair[f"{side}_us"] = 1e6 * (thread - model)
            pair[f"{side}_model_us"] = 1e6 * model
            pair[f"{side}_p50_ms"] = 1e3 * gaps[len(gaps) // 2]
        pairs.append(pair)
    files = {side: str(modules["recis_async"].__file__) for side, modules in code.items()}
    return {"config": config, "pairs": pairs, "code": files}


# the adapter's class, by framework, and its methods a framework calls back (the bus and the
# hooks run inside them)
_ADAPTERS = {
    "ignite": ("recis_async.adapters.ignite", "IgniteAdapter"),
    "lightning": ("recis_async.adapters.lightning", "RecisCallback"),
    "hf": ("recis_async.adapters.transformers", "RecisTrainerCallback"),
}
_IGNITE_HANDLERS = (
    "_started _epoch_started _batch_started _batch_completed _iteration_completed "
    "_epoch_completed _terminated _completed _failed"
).split()


def time_our_code(clock: Clock, framework: str) -> None:
    """Count the step thread's CPU in this library's code into ``clock.ours_ns``: the
    adapter's callbacks (the bus and the hooks run inside them; the Hugging Face adapter's
    forward hooks too) and the model's calls of the collectors.  A change of the library's
    code shows there free of the framework's and the model's variation from job to job
    (what it does to their speed does not: the step's figure has that).  Wraps the
    ``recis_async`` in ``sys.modules`` now, once per package (each call costs two reads of
    the thread clock, on both sides of a ``--compare`` alike)."""
    import functools
    import importlib

    package = sys.modules["recis_async"]
    if getattr(package, "_bench_timed", False):
        return
    package._bench_timed = True  # type: ignore[attr-defined]

    def timed(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            if clock.in_ours:  # called from our own code: counted there
                return fn(*a, **k)
            clock.in_ours = True
            t = time.thread_time_ns()
            try:
                return fn(*a, **k)
            finally:
                clock.ours_ns += time.thread_time_ns() - t
                clock.in_ours = False

        return wrapper

    for name in ("add_metric", "add_to_trace", "add_to_ml_tracker"):
        setattr(package, name, timed(getattr(package, name)))
    module, name = _ADAPTERS[framework]
    cls = getattr(importlib.import_module(module), name)
    names = [n for n in vars(cls) if n.startswith("on_")] + (
        _IGNITE_HANDLERS if framework == "ignite" else ["_before_forward", "_took_forward"]
    )
    for method in names:
        if callable(vars(cls).get(method)):
            setattr(cls, method, timed(vars(cls)[method]))


def _package_modules() -> dict[str, Any]:
    """The ``recis_async`` modules loaded now (a package's, for :func:`_use_package`)."""
    return {
        name: module
        for name, module in sys.modules.items()
        if name == "recis_async" or name.startswith("recis_async.")
    }


def _use_package(modules: dict[str, Any]) -> None:
    """Make ``modules`` the ``recis_async`` that imports find: the jobs import what they use
    when they start (``from recis_async... import ...``), and a submodule not loaded yet is
    found through the package's own ``__path__``."""
    for name in list(_package_modules()):
        del sys.modules[name]
    sys.modules.update(modules)


def _other_package(root: Path) -> dict[str, Any]:
    """Import the ``recis_async`` of the checkout ``root`` beside the one loaded (whose
    modules leave ``sys.modules`` until :func:`_use_package` puts them back)."""
    import importlib

    _use_package({})
    sys.path.insert(0, str(root))
    try:
        importlib.invalidate_caches()
        package = importlib.import_module("recis_async")
    finally:
        sys.path.remove(str(root))
    if not str(package.__file__).startswith(str(root)):
        raise RuntimeError(f"--compare {root}: imported {package.__file__} instead")
    return _package_modules()


def _trace_hooks(out: Path) -> list[Any]:
    from recis_async.hooks import MLTrackerHook, TraceHook
    from recis_async.sinks import ParquetSink
    from recis_async.trackers import JsonlTracker

    return [
        TraceHook(ParquetSink(out, "trace", rank=0), ["id"], ["bigint"], spill_dir=out / "spill"),
        MLTrackerHook(
            "bench", "peers", tracker=JsonlTracker(out / "ml"), spill_dir=out / "ml_spill"
        ),
    ]


def _plain_loop(torch: Any, mlp: Any, batches: Any, clock: Clock, out: Path, log: Any) -> None:
    from tqdm import tqdm

    net = make_net(torch, mlp, clock)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    net.train()
    with open(out / "loss.txt", "w") as f:
        for step, batch in enumerate(tqdm(batches, mininterval=0.1)):
            loss = net(**batch)["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            f.write(f"{step}\t{loss.item()}\n")
            if step % LOG_EVERY == 0:
                log.info("step %d loss %.4f", step, loss.item())
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, out / "final.pt")


def run_plain(*a: Any) -> None:
    _plain_loop(*a[:6])


run_plain_again = run_plain


def run_trainer(
    torch: Any, mlp: Any, batches: Any, clock: Clock, out: Path, log: Any, _: bool
) -> None:
    import anyio

    from recis_async import MLTrackerHook, ProgressBarHook, Trainer, TrainingArguments
    from recis_async.trackers import JsonlTracker

    net = make_net(torch, mlp, clock, record=_loss_recorder(), whole_batch=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    args = TrainingArguments(
        output_dir=str(out / "ckpt"), log_steps=LOG_EVERY, save_steps=10 * len(batches)
    )
    hooks = [
        ProgressBarHook(),
        MLTrackerHook(
            "bench", "peers", tracker=JsonlTracker(out / "ml"), spill_dir=out / "ml_spill"
        ),
    ]
    trainer = Trainer(
        net, args, train_dataset=batches, hooks=hooks, dense_optimizers=(optimizer, None)
    )
    anyio.run(trainer.train)


def _loss_recorder() -> Any:
    """``record(loss)``: the step's loss to the tracker (imported once, as a user's module
    would: an import statement run every step costs the step ~15 µs)."""
    from recis_async import add_to_ml_tracker

    def record(loss: Any) -> None:
        add_to_ml_tracker("loss", loss)

    return record


def _loop_hooks(torch: Any, net: Any, optimizer: Any, out: Path, steps: int) -> list[Any]:
    from recis_async import CheckpointSaverHook, LoggerHook, MLTrackerHook, ProgressBarHook
    from recis_async.trackers import JsonlTracker

    return [
        LoggerHook(log_step=LOG_EVERY),
        ProgressBarHook(total=steps),
        MLTrackerHook(
            "bench", "peers", tracker=JsonlTracker(out / "ml"), spill_dir=out / "ml_spill"
        ),
        CheckpointSaverHook(
            str(out / "ckpt"), save_steps=10 * steps, model=net, optimizer=optimizer
        ),
    ]


def run_async_loop(
    torch: Any, mlp: Any, batches: Any, clock: Clock, out: Path, log: Any, _: bool
) -> None:
    import anyio

    from recis_async import HookBus, add_metric
    from recis_async.events import AfterStep, BeforeStep, Start

    net = make_net(torch, mlp, clock, record=_loss_recorder())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    async def main() -> None:
        async with HookBus() as bus:
            for hook in _loop_hooks(torch, net, optimizer, out, len(batches)):
                bus.add_hook(hook)
            await bus.publish(Start())
            for step, batch in enumerate(batches):
                await bus.publish(BeforeStep(global_step=step, local_step=step))
                loss = net(**batch)["loss"]
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                add_metric("loss", loss)
                await bus.publish(AfterStep(global_step=step, local_step=step, samples=BATCH))
                if bus.should_stop:
                    break

    anyio.run(main)


def run_sync_loop(
    torch: Any, mlp: Any, batches: Any, clock: Clock, out: Path, log: Any, _: bool
) -> None:
    from recis_async import add_metric
    from recis_async.events import AfterStep, BeforeStep, Start
    from recis_async.syncbus import SyncHookBus

    net = make_net(torch, mlp, clock, record=_loss_recorder())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    with SyncHookBus() as bus:
        for hook in _loop_hooks(torch, net, optimizer, out, len(batches)):
            bus.add_hook(hook)
        bus.publish(Start())
        for step, batch in enumerate(batches):
            bus.publish(BeforeStep(global_step=step, local_step=step))
            loss = net(**batch)["loss"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            add_metric("loss", loss)
            bus.publish(AfterStep(global_step=step, local_step=step, samples=BATCH))
            if bus.should_stop:
                break


def run_lightning(
    torch: Any, mlp: Any, batches: Any, clock: Clock, out: Path, log: Any, adapter: bool
) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    net = make_net(torch, mlp, clock, trace=adapter)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.net(**batch)["loss"]
            self.log("loss", loss, on_step=True, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Every50(pl.Callback):
        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
        ) -> None:
            if i % LOG_EVERY == 0:
                log.info("step %d loss %.4f", i, outputs["loss"].item())

    callbacks: list[Any] = [Every50(), ModelCheckpoint(dirpath=out / "ckpt")]
    if adapter:
        from recis_async.adapters.lightning import RecisCallback

        callbacks.insert(0, RecisCallback(_trace_hooks(out)))
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=callbacks,
        logger=CSVLogger(out / "csv"),
        log_every_n_steps=1,
        default_root_dir=str(out),
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(batches, batch_size=None))


def run_hf(
    torch: Any, mlp: Any, batches: Any, clock: Clock, out: Path, log: Any, adapter: bool
) -> None:
    import transformers

    f = open(out / "loss.txt", "w")  # noqa: SIM115  (closed below)
    counter = iter(range(1 << 62))

    def record(loss: Any) -> None:
        f.write(f"{next(counter)}\t{loss.item()}\n")

    net = make_net(torch, mlp, clock, record=record, trace=adapter)

    class Rows(torch.utils.data.Dataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return len(batches) * BATCH

        def __getitem__(self, i: int) -> Any:
            b = batches[i // BATCH]
            return {"x": b["x"][i % BATCH], "y": b["y"][i % BATCH], "ids": b["ids"][i % BATCH]}

    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=BATCH,
        num_train_epochs=1,
        learning_rate=0.01,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=LOG_EVERY,
        save_strategy="steps",
        save_steps=len(batches),
        report_to=[],
        use_cpu=True,
        disable_tqdm=False,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
    )
    callbacks: list[Any] = []
    if adapter:
        from recis_async.adapters.transformers import RecisTrainerCallback

        callbacks.append(RecisTrainerCallback(_trace_hooks(out)))
    trainer = transformers.Trainer(model=net, args=args, train_dataset=Rows(), callbacks=callbacks)
    trainer.train()
    f.close()


def run_ignite(
    torch: Any, mlp: Any, batches: Any, clock: Clock, out: Path, log: Any, adapter: bool
) -> None:
    from ignite.engine import Engine, Events
    from ignite.handlers import Checkpoint, DiskSaver, ProgressBar

    net = make_net(torch, mlp, clock, trace=adapter)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def update(engine: Engine, batch: Any) -> Any:
        loss = net(**batch)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    engine = Engine(update)
    if adapter:
        from recis_async.adapters.ignite import attach

        attach(engine, _trace_hooks(out))
    f = open(out / "loss.txt", "w")  # noqa: SIM115  (closed below)
    engine.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: f.write(f"{e.state.iteration}\t{e.state.output.item()}\n"),
    )
    engine.add_event_handler(
        Events.ITERATION_COMPLETED(every=LOG_EVERY),
        lambda e: log.info("step %d loss %.4f", e.state.iteration, e.state.output.item()),
    )
    ProgressBar(persist=True).attach(engine)
    saver = Checkpoint({"model": net, "optimizer": optimizer}, DiskSaver(str(out / "ckpt")))
    engine.add_event_handler(Events.COMPLETED, saver)
    engine.run(batches, max_epochs=1)
    f.close()


# --------------------------------------------------------------------------- the driver
def run_one(label: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``label``: a config, or ``config@compare`` for the code of ``--compare``."""
    config, _, other = label.partition("@")
    code = Path(args.compare).resolve() if other else ROOT
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        env = {
            **os.environ,
            # the code measured first, then the caller's path (packages installed there)
            "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        argv = [sys.executable, __file__, "--child", config, "--out", tmp]
        argv += ["--steps", str(args.steps), "--hidden", str(args.hidden)]
        if args.paired:
            argv += ["--paired", str(args.paired)]
            if args.compare:
                argv += ["--compare", str(Path(args.compare).resolve())]
        started = time.perf_counter()
        with open(Path(tmp) / "stderr.txt", "w") as err:
            proc = subprocess.run(
                argv, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=err, text=True
            )
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            tail = (Path(tmp) / "stderr.txt").read_text()[-3000:]
            raise RuntimeError(f"{config} exited with {proc.returncode}:\n{tail}")
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        result["wall_s"] = wall
        return result


def available(config: str) -> bool:
    import importlib.util

    module = {"lightning": "lightning", "hf": "transformers", "ignite": "ignite"}.get(
        config.split("+")[0]
    )
    return module is None or importlib.util.find_spec(module) is not None


def report(results: dict[str, list[dict[str, Any]]], reps: int) -> str:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    base = results["plain"]
    lines = [
        "| path | steps/s ÷ plain (range) | CPU ms/step ÷ plain (range) "
        "| CPU µs/step besides the model (range) | step p50 / p99 ms "
        "| process wall s | import s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config, runs in results.items():
        ratios = [r["steps_per_s"] / b["steps_per_s"] for r, b in zip(runs, base, strict=False)]
        cpu = [r["cpu_ms"] / b["cpu_ms"] for r, b in zip(runs, base, strict=False) if "cpu_ms" in r]
        cpu_cell = f"{med(cpu):.3f} ({min(cpu):.2f}–{max(cpu):.2f})" if cpu else "–"
        rest = [1e3 * (r["cpu_ms"] - r["model_ms"]) for r in runs if "model_ms" in r]
        rest_cell = f"{med(rest):.0f} ({min(rest):.0f}–{max(rest):.0f})" if rest else "–"
        lines.append(
            f"| {config} | {med(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f}) | {cpu_cell} "
            f"| {rest_cell} "
            f"| {med([r['p50_ms'] for r in runs]):.2f} / {med([r['p99_ms'] for r in runs]):.2f} "
            f"| {med([r['wall_s'] for r in runs]):.1f} | {med([r['import_s'] for r in runs]):.1f} "
            f"| {med([r['rss_mb'] for r in runs]):.0f} |"
        )
    return "\n".join(lines)


def paired(results: dict[str, list[dict[str, Any]]]) -> str:
    """The CPU a step costs besides the model, µs, compared within each repetition (its configs
    ran in the same minutes, in a rotated order): each config minus the plain loop (the mean of
    ``plain`` and ``plain-again`` where both ran; ``plain-again`` itself minus ``plain``: the
    A/A noise), and, with ``--compare``, minus the same config on the other code.  Each cell:
    the median, then every repetition's value."""

    def besides(run: dict[str, Any]) -> float:
        return 1e3 * (run["cpu_ms"] - run["model_ms"])

    def cell(values: list[float]) -> str:
        if not values:
            return "–"
        return f"{statistics.median(values):+.0f} ({', '.join(f'{v:+.0f}' for v in values)})"

    plain = [besides(r) for r in results["plain"]]
    again = [besides(r) for r in results.get("plain-again", [])]
    base = [(a + b) / 2 for a, b in zip(plain, again, strict=False)] if again else plain
    lines = [
        "| path | minus the plain loop | minus its --compare code |",
        "|---|---|---|",
    ]
    for config, runs in results.items():
        if config == "plain" or "@" in config:
            continue
        mine = [besides(r) for r in runs]
        reference = plain if config == "plain-again" else base
        other = next((v for k, v in results.items() if k.startswith(config + "@")), [])
        before = [besides(r) for r in other]
        lines.append(
            f"| {config} | {cell([m - p for m, p in zip(mine, reference, strict=False)])} "
            f"| {cell([m - b for m, b in zip(mine, before, strict=False)])} |"
        )
    return "\n".join(lines)


def adapters(results: dict[str, list[dict[str, Any]]]) -> str:
    """What each adapter adds to its framework's step, within each repetition (the two runs
    of the same minutes): on the step thread (its CPU besides the model's: the adapter's
    callbacks, the bus, the hooks' work on the step), in the whole process (every thread: the
    Parquet writer's encoding, the tracker's worker), and to the step's p50, each in µs and in
    % of the framework's step p50.  Each cell: the median, then every repetition's value."""

    def cell(values: list[float], step_ms: float) -> str:
        median = statistics.median(values)
        every = ", ".join(f"{v:+.0f}" for v in values)
        return f"{median:+.0f} µs = {median / step_ms / 10:+.1f} % ({every})"

    lines = [
        "| adapter | step thread | whole process | step p50 |",
        "|---|---|---|---|",
    ]
    for config, runs in results.items():
        framework = config.removesuffix("+adapter")
        base = results.get(framework)
        if framework == config or "@" in config or not base:
            continue
        pairs = list(zip(runs, base, strict=False))
        step_ms = statistics.median(b["p50_ms"] for b in base)
        thread = [
            1e3 * ((r["thread_ms"] - r["model_ms"]) - (b["thread_ms"] - b["model_ms"]))
            for r, b in pairs
        ]
        process = [
            1e3 * ((r["cpu_ms"] - r["model_ms"]) - (b["cpu_ms"] - b["model_ms"])) for r, b in pairs
        ]
        p50 = [1e3 * (r["p50_ms"] - b["p50_ms"]) for r, b in pairs]
        cells = " | ".join(cell(values, step_ms) for values in (thread, process, p50))
        lines.append(f"| {config} | {cells} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def median_interval(values: list[float]) -> tuple[float, float]:
    """A 95 % interval of the median of ``values``, free of any assumed distribution: the
    order statistics between which the median lies with probability >= 0.95 (the sign test's
    binomial), or the whole range where there are too few values for that."""
    ordered, n = sorted(values), len(values)
    k, below = 0, 0.0  # k: how many values may lie below the interval
    while True:
        below += math.comb(n, k) / 2**n
        if below > 0.025:
            break
        k += 1
    if k == 0:
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def paired_report(results: dict[str, list[dict[str, Any]]]) -> str:
    """``--paired``: per config, what side ``b`` (the adapter; for a bare framework the same
    job again, the A/A) adds to the step thread's CPU besides the model, over every pair of
    every process: the median in µs and in % of the framework's step p50, its 95 % interval,
    the range, each process's own median; then the garbage collection a step on each side,
    and, with ``--compare``, what side ``b`` adds in the library's own code alone
    (:func:`time_our_code`, read at each block's speed the same way; without ``--compare``
    only side ``b`` runs that code, and timing it would add the clock's reads to that side).

    A block's figures are read at that block's speed: this VM's speed moves by a third from
    one minute to the next, the model's compute and the Python around it alike.  So each
    side's cost is taken as a share of its own block's model time and brought back to µs at
    the framework's median model time: ``(b / b_model - a / a_model) x median(a_model)``.
    (That counts what the adapter does on the step, not a slowdown it would cause the
    model's own compute.)  The raw difference ``b - a`` is given beside it."""
    lines = [
        "| config | adds to the step thread, median | 95 % interval of the median "
        "| pairs: range | each process's median | raw b − a, median (range) "
        "| garbage collection a step, a / b "
        "| the library's own code on the step, b − a, median (95 % interval) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config, runs in results.items():
        pairs = [p for run in runs for p in run["pairs"]]
        model = statistics.median(p["a_model_us"] for p in pairs)

        def added(p: dict[str, float], model: float = model) -> float:
            return (p["b_us"] / p["b_model_us"] - p["a_us"] / p["a_model_us"]) * model

        diffs = [added(p) for p in pairs]
        raw = [p["b_us"] - p["a_us"] for p in pairs]
        step_us = 1e3 * statistics.median(p["a_p50_ms"] for p in pairs)
        low, high = median_interval(diffs)
        median = statistics.median(diffs)
        each = ", ".join(
            f"{statistics.median(added(p) for p in run['pairs']):+.0f}" for run in runs
        )
        gc_a = statistics.median(p["a_gc_us"] for p in pairs)
        gc_b = statistics.median(p["b_gc_us"] for p in pairs)
        ours_cell = "–"  # timed with --compare only: without, side a has none to time
        if "a_ours_us" in pairs[0]:
            ours = [
                (p["b_ours_us"] / p["b_model_us"] - p["a_ours_us"] / p["a_model_us"]) * model
                for p in pairs
            ]
            low_ours, high_ours = median_interval(ours)
            ours_cell = f"{statistics.median(ours):+.1f} µs ({low_ours:+.1f} to {high_ours:+.1f})"
        lines.append(
            f"| {config} (step p50 {step_us / 1e3:.2f} ms) | {median:+.0f} µs = "
            f"{100 * median / step_us:+.1f} % | {low:+.0f} to {high:+.0f} µs = "
            f"{100 * low / step_us:+.1f} to {100 * high / step_us:+.1f} % "
            f"| {min(diffs):+.0f} to {max(diffs):+.0f} ({len(diffs)}) | {each} "
            f"| {statistics.median(raw):+.0f} ({min(raw):+.0f} to {max(raw):+.0f}) "
            f"| {gc_a:.0f} / {gc_b:.0f} µs "
            f"| {ours_cell} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=6, help="repetitions of every config")
    parser.add_argument("--steps", type=int, default=1500, help="training steps a run")
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument(
        "--only",
        help="comma-separated configs; 'own' is async-loop,sync-loop (plain and plain-again, "
        "the A/A row, are always run)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="every config once, 120 steps (a smoke test)"
    )
    parser.add_argument("--json", help="also write every run's figures to this file")
    parser.add_argument(
        "--compare",
        metavar="DIR",
        help="also run every config but plain with the recis_async of the checkout DIR "
        "(rows 'config@DIR'), alternated with the others in every repetition; with "
        "--paired, '<framework>+adapter' runs the adapter with DIR's code on side a",
    )
    parser.add_argument(
        "--paired",
        type=int,
        metavar="BLOCKS",
        help="instead: each framework config runs as a process alternating BLOCKS jobs "
        "without the adapter with BLOCKS jobs with it ('<framework>+adapter'; a bare "
        "'<framework>': without it on both sides, the A/A), --reps processes a config",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child and args.paired:
        other_code = Path(args.compare) if args.compare else None
        print(
            json.dumps(
                paired_child(
                    args.child, Path(args.out), args.steps, args.hidden, args.paired, other_code
                )
            )
        )
        return
    if args.child:
        print(json.dumps(child(args.child, Path(args.out), args.steps, args.hidden)))
        return
    if args.quick:
        args.reps, args.steps = 1, 120
    if args.steps <= WARMUP + 2:  # a step's time is between two forward calls after warm-up
        parser.error(
            f"--steps: expected more than {WARMUP + 2} ({WARMUP} warm-up), got {args.steps}"
        )
    if args.paired is not None and args.paired < 1:
        parser.error(f"--paired: expected a number of jobs a side >= 1, got {args.paired}")
    configs = list(CONFIGS)
    if args.only:  # plain and plain-again (the A/A row: the resolution) are always run
        asked = [c for n in args.only.split(",") for c in ALIASES.get(n.strip(), [n.strip()])]
        configs = [] if args.paired else ["plain", "plain-again"]
        configs += [c for c in dict.fromkeys(asked) if c not in configs]
    if args.paired:  # a framework's job without and with its adapter, in one process
        frameworks = ("lightning", "hf", "ignite")
        configs = [c for c in configs if c.split("+")[0] in frameworks]
        if not configs:
            parser.error(
                f"--paired: expected --only to name a framework config "
                f"({', '.join(frameworks)}, each with or without '+adapter'), got {args.only!r}"
            )
        if args.compare and not (Path(args.compare) / "recis_async" / "__init__.py").is_file():
            parser.error(f"--compare: expected a checkout holding recis_async/, got {args.compare}")
    unknown = [c for c in configs if c not in CONFIGS]  # (before the --compare labels)
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    skipped = [c for c in configs if not available(c)]
    configs = [c for c in configs if c not in skipped]
    if skipped:
        print(f"skipped (framework not installed): {', '.join(skipped)}", file=sys.stderr)
    if args.compare and not args.paired:  # every config but the plain ones again, with the
        # other checkout's code (--paired: in the same process, see paired_child)
        other = Path(args.compare).resolve().name
        pairs = [[c] if c.startswith("plain") else [c, f"{c}@{other}"] for c in configs]
        configs = [label for pair in pairs for label in pair]
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for rep in range(args.reps):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for config in order:
            r = run_one(config, args)
            results[config].append(r)
            if args.paired:
                print(
                    f"rep {rep + 1}/{args.reps} {config:18s} raw b - a: "
                    + " ".join(f"{p['b_us'] - p['a_us']:+.0f}" for p in r["pairs"])
                    + f" µs wall {r['wall_s']:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            print(
                f"rep {rep + 1}/{args.reps} {config:18s} {r['steps_per_s']:7.1f} steps/s "
                f"p50 {r['p50_ms']:.2f} ms wall {r['wall_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.paired:
        if args.compare:
            print(
                f"side a: '<framework>+adapter' with the recis_async of {args.compare}; "
                "side b: with this checkout's (a bare framework: the A/A)"
            )
        print(paired_report(results))
        return
    print(report(results, args.reps))
    print("\nµs of CPU a step besides the model, within each repetition:\n" + paired(results))
    added = adapters(results)
    if added:
        print("\nWhat each adapter adds to its framework's step, within each repetition:\n" + added)


if __name__ == "__main__":
    main()
