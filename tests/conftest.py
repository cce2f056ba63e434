"""Shared fixtures: every async test runs on asyncio and on trio; no test leaves files
behind, neither in the checkout nor in the temp folder other programs share."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Made by tools, not by the code under test.
_TOOL_FILES = {".pytest_cache", ".mypy_cache", ".ruff_cache", "__pycache__", ".hypothesis"}
# torch's compile cache and torchrun's rendezvous folders, which torch leaves on purpose
_TORCH_FILES = ("torchinductor_", "torchelastic_")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The suite's stand-in for the system temp folder (``TMPDIR``, subprocesses included),
    so that whatever a run leaves there is seen."""
    path = tmp_path_factory.mktemp("shared-tmp", numbered=False)
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = str(path)
    yield path
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]


def _left(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if not p.name.startswith(_TORCH_FILES)} - _TOOL_FILES


@pytest.fixture(autouse=True)
def leaves_nothing_behind(shared_tmp: Path) -> Iterator[None]:
    """Fail a test that leaves files in the checkout or the shared temp folder (a spill file
    in ``./trace_spill`` or ``/tmp``, say): a user's run must not either."""
    root_before, tmp_before = _left(ROOT), _left(shared_tmp)
    yield
    root_new, tmp_new = _left(ROOT) - root_before, _left(shared_tmp) - tmp_before
    for name in tmp_new:  # the next test starts clean either way
        _remove(shared_tmp / name)
    assert not root_new, f"the test left {sorted(root_new)} in {ROOT}"
    assert not tmp_new, f"the test left {sorted(tmp_new)} in the temp folder"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            _remove(child)
        path.rmdir()
    else:
        path.unlink()
