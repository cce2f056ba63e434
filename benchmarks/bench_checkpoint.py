"""Step-time stall while a checkpoint is written: CheckpointSaverHook vs torch.save inline.

A real torch training loop (an MLP of ``--layers`` x ``--width``^2 weights, SGD with momentum,
one intra-op thread) runs three phases in one process on the same model:

* ``baseline``  no checkpoints: the median step time is the reference;
* ``hook``      ``CheckpointSaverHook(save_steps=--every)``: the snapshot (tensors cloned to CPU)
  is taken on the step, ``torch.save`` + ``fsync`` run in a worker thread while training goes on;
* ``inline``    ``torch.save`` of the same state + ``fsync`` inside the step, every ``--every``.

For each phase it prints the save step (the step that took the snapshot or wrote the file), the
steps that ran while a background write was in flight, and their ratio to the baseline median.
Target (issue 4): the step during a save <= 1.2x a normal step.

    python benchmarks/bench_checkpoint.py [--layers 4 --width 2048 --batch 256 --saves 3]
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
) -> tuple[list[float], list[int], list[int]]:
    """Step times, the indices of save steps, and of steps run while a write was in flight."""
    times: list[float] = []
    save_steps: list[int] = []
    overlapped: list[int] = []
    async with HookBus() as bus:
        saver = None
        if phase == "hook":
            saver = CheckpointSaverHook(
                out, save_steps=every, max_to_keep=2, save_end=False, model=model, optimizer=opt
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


def fmt(values: list[float]) -> str:
    return ", ".join(f"{v * 1e3:.0f}" for v in values) or "-"


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
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as out:
        for _ in range(args.warmup):
            train_step(model, opt, x)
        base, _, _ = await run_phase("baseline", model, opt, x, args.baseline, args.every, out)
        normal = statistics.median(base)
        print(
            f"baseline   median step {normal * 1e3:.0f} ms over {len(base)} steps (ms: {fmt(base)})"
        )
        ratios: dict[str, float] = {}
        medians: dict[str, float] = {}
        for phase in ("hook", "inline"):
            times, saves, overlapped = await run_phase(phase, model, opt, x, steps, args.every, out)
            save_t = [times[i] for i in saves]
            over_t = [times[i] for i in overlapped]
            worst = max(save_t + over_t)
            ratios[phase] = worst / normal
            medians[phase] = statistics.median(save_t + over_t) / normal
            median_save = statistics.median(save_t) / normal
            print(f"{phase:<10} save steps ms: {fmt(save_t)} (median {median_save:.2f}x)")
            if phase == "hook":
                print(f"{'':<10} steps while a write was in flight ms: {fmt(over_t)}")
            print(f"{'':<10} worst step during a save {worst * 1e3:.0f} ms = {worst / normal:.2f}x")
    print(
        f"RESULT step during a save / normal step (target <= 1.2x): "
        f"hook worst {ratios['hook']:.2f}x median {medians['hook']:.2f}x; "
        f"inline torch.save worst {ratios['inline']:.2f}x median {medians['inline']:.2f}x"
    )
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
    p.add_argument("--every", type=int, default=6, help="save every N steps (default 6)")
    p.add_argument("--saves", type=int, default=3, help="saves per phase (default 3)")
    p.add_argument("--tail", type=int, default=4, help="steps after the last save (default 4)")
    p.add_argument("--baseline", type=int, default=10, help="baseline steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (default 3)")
    p.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    return p.parse_args(argv)


if __name__ == "__main__":
    ns = parse(sys.argv[1:])
    sys.exit(anyio.run(main, ns, backend=ns.backend))
