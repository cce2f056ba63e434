"""Row indices from the host id map to the rows' device, without making the step wait.

The id map lives on the host (ids come from the loader there); the rows live on the table's
device.  Each lookup's indices (slots, bag offsets, ...) are packed into one buffer, put in
page-locked memory and copied with ``non_blocking=True``: one copy queued on the current
stream, where a copy from ordinary memory would wait for the device's queue to drain.  On the
CPU the indices are used where they are.
"""

from __future__ import annotations

import torch

__all__ = ["host_to"]


def host_to(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The 1-D int64 host ``tensors`` on ``device`` (as they are on the CPU)."""
    if device.type == "cpu":
        return tensors
    sizes = [t.numel() for t in tensors]
    packed = torch.cat(tensors) if len(tensors) > 1 else tensors[0].contiguous()
    if device.type == "cuda":
        packed = packed.pin_memory()
    return tuple(packed.to(device, non_blocking=True).split(sizes))
