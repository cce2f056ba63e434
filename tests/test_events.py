from __future__ import annotations

import msgspec
import numpy as np
import pytest

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
    with pytest.raises(TypeError, match=r"BeforeStep.global_step: expected int, got str"):
        BeforeStep(global_step="3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"AfterStep.samples: expected int, got float"):
        AfterStep(samples=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"epoch: expected int, got bool"):
        BeforeStep(epoch=True)


def test_end_status_is_checked() -> None:
    with pytest.raises(
        ValueError,
        match=r"End.status: expected one of ok, failed, cancelled, preempted, got 'done'",
    ):
        End(status="done")  # type: ignore[arg-type]


def test_after_step_trace_holds_numpy() -> None:
    step = AfterStep(trace={"user_id": np.arange(4)})
    assert step.trace["user_id"].tolist() == [0, 1, 2, 3]
