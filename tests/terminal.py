"""Run a program in a pseudo-terminal and render what it drew, as a person would see it.

The bytes the program writes to the terminal (carriage returns, ANSI cursor and erase codes
from tqdm) are replayed into ``pyte``'s VT100 emulator; the rendered rows are returned.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyte


def render(data: bytes, *, columns: int, rows: int, newline_is_crlf: bool = False) -> list[str]:
    """The screen after ``data`` was written to a ``columns`` x ``rows`` terminal, trailing
    blanks and empty last rows removed.  ``newline_is_crlf``: treat ``\\n`` as a terminal's
    output processing does (for bytes read from a file rather than a pty)."""
    if newline_is_crlf:
        data = data.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    screen = pyte.Screen(columns, rows)
    pyte.ByteStream(screen).feed(data)
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_in_terminal(
    argv: Sequence[str],
    *,
    columns: int = 120,
    rows: int = 400,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 300.0,
) -> tuple[int, bytes]:
    """Run ``argv`` with stdin, stdout and stderr on a pty of the given size; return its exit
    status and every byte it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    proc = subprocess.Popen(
        list(argv), stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed its end
                break
            if not data:
                break
            chunks.append(data)
        else:
            raise TimeoutError(f"{argv} did not finish within {timeout}s")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(master)
    return proc.returncode, b"".join(chunks)
