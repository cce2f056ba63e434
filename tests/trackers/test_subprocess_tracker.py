"""SubprocessTracker: a real child process running a real tracker, outputs read back."""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import numpy as np
import pytest

from recis_async import HookBus, HookError
from recis_async.events import AfterStep
from recis_async.hooks import MLTrackerHook
from recis_async.trackers import (
    JsonlTracker,
    MlflowTracker,
    RunSpec,
    StepRecord,
    SubprocessTracker,
    read_records,
)
from recis_async.trackers.replay import replay_file


class RefusingTracker(JsonlTracker):
    """Fails on steps >= 100 and dies on step 666 (module level: the child imports it)."""

    def log(self, records: Sequence[StepRecord]) -> None:
        if any(r.step == 666 for r in records):
            os._exit(3)
        if any(r.step >= 100 for r in records):
            raise PermissionError("token expired")
        super().log(records)


class HangingTracker(JsonlTracker):
    """Never answers a log of step 777 (module level: the child imports it)."""

    def log(self, records: Sequence[StepRecord]) -> None:
        if any(r.step == 777 for r in records):
            time.sleep(120)
        super().log(records)


class StoreThenDieTracker(JsonlTracker):
    """Stores a batch holding step 555, then dies before answering (module level: the child
    imports it): the parent cannot tell such a batch from one the child never took."""

    def log(self, records: Sequence[StepRecord]) -> None:
        super().log(records)
        if any(r.step == 555 for r in records):
            os._exit(9)


class PrefixTracker(JsonlTracker):
    """Stores only the first 3 records of a batch holding step 888 and says so, as
    ``JsonlTracker`` does when a full disk cuts a write it cannot take back (module level)."""

    def log(self, records: Sequence[StepRecord]) -> None:
        if any(r.step == 888 for r in records):
            super().log(records[:3])
            error = OSError(28, "No space left on device")
            error.delivered = 3  # type: ignore[attr-defined]
            raise error
        super().log(records)


class UnstartableTracker(JsonlTracker):
    """Refuses to start (module level: the child imports it)."""

    def start(self, run: RunSpec) -> None:
        raise PermissionError("no such project")


def _run_dir(root: Path) -> Path:
    (project,) = list(root.iterdir())
    (run,) = list(project.iterdir())
    return run


PROBE = """
import sys
from recis_async.trackers.jsonl import JsonlTracker

class ImportRecordingTracker(JsonlTracker):
    def start(self, run):
        super().start(run)
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        (self.root / "imports.json").write_text(repr({"torch": "torch" in sys.modules, "main": main}))
"""


def test_the_child_imports_neither_torch_nor_the_main_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child's start costs its tracker's imports only: not torch (which the package's
    training side needs) nor the program's main module (multiprocessing's spawn reruns it)."""
    import torch  # noqa: F401  - in the parent, as in a training program

    (tmp_path / "probe_tracker.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from probe_tracker import ImportRecordingTracker  # type: ignore[import-not-found]

    tracker = SubprocessTracker(functools.partial(ImportRecordingTracker, tmp_path))
    tracker.start(RunSpec(project="p", name="n"))
    tracker.finish("ok")
    assert (tmp_path / "imports.json").read_text() == repr({"torch": False, "main": None})


TEARDOWN_PROBE = """
import atexit
from recis_async.trackers.jsonl import JsonlTracker

class TeardownTracker(JsonlTracker):
    def start(self, run):
        super().start(run)
        atexit.register((self.root / "torn-down").write_text, "x")
"""


def test_the_child_exits_at_once_after_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once ``finish`` is answered the run is stored; the child skips the interpreter's
    teardown (seconds for mlflow and SQLAlchemy), which the parent's close would wait for."""
    (tmp_path / "teardown_probe.py").write_text(TEARDOWN_PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from teardown_probe import TeardownTracker  # type: ignore[import-not-found]

    tracker = SubprocessTracker(functools.partial(TeardownTracker, tmp_path / "runs"))
    tracker.start(RunSpec(project="p", name="n"))
    tracker.log([StepRecord(0, time.time(), {"loss": 1.0})])
    tracker.finish("ok")
    assert not (tmp_path / "runs" / "torn-down").exists()
    assert [r.step for r in read_records(_run_dir(tmp_path / "runs") / "metrics.jsonl")] == [0]


def test_the_child_outlives_a_ctrl_c_of_the_process_group(tmp_path: Path) -> None:
    """SIGINT goes to every process of the terminal's group: the child must still take the
    parent's last records and finish the run while the parent drains."""
    tracker = SubprocessTracker(functools.partial(JsonlTracker, tmp_path))
    tracker.start(RunSpec(project="p", name="n"))
    assert tracker.pid is not None
    os.kill(tracker.pid, signal.SIGINT)
    tracker.log([StepRecord(s, time.time(), {"loss": s / 10}) for s in range(5)])
    tracker.finish("preempted")
    run = _run_dir(tmp_path)
    assert [r.step for r in read_records(run / "metrics.jsonl")] == list(range(5))
    assert b'"status":"preempted"' in (run / "run.json").read_bytes()


def test_forwards_calls_and_arrays(tmp_path: Path) -> None:
    tracker = SubprocessTracker(functools.partial(JsonlTracker, tmp_path))
    tracker.start(RunSpec(project="p", name="n", params={"lr": 0.1, "dims": [1, 2]}))
    assert tracker.pid is not None and tracker.pid != os.getpid()
    records = [
        StepRecord(s, time.time(), {"loss": s / 10, "emb": np.arange(4, dtype=np.float32) * s})
        for s in range(50)
    ]
    tracker.log(records[:20])
    tracker.log(records[20:])
    tracker.finish("preempted")
    run = _run_dir(tmp_path)
    back = read_records(run / "metrics.jsonl")
    assert [r.step for r in back] == list(range(50))
    assert back[7].values == {"loss": 0.7, "emb": [0.0, 7.0, 14.0, 21.0]}
    assert b'"status":"preempted"' in (run / "run.json").read_bytes()
    assert b'"dims":[1,2]' in (run / "params.json").read_bytes()


def test_child_errors_and_death_become_errors_here(tmp_path: Path) -> None:
    tracker = SubprocessTracker(functools.partial(RefusingTracker, tmp_path))
    tracker.start(RunSpec(project="p", name="n"))
    tracker.log([StepRecord(1, 0.0, {"x": 1.0})])
    with pytest.raises(
        RuntimeError, match="log failed in the tracker process: PermissionError: token expired"
    ) as refused:
        tracker.log([StepRecord(100, 0.0, {"x": 1.0})])
    assert not hasattr(refused.value, "in_doubt")  # the child answered: nothing stored
    tracker.log([StepRecord(2, 0.0, {"x": 2.0})])  # the child survives a failed call
    with pytest.raises(
        RuntimeError, match=r"tracker process is gone during log \(exit code 3\)"
    ) as gone:
        tracker.log([StepRecord(666, 0.0, {"x": 1.0})])
    assert gone.value.in_doubt is True  # type: ignore[attr-defined]
    assert [r.step for r in read_records(_run_dir(tmp_path) / "metrics.jsonl")] == [1, 2]


def test_a_hung_child_is_a_timeout_and_is_killed_at_once(tmp_path: Path) -> None:
    """A call the child does not answer within call_timeout raises a timeout naming the
    call, and the unresponsive child is killed and reaped then, not waited on."""
    tracker = SubprocessTracker(functools.partial(HangingTracker, tmp_path))
    tracker.start(RunSpec(project="p", name="n"))
    tracker.call_timeout = 1.0
    proc = tracker._proc
    assert proc is not None
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"log got no answer in 1.0s") as hung:
        tracker.log([StepRecord(777, 0.0, {"x": 1.0})])
    assert hung.value.in_doubt is True  # type: ignore[attr-defined]
    assert time.monotonic() - started < 6
    assert proc.returncode is not None  # reaped: no zombie, no orphan still sleeping


def test_a_failed_start_ends_the_child(tmp_path: Path) -> None:
    """A tracker whose start fails in the child leaves no child process behind (nothing
    calls finish on a run that never started)."""
    tracker = SubprocessTracker(functools.partial(UnstartableTracker, tmp_path))
    with pytest.raises(RuntimeError, match="start failed in the tracker process"):
        tracker.start(RunSpec(project="p", name="n"))
    proc = tracker._proc
    assert proc is not None and proc.returncode is not None
    tracker.finish("failed")  # still a no-op, not an error


def test_constructor_validation() -> None:
    with pytest.raises(
        ValueError, match="SubprocessTracker.factory: expected a picklable callable"
    ):
        SubprocessTracker(lambda: JsonlTracker())
    with pytest.raises(TypeError, match="expected a callable, got 3"):
        SubprocessTracker(3)  # type: ignore[arg-type]
    main_factory = type("Local", (JsonlTracker,), {"__module__": "__main__"})
    sys.modules["__main__"].Local = main_factory  # type: ignore[attr-defined]
    try:
        with pytest.raises(ValueError, match="expected a callable importable from a module"):
            SubprocessTracker(main_factory)
    finally:
        del sys.modules["__main__"].Local  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="log before start"):
        SubprocessTracker(JsonlTracker).log([])


@pytest.mark.anyio
async def test_mlflow_in_a_child_through_the_hook(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, artifact_location=str(tmp_path / "art"))  # a SubprocessTracker
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("sub", "run", {"lr": 0.5}, tracker=tracker))
        for step in range(300):
            await bus.publish(AfterStep(global_step=step, tracked={"loss": step / 300}))
    assert tracker.pid is not None and tracker.pid != os.getpid()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sub").experiment_id])
    assert run.info.run_id == tracker.run_id  # handed back by the child
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.5"}
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(300))


@pytest.mark.anyio
async def test_child_failure_follows_on_error_raise(tmp_path: Path) -> None:
    hook = MLTrackerHook(
        "p",
        "n",
        {},
        tracker=SubprocessTracker(functools.partial(RefusingTracker, tmp_path / "runs")),
        flush_interval=0,
        spill_dir=tmp_path / "spill",
    )
    with pytest.raises(HookError, match="token expired"):
        async with HookBus() as bus:
            bus.add_hook(hook)
            for step in range(98, 103):
                await bus.publish(AfterStep(global_step=step, tracked={"loss": 1.0}))
    assert hook.service is not None and hook.service.spill_path is not None
    delivered = read_records(_run_dir(tmp_path / "runs") / "metrics.jsonl")
    spilled = read_records(hook.service.spill_path)
    assert sorted(r.step for r in delivered + spilled) == list(range(98, 103))


@pytest.mark.anyio
@pytest.mark.parametrize("on_error", ["log", "raise"])
async def test_a_batch_the_child_stored_before_dying_is_spilled_in_doubt(
    tmp_path: Path, on_error: str
) -> None:
    """The child stored the batch of step 555 and died before it answered: that batch is
    spilled as in doubt (``*.inflight.jsonl``), never as unsent, so no file claims a stored
    record was lost; the replay settles the files and each step is stored once."""
    root, spill = tmp_path / "runs", tmp_path / "spill"
    hook = MLTrackerHook(
        "p",
        "n",
        tracker=SubprocessTracker(functools.partial(StoreThenDieTracker, root)),
        flush_interval=0,
        spill_dir=spill,
        on_error=on_error,  # type: ignore[arg-type]
    )
    published: list[int] = []
    try:
        async with HookBus() as bus:
            bus.add_hook(hook)
            for step in range(550, 562):
                await bus.publish(AfterStep(global_step=step, tracked={"loss": step / 10}))
                published.append(step)
                if step == 555:
                    await hook.flush()  # the batch holding 555 is answered (or not) now
    except HookError:
        assert on_error == "raise"
    else:
        assert on_error == "log"
    stored = [r.step for r in read_records(_run_dir(root) / "metrics.jsonl")]
    in_doubt = [r.step for p in spill.glob("*.inflight.jsonl") for r in read_records(p)]
    unsent = [
        r.step
        for p in spill.glob("*.jsonl")
        if not p.name.endswith(".inflight.jsonl")
        for r in read_records(p)
    ]
    assert 555 in stored and 555 in in_doubt  # stored, and its delivery was unknown here
    assert len(stored) == len(set(stored)) and not set(stored) & set(unsent)
    assert sorted(set(stored) | set(unsent) | set(in_doubt)) == published
    if on_error == "log":  # the child was started again for the later steps
        assert set(range(556, 562)) <= set(stored)
    for file in sorted(spill.glob("*.jsonl")):
        replay_file(file, root=root)
    assert sorted(r.step for r in read_records(_run_dir(root) / "metrics.jsonl")) == published


@pytest.mark.anyio
async def test_a_batch_mlflow_stored_in_part_is_spilled_in_doubt(tmp_path: Path) -> None:
    """A batch MLflow takes in two requests, the second refused: the first request's points
    are stored, so the child's error says the batch is in doubt and the service spills it
    apart (``*.inflight.jsonl``), not as unsent; a batch refused whole is not in doubt."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from recis_async.trackers import TrackerService

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, artifact_location=str(tmp_path / "art"))  # a SubprocessTracker
    service = TrackerService(
        tracker,
        RunSpec(project="p", name="n"),
        flush_interval=0,
        on_error="log",
        spill_dir=tmp_path / "spill",
    )
    refused = {"k" * 300: 1.0}  # MLflow refuses a name over 250 characters (ours never pass)
    first = [StepRecord(s, 1000.0 + s, {"loss": s / 10}) for s in range(1000)]  # one request
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        assert await service.wait_started()
        await service.put(StepRecord(0, 999.0, refused))  # refused whole: nothing landed
        await service.flush()
        for record in [*first, StepRecord(1000, 2000.0, refused)]:
            assert service.put_nowait(record, 64)
        await service.flush()
        await service.aclose(anyio.current_time() + 30)
    spill = tmp_path / "spill"
    (unsent,) = [p for p in spill.glob("*.jsonl") if not p.name.endswith(".inflight.jsonl")]
    (in_doubt,) = spill.glob("*.inflight.jsonl")
    assert [(r.step, list(r.values)) for r in read_records(unsent)] == [(0, list(refused))]
    assert [r.step for r in read_records(in_doubt)] == list(range(1001))
    assert service.run_id is not None
    history = MlflowClient(uri).get_metric_history(service.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1000))  # the first request's, once


@pytest.mark.anyio
async def test_the_stored_prefix_a_child_reports_is_neither_spilled_nor_lost(
    tmp_path: Path,
) -> None:
    """The child's tracker stored 3 records of a batch and said so (``delivered``): the
    parent counts those delivered and spills only the rest."""
    from recis_async.trackers import TrackerService

    root = tmp_path / "runs"
    service = TrackerService(
        SubprocessTracker(functools.partial(PrefixTracker, root)),
        RunSpec(project="p", name="n"),
        flush_interval=0,
        on_error="log",
        spill_dir=tmp_path / "spill",
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        assert await service.wait_started()
        for step in range(880, 890):
            assert service.put_nowait(StepRecord(step, float(step), {"x": 1.0}), 64)
        await service.flush()
        await service.aclose(anyio.current_time() + 30)
    stored = [r.step for r in read_records(_run_dir(root) / "metrics.jsonl")]
    spilled = [r.step for p in service.spill_files for r in read_records(p)]
    assert stored == [880, 881, 882] and spilled == list(range(883, 890))
    assert not any(p.name.endswith(".inflight.jsonl") for p in service.spill_files)
    assert service.stats()["logged"] == 3
