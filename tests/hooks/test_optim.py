"""ClipGradNormHook, GradNormHook, LearningRateHook: what they do to the gradients, what they
report (log lines, tracker records read back), and that they read no tensor on the step."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from host_reads import HostReads
from toy import Model, batches

from recis_async import HookBus, Trainer, TrainingArguments
from recis_async.events import (
    AfterBackward,
    AfterOptimizerStep,
    AfterStep,
    BeforeOptimizerStep,
    BeforeStep,
)
from recis_async.hooks import ClipGradNormHook, GradNormHook, LearningRateHook, MLTrackerHook
from recis_async.nn import HashTable
from recis_async.trackers import JsonlTracker, read_records

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]

ACCUMULATE = 2
STEPS = 8


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 6, generator=gen) * 3, torch.randn(4, 1, generator=gen)) for _ in range(n)
    ]


def _loss(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(net(x), y) / ACCUMULATE


def _reference(max_norm: float) -> tuple[list[list[torch.Tensor]], list[float]]:
    """The loop done by hand: clip_grad_norm_ once per optimizer step, after unscale_."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    grads, norms = [], []
    for g, batch in enumerate(_data(STEPS)):
        scaler.scale(_loss(net, batch)).backward()
        if (g + 1) % ACCUMULATE:
            continue
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)))
        grads.append([p.grad.clone() for p in net.parameters()])
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return grads, norms


async def test_clip_equals_clip_grad_norm_once_after_unscaling_and_reports_the_norm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under gradient accumulation and a GradScaler: the clipped gradients equal
    clip_grad_norm_ applied once per optimizer step after unscale_; the reported norms are
    the pre-clip ones (mean and max per window), read back from the log and the tracker."""
    caplog.set_level(logging.INFO)
    max_norm = 0.5
    expected_grads, expected_norms = _reference(max_norm)
    assert all(n > max_norm for n in expected_norms)  # every step is clipped

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    hook = ClipGradNormHook(list(net.parameters()), None, max_norm, log_steps=4)
    tracker = JsonlTracker(tmp_path)
    seen: list[list[torch.Tensor]] = []
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("p", "clip", {}, tracker=tracker))
        bus.add_hook(hook)
        for g, batch in enumerate(_data(STEPS)):
            scaler.scale(_loss(net, batch)).backward()
            sync = (g + 1) % ACCUMULATE == 0
            await bus.publish(AfterBackward(global_step=g, sync=sync))
            if sync:
                scaler.unscale_(opt)
                event = dict(global_step=g, optimizers=(opt,), scaler=scaler)
                await bus.publish(BeforeOptimizerStep(**event))
                seen.append([p.grad.clone() for p in net.parameters()])
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                await bus.publish(AfterOptimizerStep(**event))
            await bus.publish(AfterStep(global_step=g, samples=4))

    assert len(seen) == len(expected_grads) == STEPS // ACCUMULATE
    for got, want in zip(seen, expected_grads, strict=True):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    windows = [expected_norms[:2], expected_norms[2:]]  # steps 0-3 and 4-7: 2 updates each
    assert tracker.run_dir is not None
    records = read_records(tracker.run_dir / "metrics.jsonl")
    assert [r.step for r in records] == [3, 7]
    for record, norms in zip(records, windows, strict=True):
        assert record.values["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-6)
        assert record.values["grad_norm_max"] == pytest.approx(max(norms), rel=1e-6)
        assert record.values["grad_norm_clipped"] == 2.0
        assert record.values["grad_norm_nonfinite"] == 0.0
    lines = [r.getMessage() for r in caplog.records if r.name == "recis_async.hooks.optim"]
    assert len(lines) == 2 and lines[1].startswith("ClipGradNormHook <gstep=7> <grad_norm=")
    assert f"<grad_norm_max={max(windows[1]):.6g}>" in lines[1]


async def test_clipping_on_after_backward_is_what_this_hook_avoids() -> None:
    """The RecIS bug the hook fixes, shown: clipping before unscale_ sees a norm scaled by the
    GradScaler's factor (65536), so its gradients differ from the reference."""
    _, expected_norms = _reference(0.5)
    net = _net()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(net, _data(1)[0])).backward()
    scaler.scale(_loss(net, _data(2)[1])).backward()
    scaled = float(torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf))
    assert scaled == pytest.approx(expected_norms[0] * scaler.get_scale(), rel=1e-4)


async def test_no_host_read_on_any_step() -> None:
    """Every step, boundaries included: the hooks' values stay on the device; the window is
    read in a worker thread.  error_if_nonfinite=True is the documented exception."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    reads = HostReads()
    hooks = [
        ClipGradNormHook(net, None, 0.5, clip_value=0.1, log_steps=2, per_layer=True),
        GradNormHook(net, log_steps=3, per_layer=True, prefix="mon/"),
        LearningRateHook(opt, log_steps=2, momentum=True, weight_decay=True),
    ]
    async with HookBus() as bus:
        for hook in hooks:
            bus.add_hook(hook)
        for g, batch in enumerate(_data(6)):
            _loss(net, batch).backward()
            with reads:
                reads.where = g
                await bus.publish(BeforeStep(global_step=g))
                await bus.publish(AfterBackward(global_step=g))
                await bus.publish(BeforeOptimizerStep(global_step=g, optimizers=(opt,)))
            opt.step()
            opt.zero_grad()
            with reads:
                await bus.publish(AfterStep(global_step=g, samples=4))
    assert reads.reads == []
    assert [h.last_values[0] for h in hooks if h.last_values] == [5, 5, 5]

    strict = ClipGradNormHook(net, max_norm=1.0, error_if_nonfinite=True)
    async with HookBus() as bus:
        bus.add_hook(strict)
        _loss(net, _data(1)[0]).backward()
        with reads:
            reads.where = "strict"
            await bus.publish(BeforeOptimizerStep(global_step=0, optimizers=(opt,)))
    assert [r.name for r in reads.at("strict")] == ["__bool__"]


async def test_grad_norm_per_layer_and_sparse_gradients(tmp_path: Path) -> None:
    """GradNormHook's total and per-parameter norms equal torch's; a sparse (embedding-table)
    gradient counts in the total norm by its values, and is clipped like a dense one."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    lin = torch.nn.Linear(3, 1)
    ids = torch.tensor([1, 1, 4])
    loss = lin(emb(ids)).pow(2).sum() * 10
    loss.backward()
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse
    dense_grad = emb.weight.grad.to_dense()
    w_norm = float(lin.weight.grad.norm())
    expect_total = torch.linalg.vector_norm(
        torch.stack([dense_grad.norm(), lin.weight.grad.norm(), lin.bias.grad.norm()])
    )
    mon = GradNormHook(
        {"emb": emb.weight, "w": lin.weight, "b": lin.bias}, per_layer=True, log_steps=1
    )
    clip = ClipGradNormHook(lin, {"emb": emb.weight}, max_norm=1.0, log_steps=1, prefix="c/")
    tracker = JsonlTracker(tmp_path)
    async with HookBus() as bus:
        bus.add_hook(MLTrackerHook("p", "norms", {}, tracker=tracker))
        bus.add_hook(mon)
        bus.add_hook(clip)
        await bus.publish(BeforeOptimizerStep(global_step=0))
        await bus.publish(AfterStep(global_step=0))
    assert tracker.run_dir is not None
    records = read_records(tracker.run_dir / "metrics.jsonl")
    assert [r.step for r in records] == [0, 0]  # one record per hook
    v = {**records[0].values, **records[1].values}
    assert v["grad_norm"] == pytest.approx(float(expect_total), rel=1e-6)
    assert v["grad_norm/emb"] == pytest.approx(float(dense_grad.norm()), rel=1e-6)
    assert v["grad_norm/w"] == pytest.approx(w_norm, rel=1e-6)
    assert v["c/grad_norm"] == pytest.approx(float(expect_total), rel=1e-6)
    assert v["c/grad_norm_clipped"] == 1.0
    total_after = torch.linalg.vector_norm(
        torch.stack(
            [emb.weight.grad.to_dense().norm(), lin.weight.grad.norm(), lin.bias.grad.norm()]
        )
    )
    assert float(total_after) == pytest.approx(1.0, rel=1e-4)


async def test_learning_rate_hook_with_the_trainer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Trainer's optimizer, learned from BeforeOptimizerStep; values after the scheduler
    stepped, per param group; momentum (SGD's, Adam's beta1) and weight decay on request."""
    caplog.set_level(logging.INFO)
    model = Model()
    opt = torch.optim.SGD(
        [
            {"params": [model.linear.weight], "lr": 0.1},
            {"params": [model.linear.bias], "lr": 0.01, "weight_decay": 0.5},
        ],
        momentum=0.9,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    tracker = JsonlTracker(tmp_path / "runs")
    hook = LearningRateHook(log_steps=2, momentum=True, weight_decay=True)
    trainer = Trainer(
        model,
        TrainingArguments(output_dir=str(tmp_path / "out"), save_steps=None, log_steps=100),
        train_dataset=batches(4),
        hooks=[MLTrackerHook("p", "lr", {}, tracker=tracker), hook],
        dense_optimizers=(opt, sched),
    )
    await trainer.train()
    assert tracker.run_dir is not None
    records = read_records(tracker.run_dir / "metrics.jsonl")
    by_step = {r.step: r.values for r in records if "lr-SGD/pg0" in r.values}
    assert sorted(by_step) == [1, 3]
    assert by_step[1]["lr-SGD/pg0"] == pytest.approx(0.05)  # 2 scheduler steps: halved once
    assert by_step[3]["lr-SGD/pg0"] == pytest.approx(0.025)
    assert by_step[3]["lr-SGD/pg1"] == pytest.approx(0.0025)
    assert by_step[3]["momentum-SGD/pg0"] == 0.9
    assert by_step[3]["weight_decay-SGD/pg1"] == 0.5
    lines = [r.getMessage() for r in caplog.records if r.name == "recis_async.hooks.optim"]
    assert lines[-1].startswith("LearningRateHook <gstep=3> <lr-SGD/pg0=0.025>")

    adam = torch.optim.Adam(Model().parameters(), lr=torch.tensor(0.003), betas=(0.8, 0.99))
    both = LearningRateHook([adam, torch.optim.Adam(Model().parameters())], momentum=True)
    values = both.values()
    assert isinstance(values["lr-Adam"], torch.Tensor)  # read later, in the worker thread
    assert values["momentum-Adam"] == 0.8 and values["lr-Adam-1"] == 0.001


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: ClipGradNormHook(), ValueError, r"expected max_norm, clip_value or both"),
        (lambda: ClipGradNormHook(max_norm=0), ValueError, r"\(max_norm=...\): expected a pos"),
        (lambda: ClipGradNormHook(max_norm="1"), TypeError, r"\(max_norm=...\): expected a pos"),
        (lambda: ClipGradNormHook([3], max_norm=1), TypeError, r"\(dense_params=...\): expected"),
        (lambda: GradNormHook(norm_type=0), ValueError, r"GradNormHook\(norm_type=...\)"),
        (lambda: GradNormHook(log_steps=0), ValueError, r"GradNormHook\(log_steps=...\)"),
        (lambda: GradNormHook(per_layer=1), TypeError, r"GradNormHook\(per_layer=...\)"),
        (lambda: LearningRateHook(3), TypeError, r"LearningRateHook\(optimizers\[0\]=...\)"),
        (lambda: LearningRateHook(momentum="y"), TypeError, r"LearningRateHook\(momentum=...\)"),
    ],
)
def test_bad_arguments_are_refused(make: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make()


def test_reprs() -> None:
    net = _net()
    assert repr(ClipGradNormHook(net, max_norm=1.0)) == (
        "<ClipGradNormHook max_norm=1.0 clip_value=None norm_type=2.0 params=4 log_steps=100>"
    )
    assert repr(GradNormHook(per_layer=True)) == (
        "<GradNormHook norm_type=2.0 per_layer=True log_steps=100>"
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert repr(LearningRateHook(opt)) == "<LearningRateHook optimizers=[SGD] log_steps=100>"
    assert repr(LearningRateHook()) == "<LearningRateHook optimizers=[from events] log_steps=100>"


class Ctr(torch.nn.Module):
    """A hash table of ids (sparse gradients) feeding a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        init = lambda rows: torch.nn.init.normal_(rows, std=3.0)  # noqa: E731
        self.table = HashTable(4, name="ids", sparse=True, capacity=64, initializer=init)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pred = self.head(self.table(batch["ids"])).squeeze(-1)
        return torch.nn.functional.mse_loss(pred, batch["y"])


def _ctr_batches(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        {"ids": torch.randint(0, 20, (6,), generator=gen), "y": torch.randn(6, generator=gen)}
        for _ in range(n)
    ]


async def test_trainer_clips_the_hash_tables_sparse_gradients_once_per_update(
    tmp_path: Path,
) -> None:
    """With the Trainer's gradient accumulation, ClipGradNormHook(dense, sparse, max_norm)
    over a HashTable's sparse gradients gives the parameters of a hand-written loop calling
    clip_grad_norm_ once per update (on the densified gradients)."""
    reference = Ctr()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    norms = []
    for g, batch in enumerate(_ctr_batches(6)):
        (reference(batch) / 3).backward()
        if (g + 1) % 3:
            continue
        grad = reference.table.weight.grad
        reference.table.weight.grad = grad.to_dense()  # clip_grad_norm_ takes dense ones
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)))
        reference.table.weight.grad = reference.table.weight.grad.to_sparse()
        ref_opt.step()
        ref_opt.zero_grad()

    assert all(n > 1.0 for n in norms)  # every update is clipped

    model = Ctr()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = ClipGradNormHook(model.head, [model.table.weight], 1.0, log_steps=6)
    await Trainer(
        model,
        TrainingArguments(output_dir=str(tmp_path), save_steps=None, gradient_accumulation_steps=3),
        train_dataset=_ctr_batches(6),
        hooks=[hook],
        dense_optimizers=(opt, None),
    ).train()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)
    assert hook.last_values is not None and hook.last_values[0] == 5
    assert hook.last_values[1]["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-5)
    assert hook.last_values[1]["grad_norm_clipped"] == 2.0
