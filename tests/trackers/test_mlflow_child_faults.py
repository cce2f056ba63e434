"""The MLflow child stopped (SIGSTOP) or killed: the process exits by the close deadline, the
records in doubt are settled by the replay command, no run is left RUNNING."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

from recis_async.trackers import read_records  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS, STOP_AT, DEADLINE = 600, 300, 3.0
# The killed child's test is about the restart, not the deadline: the new child is a cold
# interpreter importing mlflow and reopening the store (3.4-5 s with mlflow 3.17 on a loaded
# 2-core machine, ~0.7 s of steps left after the kill), so its close gets time for that; the
# deadline itself is the stopped child's test.
RESTART_DEADLINE = 30.0

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import anyio
    from recis_async import HookBus, add_to_ml_tracker
    from recis_async.events import AfterStep, BeforeStep, Start
    from recis_async.hooks import MLTrackerHook
    from recis_async.trackers import MlflowTracker

    uri, spill, backend, mode = sys.argv[1:5]
    DEADLINE, STEPS, STOP_AT = map(float, sys.argv[5:8])
    STEPS, STOP_AT = int(STEPS), int(STOP_AT)

    async def main():
        tracker = MlflowTracker(uri)
        hook = MLTrackerHook("faults", "job", tracker=tracker, spill_dir=spill,
                             flush_interval=0.01, on_error="log")
        try:
            async with HookBus(flush_timeout=DEADLINE) as bus:
                bus.add_hook(hook)
                await bus.publish(Start())
                for step in range(STEPS):
                    if step == STOP_AT:
                        os.kill(tracker.pid, signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
                    await bus.publish(BeforeStep(global_step=step))
                    add_to_ml_tracker("loss", float(step))
                    await bus.publish(AfterStep(global_step=step))
                    await anyio.sleep(0.002)
                print(json.dumps({"run_id": tracker.run_id}), flush=True)
                print("CLOSING", time.time(), flush=True)
        except Exception as exc:
            print("CLOSE ERROR", type(exc).__name__, exc, flush=True)

    anyio.run(main, backend=backend)
    """
)


def _run(
    tmp_path: Path, backend: str, mode: str, deadline: float = DEADLINE
) -> tuple[str, str, Path, float, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spill = tmp_path / "spill"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, str(script), uri, str(spill), backend, mode]
        + [str(deadline), str(STEPS), str(STOP_AT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    exited = time.time()
    closing = [line for line in out.splitlines() if line.startswith("CLOSING")]
    assert closing, out
    run_id = json.loads(out.split("CLOSING")[0].strip().splitlines()[-1])["run_id"]
    return uri, run_id, spill, exited - float(closing[0].split()[1]), out


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stopped_child_is_killed_at_the_deadline_and_replay_settles_the_run(
    tmp_path: Path, backend: str
) -> None:
    uri, run_id, spill, exit_s, out = _run(tmp_path, backend, "stop")
    # Bounded: the close deadline plus a few seconds (it was ~300 s: the call's own timeout).
    assert exit_s < DEADLINE + 8, (exit_s, out)
    client = MlflowClient(uri)
    stored = [m.step for m in client.get_metric_history(run_id, "loss")]
    files = sorted(spill.glob("*.jsonl"))
    spilled = [r.step for path in files for r in read_records(path)]
    assert sorted(set(stored) | set(spilled)) == list(range(STEPS))  # nothing lost
    assert len(stored) == len(set(stored))
    assert "settle them with python -m recis_async.trackers.replay" in out or not any(
        p.name.endswith(".inflight.jsonl") for p in files
    )
    done = subprocess.run(
        [sys.executable, "-m", "recis_async.trackers.replay", *map(str, files)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert steps == list(range(STEPS))  # each step once: nothing doubled by the replay
    assert client.get_run(run_id).info.status == "FAILED"  # not left RUNNING
    assert not list(spill.glob("*.jsonl"))  # settled files are removed
    again = subprocess.run(  # a second replay of a settled file is refused, not doubled
        [sys.executable, "-m", "recis_async.trackers.replay", str(files[0])],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    assert again.returncode == 1 and "No such file" in again.stderr


def test_a_killed_child_is_restarted_on_the_same_run(tmp_path: Path) -> None:
    uri, run_id, spill, exit_s, out = _run(tmp_path, "asyncio", "kill", RESTART_DEADLINE)
    assert "starting it again (1 of 3)" in out, out
    client = MlflowClient(uri)
    stored = [m.step for m in client.get_metric_history(run_id, "loss")]
    files = sorted(spill.glob("*.jsonl"))
    # records unsent are spilled; those sent when the child died are in doubt (.inflight):
    # maybe stored, maybe not -- the replay settles them against the run
    unsent = [r.step for p in files if not p.name.endswith(".inflight.jsonl") for r in read_records(p)]
    in_doubt = [r.step for p in files if p.name.endswith(".inflight.jsonl") for r in read_records(p)]
    assert len(stored) == len(set(stored)) and not set(stored) & set(unsent)
    assert sorted(set(stored) | set(unsent) | set(in_doubt)) == list(range(STEPS))
    assert client.get_run(run_id).info.status == "FINISHED"  # the restarted child finished it
    assert out.count("log before start") == 0
    if files:
        done = subprocess.run(
            [sys.executable, "-m", "recis_async.trackers.replay", *map(str, files)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert steps == list(range(STEPS))  # each step once after the replay
