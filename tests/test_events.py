from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec
import numpy as np
import pytest
import torch

from recis_async import events as ev
from recis_async.events import AfterStep, BeforeStep, End, Error, Event, method_name

ALL = list(ev.LIFECYCLE)


def test_every_event_is_frozen_and_has_is_train() -> None:
    for cls in ALL:
        assert issubclass(cls, Event)
        kwargs = {"exc_type": "ValueError", "message": "boom"} if cls is Error else {}
        instance = cls(**kwargs)
        assert instance.is_train in (True, False)
        with pytest.raises(AttributeError):
            instance.is_train = False  # type: ignore[misc]


def test_method_names_map_one_to_one() -> None:
    assert method_name(AfterStep) == "after_step"
    assert method_name(ev.OutOfData) == "out_of_data"
    assert method_name(ev.BeforeSaveCheckpoint) == "before_save_checkpoint"
    assert method_name(End) == "end"
    assert len({method_name(c) for c in ALL}) == len(ALL)


@pytest.mark.parametrize("proto", [msgspec.json, msgspec.msgpack])
def test_plain_events_round_trip(proto: object) -> None:
    samples = [
        BeforeStep(is_train=False, global_step=7, local_step=2, epoch=1),
        AfterStep(global_step=3, samples=512, metrics={"loss": 0.25}, tracked={"auc": [0.5, 0.6]}),
        End(status="preempted", global_step=10),
        Error(exc_type="RuntimeError", message="disk full"),
    ]
    for event in samples:
        data = proto.encode(event)  # type: ignore[attr-defined]
        assert proto.decode(data, type=type(event)) == event  # type: ignore[attr-defined]


def test_custom_events_subclass_event() -> None:
    class EvalProbe(Event, frozen=True, kw_only=True):
        auc: float = 0.0

    probe = EvalProbe(auc=0.7)
    assert method_name(EvalProbe) == "eval_probe"
    assert msgspec.json.decode(msgspec.json.encode(probe), type=EvalProbe) == probe


def test_step_fields_must_be_ints() -> None:
    with pytest.raises(
        TypeError, match=r"BeforeStep\(global_step=...\): expected int >= 0, got str '3'"
    ):
        BeforeStep(global_step="3")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"AfterStep\(samples=...\): expected int >= 0, got float 1.5"
    ):
        AfterStep(samples=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"epoch=...\): expected int >= 0, got bool True"):
        BeforeStep(epoch=True)


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (
            lambda: AfterStep(is_train="yes"),
            TypeError,
            r"AfterStep\(is_train=...\): expected bool, got str 'yes'",
        ),
        (
            lambda: AfterStep(metrics=[1, 2]),
            TypeError,
            r"AfterStep\(metrics=...\): expected a dict of str -> number.*, got list \[1, 2\]",
        ),
        (
            lambda: AfterStep(samples=-5),
            ValueError,
            r"AfterStep\(samples=...\): expected int >= 0, got -5",
        ),
        (
            lambda: AfterStep(global_step=-1),
            ValueError,
            r"AfterStep\(global_step=...\): expected int >= 0, got -1",
        ),
        (
            lambda: BeforeStep(local_step=-1),
            ValueError,
            r"BeforeStep\(local_step=...\): expected int >= 0, got -1",
        ),
        (
            lambda: ev.OutOfData(is_train=1),
            TypeError,
            r"OutOfData\(is_train=...\): expected bool, got int 1",
        ),
        (
            lambda: AfterStep(metrics={"loss": torch.zeros(2, dtype=torch.complex64)}),
            TypeError,
            r"AfterStep\(metrics=...\): expected .*, got torch.complex64 tensor \(layout "
            r"torch.strided, device cpu, shape \(2,\)\) for 'loss'",
        ),
        (
            lambda: AfterStep(metrics={1: 0.5}),
            TypeError,
            r"AfterStep\(metrics=...\): expected .*, got key 1 \(int\)",
        ),
        (lambda: AfterStep(metrics={"v": None}), TypeError, r"got NoneType None for 'v'"),
        (
            lambda: AfterStep(reduce={"x": "avg"}),
            ValueError,
            r"AfterStep\(reduce=...\): expected a dict of str -> 'mean', .* or a callable, "
            r"got str 'avg' for 'x'",
        ),
        (
            lambda: AfterStep(trace={"a": 3}),
            TypeError,
            r"AfterStep\(trace=...\): expected .*, got int 3 for 'a'",
        ),
        (
            lambda: AfterStep(tracked={"a": None}),
            TypeError,
            r"AfterStep\(tracked=...\): expected .*, got NoneType None for 'a'",
        ),
        (
            lambda: ev.AfterEval(steps=-1),
            ValueError,
            r"AfterEval\(steps=...\): expected int >= 0, got -1",
        ),
        (
            lambda: ev.AfterEval(metrics={"auc": {"a": 1}}),
            TypeError,
            r"AfterEval\(metrics=...\): expected .*, got dict \{'a': 1\} for 'auc'",
        ),
        (
            lambda: ev.BeforeEpoch(epoch="1"),
            TypeError,
            r"BeforeEpoch\(epoch=...\): expected int, got str '1'",
        ),
        (
            lambda: ev.BeforeWindow(window=-3),
            ValueError,
            r"BeforeWindow\(window=...\): expected int >= 0, got -3",
        ),
        (
            lambda: ev.BeforeSaveCheckpoint(path=3),
            TypeError,
            r"BeforeSaveCheckpoint\(path=...\): expected str, got int 3",
        ),
        (
            lambda: ev.AfterLoadCheckpoint(hook_states=[]),
            TypeError,
            r"AfterLoadCheckpoint\(hook_states=...\): expected dict, got list \[\]",
        ),
        (
            lambda: Error(exc_type=ValueError, message="x"),
            TypeError,
            r"Error\(exc_type=...\): expected str, got type",
        ),
        (
            lambda: End(global_step=-2),
            ValueError,
            r"End\(global_step=...\): expected int >= 0, got -2",
        ),
        (
            lambda: ev.Start(is_train=None),
            TypeError,
            r"Start\(is_train=...\): expected bool, got NoneType None",
        ),
    ],
)
def test_every_builtin_field_is_checked_when_built(
    build: Callable[[], Event], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        build()


def test_metric_values_may_be_plain_values() -> None:
    step = AfterStep(
        metrics={"n": 3, "flag": True, "xs": [0.1, 2], "v": np.zeros(2, np.float32), "tag": "a"},
        reduce={"tag": "last", "n": max},
    )
    assert step.metrics["xs"] == [0.1, 2] and step.reduce["n"] is max
    assert ev.AfterEval(metrics={"loss": math.nan}).metrics["loss"] != 0


def test_fields_of_custom_events_are_checked_by_msgspec() -> None:
    class Probe(Event, frozen=True, kw_only=True):
        count: int = 0
        rate: Annotated[float, msgspec.Meta(gt=0)] = 1.0
        tags: list[str] = msgspec.field(default_factory=list)
        status: Literal["up", "down"] = "up"

    class ProbeStep(AfterStep, frozen=True, kw_only=True):
        note: str = ""

    class ProbeBefore(BeforeStep, frozen=True, kw_only=True):
        shard: ev.NonNegativeInt = 0

    assert Probe(count=3, rate=0.5, tags=["a"]).count == 3
    with pytest.raises(TypeError, match=r"Probe\(count=...\): expected int, got str 'x'"):
        Probe(count="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Probe\(rate=...\): expected float > 0.0, got -1"):
        Probe(rate=-1)
    with pytest.raises(
        TypeError, match=r"Probe\(tags=...\): expected str, got int at \$.tags\[1\] in"
    ):
        Probe(tags=["a", 1])  # type: ignore[list-item]
    with pytest.raises(
        ValueError, match=r"Probe\(status=...\): expected one of 'up', 'down', got 'sideways'"
    ):
        Probe(status="sideways")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Probe\(is_train=...\): expected bool, got str 'no'"):
        Probe(is_train="no")  # type: ignore[arg-type]
    # subclasses of the step events: the inherited fields fast, their own through msgspec
    with pytest.raises(TypeError, match=r"ProbeStep\(note=...\): expected str, got int 5"):
        ProbeStep(note=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ProbeStep\(samples=...\): expected int >= 0, got -1"):
        ProbeStep(samples=-1)
    with pytest.raises(ValueError, match=r"ProbeBefore\(shard=...\): expected int >= 0, got -4"):
        ProbeBefore(shard=-4)
    assert ProbeBefore(shard=2, global_step=1).shard == 2


def test_end_status_is_checked() -> None:
    with pytest.raises(
        ValueError,
        match=r"End\(status=...\): expected one of 'ok', 'failed', 'cancelled', 'preempted', "
        r"got 'done'",
    ):
        End(status="done")  # type: ignore[arg-type]


def test_after_step_trace_holds_numpy() -> None:
    step = AfterStep(trace={"user_id": np.arange(4)})
    assert step.trace["user_id"].tolist() == [0, 1, 2, 3]
