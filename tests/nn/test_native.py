"""Building, caching and loading the native id map, and the fallback when it cannot load."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recis_async.nn import _native

ROOT = Path(__file__).resolve().parents[2]


def test_built_once_then_loaded_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = _native.load()
    assert first is not None
    assert first.path.parent == tmp_path / "recis_async"
    built = first.path.stat().st_mtime_ns
    # a second load never compiles: with no working compiler it still loads the cached file
    monkeypatch.setenv("CXX", "false")
    again = _native.load()
    assert again is not None and again.path == first.path
    assert first.path.stat().st_mtime_ns == built
    assert [p.name for p in first.path.parent.iterdir()] == [first.path.name]  # no leftovers


def test_a_failed_build_logs_one_line_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    broken = tmp_path / "broken-cxx"
    broken.write_text("#!/bin/sh\necho 'x.cpp:1:1: error: no such thing' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    with caplog.at_level("WARNING", logger="recis_async.nn._native"):
        assert _native.load() is None
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message
    assert "native id map unavailable, HashTable uses the torch-ops map" in message
    assert "exited with 3" in message and "error: no such thing" in message
    assert not any((tmp_path / "recis_async").iterdir())


def test_without_a_compiler_tables_train_on_the_torch_ops_map(tmp_path: Path) -> None:
    """A fresh process whose build fails: one warning line, then tables work as before."""
    script = textwrap.dedent(
        """
        import torch
        from recis_async.nn import DynamicEmbedding, EmbeddingOption, HashTable

        tables = [HashTable(4), DynamicEmbedding(EmbeddingOption(4, "e")).table]
        for table in tables:
            out = table(torch.tensor([3, 1, 3, 2**62]))
            out.sum().backward()
            assert table.ids_count() == 3 and table.weight.grad is not None
        print(sorted({type(t._map).__name__ for t in tables}))
        """
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['SlotMap']"
    warnings = [ln for ln in done.stderr.splitlines() if "native id map unavailable" in ln]
    assert len(warnings) == 1, done.stderr
    assert "false exited with 1" in warnings[0]
