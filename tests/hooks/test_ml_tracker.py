"""MLTrackerHook on a real bus, read back through each tracker's own store."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import torch

from recis_async import HookBus, HookError, add_metric, add_to_ml_tracker
from recis_async.events import AfterEval, AfterStep, BeforeStep, Start
from recis_async.hooks import MLTrackerHook
from recis_async.trackers import (
    JsonlTracker,
    MlflowTracker,
    RunSpec,
    StepRecord,
    TensorBoardTracker,
    read_records,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402


class FlakyJsonl(JsonlTracker):
    """A real JsonlTracker whose ``log`` fails on the given calls."""

    def __init__(self, root: Path, fail_calls: Sequence[int]) -> None:
        super().__init__(root)
        self.fail_calls = set(fail_calls)
        self.calls = 0

    def log(self, records: Sequence[StepRecord]) -> None:
        self.calls += 1
        if self.calls in self.fail_calls:
            raise OSError(f"quota exceeded (call {self.calls})")
        super().log(records)


async def _train(bus: HookBus, steps: int, *, start: int = 0) -> None:
    await bus.publish(Start())
    for step in range(start, start + steps):
        await bus.publish(BeforeStep(global_step=step))
        add_to_ml_tracker("loss", torch.tensor(1.0 / (step + 1)))
        add_to_ml_tracker("emb", torch.arange(3, dtype=torch.float32) + step)
        add_metric("not_tracked", 1.0)
        await bus.publish(AfterStep(global_step=step, samples=8))


def _jsonl_run(tracker: JsonlTracker) -> tuple[list[StepRecord], dict[str, Any], dict[str, Any]]:
    assert tracker.run_dir is not None
    records = read_records(tracker.run_dir / "metrics.jsonl")
    params = msgspec.json.decode((tracker.run_dir / "params.json").read_bytes())
    info = msgspec.json.decode((tracker.run_dir / "run.json").read_bytes())
    return records, params, info


async def test_jsonl_default_every_step_once(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    hook = MLTrackerHook("ctr", "run-7", {"opt": {"lr": 0.01}, "bs": 8}, tracker=tracker)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await _train(bus, 300)
        await bus.publish(AfterEval(global_step=299, steps=5, metrics={"loss": 0.5, "auc": 0.7}))
    records, params, info = _jsonl_run(tracker)
    train = [r for r in records if "loss" in r.values and "eval/loss" not in r.values]
    assert [r.step for r in train] == list(range(300))  # nothing lost, nothing twice
    assert train[3].values == {"loss": 0.25, "emb": [3.0, 4.0, 5.0]}
    assert all("not_tracked" not in r.values for r in records)
    assert records[-1].values == {"eval/loss": 0.5, "eval/auc": 0.7}
    assert params == {"opt.lr": 0.01, "bs": 8}
    assert info["status"] == "ok" and info["project"] == "ctr" and info["name"] == "run-7"
    stats = bus.stats()["services"]["MLTrackerHook[ctr/run-7]"]
    assert stats["logged"] == 301 and stats["spilled"] == 0


async def test_status_failed_when_body_raises(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    with pytest.raises(ZeroDivisionError):
        async with HookBus() as bus:
            bus.add_hook(MLTrackerHook("p", "boom", {}, tracker=tracker))
            await _train(bus, 25)
            1 / 0  # noqa: B018
    records, _, info = _jsonl_run(tracker)
    assert len(records) == 25 and info["status"] == "failed"


async def test_status_cancelled(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    with anyio.CancelScope() as scope:
        async with HookBus() as bus:
            bus.add_hook(MLTrackerHook("p", "cancel", {}, tracker=tracker))
            await _train(bus, 12)
            scope.cancel()
            await anyio.sleep(10)
    records, _, info = _jsonl_run(tracker)
    assert len(records) == 12 and info["status"] == "cancelled"


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")


async def test_mlflow_end_to_end(mlflow_uri: tuple[str, str], tmp_path: Path) -> None:
    uri, artifacts = mlflow_uri
    tracker = MlflowTracker(uri, artifact_location=artifacts)
    config = {"model": {"dims": [64, 32]}, "lr": 0.001}
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("ctr-e2e", "mlflow-run", config, tracker=tracker))
        await _train(bus, 1500)
    assert tracker.run_id is not None
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "mlflow-run"
    assert run.data.params == {"model.dims": "[64, 32]", "lr": "0.001"}
    history = client.get_metric_history(tracker.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1500))
    arrays = read_records(
        client.download_artifacts(tracker.run_id, "tracked/arrays.jsonl", str(tmp_path))
    )
    assert [r.step for r in arrays] == list(range(1500))
    assert arrays[10].values == {"emb": [10.0, 11.0, 12.0]}


async def test_mlflow_failed_run(mlflow_uri: tuple[str, str]) -> None:
    uri, artifacts = mlflow_uri
    tracker = MlflowTracker(uri, artifact_location=artifacts)
    with pytest.raises(RuntimeError, match="step failed"):
        async with HookBus() as bus:
            bus.add_hook(MLTrackerHook("ctr-status", "failed", {}, tracker=tracker))
            await _train(bus, 5)
            raise RuntimeError("step failed")
    assert tracker.run_id is not None
    client = MlflowClient(uri)
    assert client.get_run(tracker.run_id).info.status == "FAILED"
    assert len(client.get_metric_history(tracker.run_id, "loss")) == 5


async def test_mlflow_preempted_by_sigterm_is_killed(mlflow_uri: tuple[str, str]) -> None:
    uri, artifacts = mlflow_uri
    tracker = MlflowTracker(uri, artifact_location=artifacts)
    with pytest.raises(SystemExit) as info:
        async with HookBus() as bus:
            bus.add_hook(MLTrackerHook("ctr-status", "preempted", {}, tracker=tracker))
            await _train(bus, 5)
            os.kill(os.getpid(), signal.SIGTERM)
            with anyio.fail_after(10):
                while not bus.should_stop:
                    await anyio.sleep(0.01)
    assert info.value.code == 143
    assert tracker.run_id is not None
    client = MlflowClient(uri)
    assert client.get_run(tracker.run_id).info.status == "KILLED"
    assert len(client.get_metric_history(tracker.run_id, "loss")) == 5


async def test_tensorboard_tracker_through_hook(tmp_path: Path) -> None:
    tracker = TensorBoardTracker(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("ctr", "tb", {"lr": 0.1}, tracker=tracker))
        await _train(bus, 40)
    acc = event_accumulator.EventAccumulator(
        str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0}
    )
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(40))
    assert [e.step for e in acc.Histograms("emb")] == list(range(40))


async def test_tracker_failure_raise_surfaces_hook_error(tmp_path: Path) -> None:
    tracker = FlakyJsonl(tmp_path, fail_calls=[2])
    hook = MLTrackerHook(
        "p", "flaky", {}, tracker=tracker, flush_interval=0, spill_dir=tmp_path / "spill"
    )
    published = 0
    with pytest.raises(HookError) as info:
        async with HookBus() as bus:
            bus.add_hook(hook)
            for step in range(1000):
                await bus.publish(BeforeStep(global_step=step))
                add_to_ml_tracker("loss", float(step))
                await bus.publish(AfterStep(global_step=step))
                published += 1
                await anyio.sleep(0.002)  # let the service flush small batches
    err = info.value
    assert "MLTrackerHook" in err.subscriber and "quota exceeded" in repr(err.__cause__)
    assert published < 1000
    records, _, run = _jsonl_run(tracker)
    assert hook.service is not None and hook.service.spill_path is not None
    spilled = read_records(hook.service.spill_path)
    steps = sorted(r.step for r in records + spilled)
    assert steps == list(range(published))  # every step whose publish succeeded, once
    assert run["status"] == "failed"


def _failing_first_flush(tmp_path: Path, tracker: Any, mode: str) -> MLTrackerHook:
    """A hook flushing every step to ``tracker`` with ``on_error=mode``, spilling under tmp."""
    return MLTrackerHook(
        "p",
        mode,
        {},
        tracker=tracker,
        flush_interval=0,
        on_error=mode,  # type: ignore[arg-type]
        spill_dir=tmp_path / "spill",
    )


async def _until_first_error(bus: HookBus, hook: MLTrackerHook) -> None:
    """Add ``hook``, publish step 0 and wait until its service has seen the first failure."""
    bus.add_hook(hook)
    await bus.publish(AfterStep(global_step=0, tracked={"loss": 0.0}))
    assert hook.service is not None
    with anyio.fail_after(5):
        while hook.service.stats()["errors"] == 0:
            await anyio.sleep(0.001)


@pytest.mark.async_bus_only  # awaits the service's first failure between publishes
@pytest.mark.parametrize("mode", ["log", "disable"])
async def test_tracker_failure_log_or_disable(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = FlakyJsonl(tmp_path, fail_calls=[1])
    hook = _failing_first_flush(tmp_path, tracker, mode)
    async with HookBus() as bus:
        await _until_first_error(bus, hook)
        for step in range(1, 50):
            await bus.publish(AfterStep(global_step=step, tracked={"loss": float(step)}))
    stats = hook.service.stats()
    records, _, _ = _jsonl_run(tracker)
    assert hook.service.spill_path is not None
    assert [r.step for r in read_records(hook.service.spill_path)] == [0]
    assert "quota exceeded" in caplog.text
    if mode == "log":
        assert [r.step for r in records] == list(range(1, 50))
    else:
        assert records == [] and stats["dropped"] == 49


async def test_bad_tracked_value_fails_at_its_publish(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("p", "bad", {}, tracker=tracker))
        await bus.publish(AfterStep(global_step=0, tracked={"ok": 1.0}))
        with pytest.raises(HookError, match=r"AfterStep.tracked\['ragged'\]: expected a number"):
            await bus.publish(AfterStep(global_step=1, tracked={"ragged": [[1.0], [2.0, 3.0]]}))
        with pytest.raises(HookError, match=r"AfterStep.tracked key: .*got 'a\$b'"):
            await bus.publish(AfterStep(global_step=2, tracked={"a$b": 1.0}))
        await bus.publish(AfterStep(global_step=3, tracked={"ok": 3.0}))
    records, _, _ = _jsonl_run(tracker)
    assert [(r.step, r.values) for r in records] == [(0, {"ok": 1.0}), (3, {"ok": 3.0})]


async def test_log_metrics_for_other_hooks(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    hook = MLTrackerHook("p", "api", {}, tracker=tracker)
    with pytest.raises(RuntimeError, match="not attached"):
        await hook.log_metrics(0, {"x": 1.0})
    async with HookBus() as bus:
        bus.add_hook(hook)
        await hook.log_metrics(7, {"qps": 10.0, "hist": np.ones(2)}, prefix="report/")
        with pytest.raises(TypeError, match="step=...\\): expected int, got 1.5"):
            await hook.log_metrics(1.5, {"x": 1.0})  # type: ignore[arg-type]
    records, _, _ = _jsonl_run(tracker)
    assert [(r.step, r.values) for r in records] == [
        (7, {"report/qps": 10.0, "report/hist": [1.0, 1.0]})
    ]
    assert not hook.accepting


@pytest.mark.async_bus_only  # the gate is opened by a task that runs while a publish waits
async def test_backpressure_bounds_the_buffer(tmp_path: Path) -> None:
    gate = threading.Event()

    class Gated(JsonlTracker):
        def log(self, records: Sequence[StepRecord]) -> None:
            gate.wait(30)
            super().log(records)

    tracker = Gated(tmp_path)
    hook = MLTrackerHook("p", "bp", {}, tracker=tracker, max_buffer_bytes=4096, flush_interval=0)
    peak = 0

    async def release_later() -> None:
        await anyio.sleep(0.2)
        gate.set()

    async with HookBus() as bus:
        bus.add_hook(hook)
        assert hook.service is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(release_later)
            for step in range(400):
                await bus.publish(AfterStep(global_step=step, tracked={"loss": float(step)}))
                peak = max(peak, hook.service.stats()["queued_bytes"])
    assert peak <= 4096
    records, _, _ = _jsonl_run(tracker)
    assert [r.step for r in records] == list(range(400))


async def test_rank_zero_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(tmp_path)
    tracker = JsonlTracker(tmp_path / "runs")
    hook = MLTrackerHook("p", "r1", {}, tracker=tracker)
    default = MLTrackerHook("p", "r1", {})  # JsonlTracker("ml_tracker")
    async with HookBus() as bus:
        bus.add_hook(hook)
        bus.add_hook(default)
        await _train(bus, 3)
        assert bus.hooks == ()
    assert hook.service is None and tracker.run_dir is None
    assert list(tmp_path.iterdir()) == [], "a skipped rank leaves no folders behind"


def test_constructor_validation(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    with pytest.raises(ValueError, match="MLTrackerHook.project: expected a non-empty str, got ''"):
        MLTrackerHook("", "n", {}, tracker=tracker)
    with pytest.raises(ValueError, match=r"MLTrackerHook.config key: .*'bad key!'"):
        MLTrackerHook("p", "n", {"bad key!": 1}, tracker=tracker)
    with pytest.raises(TypeError, match="config: expected a mapping or None, got list"):
        MLTrackerHook("p", "n", [1], tracker=tracker)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tracker: expected an object with start/log/finish"):
        MLTrackerHook("p", "n", {}, tracker=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_buffer_bytes: expected a positive int, got 0"):
        MLTrackerHook("p", "n", {}, tracker=tracker, max_buffer_bytes=0)
    with pytest.raises(ValueError, match="flush_interval: expected seconds >= 0, got -1"):
        MLTrackerHook("p", "n", {}, tracker=tracker, flush_interval=-1)
    with pytest.raises(
        ValueError, match=r"on_error=...\): expected one of 'raise', 'log', 'disable'"
    ):
        MLTrackerHook("p", "n", {}, tracker=tracker, on_error="ignore")  # type: ignore[arg-type]


async def test_resume_run_id_appends(tmp_path: Path) -> None:
    first = JsonlTracker(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("p", "n", {}, id="run-1", tracker=first))
        await _train(bus, 5)
    second = JsonlTracker(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("p", "n", {}, id="run-1", tracker=second))
        await _train(bus, 5, start=5)
    assert second.run_dir == first.run_dir
    records, _, _ = _jsonl_run(second)
    assert [r.step for r in records] == list(range(10))


def test_run_spec_from_hook(tmp_path: Path) -> None:
    hook = MLTrackerHook("p", "n", {"a": {"b": 1}}, id="x", tracker=JsonlTracker(tmp_path))
    assert hook.params == {"a.b": 1}
    assert RunSpec(project="p", name="n", run_id="x", params=hook.params).run_id == "x"


@pytest.mark.async_bus_only  # awaits the service's first failure between publishes
async def test_disable_takes_effect_before_the_failed_batch_is_spilled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records published while the failed batch is still being spilled are dropped, as
    documented, not buffered: the service is disabled before its first await."""
    from recis_async.trackers.service import TrackerService

    slow_spill = TrackerService._spill

    async def spill(self: TrackerService, records: list[Any]) -> None:
        await anyio.sleep(0.1)  # hold the window open
        await slow_spill(self, records)

    monkeypatch.setattr(TrackerService, "_spill", spill)
    tracker = FlakyJsonl(tmp_path, fail_calls=[1])
    hook = _failing_first_flush(tmp_path, tracker, "disable")
    async with HookBus() as bus:
        await _until_first_error(bus, hook)
        for step in range(1, 11):  # inside the 0.1 s spill
            await bus.publish(AfterStep(global_step=step, tracked={"loss": float(step)}))
    assert hook.service.spill_path is not None
    assert [r.step for r in read_records(hook.service.spill_path)] == [0]
    assert hook.service.stats()["dropped"] == 10


@pytest.mark.async_bus_only  # awaits each step's flush between publishes
async def test_a_tracker_failing_every_flush_logs_three_tracebacks_then_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tracker = FlakyJsonl(tmp_path, fail_calls=range(1, 10_000))
    hook = MLTrackerHook(
        "p", "r", tracker=tracker, on_error="log", flush_interval=0.0, spill_dir=tmp_path / "s"
    )
    async with HookBus() as bus:
        bus.add_hook(hook)
        for step in range(40):
            await bus.publish(AfterStep(global_step=step, tracked={"loss": float(step)}))
            await anyio.sleep(0.01)  # each step's record is flushed (and fails) by itself
    assert hook.service is not None
    errors = hook.service.stats()["errors"]
    assert errors >= 10
    failures = [
        r
        for r in caplog.records
        if r.name == "recis_async.trackers.service" and r.levelno >= logging.ERROR
    ]
    assert sum(r.exc_info is not None for r in failures) == 3
    counts = [r.getMessage() for r in failures if r.exc_info is None]
    assert len(counts) == (1 if errors < 100 else 2), counts
    assert "tracker.log failed" in counts[0]
    assert ": 10 failures so far, the last OSError: quota exceeded (call 10)" in counts[0]


class SlowStartJsonl(JsonlTracker):
    """A real JsonlTracker whose start takes a while (a tracker process, an import, a store)."""

    def start(self, run: RunSpec) -> None:
        threading.Event().wait(0.3)
        super().start(run)


async def test_start_returns_once_the_tracker_has_started(tmp_path: Path) -> None:
    """The tracker's start (for MLflow: its process, import, store and run) happens before the
    first step, not beside the first steps: ``Start`` waits for it."""
    tracker = SlowStartJsonl(tmp_path)
    hook = MLTrackerHook("p", "n", {"lr": 0.1}, tracker=tracker)
    async with HookBus() as bus:
        bus.add_hook(hook)
        with anyio.fail_after(30):
            await bus.publish(Start())
        assert tracker.run_dir is not None and (tracker.run_dir / "params.json").exists()
        await _train(bus, 3)
    records, _, info = _jsonl_run(tracker)
    assert [r.step for r in records] == [0, 1, 2] and info["status"] == "ok"
