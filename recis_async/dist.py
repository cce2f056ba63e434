"""Rank helpers: torch.distributed when initialised, else the torchrun environment, else 0/1."""

from __future__ import annotations

import os
import pickle
from typing import Any

DEFAULT_TIMEOUT = 300.0
"""Seconds a library collective waits for the other ranks before naming this one and failing."""

__all__ = [
    "DEFAULT_TIMEOUT",
    "all_gather_object",
    "all_reduce_max",
    "all_reduce_mean",
    "barrier",
    "control_group",
    "get_rank",
    "get_world_size",
    "is_initialized",
    "release_group",
    "wait_work",
]


def is_initialized() -> bool:
    """Whether a torch.distributed process group is up."""
    import torch.distributed as tdist

    return tdist.is_available() and tdist.is_initialized()


def get_rank() -> int:
    """This process's rank."""
    if is_initialized():
        import torch.distributed as tdist

        return int(tdist.get_rank())
    return _env_int("RANK", 0)


def get_world_size() -> int:
    """The number of ranks in the job."""
    if is_initialized():
        import torch.distributed as tdist

        return int(tdist.get_world_size())
    return _env_int("WORLD_SIZE", 1)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an int, got {raw!r}") from None


def all_reduce_max(values: list[int], *, timeout: float, what: str) -> list[int]:
    """Element-wise MAX of ``values`` over all ranks; blocking, so call it from a worker thread.

    Raises ``TimeoutError`` naming this rank and ``what`` when the other ranks do not join
    within ``timeout`` seconds (a rank died or is stuck) instead of waiting forever.
    """
    import torch
    import torch.distributed as tdist

    tensor = torch.tensor(values, dtype=torch.int64)
    work = tdist.all_reduce(tensor, op=tdist.ReduceOp.MAX, async_op=True)
    wait_work(work, timeout, what)
    return [int(v) for v in tensor.tolist()]


def all_reduce_mean(values: dict[str, float], *, timeout: float, what: str) -> dict[str, float]:
    """Mean of each named value over all ranks (every rank must pass the same names)."""
    import torch
    import torch.distributed as tdist

    names = sorted(values)
    tensor = torch.tensor([float(values[n]) for n in names], dtype=torch.float64)
    work = tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM, async_op=True)
    wait_work(work, timeout, what)
    size = tdist.get_world_size()
    return {n: float(v) / size for n, v in zip(names, tensor.tolist(), strict=True)}


def all_gather_object(obj: object, *, timeout: float, what: str) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; blocking, so call it from a worker
    thread.  Unlike ``torch.distributed.all_gather_object`` it honours ``timeout``."""
    import torch
    import torch.distributed as tdist

    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = tdist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    work = tdist.all_gather(lengths, torch.tensor([payload.numel()]), async_op=True)
    wait_work(work, timeout, what)
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    chunks = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    work = tdist.all_gather(chunks, padded, async_op=True)
    wait_work(work, timeout, what)
    return [
        pickle.loads(chunk[: int(n)].numpy().tobytes())
        for chunk, n in zip(chunks, lengths, strict=True)
    ]


def control_group() -> Any:
    """A new process group of every rank on gloo, for the library's own small collectives on
    CPU tensors (the trainer's stop agreement): it works whatever the job's default backend
    (NCCL takes no CPU tensors), never touches an accelerator, and does not interleave with
    the job's gradient collectives.  Creating a group is itself collective: every rank must
    call this at the same point.  ``destroy_process_group()`` removes it with the others."""
    import torch.distributed as tdist

    return tdist.new_group(backend="gloo")


def release_group(group: Any) -> None:
    """Destroy ``group`` (from :func:`control_group`) now rather than with the default group;
    nothing when the default group is already gone."""
    import torch.distributed as tdist

    if is_initialized():
        tdist.destroy_process_group(group)


def barrier(*, timeout: float, what: str) -> None:
    """Wait until every rank reached this point, or raise ``TimeoutError`` naming the rank."""
    import torch
    import torch.distributed as tdist

    work = tdist.all_reduce(torch.zeros(1), async_op=True)  # a barrier that honours a timeout
    wait_work(work, timeout, what)


def wait_work(work: object, timeout: float, what: str) -> None:
    """Wait for a collective started with ``async_op=True``, at most ``timeout`` seconds;
    ``TimeoutError`` naming this rank and ``what`` otherwise (a failed collective too)."""
    from datetime import timedelta

    try:
        completed = work.wait(timeout=timedelta(seconds=timeout))  # type: ignore[attr-defined]
    except RuntimeError as exc:
        raise TimeoutError(
            f"rank {get_rank()}: {what} did not complete within {timeout}s "
            f"(another rank failed or is stuck): {exc}"
        ) from exc
    if completed is False:
        raise TimeoutError(f"rank {get_rank()}: {what} did not complete within {timeout}s")
