"""``python -m recis_async.trackers.replay``: settle tracker spill files against the run's store.

A tracker spill file (``<name>.jsonl``: records the tracker never took; ``<name>.inflight.jsonl``:
records of a call cut at the close deadline, which may or may not have landed) sits beside a
``<name>.run.json`` naming the tracker and its run.  ``replay FILE`` reads what the run holds
already and logs only the records it lacks, so a file can be replayed any number of times and
no record is stored twice; then the file is removed.  An MLflow run still ``RUNNING`` (its
process was killed) is marked ``FAILED``.  Supported stores: MLflow and the JSONL tracker.

Exit status: 0 done; 1 with a one-line reason on stderr; 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from .base import StepRecord, encode_value
from .jsonl import _safe, read_records, write_whole

__all__ = ["main", "replay_file", "ReplayResult"]

PROG = "python -m recis_async.trackers.replay"
logger = logging.getLogger(__name__)


class ReplayResult(msgspec.Struct, frozen=True):
    """What a replay did: records in the file, already in the run, delivered now."""

    run_id: str
    records: int
    already: int
    delivered: int


def _meta_path(path: Path) -> Path:
    base = path.name
    for suffix in (".inflight.jsonl", ".jsonl"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return path.with_name(f"{base}.run.json")


def read_meta(path: Path) -> dict[str, Any]:
    """The run a spill file belongs to (its ``.run.json`` sidecar); ``{}`` if none."""
    meta = _meta_path(path)
    if not meta.exists():
        return {}
    decoded = msgspec.json.decode(meta.read_bytes())
    return decoded if isinstance(decoded, dict) else {}


def replay_file(
    path: str | os.PathLike[str],
    *,
    tracking_uri: str | None = None,
    root: str | os.PathLike[str] | None = None,
    run_id: str | None = None,
    remove: bool = True,
) -> ReplayResult:
    """Log the records of the spill file ``path`` that its run lacks; see the module docs.

    ``tracking_uri`` / ``root`` / ``run_id`` override the sidecar's (an MLflow URI with a
    password is never written there, so pass it here).  ``remove``: delete the file once
    settled.
    """
    file = Path(path)
    records = read_records(file)
    meta = read_meta(file)
    run = run_id or meta.get("run_id")
    if not run:
        raise ValueError(f"{PROG}: {file} names no run (no {_meta_path(file).name}); pass --run-id")
    kind = str(meta.get("tracker", ""))
    if tracking_uri is not None or "Mlflow" in kind:
        result = _replay_mlflow(records, tracking_uri or meta.get("tracking_uri"), run)
    elif root is not None or kind == "JsonlTracker":
        base = root or meta.get("root")
        if base is None:
            raise ValueError(f"{PROG}: {file}: the JSONL root is unknown; pass --root")
        project = str(meta.get("project", ""))
        result = _replay_jsonl(records, Path(base) / _safe(project) / _safe(run), run)
    else:
        raise ValueError(
            f"{PROG}: {file}: replaying into {kind or 'an unknown tracker'} is not supported "
            "(MLflow and JSONL are); read the records with recis_async.trackers.read_records"
        )
    if remove:
        file.unlink()
        meta_file = _meta_path(file)
        stem = meta_file.name[: -len(".run.json")]
        if not any(
            p.name.startswith(stem) and p.name.endswith(".jsonl") for p in file.parent.iterdir()
        ):
            meta_file.unlink(missing_ok=True)
    return result


def _replay_mlflow(records: Sequence[StepRecord], uri: Any, run_id: str) -> ReplayResult:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from .mlflow import metric_requests

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    keys = {k for r in records for k, v in r.values.items() if not isinstance(v, np.ndarray)}
    stored: set[tuple[str, int, int]] = set()
    for key in keys:
        for m in client.get_metric_history(run_id, key):
            stored.add((m.key, int(m.step), int(m.timestamp)))
    metrics: list[Any] = []
    already = delivered = 0
    arrays: list[StepRecord] = []
    for record in records:
        timestamp = int(record.time * 1000)
        missing = False
        array_values = {}
        for key, value in record.values.items():
            if isinstance(value, (list, np.ndarray)):
                array_values[key] = value
            elif (key, record.step, timestamp) not in stored:
                missing = True
                metrics.append(Metric(key, float(value), timestamp, record.step))
        if array_values:
            arrays.append(StepRecord(record.step, record.time, array_values))
        if missing:
            delivered += 1
        elif not array_values:
            already += 1
    for request in metric_requests(metrics):
        client.log_batch(run_id, metrics=request, synchronous=True)
    if arrays:
        _replay_arrays(client, run_id, arrays)
        delivered += len(arrays)
    if run.info.status == "RUNNING":
        client.set_terminated(run_id, status="FAILED")
        logger.warning("run %s was left RUNNING (its process died): marked FAILED", run_id)
    return ReplayResult(run_id=run_id, records=len(records), already=already, delivered=delivered)


def _replay_arrays(client: Any, run_id: str, arrays: list[StepRecord]) -> None:
    """Arrays go to a ``tracked/`` artifact as the tracker sends them; one named after the
    replay so an earlier artifact is never overwritten."""
    import tempfile

    encoder = msgspec.json.Encoder(enc_hook=encode_value)
    with tempfile.TemporaryDirectory(prefix="recis_async_replay_") as tmp:
        name = os.path.join(tmp, f"arrays-replayed-{os.getpid()}.jsonl")
        with open(name, "wb") as fh:
            fh.write(b"".join(encoder.encode(r) + b"\n" for r in arrays))
        client.log_artifact(run_id, name, "tracked")


def _replay_jsonl(records: Sequence[StepRecord], run_dir: Path, run_id: str) -> ReplayResult:
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{PROG}: no JSONL run folder {run_dir}")
    stored = {(r.step, r.time) for r in read_records(metrics)} if metrics.exists() else set()
    missing = [r for r in records if (r.step, r.time) not in stored]
    if missing:
        encoder = msgspec.json.Encoder(enc_hook=encode_value)
        data = b"".join(encoder.encode(r) + b"\n" for r in missing)
        fd = os.open(metrics, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            write_whole(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    return ReplayResult(
        run_id=run_id,
        records=len(records),
        already=len(records) - len(missing),
        delivered=len(missing),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Settle tracker spill files (*.jsonl, *.inflight.jsonl) against the run's "
        "store: log what the run lacks, skip what it has, then remove the file.",
    )
    parser.add_argument("files", nargs="+", type=Path, help="tracker spill files")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: the sidecar's)")
    parser.add_argument("--root", type=Path, help="JsonlTracker root (default: the sidecar's)")
    parser.add_argument("--run-id", help="the run to settle against (default: the sidecar's)")
    parser.add_argument("--keep", action="store_true", help="keep the files after settling")
    args = parser.parse_args(argv)
    for file in args.files:
        try:
            result = replay_file(
                file,
                tracking_uri=args.tracking_uri,
                root=args.root,
                run_id=args.run_id,
                remove=not args.keep,
            )
        except Exception as exc:
            print(f"{PROG}: {file}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print(
            f"{file}: {result.records} records for run {result.run_id}: "
            f"{result.already} already there, {result.delivered} delivered now"
            + ("" if args.keep else "; file removed")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
