"""Reads of host-side values on a lookup: ids, slots, masks and offsets in host memory.

A table's id map lives on the host on every device (the ids come from the loader there), so
deciding what a lookup inserts reads those values in Python.  That never waits for a device.
The reads are made here, each checking that its tensor is on the CPU, so that a count of host
reads on the step (tests/host_reads.py) can tell them from a read of device values.
"""

from __future__ import annotations

import torch

__all__ = ["any_set", "int_at"]


def any_set(mask: torch.Tensor) -> bool:
    """Whether any element of the host tensor ``mask`` is true."""
    _check_host(mask)
    return bool(mask.any())


def int_at(t: torch.Tensor, i: int) -> int:
    """Element ``i`` of the 1-D host tensor ``t``."""
    _check_host(t)
    return int(t[i])


def _check_host(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise AssertionError(f"a host-side read of a tensor on {t.device}")
