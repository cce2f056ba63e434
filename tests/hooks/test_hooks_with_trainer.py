"""The observability hooks together under the Trainer: every output exists and agrees."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from recis_async import Trainer, TrainingArguments, add_to_ml_tracker
from recis_async.hooks import (
    LoggerHook,
    MetricReportHook,
    MLTrackerHook,
    ProfilerHook,
    ReportArguments,
    SummarySaverHook,
)
from recis_async.trackers import JsonlTracker, read_records

pytestmark = pytest.mark.anyio


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        add_to_ml_tracker("train/loss", loss)
        return loss


async def test_trainer_with_all_observability_hooks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    torch.manual_seed(0)
    model = Regressor()
    data = [(torch.randn(32, 8), torch.randn(32, 1)) for _ in range(30)]
    tracker = JsonlTracker(tmp_path / "runs")
    hooks = [
        LoggerHook(log_step=10),
        MLTrackerHook("ctr", "trainer", {"lr": 0.05}, tracker=tracker),
        MetricReportHook(model, ReportArguments(interval_step=10)),
        SummarySaverHook(10, tmp_path / "tb", model=model),
        ProfilerHook(wait=1, warmup=1, active=1, repeat=1, output_dir=tmp_path / "prof"),
    ]
    trainer = Trainer(
        model,
        TrainingArguments(output_dir=str(tmp_path / "out"), train_steps=30, save_steps=None),
        train_dataset=data,
        eval_dataset=data[:5],
        hooks=hooks,
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.05), None),
    )
    await trainer.train_and_evaluate()

    lines = [r.getMessage() for r in caplog.records if r.name == "recis_async.hooks.logger"]
    assert [line.split()[1] for line in lines if "<mode=train>" in line] == [
        "<gstep=9>", "<gstep=19>", "<gstep=29>"
    ]  # fmt: skip
    assert all("<loss=" in line for line in lines)

    assert tracker.run_dir is not None
    records = read_records(tracker.run_dir / "metrics.jsonl")
    losses = [r for r in records if "train/loss" in r.values]
    assert [r.step for r in losses] == list(range(30))
    reports = [r for r in records if "report/steps_per_sec" in r.values]
    assert [r.step for r in reports] == [9, 19, 29]
    assert all(r.values["report/params"] == 8 * 16 + 16 + 16 + 1 for r in reports)
    assert [r.step for r in records if "eval/loss" in r.values] == [30]

    (trace,) = list((tmp_path / "prof").glob("0-timeline-*.json"))
    assert trace.name == "0-timeline-2.json" and json.loads(trace.read_text())["traceEvents"]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
