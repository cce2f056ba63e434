"""The project's promises about itself: CI runs the README's command, the package is typed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\s+```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no Quick start code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quick_start_is_two_commands_and_ci_runs_the_test_one() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    run_example, run_tests = commands
    assert "examples/" in run_example and "pytest" in run_tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert run_tests in ci.splitlines()


def test_package_ships_py_typed() -> None:
    assert (ROOT / "recis_async" / "py.typed").exists()
    assert "py.typed" in (ROOT / "pyproject.toml").read_text()


def test_package_ships_the_native_id_map_source() -> None:
    assert (ROOT / "recis_async" / "nn" / "_slot_map.cpp").exists()
    assert '"nn/_slot_map.cpp"' in (ROOT / "pyproject.toml").read_text()
