"""The toy regression model and data the Trainer and run-hook tests share."""

from __future__ import annotations

from typing import Any

import anyio
import torch

from recis_async import Hook


class Model(torch.nn.Module):
    """``model(batch)`` returns the MSE loss of a linear map learning ``y = x.sum()``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.linear(batch["x"]).squeeze(-1), batch["y"])


def batches(n: int, *, size: int = 4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of ``size`` rows, made from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(size, 3, generator=gen)
        out.append({"x": x, "y": x.sum(dim=1)})
    return out


class ServiceFailsAfterFirstStep(Hook):
    """A hook whose background service fails once the first training step has ended (its
    ``after_step`` lets the service run and record the failure): the bus must raise it at the
    next step boundary, before the model runs again."""

    def __init__(self) -> None:
        self.service = _FailsWhenTold()

    def attach(self, bus: Any) -> None:
        bus.start_service(self.service)

    async def after_step(self, event: Any) -> None:
        if event.global_step == 0:
            self.service.fail = True
            await anyio.sleep(0.2)  # the service wakes, raises, and the bus records it


class _FailsWhenTold:
    name = "fails-when-told"

    def __init__(self) -> None:
        self.fail = False

    async def run(self) -> None:
        while not self.fail:
            await anyio.sleep(0.005)
        raise OSError("the disk is full")

    async def aclose(self, deadline: float) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


class CountingModel(Model):
    """:class:`Model` counting its forward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        return super().forward(batch)
