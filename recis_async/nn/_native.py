"""Builds and loads the native probe loops of :class:`~recis_async.nn.slot_map.NativeSlotMap`.

``_slot_map.cpp`` is plain C++ with a C interface (no torch or Python headers), so the
machine's C++ compiler builds it in well under a second; the library is cached under
``$XDG_CACHE_HOME/recis_async`` (default ``~/.cache/recis_async``), keyed by a hash of the
source and the compiler flags, and later processes only load it.  The first
:class:`~recis_async.nn.HashTable` of a process triggers the load (and, once per machine,
the build), so a training step never compiles.  Where no compiler or cache folder is usable,
one warning says why and the tables use the torch-ops map.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["Kernels", "cache_dir", "kernels", "load"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_slot_map.cpp")
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17")
_BUILD_TIMEOUT_S = 300.0

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


class Kernels:
    """The loaded library's functions (see ``_slot_map.cpp``); they release the GIL."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self.find = lib.slot_map_find
        self.find.argtypes = (_P, _INT, _P, _I64, _P)
        self.find.restype = None
        self.claim = lib.slot_map_claim
        self.claim.argtypes = (_P, _INT, _P, _I64, _P, _P)
        self.claim.restype = _I64
        self.resolve = lib.slot_map_resolve
        self.resolve.argtypes = (_P, _P, _P, _P, _I64, _P, _I64)
        self.resolve.restype = None
        self.revert = lib.slot_map_revert
        self.revert.argtypes = (_P, _P, _I64)
        self.revert.restype = None


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/recis_async`` or ``~/.cache/...``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "recis_async"


def _compiler() -> str:
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found (looked for $CXX, c++, g++, clang++)")


def _build() -> Path:
    """The cached library, built first if this source and these flags have none yet."""
    source = _SOURCE.read_bytes()
    tag = f"{sys.platform}-{platform.machine()}-{' '.join(_FLAGS)}".encode()
    key = hashlib.sha256(source + b"\0" + tag).hexdigest()[:16]
    target = cache_dir() / f"slot_map-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    cmd = [_compiler(), *_FLAGS, "-o", str(partial), str(_SOURCE)]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), "")
            raise RuntimeError(f"{cmd[0]} exited with {done.returncode}: {first.strip()}")
        os.replace(partial, target)  # atomic: concurrent builders leave one whole file
    finally:
        partial.unlink(missing_ok=True)
    return target


def load() -> Kernels | None:
    """Build (if not cached) and load the kernels; ``None`` after one warning naming the
    reason if that fails."""
    try:
        path = _build()
        return Kernels(ctypes.CDLL(str(path)), path)
    except Exception as exc:  # any failure means: use the torch-ops map
        logger.warning(
            "recis_async.nn: native id map unavailable, HashTable uses the torch-ops map (%s: %s)",
            type(exc).__name__,
            exc,
        )
        return None


@functools.cache
def kernels() -> Kernels | None:
    """:func:`load`, once per process (a loaded library is never unloaded)."""
    return load()
