"""The adapters with the real frameworks: a short CPU job per framework carrying the trace,
tracker, logger and NaN hooks, read back complete and once; a hook's stop request stopping
the framework's loop at that step; a failure, a Ctrl-C and a scheduler's SIGTERM ending the
job with every row of the steps the hooks were handed delivered; the hooks' state travelling
with the framework's checkpoints, and a job killed with SIGKILL and resumed from them tracing
each step once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("ignite")

import peers_support as ps  # noqa: E402
from subprocess_support import torchrun_argv, wait_for  # noqa: E402
from terminal import Terminal  # noqa: E402

from recis_async.errors import HookError  # noqa: E402
from recis_async.events import AfterLoadCheckpoint, AfterStep, BeforeSaveCheckpoint, End, Start  # noqa: E402
from recis_async.hook import Hook  # noqa: E402
from recis_async.syncbus import SyncHookBus  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "peer_job.py"
RESUME = Path(__file__).parent / "scripts" / "resume_job.py"
STEPS = 5  # per epoch


class Events(Hook):
    """Records the events of a run, by type name (training steps with their global step)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def start(self, event: Start) -> None:
        self.seen.append("Start")

    def after_step(self, event: AfterStep) -> None:
        if event.is_train:
            self.seen.append(f"AfterStep{event.global_step}")
            assert "loss" in event.metrics

    def end(self, event: End) -> None:
        self.seen.append(f"End:{event.status}")


@pytest.mark.parametrize("framework", ps.FRAMEWORKS)
def test_a_short_job_delivers_every_row_and_record_once(framework: str, tmp_path: Path) -> None:
    events = Events()
    hooks, lines, published = ps.job_hooks(tmp_path, events)
    ran = ps.run_job(framework, tmp_path, hooks, rows=ps.ROWS * STEPS, epochs=2)
    assert ran == 2 * STEPS
    ps.check_delivered(tmp_path, published.steps, rows_per_epoch=ps.ROWS * STEPS)
    assert published.steps == list(range(2 * STEPS))
    assert events.seen == ["Start", *(f"AfterStep{i}" for i in range(2 * STEPS)), "End:ok"]
    assert len(lines.lines) == STEPS  # LoggerHook(log_step=2): at steps 1, 3, ... 9
    assert all("<loss=" in line for line in lines.lines), lines.lines


@pytest.mark.parametrize("framework", ps.FRAMEWORKS)
def test_a_hooks_stop_request_stops_the_framework_at_that_step(
    framework: str, tmp_path: Path
) -> None:
    hooks, _, published = ps.job_hooks(tmp_path, ps.StopAt(3))
    ran = ps.run_job(framework, tmp_path, hooks, rows=ps.ROWS * 50)
    assert ran == 4  # steps 0..3
    ps.check_delivered(tmp_path, published.steps)
    assert published.steps == [0, 1, 2, 3]


@pytest.mark.parametrize("framework", ps.FRAMEWORKS)
def test_a_failing_step_closes_the_bus_with_the_rows_before_it(
    framework: str, tmp_path: Path
) -> None:
    events = Events()
    hooks, _, published = ps.job_hooks(tmp_path, events)
    with pytest.raises(RuntimeError, match="boom"):
        ps.run_job(framework, tmp_path, hooks, rows=ps.ROWS * 50, fail_at=4)
    assert events.seen[-1] == "End:failed"
    ps.check_delivered(tmp_path, published.steps)
    assert published.steps == [0, 1, 2, 3]
    # whatever handlers the framework put back at its teardown (Lightning's are the closed
    # bus's), Ctrl-C still interrupts this process
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_a_nan_loss_fails_the_job_at_that_step(tmp_path: Path, tensor_path: str) -> None:
    """NanTensorHook reads the loss the adapter put into AfterStep.metrics: a CPU loss, read at
    the call, fails step 2's publish; on a device the NaN of step 2 is acted on its default lag
    of 2 steps later, at step 4's publish."""
    import torch

    hooks, _, published = ps.job_hooks(tmp_path)
    original = ps.Net.forward

    def nan_at_2(self: Any, **batch: Any) -> Any:
        out = original(self, **batch)
        if self.training and int(batch["ids"][0]) == 2 * ps.ROWS:
            out["loss"] = out["loss"] * torch.tensor(float("nan"))
        return out

    ps.Net.forward = nan_at_2  # type: ignore[method-assign]
    try:
        found = r" \(found at global_step 4\)" if tensor_path == "device" else "$"
        with pytest.raises(HookError, match=rf"NanTensorHook.*at global_step 2{found}"):
            ps.run_job("ignite", tmp_path, hooks, rows=ps.ROWS * 20)
    finally:
        ps.Net.forward = original  # type: ignore[method-assign]
    assert published.steps == ([0, 1, 2, 3] if tensor_path == "device" else [0, 1])


def test_a_given_bus_is_left_open_for_its_owner(tmp_path: Path) -> None:
    events = Events()
    hooks, _, published = ps.job_hooks(tmp_path, events)
    with SyncHookBus() as bus:
        ps.run_job("lightning", tmp_path, hooks, rows=ps.ROWS * 3, bus=bus)
        assert events.seen[-1] == "AfterStep2"  # no End yet: the bus is the caller's
        assert all(any(h is hook for h in bus.hooks) for hook in hooks)
    assert events.seen[-1] == "End:ok"
    ps.check_delivered(tmp_path, published.steps)


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
@pytest.mark.parametrize("framework", ps.FRAMEWORKS)
def test_a_stop_signal_ends_the_job_preempted_with_its_rows_delivered(
    framework: str, stop: str, tmp_path: Path
) -> None:
    """One Ctrl-C in the job's terminal, or one SIGTERM to its process group (a scheduler's):
    the job stops at the next step boundary, every row of every step the hooks were handed is
    in Parquet once, nothing spilled, the tracker's run is ``preempted`` and the process exits
    with 128 + the signal.  (Lightning quits on a SIGTERM of its own accord with exit status
    0, which a scheduler reads as a finished job: the run was marked failed and the process
    exited 0 until the adapter took that exit for the preemption it is.)  The disk is made
    slower than the steps (50 ms a write), as on a loaded machine: the batch sealed by the
    step after the stop then finds the writer's queue full, and was spilled (steps 8-11 of
    Ignite's run, found once in three full runs before the disk was slowed here)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    argv = [sys.executable, str(SCRIPT), framework, str(tmp_path), "0.05"]
    signum = signal.SIGINT if stop == "ctrl-c" else signal.SIGTERM
    with Terminal(argv, env=env) as term:
        term.expect(b"ready", timeout=240)
        if stop == "ctrl-c":
            term.press(b"\x03")
        else:
            os.killpg(term.proc.pid, signal.SIGTERM)
        rc = term.wait(timeout=240)
    assert rc == 128 + signum, term.text
    assert "Traceback" not in term.text, term.text
    assert "finished without a stop" not in term.text
    steps = [int(s) for s in (tmp_path / "published.txt").read_text().split()]
    assert len(steps) >= 11
    ps.check_delivered(tmp_path, steps)
    (run,) = (tmp_path / "ml").rglob("run.json")
    assert json.loads(run.read_text())["status"] == "preempted"


class Counting(Hook):
    """A hook with state: the training steps it saw, over resumes."""

    def __init__(self) -> None:
        self.count = 0
        self.saves: list[int] = []
        self.loaded: list[int] = []

    def after_step(self, event: AfterStep) -> None:
        if event.is_train:
            self.count += 1

    def before_save_checkpoint(self, event: BeforeSaveCheckpoint) -> None:
        self.saves.append(event.global_step)

    def after_load_checkpoint(self, event: AfterLoadCheckpoint) -> None:
        self.loaded.append(event.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


@pytest.mark.parametrize("framework", ps.FRAMEWORKS)
def test_hook_state_travels_with_the_frameworks_checkpoint(framework: str, tmp_path: Path) -> None:
    first, second = Counting(), Counting()
    ps.checkpoint_and_resume(framework, tmp_path, first, second, steps=STEPS)
    assert first.count == STEPS and first.saves == [STEPS]
    assert second.loaded == [STEPS]
    assert second.count == 2 * STEPS  # restored, then the second epoch's steps


@pytest.mark.parametrize("framework", ps.FRAMEWORKS)
def test_kill_9_then_resume_from_the_frameworks_checkpoint_traces_each_step_once(
    framework: str, tmp_path: Path
) -> None:
    """A job checkpointing with its framework's own checkpoints every 8 steps is killed with
    SIGKILL (a preemption without grace) at step 21, once the rows of steps 0-20 are on disk,
    and resumed from its newest checkpoint (step 16) as that framework resumes.  The steps
    from the checkpoint to the kill, trained again, are not traced again (the trace hook's
    run travels in the checkpoint, and the sink names the steps each file holds); every step
    is in the table once."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    argv = [sys.executable, str(RESUME), framework, str(tmp_path)]
    first = subprocess.Popen(
        [*argv, "--kill-after", "21"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # read with stdout: a full stderr pipe would stall the job
        text=True,
        env=env,
    )
    try:
        wait_for(first, "ready", timeout=240)
    finally:
        first.kill()
        first.communicate(timeout=60)
    before = _traced_steps(tmp_path)
    assert set(range(21)) <= set(before), sorted(before)
    done = subprocess.run([*argv, "--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "were delivered before it stopped; resumed at step 16" in done.stderr, done.stderr
    counts = Counter(_traced_steps(tmp_path))
    assert counts == dict.fromkeys(range(48), ps.ROWS), sorted(counts.items())
    assert not (tmp_path / "spill").exists() or not list((tmp_path / "spill").iterdir())


def _traced_steps(out: Path) -> list[int]:
    """The ``step`` column of every row in the Parquet files (one entry per row)."""
    files = [str(p) for p in (out / "t").rglob("*.parquet")]
    return ds.dataset(files, format="parquet").to_table(columns=["step"])["step"].to_pylist()


def test_a_hugging_face_step_over_micro_batches_traces_each(tmp_path: Path) -> None:
    """``gradient_accumulation_steps=2``: a ``Trainer`` step runs the model on two
    micro-batches, each tracing its rows; the step's trace holds both (it failed at the
    second micro-batch's ``add_to_trace`` before), and every row is in Parquet once."""
    from recis_async.adapters.transformers import RecisTrainerCallback
    from recis_async.events import TraceParts

    parts: list[int] = []

    class Parts(Hook):
        def after_step(self, event: AfterStep) -> None:
            if event.is_train:
                column = event.trace["id"]
                parts.append(len(column) if type(column) is TraceParts else 1)

    hooks, _, published = ps.job_hooks(tmp_path, Parts())
    callback = RecisTrainerCallback(hooks)
    trainer = ps.hf_job(tmp_path, callback, rows=ps.ROWS * 8, gradient_accumulation_steps=2)
    assert trainer.state.global_step == 4
    assert published.steps == [0, 1, 2, 3] and parts == [2, 2, 2, 2]
    assert Counter(ps.traced_ids(tmp_path)) == Counter(range(ps.ROWS * 8))
    assert sorted(ps.tracked_steps(tmp_path)) == [0, 1, 2, 3]


def test_a_hugging_face_job_failing_outside_a_with_block_still_exits_with_its_rows(
    tmp_path: Path,
) -> None:
    """The ``Trainer`` tells no callback that it failed, so a run not wrapped in ``with
    callback:`` leaves the bus open: the bus is closed as the program ends (``End``: failed),
    its rows delivered, and the process exits with the model's error.  It waited forever at
    exit on the bus's worker thread, a SIGTERM included."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "hf_fails.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "RuntimeError: boom" in done.stderr
    assert "SyncHookBus still open as the program ends after RuntimeError: boom" in done.stderr
    ps.check_delivered(tmp_path, [0, 1, 2])
    (run,) = (tmp_path / "ml").rglob("run.json")
    assert json.loads(run.read_text())["status"] == "failed"


@pytest.mark.slow
@pytest.mark.parametrize("framework", ps.FRAMEWORKS)
def test_a_stop_requested_on_one_rank_stops_every_rank_at_the_same_step(
    framework: str, tmp_path: Path
) -> None:
    """A distributed job (2 ranks, gloo, CPU: Lightning's own DDP launcher, ``torchrun`` for
    the others) whose hook on rank 0 alone requests a stop after step 5: the ranks agree,
    and every rank stops after step 6, its rows delivered.  Rank 0 used to stop alone,
    leaving rank 1 in the next step's gradient collective until rank 0's exit broke it."""
    script = SCRIPT.parent / "dist_job.py"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "OMP_NUM_THREADS": "1",
    }
    argv = (
        [sys.executable, str(script), framework, str(tmp_path)]  # Lightning starts rank 1
        if framework == "lightning"
        else torchrun_argv(script, framework, str(tmp_path))
    )
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        published = (tmp_path / f"published{rank}.txt").read_text().split()
        assert published == [str(step) for step in range(7)], (rank, done.stderr[-3000:])
    ids = ps.traced_ids(tmp_path)
    assert len(ids) == 2 * 7 * ps.ROWS and len(set(ids)) == len(ids)


def test_ignite_handles_get_batch_completed_only_while_after_data_has_a_subscriber(
    tmp_path: Path,
) -> None:
    """A hook subscribing to ``AfterData`` during the run receives it from the next batch on,
    in its place between ``BeforeStep`` and ``AfterStep``; once it unsubscribes, the adapter's
    ``GET_BATCH_COMPLETED`` handler is gone again (each handler costs Ignite's every step)."""
    from ignite.engine import Events as IgniteEvents

    from recis_async.adapters.ignite import attach
    from recis_async.events import AfterData, BeforeStep

    seen: list[str] = []
    handled: list[bool] = []

    class Late(Hook):
        """At step 1 subscribes to the step's events; at step 3 unsubscribes."""

        def __init__(self) -> None:
            self.subscriptions: list[Any] = []

        def after_step(self, event: AfterStep) -> None:
            seen.append(f"AfterStep{event.global_step}")
            handled.append(
                engine.has_event_handler(adapter._batch_completed, IgniteEvents.GET_BATCH_COMPLETED)
            )
            if event.global_step == 1:
                for kind in (BeforeStep, AfterData):
                    self.subscriptions.append(bus.subscribe(kind, self.record))
            elif event.global_step == 3:
                for subscription in self.subscriptions:
                    bus.unsubscribe(subscription)

        def record(self, event: Any) -> None:
            seen.append(f"{type(event).__name__}{event.global_step}")

    def attached(e: Any) -> Any:
        nonlocal engine, adapter, bus
        engine = e
        adapter = attach(e, [Late()], bus=bus)
        return adapter

    engine: Any = None
    adapter: Any = None
    with SyncHookBus(handle_signals=False) as bus:
        ps.ignite_job(tmp_path, attached, rows=ps.ROWS * 6)
    assert seen == [
        "AfterStep0",
        "AfterStep1",
        *("BeforeStep2", "AfterData2", "AfterStep2"),
        *("BeforeStep3", "AfterData3", "AfterStep3"),
        "AfterStep4",
        "AfterStep5",
    ]
    # whether the handler was there at each step's end: added when step 1 ended, removed
    # when step 3 did
    assert handled == [False, False, True, True, False, False]


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_backward_and_optimizer_step_events_reach_their_subscribers(
    framework: str, tmp_path: Path
) -> None:
    """The framework's backward and optimizer callbacks become ``AfterBackward(sync=True)``
    and ``AfterOptimizerStep`` carrying the framework's optimizer, once a step, before its
    ``AfterStep`` (the adapter works out what they carry only when they are received)."""
    import torch

    from recis_async.events import AfterBackward, AfterOptimizerStep

    seen: list[tuple[str, int, Any]] = []

    class Steps(Hook):
        def attach(self, bus: Any) -> None:
            super().attach(bus)
            bus.subscribe(AfterBackward, lambda e: seen.append(("backward", e.global_step, e.sync)))
            bus.subscribe(
                AfterOptimizerStep,
                lambda e: seen.append(("optimizer", e.global_step, type(e.optimizers[0]))),
            )

        def after_step(self, event: AfterStep) -> None:
            if event.is_train:
                seen.append(("step", event.global_step, None))

    ps.run_job(framework, tmp_path, [Steps()], rows=ps.ROWS * 3)
    optimizer = seen[1][2]
    assert issubclass(optimizer, torch.optim.Optimizer), seen
    assert seen == [
        entry
        for step in range(3)
        for entry in (
            ("backward", step, True),
            ("optimizer", step, optimizer),
            ("step", step, None),
        )
    ]


class Late(Hook):
    """Subscribes to ``BeforeStep``, ``AfterData`` and ``AfterBackward`` in step 1's
    ``AfterStep`` and unsubscribes in step 3's, recording what it receives; ``probe()`` is
    called at each step's end (whether the framework calls the adapter inside the step)."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.seen: list[str] = []
        self.followed: list[bool] = []
        self.subscriptions: list[Any] = []

    def attach(self, bus: Any) -> None:
        self.bus = bus

    def after_step(self, event: AfterStep) -> None:
        from recis_async.events import AfterBackward, AfterData, BeforeStep

        self.seen.append(f"AfterStep{event.global_step}")
        self.followed.append(self.probe())
        if event.global_step == 1:
            for kind in (BeforeStep, AfterData, AfterBackward):
                self.subscriptions.append(self.bus.subscribe(kind, self.record))
        elif event.global_step == 3:
            for subscription in self.subscriptions:
                self.bus.unsubscribe(subscription)

    def record(self, event: Any) -> None:
        self.seen.append(f"{type(event).__name__}{event.global_step}")

    @staticmethod
    def expected(*inside: str) -> list[str]:
        """What it records over a six-step job whose adapter publishes the events ``inside``
        from inside a step: every ``AfterStep``, and those events before it in steps 2-3."""
        seen: list[str] = []
        for step in range(6):
            seen += [f"{name}{step}" for name in inside] if step in (2, 3) else []
            seen.append(f"AfterStep{step}")
        return seen


def test_ignite_handles_get_batch_started_only_while_a_hook_receives_an_event_inside_the_step(
    tmp_path: Path,
) -> None:
    """While no hook receives ``BeforeStep`` or another event from inside the step, the adapter
    has no ``GET_BATCH_STARTED`` handler (each handler costs Ignite's every step) and
    ``ITERATION_COMPLETED`` publishes the step whole; a hook subscribing in a step's
    ``AfterStep`` receives ``BeforeStep`` and ``AfterData`` from the next step on, in their
    places, and the handler goes once it unsubscribes.  The rows of every step arrive once."""
    from ignite.engine import Events as IgniteEvents

    from recis_async.adapters.ignite import attach

    adapter: Any = None
    engine: Any = None
    late = Late(
        lambda: engine.has_event_handler(adapter._batch_started, IgniteEvents.GET_BATCH_STARTED)
    )
    hooks, _, published = ps.job_hooks(tmp_path, late)

    def attached(e: Any) -> Any:
        nonlocal engine, adapter
        engine, adapter = e, attach(e, hooks)
        return adapter

    ps.ignite_job(tmp_path, attached, rows=ps.ROWS * 6)
    assert late.seen == Late.expected("BeforeStep", "AfterData")
    assert late.followed == [False, False, True, True, False, False]
    assert published.steps == list(range(6))
    ps.check_delivered(tmp_path, published.steps)


def test_hugging_face_begins_a_step_at_its_start_only_while_a_hook_receives_an_event_inside_it(
    tmp_path: Path,
) -> None:
    """Hugging Face calls every callback at every point of a step: while no hook receives
    ``BeforeStep`` or another event from inside the step, ``on_step_begin`` publishes nothing
    and the step is published whole when it ends (on a logging step, at ``on_log``, with what
    the ``Trainer`` logged); a hook subscribing in a step's ``AfterStep`` receives
    ``BeforeStep``, ``AfterData`` and ``AfterBackward`` from the next step on, in their order.
    The rows of every step arrive once."""
    from recis_async.adapters.transformers import RecisTrainerCallback

    begun: list[bool] = []  # the driver's begin_step calls in the step under way

    def probe() -> bool:
        was = bool(begun)
        begun.clear()
        return was

    late = Late(probe)
    metrics: list[dict[str, Any]] = []

    class Logged(Hook):
        def after_step(self, event: AfterStep) -> None:
            metrics.append(dict(event.metrics))

    hooks, _, published = ps.job_hooks(tmp_path, late, Logged())
    callback = RecisTrainerCallback(hooks)
    begin_step = callback._driver.begin_step

    def counted(*args: Any, **kwargs: Any) -> None:
        begun.append(True)
        begin_step(*args, **kwargs)

    callback._driver.begin_step = counted
    ps.hf_job(tmp_path, callback, rows=ps.ROWS * 6)
    assert late.seen == Late.expected("BeforeStep", "AfterData", "AfterBackward")
    assert late.followed == [False, False, True, True, False, False]
    assert published.steps == list(range(6))
    # logging_steps=3: the steps ending at global steps 3 and 6 carry what the Trainer logged
    assert ["learning_rate" in m for m in metrics] == [False, False, True, False, False, True]
    assert all("loss" in m for m in metrics)
    ps.check_delivered(tmp_path, published.steps)


def test_lightning_calls_the_callbacks_inside_a_step_only_while_a_hook_receives_their_events(
    tmp_path: Path,
) -> None:
    """Lightning calls every callback at every point of a step, inside a profiler context,
    unless the callback's attribute is not callable: the adapter's points that publish nothing
    now are not called at all (read from Lightning's own profiler, which names each callback
    call), ``on_before_backward`` / ``on_before_zero_grad`` never; a hook subscribing in a
    step's ``AfterStep`` receives ``BeforeStep``, ``AfterData`` and ``AfterBackward`` from the
    next step on, in their order.  The rows of every step arrive once."""
    from lightning.pytorch.profilers import Profiler

    from recis_async.adapters.lightning import RecisCallback

    class Calls(Profiler):
        """Counts Lightning's calls of the adapter's callback points."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}

        def start(self, action_name: str) -> None:
            if action_name.startswith("[Callback]RecisCallback"):
                point = action_name.rsplit(".", 1)[1]
                self.calls[point] = self.calls.get(point, 0) + 1

        def stop(self, action_name: str) -> None:
            pass

    calls = Calls()
    late = Late(lambda: calls.calls.get("on_after_backward", 0))
    hooks, _, published = ps.job_hooks(tmp_path, late)
    ps.lightning_job(tmp_path, RecisCallback(hooks), rows=ps.ROWS * 6, profiler=calls)
    assert late.seen == Late.expected("BeforeStep", "AfterData", "AfterBackward")
    # on_after_backward's calls counted at each step's end: in steps 2 and 3 only
    assert late.followed == [0, 0, 1, 2, 2, 2]
    assert calls.calls["on_train_batch_end"] == 6
    assert calls.calls["on_train_batch_start"] == 2
    assert calls.calls["on_after_backward"] == 2
    for point in ("on_before_backward", "on_before_zero_grad", "on_before_optimizer_step"):
        assert point not in calls.calls, calls.calls
    assert published.steps == list(range(6))
    ps.check_delivered(tmp_path, published.steps)


def test_what_a_lightning_step_logs_is_in_its_after_step_metrics(tmp_path: Path) -> None:
    """``self.log(..., on_step=True)`` in the training step (the job logs twice the loss)
    reaches that step's ``AfterStep.metrics`` beside the loss, on every step."""
    from recis_async.adapters.lightning import RecisCallback

    seen: list[dict[str, Any]] = []

    class Metrics(Hook):
        def after_step(self, event: AfterStep) -> None:
            seen.append(dict(event.metrics))

    ps.lightning_job(tmp_path, RecisCallback([Metrics()]), rows=ps.ROWS * 3)
    assert len(seen) == 3
    for metrics in seen:
        assert sorted(metrics) == ["double_loss", "loss"], metrics
        assert metrics["double_loss"] == pytest.approx(2 * metrics["loss"])


def test_what_a_lightning_validation_step_returns_is_in_its_after_step_metrics(
    tmp_path: Path,
) -> None:
    """A validation step returning ``{"acc": ...}`` (no loss) or ``{"loss": ..., "acc":
    ...}``: its one-element entries reach that evaluation step's ``AfterStep.metrics``, the
    loss as ``loss``, and the training steps carry none of them."""
    import lightning.pytorch as pl
    import torch

    from recis_async.adapters.lightning import RecisCallback

    seen: list[tuple[bool, dict[str, Any]]] = []

    class Metrics(Hook):
        def after_step(self, event: AfterStep) -> None:
            seen.append((event.is_train, dict(event.metrics)))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = ps.Net()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            return self.net(**batch)["loss"]

        def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            acc = torch.tensor(0.25 * (batch_idx + 1))
            if batch_idx == 0:
                return {"acc": acc}
            return {"loss": self.net(**batch)["loss"], "acc": acc}

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[RecisCallback([Metrics()])],
        default_root_dir=str(tmp_path / "pl"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
    )
    loader = torch.utils.data.DataLoader(ps.Rows(ps.ROWS * 2), batch_size=ps.ROWS)
    trainer.fit(Module(), loader, loader)
    evals = [metrics for is_train, metrics in seen if not is_train]
    assert [sorted(m) for m in evals] == [["acc"], ["acc", "loss"]], seen
    assert [m["acc"] for m in evals] == [0.25, 0.5]
    assert all("acc" not in metrics for is_train, metrics in seen if is_train), seen


def test_a_lightning_callback_subclass_keeps_its_own_step_callbacks(tmp_path: Path) -> None:
    """The callback hides the points of a step that publish nothing, but never a subclass's
    own override of one: Lightning calls it on every step."""
    from recis_async.adapters.lightning import RecisCallback

    calls: list[str] = []

    class Mine(RecisCallback):
        def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            calls.append("zero_grad")

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            calls.append("backward")
            super().on_after_backward(trainer, pl_module)

    ps.lightning_job(tmp_path, Mine([Events()]), rows=ps.ROWS * 3)
    assert sorted(calls) == ["backward"] * 3 + ["zero_grad"] * 3
