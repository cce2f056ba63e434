"""Watch a training run: log lines, an experiment tracker, periodic reports, TensorBoard
summaries and profiler traces, all written off the step.

python examples/observe_training.py --steps 300 --tracker jsonl --out /tmp/observe
python examples/observe_training.py --tracker mlflow      # sqlite store in --out, offline
python examples/observe_training.py --tracker tensorboard # tensorboard --logdir <out>/tb
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import anyio
import torch

from recis_async import HookBus, add_metric, add_to_ml_tracker
from recis_async.events import AfterData, AfterStep, BeforeStep, Start
from recis_async.hooks import (
    LoggerHook,
    MetricReportHook,
    MLTrackerHook,
    ProfilerHook,
    ReportArguments,
    SummarySaverHook,
)
from recis_async.trackers import JsonlTracker, MlflowTracker, TensorBoardTracker


def make_tracker(kind: str, out: Path) -> Any:
    if kind == "jsonl":
        return JsonlTracker(out / "runs")
    if kind == "tensorboard":
        return TensorBoardTracker(out / "tb")
    # MlflowTracker runs MLflow's (Python-heavy) client in a child process, off the training GIL.
    uri = f"sqlite:///{out / 'mlflow.db'}"
    return MlflowTracker(uri, artifact_location=str(out / "mlartifacts"))


async def main(steps: int, kind: str, out: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    true_w = torch.randn(16, 1)
    config = {"optimizer": {"name": "adam", "lr": 1e-2}, "batch_size": 128, "steps": steps}

    async with HookBus() as bus:
        bus.add_hook(LoggerHook(log_step=50))
        bus.add_hook(
            MLTrackerHook("observe", f"demo-{kind}", config, tracker=make_tracker(kind, out))
        )
        bus.add_hook(MetricReportHook(model, ReportArguments(interval_step=100)))
        bus.add_hook(SummarySaverHook(100, out / "summaries", model=model))
        bus.add_hook(
            ProfilerHook(wait=5, warmup=5, active=2, repeat=1, output_dir=out / "timeline")
        )

        await bus.publish(Start(is_train=True))
        for step in range(steps):
            await bus.publish(BeforeStep(global_step=step, local_step=step))
            x = torch.randn(128, 16)
            y = x @ true_w + 0.1 * torch.randn(128, 1)
            await bus.publish(AfterData(global_step=step, local_step=step))
            pred = model(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            add_metric("loss", loss)
            add_to_ml_tracker("loss", loss)
            add_to_ml_tracker("pred", pred.detach()[:8, 0])  # an array: histogram / artifact
            await bus.publish(AfterStep(global_step=step, local_step=step, samples=128))
    print(f"outputs under {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tracker", choices=("jsonl", "mlflow", "tensorboard"), default="jsonl")
    parser.add_argument("--out", type=Path, default=Path("observe_output"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    anyio.run(main, args.steps, args.tracker, args.out)
