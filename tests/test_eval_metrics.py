"""Evaluation that reports: metrics aggregated over the pass, model outputs the Trainer takes,
LoggerHook's eval summary line and its step counts."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from toy import Model, batches

from recis_async import HookBus, MetricAggregator, Trainer, TrainingArguments, add_metric
from recis_async.events import AfterEval, AfterStep, BeforeStep
from recis_async.hooks import LoggerHook

pytestmark = pytest.mark.anyio

_FIELD = re.compile(r"<([\w/.]+)=([^>]*)>")


def logged(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    return [
        dict(_FIELD.findall(r.getMessage()))
        for r in caplog.records
        if r.name == "recis_async.hooks.logger"
    ]


class Scored(Model):
    """Adds per-batch metrics with every reduction; rows differ in count between batches."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = super().forward(batch)
        rows = len(batch["y"])
        add_metric("rows_mean", float(rows))  # default: sample-weighted mean
        add_metric("rows_sum", rows, reduce="sum")
        add_metric("first_x_max", batch["x"][0, 0], reduce="max")
        add_metric("first_x_min", batch["x"][0, 0], reduce="min")
        add_metric("rows_last", rows, reduce="last")
        add_metric("rows_median", rows, reduce=np.median)
        return loss


def uneven(sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    return [batches(1, size=n, seed=i)[0] for i, n in enumerate(sizes)]


def trainer_for(model: torch.nn.Module, eval_data: Any, **kwargs: Any) -> Trainer:
    args = TrainingArguments(**{"save_steps": None, "log_steps": 1000, **kwargs})
    return Trainer(
        model,
        args,
        train_dataset=batches(2),
        eval_dataset=eval_data,
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.01), None),
    )


# ------------------------------------------------------------------ point 7: aggregation
async def test_evaluate_aggregates_every_metric_with_its_reduction() -> None:
    data = uneven([4, 2, 6])
    model = Scored()
    seen: list[AfterEval] = []
    trainer = trainer_for(model, data)
    async with HookBus() as bus:
        bus.subscribe(AfterEval, seen.append)
        trainer.bus = bus
        metrics = await trainer.evaluate()
    with torch.no_grad():
        losses = [float(Model.forward(model, b)) for b in data]
    xs = [float(b["x"][0, 0]) for b in data]
    assert metrics["loss"] == pytest.approx((losses[0] * 4 + losses[1] * 2 + losses[2] * 6) / 12)
    assert metrics["rows_mean"] == pytest.approx((16 + 4 + 36) / 12)  # weighted by samples
    assert metrics["rows_sum"] == 12 and type(metrics["rows_sum"]) is int
    assert metrics["first_x_max"] == pytest.approx(max(xs))
    assert metrics["first_x_min"] == pytest.approx(min(xs))
    assert metrics["rows_last"] == 6
    assert metrics["rows_median"] == 4
    assert [e.metrics for e in seen] == [metrics] and seen[0].steps == 3


async def test_train_and_evaluate_returns_the_last_evaluation() -> None:
    model = Scored()
    evals: list[dict[str, Any]] = []
    trainer = trainer_for(model, uneven([3, 5]), train_epoch=2)
    async with HookBus() as bus:
        bus.subscribe(AfterEval, lambda e: evals.append(e.metrics))
        trainer.bus = bus
        result = await trainer.train_and_evaluate()
    assert len(evals) == 2 and result == evals[-1]
    assert result["rows_sum"] == 8 and set(result) >= {"loss", "rows_mean", "rows_median"}


async def test_own_loop_aggregator_and_a_reduction_that_changes_mid_pass_fails_at_its_step() -> (
    None
):
    agg = MetricAggregator()
    async with HookBus() as bus:
        with bus.subscribe(AfterStep, agg.update, when=lambda e: not e.is_train):
            for step, n in enumerate([2, 3]):
                await bus.publish(BeforeStep(is_train=False, global_step=step))
                add_metric("hits", n, reduce="sum")
                add_metric("auc", 0.5 + step / 10)
                add_metric("tag", f"batch-{step}", reduce="last")
                add_metric("probs", np.array([0.1, 0.2]) * (step + 1))
                await bus.publish(AfterStep(is_train=False, global_step=step, samples=n))
        assert agg.steps == 2 and agg.samples == 5
        result = await agg.compute_all_ranks()
        assert result["hits"] == 5 and result["tag"] == "batch-1"
        assert result["auc"] == pytest.approx((0.5 * 2 + 0.6 * 3) / 5)
        np.testing.assert_allclose(result["probs"], np.array([0.1, 0.2]) * (2 + 6) / 5)

        agg.reset()
        from recis_async import HookError

        with bus.subscribe(AfterStep, agg.update):
            await bus.publish(BeforeStep(global_step=0))
            add_metric("hits", 1, reduce="sum")
            await bus.publish(AfterStep(global_step=0))
            await bus.publish(BeforeStep(global_step=1))
            add_metric("hits", 1, reduce="max")
            with pytest.raises(
                HookError, match=r"reduce\['hits'\]: expected 'sum' as in the earlier"
            ):
                await bus.publish(AfterStep(global_step=1))


async def test_a_lambda_reduction_written_in_the_loop_is_one_reduction() -> None:
    agg = MetricAggregator()
    async with HookBus() as bus:
        with bus.subscribe(AfterStep, agg.update):
            for step in range(3):
                await bus.publish(BeforeStep(global_step=step))
                add_metric("x", step, reduce=lambda v: float(v.max() - v.min()))
                await bus.publish(AfterStep(global_step=step))
    assert agg.compute() == {"x": 2.0}


def test_a_value_that_is_not_a_number_is_named_once_a_pass_and_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agg = MetricAggregator()
    with caplog.at_level(logging.WARNING, logger="recis_async.aggregate"):
        for _ in range(2):  # two passes
            agg.reset()
            for step in range(3):
                agg.update(AfterStep(global_step=step, metrics={"loss": 1.0, "name": "x"}))
    assert agg.compute() == {"loss": 1.0}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("metric 'name' is a str" in w for w in warnings)


def test_bad_reductions_are_refused_at_the_call() -> None:
    with pytest.raises(ValueError, match=r"AfterStep\(reduce=...\): expected .*, got str 'avg'"):
        AfterStep(metrics={"x": 1.0}, reduce={"x": "avg"})  # the event is checked when built


async def test_add_metric_refuses_an_unknown_reduction() -> None:
    async with HookBus():
        with pytest.raises(
            ValueError,
            match=r"add_metric\('x', reduce=...\): expected one of 'mean', 'sum', 'max', 'min', "
            r"'last' or a callable, got 'avg'",
        ):
            add_metric("x", 1.0, reduce="avg")  # type: ignore[arg-type]


async def test_an_empty_evaluation_has_no_metrics() -> None:
    trainer = trainer_for(Model(), [])
    assert await trainer.evaluate() == {}


# ------------------------------------------------------------------ point 7: LoggerHook
async def test_logger_writes_one_eval_summary_and_restarts_eval_counters_per_evaluate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trainer = trainer_for(Scored(), uneven([4, 4, 4, 4]), log_steps=3)
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.logger"):
        first = await trainer.evaluate()
        await trainer.evaluate()
    lines = logged(caplog)
    step_lines = [line for line in lines if line["mode"] == "eval"]
    summaries = [line for line in lines if line["mode"] == "eval_summary"]
    # log_steps=3 with 4 eval steps a pass: each pass logs its 3rd step (lstep=2)
    assert [line["lstep"] for line in step_lines] == ["2", "2"]
    assert len(summaries) == 2
    assert summaries[0]["steps"] == "4" and summaries[0]["rows_sum"] == "16"
    assert float(summaries[0]["loss"]) == pytest.approx(first["loss"], rel=1e-5)


# ------------------------------------------------------------------ point 8: model outputs
class DictOut(Model):
    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        pred = self.linear(batch["x"]).squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, batch["y"])
        return {"loss": loss, "mae": (pred - batch["y"]).abs().mean(), "logits": pred}


class TupleOut(Model):
    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        pred = self.linear(batch["x"]).squeeze(-1)
        return torch.nn.functional.mse_loss(pred, batch["y"]), pred


async def test_a_dict_output_gives_the_loss_and_its_scalar_entries_as_metrics() -> None:
    model = DictOut()
    steps: list[AfterStep] = []
    trainer = trainer_for(model, batches(2, seed=3))
    async with HookBus() as bus:
        bus.subscribe(AfterStep, steps.append)
        trainer.bus = bus
        await trainer.train()
        metrics = await trainer.evaluate()
    train = [s for s in steps if s.is_train]
    assert len(train) == 2
    assert all(set(s.metrics) == {"loss", "mae"} for s in steps)  # logits are no metric
    assert set(metrics) == {"loss", "mae"} and metrics["mae"] > 0


async def test_a_tuple_output_gives_its_first_item_as_the_loss() -> None:
    model = TupleOut()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = trainer_for(model, batches(1, seed=3))
    await trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert math.isfinite((await trainer.evaluate())["loss"])


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (
            {"logits": torch.zeros(4)},
            r"model\(batch\): expected the scalar loss tensor, a dict with 'loss' or a tuple whose "
            r"first item is the loss, got a dict without 'loss' \(keys: \['logits'\]\)",
        ),
        ((), r"got an empty tuple"),
        (
            (torch.zeros(4), 1),
            r"model\(batch\)\[0\]: expected the scalar loss tensor, got a "
            r"tensor of shape \(4,\)",
        ),
        ({"loss": "high"}, r"model\(batch\)\['loss'\]: expected the scalar loss tensor, got str"),
        (3.0, r"a tuple whose first item is the loss, got float"),
    ],
)
async def test_an_output_with_no_loss_is_named(output: Any, message: str) -> None:
    class Bad(Model):
        def forward(self, batch: dict[str, torch.Tensor]) -> Any:
            return output

    with pytest.raises(TypeError, match=message):
        await trainer_for(Bad(), batches(1)).train()


# ------------------------------------------------------------------ point 9: lstep
async def test_logger_counts_lstep_when_the_loop_does_not_pass_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="recis_async.hooks.logger"):
        async with HookBus() as bus:
            bus.add_hook(LoggerHook(log_step=2))
            for step in range(6):  # an own loop that passes global_step only
                await bus.publish(BeforeStep(global_step=step))
                await bus.publish(AfterStep(global_step=step, samples=4))
            for step in range(4):  # it numbers eval steps itself from 0
                await bus.publish(BeforeStep(is_train=False, global_step=6, local_step=step))
                await bus.publish(AfterStep(is_train=False, global_step=6, local_step=step))
    lines = logged(caplog)
    assert [(line["mode"], line["lstep"]) for line in lines] == [
        ("train", "1"),
        ("train", "3"),
        ("train", "5"),
        ("eval", "1"),
        ("eval", "3"),
    ]
