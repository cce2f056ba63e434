"""What the Trainer's loop costs a step, alone and across ranks (its stop agreement).

``--ranks 1`` (default): a small MLP (``--width``, ``--batch``) trained by the ``Trainer`` with
its default hooks (logger; checkpoints off) against the same model trained by a bare loop,
interleaved for ``--rounds``; prints the median step time of each and the Trainer's overhead
per step in microseconds.

``--ranks 2``: the same Trainer on two ranks under ``torch.distributed.run`` (gloo, CPU); rank
1's steps are made uneven (``--jitter`` ms of extra work on one step in four, the kind of
spread data loading gives), so a boundary that waits for the other rank every step waits for
rank 1's slow steps on rank 0 too.  Rank 0 prints each rank's steps/s and median step
boundary (AfterStep to the next BeforeStep, where the agreement runs).  The
stop agreement's collective and a slow rank cost the other rank only what the one-step lag
cannot absorb.

The script uses the public API only, so the same file measures another checkout::

    python benchmarks/bench_trainer.py [--ranks 2] [--steps 400]
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_trainer.py --ranks 2
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from recis_async import Hook, Trainer, TrainingArguments
from recis_async.events import AfterStep, BeforeStep


class Net(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
        )

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.body(batch).pow(2).mean()


class Jitter(torch.nn.Module):
    """``Net`` whose every fourth step does ``ms`` of extra work (busy, like a slow batch)."""

    def __init__(self, width: int, ms: float) -> None:
        super().__init__()
        self.net = Net(width)
        self.ms = ms
        self.calls = 0

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.ms and self.calls % 4 == 0:
            end = time.perf_counter() + self.ms / 1000
            while time.perf_counter() < end:
                pass
        return self.net(batch)


class Clock(Hook):
    """Times each training step (AfterStep to AfterStep) and each step boundary (AfterStep to
    the next BeforeStep: where the stop agreement runs)."""

    def __init__(self) -> None:
        self.last = 0.0
        self.times: list[float] = []
        self.boundaries: list[float] = []

    def before_step(self, event: BeforeStep) -> None:
        if self.last and event.is_train:
            self.boundaries.append(time.perf_counter() - self.last)

    def after_step(self, event: AfterStep) -> None:
        now = time.perf_counter()
        if self.last:
            self.times.append(now - self.last)
        self.last = now


def data(n: int, batch: int, width: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, width, generator=g) for _ in range(n)]


async def trainer_steps(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    return (await trainer_clock(model, batches)).times


async def trainer_clock(model: torch.nn.Module, batches: list[torch.Tensor]) -> Clock:
    clock = Clock()
    args = TrainingArguments(save_steps=None, log_steps=100, collective_timeout=60)
    trainer = Trainer(
        model,
        args,
        train_dataset=batches,
        hooks=[clock],
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=1e-3), None),
    )
    await trainer.train()
    return clock


def bare_steps(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    last = 0.0
    for batch in batches:
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if last:
            times.append(now - last)
        last = now
    return times


def one_rank(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    batches = data(args.steps, args.batch, args.width)
    trainer_t: list[float] = []
    bare_t: list[float] = []
    for _ in range(args.rounds):
        trainer_t += anyio.run(trainer_steps, Net(args.width), batches)[10:]
        bare_t += bare_steps(Net(args.width), batches)[10:]
    t, b = statistics.median(trainer_t), statistics.median(bare_t)
    print(f"bare loop      median step {b * 1e6:8.1f} us")
    print(f"Trainer        median step {t * 1e6:8.1f} us")
    print(f"Trainer overhead per step  {(t - b) * 1e6:8.1f} us  ({t / b:.3f}x)")


def rank_main(args: argparse.Namespace) -> None:
    import torch._dynamo  # noqa: F401  (see tests/scripts/dist_train.py)
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    model = Jitter(args.width, args.jitter if rank == 1 else 0.0)
    batches = data(args.steps, args.batch, args.width)
    anyio.run(trainer_steps, model, batches[:20])  # warm-up
    started = time.perf_counter()
    clock = anyio.run(trainer_clock, model, batches)
    rate = args.steps / (time.perf_counter() - started)
    boundary = statistics.median(clock.boundaries) * 1e6
    gathered: list[Any] = [None, None]
    tdist.all_gather_object(gathered, (rate, boundary))
    if rank == 0:
        (r0, b0), (r1, b1) = gathered
        print(
            f"steps/s: rank 0 {r0:.1f}, rank 1 {r1:.1f}; median step boundary "
            f"(AfterStep -> next BeforeStep): rank 0 {b0:.0f} us, rank 1 {b1:.0f} us"
        )
    tdist.destroy_process_group()


def two_ranks(args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_TRAINER_RANK": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        str(Path(__file__).resolve()),
        *sys.argv[1:],
    ]
    for _ in range(args.rounds):
        subprocess.run(cmd, env=env, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, choices=(1, 2), default=1)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jitter", type=float, default=4.0, help="[--ranks 2] ms, one step in 4")
    args = p.parse_args()
    torch.set_num_threads(1)
    if os.environ.get("BENCH_TRAINER_RANK"):
        rank_main(args)
    elif args.ranks == 2:
        two_ranks(args)
    else:
        one_rank(args)


if __name__ == "__main__":
    main()
