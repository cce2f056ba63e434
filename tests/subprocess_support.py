"""Reading a child process's output line by line, as the tests that stop jobs need."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path


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


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_argv(script: Path, *args: str) -> list[str]:
    """The command running ``script`` with ``args`` under ``torchrun`` on 2 local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        *args,
    ]
