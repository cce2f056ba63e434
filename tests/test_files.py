"""recis_async._files: a file appears whole under its final name, or not at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recis_async._files import atomic_path, fsync_path


def record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths fsync'ed through fsync_path, in order (the real fsync still runs)."""
    synced: list[str] = []
    real_open, real_fsync = os.open, os.fsync
    names: dict[int, str] = {}

    def opening(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        fd = real_open(path, flags, *args)
        names[fd] = os.fspath(path)
        return fd

    def fsync(fd: int) -> None:
        synced.append(names.get(fd, f"fd {fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_the_file_appears_after_its_data_and_its_directory_are_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = record_fsyncs(monkeypatch)
    final, tmp = tmp_path / "run.json", tmp_path / ".run.json.tmp"
    with atomic_path(final, tmp) as path:
        assert path == tmp
        path.write_bytes(b"{}")
        assert not final.exists()  # nothing under the final name while writing
    assert final.read_bytes() == b"{}"
    assert not tmp.exists()
    assert synced == [str(tmp), str(tmp_path)]  # the data, then the rename


def test_an_existing_file_is_replaced_whole(tmp_path: Path) -> None:
    final = tmp_path / "params.json"
    final.write_bytes(b"old")
    with atomic_path(final, tmp_path / ".params.tmp") as path:
        path.write_bytes(b"new")
    assert final.read_bytes() == b"new"


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_write_leaves_neither_the_file_nor_the_temporary(
    tmp_path: Path, error: BaseException
) -> None:
    final = tmp_path / "checkpoint-3.pt"
    final.write_bytes(b"previous")
    with pytest.raises(type(error)), atomic_path(final, tmp_path / ".ck.tmp") as path:
        path.write_bytes(b"half")
        raise error
    assert final.read_bytes() == b"previous"  # the earlier file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3.pt"]


def test_fsync_path_reports_a_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        fsync_path(tmp_path / "missing")
