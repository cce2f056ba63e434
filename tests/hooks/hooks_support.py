"""Shared by the hook tests: a step recorder, a toy trainer and regression model, a loop."""

from __future__ import annotations

from typing import Any

import anyio
import torch
from toy import Model, batches

from recis_async import (
    Hook,
    HookBus,
    Priority,
    Trainer,
    TrainingArguments,
    add_metric,
)
from recis_async.events import AfterStep, BeforeStep


class Steps(Hook):
    """Records training AfterStep events; runs last so it sees what every hook left."""

    priority = Priority.LOWEST

    def __init__(self) -> None:
        self.events: list[AfterStep] = []

    def after_step(self, event: AfterStep) -> None:
        if event.is_train:
            self.events.append(event)

    @property
    def steps(self) -> list[int]:
        return [e.global_step for e in self.events]


def trainer(hooks: list[Hook], data: Any = None, lr: float = 0.05, **kwargs: Any) -> Trainer:
    model = Model()
    args = TrainingArguments(**{"save_steps": None, **kwargs})
    return Trainer(
        model,
        args,
        train_dataset=batches(10) if data is None else data,
        eval_dataset=batches(2, seed=1),
        hooks=hooks,
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=lr), None),
    )


async def loop(
    bus: HookBus,
    losses: list[float],
    first: int = 0,
    samples: int = 8,
    pause: float = 0.0,
) -> int:
    """A hand-written loop; returns the number of steps run before a stop."""
    done = 0
    for i, loss in enumerate(losses, start=first):
        await bus.publish(BeforeStep(global_step=i))
        if pause:
            await anyio.sleep(pause)
        add_metric("loss", loss)
        await bus.publish(AfterStep(global_step=i, samples=samples))
        done += 1
        if bus.should_stop:
            break
    return done


class Reg(torch.nn.Module):
    """A linear regression on ``{"x": [n, 3], "y": [n]}`` batches."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.linear(batch["x"]).squeeze(-1), batch["y"])
