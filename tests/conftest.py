"""Shared fixtures: every async test runs on asyncio and on trio; no test leaves files
behind, neither in the checkout nor in the temp folder other programs share."""

from __future__ import annotations

import inspect
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Made by tools, not by the code under test.
_TOOL_FILES = {".pytest_cache", ".mypy_cache", ".ruff_cache", "__pycache__", ".hypothesis"}
# torch's compile cache and torchrun's rendezvous folders, which torch leaves on purpose
_TORCH_FILES = ("torchinductor_", "torchelastic_")


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collectors treat CPU tensors as a GPU's: kept unread, copied to the host off the
    step (``recis_async.collect.READ_CPU_AT_CALL``), so that a CPU-only machine runs the
    logic a GPU runs."""
    from recis_async import collect

    monkeypatch.setattr(collect, "READ_CPU_AT_CALL", False)


@pytest.fixture(params=["cpu", "device"])
def tensor_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a collected tensor goes: read at the call (a CPU tensor) and copied off the
    step (a GPU's, as :func:`device_path` makes the CPU's)."""
    if request.param == "device":
        from recis_async import collect

        monkeypatch.setattr(collect, "READ_CPU_AT_CALL", False)
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


# ---------------------------------------------------------------- both buses
# A hook test module opts in with ``pytestmark = pytest.mark.usefixtures("either_bus")``:
# each of its tests that opens a bus of its own (``HookBus(`` in its source) then runs twice,
# on HookBus and on SyncHookBus, with the test unchanged.  A test that cannot run on the
# synchronous bus (it awaits background progress between publishes, say) is marked
# ``@pytest.mark.async_bus_only``.


class SyncBusInAsyncTest:
    """What a test's ``async with HookBus(...) as bus:`` gets on the "sync" run: a
    :class:`SyncHookBus` served from the test's body, ``await bus.publish(ev)`` calling its
    synchronous ``publish``.  Its loop runs beside the test's (the other backend: trio cannot
    run inside trio), as a notebook cell's would."""

    backend = "asyncio"

    def __init__(self, flush_timeout: float = 60.0, *, handle_signals: bool = True) -> None:
        from recis_async import SyncHookBus

        self.sync_bus = SyncHookBus(
            flush_timeout, handle_signals=handle_signals, backend=self.backend
        )

    async def __aenter__(self) -> SyncBusInAsyncTest:
        self.sync_bus.__enter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool:
        return self.sync_bus.__exit__(*exc)

    async def publish(self, event: Any) -> None:
        self.sync_bus.publish(event)

    async def aclose(self) -> None:
        self.sync_bus.close()

    def __getattr__(self, name: str) -> Any:  # add_hook, should_stop, stats, ...
        target = self.sync_bus if hasattr(self.sync_bus, name) else self.sync_bus.hook_bus
        return getattr(target, name)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "either_bus" not in metafunc.fixturenames:
        return
    kinds = ["HookBus"]
    if metafunc.definition.get_closest_marker("async_bus_only") is None:
        try:
            source = inspect.getsource(metafunc.function)
        except (OSError, TypeError):
            source = ""
        if "HookBus(" in source:
            kinds.append("SyncHookBus")
    metafunc.parametrize("either_bus", kinds, indirect=True)


@pytest.fixture
def either_bus(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``HookBus`` in the test's module is the real one, or a SyncHookBus behind
    :class:`SyncBusInAsyncTest` (see above)."""
    kind = str(request.param)
    if kind == "SyncHookBus":
        callspec = getattr(request.node, "callspec", None)
        outer = callspec.params.get("anyio_backend") if callspec is not None else None
        driver = type(
            "SyncHookBus",
            (SyncBusInAsyncTest,),
            {"backend": "trio" if outer == "asyncio" else "asyncio"},
        )
        monkeypatch.setattr(request.module, "HookBus", driver)
    return kind


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "async_bus_only: not run on SyncHookBus by the either_bus fixture"
    )
    # A suite started in the background by a shell without job control (`cmd &`, `nohup`)
    # inherits SIGINT ignored, and so does every process it starts: the tests of Ctrl-C would
    # see nothing happen.  They run as from a terminal (a handler, unlike an ignored signal,
    # is not inherited: the children start with the default again).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Each test starts with the SIGINT/SIGTERM handlers the previous one found: a framework
    that installs its own (Lightning, Hugging Face's Trainer) must not change what a later
    test's Ctrl-C does."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        if signal.getsignal(s) is not handler and handler is not None:
            signal.signal(s, handler)
