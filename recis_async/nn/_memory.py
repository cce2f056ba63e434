"""Buffers for the table's large tensors: huge pages, and growth without copying.

A table grows by giving its rows (and its optimizer's row state) a bigger buffer, and a
dense gradient is a fresh ``[capacity, dim]`` buffer every step.  First-touch page faults
made allocating a large buffer cost several times more than copying it (benchmarks/README.md,
"Table growth without copies").  So:

* buffers of 4 MiB and more come from a private anonymous mapping advised to use 2 MiB pages
  (``MADV_HUGEPAGE``); its pages read as zeros without being written;
* :class:`RowSpace` maps a growing tensor with room for :data:`_RESERVE` times its rows
  (address space only: pages are backed when first written), so later growths are a wider
  view of the same mapping, with no copy.  Each tensor's storage is exactly its own size,
  so ``torch.save`` writes no reserve.

Where mappings or the advice are unavailable (not Linux, strict overcommit), this is plain
``torch.zeros`` plus a copy; so it is for tensors on an accelerator (a table moved there).  A
tensor keeps its mapping alive and it is unmapped when the last tensor over it is freed.
"""

from __future__ import annotations

import math
import mmap
import sys
import weakref
from typing import Any

import torch

__all__ = ["RowSpace", "zeros"]

_HUGE_MIN = 4 << 20
_HUGE_PAGE = 2 << 20
_RESERVE = 8  # rows mapped per row in use: room for five growths by half
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)
# address space without a commit charge (Linux's MAP_NORESERVE; Python's mmap lacks the name)
_NORESERVE = 0x4000 if sys.platform == "linux" else 0


def _mapping(nbytes: int, reserve: bool) -> mmap.mmap | None:
    """A zero-filled private mapping of at least ``nbytes`` on huge pages, or ``None``."""
    if _ADVICE is None or nbytes < _HUGE_MIN:
        return None
    size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (_NORESERVE if reserve else 0)
    try:
        region = mmap.mmap(-1, size, flags=flags)
        region.madvise(_ADVICE)
    except (OSError, ValueError):  # no such mapping or advice here: ordinary pages
        return None
    return region


def _view(region: mmap.mmap, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(region, dtype=dtype, count=math.prod(shape)).view(shape)


def zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """A zero-filled contiguous tensor of ``shape`` and ``dtype`` (on ``device``)."""
    if device is not None and device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = _mapping(nbytes, reserve=False)
    if region is None:
        return torch.zeros(shape, dtype=dtype)
    return _view(region, shape, dtype)


class RowSpace:
    """Grows tensors by whole rows, in place where the tensor's own mapping has room.

    One per table; it knows the mappings of the tensors it made by their data pointer, held
    weakly: a mapping lives exactly as long as a tensor over it.  Pickles empty: an unpickled
    table's first growth copies once.
    """

    def __init__(self) -> None:
        self._regions: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()

    def grown(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        """``t`` with ``rows`` rows: its own rows first, zeros after."""
        shape = (rows, *t.shape[1:])
        if t.device.type != "cpu":
            out = torch.zeros(shape, dtype=t.dtype, device=t.device)
            out[: t.shape[0]] = t
            return out
        nbytes = math.prod(shape) * t.element_size()
        region = self._regions.get(t.data_ptr())
        if region is not None and nbytes <= len(region) and t.is_contiguous():
            return _view(region, shape, t.dtype)  # rows past t's were never written: zeros
        region = _mapping(_RESERVE * nbytes, reserve=True)
        if region is None:
            out = torch.zeros(shape, dtype=t.dtype)
        else:
            out = _view(region, shape, t.dtype)
            self._regions[out.data_ptr()] = region
        out[: t.shape[0]] = t
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
