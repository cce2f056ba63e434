"""The library's own small collectives (``recis_async.dist``) in one process: on the CPU
where the default group takes CPU tensors, on this rank's CUDA device where it is NCCL alone
(NCCL takes no CPU tensor: before, the Logger's all-reduce, the checkpoint barrier and the
evaluation's all-gather failed on every NCCL job).  The multi-rank runs are in
``test_distributed.py`` (torchrun, gloo)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from recis_async import dist


@pytest.fixture
def group(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[None]:
    """A one-rank default group of the backend ``request.param``."""
    tdist.init_process_group(
        request.param, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        tdist.destroy_process_group()


def _exchange(device: torch.device | None) -> None:
    kw = {"timeout": 30.0, "what": "a test's collective", "device": device}
    assert dist.all_reduce_mean({"b": 3.0, "a": 2.0}, **kw) == {"a": 2.0, "b": 3.0}
    assert dist.all_reduce_max([1, 5], **kw) == [1, 5]
    assert dist.all_gather_object({"rows": [1, 2]}, **kw) == [{"rows": [1, 2]}]
    dist.barrier(**kw)


@pytest.mark.parametrize("group", ["gloo"], indirect=True)
def test_a_gloo_group_exchanges_on_the_cpu(group: None) -> None:
    assert dist.collective_device() == torch.device("cpu")
    _exchange(dist.collective_device())
    _exchange(None)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and tdist.is_nccl_available()), reason="needs CUDA and NCCL"
)
@pytest.mark.parametrize("group", ["nccl"], indirect=True)
def test_an_nccl_only_group_exchanges_on_this_ranks_device(group: None) -> None:
    device = dist.collective_device()
    assert device == torch.device("cuda", torch.cuda.current_device())
    _exchange(device)
    with pytest.raises(Exception, match="(?i)cpu|backend"):  # what the library passed before
        dist.barrier(timeout=30.0, what="a CPU tensor to NCCL")


def test_the_wait_is_bounded_and_names_the_rank() -> None:
    class Stuck:  # a collective another rank never joins
        def is_completed(self) -> bool:
            return False

    with pytest.raises(TimeoutError, match=r"rank 0: the stuck one did not complete within 0.05s"):
        dist.wait_work(Stuck(), 0.05, "the stuck one")
