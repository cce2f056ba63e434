"""Every hook that writes says where, when it is added and in a summary when the bus closes."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from odps_server import TEST_ACCESS_ID, TEST_SECRET, OdpsServer, sink_config

from recis_async import Hook, HookBus, add_metric, add_to_ml_tracker, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import (
    CheckpointSaverHook,
    HistorySaverHook,
    MLTrackerHook,
    ProfilerHook,
    SummarySaverHook,
    TraceHook,
    TraceToOdpsHook,
)
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker
from recis_async.trackers.base import tracker_location

pytestmark = pytest.mark.anyio


def bus_info(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "recis_async.bus" and r.levelno == logging.INFO
    ]


async def steps(bus: HookBus, n: int, *, trace: bool = True) -> None:
    for step in range(n):
        await bus.publish(BeforeStep(global_step=step))
        if trace:
            add_to_trace("id", np.arange(4) + 4 * step)
        add_metric("loss", 0.5)
        add_to_ml_tracker("loss", 0.5)
        await bus.publish(AfterStep(global_step=step, samples=4))


async def test_each_output_is_logged_at_start_and_summarised_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Relative paths are given; absolute ones are logged.  The summary names what was
    written: the run folder, the rows, the newest checkpoint, the timeline files."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="recis_async.bus")
    model = torch.nn.Linear(2, 1)
    tracker = JsonlTracker("runs")
    async with HookBus() as bus:
        bus.add_hook(TraceHook(ParquetSink("trace", "t", "dt=1", rank=0), ["id"], ["bigint"]))
        bus.add_hook(CheckpointSaverHook("ckpt", save_steps=2, model=model))
        bus.add_hook(ProfilerHook(wait=0, warmup=1, active=1, repeat=1, output_dir="prof"))
        bus.add_hook(HistorySaverHook(2, "hist"))
        bus.add_hook(MLTrackerHook("proj", "run", tracker=tracker))
        bus.add_hook(SummarySaverHook(2, "tb"))
        started = bus_info(caplog)
        await steps(bus, 4)
    here = str(tmp_path)
    assert started == [
        f"TraceHook writes traces to {here}/trace/t/dt=1",
        f"TraceHook writes trace spill files (only if delivery fails) to {here}/trace_spill",
        f"CheckpointSaverHook writes checkpoints to {here}/ckpt",
        f"ProfilerHook writes profiler timelines to {here}/prof",
        f"HistorySaverHook writes loss history to {here}/hist/history.csv",
        f"MLTrackerHook writes experiment tracking to {here}/runs/proj/<run>",
        "MLTrackerHook writes tracker spill files (only if the tracker fails) to "
        + os.path.abspath(os.path.join(os.environ.get("TMPDIR", "/tmp"), "recis_async_spill")),
        f"SummarySaverHook writes TensorBoard summaries to {here}/tb",
    ]
    (summary,) = [m for m in bus_info(caplog) if m.startswith("outputs of this run:")]
    timeline = next((tmp_path / "prof").glob("0-timeline-*.json")).name
    assert summary.splitlines()[1:] == [
        f"  traces (TraceHook): {here}/trace/t/dt=1 (16 rows written)",
        f"  checkpoints (CheckpointSaverHook): {here}/ckpt/checkpoint-4.pt (the newest)",
        f"  profiler timelines (ProfilerHook): {here}/prof (1 timeline file(s), the last "
        f"{timeline})",
        f"  loss history (HistorySaverHook): {here}/hist/history.csv",
        f"  experiment tracking (MLTrackerHook): {tracker.run_dir}",
        f"  TensorBoard summaries (SummarySaverHook): {here}/tb",
    ]
    assert (tmp_path / "ckpt" / "checkpoint-4.pt").exists()
    assert (tmp_path / "hist" / "history.csv").exists()
    assert tracker.run_dir is not None and (tracker.run_dir / "metrics.jsonl").exists()


async def test_odps_output_names_table_and_partition_never_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="recis_async.bus")
    with OdpsServer("out_proj") as server:
        config = sink_config(server, "t", "dt=20261124")
        async with HookBus() as bus:
            bus.add_hook(TraceToOdpsHook(config, ["id"], ["bigint"]))
            await steps(bus, 3)
    lines = bus_info(caplog)
    assert (
        lines[0] == "TraceToOdpsHook writes traces to ODPS table out_proj.t, partition dt=20261124"
    )
    assert (
        "  traces (TraceToOdpsHook): ODPS table out_proj.t, partition dt=20261124 "
        "(12 rows written)" in lines[-1].splitlines()
    )
    assert not any(TEST_SECRET in line or TEST_ACCESS_ID in line for line in lines)


def test_tracker_location_drops_the_uri_password() -> None:
    from recis_async.trackers import MlflowClientTracker

    tracker = MlflowClientTracker("http://alice:s3cret@mlflow.example:5000/")
    where = tracker_location(tracker, "proj")
    assert where == "MLflow at http://mlflow.example:5000/"


async def test_a_failing_outputs_method_is_logged_and_the_run_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(Hook):
        def outputs(self) -> dict[str, str]:
            raise OSError("no cwd")

    caplog.set_level(logging.INFO, logger="recis_async.bus")
    async with HookBus() as bus:
        bus.add_hook(Broken())
        await steps(bus, 1, trace=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["<Broken>.outputs() failed: OSError: no cwd"] * 2
