"""Trackers on a full disk: whole records or none, spills that find a place or say what is lost.

The full disk is a real 64 KiB tmpfs where this process may mount one (root), and otherwise
``RLIMIT_FSIZE``, which makes the same ``write`` call fail (EFBIG) at the same size, so the
test runs wherever CI runs.  Records are counted back with :func:`read_records`: published =
delivered + spilled + lost, none doubled.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from recis_async.trackers import JsonlTracker, RunSpec, StepRecord, TrackerService, read_records

DISK_BYTES = 64 << 10


@contextlib.contextmanager
def full_disk(where: Path, how: str) -> Iterator[Path]:
    """A folder whose files cannot grow past ``DISK_BYTES``, by ``how``."""
    where.mkdir()
    if how == "tmpfs":
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(where)],
            capture_output=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        try:
            yield where
        finally:
            subprocess.run(["umount", "-l", str(where)], check=True)
        return
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (DISK_BYTES, old[1]))
    try:
        yield where
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_handler)


def _record(step: int) -> StepRecord:
    # ~300 bytes a line: the disk fills after ~200 steps, midway through a batch
    return StepRecord(step, time.time(), {f"metric_{i:02d}": step + i / 10 for i in range(12)})


async def _publish(service: TrackerService, steps: int) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        for step in range(steps):
            await service.put(_record(step))
            if step % 37 == 36:
                await service.flush()  # batches of 37 lines: the full disk cuts one midway
        service.set_status("ok")
        with contextlib.suppress(Exception):
            await service.aclose(anyio.current_time() + 10)


def _steps(path: Path | None) -> list[int]:
    return [r.step for r in read_records(path)] if path is not None and path.exists() else []


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["tmpfs", "rlimit"])
async def test_a_batch_cut_by_a_full_disk_is_truncated_then_spilled(
    tmp_path: Path, how: str
) -> None:
    published = 400
    with full_disk(tmp_path / "disk", how) as disk:
        tracker = JsonlTracker(disk)
        service = TrackerService(
            tracker, RunSpec(project="p", name="n"), spill_dir=tmp_path / "spill", on_error="log"
        )
        await _publish(service, published)
        assert tracker.run_dir is not None
        metrics = tracker.run_dir / "metrics.jsonl"
        assert metrics.read_bytes().endswith(b"\n")  # no torn line left behind
        delivered = _steps(metrics)
    spilled = [step for path in service.spill_files for step in _steps(path)]
    assert 0 < len(delivered) < published and spilled  # the disk did fill
    assert sorted(delivered + spilled) == list(range(published))  # none lost, none doubled
    stats = service.stats()
    assert (stats["logged"], stats["spilled"], stats["lost"]) == (
        len(delivered),
        len(spilled),
        0,
    )


@pytest.mark.anyio
async def test_a_spill_on_the_same_full_disk_goes_to_the_temp_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    published = 400
    with full_disk(tmp_path / "disk", "tmpfs") as disk:
        tracker = JsonlTracker(disk / "runs")
        service = TrackerService(
            tracker, RunSpec(project="p", name="n"), spill_dir=disk / "spill", on_error="log"
        )
        await _publish(service, published)
        assert not list((disk / "spill").glob("*.jsonl"))  # no 0-byte spill file left
        assert tracker.run_dir is not None
        delivered = _steps(tracker.run_dir / "metrics.jsonl")
    assert all(
        path.parent == tmp_path / "tmp" / "recis_async_spill" for path in service.spill_files
    )
    spilled = [step for path in service.spill_files for step in _steps(path)]
    assert spilled and sorted(delivered + spilled) == list(range(published))


@pytest.mark.anyio
async def test_records_no_place_could_take_are_counted_lost_with_their_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Both places fail: the spill dir and the temp dir lie under a plain file.
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "file" / "tmp"))
    published = 400
    with full_disk(tmp_path / "disk", "rlimit") as disk, caplog.at_level(logging.ERROR):
        tracker = JsonlTracker(disk)
        service = TrackerService(
            tracker,
            RunSpec(project="p", name="n"),
            spill_dir=tmp_path / "file" / "spill",
            on_error="log",
        )
        await _publish(service, published)
        assert tracker.run_dir is not None
        delivered = _steps(tracker.run_dir / "metrics.jsonl")
    stats = service.stats()
    assert stats["spilled"] == 0 and service.spill_files == []
    assert stats["lost"] == published - len(delivered) > 0
    lost_lines = [r.getMessage() for r in caplog.records if "LOST" in r.getMessage()]
    first_lost = min(set(range(published)) - set(delivered))
    assert lost_lines and f"of steps {first_lost}-{first_lost + 36} are LOST" in lost_lines[0]
    assert "Not a directory" in lost_lines[0]


def test_read_records_skips_a_torn_last_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(
        b'{"step":0,"time":1.0,"values":{"a":1.0}}\n{"step":1,"time":2.0,"values":{"a":2.0}}\n'
        b'{"step":2,"time":3.0,"val'
    )
    with caplog.at_level(logging.WARNING):
        assert [r.step for r in read_records(path)] == [0, 1]
    assert "torn line of 25 bytes" in caplog.text
    path.write_bytes(b'{"step":0,"time":1.0,"val\n{"step":1,"time":2.0,"values":{}}\n')
    with pytest.raises(ValueError, match="metrics.jsonl line 1: expected a record"):
        read_records(path)  # a broken line that is not the last is not silently skipped


def test_a_resumed_jsonl_run_cuts_a_torn_tail_before_appending(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    tracker.start(RunSpec(project="p", name="n", run_id="r"))
    tracker.log([_record(0), _record(1)])
    tracker.finish("failed")
    assert tracker.run_dir is not None
    metrics = tracker.run_dir / "metrics.jsonl"
    with open(metrics, "ab") as fh:
        fh.write(b'{"step":2,"time":')  # the process died mid-write
    again = JsonlTracker(tmp_path)
    again.start(RunSpec(project="p", name="n", run_id="r"))
    again.log([_record(2), _record(3)])
    again.finish("ok")
    assert _steps(metrics) == [0, 1, 2, 3]
