"""Trackers write what they are given, read back with each store's own reader."""

from __future__ import annotations

import math
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from recis_async.trackers import (
    JsonlTracker,
    MlflowClientTracker,
    MlflowTracker,
    RunSpec,
    StepRecord,
    TensorBoardTracker,
    check_metric_name,
    flatten_params,
    read_records,
)
from recis_async.trackers.mlflow import metric_requests

mlflow = pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2  # noqa: E402


def _records(n: int, start: int = 0) -> list[StepRecord]:
    t0 = time.time()
    return [
        StepRecord(step, t0 + step, {"loss": 1.0 / (step + 1), "acc": float(step % 7)})
        for step in range(start, start + n)
    ]


# ------------------------------------------------------------------------- names / params


def test_check_metric_name_accepts_and_refuses() -> None:
    assert check_metric_name("train/loss: a-b.c d") == "train/loss: a-b.c d"
    for bad, needle in [
        ("", "1..250"),
        ("a" * 251, "1..250"),
        ("loss!", "letters"),
        ("a//b", "normalised"),
        ("/abs", "normalised"),
        ("../x", "normalised"),
    ]:
        with pytest.raises(ValueError, match=needle):
            check_metric_name(bad, where="tracked key")
    with pytest.raises(TypeError, match="expected str, got int"):
        check_metric_name(3)


def test_flatten_params_nests_and_names_bad_keys() -> None:
    assert flatten_params({"opt": {"lr": 0.1, "betas": [0.9, 0.99]}, "bs": 32, "empty": {}}) == {
        "opt.lr": 0.1,
        "opt.betas": [0.9, 0.99],
        "bs": 32,
        "empty": {},
    }
    with pytest.raises(ValueError, match=r"config key.*'opt\.l\$r'"):
        flatten_params({"opt": {"l$r": 1}})
    with pytest.raises(TypeError, match="keys must be str, got int"):
        flatten_params({"opt": {1: 2}})


# ------------------------------------------------------------------------------- JSONL


def test_jsonl_roundtrip(tmp_path: Path) -> None:
    tracker = JsonlTracker(tmp_path)
    tracker.start(RunSpec(project="ctr", name="run 7", params={"lr": 0.1, "layers": [64, 32]}))
    records = _records(50)
    tracker.log(records[:20])
    tracker.log(records[20:] + [StepRecord(99, 1.0, {"emb": np.arange(3.0), "bad": math.nan})])
    tracker.finish("ok")

    assert tracker.run_dir is not None and tracker.run_dir.parent == tmp_path / "ctr"
    params = msgspec.json.decode((tracker.run_dir / "params.json").read_bytes())
    assert params == {"lr": 0.1, "layers": [64, 32]}
    info = msgspec.json.decode((tracker.run_dir / "run.json").read_bytes())
    assert (
        info["status"] == "ok"
        and info["name"] == "run 7"
        and info["end_time"] >= info["start_time"]
    )

    back = read_records(tracker.run_dir / "metrics.jsonl")
    assert [r.step for r in back] == list(range(50)) + [99]
    assert back[:50] == records
    assert back[50].values == {"emb": [0.0, 1.0, 2.0], "bad": None}  # JSON has no NaN


def test_jsonl_resume_appends(tmp_path: Path) -> None:
    first = JsonlTracker(tmp_path)
    first.start(RunSpec(project="p", name="n", run_id="abc", params={"a": 1}))
    first.log(_records(5))
    first.finish("preempted")
    second = JsonlTracker(tmp_path)
    second.start(RunSpec(project="p", name="n", run_id="abc", params={"a": 1}))
    second.log(_records(5, start=5))
    second.finish("failed")
    assert second.run_dir == first.run_dir
    assert second.run_dir is not None
    assert [r.step for r in read_records(second.run_dir / "metrics.jsonl")] == list(range(10))
    info = msgspec.json.decode((second.run_dir / "run.json").read_bytes())
    assert info["status"] == "failed"


def test_jsonl_root_is_checked_at_once_but_created_by_the_first_run(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b"
    tracker = JsonlTracker(root)
    assert not (tmp_path / "a").exists()
    tracker.start(RunSpec(project="p", name="n", params={}))
    tracker.finish("ok")
    assert tracker.run_dir is not None and tracker.run_dir.parent.parent == root


def test_jsonl_unwritable_root(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(
        ValueError, match=r"JsonlTracker\(root=...\): expected a writable directory"
    ):
        JsonlTracker(blocker / "runs")


# ------------------------------------------------------------------------------ MLflow


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")


def test_metric_requests_respect_mlflow_limits() -> None:
    from mlflow.entities import Metric

    many = [Metric(f"m{i % 3}", 1.0, 0, i) for i in range(2500)]
    assert [len(r) for r in metric_requests(many)] == [1000, 1000, 500]
    huge_key = [Metric("k" * 4000, 1.0, 0, i) for i in range(600)]  # ~4.1 kB each
    parts = metric_requests(huge_key)
    assert sum(len(p) for p in parts) == 600 and len(parts) == 3
    assert all(sum(len(m.key) + 96 for m in p) <= 1_000_000 for p in parts)
    assert metric_requests([]) == []


@pytest.mark.parametrize(
    ("status", "expected"),
    [("ok", "FINISHED"), ("failed", "FAILED"), ("cancelled", "KILLED"), ("preempted", "KILLED")],
)
def test_mlflow_run_status(mlflow_store: tuple[str, str], status: str, expected: str) -> None:
    uri, artifacts = mlflow_store
    # the client's logic, in-process (MlflowTracker runs this same class in a child process;
    # test_mlflow_metrics_params_arrays and the hook tests go through the child)
    tracker = MlflowClientTracker(uri, artifact_location=artifacts)
    tracker.start(RunSpec(project="status", name=status))
    tracker.log(_records(3))
    tracker.finish(status)  # type: ignore[arg-type]
    assert tracker.run_id is not None
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.info.status == expected
    assert run.info.run_name == status


def test_mlflow_metrics_params_arrays(mlflow_store: tuple[str, str], tmp_path: Path) -> None:
    uri, artifacts = mlflow_store
    tracker = MlflowTracker(uri, artifact_location=artifacts)
    params = flatten_params(
        {"opt": {"lr": 0.01}, "bs": 512, "note": "x" * 7000, **{f"p{i}": i for i in range(150)}}
    )
    tracker.start(RunSpec(project="ctr", name="metrics", params=params))
    records = _records(1200)
    wide = StepRecord(5000, time.time(), {f"w{i}": float(i) for i in range(2500)})
    tracker.log(records[:700])
    tracker.log(records[700:] + [wide, StepRecord(5001, 2.0, {"emb": np.array([1.0, 2.5])})])
    tracker.finish("ok")
    assert tracker.run_id is not None

    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["opt.lr"] == "0.01" and run.data.params["bs"] == "512"
    assert len(run.data.params["note"]) == 6000
    assert len(run.data.params) == 153
    loss = client.get_metric_history(tracker.run_id, "loss")
    assert sorted(m.step for m in loss) == list(range(1200))
    assert {m.step: m.value for m in loss}[3] == pytest.approx(0.25)
    assert {m.step: m.timestamp for m in loss}[3] == int(records[3].time * 1000)
    assert len(client.get_metric_history(tracker.run_id, "acc")) == 1200
    assert client.get_metric_history(tracker.run_id, "w2499")[0].value == 2499.0
    assert "emb" not in run.data.metrics
    local = client.download_artifacts(tracker.run_id, "tracked/arrays.jsonl", str(tmp_path))
    arrays = read_records(local)
    assert arrays == [StepRecord(5001, 2.0, {"emb": [1.0, 2.5]})]


def test_mlflow_resume_run(mlflow_store: tuple[str, str]) -> None:
    uri, artifacts = mlflow_store
    first = MlflowClientTracker(uri, artifact_location=artifacts)
    first.start(RunSpec(project="resume", name="r", params={"lr": 0.1}))
    first.log(_records(10))
    first.finish("preempted")
    assert first.run_id is not None
    second = MlflowClientTracker(uri)
    second.start(
        RunSpec(project="resume", name="r", run_id=first.run_id, params={"lr": 0.2, "extra": 1})
    )
    second.log(_records(10, start=10))
    second.finish("ok")
    client = MlflowClient(uri)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.1", "extra": "1"}  # MLflow params are immutable
    assert sorted(m.step for m in client.get_metric_history(first.run_id, "loss")) == list(
        range(20)
    )


def test_mlflow_credentials_stay_out_of_repr_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    tracker = MlflowTracker(f"http://user:s3cret@127.0.0.1:{port}")
    assert "s3cret" not in repr(tracker)
    with pytest.raises(RuntimeError) as info:
        tracker.start(RunSpec(project="p", name="n"))
    # mlflow's own message quotes the URL with the password; ours masks it and drops the chain
    assert "user:***@127.0.0.1" in str(info.value) and "s3cret" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__context__ is None


# ------------------------------------------------------------------------- TensorBoard


def _accumulator(path: Path) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(
        str(path),
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.HISTOGRAMS: 0,
            event_accumulator.TENSORS: 0,
        },
    )
    acc.Reload()
    return acc


def _session_status(acc: event_accumulator.EventAccumulator) -> int:
    content = acc.PluginTagToContent("hparams")["_hparams_/session_end_info"]
    return int(plugin_data_pb2.HParamsPluginData.FromString(content).session_end_info.status)


def test_tensorboard_scalars_histograms_hparams(tmp_path: Path) -> None:
    tracker = TensorBoardTracker(tmp_path)
    tracker.start(
        RunSpec(project="ctr", name="tb run", params={"lr": 0.1, "deep": True, "dims": [4, 2]})
    )
    records = _records(30)
    tracker.log(records)
    tracker.log([StepRecord(40, 3.0, {"emb": np.arange(100.0), "empty": np.zeros(0)})])
    tracker.finish("ok")
    assert tracker.run_dir == tmp_path / "tb_run"

    acc = _accumulator(tmp_path / "tb_run")
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == list(range(30))
    assert loss[3].value == pytest.approx(0.25) and loss[3].wall_time == pytest.approx(
        records[3].time
    )
    hist = acc.Histograms("emb")
    assert len(hist) == 1 and hist[0].step == 40
    assert hist[0].histogram_value.num == 100 and hist[0].histogram_value.max == 99.0
    assert "empty" not in acc.Tags()["histograms"]
    start = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info
    assert start.hparams["lr"].number_value == 0.1 and start.hparams["deep"].bool_value is True
    assert start.hparams["dims"].string_value == "[4, 2]"
    assert _session_status(acc) == api_pb2.STATUS_SUCCESS


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ("failed", api_pb2.STATUS_FAILURE),
        ("cancelled", api_pb2.STATUS_UNKNOWN),
        ("preempted", api_pb2.STATUS_UNKNOWN),
    ],
)
def test_tensorboard_status(tmp_path: Path, status: str, code: int) -> None:
    tracker = TensorBoardTracker(tmp_path, subdir=False)
    tracker.start(RunSpec(project="p", name="n", params={"a": 1}))
    tracker.finish(status)  # type: ignore[arg-type]
    acc = _accumulator(tmp_path)
    assert _session_status(acc) == code
    text = acc.Tensors("status/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text == status


def test_tensorboard_unwritable(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"TensorBoardTracker\(log_dir=...\): expected a writable"):
        TensorBoardTracker(blocker / "tb")


def test_missing_extras_name_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install recis_async\[mlflow\]"):
        MlflowTracker("sqlite:///x.db")
    monkeypatch.setitem(__import__("sys").modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install recis_async\[tensorboard\]"):
        TensorBoardTracker(tmp_path)
