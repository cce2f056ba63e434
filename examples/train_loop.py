"""Your own training loop on the bus: publish the lifecycle events, collect per-step values.

python examples/train_loop.py --steps 200
"""

from __future__ import annotations

import argparse

import anyio
import torch

from recis_async import Hook, HookBus, add_metric, enable_logging
from recis_async.events import AfterStep, BeforeStep, End, Start


class PrintEvery(Hook):
    """A tiny custom hook: prints the loss every ``n`` training steps."""

    def __init__(self, n: int) -> None:
        self.n = n

    def after_step(self, event: AfterStep) -> None:
        if event.is_train and (event.global_step + 1) % self.n == 0:
            print(f"step {event.global_step + 1}: loss={event.metrics['loss']:.4f}")

    def end(self, event: End) -> None:
        print(f"run ended: {event.status}")


async def main(steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    true_w = torch.randn(8, 1)
    async with HookBus() as bus:
        bus.add_hook(PrintEvery(5))  # the loop converges in a few dozen steps

        @bus.on(AfterStep, when=lambda e: e.metrics.get("loss", 1.0) < 0.05)
        async def converged(event: AfterStep) -> None:
            bus.request_stop(f"loss below 0.05 at step {event.global_step}")

        await bus.publish(Start(is_train=True))
        for step in range(steps):
            await bus.publish(BeforeStep(global_step=step))
            x = torch.randn(64, 8)
            loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            add_metric("loss", loss)
            await bus.publish(AfterStep(global_step=step, samples=64))
            if bus.should_stop:
                print(f"stopping: {bus.stop_reason}")
                break


if __name__ == "__main__":
    enable_logging()  # the library's INFO lines on stderr; an own loop asks for them
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    anyio.run(main, parser.parse_args().steps)
