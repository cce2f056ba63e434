"""HashTableFilterHook on a real bus (asyncio and trio) and under the Trainer."""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

import anyio
import pytest
import torch
from torch import nn

from recis_async import Hook, HookBus, Trainer, TrainingArguments
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import HashTableFilterHook
from recis_async.nn import DynamicEmbedding, EmbeddingOption, EvictionPlan, FilterHook, HashTable

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


def table(n: int, name: str = "user") -> HashTable:
    return HashTable(2, name=name, filter_hook=FilterHook("GlobalStepFilter", {"filter_step": n}))


async def train_step(bus: HookBus, hook: HashTableFilterHook, step: int, *lookups: Any) -> None:
    await bus.publish(BeforeStep(global_step=step))
    for tbl, ids in lookups:
        tbl(torch.tensor(ids))
    await bus.publish(AfterStep(global_step=step))
    await hook.wait_idle()


@pytest.mark.async_bus_only  # awaits the hook's own coroutine (wait_idle) from the test
async def test_evicts_at_the_interval_with_the_exact_rule(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="recis_async.hooks.hashtable_filter")
    t = table(2)
    hook = HashTableFilterHook(3, tables=[t])
    seen: list[list[int]] = []
    async with HookBus() as bus:
        bus.add_hook(hook)
        for step in range(12):
            await train_step(bus, hook, step, (t, [step, 100]))  # 100 is used every step
            seen.append(t.ids().tolist())
        stats = bus.stats()["services"]["HashTableFilterHook"]
    # anchor at step 0, evictions at 3, 6, 9; an id used at step s goes iff step - s > 2
    assert seen[2] == [0, 1, 2, 100]
    assert seen[3] == [1, 2, 3, 100]  # 0 went: 3 - 0 > 2; 1 stayed: 3 - 1 = 2
    assert seen[5] == [1, 2, 3, 4, 5, 100]
    assert seen[6] == [4, 5, 6, 100]
    assert seen[9] == [7, 8, 9, 100]
    assert seen[11] == [7, 8, 9, 10, 11, 100]
    assert stats["evictions"] == 3 and stats["last_step"] == 9
    assert stats["evicted"] == 1 + 3 + 3 == stats["evicted_by_table"]["user"]
    assert stats["ids_by_table"] == {"user": 6} and stats["skipped"] == 0
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert logged == [
        "HashTableFilterHook: step 3 evicted 1 ids (user 1), 4 ids left",
        "HashTableFilterHook: step 6 evicted 3 ids (user 3), 4 ids left",
        "HashTableFilterHook: step 9 evicted 3 ids (user 3), 4 ids left",
        "HashTableFilterHook: 3 evictions removed 7 ids (user 7); 0 requests skipped while one ran",
    ]


@pytest.mark.async_bus_only  # awaits the hook's own coroutine (wait_idle) from the test
async def test_quiet_at_info_when_nothing_is_evicted(caplog: pytest.LogCaptureFixture) -> None:
    """Evictions that remove nothing, per-table counts and skipped requests are DEBUG only:
    at INFO a run that evicts nothing shows one summary line, whatever its length."""
    caplog.set_level(logging.DEBUG, logger="recis_async.hooks.hashtable_filter")
    user, item = table(2, "user"), table(2, "item")
    hook = HashTableFilterHook(2, tables=[user, item])
    async with HookBus() as bus:
        bus.add_hook(hook)
        for step in range(40):
            await train_step(bus, hook, step, (user, [1]), (item, [2]))
        for step in (41, 42, 43):  # one runs, one waits, the third is skipped
            hook._service.request(step)  # type: ignore[union-attr]
        stats = bus.stats()["services"]["HashTableFilterHook"]
    assert stats["evictions"] >= 19 and stats["evicted"] == 0 and stats["skipped"] >= 1
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(info) == 1, info
    assert re.fullmatch(
        r"HashTableFilterHook: \d+ evictions removed 0 ids \(user 0, item 0\); "
        r"[1-9]\d* requests skipped while one ran",
        info[0],
    ), info
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("evicted 0 of 0 candidate ids from 'item'" in m for m in debug)
    assert any("skipped, the previous one is still running" in m for m in debug)


@pytest.mark.async_bus_only  # awaits the hook's own coroutine (wait_idle) from the test
async def test_eval_steps_neither_advance_nor_evict() -> None:
    t = table(1)
    hook = HashTableFilterHook(1, tables=[t])
    async with HookBus() as bus:
        bus.add_hook(hook)
        await train_step(bus, hook, 0, (t, [1, 2]))
        t.eval()
        for step in range(5):  # eval steps carry the training step they evaluate
            await bus.publish(BeforeStep(is_train=False, global_step=1000 + step))
            t(torch.tensor([1]))
            await bus.publish(AfterStep(is_train=False, global_step=1000 + step))
            await hook.wait_idle()
        assert t.step == 1 and t.ids().tolist() == [1, 2]
        t.train()
        await train_step(bus, hook, 1, (t, [2]))
        assert t.ids().tolist() == [1, 2]  # 1 - 0 = 1, not > 1
        await train_step(bus, hook, 2, (t, [2]))
        # id 1 was last used in training at step 0 (eval lookups did not stamp it)
        assert t.ids().tolist() == [2]
        stats = bus.stats()["services"]["HashTableFilterHook"]
    assert stats["evictions"] == 2 and stats["evicted"] == 1


@pytest.mark.async_bus_only  # awaits the hook's own coroutine (wait_idle) from the test
async def test_tables_from_a_model_and_per_table_counts() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = DynamicEmbedding(
                EmbeddingOption(
                    2, "user", filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 0})
                )
            )
            self.item = DynamicEmbedding(
                EmbeddingOption(
                    2, "item", filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 5})
                )
            )
            self.plain = DynamicEmbedding(EmbeddingOption(2, "plain"))  # no filter: not watched

    model = Model()
    hook = HashTableFilterHook(2, model=model, name="filters")
    assert [t.name for t in hook.tables] == ["user", "item"]
    async with HookBus() as bus:
        bus.add_hook(hook)
        for step in range(5):
            await train_step(
                bus,
                hook,
                step,
                (model.user.table, [step]),
                (model.item.table, [step]),
                (model.plain.table, [step]),
            )
        stats = bus.stats()["services"]["filters"]
    # evictions at 2 and 4: user keeps only ids used at that step, item keeps everything
    assert model.user.table.ids().tolist() == [4]
    assert model.item.table.ids_count() == 5 and model.plain.table.ids_count() == 5
    assert stats["evicted_by_table"] == {"user": 2 + 2, "item": 0}


class GatedTable(HashTable):
    """A table whose scan waits for a gate, to hold an eviction in flight."""

    def __init__(self) -> None:
        super().__init__(
            2, name="gated", filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 0})
        )
        self.gate = threading.Event()
        self.entered = threading.Event()

    def scan_eviction(self, now: int | None = None) -> EvictionPlan:
        self.entered.set()
        self.gate.wait(10)
        return super().scan_eviction(now)


@pytest.mark.async_bus_only  # awaits the eviction's scan, then wait_idle, between publishes
async def test_a_request_while_one_waits_is_skipped_and_the_step_is_not_held() -> None:
    t = GatedTable()
    hook = HashTableFilterHook(1, tables=[t])
    async with HookBus() as bus:
        bus.add_hook(hook)
        for step in range(4):
            await bus.publish(BeforeStep(global_step=step))
            t(torch.tensor([step]))  # lookups go on while a scan waits in its thread
            with anyio.fail_after(5):
                await bus.publish(AfterStep(global_step=step))
            if step == 1:
                with anyio.fail_after(5):
                    await anyio.to_thread.run_sync(t.entered.wait)
        stats = bus.stats()["services"]["HashTableFilterHook"]
        assert stats["requests"] == 2 and stats["skipped"] == 1 and stats["pending"] == 2
        t.gate.set()
        with anyio.fail_after(5):
            await hook.wait_idle()
        stats = bus.stats()["services"]["HashTableFilterHook"]
    assert stats["evictions"] == 2 and stats["last_step"] == 2
    assert t.ids().tolist() == [2, 3]


@pytest.mark.async_bus_only  # awaits wait_idle, then the eviction's scan, between publishes
async def test_close_finishes_the_running_eviction() -> None:
    t = GatedTable()
    hook = HashTableFilterHook(1, tables=[t])
    async with HookBus() as bus:
        bus.add_hook(hook)
        await train_step(bus, hook, 0, (t, [0]))
        await bus.publish(BeforeStep(global_step=1))
        await bus.publish(AfterStep(global_step=1))
        await anyio.to_thread.run_sync(t.entered.wait)
        t.gate.set()
    assert bus.stats()["services"]["HashTableFilterHook"]["evictions"] == 1
    assert t.ids_count() == 0


@pytest.mark.async_bus_only  # the async Trainer takes a HookBus (Trainer(bus=...))
async def test_trainer_run_filters_its_model() -> None:
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = DynamicEmbedding(
                EmbeddingOption(
                    4, "user", filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 2})
                )
            )
            self.head = nn.Linear(4, 1)

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            logits = self.head(self.emb(batch["ids"])).squeeze(1)
            return nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])

    model = Model()
    data = [
        {"ids": torch.tensor([[10 * step + i] for i in range(4)]), "label": torch.ones(4)}
        for step in range(10)
    ]
    hook = HashTableFilterHook(4, model=model)

    class OneEvictionAtATime(Hook):
        """The steps here take microseconds: let each eviction finish before the next step,
        so the one at step 8 is not skipped as overlapping the one at step 4."""

        async def before_step(self, event: BeforeStep) -> None:
            await hook.wait_idle()

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.emb.attach_optimizer(opt)
    async with HookBus() as bus:
        trainer = Trainer(
            model,
            TrainingArguments(train_steps=10, save_steps=None),  # nothing written to cwd
            data,
            hooks=[hook, OneEvictionAtATime()],
            dense_optimizers=(opt, None),
            bus=bus,
        )
        await trainer.train()
        await hook.wait_idle()
        stats = bus.stats()["services"]["HashTableFilterHook"]
    # evictions at steps 4 and 8: ids of steps 0..1 then 2..5 went
    assert stats["last_step"] == 8 and stats["evicted"] == 8 + 16
    assert model.emb.table.ids().tolist() == sorted(
        10 * s + i for s in (6, 7, 8, 9) for i in range(4)
    )


def test_configuration_errors_fail_early() -> None:
    with pytest.raises(ValueError, match="filter_interval: expected an int >= 1 or None"):
        HashTableFilterHook(0)
    with pytest.raises(ValueError, match="filter_interval"):
        HashTableFilterHook(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tables\[0\]: table 'plain' has no filter_hook"):
        HashTableFilterHook(tables=[HashTable(2, name="plain")])
    with pytest.raises(ValueError, match=r"tables\[1\]: expected a HashTable"):
        HashTableFilterHook(tables=[table(1), nn.Linear(1, 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="model: expected a module containing HashTables"):
        HashTableFilterHook(model=nn.Linear(1, 1))
    with pytest.raises(ValueError, match="expected tables=.*or model=.*got neither"):
        HashTableFilterHook(100)
    hook = HashTableFilterHook(100, tables=[table(1)])  # the seed's positional interval
    with pytest.raises(ValueError, match="reset_filter_interval"):
        hook.reset_filter_interval(-3)
    hook.reset_filter_interval(7)
    assert hook.filter_interval == 7
    hook.reset_filter_interval(None)
    assert hook.filter_interval is None
    assert HashTableFilterHook(5, tables=[table(1)], name="items").state_key == "items"


@pytest.mark.async_bus_only  # awaits the hook's own coroutine (wait_idle) from the test
async def test_state_dict_keeps_the_anchor() -> None:
    t = table(0)
    hook = HashTableFilterHook(5, tables=[t])
    async with HookBus() as bus:
        bus.add_hook(hook)
        await train_step(bus, hook, 3, (t, [1]))
        assert hook.state_dict() == {"last_filter_step": 3}
    resumed = HashTableFilterHook(5, tables=[t])
    resumed.load_state_dict(hook.state_dict())
    async with HookBus() as bus:
        bus.add_hook(resumed)
        await train_step(bus, resumed, 7, (t, [2]))
        assert t.ids_count() == 2  # 7 - 3 < 5: no eviction yet
        await train_step(bus, resumed, 8, (t, [2]))
        assert t.ids().tolist() == [2]
    with pytest.raises(ValueError, match="last_filter_step"):
        resumed.load_state_dict({"last_filter_step": "3"})


def test_without_a_bus_the_hook_evicts_in_the_calling_thread() -> None:
    t = table(0)
    hook = HashTableFilterHook(2, tables=[t])
    for step in range(5):
        hook.before_step(BeforeStep(global_step=step))
        t(torch.tensor([step]))
        hook.after_step(AfterStep(global_step=step))
    assert t.ids().tolist() == [4]  # evictions at steps 2 and 4, each keeping that step's id
