"""ProgressBarHook: tqdm output captured."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hooks_support import Reg, loop

from recis_async import Hook, HookBus, Trainer, TrainingArguments
from recis_async.hooks import (
    ProgressBarHook,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("either_bus")]


def bar_trainer(hooks: list[Hook], n: int = 5, **kwargs: Any) -> Trainer:
    model = Reg()
    return Trainer(
        model,
        TrainingArguments(**{"save_steps": None, **kwargs}),
        train_dataset=[{"x": torch.randn(4, 3), "y": torch.randn(4)} for _ in range(n)],
        hooks=hooks,
        dense_optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
    )


async def test_progress_bar_total_from_train_steps_with_eta_and_metrics() -> None:
    out = io.StringIO()
    bar = ProgressBarHook(file=out, mininterval=1e-9)
    await bar_trainer([bar], n=10, train_steps=4).train()
    assert bar.total == 4
    text = out.getvalue()
    frames = [f for f in text.replace("\n", "\r").split("\r") if f.strip()]
    assert frames[0].startswith("Training:   0%|") and "0/4" in frames[0]
    assert "4/4" in frames[-1] and "100%" in frames[-1]
    assert "loss=" in frames[-1]
    assert any("2/4 [" in f and "<" in f for f in frames)  # elapsed<remaining: the ETA


async def test_progress_bar_total_from_epochs_and_length() -> None:
    out = io.StringIO()
    bar = ProgressBarHook(file=out, metrics=["loss"])
    await bar_trainer([bar], n=3, train_epoch=2).train()
    assert bar.total == 6
    assert "6/6" in out.getvalue()


async def test_progress_bar_starts_at_the_restored_step(tmp_path: Path) -> None:
    out = io.StringIO()
    first = bar_trainer([], n=3, output_dir=str(tmp_path), save_steps=3)
    await first.train()
    bar = ProgressBarHook(file=out, mininterval=1e-9)
    # the first run read its one epoch to the end: the resumed run goes on with a second one
    resumed = bar_trainer(
        [bar], n=3, output_dir=str(tmp_path), save_steps=3, train_steps=5, train_epoch=2
    )
    await resumed.train(resume_from_checkpoint=True)
    frames = [f for f in out.getvalue().replace("\n", "\r").split("\r") if f.strip()]
    assert "3/5" in frames[0] and "5/5" in frames[-1]


async def test_progress_bar_given_total_is_kept_and_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    bar = ProgressBarHook(total=50, file=out)
    await bar_trainer([bar], n=2).train()
    assert bar.total == 50 and "2/50" in out.getvalue()

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    quiet = io.StringIO()
    async with HookBus() as bus:
        bus.add_hook(ProgressBarHook(file=quiet))
        assert bus.hooks == ()
        await loop(bus, [1.0])
    assert quiet.getvalue() == ""


def test_progress_bar_without_tqdm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'recis_async\[progress\]'"):
        ProgressBarHook()


def test_progress_bar_bad_input() -> None:
    with pytest.raises(
        ValueError, match=r"ProgressBarHook\(total=...\): expected a positive int, got 0"
    ):
        ProgressBarHook(total=0)
    with pytest.raises(TypeError, match=r"metrics=...\): expected a list of names, got 'loss'"):
        ProgressBarHook(metrics="loss")
    for bad in (3, [3], [""]):
        with pytest.raises(TypeError, match=r"metrics=...\): expected a list of names, got"):
            ProgressBarHook(metrics=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ProgressBarHook\(file=...\): expected a text stream"):
        ProgressBarHook(file=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ProgressBarHook\(leave=...\): expected a bool, got 'no'"):
        ProgressBarHook(leave="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ProgressBarHook\(desc=...\): expected a str, got 3"):
        ProgressBarHook(desc=3)  # type: ignore[arg-type]


def counting_postfix(hook: ProgressBarHook) -> list[dict[str, Any]]:
    """The postfixes ``hook``'s bar is given, in order."""
    given: list[dict[str, Any]] = []

    class Counted(hook._tqdm):  # type: ignore[misc, name-defined]
        def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kw: Any) -> None:
            given.append(dict(ordered_dict or {}))
            super().set_postfix(ordered_dict, refresh=refresh, **kw)

    hook._tqdm = Counted
    return given


async def test_number_postfix_is_formatted_only_when_the_bar_redraws() -> None:
    out = io.StringIO()
    bar = ProgressBarHook(total=200, file=out, mininterval=3600.0)  # no redraw in the loop
    given = counting_postfix(bar)
    losses = [0.5 + 0.001 * i for i in range(200)]
    async with HookBus() as bus:
        bus.add_hook(bar)
        await loop(bus, losses)
    # not once a step: once for the first redraw tqdm may make, and the last values at End
    assert 1 <= len(given) <= 3, given
    assert given[-1] == {"loss": losses[-1]}
    frames = [f for f in out.getvalue().replace("\n", "\r").split("\r") if f.strip()]
    assert "200/200" in frames[-1] and "loss=0.699" in frames[-1], frames[-1]


async def test_steps_reach_the_bar_at_its_redraws_and_every_one_by_the_end() -> None:
    out = io.StringIO()
    bar = ProgressBarHook(total=300, file=out, mininterval=3600.0)  # no redraw in the loop
    updates: list[int] = []

    class Counted(bar._tqdm):  # type: ignore[misc, name-defined]
        def update(self, n: float | None = 1) -> bool | None:
            updates.append(int(n or 0))
            return super().update(n)

    bar._tqdm = Counted
    async with HookBus() as bus:
        bus.add_hook(bar)
        await loop(bus, [0.5] * 300)
        # tqdm's update() is called near its redraws only, not once a step
        assert len(updates) <= 3, updates
    assert sum(updates) == 300  # the close tells the bar of the steps since
    frames = [f for f in out.getvalue().replace("\n", "\r").split("\r") if f.strip()]
    assert "300/300" in frames[-1] and "100%" in frames[-1], frames[-1]


async def test_each_redraw_shows_the_numbers_of_its_own_step() -> None:
    out = io.StringIO()
    bar = ProgressBarHook(total=20, file=out, mininterval=1e-9)  # a redraw every step
    losses = [float(i) for i in range(1, 21)]
    async with HookBus() as bus:
        bus.add_hook(bar)
        await loop(bus, losses)
    frames = [f for f in out.getvalue().replace("\n", "\r").split("\r") if "loss=" in f]
    assert frames, out.getvalue()
    for frame in frames:  # "k/20" is drawn after step k - 1, whose loss is k
        done = int(frame.split("/20")[0].split()[-1])
        assert f"loss={done}" in frame.replace(".0,", ",").replace(".0]", "]"), frame
