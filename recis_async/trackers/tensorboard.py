"""TensorBoardTracker: event files readable by TensorBoard.

Scalars become scalar summaries, arrays histograms, both at the record's step and wall
time.  Params are written once as an HParams session (so TensorBoard's HParams dashboard
lists the run) and as a ``params`` text table; :meth:`finish` closes the session with the
run's status (and a ``status`` text summary with End.status).  Writing goes through
``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package (the
optional extra), imported when the tracker is built.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._checks import creatable_dir
from ..events import EndStatus
from .base import RunSpec, StepRecord, params_for_text

__all__ = ["TensorBoardTracker"]

logger = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^\w.\-]+")


def _import_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "TensorBoardTracker needs the tensorboard package: pip install recis_async[tensorboard]"
        ) from exc
    return SummaryWriter


def _hparams_summary(tag: str, data: Any) -> Any:
    """A Summary carrying HParams plugin data (built from protos: no TensorFlow needed)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import metadata

    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))])


class TensorBoardTracker:
    """Write TensorBoard event files.

    With ``subdir=True`` (the default) each run gets its own folder
    ``<log_dir>/<run_id or name>`` so TensorBoard shows runs side by side; with
    ``subdir=False`` events go straight into ``log_dir``.

    Args:
        log_dir: where the event files go.
        subdir: give each run a folder of its own under ``log_dir``.

    Raises:
        ImportError: tensorboard is not installed (the ``tensorboard`` extra).
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, subdir: bool = True) -> None:
        self._writer_cls = _import_writer()
        path = Path(creatable_dir("TensorBoardTracker", "log_dir", log_dir))
        self.log_dir = path
        self.subdir = subdir
        self.run_dir: Path | None = None
        self.run_id: str | None = None
        self._writer: Any = None
        self._continued = False  # the folder held events: the first log purges later steps
        self._logged = False
        self._session = False
        self._warned_empty: set[str] = set()

    def __repr__(self) -> str:
        return f"TensorBoardTracker(log_dir={str(self.log_dir)!r})"

    def start(self, run: RunSpec) -> None:
        run_dir = self.log_dir
        run_id = _UNSAFE.sub("_", run.run_id or run.name).strip("._") or "run"
        if self.subdir:
            run_dir = run_dir / run_id
        self._continued = run_dir.is_dir() and any(run_dir.glob("events.out.tfevents.*"))
        self._logged = False
        writer = self._writer_cls(log_dir=str(run_dir), flush_secs=30)
        if run.params:
            from tensorboard.plugins.hparams import metadata, plugin_data_pb2

            hparams = params_for_text(run.params)
            info = plugin_data_pb2.SessionStartInfo(
                group_name=run.project, start_time_secs=time.time()
            )
            for key, value in hparams.items():
                if isinstance(value, bool):
                    info.hparams[key].bool_value = value
                elif isinstance(value, float):
                    info.hparams[key].number_value = value
                else:
                    info.hparams[key].string_value = value
            writer._get_file_writer().add_summary(
                _hparams_summary(
                    metadata.SESSION_START_INFO_TAG,
                    plugin_data_pb2.HParamsPluginData(session_start_info=info),
                )
            )
            table = "| param | value |\n|---|---|\n" + "\n".join(
                f"| {k} | {v} |" for k, v in hparams.items()
            )
            writer.add_text("params", table, global_step=0)
            self._session = True
        writer.flush()
        self._writer, self.run_dir, self.run_id = writer, run_dir, run_id

    def log(self, records: Sequence[StepRecord]) -> None:
        writer = self._writer
        if writer is None:
            raise RuntimeError("TensorBoardTracker.log: the run is not started")
        if records and not self._logged and self._continued:
            self._purge_from(min(record.step for record in records))
        self._logged = True
        for record in records:
            for key, value in record.values.items():
                if isinstance(value, np.ndarray):
                    if value.size == 0:
                        if key not in self._warned_empty:
                            self._warned_empty.add(key)
                            logger.warning(
                                "TensorBoardTracker: %r is an empty array at step %d; "
                                "a histogram needs values; this and later empty ones are skipped",
                                key,
                                record.step,
                            )
                        continue
                    writer.add_histogram(key, value, global_step=record.step, walltime=record.time)
                else:
                    writer.add_scalar(
                        key, float(value), global_step=record.step, walltime=record.time
                    )
        writer.flush()

    def _purge_from(self, step: int) -> None:
        """A run that continues in a folder with events: TensorBoard's readers drop the
        earlier attempt's events of steps ``>= step`` (``SummaryWriter(purge_step=...)``'s
        restart marker), so each step shows once, as this attempt logs it."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        logger.info(
            "TensorBoardTracker: run %s continues at step %d; earlier events of steps >= %d "
            "are superseded",
            self.run_dir,
            step,
            step,
        )
        self._writer._get_file_writer().add_event(
            Event(step=step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START))
        )

    def discard(self) -> None:
        """Close the run just started; its event file is removed if nothing was logged."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        path = writer._get_file_writer().event_writer._file_name
        writer.close()
        if not self._logged:
            Path(path).unlink(missing_ok=True)

    def finish(self, status: EndStatus) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            if self._session:
                from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

                # HParams knows no "aborted": cancelled/preempted runs end as UNKNOWN; the
                # exact status is in the "status" text summary.
                code = {
                    "ok": api_pb2.STATUS_SUCCESS,
                    "failed": api_pb2.STATUS_FAILURE,
                }.get(status, api_pb2.STATUS_UNKNOWN)
                end = plugin_data_pb2.SessionEndInfo(status=code, end_time_secs=time.time())
                writer._get_file_writer().add_summary(
                    _hparams_summary(
                        metadata.SESSION_END_INFO_TAG,
                        plugin_data_pb2.HParamsPluginData(session_end_info=end),
                    )
                )
            writer.add_text("status", status)
        finally:
            writer.close()
