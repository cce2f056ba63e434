"""A disk that fills up or stops taking writes under the Parquet root and the spill folder.

Every test counts rows back: the Parquet table read with pyarrow, the spill files read and
replayed with ``python -m recis_async.spill replay``, and the rows reported lost by count:
published = delivered + spilled + lost, no id twice.  The full disk is a 2 MiB tmpfs where
this process may mount one; the same call fails everywhere by a folder replaced by a file,
and by ``RLIMIT_FSIZE`` in a subprocess (``File too large`` for every write, as a full disk).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pyarrow.dataset as pads
import pytest

from recis_async import HookBus, HookError, add_to_trace
from recis_async.errors import SinkError, TraceDeliveryError
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink
from recis_async.spill import read_spill
from recis_async.trace.buffer import ColumnBuffer

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ["id", "emb"]
TYPES = ["bigint", "array<float>"]
ROWS = 1024  # per step: 1024 * (8 + 64 * 4) bytes = 264 KiB, one batch per step


def step_values(step: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(step * ROWS, (step + 1) * ROWS)
    emb = np.random.default_rng(step).random((ROWS, 64), dtype=np.float32)  # incompressible
    return ids, emb


async def publish_steps(bus: HookBus, steps: range) -> int:
    """Publish ``steps``; return the rows of every publish that returned."""
    published = 0
    for step in steps:
        await bus.publish(BeforeStep(global_step=step))
        ids, emb = step_values(step)
        add_to_trace("id", ids)
        add_to_trace("emb", emb)
        await bus.publish(AfterStep(global_step=step, samples=ROWS))
        published += ROWS
    return published


def hook(root: Path, spill: list[Path] | Path) -> TraceHook:
    return TraceHook(
        ParquetSink(root, "t", rank=0),
        FIELDS,
        TYPES,
        size_threshold=ROWS * (8 + 64 * 4),
        retries=1,
        retry_backoff=0.01,
        spill_dir=spill,
    )


def table_ids(root: Path) -> list[int]:
    table = root / "t"
    if not table.is_dir() or not any(table.glob("*.parquet")):
        return []
    return list(pads.dataset(table).to_table().column("id").to_pylist())


def spill_files(*folders: Path) -> list[Path]:
    return sorted(p for f in folders if f.is_dir() for p in f.glob("*.arrows"))


def spilled_ids(files: list[Path]) -> list[int]:
    ids: list[int] = []
    for path in files:
        for entry in read_spill(path).entries:
            ids += entry.batch.to_arrow().column("id").to_pylist()
    return ids


def replay(files: list[Path], root: Path) -> list[int]:
    """Replay every spill file into ``root/t`` with the command line; return its ids."""
    for path in files:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "recis_async.spill",
                "replay",
                str(path),
                "--parquet",
                str(root),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "delivered 1 batch(es)" in done.stdout
    return table_ids(root)


def lost_error(exc: BaseException) -> TraceDeliveryError:
    """The error a loss raises: a TraceDeliveryError (TraceRowsLostError) with ``lost_rows``."""
    cause = exc.__cause__
    assert isinstance(cause, TraceDeliveryError) and hasattr(cause, "lost_rows"), repr(exc)
    return cause


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, where mounting works (root in a container); skipped elsewhere -- the
    tests below without it make the same call fail by other means."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system temp dir the writer falls back to, kept inside this test's folder."""
    folder = tmp_path / "systemp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# ----------------------------------------------------------------------------- full disk


@pytest.mark.anyio
async def test_full_disk_spills_to_the_named_second_place_and_warns_at_start(
    small_disk: Path, tmp_path: Path, temp_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = tmp_path / "other"
    caplog.set_level(logging.WARNING)
    trace = hook(small_disk / "root", [small_disk / "spill", other])
    assert "spill_dir" not in caplog.text  # the second place is on another disk: no warning
    with pytest.raises(HookError) as info:
        with anyio.fail_after(120):  # never waits forever
            async with HookBus() as bus:
                bus.add_hook(trace)
                published = await publish_steps(bus, range(10))
    message = str(info.value)
    assert "not delivered" in message and "spilled to" in message
    assert "No space left on device" in message
    delivered = table_ids(small_disk / "root")
    files = spill_files(small_disk / "spill", other, temp_dir / "recis_async-spill")
    spilled = spilled_ids(files)
    assert 0 < len(delivered) < published and spilled
    assert len(delivered) + len(spilled) == published == 10 * ROWS
    assert sorted(delivered + spilled) == list(range(published))  # none doubled
    # the spill files replay (into a root with room) exactly once
    replayed = replay(files, tmp_path / "replayed")
    assert sorted(delivered + replayed) == list(range(published))


@pytest.mark.anyio
async def test_spill_dir_on_the_parquet_disk_is_warned_about(
    small_disk: Path, temp_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    hook(small_disk / "root", small_disk / "spill")
    assert f"spill_dir {small_disk / 'spill'} is on the same file system as the Parquet root" in (
        caplog.text
    )


@pytest.mark.anyio
async def test_full_disk_everywhere_reports_lost_rows_at_the_next_publish_and_at_close(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spill folder and the temp dir on the full disk too: nothing can be written.  The
    writer keeps running, the next publish raises with the count, the steps and the cause,
    and close raises again with the total; nothing hangs."""
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk / "tmp"))
    published = 0
    at_step: TraceDeliveryError | None = None
    with pytest.raises(HookError) as info:
        with anyio.fail_after(120):
            async with HookBus() as bus:
                bus.add_hook(hook(small_disk / "root", small_disk / "spill"))
                for step in range(40):
                    try:
                        published += await publish_steps(bus, range(step, step + 1))
                    except HookError as exc:
                        at_step = lost_error(exc)
                        break
    assert at_step is not None, "no publish reported the loss"
    assert f"No space left on device on {small_disk / 'spill'}" in str(at_step)
    assert "LOST" in str(at_step) and " of step" in str(at_step)
    at_close = lost_error(info.value)
    delivered = table_ids(small_disk / "root")
    assert spill_files(small_disk / "spill", small_disk / "tmp") == []
    assert sorted(delivered) == sorted(set(delivered))
    assert len(delivered) + at_close.lost_rows == published
    assert at_close.lost_rows >= at_step.lost_rows > 0


@pytest.mark.anyio
async def test_read_only_remount_mid_run_spills_to_the_second_place(
    small_disk: Path, tmp_path: Path, temp_dir: Path
) -> None:
    root, spill, other = small_disk / "root", small_disk / "spill", tmp_path / "other"
    trace = hook(root, [spill, other])
    with pytest.raises(HookError) as info:
        with anyio.fail_after(120):
            async with HookBus() as bus:
                bus.add_hook(trace)
                published = await publish_steps(bus, range(2))
                await wait_delivered(trace, 2)
                subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
                published += await publish_steps(bus, range(2, 4))
    assert f"Read-only file system on {spill}" in str(info.value)
    delivered, files = table_ids(root), spill_files(other)
    spilled = spilled_ids(files)
    assert sorted(delivered + spilled) == list(range(published)) == list(range(4 * ROWS))
    assert sorted(delivered + replay(files, tmp_path / "replayed")) == list(range(published))


# ------------------------------------------------- the same call failing without a mount


async def wait_delivered(trace: TraceHook, batches: int) -> None:
    with anyio.fail_after(30):
        while trace.writer.stats()["batches"] < batches:
            await anyio.sleep(0.01)


def make_unusable(folder: Path) -> None:
    """Replace ``folder`` by a file: creating or writing in it now fails (as root too)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.write_text("not a folder")


@pytest.mark.anyio
async def test_unusable_table_and_spill_folder_fall_back_to_the_second_place(
    tmp_path: Path, temp_dir: Path
) -> None:
    root, spill, other = tmp_path / "root", tmp_path / "spill", tmp_path / "other"
    trace = hook(root, [spill, other])
    with pytest.raises(HookError) as info:
        with anyio.fail_after(120):
            async with HookBus() as bus:
                bus.add_hook(trace)
                published = await publish_steps(bus, range(3))
                await wait_delivered(trace, 3)
                delivered = table_ids(root)
                make_unusable(root / "t")
                make_unusable(spill)
                published += await publish_steps(bus, range(3, 8))
    assert f"on {spill}" in str(info.value)  # why the first place was not used
    files = spill_files(other)
    assert files and not spill_files(temp_dir / "recis_async-spill")
    spilled = spilled_ids(files)
    assert sorted(delivered + spilled) == list(range(published)) == list(range(8 * ROWS))
    replayed = replay(files, tmp_path / "replayed")
    assert sorted(delivered + replayed) == list(range(published))


@pytest.mark.anyio
async def test_the_system_temp_dir_is_the_last_place(tmp_path: Path, temp_dir: Path) -> None:
    root, spill = tmp_path / "root", tmp_path / "spill"
    trace = hook(root, spill)
    with pytest.raises(HookError):
        async with HookBus() as bus:
            bus.add_hook(trace)
            await publish_steps(bus, range(1))
            await wait_delivered(trace, 1)
            make_unusable(root / "t")
            make_unusable(spill)
            await publish_steps(bus, range(1, 3))
    files = spill_files(temp_dir / "recis_async-spill")
    assert sorted(spilled_ids(files)) == list(range(ROWS, 3 * ROWS))


@pytest.mark.anyio
async def test_nowhere_to_spill_is_reported_with_counts_steps_and_each_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, spill = tmp_path / "root", tmp_path / "spill"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))
    trace = hook(root, spill)
    at_step: TraceDeliveryError | None = None
    published = 0
    with pytest.raises(HookError) as info:
        with anyio.fail_after(60):
            async with HookBus() as bus:
                bus.add_hook(trace)
                published += await publish_steps(bus, range(2))
                await wait_delivered(trace, 2)
                delivered = table_ids(root)
                for folder in (root / "t", spill, tmp_path / "systemp"):
                    make_unusable(folder)
                for step in range(2, 40):
                    try:
                        published += await publish_steps(bus, range(step, step + 1))
                    except HookError as exc:
                        at_step = lost_error(exc)
                        break
    assert at_step is not None
    message = str(at_step)
    assert "rows of step 2 (1 batch(es)) are LOST" in message or "rows of steps 2-" in message
    assert f"on {spill}" in message and f"on {tmp_path / 'systemp'}" in message
    at_close = lost_error(info.value)
    assert sorted(delivered) == list(range(2 * ROWS))
    assert len(delivered) + at_close.lost_rows == published
    assert "unhandled errors in a TaskGroup" not in str(info.value)


FSIZE_JOB = textwrap.dedent(
    """
    import json, resource, signal, sys
    import anyio, numpy as np
    from recis_async import HookBus, HookError, add_to_trace
    from recis_async.events import AfterStep, BeforeStep
    from recis_async.hooks import TraceHook
    from recis_async.sinks import ParquetSink

    root, spill, backend = sys.argv[1], sys.argv[2], sys.argv[3]
    ROWS = 1024

    async def main():
        hook = TraceHook(ParquetSink(root, "t", rank=0), ["id", "emb"], ["bigint", "array<float>"],
                         size_threshold=ROWS * 264, retries=1, retry_backoff=0.01, spill_dir=spill)
        published, at_step, at_close = 0, None, None
        try:
            async with HookBus() as bus:
                bus.add_hook(hook)
                for step in range(30):
                    if step == 4:
                        while hook.writer.stats()["batches"] < 4:
                            await anyio.sleep(0.01)
                        # from now on every write of a file fails: a full disk, everywhere
                        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
                    await bus.publish(BeforeStep(global_step=step))
                    add_to_trace("id", np.arange(step * ROWS, (step + 1) * ROWS))
                    add_to_trace("emb", np.random.default_rng(step).random((ROWS, 64), np.float32))
                    try:
                        await bus.publish(AfterStep(global_step=step, samples=ROWS))
                    except HookError as exc:
                        at_step = exc.__cause__
                        break
                    published += ROWS
        except HookError as exc:
            at_close = exc.__cause__
        print(json.dumps({
            "published": published,
            "at_step": str(at_step), "at_close": str(at_close),
            "lost_rows": getattr(at_close, "lost_rows", None),
            "type": type(at_close).__name__,
        }))

    anyio.run(main, backend=backend)
    """
)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_file_size_limit_in_a_subprocess_reports_every_lost_row(
    tmp_path: Path, backend: str
) -> None:
    """``RLIMIT_FSIZE`` 0: every file write fails (``File too large``) as on a full disk,
    for the table, the spill folder and the temp dir alike -- with no mount, no root."""
    root, spill = tmp_path / "root", tmp_path / "spill"
    (tmp_path / "tmp").mkdir()  # the job's temp dir (TMPDIR must exist to be used)
    done = subprocess.run(
        [sys.executable, "-c", FSIZE_JOB, str(root), str(spill), backend],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path / "tmp")},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["type"] == "TraceRowsLostError", result
    assert f"File too large on {spill}" in result["at_step"]
    delivered = table_ids(root)
    assert sorted(delivered) == list(range(4 * ROWS))
    assert len(delivered) + result["lost_rows"] == result["published"]
    assert spill_files(spill, tmp_path / "tmp" / "recis_async-spill") == []  # no 0-byte files
    assert f"File too large on {tmp_path / 'tmp' / 'recis_async-spill'}" in result["at_step"]
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))


def test_an_existing_table_folder_that_cannot_be_written_is_found_at_open(
    tmp_path: Path,
) -> None:
    """A table folder left read-only (a read-only mount; for a user other than root, its
    permissions) fails the open, when the bus starts, not the first batch minutes later."""
    table = tmp_path / "root" / "t"
    table.mkdir(parents=True)
    if os.geteuid() == 0:  # root writes through permissions: a read-only mount instead
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(table)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"root, and cannot mount a read-only tmpfs: {done.stderr.decode()}")
    else:
        table.chmod(0o555)
    buffer = ColumnBuffer(["id"], ["bigint"])
    try:
        with pytest.raises(SinkError, match=r"cannot prepare .*/root/t: .*(Read-only|denied)"):
            ParquetSink(tmp_path / "root", "t", rank=0).open(buffer.fields, buffer.types)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(table)], check=False)
        else:
            table.chmod(0o755)
    assert list(table.iterdir()) == []
