"""Rank helpers: torch.distributed when initialised, else the torchrun environment, else 0/1."""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT = 300.0
"""Seconds a library collective waits for the other ranks before naming this one and failing."""

__all__ = [
    "DEFAULT_TIMEOUT",
    "all_gather_object",
    "all_reduce_max",
    "all_reduce_mean",
    "barrier",
    "collective_device",
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


def collective_device() -> torch.device:
    """Where the library's small collectives put their tensors: the CPU where the default
    group takes CPU tensors (gloo, MPI, UCC, or a ``"cpu:gloo,cuda:nccl"`` group), else (NCCL
    alone) this rank's CUDA device.  Call it on the training loop's thread, the one that ran
    ``torch.cuda.set_device``: the current device is per thread, a worker's is device 0."""
    import torch
    import torch.distributed as tdist

    backend = str(tdist.get_backend()).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        takes_cpu = "cpu" in {part.split(":")[0] for part in backend.split(",")}
    else:
        takes_cpu = backend in ("gloo", "mpi", "ucc")
    if takes_cpu:
        return torch.device("cpu")
    bound = getattr(tdist.distributed_c10d._get_default_group(), "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


def all_reduce_max(
    values: list[int], *, timeout: float, what: str, device: torch.device | None = None
) -> list[int]:
    """Element-wise MAX of ``values`` over all ranks; blocking, so call it from a worker thread.

    ``device`` is :func:`collective_device`, read on the loop's thread (default: the CPU).
    Raises ``TimeoutError`` naming this rank and ``what`` when the other ranks do not join
    within ``timeout`` seconds (a rank died or is stuck) instead of waiting forever.
    """
    import torch
    import torch.distributed as tdist

    with _on(device) as dev:
        tensor = torch.tensor(values, dtype=torch.int64, device=dev)
        work = tdist.all_reduce(tensor, op=tdist.ReduceOp.MAX, async_op=True)
        wait_work(work, timeout, what)
        return [int(v) for v in tensor.tolist()]


def all_reduce_mean(
    values: dict[str, float], *, timeout: float, what: str, device: torch.device | None = None
) -> dict[str, float]:
    """Mean of each named value over all ranks (every rank must pass the same names)."""
    import torch
    import torch.distributed as tdist

    names = sorted(values)
    with _on(device) as dev:
        tensor = torch.tensor([float(values[n]) for n in names], dtype=torch.float64, device=dev)
        work = tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM, async_op=True)
        wait_work(work, timeout, what)
        size = tdist.get_world_size()
        return {n: float(v) / size for n, v in zip(names, tensor.tolist(), strict=True)}


def all_gather_object(
    obj: object, *, timeout: float, what: str, device: torch.device | None = None
) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order; blocking, so call it from a worker
    thread.  Unlike ``torch.distributed.all_gather_object`` it honours ``timeout``."""
    import torch
    import torch.distributed as tdist

    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = tdist.get_world_size()
    with _on(device) as dev:
        lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(size)]
        mine = torch.tensor([payload.numel()], device=dev)
        work = tdist.all_gather(lengths, mine, async_op=True)
        wait_work(work, timeout, what)
        counts = [int(n) for n in torch.cat(lengths).tolist()]
        padded = torch.zeros(max(counts), dtype=torch.uint8)
        padded[: payload.numel()] = payload
        chunks = [torch.empty(max(counts), dtype=torch.uint8, device=dev) for _ in range(size)]
        work = tdist.all_gather(chunks, padded.to(dev), async_op=True)
        wait_work(work, timeout, what)
        return [
            pickle.loads(chunk[:n].cpu().numpy().tobytes())
            for chunk, n in zip(chunks, counts, strict=True)
        ]


@contextlib.contextmanager
def _on(device: torch.device | None) -> Iterator[torch.device]:
    """``device`` (default: the CPU), made this worker thread's current CUDA device."""
    import torch

    if device is None or device.type != "cuda":
        yield torch.device("cpu")
        return
    with torch.cuda.device(device):
        yield device


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


def barrier(*, timeout: float, what: str, device: torch.device | None = None) -> None:
    """Wait until every rank reached this point, or raise ``TimeoutError`` naming the rank
    (``device``: see :func:`all_reduce_max`)."""
    import torch
    import torch.distributed as tdist

    with _on(device) as dev:  # an all-reduce: a barrier that honours a timeout
        work = tdist.all_reduce(torch.zeros(1, device=dev), async_op=True)
        wait_work(work, timeout, what)


def wait_work(work: object, timeout: float, what: str) -> None:
    """Wait for a collective started with ``async_op=True``, at most ``timeout`` seconds;
    ``TimeoutError`` naming this rank and ``what`` otherwise (a failed collective too)."""
    import time
    from datetime import timedelta

    # polled first: NCCL's wait() only orders the current stream after the collective, so the
    # host's bound is here (then wait() raises what the collective failed with, if it did)
    deadline = time.monotonic() + timeout
    while not work.is_completed():  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {get_rank()}: {what} did not complete within {timeout}s")
        time.sleep(0.001)
    try:
        completed = work.wait(timeout=timedelta(seconds=timeout))  # type: ignore[attr-defined]
    except RuntimeError as exc:
        raise TimeoutError(
            f"rank {get_rank()}: {what} did not complete within {timeout}s "
            f"(another rank failed or is stuck): {exc}"
        ) from exc
    if completed is False:
        raise TimeoutError(f"rank {get_rank()}: {what} did not complete within {timeout}s")
