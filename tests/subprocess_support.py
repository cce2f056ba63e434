"""Reading a child process's output line by line, as the tests that stop jobs need."""

from __future__ import annotations

import subprocess
import time


def wait_for(
    proc: subprocess.Popen[str], prefix: str, seen: list[str] | None = None, timeout: float = 60
) -> str:
    """Read ``proc``'s stdout up to a line starting with ``prefix`` and return it (the lines
    read are kept in ``seen``); kill it and fail, with its stderr, if none comes."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        if seen is not None:
            seen.append(line.strip())
        if line.startswith(prefix):
            return line.strip()
    proc.kill()
    raise AssertionError(f"never printed {prefix!r}; stderr: {proc.communicate()[1]}")
