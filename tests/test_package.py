"""The top-level package: its names and subpackages reachable as attributes, imported lazily."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, where nothing of recis_async is imported yet."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_subpackages_are_attributes_after_a_bare_import() -> None:
    """``import recis_async`` then ``recis_async.hooks.X`` works, as it did before the
    top-level names became lazy."""
    result = run_fresh(
        """
        import recis_async
        assert recis_async.hooks.LoggerHook.__name__ == "LoggerHook"
        assert recis_async.events.AfterStep.__name__ == "AfterStep"
        assert recis_async.sinks.ParquetSink.__name__ == "ParquetSink"
        assert recis_async.trackers.JsonlTracker.__name__ == "JsonlTracker"
        assert recis_async.nn.HashTable.__name__ == "HashTable"
        assert callable(recis_async.spill.replay_spill)
        """
    )
    assert result.returncode == 0, result.stderr


def test_every_exported_name_resolves_and_is_listed() -> None:
    result = run_fresh(
        """
        import recis_async
        for name in recis_async.__all__:
            getattr(recis_async, name)
        assert set(recis_async.__all__) <= set(dir(recis_async))
        import recis_async.hooks
        listed = dir(recis_async)
        assert "hooks" in listed, listed
        assert not {"importlib", "TYPE_CHECKING", "Any", "annotations"} & set(listed), listed
        try:
            recis_async.no_such_name
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        else:
            raise AssertionError("no AttributeError")
        """
    )
    assert result.returncode == 0, result.stderr


def test_a_job_that_does_not_trace_imports_nothing_tracing_needs() -> None:
    """The hooks are imported one module at a time: a job that logs, tracks and checkpoints
    never imports pyarrow or the trace writer (~0.2 s of its start); ``TraceHook`` does."""
    result = run_fresh(
        """
        import sys, tempfile
        import anyio
        import torch
        from recis_async import (
            CheckpointSaverHook, HookBus, LoggerHook, MLTrackerHook, ProgressBarHook, Trainer,
            add_metric, add_to_ml_tracker,
        )
        from recis_async.events import AfterStep, BeforeStep
        from recis_async.hooks import NanTensorHook, StopAtStepHook
        from recis_async.trackers import JsonlTracker

        async def main(out):
            async with HookBus(handle_signals=False) as bus:
                bus.add_hook(LoggerHook(log_step=2))
                bus.add_hook(ProgressBarHook(total=4))
                bus.add_hook(MLTrackerHook("e", "r", tracker=JsonlTracker(out)))
                model = torch.nn.Linear(2, 1)
                bus.add_hook(CheckpointSaverHook(out + "/ckpt", save_steps=2, model=model))
                bus.add_hook(NanTensorHook())
                bus.add_hook(StopAtStepHook(last_step=4))
                for step in range(4):
                    await bus.publish(BeforeStep(global_step=step))
                    add_metric("loss", 0.5)
                    add_to_ml_tracker("loss", 0.5)
                    await bus.publish(AfterStep(global_step=step, samples=8))

        with tempfile.TemporaryDirectory() as out:
            anyio.run(main, out)
        heavy = {"pyarrow", "recis_async.trace", "recis_async.hooks.trace"} & set(sys.modules)
        assert not heavy, heavy
        import recis_async.hooks as hooks
        assert "nan" in dir(hooks) and "trace" not in dir(hooks)
        assert not {"importlib", "TYPE_CHECKING", "Any", "annotations"} & set(dir(hooks))
        from recis_async.hooks import TraceHook
        assert "pyarrow" in sys.modules and "trace" in dir(hooks)
        assert hooks.progress.ProgressBarHook is ProgressBarHook
        try:
            hooks.NoSuchHook
        except AttributeError as exc:
            assert "NoSuchHook" in str(exc)
        else:
            raise AssertionError("no AttributeError")
        """
    )
    assert result.returncode == 0, result.stderr


PUBLIC_PACKAGES = (
    "recis_async",
    "recis_async.checkpoint",
    "recis_async.events",
    "recis_async.hooks",
    "recis_async.nn",
    "recis_async.sinks",
    "recis_async.spill",
    "recis_async.trace",
    "recis_async.trackers",
)


def test_every_public_name_is_importable_and_documented() -> None:
    """Each name in a public package's ``__all__`` imports, and says what it is: a docstring
    of its own (classes, functions), or a mention in the package's docstring (constants)."""
    result = run_fresh(
        f"""
        import importlib, importlib.util, inspect
        missing = []
        for package in {PUBLIC_PACKAGES!r}:
            if importlib.util.find_spec(package) is None:
                continue
            module = importlib.import_module(package)
            for name in module.__all__:
                value = getattr(module, name)  # AttributeError fails the test
                own = inspect.isclass(value) or inspect.isroutine(value)
                doc = inspect.getdoc(value) if own else None
                if own and not (doc and doc.strip()):
                    missing.append(f"{{package}}.{{name}}: no docstring")
                elif not own and name not in (module.__doc__ or ""):
                    missing.append(f"{{package}}.{{name}}: not named in the package docstring")
        assert not missing, "\\n".join(missing)
        """
    )
    assert result.returncode == 0, result.stderr


def test_public_constructors_document_their_arguments_and_errors() -> None:
    """Every public class built by users documents its constructor in one form: an ``Args:``
    section naming each parameter, and a ``Raises:`` section when it checks them.

    Left out: exceptions, enums, msgspec Structs (events, ``ReportArguments``: their fields are
    attributes, documented as such), Protocols, and ``Subscription`` (built by the bus,
    returned by ``subscribe``)."""
    result = run_fresh(
        f"""
        import enum, importlib, importlib.util, inspect
        import msgspec
        from recis_async.subscription import Subscription
        seen, missing = set(), []
        for package in {PUBLIC_PACKAGES!r}:
            if importlib.util.find_spec(package) is None:
                continue
            module = importlib.import_module(package)
            for name in module.__all__:
                cls = getattr(module, name)
                if not inspect.isclass(cls) or cls in seen or cls is Subscription:
                    continue
                seen.add(cls)
                if issubclass(cls, (BaseException, msgspec.Struct, enum.Enum)):
                    continue
                if getattr(cls, "_is_protocol", False):
                    continue
                init = cls.__init__
                try:
                    source = inspect.getsource(init)
                except (OSError, TypeError):
                    continue  # inherited from object or a C type: no parameters of its own
                params = [
                    p.name
                    for p in inspect.signature(init).parameters.values()
                    if p.name != "self"
                ]
                if not params:
                    continue
                doc = (cls.__doc__ or "") + (init.__doc__ or "")
                where = f"{{cls.__module__}}.{{cls.__qualname__}}"
                if "Args:" not in doc:
                    missing.append(f"{{where}}: no Args: section")
                    continue
                absent = [p for p in params if f"{{p}}:" not in doc]
                if absent:
                    missing.append(f"{{where}}: Args: does not name {{absent}}")
                checks = "raise " in source or "_checks" in source or any(
                    f"{{c}}(" in source
                    for c in ("positive_int", "positive_number", "boolean", "one_of",
                              "writable_dir", "exactly_one", "nonempty_str", "stateful")
                )
                if checks and "Raises:" not in doc:
                    missing.append(f"{{where}}: checks its arguments but has no Raises:")
        assert not missing, "\\n".join(missing)
        """
    )
    assert result.returncode == 0, result.stderr
