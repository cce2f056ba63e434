"""Every ```python block of the README runs as written, unless it is marked as a fragment.

A block that is deliberately partial carries the marker ``<!-- fragment -->`` on the last
non-blank line before its opening fence; it must still compile.  Every other block is run by
itself in a fresh interpreter, in an empty working directory, and must exit with status 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FRAGMENT = "<!-- fragment -->"
FENCE = re.compile(r"^```\s*(\S*)\s*$")


class Block(NamedTuple):
    line: int  # of the opening fence, 1-based
    code: str
    fragment: bool


def python_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if opening.group(1).lower() in ("python", "py", "python3"):
            before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            blocks.append(Block(i + 1, "\n".join(lines[i + 1 : end]) + "\n", before == FRAGMENT))
        i = end + 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_python_blocks_are_found_and_parse() -> None:
    assert len(BLOCKS) >= 4
    for block in BLOCKS:
        compile(block.code, f"README.md:{block.line}", "exec")


def test_fragment_marker_is_recognised() -> None:
    text = "x\n\n<!-- fragment -->\n\n```python\nbus.add_hook(h)\n```\n\n```python\nprint(1)\n```\n"
    assert python_blocks(text) == [
        Block(5, "bus.add_hook(h)\n", True),
        Block(9, "print(1)\n", False),
    ]


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if not b.fragment], ids=lambda b: f"README.md:{b.line}"
)
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in [k for k in env if k.startswith(("ODPS_", "ALIBABA_CLOUD_", "MLFLOW_"))]:
        del env[key]  # the snippets' local defaults, whatever this machine has set
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"README.md:{block.line} failed (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    )
