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


class Terminal:
    """A program whose controlling terminal is a pty, as a shell starts it in the foreground.

    It leads a session of its own, so the keys written by :meth:`press` reach it as a terminal
    delivers them: ``\\x03`` (Ctrl-C) is a SIGINT to the whole foreground process group, its
    forked children included."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self._master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
        self.proc = subprocess.Popen(
            list(argv),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.output = b""

    def expect(self, text: bytes, timeout: float = 120.0) -> None:
        """Read what the program writes until ``text`` appears."""
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if time.monotonic() > deadline or not self._read(0.5):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise AssertionError(f"{text!r} never appeared in:\n{self.text}")

    def press(self, keys: bytes) -> None:
        os.write(self._master, keys)

    def wait(self, timeout: float = 120.0) -> int:
        """Read until the program exits; its exit status."""
        deadline = time.monotonic() + timeout
        while self._read(0.5) or self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"still running after {timeout}s:\n{self.text}")
        return self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait()
        os.close(self._master)

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace").replace("\r\n", "\n")

    def _read(self, wait: float) -> bool:
        ready, _, _ = select.select([self._master], [], [], wait)
        if not ready:
            return False
        try:
            data = os.read(self._master, 65536)
        except OSError:  # EIO: every writer closed its end
            return False
        self.output += data
        return bool(data)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
