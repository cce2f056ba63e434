"""The toy regression model and data the Trainer and run-hook tests share."""

from __future__ import annotations

import torch


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
