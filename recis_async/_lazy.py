"""A package's public names imported on first use (PEP 562), for ``recis_async`` and
``recis_async.hooks``: a process imports the modules it uses, not every one a package
re-exports (a tracker's child process does not import torch, a job that does not trace does
not import pyarrow)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["attach"]


def attach(
    package: str, where: Mapping[str, str], public: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: a name in ``where`` (name ->
    module, relative to ``package``) is imported on first use and then kept as a global; a
    submodule not imported yet is imported as an attribute; ``dir()`` lists ``public`` and the
    submodules imported so far, not the package's helpers."""
    namespace = sys.modules[package].__dict__
    listed = frozenset(public)

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
            namespace[name] = value  # later lookups are plain attribute reads, as an import's
            return value
        if (
            name.isidentifier()
            and not name.startswith("_")
            and importlib.util.find_spec(f"{package}.{name}") is not None
        ):
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        loaded = [
            name
            for name, value in namespace.items()
            if not name.startswith("_")
            and isinstance(value, ModuleType)
            and value.__name__ == f"{package}.{name}"
        ]
        return sorted({*listed, *loaded})

    return __getattr__, __dir__
