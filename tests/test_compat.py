"""from_recis: hooks written against RecIS's documented ``recis.hooks.Hook`` run unchanged.

RecIS is not installed: ``RecisBase`` below restates the documented base class (every method
variadic and doing nothing), and the hooks subclass it as a RecIS user would.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from toy import Model, batches

from recis_async import HookBus, HookError, Trainer, TrainingArguments, add_metric
from recis_async.compat import from_recis
from recis_async.events import AfterStep, BeforeStep, OutOfData, Start

pytestmark = pytest.mark.anyio


class RecisBase:
    """The documented signatures of ``recis.hooks.Hook``."""

    def window_mode(self, *args: Any, **kwargs: Any) -> None: ...
    def out_off_data(self, *args: Any, **kwargs: Any) -> None: ...
    def before_epoch(self, is_train: bool = True, *args: Any, **kwargs: Any) -> None: ...
    def after_epoch(self, is_train: bool = True, *args: Any, **kwargs: Any) -> None: ...
    def before_window(self, is_train: bool = True, *args: Any, **kwargs: Any) -> None: ...
    def after_window(self, is_train: bool = True, *args: Any, **kwargs: Any) -> None: ...
    def before_step(self, is_train: bool = True, *args: Any, **kwargs: Any) -> None: ...
    def after_step(self, is_train: bool = True, *args: Any, **kwargs: Any) -> None: ...
    def start(self, is_train: bool = True, *args: Any, **kwargs: Any) -> None: ...
    def end(self, is_train: bool = True, *args: Any, **kwargs: Any) -> None: ...
    def after_data(self, is_train: bool = True, *args: Any, **kwargs: Any) -> None: ...
    def after_eval(self, *args: Any, **kwargs: Any) -> None: ...
    def after_train(self, *args: Any, **kwargs: Any) -> None: ...
    def after_backward(self, *args: Any, **kwargs: Any) -> None: ...


class Recording(RecisBase):
    """Writes down every call with its arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __getattribute__(self, name: str) -> Any:
        attr = object.__getattribute__(self, name)
        if name.startswith("_") or name == "calls" or not callable(attr):
            return attr
        calls = object.__getattribute__(self, "calls")

        def record(*args: Any, **kwargs: Any) -> Any:
            assert not args, f"{name} got positional arguments {args}"
            calls.append((name, kwargs))
            return attr(**kwargs)

        return record


class LogEvery(RecisBase):
    """A logging hook as RecIS users write them (modelled on RecIS's LoggerHook)."""

    def __init__(self, log_step: int) -> None:
        self.log_step = log_step
        self.steps = 0
        self.logger = logging.getLogger("recis_user.log_every")

    def after_step(self, metrics=None, global_step=0, is_train=True, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.steps % self.log_step == 0:
            text = " ".join(f"<{k}={v}>" for k, v in metrics.items())
            self.logger.info(f"<gstep={int(global_step)}> <lstep={self.steps}>{text}")
        self.steps += 1


class Accumulate(RecisBase):
    """Sums the training loss and counts eval steps; keeps the tensors it was given."""

    def __init__(self) -> None:
        self.train_loss = 0.0
        self.eval_steps = 0
        self.steps: list[Any] = []
        self.ended: list[bool] = []

    def after_step(self, metrics=None, global_step=0, is_train=True, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.steps.append(global_step)
        if is_train:
            self.train_loss += float(metrics["loss"])
        else:
            self.eval_steps += 1

    def end(self, is_train=True, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.ended.append(is_train)


class StopAfter(RecisBase):
    """Asks for a stop through the route from_recis documents."""

    def __init__(self, last: int) -> None:
        self.last = last

    def after_step(self, metrics=None, global_step=0, is_train=True, *args, **kwargs):  # type: ignore[no-untyped-def]
        if is_train and global_step >= self.last:
            self.request_stop(f"reached step {int(global_step)}")  # type: ignore[attr-defined]


class Fails(RecisBase):
    def __init__(self) -> None:
        self.calls = 0

    def after_step(self, metrics=None, global_step=0, is_train=True, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls += 1
        raise KeyError("no such metric")


def trainer(hooks: list[Any], *, train: int = 2, eval_: int = 1, **kwargs: Any) -> Trainer:
    model = Model()
    return Trainer(
        model,
        TrainingArguments(**{"save_steps": None, "log_steps": 1000, **kwargs}),
        train_dataset=batches(train),
        eval_dataset=batches(eval_, seed=1),
        hooks=hooks,
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None),
    )


async def test_the_trainer_calls_each_method_with_recis_arguments() -> None:
    rec = Recording()
    await trainer([from_recis(rec)]).train_and_evaluate()
    names = [name for name, _ in rec.calls]
    train_step = ["before_step", "after_data", "after_backward", "after_step"]
    assert names == [
        "start",
        "before_epoch",
        *train_step,
        *train_step,
        "before_step",
        "out_off_data",
        "after_train",
        "before_step",
        "after_data",
        "after_step",
        "before_step",
        "out_off_data",
        "after_eval",
        "after_epoch",
        "end",
    ]
    kwargs = dict(enumerate(rec.calls))
    assert kwargs[0] == ("start", {"is_train": True})
    assert kwargs[3] == ("after_data", {"is_train": True, "data": None})
    assert kwargs[4] == ("after_backward", {"is_train": True})
    name, step = kwargs[5]
    assert name == "after_step" and set(step) == {"metrics", "global_step", "is_train"}
    assert set(step["metrics"]) == {"loss", "epoch"} and step["metrics"]["epoch"] == 0
    assert (
        isinstance(step["global_step"], torch.Tensor) and step["global_step"].dtype == torch.int64
    )
    assert int(step["global_step"]) == 0 and step["is_train"] is True
    eval_step = rec.calls[names.index("after_step", 12)][1]
    assert eval_step["is_train"] is False and eval_step["eval_result"] is None
    assert set(eval_step["metrics"]) == {"loss"} and int(eval_step["global_step"]) == 2
    assert rec.calls[-1] == ("end", {"is_train": True})
    assert ("window_mode", {}) not in rec.calls


async def test_evaluate_ends_with_is_train_false_and_array_metrics_arrive_as_tensors() -> None:
    acc, rec = Accumulate(), Recording()
    async with HookBus() as bus:
        bus.add_hook(from_recis(acc))
        bus.add_hook(from_recis(rec))
        await bus.publish(Start(is_train=False))
        await bus.publish(BeforeStep(is_train=False, global_step=7))
        add_metric("probs", torch.tensor([0.25, 0.75]))
        names = np.array(["a", "b"])
        await bus.publish(
            AfterStep(is_train=False, global_step=7, samples=2, metrics={"names": names})
        )
    assert acc.eval_steps == 1 and acc.ended == [False]
    metrics = [kw for name, kw in rec.calls if name == "after_step"][0]["metrics"]
    assert torch.equal(metrics["probs"], torch.tensor([0.25, 0.75]))
    assert metrics["names"].tolist() == ["a", "b"]  # not numeric: stays an array


async def test_logging_accumulating_and_stopping_hooks_run_on_the_trainer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log, acc, stop = LogEvery(2), Accumulate(), StopAfter(3)
    steps: list[AfterStep] = []
    t = trainer([from_recis(log), from_recis(acc), from_recis(stop)], train=10)
    async with HookBus() as bus:
        bus.subscribe(AfterStep, steps.append)
        t.bus = bus
        with caplog.at_level(logging.INFO, logger="recis_user.log_every"):
            await t.train()
        assert bus.stop_reason == "reached step 3"
    assert [s.global_step for s in steps] == [0, 1, 2, 3]  # stopped at the step boundary
    assert [int(g) for g in acc.steps] == [0, 1, 2, 3]
    assert acc.train_loss == pytest.approx(sum(s.metrics["loss"] for s in steps))
    assert acc.ended == [True]
    lines = [r.getMessage() for r in caplog.records if r.name == "recis_user.log_every"]
    assert [line.split()[0] for line in lines] == ["<gstep=0>", "<gstep=2>"]
    assert "<epoch=0>" in lines[0] and "<loss=" in lines[0]


async def test_each_trainer_call_binds_the_stop_route_to_its_own_bus() -> None:
    stop = StopAfter(0)
    hook = from_recis(stop)
    t = trainer([hook], train=5, train_epoch=1)
    await t.train()
    assert t.global_step == 1
    await t.train()  # a second run opens a new bus: the stop request goes there
    assert t.global_step == 2


async def test_a_hook_with_its_own_request_stop_keeps_it() -> None:
    class Own(RecisBase):
        asked = 0

        def request_stop(self) -> None:
            self.asked += 1

        def after_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.request_stop()

    own = Own()
    async with HookBus() as bus:
        bus.add_hook(from_recis(own))
        await bus.publish(AfterStep())
        assert own.asked == 1 and not bus.should_stop


async def test_exceptions_follow_on_error(caplog: pytest.LogCaptureFixture) -> None:
    async with HookBus() as bus:
        bus.add_hook(from_recis(Fails()))
        with pytest.raises(HookError, match=r"Fails\.after_step failed on AfterStep: KeyError"):
            await bus.publish(AfterStep(global_step=4))

    logged = Fails()
    with caplog.at_level(logging.ERROR, logger="recis_async.bus"):
        async with HookBus() as bus:
            bus.add_hook(from_recis(logged, on_error="log"))
            for step in range(3):
                await bus.publish(AfterStep(global_step=step))
    assert logged.calls == 3 and any("Fails.after_step" in r.getMessage() for r in caplog.records)

    disabled = Fails()
    async with HookBus() as bus:
        bus.add_hook(from_recis(disabled, on_error="disable"))
        for step in range(3):
            await bus.publish(AfterStep(global_step=step))
    assert disabled.calls == 1


async def test_priority_orders_the_wrapped_hook_among_the_others() -> None:
    order: list[str] = []

    class Early(RecisBase):
        def out_off_data(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            order.append("recis")

    async with HookBus() as bus:
        bus.subscribe(OutOfData, lambda e: order.append("normal"))
        bus.add_hook(from_recis(Early(), priority="HIGHEST"))
        await bus.publish(OutOfData())
    assert order == ["recis", "normal"]


def test_from_recis_names_what_it_cannot_wrap() -> None:
    from recis_async.hooks import LoggerHook

    with pytest.raises(TypeError, match=r"from_recis\(hook=...\): expected an object with RecIS"):
        from_recis(object())
    with pytest.raises(TypeError, match=r"expected a hook instance, got the class Accumulate"):
        from_recis(Accumulate)
    with pytest.raises(TypeError, match=r"a recis_async Hook already"):
        from_recis(LoggerHook())
    with pytest.raises(ValueError, match=r"from_recis\(on_error=...\): expected one of"):
        from_recis(Accumulate(), on_error="ignore")  # type: ignore[arg-type]
