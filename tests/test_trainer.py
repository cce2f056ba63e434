from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch
from toy import CountingModel, Model, ServiceFailsAfterFirstStep, batches

from recis_async import Hook, HookBus, HookError, Trainer, TrainingArguments, add_metric
from recis_async.events import (
    AfterBackward,
    AfterEval,
    AfterStep,
    BeforeOptimizerStep,
    BeforeStep,
    Event,
    StepEvent,
)

pytestmark = pytest.mark.anyio


class Recorder(Hook):
    """Records every event compactly: name[/e for eval](global_step,local_step,epoch)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.steps: list[AfterStep] = []

    def event(self, ev: Event) -> None:
        name = type(ev).__name__ + ("" if ev.is_train else "/e")
        if isinstance(ev, StepEvent):
            name += f"({ev.global_step},{ev.local_step},{ev.epoch})"
        if isinstance(ev, AfterStep):
            self.steps.append(ev)
        self.log.append(name)


def make(data: Any, rec: Recorder, eval_data: Any = None, **kwargs: Any) -> tuple[Trainer, Model]:
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    args = TrainingArguments(**{"log_steps": 10, "save_steps": None, **kwargs})
    trainer = Trainer(
        model,
        args,
        train_dataset=data,
        eval_dataset=eval_data,
        hooks=[rec],
        dense_optimizers=(opt, None),
    )
    return trainer, model


def step(kind: str, g: int, l: int, e: int = 0) -> list[str]:
    suffix = "" if kind == "t" else "/e"
    train = ["AfterBackward", "BeforeOptimizerStep", "AfterOptimizerStep"]
    names = ["BeforeStep", "AfterData"] + (train if kind == "t" else []) + ["AfterStep"]
    return [f"{n}{suffix}({g},{l},{e})" for n in names]


async def test_train_publishes_the_reference_order(tensor_path: str) -> None:
    rec = Recorder()
    trainer, _ = make(batches(2), rec, train_epoch=2)
    await trainer.train()
    expected = (
        ["Start", "BeforeEpoch"]
        + step("t", 0, 0)
        + step("t", 1, 1)
        + ["BeforeStep(2,2,0)", "OutOfData(2,2,0)", "AfterTrain", "AfterEpoch", "BeforeEpoch"]
        + step("t", 2, 0, 1)
        + step("t", 3, 1, 1)
        + ["BeforeStep(4,2,1)", "OutOfData(4,2,1)", "AfterTrain", "AfterEpoch", "End"]
    )
    assert rec.log == expected
    assert trainer.global_step == 4
    assert all(s.samples == 4 for s in rec.steps)
    if tensor_path == "device":
        # the loss stays a tensor on its device (issue 23): read by the hooks once per window
        assert all(isinstance(s.metrics["loss"], torch.Tensor) for s in rec.steps)
        assert all(s.metrics["loss"].shape == () for s in rec.steps)
    else:  # a CPU loss waits for nothing: its number, read at the call
        assert all(type(s.metrics["loss"]) is float for s in rec.steps)


async def test_train_steps_runs_exactly_that_many() -> None:
    rec = Recorder()
    trainer, _ = make(batches(10), rec, train_steps=3, train_epoch=5)
    await trainer.train()
    assert [s.global_step for s in rec.steps] == [0, 1, 2]
    assert rec.log[-3:] == ["AfterTrain", "AfterEpoch", "End"]
    assert "OutOfData" not in " ".join(rec.log)


async def test_evaluate_only_eval_values() -> None:
    rec = Recorder()
    trainer, _ = make(batches(2), rec, eval_data=batches(3, seed=1), eval_steps=2)
    metrics = await trainer.evaluate()
    assert rec.log == ["Start/e"] + step("e", 0, 0) + step("e", 0, 1) + ["AfterEval/e", "End"]
    assert all(not s.is_train and set(s.metrics) == {"loss"} for s in rec.steps)
    assert metrics["loss"] == pytest.approx(sum(s.metrics["loss"] for s in rec.steps) / 2)


async def test_train_and_evaluate_interleaves_and_never_mixes_metrics() -> None:
    rec = Recorder()
    trainer, _ = make(batches(1), rec, eval_data=batches(1, seed=1), train_epoch=2)
    leaky_rec = Recorder()
    leaky, _ = make(batches(1), leaky_rec, eval_data=batches(1, seed=1), train_steps=1)

    class Leaky(Hook):
        def after_step(self, ev: AfterStep) -> None:
            from recis_async import add_metric

            if ev.is_train:
                add_metric("train_only", 1.0)  # collected after this step: must not reach eval

    leaky.hooks.append(Leaky())
    await leaky.train_and_evaluate()
    # train_steps=1 ends the epoch without OutOfData: the eval step follows the train step
    assert leaky_rec.log[:9] == ["Start", "BeforeEpoch", *step("t", 0, 0), "AfterTrain"]
    assert [s.metrics for s in leaky_rec.steps if not s.is_train] == [
        {"loss": pytest.approx(leaky_rec.steps[-1].metrics["loss"])}
    ]
    await trainer.train_and_evaluate()
    expected = (
        ["Start", "BeforeEpoch"]
        + step("t", 0, 0)
        + ["BeforeStep(1,1,0)", "OutOfData(1,1,0)", "AfterTrain"]
        + step("e", 1, 0)
        + ["BeforeStep/e(1,1,0)", "OutOfData/e(1,1,0)", "AfterEval/e", "AfterEpoch", "BeforeEpoch"]
        + step("t", 1, 0, 1)
        + ["BeforeStep(2,1,1)", "OutOfData(2,1,1)", "AfterTrain"]
        + step("e", 2, 0, 1)
        + ["BeforeStep/e(2,1,1)", "OutOfData/e(2,1,1)", "AfterEval/e", "AfterEpoch", "End"]
    )
    assert rec.log == expected


class Windows:
    def __init__(self, parts: list[list[dict[str, torch.Tensor]]]) -> None:
        self.parts = parts

    def windows(self) -> Iterable[Iterable[dict[str, torch.Tensor]]]:
        return iter(self.parts)


async def test_windowed_dataset_gets_window_events() -> None:
    rec = Recorder()
    data = Windows([batches(1), batches(1, seed=2)])
    trainer, _ = make(data, rec)
    await trainer.train()
    expected = (
        ["Start", "WindowMode", "BeforeEpoch", "BeforeWindow"]
        + step("t", 0, 0)
        + ["BeforeStep(1,1,0)", "OutOfData(1,1,0)", "AfterTrain", "AfterWindow", "BeforeWindow"]
        + step("t", 1, 0)
        + [
            "BeforeStep(2,1,0)",
            "OutOfData(2,1,0)",
            "AfterTrain",
            "AfterWindow",
            "AfterEpoch",
            "End",
        ]
    )
    assert rec.log == expected


async def test_stop_request_is_honoured_at_the_step_boundary() -> None:
    rec = Recorder()

    class StopAt2(Hook):
        def after_step(self, ev: AfterStep) -> None:
            if ev.global_step == 1:
                self.bus.request_stop("enough")

        def attach(self, bus: HookBus) -> None:
            self.bus = bus

    trainer, _ = make(batches(10), rec, train_epoch=3)
    trainer.hooks.append(StopAt2())
    await trainer.train()
    assert [s.global_step for s in rec.steps] == [0, 1]
    assert rec.log[-4:] == ["AfterStep(1,1,0)", "AfterTrain", "AfterEpoch", "End"]


async def test_hooks_never_advance_the_step_and_training_learns() -> None:
    rec = Recorder()
    trainer, model = make(batches(50), rec)
    before = [p.detach().clone() for p in model.parameters()]
    await trainer.train()
    assert [s.global_step for s in rec.steps] == list(range(50))
    assert rec.steps[-1].metrics["loss"] < rec.steps[0].metrics["loss"]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


async def test_gradient_accumulation_steps_the_optimizer_every_k() -> None:
    updates: list[int] = []

    class CountingSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            updates.append(1)
            return super().step(closure)

    model = Model()
    opt = CountingSGD(model.parameters(), lr=0.01)
    args = TrainingArguments(gradient_accumulation_steps=3, save_steps=None)
    await Trainer(model, args, train_dataset=batches(7), dense_optimizers=(opt, None)).train()
    assert len(updates) == 3  # after steps 3 and 6, plus the leftover of step 7


async def test_gradient_accumulation_publishes_the_optimizer_events_of_each_update() -> None:
    """AfterBackward.sync says which micro-steps an optimizer step follows; the two optimizer
    events come once per update, carrying the optimizer, the leftover update before
    AfterTrain; the gradients a BeforeOptimizerStep subscriber sees are the accumulated ones."""
    rec = Recorder()
    syncs: list[tuple[int, bool]] = []
    seen: list[tuple[int, tuple[Any, ...], float]] = []
    trainer, model = make(batches(5), rec, gradient_accumulation_steps=2)
    opt = trainer.optimizer
    async with HookBus() as bus:
        bus.subscribe(AfterBackward, lambda e: syncs.append((e.global_step, e.sync)))
        bus.subscribe(
            BeforeOptimizerStep,
            lambda e: seen.append(
                (e.global_step, e.optimizers, float(model.linear.weight.grad.abs().sum()))
            ),
        )
        trainer.bus = bus
        await trainer.train()
    assert syncs == [(0, False), (1, True), (2, False), (3, True), (4, False)]
    assert [(g, o) for g, o, _ in seen] == [(1, (opt,)), (3, (opt,)), (4, (opt,))]
    assert all(total > 0 for _, _, total in seen)
    train_events = [e for e in rec.log if "Optimizer" in e or e == "AfterTrain"]
    assert train_events == [
        "BeforeOptimizerStep(1,1,0)",
        "AfterOptimizerStep(1,1,0)",
        "BeforeOptimizerStep(3,3,0)",
        "AfterOptimizerStep(3,3,0)",
        "BeforeOptimizerStep(4,4,0)",  # the leftover of step 4, after the data ran out
        "AfterOptimizerStep(4,4,0)",
        "AfterTrain",
    ]


async def test_trainer_uses_a_given_open_bus_and_end_once() -> None:
    rec = Recorder()
    trainer, _ = make(batches(1), rec, eval_data=batches(1))
    async with HookBus() as bus:
        trainer.bus = bus
        await trainer.train()
        await trainer.evaluate()
        assert "End" not in rec.log
    assert rec.log.count("End") == 1 and rec.log[-1] == "End"


def published_names(bus: HookBus) -> list[str]:
    """The names of the events published on ``bus`` from now on, in order (a live list)."""
    published: list[str] = []
    publish = bus.publish

    def recording(event: Event) -> Any:
        published.append(type(event).__name__)
        return publish(event)

    bus.publish = recording  # type: ignore[method-assign]
    return published


async def test_step_events_nobody_receives_are_not_published() -> None:
    """BeforeStep, AfterData, AfterBackward and the optimizer-step events reach their
    subscribers, with their step's fields; with none (the default hooks subscribe to none of
    them), the trainer does not build or publish them."""
    trainer, _ = make(batches(3), Recorder())
    trainer.hooks = [h for h in trainer.hooks if not isinstance(h, Recorder)]
    backward: list[int] = []
    async with HookBus() as bus:
        published = published_names(bus)
        trainer.bus = bus
        assert not bus.has_subscribers(AfterBackward)
        await trainer.train()
        steps = ["AfterStep"] * 3 + ["OutOfData"]
        assert published == ["Start", "BeforeEpoch", *steps, "AfterTrain", "AfterEpoch"]
        published.clear()
        with bus.subscribe(AfterBackward, lambda e: backward.append(e.global_step)):
            assert bus.has_subscribers(AfterBackward) and bus.has_subscribers(StepEvent) is False
            await trainer.train()
        assert not bus.has_subscribers(AfterBackward)
    assert "AfterBackward" in published and "AfterData" not in published
    assert backward == [3, 4, 5]


async def test_a_before_step_nobody_receives_is_not_published_yet_the_bus_acts_on_it() -> None:
    """Without a ``BeforeStep`` subscriber (no logger) the trainer publishes none, and the bus
    still does its part of one: a value collected after an evaluation, before the next
    training step, belongs to neither and is dropped, not merged into that training step."""

    class Stray(Hook):
        def __init__(self) -> None:
            self.train_metrics: list[list[str]] = []

        def after_eval(self, event: AfterEval) -> None:
            add_metric("stray", 1.0)

        def after_step(self, event: AfterStep) -> None:
            if event.is_train:
                self.train_metrics.append(sorted(event.metrics))

    stray = Stray()
    trainer, _ = make(batches(2), Recorder(), eval_data=batches(1))
    trainer.hooks = [stray]
    async with HookBus() as bus:
        published = published_names(bus)
        trainer.bus = bus
        assert not bus.has_subscribers(BeforeStep)
        await trainer.evaluate()
        await trainer.train()
        train_steps = published[published.index("AfterEval") :]
        assert "BeforeStep" not in train_steps and train_steps.count("AfterStep") == 2
        assert stray.train_metrics == [["loss"], ["loss"]]
        late: list[int] = []  # a subscriber added later receives it from then on
        with bus.subscribe(BeforeStep, lambda e: late.append(e.global_step)):
            await trainer.train()
        assert late == [2, 3, 4]  # the last one finds the data ended (OutOfData)


async def test_a_failure_waiting_at_a_step_boundary_is_raised_before_the_next_step() -> None:
    """With no ``BeforeStep`` subscriber the trainer publishes none, yet a service's failure
    recorded during a step is still raised at the next step's start, before its model call
    (the step boundary then publishes, as before): nothing runs that the failure would lose."""
    model = CountingModel()
    trainer = Trainer(
        model,
        TrainingArguments(save_steps=None),
        train_dataset=batches(3),
        hooks=[ServiceFailsAfterFirstStep()],
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.05), None),
    )
    with pytest.raises(HookError, match="the disk is full"):
        await trainer.train()
    assert model.calls == 1


async def test_body_error_from_model_ends_failed() -> None:
    rec = Recorder()

    class Broken(Model):
        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            raise FloatingPointError("diverged")

    model = Broken()
    trainer = Trainer(
        model,
        TrainingArguments(save_steps=None),
        train_dataset=batches(2),
        hooks=[rec],
        dense_optimizers=(torch.optim.SGD(model.parameters(), 0.1), None),
    )
    with pytest.raises(FloatingPointError, match="diverged"):
        await trainer.train()
    assert rec.log[-4:] == ["BeforeStep(0,0,0)", "AfterData(0,0,0)", "Error", "End"]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"TrainingArguments\(train_steps=...\): expected a positive int, got 0"
    ):
        TrainingArguments(train_steps=0)
    with pytest.raises(
        ValueError,
        match=r"TrainingArguments\(gradient_accumulation_steps=...\): expected a positive int, "
        r"got -1",
    ):
        TrainingArguments(gradient_accumulation_steps=-1)
    with pytest.raises(TypeError, match=r"TrainingArguments\(output_dir=...\): expected a non"):
        TrainingArguments(output_dir=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TrainingArguments\(log_steps=...\): .* got '10'"):
        TrainingArguments(log_steps="10")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Trainer\(hooks\[0\]\): expected a Hook"):
        Trainer(Model(), hooks=[print])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"Trainer\(train_dataset=...\): expected an iterable"):
        Trainer(Model(), train_dataset=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dense_optimizers"):
        Trainer(Model(), dense_optimizers=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Trainer\(hooks=...\): expected a list of Hooks, got <"):
        Trainer(Model(), hooks=Recorder())  # type: ignore[arg-type]
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        TypeError,
        match=r"Trainer\(dense_optimizers=...\): expected \(optimizer, lr_scheduler\), got SGD$",
    ):
        Trainer(model, dense_optimizers=opt)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"Trainer\(dense_optimizers\[0\]=...\): expected the optimizer \(an object with "
        r"step\(\) and zero_grad\(\)\) or None, got int",
    ):
        Trainer(model, dense_optimizers=(3, None))
    with pytest.raises(
        TypeError, match=r"Trainer\(dense_optimizers\[1\]=...\): expected the lr_scheduler"
    ):
        Trainer(model, dense_optimizers=(opt, "cosine"))


async def test_non_scalar_loss_is_refused_naming_the_shape() -> None:
    class Vector(Model):
        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.linear(batch["x"])

    model = Vector()
    trainer = Trainer(
        model,
        TrainingArguments(save_steps=None),
        train_dataset=batches(1),
        dense_optimizers=(torch.optim.SGD(model.parameters(), 0.1), None),
    )
    with pytest.raises(
        TypeError,
        match=r"expected the scalar loss tensor, a dict with 'loss' or a tuple whose first item "
        r"is the loss, got a tensor of shape \(4, 1\)",
    ):
        await trainer.train()


@pytest.mark.parametrize(
    ("output", "error", "match"),
    [
        (
            "vector",
            TypeError,
            r"model\(batch\)\['loss'\]: expected the scalar loss tensor, got a "
            r"tensor of shape \(4, 1\)",
        ),
        ("detached", ValueError, r"expected a loss that requires grad"),
        ("other key", TypeError, r"got a dict without 'loss' \(keys: \['lost'\]\)"),
    ],
)
async def test_a_dict_of_one_entry_is_checked_as_any_output(
    output: str, error: type[Exception], match: str
) -> None:
    class OneEntry(Model):
        def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if output == "vector":
                return {"loss": self.linear(batch["x"])}
            if output == "detached":
                return {"loss": super().forward(batch).detach()}
            return {"lost": super().forward(batch)}

    model = OneEntry()
    trainer = Trainer(
        model,
        TrainingArguments(save_steps=None),
        train_dataset=batches(1),
        dense_optimizers=(torch.optim.SGD(model.parameters(), 0.1), None),
    )
    with pytest.raises(error, match=match):
        await trainer.train()


async def test_a_loss_without_grad_is_refused_before_backward() -> None:
    class Detached(Model):
        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return super().forward(batch).detach()

    model = Detached()
    trainer = Trainer(
        model,
        TrainingArguments(save_steps=None),
        train_dataset=batches(1),
        dense_optimizers=(torch.optim.SGD(model.parameters(), 0.1), None),
    )
    with pytest.raises(
        ValueError,
        match=r"model\(batch\) in training: expected a loss that requires grad .*, got a "
        r"tensor without grad_fn",
    ):
        await trainer.train()


async def test_the_trainer_logs_every_log_steps_unless_given_a_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from recis_async.hooks import LoggerHook

    rec = Recorder()
    trainer, _ = make(batches(6), rec, log_steps=3)
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.logger"):
        await trainer.train()
    lines = [r.getMessage() for r in caplog.records if "gstep=" in r.getMessage()]
    assert len(lines) == 2 and "<gstep=2>" in lines[0] and "<gstep=5>" in lines[1]

    own = LoggerHook(log_step=100)
    trainer2, _ = make(batches(2), Recorder(), log_steps=1)
    trainer2.hooks.append(own)
    async with HookBus() as bus:
        trainer2.bus = bus
        await trainer2.train()
        assert [type(h).__name__ for h in bus.hooks].count("LoggerHook") == 1
