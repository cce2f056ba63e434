"""MlflowTracker: runs in an MLflow tracking store through ``MlflowClient``, in a child process.

MLflow's client is Python through and through; in a worker thread of the training process it
holds the GIL for each request, and the training thread, which takes the GIL back after every
torch op, waits for it (figures: benchmarks/README.md, "MLflow in a child process").
:class:`MlflowTracker` therefore runs :class:`MlflowClientTracker` (the client itself) in a
child process through :class:`~recis_async.trackers.SubprocessTracker`; the training process
only encodes each batch and writes it to a pipe.  ``MlflowClientTracker`` is the same tracker
in-process, for callers that cannot start a process.

``project`` is the experiment, ``name`` the run name.  ``run_id`` continues a run: an MLflow
run id, or a name of the user's own (``MLTrackerHook(id="my-job-1")``), kept in the run's
``recis_async.id`` tag, which finds the run again on a restart (created on first use).  A
continued run that logs again from step ``s`` keeps, for each metric, the points of steps
``>= s`` it already holds and skips the new ones (MLflow cannot delete a point): each step is
in the run once.  Scalars are
metrics sent with ``log_batch`` in requests of at most 1000 metrics and about 1 MB (MLflow's
own limits); arrays, which MLflow metrics cannot hold, go to a ``tracked/arrays.jsonl``
artifact uploaded when the run finishes.  Params are flattened (``a.b``) and sent 100 per
request; values longer than MLflow's 6000 characters are cut with a warning.

mlflow is an optional extra and is imported when the tracker is built.  The client is only
used from one thread, and no global mlflow state (active run, tracking URI) is touched, so
several trackers can coexist in one process.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import IO, Any
from urllib.parse import urlsplit

import msgspec
import numpy as np

from ..events import EndStatus
from .base import RunSpec, StepRecord, append_jsonl, chunked, encode_value
from .subprocess import SubprocessTracker

__all__ = ["MlflowTracker", "MlflowClientTracker", "STATUS_MAP"]

logger = logging.getLogger(__name__)

#: End.status -> MLflow run status.
STATUS_MAP: Mapping[str, str] = MappingProxyType(
    {"ok": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "preempted": "KILLED"}
)

MAX_METRICS_PER_REQUEST = 1000
MAX_REQUEST_BYTES = 1_000_000
MAX_PARAMS_PER_REQUEST = 100
MAX_PARAM_VALUE_CHARS = 6000
#: the tag holding a run id given by the user (MLflow makes its own run ids)
ID_TAG = "recis_async.id"
# JSON framing of one metric in a REST request besides its key: value, timestamp, step.
_METRIC_OVERHEAD_BYTES = 96


_MISSING = "MlflowTracker needs the mlflow package: pip install recis_async[mlflow]"


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    return mlflow


def _check_mlflow() -> None:
    """Fail here if mlflow is missing, without importing it (seconds of CPU the training
    process does not need: the child imports it)."""
    try:
        found = importlib.util.find_spec("mlflow") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImportError(_MISSING)


def metric_requests(metrics: Sequence[Any]) -> list[list[Any]]:
    """Split MLflow ``Metric`` entities into requests of <= 1000 metrics and <= ~1 MB."""
    requests: list[list[Any]] = []
    current: list[Any] = []
    size = 0
    for metric in metrics:
        nbytes = len(metric.key.encode()) + _METRIC_OVERHEAD_BYTES
        full = len(current) >= MAX_METRICS_PER_REQUEST or size + nbytes > MAX_REQUEST_BYTES
        if current and full:
            requests.append(current)
            current, size = [], 0
        current.append(metric)
        size += nbytes
    if current:
        requests.append(current)
    return requests


def stored_points(client: Any, run_id: str, keys: set[str], min_step: int) -> set[tuple[str, int]]:
    """``(key, step)`` of the run's points of ``keys`` at steps ``>= min_step``."""
    stored: set[tuple[str, int]] = set()
    for key in keys:
        for metric in client.get_metric_history(run_id, key):
            if metric.step >= min_step:
                stored.add((metric.key, int(metric.step)))
    return stored


class MlflowTracker(SubprocessTracker):
    """Log to MLflow from a child process.  ``tracking_uri`` may be ``sqlite:///path.db``
    (local, offline), an ``http(s)://`` server, or any URI mlflow accepts; ``None`` uses
    mlflow's default.  ``run_id`` is the run's id once started.

    The child is a fresh interpreter importing mlflow and this module only (see
    :class:`SubprocessTracker`).

    Args:
        tracking_uri: as above; ``None`` uses mlflow's default.
        artifact_location: where a new experiment keeps artifacts.
        tags: tags set on the run.

    Raises:
        ImportError: mlflow is not installed (the ``mlflow`` extra): here, not in the child.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        artifact_location: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        _check_mlflow()  # a missing extra fails here, not in the child
        super().__init__(
            functools.partial(
                MlflowClientTracker,
                tracking_uri,
                artifact_location=artifact_location,
                tags=dict(tags or {}),
            )
        )
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location

    def __repr__(self) -> str:
        # The URI may carry user:password for an http server; never show it.
        if self.run_id is None and self.requested_id is not None:
            return f"MlflowTracker(id={self.requested_id!r})"
        return f"MlflowTracker(run_id={self.run_id!r})"


class MlflowClientTracker:
    """:class:`MlflowTracker`'s work in the calling process (its worker thread holds the GIL
    while the client runs: see the module docs).

    Args:
        tracking_uri: as for :class:`MlflowTracker`.
        artifact_location: where a new experiment keeps artifacts.
        tags: tags set on the run.

    Raises:
        ImportError: mlflow is not installed (the ``mlflow`` extra).
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        artifact_location: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        self._mlflow = _import_mlflow()
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self._client: Any = None
        self._created = False
        self._logged = False
        self._continued = False
        # a continued run: the step its first batch starts at, and the steps the run holds
        # from there on, per metric (fetched once per metric; see _skip_stored)
        self._resumed_at: int | None = None
        self._stored: dict[str, set[int]] = {}
        self._warned_stored = False
        self._array_dir: str | None = None
        self._arrays: IO[bytes] | None = None
        self._encoder = msgspec.json.Encoder(enc_hook=encode_value)

    def __repr__(self) -> str:
        # The URI may carry user:password for an http server; never show it.
        return f"MlflowClientTracker(run_id={self.run_id!r})"

    def _scrubbed(self, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn``; errors are re-raised with the tracking URI's password masked (the
        clients quote request URLs in their messages)."""
        secret = urlsplit(self.tracking_uri or "").password
        if not secret:
            fn(*args)
            return
        try:
            fn(*args)
            return
        except Exception as exc:
            error = RuntimeError(
                f"MlflowTracker: {type(exc).__name__}: {exc}".replace(secret, "***")
            )
            for attr in ("in_doubt", "delivered"):  # how much landed: see Tracker.log
                if hasattr(exc, attr):
                    setattr(error, attr, getattr(exc, attr))
        # Raised outside the handler so the original is not even its __context__.
        raise error

    def start(self, run: RunSpec) -> None:
        self._scrubbed(self._start, run)

    def log(self, records: Sequence[StepRecord]) -> None:
        self._scrubbed(self._log, records)

    def finish(self, status: EndStatus) -> None:
        self._scrubbed(self._finish, status)

    def _start(self, run: RunSpec) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(tracking_uri=self.tracking_uri)
        existing = self._find_run(client, run) if run.run_id else None
        if existing is not None:
            run_id = existing.info.run_id
            client.update_run(run_id, status="RUNNING")
            old_params = dict(existing.data.params)
            logger.info("MlflowTracker: continuing run %s (%s)", run_id, run.run_id)
        else:
            experiment_id = self._experiment_id(client, run.project)
            tags = dict(self.tags)
            if run.run_id:
                tags[ID_TAG] = run.run_id
            created = client.create_run(experiment_id, run_name=run.name, tags=tags or None)
            run_id = created.info.run_id
            old_params = {}
            logger.info("MlflowTracker: new run %s (%s)", run_id, run.run_id or run.name)
        self._created, self._continued, self._logged = existing is None, existing is not None, False
        self._resumed_at, self._stored, self._warned_stored = None, {}, False
        params = []
        for key, value in run.params.items():
            text = str(value)
            if len(text) > MAX_PARAM_VALUE_CHARS:
                logger.warning(
                    "MlflowTracker: param %r is %d characters; MLflow keeps %d, the rest is cut",
                    key,
                    len(text),
                    MAX_PARAM_VALUE_CHARS,
                )
                text = text[:MAX_PARAM_VALUE_CHARS]
            if key in old_params:
                if old_params[key] != text:
                    logger.warning(
                        "MlflowTracker: resumed run %s already has param %r=%r; "
                        "MLflow params are immutable, keeping it (new value %r not logged)",
                        run_id,
                        key,
                        old_params[key],
                        text,
                    )
                continue
            params.append(Param(key, text))
        for part in chunked(params, MAX_PARAMS_PER_REQUEST):
            client.log_batch(run_id, params=list(part), synchronous=True)
        self._client, self.run_id = client, run_id

    def _find_run(self, client: Any, run: RunSpec) -> Any:
        """The run ``run.run_id`` names: an MLflow run id, else the run tagged with it in
        the project's experiment; ``None`` if there is none yet."""
        try:
            return client.get_run(run.run_id)
        except self._mlflow.exceptions.MlflowException:
            pass
        experiment = client.get_experiment_by_name(run.project)
        if experiment is None:
            return None
        value = str(run.run_id).replace("'", "\\'")
        found = client.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.`{ID_TAG}` = '{value}'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return found[0] if found else None

    def discard(self) -> None:
        self._scrubbed(self._discard)

    def _discard(self) -> None:
        """Drop the run just created if nothing was logged (a resumed job continues its
        checkpoint's run instead)."""
        if self._client is None or self.run_id is None:
            return
        if self._created and not self._logged:
            self._client.delete_run(self.run_id)
        else:
            self._client.set_terminated(self.run_id, status="KILLED")
        self._client, self.run_id = None, None

    def _experiment_id(self, client: Any, project: str) -> str:
        found = client.get_experiment_by_name(project)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(client.create_experiment(project, artifact_location=self.artifact_location))
        except self._mlflow.exceptions.MlflowException:
            # Another rank or process created it between our lookup and create.
            found = client.get_experiment_by_name(project)
            if found is None:
                raise
            return str(found.experiment_id)

    def _log(self, records: Sequence[StepRecord]) -> None:
        from mlflow.entities import Metric

        if self._client is None or self.run_id is None:
            raise RuntimeError("MlflowTracker.log: the run is not started")
        metrics: list[Any] = []
        arrays: list[StepRecord] = []
        for record in records:
            timestamp = int(record.time * 1000)
            array_values: dict[str, Any] = {}
            for key, value in record.values.items():
                if isinstance(value, np.ndarray):
                    array_values[key] = value
                else:
                    metrics.append(Metric(key, float(value), timestamp, record.step))
            if array_values:
                arrays.append(StepRecord(record.step, record.time, array_values))
        if metrics and self._continued:
            metrics = self._skip_stored(metrics, min(record.step for record in records))
        self._logged = True
        for sent, request in enumerate(metric_requests(metrics)):
            try:
                self._client.log_batch(self.run_id, metrics=request, synchronous=True)
            except Exception as exc:
                if sent:  # earlier requests of these records are stored: a replay settles them
                    exc.in_doubt = True  # type: ignore[attr-defined]
                raise
        if arrays:
            self._spool_arrays(arrays)

    def _skip_stored(self, metrics: list[Any], first_step: int) -> list[Any]:
        """A continued run's batch: leave out points of steps the run already holds (an
        earlier attempt logged them from the first batch's ``first_step`` on).  Every batch
        is checked, not only the first: the steps the earlier attempt logged after the
        restart point may arrive in several batches (a small buffer, a flush per record).
        What the run holds is read once per metric."""
        assert self._client is not None and self.run_id is not None
        if self._resumed_at is None:
            self._resumed_at = first_step
        stored = self._stored
        new = {m.key for m in metrics if m.key not in stored}
        if new:  # (kept only once read: a failed read is tried again with the next batch)
            points = stored_points(self._client, self.run_id, new, self._resumed_at)
            for key in new:
                stored[key] = set()
            for key, step in points:
                stored[key].add(step)
        kept = [m for m in metrics if m.step not in stored[m.key]]
        if len(kept) != len(metrics):
            # warned once: sent a record at a time, every re-run step would warn again
            log = logger.debug if self._warned_stored else logger.warning
            self._warned_stored = True
            log(
                "MlflowTracker: run %s already holds %d of these points (steps >= %d from an "
                "earlier attempt); MLflow cannot delete points, so those are kept and the new "
                "ones skipped (and so for the rest of the re-run steps)",
                self.run_id,
                len(metrics) - len(kept),
                first_step,
            )
        return kept

    def _spool_arrays(self, records: list[StepRecord]) -> None:
        if self._arrays is None:
            self._array_dir = tempfile.mkdtemp(prefix="recis_async_mlflow_")
            self._arrays = open(os.path.join(self._array_dir, "arrays.jsonl"), "ab")
        append_jsonl(self._arrays, self._encoder, records)

    def _finish(self, status: EndStatus) -> None:
        if self._client is None or self.run_id is None:
            return
        try:
            if self._arrays is not None and self._array_dir is not None:
                self._arrays.close()
                self._arrays = None
                self._client.log_artifact(
                    self.run_id, os.path.join(self._array_dir, "arrays.jsonl"), "tracked"
                )
                shutil.rmtree(self._array_dir, ignore_errors=True)
                self._array_dir = None
        finally:
            self._client.set_terminated(self.run_id, status=STATUS_MAP[status])
