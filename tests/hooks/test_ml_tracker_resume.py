"""A job stopped and resumed from a checkpoint continues its tracked run, each step once.

The checkpoint is the hook's ``state_dict`` taken at step ``CKPT`` (as CheckpointHook takes
it); the first attempt goes on to step ``STOP`` and ends; the second restores the state
(``load_state_dict`` + ``AfterLoadCheckpoint``, as ``restore_checkpoint`` does) and runs from
``CKPT`` to ``END``.  Each store is read back with its own reader.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import anyio
import pytest

from recis_async import HookBus, add_to_ml_tracker
from recis_async.events import AfterLoadCheckpoint, AfterStep, BeforeStep, Start
from recis_async.hooks import MLTrackerHook
from recis_async.trackers import JsonlTracker, MlflowTracker, TensorBoardTracker, read_records
from recis_async.trackers.base import tracker_location

pytestmark = pytest.mark.anyio

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402

CKPT, STOP, END = 6, 10, 15


def _value(attempt: int, step: int) -> float:
    return attempt * 1000.0 + step


async def _attempt(
    hook: MLTrackerHook, attempt: int, state: dict[str, Any] | None, pause: float = 0.0
) -> Any:
    """Run one attempt; return the hook's state at step CKPT (the checkpoint).  ``pause``
    after each step (with ``flush_interval=0``: each record sent in a batch of its own)."""
    saved = None
    first, last = (0, STOP) if state is None else (CKPT, END)
    async with HookBus() as bus:
        bus.add_hook(hook)
        await bus.publish(Start())
        if state is not None:
            hook.load_state_dict(copy.deepcopy(state))
            await bus.publish(AfterLoadCheckpoint(global_step=CKPT, path="ckpt", hook_states={}))
        for step in range(first, last):
            if step == CKPT:
                saved = copy.deepcopy(hook.state_dict())
            await bus.publish(BeforeStep(global_step=step))
            add_to_ml_tracker("loss", _value(attempt, step))
            await bus.publish(AfterStep(global_step=step))
            if pause:
                await anyio.sleep(pause)
    return saved


def _expected() -> list[tuple[int, float]]:
    """Each step once; after the checkpoint, as the resumed attempt logged it."""
    return [(s, _value(1 if s < CKPT else 2, s)) for s in range(END)]


async def test_jsonl_run_continues_after_resume(tmp_path: Path) -> None:
    first = JsonlTracker(tmp_path)
    state = await _attempt(MLTrackerHook("p", "job", tracker=first), 1, None)
    assert state is not None and state["run_id"]
    second = JsonlTracker(tmp_path)
    await _attempt(MLTrackerHook("p", "job", tracker=second), 2, state)
    assert second.run_dir == first.run_dir and first.run_dir is not None
    assert [p.name for p in (tmp_path / "p").iterdir()] == [first.run_dir.name]  # one run
    records = read_records(first.run_dir / "metrics.jsonl")
    assert [(r.step, r.values["loss"]) for r in records] == _expected()


async def test_jsonl_resume_sent_a_record_at_a_time_has_each_step_once(tmp_path: Path) -> None:
    first = JsonlTracker(tmp_path)
    state = await _attempt(MLTrackerHook("p", "job", tracker=first), 1, None)
    second = JsonlTracker(tmp_path)
    hook = MLTrackerHook("p", "job", tracker=second, flush_interval=0)
    await _attempt(hook, 2, state, pause=0.05)
    assert hook.service is not None and hook.service.stats()["batches"] >= END - CKPT - 1
    assert first.run_dir is not None
    records = read_records(first.run_dir / "metrics.jsonl")
    assert [(r.step, r.values["loss"]) for r in records] == _expected()


@pytest.mark.parametrize("pause", [0.0, 0.05], ids=["batched", "a-record-at-a-time"])
async def test_tensorboard_run_continues_without_doubled_steps(
    tmp_path: Path, pause: float
) -> None:
    state = await _attempt(MLTrackerHook("p", "job", tracker=TensorBoardTracker(tmp_path)), 1, None)
    assert state is not None
    tracker = TensorBoardTracker(tmp_path)
    flush = {"flush_interval": 0.0} if pause else {}
    await _attempt(MLTrackerHook("p", "job", tracker=tracker, **flush), 2, state, pause=pause)
    assert tracker.run_dir is not None and [p.name for p in tmp_path.iterdir()] == ["job"]
    acc = event_accumulator.EventAccumulator(str(tracker.run_dir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == _expected()


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")


async def test_mlflow_run_continues_after_resume(
    mlflow_uri: tuple[str, str], anyio_backend: str
) -> None:
    uri, artifacts = mlflow_uri
    project = f"resume-{anyio_backend}"
    first = MlflowTracker(uri, artifact_location=artifacts)
    state = await _attempt(MLTrackerHook(project, "job", tracker=first), 1, None)
    assert state == {"run_id": first.run_id}
    second = MlflowTracker(uri, artifact_location=artifacts)
    await _attempt(MLTrackerHook(project, "job", tracker=second), 2, state)
    assert second.run_id == first.run_id
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(project)
    runs = client.search_runs([experiment.experiment_id])  # active runs: the fresh one is gone
    assert [r.info.run_id for r in runs] == [first.run_id]
    assert runs[0].info.status == "FINISHED"
    points = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "loss"))
    # Each step once.  MLflow cannot delete points: steps CKPT..STOP-1 keep the first value.
    assert [s for s, _ in points] == list(range(END))
    assert points == [(s, _value(1 if s < STOP else 2, s)) for s in range(END)]


async def test_mlflow_resume_skips_stored_points_in_every_batch(
    mlflow_uri: tuple[str, str], anyio_backend: str
) -> None:
    """The resumed attempt sends each record in a batch of its own: the steps the first
    attempt logged after the checkpoint arrive in several batches, and each is skipped (the
    tracker once checked the first batch only, and steps CKPT+1..STOP-1 were in twice)."""
    uri, artifacts = mlflow_uri
    project = f"resume-batches-{anyio_backend}"
    first = MlflowTracker(uri, artifact_location=artifacts)
    state = await _attempt(MLTrackerHook(project, "job", tracker=first), 1, None)
    second = MlflowTracker(uri, artifact_location=artifacts)
    hook = MLTrackerHook(project, "job", tracker=second, flush_interval=0)
    await _attempt(hook, 2, state, pause=0.05)
    assert hook.service is not None and hook.service.stats()["batches"] >= END - CKPT - 1
    client = MlflowClient(uri)
    points = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "loss"))
    assert points == [(s, _value(1 if s < STOP else 2, s)) for s in range(END)]


async def test_mlflow_user_id_names_the_run_across_restarts(
    mlflow_uri: tuple[str, str], anyio_backend: str
) -> None:
    uri, artifacts = mlflow_uri
    trackers = [MlflowTracker(uri, artifact_location=artifacts) for _ in range(2)]
    for attempt, tracker in enumerate(trackers):
        async with HookBus() as bus:
            bus.add_hook(
                MLTrackerHook(f"ids-{anyio_backend}", "job", id="my-job-1", tracker=tracker)
            )
            await bus.publish(Start())
            for step in range(attempt * 5, attempt * 5 + 5):
                await bus.publish(BeforeStep(global_step=step))
                add_to_ml_tracker("loss", float(step))
                await bus.publish(AfterStep(global_step=step))
    assert trackers[0].run_id is not None and trackers[0].run_id == trackers[1].run_id
    client = MlflowClient(uri)
    run = client.get_run(trackers[0].run_id)
    assert run.data.tags["recis_async.id"] == "my-job-1"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(
        range(10)
    )


def test_sqlite_uri_is_shown_as_given() -> None:
    tracker = MlflowTracker("sqlite:///job/mlflow.db")
    assert tracker_location(tracker, "p") == "MLflow at sqlite:///job/mlflow.db"
    secret = MlflowTracker("https://user:pw@mlflow.example.com/")
    assert tracker_location(secret, "p") == "MLflow at https://mlflow.example.com/"
