"""Step-time stall while a checkpoint is written: CheckpointSaverHook vs torch.save inline.

A real torch training loop (an MLP of ``--layers`` x ``--width``^2 weights, SGD with momentum,
one intra-op thread) runs these phases in one process on the same model:

* ``baseline``  a few steps without checkpoints, printed for reference;
* ``none``      as many steps as the other phases, saving nothing: the machine's own noise;
* ``hook``      ``CheckpointSaverHook(save_steps=--every)``: the snapshot (tensors copied to CPU,
  split over up to four threads) is taken on the step, ``torch.save`` + ``fsync`` run in a
  low-priority thread while training goes on;
* ``inline``    ``torch.save`` of the same state + ``fsync`` inside the step, every ``--every``.

"During a save" means the step that took the snapshot (or wrote the file) and, for the hook,
every step that ran while the background write was in flight.  Each is divided by the median
"normal" step of the same phase (no save, no write in flight); the phases alternate for
``--rounds`` so that other load on the machine weighs on all alike.  It prints the median,
90th percentile and worst of these ratios, and the same for as many steps of the ``none``
phase over their median: the worst of n steps grows with n, and this is what the machine's
noise alone makes of it.  Target (issue 4): the step during a save <= 1.2x a normal step.

    python benchmarks/bench_checkpoint.py [--layers 4 --width 2048 --batch 256 --every 8 --saves 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import anyio
import torch

from recis_async import HookBus, add_metric
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import CheckpointSaverHook


def build(layers: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
    loss = model(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def inline_save(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str, step: int) -> None:
    """What a loop without the hook does: torch.save the state on the step, durably."""
    with open(path, "wb") as f:
        torch.save(
            {"global_step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}, f
        )
        f.flush()
        os.fsync(f.fileno())


async def run_phase(
    phase: str,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    steps: int,
    every: int,
    out: str,
    options: argparse.Namespace,
) -> tuple[list[float], list[int], list[int]]:
    """Step times, the indices of save steps, and of steps run while a write was in flight."""
    times: list[float] = []
    save_steps: list[int] = []
    overlapped: list[int] = []
    async with HookBus() as bus:
        saver = None
        if phase == "hook":
            saver = CheckpointSaverHook(
                out,
                save_steps=every,
                max_to_keep=2,
                save_end=False,
                model=model,
                optimizer=opt,
                writer_nice=options.writer_nice,
                reuse_buffers=options.reuse_buffers,
            )
            bus.add_hook(saver)
        service = f"CheckpointSaverHook({os.path.abspath(out)})"
        for step in range(steps):
            busy_before = saver is not None and _busy(bus, service)
            t = time.perf_counter()
            await bus.publish(BeforeStep(global_step=step))
            loss = train_step(model, opt, x)
            add_metric("loss", loss)
            if phase == "inline" and (step + 1) % every == 0:
                inline_save(model, opt, os.path.join(out, f"inline-{step + 1}.pt"), step + 1)
            await bus.publish(AfterStep(global_step=step, samples=x.shape[0]))
            times.append(time.perf_counter() - t)
            if (step + 1) % every == 0 and phase != "baseline":
                save_steps.append(step)
            elif busy_before:
                overlapped.append(step)
        if saver is not None:
            await saver.flush()
    return times, save_steps, overlapped


def _busy(bus: HookBus, service: str) -> bool:
    stats = bus.stats()["services"][service]
    return stats["writing_step"] is not None or stats["pending_step"] is not None


def spread(ratios: list[float]) -> str:
    got = sorted(ratios)
    p90 = got[min(len(got) - 1, int(0.9 * len(got)))]
    return (
        f"median {statistics.median(got):.2f}x, p90 {p90:.2f}x, worst {got[-1]:.2f}x "
        f"({len(got)} steps)"
    )


def fmt(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.0f}" for v in values) or "-"


def fmt_x(ratios: list[float]) -> str:
    return " ".join(f"{r:.2f}" for r in ratios) or "-"


async def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    model, opt = build(args.layers, args.width)
    x = torch.randn(args.batch, args.width)
    train_step(model, opt, x)  # momentum buffers exist from here on: the state is complete
    state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    state_mb *= 2  # + one momentum buffer per parameter
    print(
        f"model {args.layers}x{args.width}^2: {state_mb:.0f} MiB of weights + momentum, "
        f"batch {args.batch}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"backend {args.backend}, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    steps = args.every * args.saves + args.tail
    ratios: dict[str, list[float]] = {"hook": [], "inline": []}
    quiet: list[float] = []  # steps of the "none" phase / their median: the machine's noise
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as out:
        for _ in range(args.warmup):
            train_step(model, opt, x)
        base, _, _ = await run_phase(
            "baseline", model, opt, x, args.baseline, args.every, out, args
        )
        print(f"no checkpoints: median step {statistics.median(base) * 1e3:.0f} ms ({fmt(base)})")
        for r in range(args.rounds):  # alternate, so that a change of load hits all alike
            for phase in ("none", "hook", "inline"):
                times, saves, over = await run_phase(
                    "baseline" if phase == "none" else phase,
                    model,
                    opt,
                    x,
                    steps,
                    args.every,
                    out,
                    args,
                )
                busy = set(saves) | set(over)
                normal = statistics.median(t for i, t in enumerate(times) if i not in busy)
                clean = [t / normal for i, t in enumerate(times) if i not in busy]
                if phase == "none":
                    quiet += clean
                    print(f"round {r + 1} none   normal {normal * 1e3:.0f} ms ({fmt_x(clean)})")
                    continue
                ratios[phase] += [times[i] / normal for i in sorted(busy)]
                print(
                    f"round {r + 1} {phase:<6} normal {normal * 1e3:.0f} ms (others "
                    f"{fmt_x(clean)}); save steps {fmt_x([times[i] / normal for i in saves])}"
                    + (
                        f"; while writing {fmt_x([times[i] / normal for i in over])}"
                        if over
                        else ""
                    )
                )
    line = []
    for phase in ("hook", "inline"):
        summary = spread(ratios[phase])
        label = "CheckpointSaverHook" if phase == "hook" else "torch.save inline"
        print(f"{label:<20} steps during a save / normal step: {summary}")
        line.append(f"{phase} {summary}")
    # the worst of n steps grows with n: compare with as many steps that saved nothing
    same_n = quiet[: len(ratios["hook"])]
    print(f"{'no checkpoints':<20} steps / their median:              {spread(same_n)}")
    line.append(f"no checkpoints {spread(same_n)}")
    print(f"RESULT (target <= 1.2x): {'; '.join(line)}")
    print(f"load average after the run: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=4, help="hidden Linear layers (default 4)")
    p.add_argument(
        "--width", type=int, default=2048, help="hidden width (default 2048: 16 MiB/layer)"
    )
    p.add_argument("--batch", type=int, default=256, help="rows per step (default 256)")
    p.add_argument("--every", type=int, default=8, help="save every N steps (default 8)")
    p.add_argument("--saves", type=int, default=3, help="saves per phase (default 3)")
    p.add_argument("--tail", type=int, default=4, help="steps after the last save (default 4)")
    p.add_argument("--baseline", type=int, default=10, help="baseline steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="hook/inline rounds (default 3)")
    p.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    p.add_argument(
        "--writer-nice",
        type=lambda v: None if v == "none" else int(v),
        default=10,
        help="CheckpointSaverHook(writer_nice=...): 0..19 or 'none' (default 10)",
    )
    p.add_argument(
        "--no-reuse",
        dest="reuse_buffers",
        action="store_false",
        help="CheckpointSaverHook(reuse_buffers=False): fresh host memory for every snapshot",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    ns = parse(sys.argv[1:])
    sys.exit(anyio.run(main, ns, backend=ns.backend))
