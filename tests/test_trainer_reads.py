"""The Trainer reads no tensor value on the host on an ordinary step (issue 23): counted with
``HostReads`` (a TorchFunctionMode seeing every ``item``/``tolist``/``numpy``/``cpu``/
``float()``/``bool()``... of a tensor in the step's thread) over a real run with its default
hooks (logger, checkpoint saver), a hash-table filter on a dynamic embedding, and evaluation.

Two kinds of read are not the step waiting on a device and are set apart:

* the embedding table's id map works on host ids in host memory on every device, by design
  (the ids come from the loader on the host): ``nn/slot_map.py``, and ``nn/_host.py`` whose
  reads check that their tensor is on the CPU;
* ``add_metric`` reads a tensor on the call until it keeps tensors on their device (the
  ``windows`` part of issue 23); detected below, so that once it does, its reads count.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from host_reads import HostReads, Read

from recis_async import HookBus, Priority, Trainer, TrainingArguments, add_metric
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import HashTableFilterHook, list_checkpoints
from recis_async.nn import DynamicEmbedding, EmbeddingOption, FilterHook

pytestmark = pytest.mark.anyio

LOG, SAVE, STEPS, EVAL = 10, 15, 32, 4


class Ctr(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = DynamicEmbedding(
            EmbeddingOption(
                embedding_dim=4,
                shared_name="user",
                filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 3}),
                initializer=functools.partial(torch.nn.init.normal_, std=0.1),
            )
        )
        self.mlp = torch.nn.Linear(4 + 2, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        u = self.user(batch["user_id"].unsqueeze(1))
        logits = self.mlp(torch.cat([u, batch["dense"]], dim=1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])


def batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "user_id": torch.randint(0, 50, (16,), generator=g) + 10 * i,  # old ids go stale
            "dense": torch.randn(16, 2, generator=g),
            "label": (torch.rand(16, generator=g) > 0.5).float(),
        }
        for i in range(n)
    ]


async def add_metric_reads() -> bool:
    """Whether ``add_metric`` still reads a tensor on the call (the value it keeps is not a
    tensor), as it did before it learnt to keep tensors on their device."""
    kept: list[Any] = []
    async with HookBus(handle_signals=False) as bus:
        bus.subscribe(AfterStep, lambda ev: kept.append(ev.metrics["x"]))
        add_metric("x", torch.tensor(1.0))
        await bus.publish(AfterStep(global_step=0))
    return not isinstance(kept[0], torch.Tensor)


def stalls(reads: list[Read], allowed: tuple[str, ...]) -> list[Read]:
    return [r for r in reads if not any(f"/recis_async/{a}:" in r.source for a in allowed)]


async def test_no_host_read_on_an_ordinary_step_of_the_trainer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Ctr()
    allowed = ("nn/slot_map.py", "nn/_host.py") + (("collect.py",) if await add_metric_reads() else ())
    filter_hook = HashTableFilterHook(4, model=model)
    trainer = Trainer(
        model,
        TrainingArguments(
            output_dir=str(tmp_path / "ckpt"),
            log_steps=LOG,
            save_steps=SAVE,
            train_steps=STEPS,
            eval_steps=EVAL,
        ),
        train_dataset=batches(STEPS, 1),
        eval_dataset=batches(EVAL, 2),
        hooks=[filter_hook],
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
    )
    counter = HostReads()

    def label(event: BeforeStep) -> None:
        counter.where = ("train" if event.is_train else "eval", event.local_step)

    with counter:
        async with HookBus() as bus:
            trainer.bus = bus
            bus.subscribe(BeforeStep, label, priority=Priority.HIGHEST)
            await trainer.train_and_evaluate()
            await filter_hook.wait_idle()
    assert trainer.global_step == STEPS
    assert [step for step, _ in list_checkpoints(tmp_path / "ckpt")] == [15, 30, 32]
    boundaries = {s for s in range(STEPS) if (s + 1) % LOG == 0 or (s + 1) % SAVE == 0}
    ordinary = [("train", s) for s in range(STEPS) if s not in boundaries]
    ordinary += [("eval", s) for s in range(EVAL)]  # eval steps; AfterEval comes after them
    found = {where: stalls(counter.at(where), allowed) for where in ordinary}
    assert {w: r for w, r in found.items() if r} == {}
    assert filter_hook.last_filter_step is not None  # the filter ran (in its worker thread)
    # the counter does see reads: the table's id map reads host ids on every lookup
    assert any("nn/slot_map.py" in r.source for r in counter.at(("train", 1)))
